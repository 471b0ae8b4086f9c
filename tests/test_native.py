"""The native CPU kernels (torchrec_cowclip/csrc, embedding/native.py) against the
functional core, and float16 / bfloat16 tables.

The grouping and the unweighted segment sums must equal torch's bit for bit (same order
of sums); the update, whose norms and sums run in another order than torch's reductions,
the functional core to 1e-6; the stochastic rounding the functional core's bit for bit.
"""

import io
import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from cowclip_testing import kjt_from_bags, random_kjt
from fused_update_cases import (
    BAD_UPDATE_INDICES,
    check_bad_indices_refused,
    check_column_shard_row_sums,
    check_rounding_matches_functional,
    check_update_matches_functional,
    fused,
    reference,
    segment_sums,
    ulp,
)
from tiny import HYPER, bag_config, mixed_tables
from torchrec import DataType, EmbeddingBagConfig

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection
from torchrec_cowclip.embedding import native, row_kernels, triton_ops
from torchrec_cowclip.embedding.row_gradients import group_rows
from torchrec_cowclip.embedding.row_kernels import (
    NativeCpuKernel,
    TorchKernel,
    TritonKernel,
    select_kernel,
)
from torchrec_cowclip.optim.functional import (
    adam_bias_corrections,
    stochastic_round,
)
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.rules import update_rule

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="no C++ compiler"
)

HALF = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _native(monkeypatch):
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "1")  # modules built here: native
    assert native.build().ok, native.build().error


def _eager_group(row_ids, bags, num_rows):
    """torch's stable sort and unique_consecutive: what the native grouping must equal."""
    return group_rows(row_ids, bags, num_rows)


@pytest.mark.parametrize("n,num_rows", [(0, 5), (1, 5), (7, 3), (5000, 70), (200_000, 3_000_000)])
def test_grouping_equals_the_stable_sort_bit_for_bit(n, num_rows):
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, num_rows, (n,), generator=gen)
    if n > 10:
        ids[::5] = ids[1]  # a hot row
    bags = torch.randperm(n, generator=gen)
    expected = _eager_group(ids, bags, num_rows)
    got = native.group_rows(ids, bags, num_rows)
    for name, a, b in zip(
        ("rows", "counts", "segment_offsets", "order", "sorted_bags"),
        (
            expected.rows,
            expected.counts,
            expected.segment_offsets,
            expected.order,
            expected.sorted_bags,
        ),
        got,
    ):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_grouping_table_by_table_equals_the_stable_sort_bit_for_bit():
    """Features of each table sorted on their own (two features share a table, a table
    of one row, an empty feature) give the global stable sort's result."""
    gen = torch.Generator().manual_seed(4)
    ranges = [(0, 50), (50, 1), (51, 4000), (0, 50), (4051, 30)]  # (first row, rows) per feature
    sizes = [300, 20, 5000, 250, 0]
    ids = torch.cat(
        [torch.randint(lo, lo + n, (k,), generator=gen) for (lo, n), k in zip(ranges, sizes)]
    )
    bags = torch.randperm(ids.numel(), generator=gen)
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    rows = torch.tensor(ranges)
    expected = _eager_group(ids, bags, 4081)
    got = native.group_rows(ids, bags, 4081, starts, rows)
    for a, b in zip(
        (
            expected.rows,
            expected.counts,
            expected.segment_offsets,
            expected.order,
            expected.sorted_bags,
        ),
        got,
    ):
        assert torch.equal(a, b)
    ids[3] = 60  # outside feature 0's rows
    with pytest.raises(RuntimeError, match="outside its feature's rows"):
        native.group_rows(ids, bags, 4081, starts, rows)


def _fused(weight, state, rows, counts, **overrides):
    return fused(native, weight, state, rows, counts, **overrides)


# --- the row update against the functional core ---------------------------------------------


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd", "adagrad", "adamw"])
@pytest.mark.parametrize("clip", [True, False], ids=["cowclip", "noclip"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dim", [6, 16, 1])
def test_fused_update_matches_the_functional_core(optimizer, clip, weighted, dim):
    check_update_matches_functional(native, optimizer, clip, weighted, dim)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd", "adagrad", "adamw"])
def test_fused_update_of_half_tables_matches_the_functional_core(optimizer, dtype):
    check_update_matches_functional(native, optimizer, True, True, 6, dtype=dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_half_tables_round_to_nearest_without_rounding_keys(dtype):
    """``stochastic_rounding=False``: the updated rows round to nearest, as ``.to(dtype)``."""
    check_update_matches_functional(native, "adam", True, True, 6, dtype=dtype, stochastic=False)


def test_unweighted_segment_sums_equal_embedding_bag_bit_for_bit():
    """SGD at lr 1 from zero weights writes ``-g_j``: the kernel's sums of a row's bag
    gradients are ATen's (FBGEMM's) segment sums, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 500, (4000,), generator=gen)
    bags = torch.randint(0, 300, (4000,), generator=gen)
    bag_grads = torch.randn(300, 16, generator=gen)
    g = _eager_group(positions, bags, 500)
    expected = F.embedding_bag(
        g.sorted_bags, bag_grads, g.segment_offsets, mode="sum", include_last_offset=True
    )
    w = torch.zeros(500, 16)
    _fused(
        w,
        [],
        g.rows,
        g.counts,
        bag_gradients=bag_grads,
        segment_offsets=g.segment_offsets,
        sorted_bags=g.sorted_bags,
        row_offsets=torch.tensor([0, 500]),
        optimizer="sgd",
        lr=1.0,
    )
    assert torch.equal(w[g.rows], -expected)


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd", "adagrad", "adamw"])
def test_column_shard_row_sums_match_the_functional_core(optimizer):
    """A column shard's update with the whole rows' sums (column-wise sharding)."""
    check_column_shard_row_sums(native, optimizer)


def test_bad_rows_are_refused_before_any_change():
    w = torch.zeros(10, 4)
    for rows in (torch.tensor([3, 2]), torch.tensor([1, 10]), torch.tensor([-1, 2])):
        with pytest.raises(RuntimeError, match="distinct, ascending and inside"):
            _fused(
                w,
                [],
                rows,
                torch.ones(2, dtype=torch.int64),
                grad=torch.ones(2, 4),
                row_offsets=torch.tensor([0, 10]),
                optimizer="sgd",
                lr=1.0,
            )
    assert not w.any()


@pytest.mark.parametrize(
    "overrides, message",
    BAD_UPDATE_INDICES,
    ids=lambda v: v if isinstance(v, str) else "-".join(v),
)
def test_bad_indices_of_the_update_are_refused_in_one_line_before_any_change(overrides, message):
    check_bad_indices_refused(native, overrides, message)


def test_bad_indices_of_the_grouping_and_the_lookup_are_refused():
    ids, bags = torch.tensor([1, 2, 40, 41]), torch.arange(4)
    starts = torch.tensor([0, 2, 4])
    native.group_rows(ids, bags, 60, starts, torch.tensor([[0, 10], [40, 20]]))  # fine
    for feature_rows in ([[0, 10], [40, 30]], [[-1, 10], [40, 20]], [[0, -2], [40, 20]]):
        with pytest.raises(RuntimeError, match=r"feature_rows must lie in \[0, num_rows = 60\)"):
            native.group_rows(ids, bags, 60, starts, torch.tensor(feature_rows))
    weight = torch.randn(6, 4).to(torch.bfloat16)
    native.pooled_lookup(weight, torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]), None, False)
    for offsets in ([1, 2, 3], [0, 2, 1, 3], [0, 1, 2]):
        with pytest.raises(RuntimeError, match="offsets must start at 0, ascend and end at the 3"):
            native.pooled_lookup(
                weight, torch.tensor([1, 2, 3]), torch.tensor(offsets), None, False
            )
    with pytest.raises(RuntimeError, match=r"id 6 outside \[0, 6\)"):
        native.pooled_lookup(weight, torch.tensor([1, 6, 3]), torch.tensor([0, 1, 3]), None, False)


def test_the_ops_have_fake_kernels_and_compile_in_one_graph():
    """Every op passes ``torch.library.opcheck`` (schema, fake kernel, autograd
    registration, AOT dispatch), and a function calling the update and the half lookup
    compiles into one graph (``fullgraph=True``) with the same result."""
    ops = torch.ops.torchrec_cowclip
    ids, bags = torch.tensor([3, 1, 3, 0, 5]), torch.tensor([0, 0, 1, 2, 2])
    weight, rows, counts = torch.randn(6, 4), torch.tensor([0, 1, 3, 5]), torch.tensor([1, 1, 2, 1])
    update = (weight, None, None, rows, counts, torch.randn(4, 4), None, None, None)
    update += (torch.tensor([0, 6]), None, None, None, None, None)
    update += (2, 0.1, 0.9, 0.99, 1e-8, 0.0, True, 1.0, 1e-3, 0.0, 1.0)
    samples = {
        ops.group_rows.default: (ids, bags, 6, None, None),
        ops.fused_update_.default: update,
        ops.pooled_lookup.default: (weight.half(), ids, torch.tensor([0, 2, 5]), None, False),
        ops.rounding_row_keys.default: (
            torch.tensor([1, 2]),
            torch.tensor([3, 4]),
            torch.tensor([5, 6]),
        ),
        ops.stochastic_round.default: (
            torch.randn(2, 3),
            torch.tensor([1, 2]),
            torch.tensor([0, 3]),
            torch.bfloat16,
        ),
    }
    for op, args in samples.items():
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, (op, results)

    def step(w, g):
        pooled = native.pooled_lookup(
            w.to(torch.bfloat16), ids, torch.tensor([0, 2, 5]), None, True
        )
        status, per_table = _fused(
            w,
            [],
            rows,
            counts,
            grad=g,
            clip=(1.0, 1e-3),
            row_offsets=torch.tensor([0, 6]),
            optimizer="sgd",
            lr=0.1,
        )
        return pooled, status, per_table

    g = torch.randn(4, 4)
    eager_w, compiled_w = weight.clone(), weight.clone()
    expected = step(eager_w, g)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_w, g)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert torch.equal(eager_w, compiled_w)


# --- the multi-chunk path (1,024-row chunks, several threads) ------------------------------

#: Rows of the three tables of the multi-chunk problem: thousands of distinct rows touched,
#: so the update runs over many 1,024-row chunks and the grouping over many 4,096-position
#: chunks, each chunk starting in its own table.
BIG_TABLES = (9_000, 13_000, 8_000)


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("dim", [16, 5])
def test_many_chunks_on_several_threads_match_the_functional_core(optimizer, dim):
    """The update over ~20 chunks of 1,024 rows on 1, 2 and 4 threads: each chunk finds its
    first row's table and counts per table atomically; the result is the functional core's
    (1e-6) and the same bit for bit on every thread count."""
    gen = torch.Generator().manual_seed(21)
    num_rows = sum(BIG_TABLES)
    row_offsets = torch.tensor([0, *torch.tensor(BIG_TABLES).cumsum(0).tolist()])
    weight = torch.randn(num_rows, dim, generator=gen) * 0.05
    weight[::97] *= 1e-4  # tiny rows in every chunk: the clip binds there
    state = []
    if optimizer == "adam":
        state = [
            torch.randn(num_rows, dim, generator=gen) * 1e-2,
            torch.rand(num_rows, dim, generator=gen) * 1e-3,
        ]
    elif optimizer == "rowwise_adagrad":
        state = [torch.rand(num_rows, generator=gen)]
    positions = torch.randint(0, num_rows, (60_000,), generator=gen)
    positions[:5000] = torch.randint(0, 50, (5000,), generator=gen)  # hot rows
    bag_grads = torch.randn(7_000, dim, generator=gen) * 0.01
    bags = torch.randint(0, 7_000, (60_000,), generator=gen)
    position_weights = torch.rand(60_000, generator=gen) + 0.5
    starts = torch.tensor([0, 60_000])
    grouping = _eager_group(positions, bags, num_rows)
    assert grouping.rows.numel() > 15 * 1024
    table_of_row = torch.bucketize(grouping.rows, row_offsets[1:], right=True)
    step = torch.tensor([2, 9, 4])
    betas, cowclip, clip_enabled = (
        (0.8, 0.99),
        CowClip(r=1.0, zeta=1e-4),
        torch.tensor([True, False, True]),
    )
    bias = adam_bias_corrections(step, *betas)
    kw = dict(lr=0.05, betas=betas, eps=1e-6, weight_decay=0.01, cowclip=cowclip)
    sorted_weights = position_weights[grouping.order]
    grad = segment_sums(grouping, bag_grads, sorted_weights)
    ref_w, ref_s, ref_clipped = reference(
        optimizer,
        weight,
        state,
        grouping.rows,
        grad,
        grouping.counts,
        None,
        clip_enabled=clip_enabled[table_of_row],
        adam_bias=(bias[0][table_of_row], bias[1][table_of_row]),
        **kw,
    )
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            got = native.group_rows(
                positions, bags, num_rows, starts, torch.tensor([[0, num_rows]])
            )
            for a, b in zip(
                (
                    grouping.rows,
                    grouping.counts,
                    grouping.segment_offsets,
                    grouping.order,
                    grouping.sorted_bags,
                ),
                got,
            ):
                assert torch.equal(a, b), n
            w, st = weight.clone(), [x.clone() for x in state]
            status, per_table = _fused(
                w,
                st,
                grouping.rows,
                grouping.counts,
                bag_gradients=bag_grads,
                segment_offsets=grouping.segment_offsets,
                sorted_bags=grouping.sorted_bags,
                sorted_weights=sorted_weights,
                row_offsets=row_offsets,
                clip_enabled=clip_enabled,
                adam_bias=bias if optimizer == "adam" else None,
                optimizer=optimizer,
                clip=(cowclip.r, cowclip.zeta),
                **{k: v for k, v in kw.items() if k != "cowclip"},
            )
            results.append((w, st, status, per_table))
    finally:
        torch.set_num_threads(threads)
    w, st, status, per_table = results[0]
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    for a, b in zip(st, ref_s):
        # Hot rows sum hundreds of weighted bag gradients, in another order than ATen's.
        torch.testing.assert_close(a, b, rtol=1e-6, atol=3e-8)
    assert torch.equal(status == native.CLIPPED, ref_clipped) and 0 < int(ref_clipped.sum())
    expected_counts = torch.stack(
        [
            torch.bincount(table_of_row, minlength=3),
            torch.bincount(table_of_row[ref_clipped], minlength=3),
            torch.zeros(3, dtype=torch.int64),
        ]
    )
    assert torch.equal(per_table, expected_counts)
    for other in results[1:]:  # every thread count: the same bits
        assert torch.equal(other[0], w) and torch.equal(other[2], status)
        assert all(torch.equal(a, b) for a, b in zip(other[1], st))
        assert torch.equal(other[3], per_table)


# --- stochastic rounding --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_equals_the_functional_core_bit_for_bit(dtype):
    check_rounding_matches_functional(native, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_unbiased(dtype):
    """Values between two representable neighbours round up as often as their distance
    says: the mean of many roundings is the value (round-to-nearest would lose it)."""
    x = torch.full((1, 20000), 1.0 + 2.0 ** (-10 if dtype == torch.bfloat16 else -13))
    rounded = stochastic_round(x, dtype, torch.tensor([99]), torch.tensor([0])).float()
    assert set(rounded.unique().tolist()) == {
        1.0,
        1.0 + 2.0 ** (-7 if dtype == torch.bfloat16 else -10),
    }
    torch.testing.assert_close(rounded.mean(), x.mean(), rtol=2e-4, atol=0)
    assert x.to(dtype).float().mean() == 1.0  # nearest rounding drops the increment


# --- half tables in the collection ----------------------------------------------------------


def _half_tables(data_type):
    """The collection tests' tables (a shared table, MEAN pooling, mixed dims, an
    unclipped dim-1 table) stored in ``data_type``."""
    return [replace(t, data_type=data_type) for t in mixed_tables()]


def _half_module(tables, optimizer, weights, mode, monkeypatch):
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", mode)  # the kernel is chosen here
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables],
        options=CowClipOptions(
            optimizer=optimizer,
            cowclip=CowClip(r=1.0, zeta=1e-3),
            unclipped_tables=("linear",),
            **HYPER,
        ),
    )
    with torch.no_grad():
        for name, w in weights.items():
            ebc.embedding_bags[name].weight.copy_(w)
    return ebc


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
def test_half_tables_native_and_eager_paths_agree_and_track_float32(dtype, optimizer, monkeypatch):
    """Half tables keep their type, pool in float32, keep float32 optimizer state; the
    native, the Triton (under its interpreter, where it can run) and the eager update
    round alike (same keys), and all stay within a few half ulps of the float32 module."""
    data_type = DataType.FP16 if dtype == torch.float16 else DataType.BF16
    tables = _half_tables(data_type)
    gen = torch.Generator().manual_seed(11)
    weights = {
        t.name: (torch.randn(t.num_embeddings, t.embedding_dim, generator=gen) * 0.3)
        .to(dtype)
        .float()
        for t in tables
    }
    modules = {
        "native": _half_module(tables, optimizer, weights, "1", monkeypatch),
        "eager": _half_module(tables, optimizer, weights, "0", monkeypatch),
        "fp32": _half_module(
            [replace(t, data_type=DataType.FP32) for t in tables],
            optimizer,
            weights,
            "0",
            monkeypatch,
        ),
    }
    if triton_ops.availability(torch.device("cpu")) is None:
        modules["triton"] = _half_module(tables, optimizer, weights, "triton", monkeypatch)
        assert isinstance(modules["triton"].row_kernel, TritonKernel)
    assert isinstance(modules["native"].row_kernel, NativeCpuKernel)
    assert isinstance(modules["eager"].row_kernel, TorchKernel)
    for _ in range(3):
        kjt = random_kjt(tables, batch_size=6, generator=gen)
        upstream = None
        for ebc in modules.values():
            out = ebc(kjt).values()
            assert out.dtype == torch.float32
            if upstream is None:
                upstream = torch.randn(out.shape, generator=gen)
            (out * upstream).sum().backward()
    states = {m: e.state_dict() for m, e in modules.items()}
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    for t in tables:
        key = f"embedding_bags.{t.name}.weight"
        assert states["native"][key].dtype == dtype
        # Same float32 step up to the last bits, same rounding keys: equal but for a rare
        # flip of one rounding decision (one ulp).
        for other in [name for name in ("eager", "triton") if name in modules]:
            diff = (states["native"][key].float() - states[other][key].float()).abs()
            assert (diff > 0).float().mean() < 0.02, other
            torch.testing.assert_close(
                states["native"][key].float(), states[other][key].float(), rtol=ulp, atol=1e-6
            )
        torch.testing.assert_close(
            states["native"][key].float(), states["fp32"][key], rtol=4 * ulp, atol=4 * ulp * 0.3
        )
    opt_state = modules["native"].fused_optimizer.state_dict()["state"]
    for entries in opt_state.values():
        for name, value in entries.items():
            if name != "step":
                assert value.dtype == torch.float32


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16])
def test_half_tables_state_dict_round_trip_and_torchrec_layout(data_type):
    import torchrec

    tables = _half_tables(data_type)
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables], options=CowClipOptions(optimizer="adam", lr=0.01)
    )
    kjt = random_kjt(tables, batch_size=4, generator=torch.Generator().manual_seed(1))
    ebc(kjt).values().sum().backward()
    stock = torchrec.EmbeddingBagCollection(tables=[replace(t) for t in tables])
    ours_state, stock_state = ebc.state_dict(), stock.state_dict()
    assert {k: v.shape for k, v in ours_state.items()} == {
        k: v.shape for k, v in stock_state.items()
    }
    dtype = torch.float16 if data_type == DataType.FP16 else torch.bfloat16
    # (TorchRec's unsharded EBC stores both half types as float16; FBGEMM's TBE and this
    # collection store BF16 as bfloat16.)
    assert {v.dtype for v in ours_state.values()} == {dtype}
    stock.load_state_dict(ours_state)  # weights move both ways
    ebc.load_state_dict(stock.state_dict())
    buffer = io.BytesIO()
    torch.save({"model": ours_state, "optim": ebc.fused_optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    copy = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables], options=CowClipOptions(optimizer="adam", lr=0.01)
    )
    copy.load_state_dict(saved["model"])
    copy.fused_optimizer.load_state_dict(saved["optim"])
    for k, v in ours_state.items():
        assert torch.equal(copy.state_dict()[k], v)
    # The next step is the same on both (same rounding keys: table, step, row, column).
    kjt2 = random_kjt(tables, batch_size=4, generator=torch.Generator().manual_seed(2))
    for module in (ebc, copy):
        module(kjt2).values().sum().backward()
    for k, v in ebc.state_dict().items():
        assert torch.equal(copy.state_dict()[k], v)
    assert (
        ebc.table_storage_bytes()
        < CowClipEmbeddingBagCollection(
            [replace(t, data_type=DataType.FP32) for t in tables],
            options=CowClipOptions(optimizer="adam"),
        ).table_storage_bytes()
    )


def test_unsupported_data_types_are_refused_naming_the_table():
    tables = [
        EmbeddingBagConfig(
            name="q",
            embedding_dim=4,
            num_embeddings=5,
            feature_names=["f"],
            data_type=DataType.INT8,
        )
    ]
    with pytest.raises(ValueError, match="table 'q': data_type must be FP32, FP16 or BF16"):
        CowClipEmbeddingBagCollection(tables)


# --- the switch ---------------------------------------------------------------------------


def test_the_kernel_is_chosen_once_per_module_from_the_mode(monkeypatch):
    """Modes ``0`` and ``inductor`` use no native kernel; the mode is resolved when the
    module is built (``kernel_mode=``, else the environment's): a mode set afterwards
    changes nothing, not even when the module moves."""
    calls = []
    monkeypatch.setattr(native, "fused_update_", lambda *a, **k: calls.append(1))
    adam = update_rule("adam")
    for mode, kind in (("0", "eager"), ("inductor", "inductor"), ("1", "native_cpu")):
        assert select_kernel(torch.device("cpu"), adam, mode).kind == kind
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "0")
    tables = [bag_config("t")]
    kjt = kjt_from_bags({"f": [[1, 2], [3]]})
    ebc = CowClipEmbeddingBagCollection(tables, options=CowClipOptions(lr=0.1))
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "1")  # too late for this module
    ebc = ebc.to("meta").to_empty(device="cpu")  # a move keeps the module's mode
    ebc.reset_parameters()
    ebc(kjt).values().sum().backward()
    assert calls == [] and ebc.kernel_mode == "0" and ebc.row_kernel.kind == "eager"
    assert ebc.clip_stats()["t"].rows_updated == 3
    # An explicit value wins over the environment; a move chooses the kernel of the new
    # device again, in the module's mode.
    built = CowClipEmbeddingBagCollection(tables, options=CowClipOptions(lr=0.1), kernel_mode="1")
    assert built.kernel_mode == "1" and built.row_kernel.kind == "native_cpu"
    built.to("meta")
    assert built.row_kernel.kind == "eager"  # the meta device runs nothing
    built.to_empty(device="cpu")
    assert built.row_kernel.kind == "native_cpu"


def test_a_failed_build_warns_and_falls_back_in_auto_mode_and_raises_in_mode_1(monkeypatch):
    failed = native.NativeBuild(error="OSError: no compiler here")
    monkeypatch.setattr(native, "build", lambda: failed)
    monkeypatch.setattr(row_kernels, "toolchain_available", lambda device_type: False)
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "0")  # reference result on the eager path
    tables = [bag_config("t")]
    kjt = kjt_from_bags({"f": [[1, 2], [3]]})
    expected = CowClipEmbeddingBagCollection(tables, init_seed=0, options=CowClipOptions(lr=0.1))
    expected(kjt).values().sum().backward()
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "auto")
    with pytest.warns(RuntimeWarning, match="no compiler here.*eager row step"):
        ebc = CowClipEmbeddingBagCollection(tables, init_seed=0, options=CowClipOptions(lr=0.1))
    assert ebc.row_kernel.kind == "eager"  # decided when built, before any step
    ebc(kjt).values().sum().backward()
    assert torch.equal(
        ebc.state_dict()["embedding_bags.t.weight"],
        expected.state_dict()["embedding_bags.t.weight"],
    )
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "1")
    with pytest.raises(RuntimeError, match="required.*: OSError: no compiler here$"):
        CowClipEmbeddingBagCollection(tables, options=CowClipOptions(lr=0.1))


def test_a_build_failure_reads_as_one_line():
    """A compiler's pages become one line: the first that names an error, else the last."""
    pages = RuntimeError(
        "Error building extension 'x':\n[1/2] c++ -O3 ...\nsrc.cpp:3:1: error: 'foo' was "
        "not declared\n   3 | foo();\nninja: build stopped"
    )
    assert native.one_line(pages) == "RuntimeError: Error building extension 'x':"
    assert native.one_line(OSError("first\n\nlast line\n")) == "OSError: last line"
    assert "\n" not in native.one_line(RuntimeError("a\nb"))


def test_the_library_name_hashes_the_source(monkeypatch, tmp_path):
    """Checkouts of the same source share a cached library; an edited source never does."""
    name = native.extension_name()
    copy = tmp_path / "cowclip_cpu.cpp"
    copy.write_bytes(native.SOURCE.read_bytes())
    monkeypatch.setattr(native, "SOURCE", copy)
    assert native.extension_name() == name
    copy.write_bytes(native.SOURCE.read_bytes() + b"// edited\n")
    assert native.extension_name() != name


def test_another_checkout_of_the_same_source_loads_the_library_without_a_rebuild(
    monkeypatch, tmp_path
):
    """The build compiles a copy of the source kept in the library's directory: a second
    checkout (another path, the same text) finds build.ninja unchanged and the library up to
    date, instead of rebuilding it in place for its own path."""
    directory = native.build_directory()
    library = next(directory.glob("*.so"))
    ninja = (directory / "build.ninja").read_text()
    assert str(directory / native.SOURCE.name) in ninja and str(native.SOURCE) not in ninja
    assert (directory / native.SOURCE.name).read_bytes() == native.SOURCE.read_bytes()
    built = library.stat().st_mtime_ns
    checkout = tmp_path / "other-checkout" / "csrc" / native.SOURCE.name
    checkout.parent.mkdir(parents=True)
    checkout.write_bytes(native.SOURCE.read_bytes())
    monkeypatch.setattr(native, "SOURCE", checkout)
    assert native.build_directory() == directory
    native._build_and_load()
    assert (directory / "build.ninja").read_text() == ninja
    assert library.stat().st_mtime_ns == built


def test_a_wrong_native_update_fails_the_reference_comparison(monkeypatch):
    """The collection's reference tests (test_collection.py, path "compiled") can fail on
    the native path: a kernel that is off on one row is caught."""
    from test_collection import test_several_steps_match_dense_autograd_reference

    real = native.fused_update_

    def wrong(weight, state0, state1, rows, *args):
        result = real(weight, state0, state1, rows, *args)
        with torch.no_grad():
            weight[rows[0]] += 1e-3
        return result

    monkeypatch.setattr(native, "fused_update_", wrong)
    with pytest.raises(AssertionError, match="not close"):
        test_several_steps_match_dense_autograd_reference(
            "adam", True, "compiled", torch.device("cpu")
        )


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode", ["1", "0", "inductor", "triton"])
def test_stochastic_rounding_false_rounds_half_tables_to_nearest_in_every_kernel(dtype, mode):
    """An update of a quarter of a unit in the last place: rounded to nearest
    (``stochastic_rounding=False``, FBGEMM's ``fused_params`` key) no row moves; rounded
    stochastically about a quarter of the entries move, on average the update."""
    if mode == "triton" and triton_ops.availability(torch.device("cpu")) is not None:
        pytest.skip("Triton's interpreter is not available here")
    data_type = DataType.FP16 if dtype == torch.float16 else DataType.BF16
    table = replace(bag_config("t", 64, 8), data_type=data_type)
    quarter_ulp = 0.25 * ulp(dtype)
    moved = {}
    for stochastic in (True, False):
        ebc = CowClipEmbeddingBagCollection(
            [replace(table)],
            CowClipOptions(
                optimizer="sgd", lr=quarter_ulp, cowclip=None, stochastic_rounding=stochastic
            ),
            kernel_mode=mode,
        )
        with torch.no_grad():
            ebc.embedding_bags["t"].weight.fill_(1.0)
        kjt = kjt_from_bags({"f": [[i] for i in range(8)]})
        ebc(kjt).values().sum().neg().backward()  # grad -1 on every entry: W += lr
        moved[stochastic] = float((ebc.embedding_bags["t"].weight != 1.0).float().mean())
        assert ebc.options.stochastic_rounding is stochastic
    assert moved[False] == 0.0
    assert 0.1 < moved[True] < 0.4

"""The Triton kernels (torchrec_cowclip/embedding/triton_kernels.py, triton_ops.py) against
the functional core: the native kernels' parity suite (fused_update_cases.py) and the
pooled lookup, the rounding and the index checks.

Torch only (no torchrec): ``pytest -m gpu`` runs the CUDA cases on a GPU machine, where the
kernels compile for real. Without a GPU the CPU cases run under Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py): correctness, not speed.
"""

import pytest
import torch
import torch.nn.functional as F
from fused_update_cases import (
    BAD_UPDATE_INDICES,
    check_bad_indices_refused,
    check_column_shard_row_sums,
    check_rounding_matches_functional,
    check_update_matches_functional,
    fused,
    reference,
    segment_sums,
)

from torchrec_cowclip.embedding import native, triton_ops
from torchrec_cowclip.embedding.row_gradients import group_rows
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.optim.functional import adam_bias_corrections
from torchrec_cowclip.optim.options import CowClip

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy casts, interpreter

HALF = [torch.float16, torch.bfloat16]

#: The interpreter's rounding of sums in another order, or a GPU's fused multiply-adds.
RTOL = 2e-6


@pytest.fixture(
    params=[
        pytest.param("cpu", id="cpu-interpreter"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    ]
)
def device(request):
    device = torch.device(request.param)
    reason = triton_ops.availability(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if reason is not None:
        pytest.skip(reason)
    return device


# --- the fused update: the native kernels' parity suite -------------------------------------


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("clip", [True, False], ids=["cowclip", "noclip"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dim", [1, 4, 16, 128])
def test_fused_update_matches_the_functional_core(optimizer, clip, weighted, dim, device):
    """Every rule, the clip binding and not (and a table that opts out), weighted
    positions, duplicates, a non-finite row, three tables; ~200 touched rows, so every dim
    runs several row blocks with a ragged last one (dim 1: one ragged block)."""
    check_update_matches_functional(
        triton_ops,
        optimizer,
        clip,
        weighted,
        dim,
        num_rows=240,
        num_positions=600,
        device=device,
        rtol=RTOL,
    )


@pytest.mark.parametrize("optimizer", ["adagrad", "adamw"])
@pytest.mark.parametrize("dim", [4, 16])
def test_the_rules_torchrec_users_set_match_the_functional_core(optimizer, dim, device):
    """Per-element Adagrad and AdamW, after the clip (binding on some rows, a table that
    opts out), weighted positions, a non-finite row."""
    check_update_matches_functional(
        triton_ops, optimizer, True, True, dim, num_rows=240, num_positions=600,
        device=device, rtol=RTOL,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", HALF)
def test_half_tables_round_to_nearest_without_rounding_keys(dtype, device):
    """``stochastic_rounding=False``: the updated rows round to nearest."""
    check_update_matches_functional(
        triton_ops, "adamw", True, True, 6, dtype=dtype, device=device, rtol=RTOL,
        stochastic=False,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd", "adagrad"])
def test_fused_update_of_half_tables_matches_the_functional_core(optimizer, dtype, device):
    """float16 / bfloat16 tables: stepped in float32, rounded stochastically with the
    functional core's counter-based bits (the same keys: at most one unit in the last
    place apart, where the float32 values differ in their last bit)."""
    check_update_matches_functional(
        triton_ops, optimizer, True, True, 6, dtype=dtype, device=device, rtol=RTOL
    )


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd", "adagrad", "adamw"])
def test_column_shard_row_sums_match_the_functional_core(optimizer, device):
    check_column_shard_row_sums(triton_ops, optimizer, device=device, rtol=RTOL)


@pytest.mark.parametrize(
    "overrides, message",
    BAD_UPDATE_INDICES,
    ids=lambda v: v if isinstance(v, str) else "-".join(v),
)
def test_bad_indices_of_the_update_are_refused_in_one_line_before_any_change(
    overrides, message, device
):
    """The check kernel's flags gate the update kernel: nothing is written, then the
    native kernels' one-line error."""
    check_bad_indices_refused(triton_ops, overrides, message, device=device)


def test_rows_outside_the_weight_are_refused_before_any_change(device):
    w = torch.zeros(10, 4, device=device)
    for rows in ([3, 2], [1, 10], [-1, 2], [2, 2]):
        with pytest.raises(RuntimeError, match="distinct, ascending and inside"):
            triton_ops.fused_update_(
                w, None, None, torch.tensor(rows, device=device),
                torch.ones(2, dtype=torch.int64, device=device), torch.ones(2, 4, device=device),
                None, None, None, torch.tensor([0, 10], device=device), None, None, None, None,
                None, 2, 1.0, 0.9, 0.999, 1e-8, 0.0, False, 1.0, 0.0, 0.0, 1.0,
            )  # fmt: skip
    assert not w.any()


@pytest.mark.gpu
def test_a_large_update_matches_the_functional_core_on_the_gpu(device):
    """Thousands of rows per table, dim 128, hot rows: the real kernels' scale."""
    if device.type != "cuda":
        pytest.skip("the large case runs on a GPU")
    check_update_matches_functional(
        triton_ops, "adam", True, True, 128, num_rows=90_000, num_positions=400_000,
        device=device, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_a_hot_row_is_summed_across_programs_and_matches_the_references(weighted, device):
    """A row with 10,257 positions (Zipf's head at batch 131,072) among short ones: its
    gradient is summed in chunks of HOT_CHUNK positions by segment_partials - one program
    a chunk - and the update equals the float64 reference, the native CPU kernel's, and
    itself run to run (the same bits)."""
    gen = torch.Generator().manual_seed(4)
    dim, num_rows, hot = 16, 40, 10_257
    positions = torch.cat(
        [torch.full((hot,), 7), torch.randint(0, num_rows, (500,), generator=gen)]
    )
    positions = positions[torch.randperm(positions.numel(), generator=gen)]
    num_bags = positions.numel() // 3
    bag_of_position = torch.randint(0, num_bags, (positions.numel(),), generator=gen)
    bag_grads = torch.randn(num_bags, dim, generator=gen) * 0.01
    weight = torch.randn(num_rows, dim, generator=gen) * 0.05
    state = [torch.randn(num_rows, dim, generator=gen) * 1e-2, torch.rand(num_rows, dim) * 1e-3]
    grouping = group_rows(positions, bag_of_position, num_rows)
    assert int(grouping.counts.max()) >= hot
    sorted_weights = (
        torch.rand(positions.numel(), generator=gen)[grouping.order] + 0.5 if weighted else None
    )
    bias = adam_bias_corrections(torch.tensor([3, 5]), 0.9, 0.999)
    given = dict(
        bag_gradients=bag_grads,
        segment_offsets=grouping.segment_offsets,
        sorted_bags=grouping.sorted_bags,
        sorted_weights=sorted_weights,
        row_offsets=torch.tensor([0, 20, num_rows]),
        adam_bias=bias,
        optimizer="adam",
        lr=0.05,
        weight_decay=0.01,
        clip=(1.0, 1e-3),
    )

    def run(library, on):
        w, st = weight.clone().to(on), [s.clone().to(on) for s in state]
        moved = {k: v.to(on) if isinstance(v, torch.Tensor) else v for k, v in given.items()}
        moved["adam_bias"] = tuple(b.to(on) for b in bias)
        status, per_table = fused(
            library, w, st, grouping.rows.to(on), grouping.counts.to(on), **moved
        )
        return w.cpu(), [s.cpu() for s in st], status.cpu(), per_table.cpu()

    with triton_ops.recording_launches() as launches:
        got = run(triton_ops, device)
    chunks = [grid[0] for name, grid, _, _ in launches if name == "segment_partials"]
    assert chunks and chunks[0] >= hot // triton_ops.HOT_CHUNK
    again = run(triton_ops, device)
    flat, flat_again = [got[0], *got[1], *got[2:]], [again[0], *again[1], *again[2:]]
    assert all(torch.equal(a, b) for a, b in zip(flat, flat_again))
    assert native.build().ok, native.build().error
    native_result = run(native, torch.device("cpu"))
    assert torch.equal(got[2], native_result[2]) and torch.equal(got[3], native_result[3])
    grad64 = segment_sums(
        grouping, bag_grads.double(), None if sorted_weights is None else sorted_weights.double()
    )
    table = torch.bucketize(grouping.rows, torch.tensor([20, num_rows]), right=True)
    ref_w, ref_s, _ = reference(
        "adam",
        weight.double(),
        [s.double() for s in state],
        grouping.rows,
        grad64,
        grouping.counts,
        None,
        lr=0.05,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.01,
        cowclip=CowClip(r=1.0, zeta=1e-3),
        adam_bias=(bias[0].double()[table], bias[1].double()[table]),
    )
    # Sums of 10K float32 terms in another order: within 1e-4 of each other, and the
    # chunked sum no further from float64 than native's sum in input order (x2).
    for ours, theirs, exact in zip(
        [got[0], *got[1]], [native_result[0], *native_result[1]], [ref_w, *ref_s]
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(ours.double(), exact, rtol=1e-4, atol=1e-8)
        ours_off = (ours.double() - exact).abs().max()
        assert ours_off <= 2 * (theirs.double() - exact).abs().max() + 1e-12


# --- the pooled lookup ----------------------------------------------------------------------


def _bags(num_rows, gen, num_bags=40, longest=12):
    """Bags of 0 to ``longest`` ids with duplicates, and their offsets."""
    lengths = torch.randint(0, longest + 1, (num_bags,), generator=gen)
    lengths[:3] = torch.tensor([0, 1, longest])
    ids = torch.randint(0, num_rows, (int(lengths.sum()),), generator=gen)
    ids[: min(4, ids.numel())] = 2  # duplicates, in one bag and across bags
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return ids, offsets


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
@pytest.mark.parametrize("dim", [1, 4, 16, 128, 200])
def test_pooled_lookup_matches_embedding_bag(dtype, mode, dim, device):
    """SUM, MEAN and weighted SUM of float32 / float16 / bfloat16 rows, accumulated in
    float32 (the reference in float64), with empty bags and duplicates; dim 200 spans two
    column blocks."""
    gen = torch.Generator().manual_seed(dim)
    weight = (torch.randn(50, dim, generator=gen)).to(dtype)
    ids, offsets = _bags(50, gen)
    psw = torch.rand(ids.numel(), generator=gen) + 0.5 if mode == "weighted" else None
    expected = F.embedding_bag(
        ids,
        weight.double(),
        offsets,
        mode="mean" if mode == "mean" else "sum",
        per_sample_weights=None if psw is None else psw.double(),
        include_last_offset=True,
    )
    got = triton_ops.pooled_lookup(
        weight.to(device),
        ids.to(device),
        offsets.to(device),
        None if psw is None else psw.to(device),
        mode == "mean",
    )
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_bad_offsets_and_ids_of_the_lookup_are_refused_in_one_line(device):
    weight = torch.randn(6, 4, device=device).to(torch.bfloat16)

    def ints(values):
        return torch.tensor(values, device=device)

    triton_ops.pooled_lookup(weight, ints([1, 2, 3]), ints([0, 1, 3]), None, False)  # fine
    for offsets in ([1, 2, 3], [0, 2, 1, 3], [0, 1, 2]):
        with pytest.raises(RuntimeError, match="offsets must start at 0, ascend and end at the 3"):
            triton_ops.pooled_lookup(weight, ints([1, 2, 3]), ints(offsets), None, False)
    for ids, bad in (([1, 6, 3], 6), ([-2, 1, 3], -2)):
        with pytest.raises(RuntimeError, match=rf"id {bad} outside \[0, 6\)"):
            triton_ops.pooled_lookup(weight, ints(ids), ints([0, 1, 3]), None, False)


# --- the stochastic rounding ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_equals_the_functional_core_bit_for_bit(dtype, device):
    check_rounding_matches_functional(triton_ops, dtype, device=device)


def test_triton_needs_a_gpu_or_its_interpreter(monkeypatch):
    """On CPU tensors without the interpreter: a one-line reason, naming the variable."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = triton_ops.availability(torch.device("cpu"))
    assert reason is not None and "TRITON_INTERPRET=1" in reason and "\n" not in reason


# --- the kernel's choice --------------------------------------------------------------------


def test_the_triton_mode_forces_the_triton_kernel(monkeypatch):
    """``TORCHREC_COWCLIP_COMPILE=triton`` picks it on any device where Triton runs (CPU
    tensors: under the interpreter); elsewhere, and for a rule of one's own, a one-line
    refusal; ``auto`` keeps the native kernels on CPU."""
    from torchrec_cowclip.embedding.row_kernels import select_kernel
    from torchrec_cowclip.optim.rules import UpdateRule, update_rule

    cpu = torch.device("cpu")
    if triton_ops.availability(cpu) is None:
        assert type(select_kernel(cpu, update_rule("adam"), "triton")).__name__ == "TritonKernel"
        assert select_kernel(cpu, update_rule("sgd"), "triton").kind == "triton"
    own = UpdateRule("my_sgd", update_rule("sgd").step, (), "torch.optim.SGD")
    with pytest.raises(ValueError, match="=triton: the Triton kernels implement the built-in"):
        select_kernel(cpu, own, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"=triton: .*TRITON_INTERPRET=1") as raised:
        select_kernel(cpu, update_rule("adam"), "triton")
    assert "\n" not in str(raised.value)

"""CowClipEmbeddingBagCollection against torchrec's EBC + plain autograd + the reference."""

import copy
import io
import shutil
from dataclasses import replace

import pytest
import torch
from cowclip_testing import (
    DenseReference,
    assert_close_to_reference,
    default_cowclip,
    keys_can_be_reordered,
    kjt_from_bags,
    random_kjt,
    to_device,
)
from tiny import HYPER, bag_config, load_mixed_scale_weights, mixed_tables
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection
from torchrec_cowclip.embedding import triton_ops
from torchrec_cowclip.optim.options import CountLR, CowClipOptions


def _build(
    tables, gen, optimizer, cowclip, unclipped=("linear",), is_weighted=False, device=None, **hyper
):
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables],
        is_weighted=is_weighted,
        device=device,
        options=CowClipOptions(
            optimizer=optimizer, cowclip=cowclip, unclipped_tables=unclipped, **hyper
        ),
    )
    weights = load_mixed_scale_weights(ebc, tables, gen)
    ref = DenseReference(
        tables,
        weights,
        optimizer,
        is_weighted=is_weighted,
        unclipped_tables=unclipped,
        cowclip=cowclip,
        **hyper,
    )
    return ebc, ref


def _assert_matches_reference(ebc, ref, tables, rtol=1e-5, atol=1e-6):
    opt_state = ebc.fused_optimizer.state_dict()["state"]
    for t in tables:
        ours = ebc.embedding_bags[t.name].weight.detach()
        assert_close_to_reference(
            ours, ref.weight(t.name), rtol=rtol, atol=atol, msg=lambda m: f"table {t.name}: {m}"
        )
        for key, value in ref.state[t.name].items():
            assert_close_to_reference(
                opt_state[f"embedding_bags.{t.name}.weight"][key],
                value,
                rtol=rtol,
                atol=atol,
                msg=lambda m: f"{t.name}.{key}: {m}",
            )


def _step_against_reference(ebc, ref, tables, kjt, gen):
    """One forward + backward of ``ebc`` and the dense reference on ``kjt``; both must agree."""
    out = ebc(kjt)
    upstream = torch.randn(out.values().shape, generator=gen)
    assert_close_to_reference(out.values(), ref.output(kjt).detach())
    (out.values() * upstream).sum().backward()
    ref.step(kjt, upstream)
    _assert_matches_reference(ebc, ref, tables)


needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="no C++ compiler for Inductor",
)

needs_triton = pytest.mark.skipif(
    triton_ops.availability(torch.device("cpu")) is not None and not torch.cuda.is_available(),
    reason="Triton cannot run here (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU)",
)

PATH_MODES = {"eager": "0", "compiled": "1", "triton": "triton", "inductor": "inductor"}


def _on_path(name, monkeypatch, device=None):
    if name == "triton" and device is not None and triton_ops.availability(device) is not None:
        pytest.skip(triton_ops.availability(device))
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", PATH_MODES[name])  # read when built
    return name


@pytest.fixture(
    params=[
        "eager",
        pytest.param("compiled", marks=needs_compiler),
        pytest.param("triton", marks=needs_triton),
    ]
)
def update_path(request, monkeypatch):
    """Runs a test on the eager update, the compiled one (the fused kernels: native on
    CPU, Triton on CUDA) and the Triton kernels on every device (on CPU tensors under
    Triton's interpreter)."""
    return _on_path(request.param, monkeypatch, torch.device("cpu"))


@pytest.fixture(
    params=[
        "eager",
        pytest.param("compiled", marks=needs_compiler),
        pytest.param("triton", marks=needs_triton),
        pytest.param("inductor", marks=needs_compiler),
    ]
)
def every_update_path(request, monkeypatch, device):
    """:func:`update_path` and the Inductor-compiled row step on CPU too (the CPU path
    before the fused kernels, ``TORCHREC_COWCLIP_COMPILE=inductor``)."""
    return _on_path(request.param, monkeypatch, device)


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd", "adagrad", "adamw"])
@pytest.mark.parametrize("clip", [True, False], ids=["cowclip", "noclip"])
def test_several_steps_match_dense_autograd_reference(optimizer, clip, every_update_path, device):
    """Four steps of the collection on ``device`` (float32; on CUDA compiled into Triton
    kernels on the compiled path) against the float64 CPU reference: a shared table, MEAN
    pooling, mixed dims, an unclipped dim-1 table, multi-hot bags with duplicates and empty
    ones, every other step's keys in another order than the tables'."""
    if every_update_path == "triton" and optimizer not in triton_ops.OPTIMIZERS:
        pytest.skip(f"the Triton update has no {optimizer} rule")
    gen = torch.Generator().manual_seed(7)
    tables = mixed_tables()
    cowclip = default_cowclip() if clip else None
    ebc, ref = _build(tables, gen, optimizer, cowclip, device=device, **HYPER)
    reorder = keys_can_be_reordered(device)
    total_clipped = 0
    for step in range(4):
        kjt = random_kjt(
            tables,
            batch_size=6,
            generator=gen,
            key_order=["fe", "fc", "fa", "fd", "fb"] if step % 2 and reorder else None,
        )
        out = ebc(to_device(kjt, device))
        upstream = torch.randn(out.values().shape, generator=gen)
        assert_close_to_reference(out.values(), ref.output(kjt).detach())
        (out.values() * upstream.to(device)).sum().backward()
        ref.step(kjt, upstream)
        _assert_matches_reference(ebc, ref, tables)
        stats = ebc.clip_stats()
        for t in tables:
            assert stats[t.name].rows_clipped == ref.clipped_rows[t.name].numel(), t.name
            assert stats[t.name].steps == step + 1
        total_clipped += sum(s.rows_clipped for s in stats.values())
        assert stats["linear"].rows_clipped == 0
    if clip:
        # The case must exercise both sides of the threshold.
        assert total_clipped > 0
        assert sum(s.total_rows_updated for s in stats.values()) > total_clipped
    else:
        assert total_clipped == 0


def test_a_wrong_update_fails_the_reference_comparison(device, wrong_row_step):
    """The comparison above can fail: an update that is off by 1e-3 on one row is caught."""
    with pytest.raises(AssertionError, match="not close"):
        test_several_steps_match_dense_autograd_reference("adam", True, "eager", device)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_count_lr_matches_dense_reference(optimizer, update_path):
    """The per-id-frequency lr (CountLR) in the fused update equals the reference's, with
    repeated ids so that counts reach past the cap."""
    gen = torch.Generator().manual_seed(11)
    tables = mixed_tables()
    ebc, ref = _build(
        tables, gen, optimizer, default_cowclip(), **HYPER, count_lr=CountLR(power=0.5, cap=3.0)
    )
    assert ebc.fused_optimizer.hyperparameters["count_lr"] == CountLR(power=0.5, cap=3.0)
    for _ in range(3):
        kjt = random_kjt(tables, batch_size=12, generator=gen)
        _step_against_reference(ebc, ref, tables, kjt, gen)


def test_weighted_features_match_reference(update_path):
    gen = torch.Generator().manual_seed(3)
    tables = [
        EmbeddingBagConfig(
            name="t0", embedding_dim=6, num_embeddings=30, feature_names=["f0", "f1"]
        ),
        bag_config("t1", 6, 20, ["f2"]),
    ]
    ebc, ref = _build(
        tables, gen, "adam", default_cowclip(), unclipped=(), is_weighted=True, **HYPER
    )
    for _ in range(3):
        kjt = random_kjt(tables, batch_size=5, generator=gen, weighted=True)
        _step_against_reference(ebc, ref, tables, kjt, gen)


# torchrec's EBC (the reference's forward) has no weighted MEAN pooling on CPU.
@pytest.mark.parametrize(
    "weighted,lin_pooling", [(False, PoolingType.MEAN), (True, PoolingType.SUM)]
)
@pytest.mark.parametrize("single_hot", [False, True], ids=["multi_hot", "single_hot"])
def test_tables_of_the_same_features_share_one_sort_and_match_reference(
    weighted, lin_pooling, single_hot, monkeypatch
):
    """DeepFM's layout: a dim-6 table and a dim-1 table per feature, same sizes. The two
    table batches look up the same row ids, so forward maps them once and backward sorts
    them once; each batch still gets its own, correct update (pooling and weights per batch)."""
    from torchrec_cowclip.embedding import batched_lookup
    from torchrec_cowclip.embedding.row_kernels import TorchKernel

    sorts, hot_flags = [], []
    real_group_rows, real_pooled_lookup = TorchKernel.group_rows, batched_lookup.pooled_lookup
    monkeypatch.setattr(
        TorchKernel, "group_rows", lambda *a, **k: sorts.append(1) or real_group_rows(*a, **k)
    )
    monkeypatch.setattr(
        batched_lookup,
        "pooled_lookup",
        lambda b, lk: hot_flags.append(lk.single_hot) or real_pooled_lookup(b, lk),
    )
    gen = torch.Generator().manual_seed(11)
    tables = [
        bag_config("emb_a", 6, 30, ["a"]),
        bag_config("emb_b", 6, 20, ["b"]),
        bag_config("lin_a", 1, 30, ["a"], pooling=lin_pooling),
        bag_config("lin_b", 1, 20, ["b"], pooling=lin_pooling),
    ]
    ebc, ref = _build(
        tables,
        gen,
        "adam",
        default_cowclip(),
        unclipped=("lin_a", "lin_b"),
        is_weighted=weighted,
        **HYPER,
    )
    input_tables = tables[:2]  # the KJT carries each feature once
    for step in range(3):
        kjt = random_kjt(
            input_tables,
            batch_size=7,
            generator=gen,
            weighted=weighted,
            **(dict(min_len=1, max_len=1) if single_hot else {}),
        )
        _step_against_reference(ebc, ref, tables, kjt, gen)
        assert len(sorts) == step + 1  # one sort per step for both table batches
    # Single-hot lookups take the sample-major forward; multi-hot ones (with empty and
    # long bags) never do.
    assert hot_flags == [single_hot] * len(hot_flags) and hot_flags


def test_row_clip_counts_match_the_reference_row_by_row(update_path):
    """With tracking on, each row's (updated, clipped) counts are the number of steps whose
    batch looked it up and of those whose reference step clipped it."""
    gen = torch.Generator().manual_seed(5)
    tables = mixed_tables()
    ebc, ref = _build(tables, gen, "adam", default_cowclip(), **HYPER)
    with pytest.raises(RuntimeError, match="track_row_clips"):
        ebc.row_clip_counts()
    ebc.track_row_clips()
    want_updated = {t.name: torch.zeros(t.num_embeddings, dtype=torch.int64) for t in tables}
    want_clipped = {t.name: torch.zeros(t.num_embeddings, dtype=torch.int64) for t in tables}
    for _ in range(4):
        kjt = random_kjt(tables, batch_size=6, generator=gen)
        _step_against_reference(ebc, ref, tables, kjt, gen)
        features = kjt.to_dict()
        for t in tables:
            ids = torch.cat([features[f].values() for f in t.feature_names]).unique()
            want_updated[t.name][ids] += 1
            want_clipped[t.name][ref.clipped_rows[t.name]] += 1
    counts = ebc.row_clip_counts()
    assert sum(int(c.sum()) for _, c in counts.values()) > 0  # the clip bound somewhere
    for t in tables:
        updated, clipped = counts[t.name]
        assert torch.equal(updated, want_updated[t.name]), t.name
        assert torch.equal(clipped, want_clipped[t.name]), t.name
        assert clipped.sum() == ebc.clip_stats()[t.name].total_rows_clipped
    ebc.clip_counters.reset()
    assert all(int(u.sum()) == 0 for u, _ in ebc.row_clip_counts().values())
    ebc.track_row_clips(False)
    with pytest.raises(RuntimeError):
        ebc.row_clip_counts()


def test_weighted_mean_pooling_divides_by_bag_length():
    table = bag_config("t", 2, 4, ["f"], pooling=PoolingType.MEAN)
    ebc = CowClipEmbeddingBagCollection(
        [table], is_weighted=True, options=CowClipOptions(optimizer="sgd", lr=1.0, cowclip=None)
    )
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.copy_(
            torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [5.0, 5.0]])
        )
    kjt = kjt_from_bags({"f": [[0, 1], [], [2]]}, {"f": [[2.0, 4.0], [], [0.5]]})
    out = ebc(kjt).values()
    assert out.tolist() == [[1.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
    out[0].sum().backward()  # dL/dW[j] = w_p / len for the rows of bag 0
    w = ebc.embedding_bags["t"].weight
    assert w[0].tolist() == [0.0, -1.0] and w[1].tolist() == [-2.0, -1.0]
    assert w[2].tolist() == [2.0, 2.0] and w[3].tolist() == [5.0, 5.0]


def test_counts_include_duplicates_inside_a_bag_and_shared_features():
    table = EmbeddingBagConfig(
        name="t", embedding_dim=2, num_embeddings=5, feature_names=["a", "b"]
    )
    ebc = CowClipEmbeddingBagCollection(
        [table], options=CowClipOptions(optimizer="sgd", lr=1.0, cowclip=CowClip(r=1.0, zeta=0.0))
    )
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.fill_(0.0).add_(torch.tensor([[3.0, 4.0]]))  # ||W|| = 5
    # Row 1 occurs 3 times (twice in one bag of "a", once in "b"): tau = 15.
    kjt = kjt_from_bags({"a": [[1, 1]], "b": [[1, 2]]})
    out = ebc(kjt).values()
    (out * 100.0).sum().backward()  # g_1 = 3 * (100, 100), norm 424 -> clipped to norm 15
    w = ebc.embedding_bags["t"].weight.detach()
    step = torch.tensor([3.0, 4.0]) - w[1]
    assert torch.linalg.vector_norm(step).item() == pytest.approx(15.0, rel=1e-5)
    stats = ebc.clip_stats()["t"]
    assert (stats.rows_updated, stats.rows_clipped) == (2, 2)


def test_zero_gradients_give_no_nan_and_rows_count_as_updated():
    gen = torch.Generator().manual_seed(0)
    tables = mixed_tables()
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables],
        options=CowClipOptions(optimizer="adam", cowclip=CowClip(r=1.0, zeta=0.0)),
    )
    with torch.no_grad():
        ebc.embedding_bags["small"].weight.zero_()  # zero rows and zero grads: 0/0 must not appear
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    kjt = random_kjt(tables, batch_size=4, generator=gen)
    (ebc(kjt).values() * 0.0).sum().backward()
    for k, v in ebc.state_dict().items():
        assert torch.equal(v, before[k]), k  # Adam with g = 0 from zero moments does not move
    state = ebc.fused_optimizer.state_dict()["state"]
    assert all(torch.isfinite(s["exp_avg_sq"]).all() for s in state.values())
    assert ebc.clip_stats()["small"].rows_clipped == 0


def test_forward_without_backward_and_no_grad_change_nothing():
    gen = torch.Generator().manual_seed(1)
    tables = mixed_tables()
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables], options=CowClipOptions(optimizer="adam", lr=0.1)
    )
    before = copy.deepcopy(ebc.state_dict())
    opt_before = copy.deepcopy(ebc.fused_optimizer.state_dict())
    kjt = random_kjt(tables, batch_size=4, generator=gen)
    with torch.no_grad():
        ebc(kjt).values().sum()
    out = ebc(kjt).values()  # graph built, never backpropagated
    del out
    for k, v in ebc.state_dict().items():
        assert torch.equal(v, before[k])
    after = ebc.fused_optimizer.state_dict()["state"]
    for k, s in opt_before["state"].items():
        for name, value in s.items():
            assert torch.equal(after[k][name], value)
    assert all(s.steps == 0 for s in ebc.clip_stats().values())


def test_no_dense_gradient_is_kept_on_the_tables():
    gen = torch.Generator().manual_seed(2)
    tables = mixed_tables()
    ebc = CowClipEmbeddingBagCollection([replace(t) for t in tables])
    ebc(random_kjt(tables, 4, gen)).values().sum().backward()
    assert all(p.grad is None for p in ebc.parameters())


def test_state_dict_keys_and_weights_move_both_ways_with_torchrec():
    tables = mixed_tables()
    ours = CowClipEmbeddingBagCollection([replace(t) for t in tables])
    stock = EmbeddingBagCollection(tables=[replace(t) for t in tables])
    assert list(ours.state_dict().keys()) == list(stock.state_dict().keys())
    stock.load_state_dict(ours.state_dict())
    kjt = random_kjt(tables, 5, torch.Generator().manual_seed(4))
    torch.testing.assert_close(stock(kjt).values(), ours(kjt).values(), rtol=0, atol=0)
    assert stock(kjt).keys() == ours(kjt).keys()
    with torch.no_grad():
        for p in stock.parameters():
            p.mul_(-2.0)
    ours.load_state_dict(stock.state_dict())
    torch.testing.assert_close(stock(kjt).values(), ours(kjt).values(), rtol=0, atol=0)
    # and the loaded weights are what the fused update trains
    ours(kjt).values().sum().backward()
    assert not torch.equal(
        ours.state_dict()["embedding_bags.shared.weight"],
        stock.state_dict()["embedding_bags.shared.weight"],
    )


def test_from_ebc_copies_weights_and_options():
    tables = mixed_tables()
    stock = EmbeddingBagCollection(tables=[replace(t) for t in tables])
    ours = CowClipEmbeddingBagCollection.from_ebc(
        stock, options=CowClipOptions(optimizer="sgd", lr=0.5, unclipped_tables=["linear"])
    )
    for k, v in stock.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    assert ours.fused_optimizer.optimizer_name == "sgd"
    assert ours.fused_optimizer.param_groups[0]["lr"] == 0.5


def _train(ebc, tables, seed, steps):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        kjt = random_kjt(tables, 8, gen)
        out = ebc(kjt).values()
        (out * torch.randn(out.shape, generator=gen)).sum().backward()


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad"])
def test_save_and_load_resume_is_bit_for_bit(optimizer, update_path):
    tables = mixed_tables()
    torch.manual_seed(0)
    a = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables],
        options=CowClipOptions(
            optimizer=optimizer, lr=0.05, cowclip=default_cowclip(), weight_decay=1e-3
        ),
    )
    _train(a, tables, seed=1, steps=3)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": a.fused_optimizer.state_dict()}, buf)
    _train(a, tables, seed=2, steps=3)  # the uninterrupted run

    torch.manual_seed(123)  # a different init, overwritten by the checkpoint
    b = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables],
        options=CowClipOptions(
            optimizer=optimizer, lr=0.05, cowclip=default_cowclip(), weight_decay=1e-3
        ),
    )
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b.load_state_dict(ckpt["model"])
    b.fused_optimizer.load_state_dict(ckpt["opt"])
    assert all(s.steps == 3 for s in b.clip_stats().values())
    _train(b, tables, seed=2, steps=3)
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v), k
    sa, sb = a.fused_optimizer.state_dict()["state"], b.fused_optimizer.state_dict()["state"]
    for k in sa:
        for name in sa[k]:
            assert torch.equal(sa[k][name], sb[k][name]), (k, name)


def test_lr_in_param_groups_takes_effect_between_steps():
    tables = mixed_tables()
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables], options=CowClipOptions(optimizer="sgd", lr=0.1, cowclip=None)
    )
    gen = torch.Generator().manual_seed(5)
    kjt = random_kjt(tables, 4, gen)
    ebc.fused_optimizer.param_groups[0]["lr"] = 0.0
    before = copy.deepcopy(ebc.state_dict())
    ebc(kjt).values().sum().backward()
    assert all(torch.equal(v, before[k]) for k, v in ebc.state_dict().items())
    ebc.fused_optimizer.param_groups[0]["lr"] = 0.1
    ebc(kjt).values().sum().backward()
    assert any(not torch.equal(v, before[k]) for k, v in ebc.state_dict().items())
    scheduler = torch.optim.lr_scheduler.StepLR(ebc.fused_optimizer, step_size=1, gamma=0.5)
    ebc.fused_optimizer.step()
    scheduler.step()
    assert ebc.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_keys_that_do_not_match_are_named():
    tables = mixed_tables()
    ebc = CowClipEmbeddingBagCollection([replace(t) for t in tables])
    bags = {k: [[0]] for k in ["fa", "fb", "fc", "fd"]}
    with pytest.raises(ValueError, match=r"missing \['fe'\]"):
        ebc(kjt_from_bags(bags))
    with pytest.raises(ValueError, match=r"unexpected \['zz'\]"):
        ebc(kjt_from_bags({**bags, "fe": [[0]], "zz": [[0]]}))


@pytest.mark.parametrize("bad_id", [40, -1, 10**9])
def test_out_of_range_ids_raise_before_any_change(bad_id, device):
    tables = mixed_tables()
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables],
        device=device,
        options=CowClipOptions(optimizer="adam", lr=0.1),
    )
    before = copy.deepcopy(ebc.state_dict())
    bags = {
        "fa": [[1], [2]],
        "fb": [[3], [4, bad_id]],
        "fc": [[0], [0]],
        "fd": [[0], []],
        "fe": [[1], [1]],
    }
    with pytest.raises(IndexError) as err:
        ebc(to_device(kjt_from_bags(bags), device)).values().sum().backward()
    message = str(err.value)
    assert "'fb'" in message and "'shared'" in message and f"id {bad_id}" in message
    assert "sample 1" in message and "[0, 40)" in message
    for k, v in ebc.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(s.steps == 0 for s in ebc.clip_stats().values())


def test_nonfinite_row_gradients_are_skipped_and_counted():
    table = bag_config("t", 3)
    ebc = CowClipEmbeddingBagCollection([table], options=CowClipOptions(optimizer="adam", lr=0.1))
    before = ebc.embedding_bags["t"].weight.detach().clone()
    kjt = kjt_from_bags({"f": [[1, 2], [3], [2]]})
    out = ebc(kjt).values()
    upstream = torch.ones_like(out)
    upstream[1, 0] = float("nan")  # sample 1 looks up row 3 only
    (out * upstream).sum().backward()
    after = ebc.embedding_bags["t"].weight.detach()
    assert torch.isfinite(after).all()
    assert torch.equal(after[3], before[3])
    assert not torch.equal(after[1], before[1]) and not torch.equal(after[2], before[2])
    state = ebc.fused_optimizer.state_dict()["state"]["embedding_bags.t.weight"]
    assert torch.isfinite(state["exp_avg"]).all() and state["exp_avg"][3].abs().sum() == 0
    stats = ebc.clip_stats()["t"]
    assert (stats.rows_updated, stats.rows_nonfinite, stats.total_rows_nonfinite) == (2, 1, 1)


def test_weighted_collection_requires_weights_and_structure_is_checked():
    table = bag_config("t", 2, 5)
    ebc = CowClipEmbeddingBagCollection([table], is_weighted=True)
    with pytest.raises(ValueError, match="has no weights"):
        ebc(kjt_from_bags({"f": [[1]]}))
    plain = CowClipEmbeddingBagCollection([replace(table)])
    broken = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1])
    )
    with pytest.raises(ValueError, match="lengths add up to 2 but it has 3 values"):
        plain(broken)


def test_constructor_arguments_are_validated():
    table = bag_config("t", 2, 5)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        CowClipEmbeddingBagCollection([replace(table)], options=CowClipOptions(optimizer="lamb"))
    with pytest.raises(
        ValueError, match=r"unclipped_tables names tables that do not exist: \['nope'\]"
    ):
        CowClipEmbeddingBagCollection(
            [replace(table)], options=CowClipOptions(unclipped_tables=["nope"])
        )
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="lr must be >= 0 and finite"):
            CowClipEmbeddingBagCollection([replace(table)], options=CowClipOptions(lr=bad))
    with pytest.raises(ValueError, match="weight_decay must be >= 0 and finite"):
        CowClipEmbeddingBagCollection(
            [replace(table)], options=CowClipOptions(weight_decay=float("inf"))
        )
    with pytest.raises(ValueError, match="Duplicate table name"):
        CowClipEmbeddingBagCollection([replace(table), replace(table)])
    # One door: the options object, not its fields as keywords.
    with pytest.raises(TypeError, match="unexpected keyword argument 'lr'"):
        CowClipEmbeddingBagCollection([replace(table)], lr=0.1)
    with pytest.raises(TypeError, match="options must be a torchrec_cowclip.CowClipOptions"):
        CowClipEmbeddingBagCollection([replace(table)], options={"lr": 0.1})
    # The same check serves from_ebc and the sharder.
    from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder

    stock = EmbeddingBagCollection(tables=[replace(table)])
    for build in (
        lambda: CowClipEmbeddingBagCollection.from_ebc(stock, options={"lr": 0.1}),
        lambda: CowClipEmbeddingBagCollectionSharder(options={"lr": 0.1}),
    ):
        with pytest.raises(TypeError, match="options must be a torchrec_cowclip.CowClipOptions"):
            build()


@pytest.mark.parametrize(
    "key,value",
    [
        ("lr", float("inf")),
        ("lr", float("nan")),
        ("lr", -0.1),
        ("weight_decay", float("nan")),
        ("eps", 0.0),
    ],
)
def test_a_bad_lr_set_between_steps_raises_before_any_row_changes(key, value):
    tables = mixed_tables()
    gen = torch.Generator().manual_seed(3)
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables], options=CowClipOptions(lr=0.1)
    )
    ebc(random_kjt(tables, 4, gen)).values().sum().backward()
    before = copy.deepcopy(ebc.state_dict())
    state_before = copy.deepcopy(ebc.fused_optimizer.state_dict()["state"])
    ebc.fused_optimizer.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: {key} must be"):
        ebc(random_kjt(tables, 4, gen)).values().sum().backward()
    for k, v in ebc.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    after = ebc.fused_optimizer.state_dict()["state"]
    for param_key, state in state_before.items():
        for name, tensor in state.items():
            torch.testing.assert_close(after[param_key][name], tensor, rtol=0, atol=0)


def test_module_moves_and_copies_keep_tables_and_views_together():
    tables = mixed_tables()
    gen = torch.Generator().manual_seed(6)
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables], options=CowClipOptions(optimizer="adam", lr=0.1)
    )
    ebc = ebc.to(torch.device("cpu"))
    clone = copy.deepcopy(ebc)
    kjt = random_kjt(tables, 4, gen)
    before = copy.deepcopy(ebc.state_dict())
    clone(kjt).values().sum().backward()
    assert all(torch.equal(v, before[k]) for k, v in ebc.state_dict().items()), (
        "copy shares storage"
    )
    changed = [k for k, v in clone.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(tables), "the copy's update reaches its own state_dict views"
    assert clone.clip_stats()["shared"].steps == 1 and ebc.clip_stats()["shared"].steps == 0


def test_works_with_torchrec_keyed_optimizers():
    tables = mixed_tables()
    ebc = CowClipEmbeddingBagCollection([replace(t) for t in tables])
    model = torch.nn.ModuleDict({"ebc": ebc, "dense": torch.nn.Linear(3, 1)})
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    assert set(dense_params) == {"dense.weight", "dense.bias"}
    dense_opt = KeyedOptimizerWrapper(dense_params, lambda ps: torch.optim.Adam(ps, lr=1e-3))
    combined = CombinedOptimizer([("ebc", ebc.fused_optimizer), ("dense", dense_opt)])
    sd = combined.state_dict()["state"]
    assert "ebc.embedding_bags.shared.weight" in sd
    assert set(sd["ebc.embedding_bags.shared.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    combined.load_state_dict(combined.state_dict())


def test_single_and_multiple_table_batches_agree_with_torchrec_order():
    tables = [
        bag_config("a", 4, 10, ["x"]),
        bag_config("b", 2, 10, ["y"]),
        EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=10, feature_names=["z", "x"]),
    ]
    ours = CowClipEmbeddingBagCollection([replace(t) for t in tables])
    stock = EmbeddingBagCollection(tables=[replace(t) for t in tables])
    stock.load_state_dict(ours.state_dict())
    kjt = random_kjt(tables, 3, torch.Generator().manual_seed(8), key_order=["z", "y", "x"])
    a, b = ours(kjt), stock(kjt)
    assert a.keys() == b.keys() == ["x@a", "y", "z", "x@c"]
    torch.testing.assert_close(a.values(), b.values(), rtol=0, atol=0)


def test_table_batch_tensors_are_module_buffers_outside_the_state_dict():
    tables = mixed_tables()
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables], options=CowClipOptions(optimizer="adam")
    )
    batch = ebc._batches[0]
    names = dict(batch.named_buffers())
    assert {
        "weight",
        "step",
        "counters",
        "state_exp_avg",
        "state_exp_avg_sq",
        "row_offsets",
    } <= set(names)
    assert batch.state_dict() == {}  # TorchRec's per-table keys are the collection's
    assert set(ebc.state_dict()) == {f"embedding_bags.{t.name}.weight" for t in tables}
    ebc.track_row_clips()
    assert dict(batch.named_buffers())["row_counters"].shape == (2, batch.weight.shape[0])
    copy_of = copy.deepcopy(ebc)
    for a, b in zip(ebc._batches, copy_of._batches):
        assert a.weight.data_ptr() != b.weight.data_ptr()
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)


def test_an_empty_batch_and_empty_bags_update_nothing(update_path):
    """A batch of no samples (as the last partial batch of a split can be) and one of empty
    bags look up zeros, and their backward is a step that touches no row, on every path."""
    ebc = CowClipEmbeddingBagCollection(
        [bag_config("t", 4, 10, ["f"])], options=CowClipOptions(lr=0.1, cowclip=default_cowclip())
    )
    before = ebc.state_dict()["embedding_bags.t.weight"].clone()
    for lengths, shape in (([0, 0], (2, 4)), ([], (0, 4))):
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f"],
            values=torch.tensor([], dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int64),
        )
        out = ebc(kjt).values()
        assert out.shape == shape and not out.any()
        out.sum().backward()
    stats = ebc.clip_stats()["t"]
    assert stats.steps == 2 and stats.total_rows_updated == 0
    assert torch.equal(ebc.state_dict()["embedding_bags.t.weight"], before)


def test_int32_ids_and_lengths_train_as_int64_ones(update_path):
    """A KJT of int32 values and lengths (TorchRec's data pipelines make them) gives the
    int64 KJT's outputs and updates, on every path."""
    tables = mixed_tables()
    results = []
    for dtype in (torch.int64, torch.int32):
        ebc = CowClipEmbeddingBagCollection(
            [replace(t) for t in tables], init_seed=5, options=CowClipOptions(lr=0.1)
        )
        kjt = random_kjt(tables, batch_size=5, generator=torch.Generator().manual_seed(9))
        lengths = kjt.lengths()
        offsets = torch.cat([torch.zeros(1, dtype=lengths.dtype), lengths.cumsum(0)])
        kjt = KeyedJaggedTensor(
            keys=kjt.keys(),
            values=kjt.values().to(dtype),
            lengths=lengths.to(dtype),
            offsets=offsets.to(dtype),
        )
        out = ebc(kjt).values()
        (out * torch.arange(out.shape[1])).sum().backward()
        results.append((out.detach(), ebc.state_dict()))
    torch.testing.assert_close(results[1][0], results[0][0])
    for key, value in results[0][1].items():
        torch.testing.assert_close(results[1][1][key], value)


def test_a_negative_length_is_refused_in_one_line_before_any_change(update_path):
    ebc = CowClipEmbeddingBagCollection([bag_config("t", 2, 5)])
    before = ebc.state_dict()["embedding_bags.t.weight"].clone()
    broken = KeyedJaggedTensor(
        keys=["f"],
        values=torch.tensor([1, 2]),
        lengths=torch.tensor([2, -1, 1]),
        offsets=torch.tensor([0, 2, 1, 2]),
    )
    with pytest.raises(ValueError, match="^KeyedJaggedTensor has negative lengths$"):
        ebc(broken)
    assert torch.equal(ebc.state_dict()["embedding_bags.t.weight"], before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_dtype_gives_half_pooled_outputs_cast_once_and_trains_as_float32(dtype):
    tables = [bag_config("t", 4, 20)]
    half = CowClipEmbeddingBagCollection(
        tables, CowClipOptions(lr=0.1, output_dtype=dtype), init_seed=2
    )
    full = CowClipEmbeddingBagCollection(tables, CowClipOptions(lr=0.1), init_seed=2)
    kjt = kjt_from_bags({"f": [[1, 2, 2], [3], []]})
    for _ in range(2):
        got, expected = half(kjt).values(), full(kjt).values()
        assert got.dtype == dtype
        assert torch.equal(got, expected.to(dtype))
        got.float().sum().backward()
        expected.sum().backward()
    torch.testing.assert_close(half.state_dict(), full.state_dict(), rtol=0, atol=0)
    assert half.options.output_dtype == dtype
    with pytest.raises(ValueError, match="output_dtype must be one of"):
        CowClipOptions(output_dtype=torch.int8)

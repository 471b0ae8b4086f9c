"""Single-process parts of sharded CowClip: whole-row sums of column shards, the
data-parallel union, the planner's view of the optimizer state, refusals, and the
TorchRec extension points the sharder relies on (multi-rank runs: test_distributed.py)."""

from __future__ import annotations

import inspect
import shutil
from types import SimpleNamespace

import pytest
import torch
from tiny import bag_config
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.types import ParameterSharding, ShardingEnv

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection, CowClipOptions
from torchrec_cowclip.distributed import (
    SUPPORTED_SHARDING_TYPES,
    CowClipEmbeddingBagCollectionSharder,
)
from torchrec_cowclip.distributed.row_sync import union_row_gradients
from torchrec_cowclip.distributed.sharded_collection import _checked_plan
from torchrec_cowclip.embedding.row_gradients import RowGradients
from torchrec_cowclip.optim.functional import RowSums, cowclip_row_update_, partial_row_sums
from torchrec_cowclip.optim.rules import STATE_LAYOUT, update_rule


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
def test_column_shards_with_whole_row_sums_step_like_the_whole_rows(optimizer):
    gen = torch.Generator().manual_seed(0)
    u, d = 40, 12
    weight = torch.randn(u, d, generator=gen) * torch.logspace(-4, 0, u)[:, None]
    grad = torch.randn(u, d, generator=gen) * 0.05
    counts = torch.randint(1, 5, (u,), generator=gen)
    hyper = dict(
        lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3, cowclip=CowClip(r=1.0, zeta=1e-3)
    )

    def fresh_state():
        g = torch.Generator().manual_seed(1)
        return {
            n: torch.rand((u, d) if per == "D" else (u,), generator=g)
            for n, per in STATE_LAYOUT[optimizer]
        }

    whole_w, whole_state = weight.clone(), fresh_state()
    whole_clipped = cowclip_row_update_(
        update_rule(optimizer).step, whole_w, grad, counts, whole_state, torch.tensor(3), **hyper
    )
    assert 0 < int(whole_clipped.sum()) < u

    splits = [slice(0, 4), slice(4, 6), slice(6, 12)]  # uneven shards
    sums = sum(partial_row_sums(grad[:, s], weight[:, s]) for s in splits)
    row_sums = RowSums.from_sums(sums, dim=d)
    for s in splits:
        w = weight[:, s].clone()
        state = {
            n: (t[:, s].clone() if t.dim() == 2 else t.clone()) for n, t in fresh_state().items()
        }
        clipped = cowclip_row_update_(
            update_rule(optimizer).step,
            w,
            grad[:, s],
            counts,
            state,
            torch.tensor(3),
            row_sums=row_sums,
            **hyper,
        )
        assert torch.equal(clipped, whole_clipped)
        torch.testing.assert_close(w, whole_w[:, s], rtol=1e-5, atol=1e-7)
        for n, t in state.items():
            expected = whole_state[n][:, s] if t.dim() == 2 else whole_state[n]
            torch.testing.assert_close(t, expected, rtol=1e-5, atol=1e-7)


def test_row_sums_mark_a_row_non_finite_on_every_shard():
    grad = torch.ones(3, 4)
    grad[1, 3] = float("nan")
    weight = torch.ones(3, 4)
    sums = partial_row_sums(grad[:, :2], weight[:, :2]) + partial_row_sums(
        grad[:, 2:], weight[:, 2:]
    )
    assert RowSums.from_sums(sums, 4).finite.tolist() == [True, False, True]


def test_data_parallel_union_sums_counts_and_averages_gradients():
    a = RowGradients(
        rows=torch.tensor([1, 4]),
        counts=torch.tensor([2, 1]),
        grad=torch.tensor([[1.0, 1.0], [2.0, 0.0]]),
    )
    b = RowGradients(
        rows=torch.tensor([0, 4]),
        counts=torch.tensor([1, 3]),
        grad=torch.tensor([[5.0, 5.0], [0.0, 2.0]]),
    )
    union = union_row_gradients([a, b], scale=0.5)
    assert union.rows.tolist() == [0, 1, 4]
    assert union.counts.tolist() == [1, 2, 4]
    assert union.grad.tolist() == [[2.5, 2.5], [0.5, 0.5], [1.0, 1.0]]
    empty = RowGradients(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2)
    )
    assert union_row_gradients([empty, empty]).rows.numel() == 0


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="t", embedding_dim=16, num_embeddings=10_000, feature_names=["f"]
                )
            ],
            device=torch.device("meta"),
        )


def _planned_bytes(optimizer: str) -> dict:
    topology = Topology(world_size=2, compute_device="cpu")
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=512, estimator=[EmbeddingStorageEstimator(topology=topology)]
    )
    options = enumerator.enumerate(
        _Model(),
        [CowClipEmbeddingBagCollectionSharder(options=CowClipOptions(optimizer=optimizer))],
    )
    return {
        (o.sharding_type, o.compute_kernel): (o.shards[0].storage.ddr, o.shards[0].size)
        for o in options
    }


def test_planner_counts_the_optimizer_state_in_table_memory():
    sgd, adam, adagrad = (_planned_bytes(o) for o in ("sgd", "adam", "rowwise_adagrad"))
    assert {t for t, _ in sgd} == set(SUPPORTED_SHARDING_TYPES)
    assert {k for _, k in sgd} == {"fused"}
    for key, (sgd_bytes, (rows, cols)) in sgd.items():
        # Per shard: a table-wise/data-parallel shard holds 10,000 x 16, a row-wise one
        # half the rows, a column-wise one part of the columns.
        assert adam[key][0] - sgd_bytes == 2 * rows * cols * 4, key  # exp_avg + exp_avg_sq
        assert adagrad[key][0] - sgd_bytes == rows * 4, key  # one float per row


def test_sharder_offers_only_supported_types_and_refuses_others():
    sharder = CowClipEmbeddingBagCollectionSharder()
    for device in ("cpu", "cuda"):
        assert sharder.sharding_types(device) == list(SUPPORTED_SHARDING_TYPES)
    assert {"row_wise", "table_row_wise"} <= set(SUPPORTED_SHARDING_TYPES)
    env = ShardingEnv.from_local(world_size=2, rank=0)
    grid = ParameterSharding(sharding_type="grid_shard", compute_kernel="fused", ranks=[0, 1])
    with pytest.raises(ValueError, match="grid_shard.*not supported"):
        _checked_plan({"t": grid}, env)
    uvm = ParameterSharding(sharding_type="table_wise", compute_kernel="fused_uvm", ranks=[0])
    with pytest.raises(ValueError, match="fused_uvm"):
        _checked_plan({"t": uvm}, env)
    dense_dp = ParameterSharding(
        sharding_type="data_parallel", compute_kernel="dense", ranks=[0, 1]
    )
    assert _checked_plan({"t": dense_dp}, env)["t"].compute_kernel == "fused"


def test_sharder_options_are_validated_and_read_from_cowclip_modules():
    with pytest.raises(ValueError, match="optimizer"):
        CowClipEmbeddingBagCollectionSharder(options=CowClipOptions(optimizer="lamb"))
    with pytest.raises(ValueError, match="module_type"):
        CowClipEmbeddingBagCollectionSharder(module_type=nn.Linear)
    with pytest.raises(ValueError, match="unclipped_tables.*nope"):
        CowClipOptions(unclipped_tables=frozenset({"nope"})).check_tables(["t"])
    module = CowClipEmbeddingBagCollection(
        [
            bag_config("t"),
            bag_config("lin", 1),
        ],
        options=CowClipOptions(
            optimizer="rowwise_adagrad",
            lr=0.3,
            eps=1e-5,
            weight_decay=0.1,
            cowclip=None,
            unclipped_tables=("lin",),
        ),
    )
    module.fused_optimizer.param_groups[0]["lr"] = 0.2  # e.g. moved by a schedule
    # A sharder that says otherwise is refused (it used to be ignored silently).
    with pytest.raises(ValueError, match="disagree"):
        CowClipEmbeddingBagCollectionSharder(
            module_type=CowClipEmbeddingBagCollection,
            options=CowClipOptions(optimizer="sgd", lr=9.0),
        ).options_for(module)
    sharder = CowClipEmbeddingBagCollectionSharder(module_type=CowClipEmbeddingBagCollection)
    assert sharder.options_for(module) == CowClipOptions(
        optimizer="rowwise_adagrad",
        lr=0.2,
        eps=1e-5,
        weight_decay=0.1,
        cowclip=None,
        unclipped_tables=frozenset({"lin"}),
    )
    # The planner's view: aliases tagged with the optimizer, the module's own parameters untouched.
    tables = sharder.shardable_parameters(module)
    assert set(tables) == {"t", "lin"}
    assert tables["t"]._optimizer_classes[0].__name__ == "RowWiseAdagrad"
    assert not hasattr(module.embedding_bags["t"].weight, "_optimizer_classes")


def test_torchrec_extension_points_still_exist():
    """The sharder overrides these TorchRec methods; a TorchRec upgrade that renames or
    re-signs them must fail here, not silently fall back to FBGEMM's kernels."""
    assert list(
        inspect.signature(GroupedPooledEmbeddingsLookup._create_embedding_kernel).parameters
    ) == [
        "self",
        "config",
        "device",
        "pg",
        "sharding_type",
        "env",
    ]
    assert list(inspect.signature(ShardedEmbeddingBagCollection._create_lookups).parameters) == [
        "self"
    ]
    assert list(inspect.signature(ShardedEmbeddingBagCollection.init_data_parallel).parameters) == [
        "self"
    ]
    init = inspect.getsource(ShardedEmbeddingBagCollection.__init__)
    assert "self._create_lookups()" in init and "self.init_data_parallel()" in init
    assert init.index("self._create_lookups()") < init.index("self.init_data_parallel()")
    for module in ("tw_sharding", "cw_sharding", "dp_sharding"):
        source = inspect.getsource(
            __import__(f"torchrec.distributed.sharding.{module}", fromlist=["x"])
        )
        assert "grouped_configs=self._grouped_embedding_configs" in source, module


def _peers(monkeypatch, *theirs):
    """A process group of this rank and ``theirs`` ((kind, mode) of ranks 1, 2, ...)."""
    from torchrec_cowclip.distributed import sharded_collection as sc

    world = 1 + len(theirs)
    monkeypatch.setattr(sc.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sc.dist, "get_world_size", lambda pg: world)
    monkeypatch.setattr(sc.dist, "get_process_group_ranks", lambda pg: list(range(world)))

    def all_gather_object(out, mine, group=None):
        out[:] = [mine, *theirs]

    monkeypatch.setattr(sc.dist, "all_gather_object", all_gather_object)
    return lambda: sc._agreed_kernel(
        torch.device("cpu"),
        update_rule("adam"),
        SimpleNamespace(process_group=object()),
        sc.kernel_mode(),
    )


@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="no C++ compiler"
)
def test_the_ranks_agree_on_one_row_kernel(monkeypatch):
    """A rank whose native build failed (all in ``auto``): every rank takes its kernel,
    with a warning naming the ranks; ranks told different modes: an error naming the
    rank that differs."""
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "auto")
    assert _peers(monkeypatch, ("native_cpu", "auto"))().kind == "native_cpu"
    agree = _peers(monkeypatch, ("native_cpu", "auto"), ("eager", "auto"))
    with pytest.warns(
        RuntimeWarning, match="rank 0: native_cpu, rank 1: native_cpu, rank 2: eager"
    ):
        assert agree().kind == "eager"
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "0")
    disagree = _peers(monkeypatch, ("eager", "0"), ("native_cpu", "1"))
    with pytest.raises(
        ValueError,
        match=r"rank 2 updates its rows with the native_cpu row kernel "
        r"\(TORCHREC_COWCLIP_COMPILE=1\), rank 0 with eager \(TORCHREC_COWCLIP_COMPILE=0\)",
    ):
        disagree()

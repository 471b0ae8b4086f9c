"""Sharded CowClip training (torchrec_cowclip.distributed) on 2 CPU ranks with gloo.

Every job runs in spawned processes with bounded time (distributed_harness): collectives
time out after PG_TIMEOUT_S and a job is killed after its limit, so a failure can never
hang the suite. Gradient convention under test: each rank minimises the mean loss of its
local batch; TorchRec divides sharded-table gradients by the world size and the CowClip
data-parallel update averages the replicas' row gradients, so the sharded model must
equal the unsharded CowClipEmbeddingBagCollection trained on the global batch with the
global mean loss.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from typing import Dict

import distributed_cases as cases
import pytest
import torch
from distributed_harness import load_result, run_ranks, start_ranks
from tiny import bag_config
from torchrec import DataType, EmbeddingBagConfig, PoolingType

from torchrec_cowclip import CowClip, Helen
from torchrec_cowclip.optim.functional import cowclip_row_update_, sgd_step
from torchrec_cowclip.optim.options import CountLR

RTOL = 1e-5


def mixed_tables():
    return [
        # table-wise on rank 0; one table, two features
        EmbeddingBagConfig(
            name="tw", embedding_dim=8, num_embeddings=40, feature_names=["fa", "fb"]
        ),
        # table-wise on rank 1, MEAN pooling (a second kernel in the table-wise lookup)
        bag_config("tw_mean", 4, 30, ["fc"], pooling=PoolingType.MEAN),
        # column-wise over ranks 0 and 1
        bag_config("cw", 8, 50, ["fd"]),
        # column-wise, 3 shards: two on rank 0 (their partial norms add up locally first)
        bag_config("cw3", 12, 30, ["fe"]),
        # table-column-wise over ranks 1 and 0, MEAN pooling
        bag_config("twcw", 8, 30, ["ff"], pooling=PoolingType.MEAN),
        # data-parallel
        bag_config("dp", 4, 20, ["fg"]),
        # row-wise over both ranks (each id's row, and its count, on one rank), MEAN pooling
        bag_config("rw", 8, 30, ["fh"], pooling=PoolingType.MEAN),
        # table-row-wise within the host
        bag_config("twrw", 4, 26, ["fi"]),
        # unclipped first-order table sharing feature "fa" with "tw"
        bag_config("lin", 1, 20, ["fa"]),
    ]


MIXED_PLAN = {
    "tw": ("table_wise", [0]),
    "tw_mean": ("table_wise", [1]),
    "cw": ("column_wise", [0, 1]),
    "cw3": ("column_wise", [0, 0, 1]),
    "twcw": ("table_column_wise", [1, 0]),
    "dp": ("data_parallel", []),
    "rw": ("row_wise", [0, 1]),
    "twrw": ("table_row_wise", [0, 1]),
    "lin": ("table_wise", [1]),
}


def mixed(optimizer: str, **kw) -> cases.Scenario:
    return cases.Scenario(
        tables=mixed_tables(),
        plan=dict(MIXED_PLAN),
        optimizer=optimizer,
        unclipped=("lin",),
        steps=3,
        **kw,
    )


# --- the column-wise norm case -------------------------------------------------------------

NORM_LR, NORM_ZETA = 0.1, 1e-3


def _norm_case_weights() -> torch.Tensor:
    w = torch.zeros(10, 8)
    # Row 3: big left half, tiny right half. Whole-row norm ~2: its gradient (norm 1,
    # count 2, tau 4) is NOT clipped; the right shard alone (norm 2e-3, tau 4e-3) would be.
    w[3] = torch.tensor([1.0, 1.0, 1.0, 1.0, 1e-3, 1e-3, 1e-3, 1e-3])
    # Row 6: whole-row norm ~2, gradient norm ~3, count 1: clipped by ~2/3. The left shard
    # alone (gradient norm 0.1) would not be, the right one (norm 0.01) much harder.
    w[6] = torch.tensor([2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.01])
    return w


def _norm_case_grads() -> Dict[int, torch.Tensor]:
    return {3: torch.tensor([0.0] * 4 + [0.5] * 4), 6: torch.tensor([0.1, 0, 0, 0, 0, 0, 0, 3.0])}


def norm_scenario() -> cases.Scenario:
    # Global batch of 2 (one sample per rank): sample 0 looks up rows 3 and 6, sample 1
    # row 3. With the global mean loss, g_3 = (u_0 + u_1) / 2 and g_6 = u_0 / 2.
    g = _norm_case_grads()
    u0 = 2 * g[6]
    u1 = 2 * g[3] - u0
    batch = ({"f": [[3, 6], [3]]}, None, {"f": torch.stack([u0, u1])})
    return cases.Scenario(
        tables=[bag_config("cw", 8)],
        plan={"cw": ("column_wise", [0, 1])},
        optimizer="sgd",
        cowclip=CowClip(r=1.0, zeta=NORM_ZETA),
        steps=1,
        local_batch=1,
        weights={"cw": _norm_case_weights()},
        hyper=dict(lr=NORM_LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
        batches=[batch],
    )


def planner_scenario() -> cases.Scenario:
    tables = [
        bag_config("a", 8, 60, ["fa"]),
        EmbeddingBagConfig(
            name="b", embedding_dim=16, num_embeddings=40, feature_names=["fb", "fc"]
        ),
        bag_config("c", 4, 30, ["fd"]),
    ]
    return cases.Scenario(
        tables=tables,
        plan=None,
        optimizer="adam",
        steps=2,
        weighted=True,
        constraints={"a": ["table_wise"], "b": ["column_wise"]},
    )


SCENARIOS = {
    "adam": mixed("adam"),
    "rowwise_adagrad": mixed("rowwise_adagrad", seed=1),
    # SGD with the per-id-frequency lr: every sharding type must see the global counts.
    "sgd": mixed("sgd", seed=2, hyper={**cases.HYPER, "count_lr": CountLR(power=0.5, cap=2.0)}),
    "norms": norm_scenario(),
    # The module is a CowClipEmbeddingBagCollection (rowwise_adagrad, lr 0.05, "lin"
    # unclipped) and the sharder says nothing: the module's own options are used (a
    # sharder that says otherwise is refused: tests/test_torchrec_native.py).
    "cowclip_module": replace(mixed("rowwise_adagrad", seed=3), cowclip_module=True),
    "planner": planner_scenario(),
    # Float16 tables under every sharding type: stochastic rounding keyed by table, global
    # row and column, so every shard and replica rounds as the unsharded table does.
    "adam_fp16": replace(
        mixed("adam", seed=6), tables=[replace(t, data_type=DataType.FP16) for t in mixed_tables()]
    ),
    # Helen's two passes: the norms and largest counts combine over every sharding type.
    # A table's norm sums its shards' parts in another order than the unsharded sum, so the
    # second gradients differ in the last bits; eps 1e-3 keeps Adam from magnifying that
    # on gradient entries near eps (by lr / eps: 5e4 at eps 1e-6).
    "helen_adam": mixed(
        "adam", seed=4, helen=Helen(rho=0.5, bound=0.3), hyper={**cases.HYPER, "eps": 1e-3}
    ),
    "helen_rowwise_adagrad": mixed(
        "rowwise_adagrad",
        seed=5,
        cowclip=None,
        helen=Helen(rho=0.5),
        hyper={**cases.HYPER, "eps": 1e-3},
    ),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist") / "results.pt")
    run_ranks(cases.run_scenarios, 2, SCENARIOS, out, timeout_s=150)
    return load_result(out)


def _assert_states_equal(
    sharded: Dict[str, torch.Tensor], unsharded: Dict[str, torch.Tensor]
) -> None:
    assert set(sharded) == set(unsharded), sorted(set(sharded) ^ set(unsharded))
    for key, expected in unsharded.items():
        actual = sharded[key]
        assert not torch.isnan(actual).any(), f"{key}: some shard never reported"
        # Half tables: the float32 steps agree to the last bits, which can flip a rare
        # stochastic rounding decision by one unit in the last place.
        half = expected.dtype in (torch.float16, torch.bfloat16)
        rtol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(expected.dtype, RTOL)
        torch.testing.assert_close(
            actual.float() if half else actual,
            expected.float() if half else expected.to(actual.dtype),
            rtol=rtol,
            atol=1e-7,
            msg=lambda m: f"{key}: {m}",
        )


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
def test_sharded_steps_equal_unsharded_on_the_global_batch(results, optimizer):
    r = results[optimizer]
    assert r["plan"] == {t: kind for t, (kind, _) in MIXED_PLAN.items()}
    _assert_states_equal(r["sharded"], r["unsharded"])
    assert r["sharded_clips"] == r["unsharded_clips"]
    # The clip binds on some rows of every sharding type, and not on all of them.
    for table in ("tw", "tw_mean", "cw", "cw3", "twcw", "dp", "rw", "twrw"):
        updated, clipped = r["sharded_clips"][table]
        assert 0 < clipped < updated, (table, updated, clipped)
    assert r["sharded_clips"]["lin"][1] == 0  # unclipped table
    steps = {k: v for k, v in r["sharded"].items() if k.endswith("/step")}
    assert steps and all(int(v) == 3 for v in steps.values())  # one counter per table


def test_sharded_float16_tables_equal_unsharded_and_stay_float16(results):
    r = results["adam_fp16"]
    weights = {k: v for k, v in r["unsharded"].items() if k.endswith(".weight")}
    assert weights and all(v.dtype == torch.float16 for v in weights.values())
    assert all(r["sharded"][k].dtype == torch.float16 for k in weights)
    _assert_states_equal(r["sharded"], r["unsharded"])
    assert r["sharded_clips"] == r["unsharded_clips"]


@pytest.mark.parametrize("name", ["helen_adam", "helen_rowwise_adagrad"])
def test_sharded_helen_steps_equal_unsharded_on_the_global_batch(results, name):
    """Table-, column-, table-column-, row-, table-row-wise and data-parallel tables take
    the unsharded Helen step of the global batch; a plain backward is refused."""
    r = results[name]
    assert r["plan"] == {t: kind for t, (kind, _) in MIXED_PLAN.items()}
    _assert_states_equal(r["sharded"], r["unsharded"])
    assert r["sharded_clips"] == r["unsharded_clips"]
    assert "trained by Helen" in r["plain_backward_error"]
    steps = {k: v for k, v in r["sharded"].items() if k.endswith("/step")}
    assert steps and all(int(v) == 3 for v in steps.values())


def _adam_scenario_on_path(tmp_path_factory, mode):
    """The mixed-sharding Adam scenario with ``TORCHREC_COWCLIP_COMPILE=mode`` in every
    rank (inherited by the spawned ranks)."""
    out = str(tmp_path_factory.mktemp(f"dist_{mode}") / "results.pt")
    previous = os.environ.get("TORCHREC_COWCLIP_COMPILE")
    os.environ["TORCHREC_COWCLIP_COMPILE"] = mode
    try:
        run_ranks(cases.run_scenarios, 2, {"adam": SCENARIOS["adam"]}, out, timeout_s=240)
    finally:
        if previous is None:
            del os.environ["TORCHREC_COWCLIP_COMPILE"]
        else:
            os.environ["TORCHREC_COWCLIP_COMPILE"] = previous
    return load_result(out)


@pytest.fixture(scope="module")
def compiled_results(tmp_path_factory):
    """The mixed-sharding Adam scenario again, with the native update in every rank
    (column shards take the whole-row-sums variant of it)."""
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler for the native update")
    return _adam_scenario_on_path(tmp_path_factory, "1")


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    """The mixed-sharding Adam scenario on the Triton kernels in every rank (under
    Triton's interpreter without a GPU, TRITON_INTERPRET=1 from tests/conftest.py)."""
    from torchrec_cowclip.embedding import triton_ops

    reason = triton_ops.availability(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    return _adam_scenario_on_path(tmp_path_factory, "triton")


@pytest.mark.parametrize("path", ["compiled_results", "triton_results"])
def test_fused_sharded_update_equals_unsharded_and_eager(results, path, request):
    """Every sharding type (column shards with the whole rows' sums, replicas, row-wise) on
    the native and the Triton kernels, the ranks agreeing on the kind."""
    r = request.getfixturevalue(path)["adam"]
    _assert_states_equal(r["sharded"], r["unsharded"])
    _assert_states_equal(r["sharded"], results["adam"]["sharded"])
    assert r["sharded_clips"] == results["adam"]["sharded_clips"]


def test_state_dict_and_fused_optimizer_look_like_torchrecs(results):
    r = results["adam"]
    types = r["state_dict_types"]
    assert {k: v for k, v in types.items()} == {
        f"ebc.embedding_bags.{t}.weight": ("Tensor" if kind == "data_parallel" else "ShardedTensor")
        for t, (kind, _) in MIXED_PLAN.items()
    }
    # Rank 0's fused optimizer: the tables it holds a shard or replica of.
    assert r["optimizer_keys"] == sorted(
        f"ebc.embedding_bags.{t}.weight" for t in ("tw", "cw", "cw3", "twcw", "dp", "rw", "twrw")
    )
    assert all(g["lr"] == cases.HYPER["lr"] for g in r["hyperparameters"])
    assert set(r["compute_kernels"].values()) == {"fused"}  # data_parallel's "dense" read as fused
    assert r["dense_parameters"] == []  # every table is marked as updated in backward
    # Pin the TorchRec extension points: a TorchRec upgrade that stops calling them fails here.
    assert r["sharded_type"] == "ShardedCowClipEmbeddingBagCollection"
    assert sorted(r["lookup_types"]) == sorted(
        ["CowClipPooledEmbeddingsLookup"] * 5 + ["ReplicatedLookup"]
    )
    assert "CowClipBatchedEmbeddingBag" in r["kernel_types"]
    assert not any("Fused" in k and k != "CowClipBatchedEmbeddingBag" for k in r["kernel_types"])


def test_column_shards_clip_with_whole_row_norms(results):
    r = results["norms"]
    w0, grads = _norm_case_weights(), _norm_case_grads()
    counts = {3: 2, 6: 1}
    sharded = r["sharded"]["embedding_bags.cw.weight"]

    # What docs/algorithm.md gives for whole rows (SGD, no weight decay).
    expected = w0.clone()
    for j, g in grads.items():
        tau = counts[j] * max(w0[j].norm().item(), NORM_ZETA)
        scale = min(1.0, tau / g.norm().item())
        expected[j] = w0[j] - NORM_LR * scale * g
    torch.testing.assert_close(sharded, expected, rtol=RTOL, atol=1e-7)
    _assert_states_equal(r["sharded"], r["unsharded"])
    assert r["sharded_clips"]["cw"] == r["unsharded_clips"]["cw"] == (2, 1)  # row 6 only

    # What clipping each 4-column shard by its own norms would give: different rows.
    per_shard = w0.clone()
    clipped_per_shard = 0
    for cols in (slice(0, 4), slice(4, 8)):
        rows = torch.tensor(sorted(grads))
        w = per_shard[rows, cols].clone()
        g = torch.stack([grads[j][cols] for j in sorted(grads)])
        was = cowclip_row_update_(
            sgd_step,
            w,
            g,
            torch.tensor([counts[j] for j in sorted(grads)]),
            {},
            torch.tensor(1),
            lr=NORM_LR,
            cowclip=CowClip(r=1.0, zeta=NORM_ZETA),
        )
        per_shard[rows, cols] = w
        clipped_per_shard += int(was.sum())
    assert clipped_per_shard == 2  # both rows' right halves
    for j in grads:
        assert (sharded[j] - per_shard[j]).abs().max() > 0.02, j


def test_sharding_a_cowclip_collection_keeps_its_options(results):
    r = results["cowclip_module"]
    assert all(g["lr"] == cases.HYPER["lr"] for g in r["hyperparameters"])  # not the default 1e-4
    assert any(k.endswith("/sum") for k in r["sharded"])  # rowwise_adagrad, not the default adam
    _assert_states_equal(r["sharded"], r["unsharded"])
    assert r["sharded_clips"] == r["unsharded_clips"]
    assert r["sharded_clips"]["lin"][1] == 0 and r["sharded_clips"]["tw"][1] > 0


def test_planner_chosen_plan_with_weighted_features_trains_like_unsharded(results):
    r = results["planner"]
    assert r["plan"]["a"] == "table_wise" and r["plan"]["b"] == "column_wise"
    assert r["plan"]["c"] in {"table_wise", "column_wise", "table_column_wise", "data_parallel"}
    assert set(r["compute_kernels"].values()) == {"fused"}
    _assert_states_equal(r["sharded"], r["unsharded"])
    assert r["sharded_clips"] == r["unsharded_clips"]


# --- checkpoints across world sizes ---------------------------------------------------------

CKPT_STEPS, CKPT_A, CKPT_B = 6, 2, 4


def _ckpt_scenarios(world: int) -> Dict[str, cases.Scenario]:
    tables = [
        EmbeddingBagConfig(
            name="tw", embedding_dim=8, num_embeddings=40, feature_names=["fa", "fb"]
        ),
        bag_config("cw", 8, 50, ["fc"]),
        bag_config("dp", 4, 20, ["fd"]),
        bag_config("mean", 4, 30, ["fe"], pooling=PoolingType.MEAN),
        bag_config("rw", 4, 22, ["ff"]),
    ]
    if world == 2:
        plan = {
            "tw": ("table_wise", [0]),
            "cw": ("column_wise", [0, 1]),
            "dp": ("data_parallel", []),
            "mean": ("table_wise", [1]),
            "rw": ("row_wise", [0, 1]),
        }
    else:  # one rank: the column-wise table as two local shards, the data/row-sharded ones whole
        plan = {
            "tw": ("table_wise", [0]),
            "cw": ("column_wise", [0, 0]),
            "dp": ("table_wise", [0]),
            "mean": ("table_wise", [0]),
            "rw": ("table_wise", [0]),
        }
    return {
        name: cases.Scenario(
            tables=[replace(t, data_type=DataType.BF16) for t in tables]
            if name.endswith("bf16")
            else tables,
            plan=plan,
            optimizer=opt,
            steps=CKPT_STEPS,
            local_batch=8 // world,
            seed=10 + i,
            helen=Helen(rho=0.5) if name == "helen" else None,
        )
        for i, (name, opt) in enumerate(
            [
                ("adam", "adam"),
                ("rowwise_adagrad", "rowwise_adagrad"),
                ("helen", "adam"),
                ("adam_bf16", "adam"),
            ]
        )
    }


def test_checkpoint_saved_on_2_ranks_resumes_on_1_and_back(tmp_path):
    ckpt_a, ckpt_b = str(tmp_path / "a"), str(tmp_path / "b")
    out = {k: str(tmp_path / f"{k}.pt") for k in ("two", "one", "two_again")}
    # 2 ranks: steps 0-2, checkpoint A, steps 2-6.
    run_ranks(
        cases.checkpoint_phase,
        2,
        _ckpt_scenarios(2),
        None,
        0,
        ckpt_a,
        CKPT_A,
        out["two"],
        timeout_s=90,
    )
    # 1 rank: load A, steps 2-4, checkpoint B, steps 4-6.
    run_ranks(
        cases.checkpoint_phase,
        1,
        _ckpt_scenarios(1),
        ckpt_a,
        CKPT_A,
        ckpt_b,
        CKPT_B,
        out["one"],
        timeout_s=90,
    )
    # 2 ranks: load B, steps 4-6.
    run_ranks(
        cases.checkpoint_phase,
        2,
        _ckpt_scenarios(2),
        ckpt_b,
        CKPT_B,
        None,
        CKPT_B,
        out["two_again"],
        timeout_s=90,
    )
    finals = {k: load_result(v) for k, v in out.items()}
    for opt, s in _ckpt_scenarios(2).items():
        reference = cases.reference_states(s, 2, [CKPT_STEPS])[CKPT_STEPS]
        for run in ("two", "one", "two_again"):
            _assert_states_equal(finals[run][opt], reference)
    assert any(k.endswith("/sum") for k in finals["one"]["rowwise_adagrad"])
    # bfloat16 tables through torch.distributed.checkpoint, resharded both ways.
    bf16 = finals["two_again"]["adam_bf16"]
    assert any(v.dtype == torch.bfloat16 for k, v in bf16.items() if k.endswith(".weight"))


# --- failures are bounded --------------------------------------------------------------------

FAILURE_PG_TIMEOUT_S = 5.0


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_dying_or_stuck_rank_fails_the_job_with_a_clear_message(mode):
    # Rank 1 dies (or stops responding) in backward, after TorchRec's output all-to-all
    # and before the column-wise whole-row norm exchange; rank 0 must not hang there.
    job = start_ranks(cases.failing_rank_case, 2, mode, pg_timeout_s=FAILURE_PG_TIMEOUT_S)
    limit = 45.0
    rank0, rank1 = job.wait(timeout_s=limit, ranks=[0])
    assert rank0.exitcode == 1, (rank0, rank1)
    assert rank0.seconds < limit
    assert "CowClip sharded update" in rank0.error and "all-reduce" in rank0.error, rank0.error
    assert "rank 0" in rank0.error
    if mode == "exit":
        assert rank1.exitcode == 3


def test_three_ranks_column_shards_over_subgroups(tmp_path):
    # Column-wise tables over ranks {0,1}, {1,2} and all three: two process subgroups,
    # and ranks whose lookups hold different tables must still meet in the same order.
    tables = [
        bag_config("cw01", 8, 40, ["fa"]),
        bag_config("cw12", 8, 30, ["fb"]),
        EmbeddingBagConfig(
            name="cw_all", embedding_dim=12, num_embeddings=30, feature_names=["fc"]
        ),
        bag_config("tw", 4, 20, ["fd"]),
        bag_config("dp", 4, 20, ["fe"]),
    ]
    plan = {
        "cw01": ("column_wise", [0, 1]),
        "cw12": ("column_wise", [2, 1]),
        "cw_all": ("column_wise", [0, 1, 2]),
        "tw": ("table_wise", [2]),
        "dp": ("data_parallel", []),
    }
    scenarios = {
        "three": cases.Scenario(
            tables=tables, plan=plan, optimizer="rowwise_adagrad", steps=3, local_batch=3, seed=5
        )
    }
    out = str(tmp_path / "three.pt")
    run_ranks(cases.run_scenarios, 3, scenarios, out, timeout_s=90)
    r = load_result(out)["three"]
    _assert_states_equal(r["sharded"], r["unsharded"])
    assert r["sharded_clips"] == r["unsharded_clips"]
    for table in ("cw01", "cw12", "cw_all"):
        assert r["sharded_clips"][table][1] > 0, table

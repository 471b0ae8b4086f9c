"""Rank functions of tests/test_torchrec_native.py (run by distributed_harness).

Each trains DistributedModelParallel models configured the way a TorchRec user does -
``fused_params``, ``apply_optimizer_in_backward``, ``get_default_sharders``, stock FBGEMM
checkpoints, ``TrainPipelineSparseDist`` - and rank 0 saves what the test asserts on.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import distributed_cases as cases  # noqa: E402  (tests/ is on sys.path in spawned ranks)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cowclip_testing import kjt_from_bags
from distributed_cases import Model, gather_full, global_batches, local_slice, mean_loss
from distributed_harness import save_result
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from tiny import TINY_PROCESSES, bag_config, tiny_config
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection, CowClipOptions
from torchrec_cowclip.distributed import (
    CowClipEmbeddingBagCollectionSharder,
    ShardedCowClipEmbeddingBagCollection,
    get_default_sharders,
)
from torchrec_cowclip.optim import CowClipRowWiseAdagrad
from torchrec_cowclip.optim.fbgemm_state import fbgemm_state_dict
from torchrec_cowclip.optim.fused import model_fused_optimizer
from torchrec_cowclip.run.safe_load import SafeFileSystemReader, SafeLoadPlanner

LR = 0.5
#: What FBGEMM trains when fused_params name only the optimizer and the lr.
STOCK_PARAMS = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8}


def tables() -> List[EmbeddingBagConfig]:
    return [
        bag_config("t0", 8, 40, ["f0"]),
        bag_config("t1", 8, 30, ["f1"]),
        bag_config("rw", 4, 30, ["f2"]),
        bag_config("cw", 8, 20, ["f3"]),
        bag_config("dp", 4, 20, ["f4"]),
    ]


PLAN_TYPES = {
    "t0": lambda: table_wise(rank=0, compute_kernel="fused"),
    "t1": lambda: table_wise(rank=1, compute_kernel="fused"),
    "rw": lambda: row_wise(compute_kernel="fused"),
    "cw": lambda: column_wise(ranks=[0, 1], compute_kernel="fused"),
    "dp": data_parallel,
}


def scenario(names: List[str]) -> cases.Scenario:
    return cases.Scenario(
        tables=[t for t in tables() if t.name in names], plan=None, steps=4, seed=7
    )


def build(
    names: List[str],
    sharders: List[Any],
    world: int,
    mark: Optional[Callable[[EmbeddingBagCollection], None]] = None,
) -> DistributedModelParallel:
    """A plain EBC on meta (marked by ``mark``), sharded with ``sharders`` on a fixed plan,
    started from the scenario's initial weights."""
    ebc = EmbeddingBagCollection(
        tables=[t for t in tables() if t.name in names], device=torch.device("meta")
    )
    if mark is not None:
        mark(ebc)
    model = Model(ebc)
    sharder = next(s for s in sharders if s.module_type is EmbeddingBagCollection)
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                ebc,
                {n: PLAN_TYPES[n]() for n in names},
                sharder=sharder,
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        }
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        sharders=sharders,
        plan=plan,
    )
    weights = cases.initial_weights(scenario(names))
    dmp.load_state_dict({f"ebc.embedding_bags.{n}.weight": w for n, w in weights.items()})
    return dmp


def train(
    dmp: DistributedModelParallel, names: List[str], steps: slice, rank: int, world: int
) -> None:
    s = scenario(names)
    for batch in global_batches(s, world, s.steps)[steps]:
        bags, _, upstream = local_slice(batch, rank, s.local_batch)
        mean_loss(dmp(kjt_from_bags(bags)).to_dict(), upstream).backward()


def full_state(
    dmp: DistributedModelParallel, state_names: Dict[str, str]
) -> Dict[str, torch.Tensor]:
    """Weights and optimizer states, gathered; state names mapped through ``state_names``
    (stock ``t0.momentum1`` and ours ``sum`` -> ``accumulator``)."""
    named: Dict[str, Any] = dict(dmp.state_dict())
    for key, state in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            short = name.split(".")[-1]
            if short in state_names:
                named[f"{key}/{state_names[short]}"] = value
    return gather_full(named)


ACCUMULATOR = {"sum": "accumulator", "momentum1": "accumulator"}


# --- the ways in ---------------------------------------------------------------------


def doors(rank: int, world: int) -> Dict[str, Any]:
    """Row-wise Adagrad at lr 0.5 with the default clip, configured four ways."""
    names = ["t0", "t1", "rw", "cw", "dp"]
    native = get_default_sharders(options=CowClipOptions(optimizer="rowwise_adagrad", lr=LR))
    ways: Dict[str, Any] = {
        "options": (native, None),
        "fused_params": (
            get_default_sharders(
                fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR}
            ),
            None,
        ),
        "apply_optimizer_in_backward": (
            get_default_sharders(),
            lambda ebc: apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR}),
        ),
        "cowclip_optimizer_class": (
            get_default_sharders(),
            lambda ebc: apply_optimizer_in_backward(
                CowClipRowWiseAdagrad, ebc.parameters(), {"lr": LR}
            ),
        ),
    }
    out: Dict[str, Any] = {}
    for way, (sharders, mark) in ways.items():
        dmp = build(names, sharders, world, mark)
        train(dmp, names, slice(None), rank, world)
        out[way] = {
            "state": full_state(dmp, ACCUMULATOR),
            "options": dmp.module.ebc.cowclip_options,
        }

    # apply_optimizer_in_backward with cowclip=None on one table: that table is unclipped.
    def unclip_t1(ebc: EmbeddingBagCollection) -> None:
        for name, param in ebc.embedding_bags.named_parameters():
            clip = None if name.startswith("t1.") else CowClip(r=1.0, zeta=1e-3)
            apply_optimizer_in_backward(CowClipRowWiseAdagrad, [param], {"lr": LR, "cowclip": clip})

    dmp = build(names, get_default_sharders(), world, unclip_t1)
    out["unclipped_by_mark"] = dmp.module.ebc.cowclip_options
    return out


# --- default sharders and the missing-sharder error ---------------------------------


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables()[:2], device=torch.device("meta"))
        self.cowclip_ebc = CowClipEmbeddingBagCollection(
            [
                replace(t, name="c" + t.name, feature_names=["g" + t.feature_names[0]])
                for t in tables()[:2]
            ],
            device="meta",
            options=CowClipOptions(optimizer="sgd", lr=0.1),
        )
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="e0", embedding_dim=8, num_embeddings=20, feature_names=["h0"])
            ],
            device=torch.device("meta"),
        )

    def forward(self, kjt: Any, gkjt: Any, hkjt: Any) -> Any:
        return self.ebc(kjt), self.cowclip_ebc(gkjt), self.ec(hkjt)


def default_sharders_case(rank: int, world: int) -> Dict[str, Any]:
    dmp = DistributedModelParallel(
        Mixed(), sharders=get_default_sharders(), device=torch.device("cpu")
    )
    kinds = {name: type(m).__name__ for name, m in dmp.module.named_children()}
    f = {"f0": [[1, 2], [3]], "f1": [[4], []]}
    g = {"gf0": [[1], [2, 2]], "gf1": [[3], [4]]}
    h = {"h0": [[1, 2], [5]]}
    pooled, cowclip_pooled, sequence = dmp(kjt_from_bags(f), kjt_from_bags(g), kjt_from_bags(h))
    loss = pooled.values().sum() + cowclip_pooled.values().square().sum()
    loss = loss + sum(jt.values().sum() for jt in sequence.values())
    loss.backward()
    cowclip = dmp.module.cowclip_ebc
    assert isinstance(cowclip, ShardedCowClipEmbeddingBagCollection)
    return {
        "kinds": kinds,
        "cowclip_options": cowclip.cowclip_options,
        "cowclip_updated": {
            t: s.total_rows_updated for t, s in cowclip.global_clip_stats().items()
        },
    }


def missing_sharder_case(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, sharders in (
        ("torchrec_defaults", None),
        ("ebc_sharder_only", [CowClipEmbeddingBagCollectionSharder()]),
    ):
        model = Model(CowClipEmbeddingBagCollection(tables()[:2], device="meta"))
        try:
            DistributedModelParallel(model, sharders=sharders, device=torch.device("cpu"))
            out[name] = None
        except RuntimeError as e:
            out[name] = str(e)
        out[f"{name}_still_meta"] = all(b.weight.device.type == "meta" for b in model.ebc._batches)
    return out


# --- stock FBGEMM checkpoints ------------------------------------------------------


def stock_checkpoints(rank: int, world: int, root: str) -> Dict[str, Any]:
    """A stock run (FBGEMM EXACT_ROWWISE_ADAGRAD) checkpointed after 2 of 4 steps and
    resumed with CowClip (clip off) must end where the stock run does; and back."""
    names = ["t0", "t1", "rw"]
    stock = [EmbeddingBagCollectionSharder(fused_params=dict(STOCK_PARAMS))]
    ours = get_default_sharders(fused_params={**STOCK_PARAMS, "cowclip": None})
    out: Dict[str, Any] = {}

    # stock -> CowClip
    a = build(names, stock, world)
    train(a, names, slice(0, 2), rank, world)
    stock_dir = os.path.join(root, "stock")
    dcp.save(
        {"model": a.state_dict(), "optim": a.fused_optimizer.state_dict()}, checkpoint_id=stock_dir
    )
    out["stock_at_2"] = full_state(a, ACCUMULATOR)
    train(a, names, slice(2, 4), rank, world)
    out["stock_final"] = full_state(a, ACCUMULATOR)
    b = build(names, ours, world)
    state = {"model": b.state_dict(), "optim": fbgemm_state_dict(b.fused_optimizer.state_dict())}
    dcp.load(state, storage_reader=SafeFileSystemReader(stock_dir), planner=SafeLoadPlanner())
    b.load_state_dict(state["model"])
    out["resumed_by_cowclip_at_2"] = full_state(b, ACCUMULATOR)
    train(b, names, slice(2, 4), rank, world)
    out["cowclip_final"] = full_state(b, ACCUMULATOR)
    # the unconverted state dict does not load a stock checkpoint
    try:
        plain = build(names, ours, world)
        dcp.load({"optim": plain.fused_optimizer.state_dict()}, checkpoint_id=stock_dir)
        out["unconverted_error"] = None
    except CheckpointException as e:  # a BaseException, raised on every rank
        out["unconverted_error"] = str(e)

    # CowClip -> stock
    c = build(names, ours, world)
    train(c, names, slice(0, 2), rank, world)
    ours_dir = os.path.join(root, "ours")
    dcp.save(
        {"model": c.state_dict(), "optim": fbgemm_state_dict(c.fused_optimizer.state_dict())},
        checkpoint_id=ours_dir,
    )
    train(c, names, slice(2, 4), rank, world)
    out["cowclip_run_final"] = full_state(c, ACCUMULATOR)
    d = build(names, stock, world)
    state = {"model": d.state_dict(), "optim": d.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=ours_dir)
    d.load_state_dict(state["model"])
    train(d, names, slice(2, 4), rank, world)
    out["stock_resumed_final"] = full_state(d, ACCUMULATOR)
    return out


# --- optimizer-state keys ------------------------------------------------------------


def optimizer_keys_case(rank: int, world: int) -> Dict[str, Any]:
    names = ["t0", "t1", "rw", "cw", "dp"]
    sharders = get_default_sharders(options=CowClipOptions(optimizer="adam"))
    dmp = build(names, sharders, world)
    sharded = {k: sorted(v) for k, v in dmp.fused_optimizer.state_dict()["state"].items()}
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, sharded)
    merged: Dict[str, Any] = {}
    for part in everyone:
        merged.update(part)
    unsharded = Model(
        CowClipEmbeddingBagCollection(tables(), options=CowClipOptions(optimizer="adam"))
    )
    local = {
        k: sorted(v) for k, v in model_fused_optimizer(unsharded).state_dict()["state"].items()
    }
    return {"sharded": merged, "unsharded": local}


def run(rank: int, world: int, root: str, out_path: str) -> None:
    results = {
        "doors": doors(rank, world),
        "default_sharders": default_sharders_case(rank, world),
        "missing_sharder": missing_sharder_case(rank, world),
        "stock_checkpoints": stock_checkpoints(rank, world, root),
        "optimizer_keys": optimizer_keys_case(rank, world),
    }
    if rank == 0:
        save_result(results, out_path)


# --- Helen through TorchRec's sparse-dist pipeline ----------------------------------


def trainer_state(trainer: Any) -> Dict[str, torch.Tensor]:
    """The trainer's weights and optimizer states, gathered over the ranks."""
    from trainer_cases import named_tensors

    return gather_full(named_tensors(trainer))


def manual_helen_steps(trainer: Any, steps: int) -> List[float]:
    """The two-pass loop written out: ``helen_step`` with a closure that runs the model,
    the second forward under DDP's ``no_sync()``, then the optimizers' step."""
    from contextlib import nullcontext

    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchrec_cowclip.compat import dmp_data_parallel

    runtime = trainer.runtime
    module = runtime.embedding_module()
    perturb_dense = module.helen.perturb_dense
    dense = [p for _, p in in_backward_optimizer_filter(runtime.train_module.named_parameters())]
    ddp = dmp_data_parallel(runtime.train_module)
    batches = runtime.train_batches(0, 0)
    losses = []
    for _ in range(steps):
        batch = next(batches)
        runtime.optimizer.zero_grad()
        calls: List[int] = []

        def closure() -> torch.Tensor:
            second = bool(calls) and ddp is not None and not perturb_dense
            with ddp.no_sync() if second else nullcontext():
                loss, _ = runtime.train_module(batch)
            calls.append(1)
            return loss

        loss = module.helen_step(closure, dense_params=dense if perturb_dense else None)
        losses.append(float(loss))
        runtime.optimizer.step()
    return losses


def pipeline_helen_steps(trainer: Any, steps: int) -> Tuple[str, List[float]]:
    """The runtime's own pipeline (its class name, and the losses of ``steps`` steps)."""
    runtime = trainer.runtime
    pipeline = runtime.pipeline()
    batches = runtime.train_batches(0, 0)
    runtime.train_module.train()
    losses = [float(pipeline.progress(batches)[0]) for _ in range(steps)]
    runtime.end_pipeline(pipeline)
    return type(pipeline).__name__, losses


def helen_pipeline_case(rank: int, world: int, root: str, out_path: str) -> None:
    from trainer_cases import _as_torchrun

    from torchrec_cowclip.train.start import start_run

    _as_torchrun(rank, world)
    results: Dict[str, Any] = {}
    for name, overrides in {
        "rowwise": dict(sharding="row_wise"),
        "data_parallel_perturbed": dict(sharding="data_parallel", helen_perturb_dense=True),
    }.items():
        config = tiny_config(
            root,
            TINY_PROCESSES,
            helen_rho=0.05,
            out=os.path.join(root, name, "pipeline"),
            **overrides,
        )
        piped = start_run(config.resolve())
        piped.run_dir.release()
        pipeline_type, pipeline_losses = pipeline_helen_steps(piped, 4)
        manual = start_run(replace(config, out=os.path.join(root, name, "manual")).resolve())
        manual.run_dir.release()
        manual_losses = manual_helen_steps(manual, 4)
        results[name] = {
            "pipeline_type": pipeline_type,
            "pipeline": trainer_state(piped),
            "manual": trainer_state(manual),
            "pipeline_losses": pipeline_losses,
            "manual_losses": manual_losses,
        }
    if rank == 0:
        save_result(results, out_path)

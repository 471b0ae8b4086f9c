"""Rank functions of the multi-process trainer tests (run by distributed_harness).

Each rank joins the harness's gloo group and runs :class:`Trainer` as ``torchrun``
would run it (the environment names rank and world size).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from distributed_cases import gather_full

from torchrec_cowclip.train import TrainConfig
from torchrec_cowclip.train.trainer import Trainer

#: Metrics that a resumed run must reproduce exactly.
EXACT = (
    "epoch_auc",
    "epoch_logloss",
    "steps",
    "train_samples",
    "rows_updated",
    "rows_clipped",
    "rows_nonfinite",
    "clipped_per_table",
    "best_epoch",
)


def tiny_config(root: str, **overrides: Any) -> TrainConfig:
    base = TrainConfig(
        model="deepfm",
        data="synthetic:16000",
        batch_size=1536,
        hidden=(16, 16),
        synthetic_scale=0.01,
        synthetic_max_cardinality=3000,
        lr_embed=1e-2,
        epochs=2,
        progress=False,
        cache_dir=os.path.join(root, "cache"),
        out=os.path.join(root, "run"),
        dist_timeout_s=60,
        val_fraction=0.1,
        early_stop_patience=3,
        embedding_dim=6,
    )
    return replace(base, **overrides)


def _as_torchrun(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))


def exact_metrics(out: str) -> Dict[str, Any]:
    metrics = json.loads(open(os.path.join(out, "metrics.json")).read())
    return {k: metrics[k] for k in EXACT}


def train_phases(rank: int, world: int, runs: List[Tuple[str, Dict[str, Any]]]) -> None:
    """Runs ``Trainer(tiny_config(root, **options)).run()`` for each ``(root, options)``
    in turn (several runs per job: the spawn and imports dominate a tiny run)."""
    _as_torchrun(rank, world)
    for root, options in runs:
        Trainer(tiny_config(root, **options)).run()
        dist.barrier()


def die_in_second_checkpoint(rank: int, world: int, root: str, overrides: Dict[str, Any]) -> None:
    """Trains with ``checkpoint_every``; rank 1 is killed after writing its part of the
    second checkpoint, before the checkpoint is complete."""
    from torch.distributed.checkpoint import state_dict_saver

    _as_torchrun(rank, world)
    real_save, saves = state_dict_saver.save, {"n": 0}

    def save(state: Any, checkpoint_id: str) -> Any:
        saves["n"] += 1
        result = real_save(state, checkpoint_id=checkpoint_id)
        if saves["n"] == 2 and rank == 1:
            os._exit(9)  # as SIGKILL: no cleanup, no barrier
        return result

    state_dict_saver.save = save
    Trainer(tiny_config(root, **overrides)).run()


def restored_state(
    rank: int, world: int, root: str, overrides: Dict[str, Any], out_path: str
) -> None:
    """Loads the run's latest checkpoint at this world size; rank 0 writes the full
    weights and optimizer states, gathered from every rank. Then trains on from there."""
    _as_torchrun(rank, world)
    trainer = Trainer(tiny_config(root, resume=True, **overrides))
    trainer.restore()
    trainer.run_dir.release()  # run() would release the --out lock at its end
    tensors = trainer.runtime.tensors()
    named: Dict[str, Any] = {f"model/{k}": v for k, v in tensors["model"].items()}
    for key, state in tensors["optimizer"]["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) or hasattr(value, "local_shards"):
                named[f"optimizer/{key}/{name}"] = value
    full = gather_full(named)
    counters = trainer.runtime.table_counters()
    if rank == 0:
        torch.save(
            {"tensors": full, "counters": counters, "progress": trainer.progress.__dict__}, out_path
        )
    dist.barrier()
    Trainer(tiny_config(root, resume=True, **overrides)).run()


def local_restored_state(root: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
    """The same, in this process (one process, no sharding)."""
    trainer = Trainer(tiny_config(root, resume=True, **overrides))
    trainer.restore()
    trainer.run_dir.release()
    tensors = trainer.runtime.tensors()
    named = {f"model/{k}": v.detach().clone() for k, v in tensors["model"].items()}
    for key, state in tensors["optimizer"]["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                named[f"optimizer/{key}/{name}"] = value.detach().clone()
    return {
        "tensors": named,
        "counters": trainer.runtime.table_counters(),
        "progress": dict(trainer.progress.__dict__),
    }

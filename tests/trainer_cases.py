"""Rank functions of the multi-process trainer tests (run by distributed_harness).

Each rank joins the harness's gloo group and runs :func:`~torchrec_cowclip.train.start.start_run`'s loop as ``torchrun``
would run it (the environment names rank and world size).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from distributed_cases import gather_full
from distributed_harness import save_result
from tiny import TINY_PROCESSES, tiny_config

from torchrec_cowclip.train.loop import TrainingLoop
from torchrec_cowclip.train.start import start_run

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


def _as_torchrun(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))


def named_tensors(trainer: Any) -> Dict[str, Any]:
    """The trainer's weights and optimizer states by name (``model/...``,
    ``optimizer/<key>/<state>``), this rank's shards as they are."""
    tensors = trainer.runtime.tensors()
    named: Dict[str, Any] = {f"model/{k}": v for k, v in tensors["model"].items()}
    for key, state in tensors["optimizer"]["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) or hasattr(value, "local_shards"):
                named[f"optimizer/{key}/{name}"] = value
    return named


def exact_metrics(out: str) -> Dict[str, Any]:
    metrics = json.loads(open(os.path.join(out, "metrics.json")).read())
    return {k: metrics[k] for k in EXACT}


def train_phases(rank: int, world: int, runs: List[Tuple[str, Dict[str, Any]]]) -> None:
    """Runs ``start_run(tiny_config(root, TINY_PROCESSES, **options).resolve()).run()`` for each ``(root, options)``
    in turn (several runs per job: the spawn and imports dominate a tiny run)."""
    _as_torchrun(rank, world)
    for root, options in runs:
        start_run(tiny_config(root, TINY_PROCESSES, **options).resolve()).run()
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
    start_run(tiny_config(root, TINY_PROCESSES, **overrides).resolve()).run()


def restored_state(
    rank: int, world: int, root: str, overrides: Dict[str, Any], out_path: str
) -> None:
    """Loads the run's latest checkpoint at this world size; rank 0 writes the full
    weights and optimizer states, gathered from every rank. Then trains on from there."""
    _as_torchrun(rank, world)
    trainer = start_run(tiny_config(root, TINY_PROCESSES, resume=True, **overrides).resolve())
    trainer.restore()
    trainer.run_dir.release()  # run() would release the --out lock at its end
    full = gather_full(named_tensors(trainer))
    counters = trainer.runtime.table_counters()
    if rank == 0:
        save_result(
            {"tensors": full, "counters": counters, "progress": trainer.progress.__dict__}, out_path
        )
    dist.barrier()
    start_run(tiny_config(root, TINY_PROCESSES, resume=True, **overrides).resolve()).run()


def local_restored_state(root: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
    """The same, in this process (one process, no sharding)."""
    trainer = start_run(tiny_config(root, TINY_PROCESSES, resume=True, **overrides).resolve())
    trainer.restore()
    trainer.run_dir.release()
    return {
        "tensors": {k: v.detach().clone() for k, v in named_tensors(trainer).items()},
        "counters": trainer.runtime.table_counters(),
        "progress": dict(trainer.progress.__dict__),
    }


def _check_sharded_atomic_load(trainer: TrainingLoop) -> None:
    """A sharded kernel's fused optimizer refuses a state dict with one wrong-shaped
    tensor whole, naming it, and keeps every state tensor as it was."""
    from torchrec_cowclip.optim.load_check import StateDictMismatch

    kernel = trainer.runtime.embedding_module()._kernels()[0]
    optimizer = kernel.fused_optimizer
    live = optimizer.state_dict()
    before = {
        (key, name): [s.tensor.clone() for s in value.local_shards()]
        if hasattr(value, "local_shards")
        else [value.clone()]
        for key, state in live["state"].items()
        for name, value in state.items()
    }
    bad = {"state": {k: dict(v) for k, v in live["state"].items()}}
    for value in bad["state"].values():  # every tensor doubled, the last one misshapen
        for name, tensor in list(value.items()):
            value[name] = tensor * 2 if not hasattr(tensor, "local_shards") else tensor
    last_key = sorted(bad["state"])[-1]
    last_name = sorted(bad["state"][last_key])[-1]
    bad["state"][last_key][last_name] = torch.zeros(3, 3, 3)
    try:
        optimizer.load_state_dict(bad)
    except StateDictMismatch as e:
        assert f"[{last_key!r}][{last_name!r}]" in str(e), str(e)
    else:
        raise AssertionError("a misshapen state dict was loaded")
    for key, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            pieces = (
                [s.tensor for s in value.local_shards()]
                if hasattr(value, "local_shards")
                else [value]
            )
            assert all(torch.equal(a, b) for a, b in zip(pieces, before[(key, name)])), name


def train_until_signal(
    rank: int,
    world: int,
    root: str,
    overrides: Dict[str, Any],
    signalled_rank: int,
    at_step: int,
    out_path: str,
) -> None:
    """Trains; rank ``signalled_rank`` alone gets SIGTERM during step ``at_step``. Every
    rank must stop after that same step with ``RunStopped`` (one checkpoint written);
    rank 0 writes the stop message to ``out_path``. Also checks the sharded fused
    optimizer's all-or-nothing load first."""
    import signal

    from torchrec_cowclip.run.stop import RunStopped

    _as_torchrun(rank, world)
    trainer = start_run(tiny_config(root, TINY_PROCESSES, **overrides).resolve())
    _check_sharded_atomic_load(trainer)
    real = trainer.runtime.step_summary
    steps = {"n": 0}

    def summary(loss: float, samples: int, stop: bool) -> Any:
        steps["n"] += 1
        if rank == signalled_rank and trainer.progress.global_step + 1 == at_step:
            os.kill(os.getpid(), signal.SIGTERM)  # handled: the flag is set at once
            stop = trainer.stop.requested is not None
        return real(loss, samples, stop)

    trainer.runtime.step_summary = summary  # type: ignore[method-assign]
    try:
        trainer.run()
    except RunStopped as stopped:
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"message": str(stopped), "step": trainer.progress.global_step}, f)
        return
    raise AssertionError(f"rank {rank} was not stopped")


def hang_in_step(rank: int, world: int, root: str, at_step: int) -> None:
    """Rank 1 stops responding in step ``at_step``; rank 0 must fail with a
    ``CollectiveError`` naming the step (the harness records its traceback)."""
    import time

    _as_torchrun(rank, world)
    trainer = start_run(tiny_config(root, TINY_PROCESSES, sharding="table_wise").resolve())
    real = trainer.runtime.step

    def step(pipeline: Any, batches: Any, number: int) -> Any:
        if rank == 1 and number == at_step:
            time.sleep(600)
        return real(pipeline, batches, number)

    trainer.runtime.step = step  # type: ignore[method-assign]
    trainer.run()

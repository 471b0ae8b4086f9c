"""Running the trainer on several processes: process group, sharding plan, DMP wrap,
and how each rank takes its part of every global batch.

Under ``torchrun`` (or torchx's ``dist.ddp``) the environment names the rank and world
size; the trainer then initialises gloo on CPU or NCCL on CUDA, shards the model's
embeddings with TorchRec's ``DistributedModelParallel`` and the project's CowClip
sharder, and gives each rank ``batch_size / world_size`` rows of every global batch, so
a run on N processes sees the same global batches as a run on one (both drop an epoch's
last incomplete batch), and evaluates every row of the evaluation sets.

Example::

    torchrun --nproc_per_node 2 -m torchrec_cowclip train --model deepfm \\
        --data synthetic:200000 --batch-size 8192 --sharding table_wise --out runs/tw
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torchrec_cowclip import compat
from torchrec_cowclip.process_context import ProcessContext

if TYPE_CHECKING:
    from torchrec.distributed.planner.types import ParameterConstraints

SHARDING_CHOICES = ("auto", "table_wise", "column_wise", "data_parallel", "row_wise")


@dataclass(frozen=True)
class DistContext:
    """This process's place in a multi-process run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # The processes torchrun started on this machine (None: all of them, one machine).
    local_world_size: Optional[int] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(
    process: ProcessContext, device_flag: str, timeout_s: float
) -> Optional[DistContext]:
    """Initialises the default process group when ``process`` was launched by
    torchrun/torchx as one of several.

    Returns None for a plain single-process run. ``timeout_s`` bounds every collective,
    so a rank that dies makes the others fail with an error instead of hanging.
    """
    if not process.is_distributed:
        return None
    rank, world_size, local_rank = process.rank, process.world_size, process.local_rank
    use_cuda = torch.cuda.is_available() and device_flag in ("auto", "cuda")
    if use_cuda:
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # So that shutdown_distributed ends the group and its threads (compat says why).
        compat.import_modules_holding_the_default_group()
        backend, timeout = "nccl" if use_cuda else "gloo", timedelta(seconds=timeout_s)
        attempt = process.restart_count
        if attempt is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # Under torchrun the agent's store outlives a restart: without a prefix of
            # its own, a restarted rank can read the address a rank of the killed
            # attempt published there and fail to connect (seen with gloo, the restart
            # then burning one of --max-restarts). Each attempt keys its own.
            store, _, _ = next(
                dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout)
            )
            dist.init_process_group(
                backend=backend,
                store=dist.PrefixStore(f"torchrec_cowclip/attempt_{attempt}", store),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
    return DistContext(rank, world_size, local_rank, device, process.local_world_size)


def shutdown_distributed() -> None:
    """Destroys the default process group after a run that ended normally (its peers are
    at the same point; after an error they may not be, and the group is left to the
    process's exit): no gloo worker thread is left for the interpreter's finalization,
    which it could abort (:func:`~torchrec_cowclip.compat.import_modules_holding_the_default_group`)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_rows_of_epoch(order: np.ndarray, batch_size: int, ctx: DistContext) -> np.ndarray:
    """This rank's rows of an epoch, batch after batch: rows ``[r*b, (r+1)*b)`` of every
    global batch of ``batch_size = world * b`` rows. The last incomplete global batch is
    dropped, as a single process drops it, so every rank takes the same steps and a
    run sees the same global batches on any number of processes.

    Example::

        >>> ctx = DistContext(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
        >>> rank_rows_of_epoch(np.arange(10), 4, ctx).tolist()   # batches [0:4], [4:8]
        [2, 3, 6, 7]
    """
    if batch_size % ctx.world_size:
        raise ValueError(
            f"--batch-size {batch_size} must be divisible by the number of processes "
            f"({ctx.world_size})"
        )
    local = batch_size // ctx.world_size
    full = (len(order) // batch_size) * batch_size
    return order[:full].reshape(-1, ctx.world_size, local)[:, ctx.rank].reshape(-1)


def rank_rows_for_eval(
    indices: np.ndarray, eval_batch_size: int, ctx: DistContext
) -> Tuple[np.ndarray, int]:
    """This rank's share of the evaluation rows ``indices`` and how many batches to cut
    it into: every row is evaluated (shares differ by at most one row), and every rank
    runs the same number of batches (sharded forwards are collective), none empty, of
    at most about ``eval_batch_size / world`` rows. Needs at least one row per rank.

    Example::

        >>> ctx = DistContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
        >>> rows, batches = rank_rows_for_eval(np.arange(7), 4, ctx)
        >>> rows.tolist(), batches
        ([0, 1, 2, 3], 2)
    """
    n, world = len(indices), ctx.world_size
    if n < world:
        raise ValueError(f"{n} evaluation rows cannot be shared by {world} processes")
    sizes = [n // world + (r < n % world) for r in range(world)]
    start = sum(sizes[: ctx.rank])
    local_batch = max(eval_batch_size // world, 1)
    batches = min(-(-sizes[0] // local_batch), sizes[-1])
    return indices[start : start + sizes[ctx.rank]], batches


def sharding_constraints(
    table_names: List[str], sharding: str
) -> Optional[Dict[str, ParameterConstraints]]:
    """Planner constraints forcing one sharding type on every table (None for auto)."""
    if sharding not in SHARDING_CHOICES:
        raise ValueError(f"--sharding must be one of {SHARDING_CHOICES}, got {sharding!r}")
    if sharding == "auto":
        return None
    from torchrec.distributed.planner.types import ParameterConstraints

    return {name: ParameterConstraints(sharding_types=[sharding]) for name in table_names}


def shard_model(
    module: nn.Module,
    table_names: List[str],
    sharders: List[object],
    sharding: str,
    ctx: DistContext,
    batch_size: int,
) -> nn.Module:
    """Plans (TorchRec's planner, collectively) and wraps ``module`` in
    ``DistributedModelParallel`` with the given sharders.

    The planner is ``torchrec-cowclip plan``'s (:func:`~torchrec_cowclip.distributed.planning.make_planner`)
    with the job's own inputs: its world size, the processes per host torchrun started
    (``ctx.local_world_size``), the GPU's memory (TorchRec's default DDR on CPU) and the
    per-rank batch, so the plan that ``plan`` printed for them is the one made here."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from torchrec_cowclip.distributed.planning import make_planner, planner_topology

    hbm = None
    if ctx.device.type == "cuda":
        hbm = int(torch.cuda.get_device_properties(ctx.device).total_memory)
    local = ctx.local_world_size or ctx.world_size
    topology = planner_topology(ctx.world_size, ctx.device.type, local, hbm_bytes=hbm)
    planner = make_planner(
        topology, batch_size // ctx.world_size, sharding_constraints(table_names, sharding)
    )
    pg = dist.GroupMember.WORLD
    plan = planner.collective_plan(module, sharders, pg)
    sharded: nn.Module = DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(pg),
        device=ctx.device,
        plan=plan,
        sharders=sharders,
    )
    return sharded


def table_shardings(dmp: nn.Module) -> Dict[str, str]:
    """Each sharded table's sharding type in ``dmp``'s plan (``DistributedModelParallel.plan``).

    Example::

        >>> table_shardings(nn.Linear(1, 1))   # not a DMP: no plan
        {}
    """
    plan = getattr(dmp, "plan", None)
    if plan is None:
        return {}
    return {
        table: parameter.sharding_type
        for module_plan in plan.plan.values()
        for table, parameter in module_plan.items()
    }


def describe_shardings(shardings: Dict[str, str]) -> str:
    """``"table_wise 20, row_wise 6"``: how many tables each sharding type holds.

    Example::

        >>> describe_shardings({"a": "table_wise", "b": "row_wise", "c": "table_wise"})
        'table_wise 2, row_wise 1'
    """
    counts: Dict[str, int] = {}
    for kind in shardings.values():
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))

"""Running the trainer on several processes: process group, sharding plan, DMP wrap,
and how each rank takes its part of every global batch.

Under ``torchrun`` (or torchx's ``dist.ddp``) the environment names the rank and world
size; the trainer then initialises gloo on CPU or NCCL on CUDA, shards the model's
embeddings with TorchRec's ``DistributedModelParallel`` and the project's CowClip
sharder, and gives each rank ``batch_size / world_size`` rows of every global batch, so
a run on N processes sees the same global batches as a run on one.

Example::

    torchrun --nproc_per_node 2 -m torchrec_cowclip train --model deepfm \\
        --data synthetic:200000 --batch-size 8192 --sharding table_wise --out runs/tw
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_flag: str, timeout_s: float) -> Optional[DistContext]:
    """Initialises the default process group when launched by torchrun/torchx.

    Returns None for a plain single-process run. ``timeout_s`` bounds every collective,
    so a rank that dies makes the others fail with an error instead of hanging.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_flag in ("auto", "cuda")
    if use_cuda:
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s)
        )
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def rank_rows_of_epoch(order: np.ndarray, batch_size: int, ctx: DistContext) -> np.ndarray:
    """This rank's rows of an epoch, batch after batch: rows ``[r*b, (r+1)*b)`` of every
    global batch of ``batch_size = world * b`` rows. The last incomplete global batch is
    dropped so every rank takes the same number of steps."""
    if batch_size % ctx.world_size:
        raise ValueError(
            f"--batch-size {batch_size} must be divisible by the number of processes "
            f"({ctx.world_size})"
        )
    local = batch_size // ctx.world_size
    full = (len(order) // batch_size) * batch_size
    return order[:full].reshape(-1, ctx.world_size, local)[:, ctx.rank].reshape(-1)


def rank_rows_for_eval(indices: np.ndarray, ctx: DistContext) -> np.ndarray:
    """An equal share of ``indices`` per rank (sharded forwards are collective, so every
    rank must run the same number of equal batches); at most ``world - 1`` rows are left
    out."""
    per_rank = len(indices) // ctx.world_size
    return indices[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]


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
    ``DistributedModelParallel`` with the given sharders."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingEnv

    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=ctx.world_size, compute_device=ctx.device.type),
        constraints=sharding_constraints(table_names, sharding),
        batch_size=batch_size // ctx.world_size,
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

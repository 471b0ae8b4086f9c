"""The fused optimizer handle of a sharded CowClip kernel, in checkpointable form.

Each sharded kernel exposes a TorchRec ``KeyedOptimizer`` over its tables, keyed like
TorchRec's fused tables (``<table>.weight``, prefixed ``embedding_bags.`` by the sharded
collection), whose state is laid out so ``torch.distributed.checkpoint`` can save it at
one world size and load it at another:

* weights and the per-weight states (Adam's ``exp_avg``/``exp_avg_sq``) of sharded
  tables are ``ShardedTensor`` views with the weight's own sharding (TorchRec's
  global metadata), so they re-shard like the weight;
* per-row states (row-wise Adagrad's ``sum``) and the table's ``step`` are plain
  tensors: a table-wise or column-wise table holds all rows on every rank that has one
  of its shards, and those copies are identical (the update is), so the checkpoint
  treats them as replicated and loads them whole wherever the table lands;
* data-parallel tables are replicas: plain tensors throughout.

The state is the live storage of the table batches (views), so loading a checkpoint in
place updates the tables directly. The keys match the unsharded
:class:`~torchrec_cowclip.optim.fused.CowClipFusedOptimizer` (``exp_avg``,
``exp_avg_sq``, ``sum``, ``step``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torchrec.distributed.embedding_types import ShardedEmbeddingTable

from torchrec_cowclip.compat import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    sharded_tensor,
)
from torchrec_cowclip.optim.fused import CowClipFusedOptimizer
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.rules import STATE_LAYOUT


@dataclass
class ShardViews:
    """One local shard of a table: its weight rows and optimizer state, as views.

    Attributes:
        table: TorchRec's description of the shard (sizes, offsets, global metadata).
        weight: ``[local_rows, local_cols]`` view into the table batch.
        state: per state name (:data:`STATE_LAYOUT`), a view of the shard's rows.
        step: 0-d view of the shard's step count.
    """

    table: ShardedEmbeddingTable
    weight: Tensor
    state: Dict[str, Tensor]
    step: Tensor


class ShardedCowClipFusedOptimizer(CowClipFusedOptimizer):
    """``KeyedOptimizer`` of the tables of one sharded CowClip kernel.

    The update runs inside backward, so :meth:`step` and :meth:`zero_grad` do nothing;
    ``param_groups[0]`` holds the hyperparameters the update reads at every step (edit
    ``lr`` there, or let a scheduler or TorchRec's ``WarmupOptimizer`` do it).

    Args:
        shards: the kernel's local shards, grouped by table name (a table has several
            local shards when more than one of its column shards is on this rank).
        options: the update rule and its hyperparameters.
        pg: the process group the tables are sharded over.

    Example (inside a ``DistributedModelParallel`` run)::

        opt = sharded_ebc.fused_optimizer       # CombinedOptimizer of these
        state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
        torch.distributed.checkpoint.save(state, checkpoint_id=path)
    """

    def __init__(
        self,
        shards: Mapping[str, List[ShardViews]],
        options: CowClipOptions,
        pg: Optional[dist.ProcessGroup],
    ) -> None:
        self._shards = {name: list(views) for name, views in shards.items()}
        params: Dict[str, Union[Tensor, ShardedTensor]] = {}
        state: Dict[Any, Dict[str, Tensor]] = {}
        for name, views in self._shards.items():
            weight = _global_view([v.weight for v in views], views, pg)
            table_state: Dict[str, Tensor] = {}
            for state_name, per_row in STATE_LAYOUT[options.optimizer]:
                if per_row == "D":
                    table_state[state_name] = _global_view(
                        [v.state[state_name] for v in views], views, pg
                    )
                else:
                    table_state[state_name] = _per_row_view(
                        [v.state[state_name] for v in views], views, pg
                    )
            table_state["step"] = views[0].step
            params[f"{name}.weight"] = weight
            state[weight] = table_state
        # step()/zero_grad()/init_state() are the unsharded handle's no-ops.
        super().__init__(params, state, options)

    def post_load_state_dict(self) -> None:
        """Copies the loaded per-row state and step of a table into its other local
        shards: the state dict exposes one copy per table (see the module docstring)."""
        for views in self._shards.values():
            if not _holds_all_rows(views[0]):
                continue  # row shards: each local shard has its own rows and steps agree
            for other in views[1:]:
                other.step.copy_(views[0].step)
                for state_name, tensor in other.state.items():
                    if tensor.dim() == 1:
                        tensor.copy_(views[0].state[state_name])


def _global_view(
    local: List[Tensor], views: List[ShardViews], pg: Optional[dist.ProcessGroup]
) -> Union[Tensor, ShardedTensor]:
    """The local tensors of a table's shards as one global tensor: a ``ShardedTensor``
    with the weight's sharding, or the tensor itself for a data-parallel replica."""
    first = views[0].table
    if first.global_metadata is None:
        return local[0]
    metadata = copy.deepcopy(first.global_metadata)
    metadata.tensor_properties.dtype = local[0].dtype
    metadata.tensor_properties.requires_grad = False
    return sharded_tensor(
        [Shard(t, v.table.local_metadata) for t, v in zip(local, views)], metadata, pg
    )


def _holds_all_rows(view: ShardViews) -> bool:
    return view.table.local_rows == view.table.num_embeddings


def _per_row_view(
    local: List[Tensor], views: List[ShardViews], pg: Optional[dist.ProcessGroup]
) -> Union[Tensor, ShardedTensor]:
    """A per-row state (row-wise Adagrad's ``sum``) as one global tensor.

    Where this rank holds whole rows (table-wise, column-wise, data-parallel) the copies
    on the ranks holding the table are identical, so the plain tensor is saved as
    replicated. Row-wise shards hold different rows: the state is a 1-D ``ShardedTensor``
    split like the weight's rows.
    """
    if _holds_all_rows(views[0]) or views[0].table.global_metadata is None:
        return local[0]
    weight_meta = views[0].table.global_metadata
    shards_meta = [
        ShardMetadata(
            shard_offsets=[m.shard_offsets[0]],
            shard_sizes=[m.shard_sizes[0]],
            placement=m.placement,
        )
        for m in weight_meta.shards_metadata
    ]
    properties = copy.deepcopy(weight_meta.tensor_properties)
    properties.dtype, properties.requires_grad = local[0].dtype, False
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_meta,
        size=torch.Size([weight_meta.size[0]]),
        tensor_properties=properties,
    )
    local_shards = [
        Shard(
            t,
            ShardMetadata(
                shard_offsets=[v.table.local_metadata.shard_offsets[0]],
                shard_sizes=[v.table.local_metadata.shard_sizes[0]],
                placement=v.table.local_metadata.placement,
            ),
        )
        for t, v in zip(local, views)
    ]
    return sharded_tensor(local_shards, metadata, pg)

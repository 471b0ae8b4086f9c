"""The sharded CowClip kernel: a rank's shards of one TorchRec table group.

TorchRec's sharded lookups call one kernel per group of tables (same pooling) with the
features of that group (:class:`torchrec.distributed.embedding_types.GroupedEmbeddingConfig`);
its FBGEMM kernel is ``BatchedFusedEmbeddingBag``. This one plugs into the same place
(:class:`~torchrec.distributed.batched_embedding_kernel.BaseBatchedEmbeddingBag`, whose
state dict and per-table parameters TorchRec's sharded collection reads) and stores
its shards as this project's table batches - one ``[rows, D]`` tensor per local width,
each shard a row range - so the forward is one ``embedding_bag`` per batch and the
backward the project's row-gradient aggregation. The update itself is the row-update
coordinator's (:mod:`torchrec_cowclip.embedding.row_updates`): the kernel submits to its
lookup's step, which may need to talk to other ranks first (:mod:`.row_sync`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    PoolingMode,
    PoolingType,
)
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.compat import (
    TableBatchedEmbeddingSlice,
    kernel_pooling_mode,
    mark_updated_in_backward,
)
from torchrec_cowclip.distributed.optimizer import ShardedCowClipFusedOptimizer, ShardViews
from torchrec_cowclip.embedding import layout
from torchrec_cowclip.embedding.row_gradients import RowGradients
from torchrec_cowclip.embedding.row_init import RowInit
from torchrec_cowclip.embedding.row_kernels import RowKernel
from torchrec_cowclip.embedding.row_lookup import RowLookup
from torchrec_cowclip.embedding.row_updates import LookupChannel, Submission
from torchrec_cowclip.embedding.table_batch import (
    TableBatch,
    TableClipStats,
    group_into_table_batches,
)
from torchrec_cowclip.optim.options import CowClipOptions


def _shard_offsets(shard: Any) -> Tuple[int, int]:
    """(row, column) of a shard's first element in its whole table."""
    if shard.local_metadata is None:
        return (0, 0)
    row, col = shard.local_metadata.shard_offsets[:2]
    return (int(row), int(col))


def _initialised_by_torchrec(weight: Tensor) -> None:
    """No-op ``init_fn`` of the local table batches' configs: shards are filled by
    :meth:`CowClipBatchedEmbeddingBag.initialise_shards`."""


class CowClipBatchedEmbeddingBag(BaseBatchedEmbeddingBag[Tensor], FusedOptimizerModule):
    """A rank's shards of one table group, looked up and trained by CowClip.

    Each shard (a table, or a column slice of one) is a table of a local table batch
    of its width. ``forward`` takes the group's features (TorchRec's layout: the
    group's features in config order, batch-major offsets) and returns ``[B, sum of
    the features' local dims]``; ``backward`` hands the row gradients to the lookup's
    :class:`~torchrec_cowclip.embedding.row_updates.LookupChannel`.

    Args:
        config: the group TorchRec assigned to this rank.
        pg: the sharding process group.
        device: where the shards live.
        sharding_type: the group's sharding type.
        options: optimizer, hyperparameters, clip and unclipped tables.
        channel: the lookup's channel into the row-update coordinator (shared by its
            kernels).
        index: this kernel's position in the lookup (orders the updates).
        kernel: the row kernel of its table batches
            (:mod:`torchrec_cowclip.embedding.row_kernels`; the sharded collection's, the same
            kind on every rank).

    Example (what :class:`~torchrec_cowclip.distributed.sharded_lookup.CowClipPooledEmbeddingsLookup`
    does for each group)::

        kernel = CowClipBatchedEmbeddingBag(config, pg, device, ShardingType.TABLE_WISE,
                                            CowClipOptions(lr=1e-4), channel, index=0,
                                            kernel=TorchKernel(compiled=False))
        pooled = kernel(kjt)                 # [B, sum of local dims]
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup],
        device: Optional[torch.device],
        sharding_type: Optional[ShardingType],
        options: CowClipOptions,
        channel: LookupChannel,
        index: int,
        kernel: RowKernel,
    ) -> None:
        super().__init__(config, pg, device, sharding_type)
        if config.data_type not in (DataType.FP32, DataType.FP16, DataType.BF16):
            raise ValueError(
                f"CowClip sharded tables must be FP32, FP16 or BF16, got {config.data_type} "
                f"for {[t.name for t in config.embedding_tables]}"
            )
        device = device if device is not None else torch.device("cpu")
        # Our own references (TorchRec's base keeps the same in private attributes).
        self._group = config
        self._group_pg = pg
        self._channel = channel
        self._index = index
        shards = config.embedding_tables
        shard_starts = [0]
        for shard in shards:
            shard_starts.append(shard_starts[-1] + shard.num_features())
        # A shard is a local table of its own width; features keep TorchRec's names
        # (two shards of one table both list its features) and are told apart by
        # position, which also names the output columns.
        # Row-wise shards hold part of each bag: TorchRec pools them with SUM (its
        # `pooling_type_to_pooling_mode`, read into the base class's pooling mode) and
        # divides by the whole bag's length after the reduce-scatter.
        pooling = (
            PoolingType.SUM if kernel_pooling_mode(self) == PoolingMode.SUM else config.pooling
        )
        local = [
            EmbeddingBagConfig(
                name=shard.name,
                num_embeddings=shard.local_rows,
                embedding_dim=shard.local_cols,
                feature_names=list(shard.feature_names),
                pooling=pooling,
                data_type=config.data_type,
                # The sharded collection initialises the shards from the whole tables'
                # initialisers (initialise_shards); and a row-wise shard of a table
                # smaller than the world has no rows, for which the config's default
                # bounds (+-sqrt(1/rows)) do not exist.
                init_fn=_initialised_by_torchrec,
            )
            for shard in shards
        ]
        self._batches: List[TableBatch] = []
        self._shard_location: List[Tuple[int, int]] = [(0, 0)] * len(shards)
        self._whole_dims: List[Tensor] = []
        batched_features: List[int] = []
        for b, group in enumerate(group_into_table_batches(local)):
            self._batches.append(
                TableBatch(
                    [local[k] for k in group],
                    [[str(p) for p in range(shard_starts[k], shard_starts[k + 1])] for k in group],
                    options.optimizer,
                    [shards[k].name not in options.unclipped_tables for k in group],
                    device,
                    kernel,
                    # Each shard rounds (FP16 / BF16) as its rows and columns of the whole
                    # table would.
                    [_shard_offsets(shards[k]) for k in group],
                )
            )
            self._batches[-1].stochastic_rounding = options.stochastic_rounding
            self._whole_dims.append(
                torch.tensor(
                    [shards[k].embedding_dim for k in group], dtype=torch.float32, device=device
                )
            )
            for i, k in enumerate(group):
                self._shard_location[k] = (b, i)
                batched_features.extend(range(shard_starts[k], shard_starts[k + 1]))
        num_features = shard_starts[-1]
        self._feature_permutation: Optional[List[int]] = (
            None if batched_features == list(range(num_features)) else batched_features
        )
        self._batch_feature_starts: List[int] = layout.feature_starts(self._batches)
        self._output_permutation = layout.as_index(
            layout.output_permutation(self._batches, [str(p) for p in range(num_features)]), device
        )
        self._param_per_table = self._table_parameters()
        self._optim = ShardedCowClipFusedOptimizer(self._shard_views(), options, pg)
        self.init_parameters()

    # --- TorchRec kernel interface ---------------------------------------------------

    @property
    def emb_module(self) -> nn.Module:
        """Absent: the shards live in table batches, not in an FBGEMM module (raises
        AttributeError, so TorchRec's ``hasattr`` probes see no FBGEMM features)."""
        raise AttributeError(
            "CowClipBatchedEmbeddingBag has no FBGEMM emb_module; use "
            "split_embedding_weights() or fused_optimizer"
        )

    @property
    def fused_optimizer(self) -> ShardedCowClipFusedOptimizer:
        return self._optim

    def split_embedding_weights(self) -> List[Tensor]:
        """Each shard's ``[local_rows, local_cols]`` weight view, in config order."""
        return [self._batches[b].table_weight(i) for b, i in self._shard_location]

    def named_split_embedding_weights(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, Tensor]]:
        for shard, weight in zip(self._group.embedding_tables, self.split_embedding_weights()):
            yield f"{prefix}{shard.name}.weight", weight

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        # As TorchRec's fused kernels: the weights as parameters marked as updated in
        # backward, so dense optimizers built with `in_backward_optimizer_filter` skip them.
        for name, weight in self.named_split_embedding_weights(prefix):
            param = nn.Parameter(weight, requires_grad=False)
            mark_updated_in_backward(param)
            yield name, param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, Tensor]]:
        yield from ()

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        if features.variable_stride_per_key():
            raise ValueError(
                "variable-batch KeyedJaggedTensors are not supported by the CowClip sharder"
            )
        if self._feature_permutation is not None:
            features = features.permute(self._feature_permutation)
        b = features.stride()
        values, offsets = features.values(), features.offsets()
        weights = features.weights_or_none() if self._group.is_weighted else None
        starts = self._batch_feature_starts
        bounds = layout.value_bounds(offsets, starts, b, values.numel())
        lookups = layout.prepare_lookups(self._batches, values, offsets, b, starts, bounds, weights)
        anchor, step = self._channel.current()
        outs = [
            RowLookup.apply(
                anchor, lookup.weights, self._batches[i], lookup, step, self._submission_of(i)
            )
            for i, lookup in enumerate(lookups)
        ]
        return layout.pooled_in_order(outs, self._output_permutation)

    # --- what the update and the collection need -----------------------------------------

    def _submission_of(self, batch_index: int) -> Callable[[RowGradients], Submission]:
        """How a table batch's backward submits its row gradients to the lookup's step:
        keyed ``(kernel, batch)``, with this kernel's hyperparameters at that backward and
        the whole tables' dims (column shards' norms are the whole rows')."""
        batch = self._batches[batch_index]
        whole_dims = self._whole_dims[batch_index]

        def submission(row_grads: RowGradients) -> Submission:
            key = (self._index, batch_index)
            return Submission(key, batch, row_grads, self._optim.row_options(), whole_dims)

        return submission

    def initialise_shards(self, row_inits: Mapping[str, Optional[RowInit]]) -> None:
        """Fills every local shard with its table's initial rows and zeroes its
        optimizer state and counters.

        A table with a :class:`~torchrec_cowclip.embedding.row_init.RowInit` gets, in
        each shard, exactly the rows and columns the whole table would hold at the
        shard's global offsets, so the start does not depend on the plan or the world
        size. Any other ``init_fn`` is called on the local shard, as TorchRec does; a
        data-parallel replica is then broadcast from rank 0 (TorchRec's rule).
        """
        with torch.no_grad():
            for shard, (b, i) in zip(self._group.embedding_tables, self._shard_location):
                weight = self._batches[b].table_weight(i)
                row_init = row_inits.get(shard.name)
                if row_init is not None:
                    offsets = shard.local_metadata.shard_offsets if shard.local_metadata else [0, 0]
                    row_init.fill_(weight, int(offsets[0]), int(offsets[1]), shard.embedding_dim)
                    continue
                assert shard.init_fn is not None  # TorchRec's configs always carry one
                shard.init_fn(weight)
                if shard.global_metadata is None and self._group_pg is not None:
                    dist.broadcast(weight, src=0, group=self._group_pg)
            for batch in self._batches:
                batch.reset_state()

    def storage_bytes(self) -> int:
        """Bytes of this kernel's shard weights and optimizer state."""
        return sum(batch.storage_bytes() for batch in self._batches)

    def load_table_counters(self, counters: Mapping[str, Tensor]) -> None:
        """Sets each local shard's clip counters from its table's global ones: a shard
        that starts at row 0 takes them, the other row shards zero (row shards' counts
        add up over ranks; column shards and replicas each report one copy)."""
        for shard, (b, i) in zip(self._group.embedding_tables, self._shard_location):
            first_row = int(shard.local_metadata.shard_offsets[0]) if shard.local_metadata else 0
            counters_of_batch = self._batches[b].counters
            if first_row == 0:
                counters_of_batch[:, i] = counters[shard.name].to(counters_of_batch.device)
            else:
                counters_of_batch[:, i] = 0

    def clip_stats(self) -> Dict[str, TableClipStats]:
        """Per table, what the update did to this rank's shards. Column shards of one
        table clip the same rows (whole-row norms), so a table reports its first shard."""
        stats: Dict[str, TableClipStats] = {}
        for shard, (b, _) in zip(self._group.embedding_tables, self._shard_location):
            stats.setdefault(shard.name, self._batches[b].stats()[shard.name])
        return stats

    # --- helpers ------------------------------------------------------------------------

    def _shard_views(self) -> Dict[str, List[ShardViews]]:
        views: Dict[str, List[ShardViews]] = {}
        for shard, (b, i) in zip(self._group.embedding_tables, self._shard_location):
            state = self._batches[b].table_state(i)
            step = state.pop("step")
            views.setdefault(shard.name, []).append(
                ShardViews(shard, self._batches[b].table_weight(i), state, step)
            )
        return views

    def _table_parameters(self) -> Dict[str, TableBatchedEmbeddingSlice]:
        """Per table, one parameter over its local shards: TorchRec registers it as the
        sharded collection's ``embedding_bags.<table>.weight`` and loads the local part
        of a state dict into it (all of a table's local shards, concatenated)."""
        locations: Dict[str, List[Tuple[int, int]]] = {}
        for shard, location in zip(self._group.embedding_tables, self._shard_location):
            locations.setdefault(shard.name, []).append(location)
        params: Dict[str, TableBatchedEmbeddingSlice] = {}
        for name, locs in locations.items():
            b = locs[0][0]
            first = locs[0][1]
            if any(loc != (b, first + n) for n, loc in enumerate(locs)):
                raise ValueError(
                    f"table '{name}': its column shards on this rank must have equal widths "
                    f"and be adjacent in TorchRec's group, got batch/table positions {locs}"
                )
            batch = self._batches[b]
            param = TableBatchedEmbeddingSlice(
                data=batch.weight,
                start_offset=batch.row_offsets_list[first],
                end_offset=batch.row_offsets_list[first + len(locs)],
                num_embeddings=-1,
                embedding_dim=batch.dim,
            )
            mark_updated_in_backward(param)
            params[name] = param
        return params

"""The sharded lookup: TorchRec's grouped pooled lookup with CowClip kernels.

:class:`~torchrec.distributed.embedding_lookup.GroupedPooledEmbeddingsLookup` splits a
sharding's features by table group and calls one kernel per group; its
``_create_embedding_kernel`` is where a kernel is chosen. Overriding that one method
keeps everything else of TorchRec's lookup (feature splitting, output layout, state
dict plumbing) and gives every group a
:class:`~torchrec_cowclip.distributed.sharded_kernel.CowClipBatchedEmbeddingBag`. The lookup
also owns its channel into the row-update coordinator, which its kernels submit their
row gradients to (:mod:`torchrec_cowclip.embedding.row_updates`).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip import compat
from torchrec_cowclip.distributed.sharded_kernel import CowClipBatchedEmbeddingBag
from torchrec_cowclip.embedding.row_kernels import RowKernel
from torchrec_cowclip.embedding.row_updates import LookupChannel
from torchrec_cowclip.embedding.table_batch import TableClipStats
from torchrec_cowclip.optim.options import CowClipOptions

#: Plan compute kernels this lookup serves. ``fused`` is what the sharder offers the
#: planner (a table-batched lookup with the optimizer fused into backward, which is what
#: this kernel is); ``dense`` is what TorchRec's plan helpers write for data-parallel
#: tables. With the CowClip sharder every table is trained by the fused CowClip update.
SUPPORTED_COMPUTE_KERNELS = (EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.DENSE)


class CowClipPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup of one sharding type, with CowClip kernels.

    Args:
        grouped_configs: the sharding's table groups on this rank.
        device, pg, env, sharding_type: as for TorchRec's lookup.
        options: how the tables are trained.
        channel: the lookup's channel into the collection's row-update coordinator,
            with the strategy of its sharding type (``RowUpdates.channel(sync)``).
        kernel: the row kernel of every table batch of its kernels (the sharded
            collection's, agreed across ranks).
        scale_weight_gradients: TorchRec's per-sample-weight gradient scaling (off for
            data-parallel, as TorchRec does).

    Example (what :class:`~torchrec_cowclip.distributed.ShardedCowClipEmbeddingBagCollection`
    does per sharding)::

        lookup = CowClipPooledEmbeddingsLookup(configs, device, pg, env,
                                               ShardingType.TABLE_WISE, options,
                                               row_updates.channel(LocalRows()), kernel)
        pooled = lookup(kjt)      # backward applies the CowClip update of all its tables
    """

    def __init__(
        self,
        grouped_configs: list[GroupedEmbeddingConfig],
        device: Optional[torch.device],
        pg: Optional[dist.ProcessGroup],
        env: Optional[ShardingEnv],
        sharding_type: ShardingType,
        options: CowClipOptions,
        channel: LookupChannel,
        kernel: RowKernel,
        scale_weight_gradients: bool = True,
    ) -> None:
        # TorchRec's constructor creates the kernels (`_create_embedding_kernel`), which
        # need these; plain attributes may be set before nn.Module.__init__.
        self._options = options
        self._channel = channel
        self._row_kernel = kernel
        super().__init__(
            grouped_configs=grouped_configs,
            device=device,
            pg=pg,
            feature_processor=None,
            scale_weight_gradients=scale_weight_gradients,
            sharding_type=sharding_type,
            env=env,
        )

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: Optional[torch.device],
        pg: Optional[dist.ProcessGroup],
        sharding_type: Optional[ShardingType],
        env: Optional[ShardingEnv],
    ) -> BaseEmbedding:
        if config.compute_kernel not in SUPPORTED_COMPUTE_KERNELS:
            raise ValueError(
                f"the CowClip sharder trains every table with its fused kernel; compute "
                f"kernel '{config.compute_kernel.value}' of tables "
                f"{[t.name for t in config.embedding_tables]} is not supported "
                f"(use {[k.value for k in SUPPORTED_COMPUTE_KERNELS]})"
            )
        return CowClipBatchedEmbeddingBag(
            config=config,
            pg=pg,
            device=device,
            sharding_type=sharding_type,
            options=self._options,
            channel=self._channel,
            kernel=self._row_kernel,
            # TorchRec appends each kernel as it is created: this is its index.
            index=len(compat.lookup_kernels(self)),
        )

    def forward(self, sparse_features: KeyedJaggedTensor) -> Tensor:
        self._channel.begin_forward()
        return super().forward(sparse_features)

    def clip_stats(self) -> Dict[str, TableClipStats]:
        """Per table of this rank, what the last and all updates did (see
        :meth:`CowClipBatchedEmbeddingBag.clip_stats`)."""
        stats: Dict[str, TableClipStats] = {}
        for kernel in compat.lookup_kernels(self):
            stats.update(kernel.clip_stats())
        return stats


class ReplicatedLookup(nn.Module):
    """Stands where TorchRec puts ``DistributedDataParallel`` around a data-parallel lookup.

    TorchRec keeps data-parallel replicas in sync by averaging their gradients with DDP
    and reaches the lookup through DDP's ``.module``. The CowClip kernels have no
    gradients to average: their update already applies the union of all replicas' rows
    on every replica (:class:`~torchrec_cowclip.distributed.row_sync.ReplicatedRows`).
    This wrapper only keeps the ``.module`` access TorchRec relies on.

    Example::

        wrapped = ReplicatedLookup(lookup)
        wrapped.module is lookup      # True
    """

    def __init__(self, module: CowClipPooledEmbeddingsLookup) -> None:
        super().__init__()
        self.module = module

    def forward(self, sparse_features: KeyedJaggedTensor) -> Tensor:
        return self.module(sparse_features)

    def flush(self) -> None:
        self.module.flush()

    def purge(self) -> None:
        self.module.purge()

    def prefetch(
        self,
        sparse_features: KeyedJaggedTensor,
        forward_stream: Optional[torch.cuda.Stream] = None,
    ) -> None:
        self.module.prefetch(sparse_features, forward_stream)

    def clip_stats(self) -> Dict[str, TableClipStats]:
        return self.module.clip_stats()

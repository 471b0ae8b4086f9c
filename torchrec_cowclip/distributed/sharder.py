"""The TorchRec sharder that shards embedding collections for CowClip training.

Pass it to ``DistributedModelParallel`` like TorchRec's ``EmbeddingBagCollectionSharder``:
it tells the planner which sharding types and kernels it offers and how much optimizer
state each table carries, and it turns a ``torchrec.EmbeddingBagCollection`` (or a
:class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`) into a
:class:`~.sharded_collection.ShardedCowClipEmbeddingBagCollection`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, Type

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    QuantizedCommCodecs,
    ShardingEnv,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_cowclip import compat
from torchrec_cowclip.distributed.options import PLANNER_OPTIMIZER_CLASS, CowClipOptions
from torchrec_cowclip.distributed.sharded_collection import (
    SUPPORTED_SHARDING_TYPES,
    ShardedCowClipEmbeddingBagCollection,
)
from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.optim.functional import CountLR, CowClip, Helen


class CowClipEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards embedding bag collections and trains them with the fused CowClip update.

    Sharding types: ``table_wise``, ``column_wise``, ``table_column_wise`` and
    ``data_parallel``, ``row_wise`` and ``table_row_wise``. Every table gets
    the ``fused`` compute kernel: a table-batched lookup with the CowClip step fused into
    backward. The planner sees the optimizer state in its memory estimate.

    Args:
        options: how plain ``EmbeddingBagCollection`` modules are trained, as one
            :class:`~torchrec_cowclip.optim.options.CowClipOptions`; or the separate
            keywords ``optimizer, lr, betas, eps, weight_decay, cowclip,
            unclipped_tables, count_lr, helen`` (as for
            :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`). A
            ``CowClipEmbeddingBagCollection`` keeps its own options.
        module_type: the module class this sharder shards (TorchRec matches sharders to
            modules by exact type): ``torchrec.EmbeddingBagCollection`` (default) or
            :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`. Pass one sharder of
            each kind if a model has both.
        fused_params, qcomm_codecs_registry: as for TorchRec's sharder.

    Example::

        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv

        sharder = CowClipEmbeddingBagCollectionSharder(
            optimizer="adam", lr=1e-4, weight_decay=2e-5,
            cowclip=CowClip(r=1.0, zeta=3.2e-5), unclipped_tables=("lin",))
        dmp = DistributedModelParallel(model, sharders=[sharder],
                                       env=ShardingEnv.from_process_group(pg),
                                       device=torch.device("cpu"))   # plan=None: TorchRec plans
        dmp(batch).mean().backward()      # the tables are updated here
        dmp.fused_optimizer.state_dict()  # their optimizer state, for checkpoints
    """

    def __init__(
        self,
        optimizer: str = "adam",
        lr: float = 1e-4,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        cowclip: Optional[CowClip] = CowClip(),
        unclipped_tables: Iterable[str] = (),
        module_type: Type[nn.Module] = EmbeddingBagCollection,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        count_lr: Optional[CountLR] = None,
        options: Optional[CowClipOptions] = None,
        helen: Optional[Helen] = None,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        if module_type not in (EmbeddingBagCollection, CowClipEmbeddingBagCollection):
            raise ValueError(
                "module_type must be torchrec.EmbeddingBagCollection or "
                f"CowClipEmbeddingBagCollection, got {module_type!r}"
            )
        self._module_type = module_type
        self._options = CowClipOptions.resolve(
            options,
            optimizer=optimizer,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            cowclip=cowclip,
            unclipped_tables=frozenset(unclipped_tables),
            count_lr=count_lr,
            helen=helen,
        )

    @property
    def options(self) -> CowClipOptions:
        """The options given to this sharder (used for plain EmbeddingBagCollections)."""
        return self._options

    def options_for(self, module: nn.Module) -> CowClipOptions:
        """The options ``module`` is sharded with: its own for a CowClip collection."""
        if isinstance(module, CowClipEmbeddingBagCollection):
            return CowClipOptions.from_module(module)
        return self._options

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ShardedCowClipEmbeddingBagCollection:
        return ShardedCowClipEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            options=self.options_for(module),
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )

    def shardable_parameters(self, module: EmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        """The tables, as the planner and TorchRec's plan helpers should see them.

        TorchRec's storage estimator sizes a table's optimizer state from the
        ``_optimizer_classes`` of this tensor, and its plan helpers pick the ``fused``
        kernel for tensors with ``_in_backward_optimizers``; the module's own parameters
        are left untouched (these are aliases carrying the two attributes).
        """
        optimizer_class = PLANNER_OPTIMIZER_CLASS[self.options_for(module).optimizer]
        tables: Dict[str, nn.Parameter] = {}
        for name, param in module.embedding_bags.named_parameters():
            alias = nn.Parameter(param.detach(), requires_grad=False)
            compat.set_planner_optimizer_class(alias, optimizer_class)
            compat.mark_updated_in_backward(alias)
            tables[name.split(".")[0]] = alias
        return tables

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(SUPPORTED_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def reshard(self, *args: Any, **kwargs: Any) -> ShardedCowClipEmbeddingBagCollection:
        raise NotImplementedError(
            "resharding a live CowClip-sharded collection is not supported; save a "
            "checkpoint with torch.distributed.checkpoint and load it under the new plan"
        )

    @property
    def module_type(self) -> Type[nn.Module]:
        return self._module_type

    @property
    def sharded_module_type(self) -> Type[ShardedCowClipEmbeddingBagCollection]:
        return ShardedCowClipEmbeddingBagCollection

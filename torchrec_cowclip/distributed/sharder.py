"""The TorchRec sharders that shard embedding collections for CowClip training.

Pass them to ``DistributedModelParallel`` as TorchRec's own:
``sharders=get_default_sharders(...)`` is TorchRec's default list with this project's
sharder for ``torchrec.EmbeddingBagCollection`` and
:class:`~torchrec_cowclip.CowClipEmbeddingBagCollection` (TorchRec matches a sharder to a
module by its exact type, so each needs one). The sharder tells the planner which
sharding types and kernels it offers and how much optimizer state each table carries,
reads how the tables train from TorchRec's own configuration (``fused_params``,
``apply_optimizer_in_backward``; :mod:`torchrec_cowclip.optim.torchrec_config`), and turns
the collection into a :class:`~.sharded_collection.ShardedCowClipEmbeddingBagCollection`.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Mapping, Optional, Type

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import get_default_sharders as torchrec_default_sharders
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    QuantizedCommCodecs,
    ShardingEnv,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_cowclip import compat
from torchrec_cowclip.distributed.sharded_collection import (
    SUPPORTED_SHARDING_TYPES,
    ShardedCowClipEmbeddingBagCollection,
)
from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.optim.options import CowClipOptions, checked_options
from torchrec_cowclip.optim.rules import RuleView
from torchrec_cowclip.optim.torchrec_config import (
    Settings,
    fused_params_settings,
    in_backward_settings,
    options_settings,
    resolve_options,
    table_marks,
)

__all__ = [
    "PLANNER_OPTIMIZER_CLASS",
    "CowClipEmbeddingBagCollectionSharder",
    "get_default_sharders",
    "planned_optimizer",
]


def _optimizer_class(path: str) -> Type[torch.optim.Optimizer]:
    module, _, name = path.rpartition(".")
    optimizer_class: Type[torch.optim.Optimizer] = getattr(importlib.import_module(module), name)
    return optimizer_class


#: The torch/TorchRec optimizer class whose state size TorchRec's planner knows for each
#: registered update rule (``UpdateRule.planner_optimizer``, a live view): Adam keeps two
#: values per weight, row-wise Adagrad one per row, SGD none. The sharder tells the
#: planner through :meth:`CowClipEmbeddingBagCollectionSharder.shardable_parameters`.
PLANNER_OPTIMIZER_CLASS: Mapping[str, Type[torch.optim.Optimizer]] = RuleView(
    lambda rule: _optimizer_class(rule.planner_optimizer)
)


#: The attribute naming the update rule on each table tensor the sharder hands TorchRec's
#: planner (this project's own, read back by :func:`planned_optimizer`).
_PLANNED_OPTIMIZER = "cowclip_optimizer"


def planned_optimizer(tensor: torch.Tensor) -> Optional[str]:
    """The update rule whose state a table tensor from
    :meth:`CowClipEmbeddingBagCollectionSharder.shardable_parameters` carries (None for
    another sharder's tensor): what the planner's CowClip storage estimator
    (:mod:`torchrec_cowclip.distributed.planning`) sizes the state by."""
    name = getattr(tensor, _PLANNED_OPTIMIZER, None)
    return None if name is None else str(name)


class CowClipEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards embedding bag collections and trains them with the fused CowClip update.

    Sharding types: ``table_wise``, ``column_wise``, ``table_column_wise`` and
    ``data_parallel``, ``row_wise`` and ``table_row_wise``. Every table gets
    the ``fused`` compute kernel: a table-batched lookup with the CowClip step fused into
    backward. The planner sees the optimizer state in its memory estimate.

    How the tables train is read from every place TorchRec and this project say it,
    merged into one :class:`~torchrec_cowclip.optim.options.CowClipOptions`
    (:func:`~torchrec_cowclip.optim.torchrec_config.resolve_options`): ``options=``,
    ``fused_params`` (FBGEMM's keys, honoured or refused in one line),
    each table weight's ``apply_optimizer_in_backward`` mark, and a
    ``CowClipEmbeddingBagCollection``'s own options. Two of them that disagree are
    refused, naming both, before anything is allocated.

    Args:
        options: how the tables are trained, as one ``CowClipOptions`` (None: what
            ``fused_params``, the marks and the collection say, else the defaults).
        module_type: the module class this sharder shards (TorchRec matches sharders to
            modules by exact type): ``torchrec.EmbeddingBagCollection`` (default) or
            :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`;
            :func:`get_default_sharders` gives one of each.
        fused_params: TorchRec's sharder configuration: ``optimizer`` (an
            ``EmbOptimType``), ``learning_rate``, ``eps``, ``beta1``, ``beta2``,
            ``weight_decay`` with ``weight_decay_mode=WeightDecayMode.L2``, and CowClip's
            ``cowclip``, ``unclipped_tables``, ``count_lr``, ``helen``
            (:mod:`torchrec_cowclip.optim.torchrec_config`); any other key is refused.
        qcomm_codecs_registry: as for TorchRec's sharder.

    Example::

        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed import DistributedModelParallel

        sharders = get_default_sharders(fused_params={
            "optimizer": EmbOptimType.ADAM, "learning_rate": 1e-4,
            "cowclip": CowClip(r=1.0, zeta=3.2e-5), "unclipped_tables": ["lin"]})
        dmp = DistributedModelParallel(model, sharders=sharders, device=device)
        dmp(batch).mean().backward()      # the tables are updated here
        dmp.fused_optimizer.state_dict()  # their optimizer state, for checkpoints
    """

    def __init__(
        self,
        options: Optional[CowClipOptions] = None,
        *,
        module_type: Type[nn.Module] = EmbeddingBagCollection,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        if module_type not in (EmbeddingBagCollection, CowClipEmbeddingBagCollection):
            raise ValueError(
                "module_type must be torchrec.EmbeddingBagCollection or "
                f"CowClipEmbeddingBagCollection, got {module_type!r}"
            )
        self._module_type = module_type
        given: Settings = (
            {} if options is None else options_settings(checked_options(options), "options=")
        )
        self._sources: List[Settings] = [given, fused_params_settings(fused_params)]
        self._options = resolve_options(self._sources)  # a disagreement is refused here

    @property
    def options(self) -> CowClipOptions:
        """How this sharder trains a plain ``EmbeddingBagCollection`` whose weights carry
        no ``apply_optimizer_in_backward`` mark (``options=`` merged with ``fused_params``)."""
        return self._options

    def options_for(self, module: nn.Module) -> CowClipOptions:
        """The options ``module`` is sharded with: this sharder's, merged with the
        module's weights' ``apply_optimizer_in_backward`` marks and, for a CowClip
        collection, its own options (a disagreement raises ValueError naming both)."""
        sources = [*self._sources, in_backward_settings(table_marks(module))]
        if isinstance(module, CowClipEmbeddingBagCollection):
            sources.append(options_settings(module.options, "the collection's own"))
        return resolve_options(sources)

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
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )

    def shardable_parameters(self, module: EmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        """The tables, as the planner and TorchRec's plan helpers should see them.

        TorchRec's storage estimator sizes a table's optimizer state from the
        ``_optimizer_classes`` of this tensor, and its plan helpers pick the ``fused``
        kernel for tensors with ``_in_backward_optimizers``; the tensor also names the
        update rule (:func:`planned_optimizer`), whose state the planner of
        :mod:`~torchrec_cowclip.distributed.planning` counts exactly (float32 whatever the
        weights' type, one row's per column shard). The module's own parameters are left
        untouched (these are aliases carrying the attributes).
        """
        optimizer = self.options_for(module).optimizer
        optimizer_class = PLANNER_OPTIMIZER_CLASS[optimizer]
        tables: Dict[str, nn.Parameter] = {}
        for name, param in module.embedding_bags.named_parameters():
            alias = nn.Parameter(param.detach(), requires_grad=False)
            compat.set_planner_optimizer_class(alias, optimizer_class)
            compat.mark_updated_in_backward(alias)
            setattr(alias, _PLANNED_OPTIMIZER, optimizer)
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


def get_default_sharders(
    fused_params: Optional[Dict[str, Any]] = None,
    options: Optional[CowClipOptions] = None,
    qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
) -> List[ModuleSharder[nn.Module]]:
    """TorchRec's default sharders (``torchrec.distributed.sharding_plan.get_default_sharders``)
    with the CowClip sharder for ``torchrec.EmbeddingBagCollection`` and for
    :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection` in place of TorchRec's EBC
    sharder; TorchRec's own for every other module kind (``EmbeddingCollection``, ...).

    ``fused_params`` and ``options`` configure both CowClip sharders (see
    :class:`CowClipEmbeddingBagCollectionSharder`).

    Example::

        dmp = DistributedModelParallel(model, sharders=get_default_sharders(), device=device)

    is all a model holding plain or CowClip embedding bag collections (and any other
    TorchRec module) needs.
    """
    ours: List[ModuleSharder[nn.Module]] = [
        CowClipEmbeddingBagCollectionSharder(
            module_type=module_type,
            fused_params=fused_params,
            options=options,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )
        for module_type in (EmbeddingBagCollection, CowClipEmbeddingBagCollection)
    ]
    return ours + [
        s for s in torchrec_default_sharders() if s.module_type is not EmbeddingBagCollection
    ]

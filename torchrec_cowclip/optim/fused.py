"""The fused optimizer handle of a CowClip embedding collection.

Like TorchRec's fused TBE optimizers, the update happens inside backward, so
:meth:`step` and :meth:`zero_grad` do nothing. The object is a TorchRec
:class:`~torchrec.optim.keyed.KeyedOptimizer` so that everything built on those works
unchanged: ``state_dict()``/``load_state_dict()`` carry each table's moments or
accumulators and its step count, ``CombinedOptimizer`` can join it with the dense
optimizer, and LR schedules (``torch.optim.lr_scheduler``, TorchRec's
``WarmupOptimizer``) can edit ``param_groups[0]["lr"]`` between steps.

Example::

    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec_cowclip import CowClipEmbeddingBagCollection, CowClipOptions
    >>> ebc = CowClipEmbeddingBagCollection(
    ...     [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
    ...     CowClipOptions(optimizer="adam", lr=1e-4))
    >>> opt = ebc.fused_optimizer
    >>> opt.param_groups[0]["lr"] = 5e-5          # takes effect at the next backward
    >>> sorted(opt.state_dict()["state"]["embedding_bags.t.weight"])
    ['exp_avg', 'exp_avg_sq', 'step']
    >>> import os, tempfile, torch
    >>> torch.save(opt.state_dict(), os.path.join(tempfile.mkdtemp(), "fused_opt.pt"))
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from torch import Tensor, nn
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

from torchrec_cowclip.optim.load_check import StateDictMismatch, check_loadable
from torchrec_cowclip.optim.options import CowClipOptions, validate_hyperparameters

__all__ = [
    "CowClipFusedOptimizer",
    "CowClipOptions",
    "model_fused_optimizer",
    "validate_hyperparameters",
]


#: The param-group entries the update reads (``CowClipOptions.hyperparameters``).
_ROW_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "cowclip", "count_lr")


class CowClipFusedOptimizer(FusedOptimizer):
    """KeyedOptimizer view of the fused CowClip update of one embedding collection.

    Args:
        params: table parameters by key (``embedding_bags.<table>.weight``).
        state: per parameter, its optimizer state views (``exp_avg``/``exp_avg_sq`` for
            Adam, ``sum`` for row-wise Adagrad) and ``step``.
        options: the update rule and its hyperparameters; these are kept in
            ``param_groups[0]`` (``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``cowclip``, ``count_lr``) and read at every backward.
    """

    def __init__(
        self,
        params: Mapping[str, Any],
        state: Dict[Any, Dict[str, Tensor]],
        options: CowClipOptions,
    ) -> None:
        self.optimizer_name = options.optimizer
        group = {"params": list(params.values()), **options.hyperparameters()}
        super().__init__(dict(params), state, [group])
        self._parsed: Optional[Tuple[Tuple[Any, ...], CowClipOptions]] = None

    def step(self, closure: Any = None) -> None:
        """No-op: the update was applied during backward."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        """No-op: fused parameters never hold a ``.grad``."""

    def init_state(self, sparse_grad_parameter_names: Optional[Set[str]] = None) -> None:
        """No-op: state is allocated eagerly, so in-place loading works from the start."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """TorchRec's in-place load, refused whole - naming the first bad key and its
        shapes - unless every state tensor matches the live one (keys, shapes, dtypes,
        shards, finite values) and every param group's hyperparameters are valid: a
        refused load changes nothing (TorchRec's would have copied the tensors before
        the misfit)."""
        check_loadable(
            dict(state_dict.get("state", {})), self.state_dict()["state"], "fused optimizer"
        )
        groups = state_dict.get("param_groups")
        if groups is not None and self.defaults.get("_save_param_groups"):
            if len(groups) != len(self.param_groups):
                raise StateDictMismatch(
                    f"fused optimizer: {len(groups)} param groups in the state dict, "
                    f"{len(self.param_groups)} here; nothing was loaded"
                )
            for i, group in enumerate(groups):
                if set(group) != set(self.param_groups[i]):
                    raise StateDictMismatch(
                        f"fused optimizer: param_groups[{i}] has keys {sorted(group)} in the "
                        f"state dict, {sorted(self.param_groups[i])} here; nothing was loaded"
                    )
                try:
                    validate_hyperparameters(group)
                except (TypeError, ValueError) as e:
                    raise StateDictMismatch(
                        f"fused optimizer: param_groups[{i}]: {e}; nothing was loaded"
                    ) from None
        super().load_state_dict(state_dict)

    def row_options(self) -> CowClipOptions:
        """The hyperparameters the update steps with: ``param_groups[0]`` as it is now,
        parsed and validated (ValueError naming a NaN, infinite or negative value, before
        any row changes) - once while the group's values stay the same, again whenever a
        schedule or a user changes one."""
        group = self.param_groups[0]
        values = tuple(group.get(name) for name in _ROW_HYPERPARAMETERS)
        if self._parsed is None or self._parsed[0] != values:
            self._parsed = (values, CowClipOptions.from_param_group(group, self.optimizer_name))
        return self._parsed[1]

    @property
    def hyperparameters(self) -> Dict[str, Any]:
        """The live param group (edit it to change lr and friends between steps)."""
        group: Dict[str, Any] = self.param_groups[0]
        return group


def model_fused_optimizer(model: nn.Module) -> CombinedOptimizer:
    """The fused optimizers of every ``FusedOptimizerModule`` in ``model`` (its CowClip
    collections), as one ``CombinedOptimizer`` keyed by each module's path - exactly as
    ``DistributedModelParallel`` keys ``dmp.fused_optimizer`` - so that an unsharded and a
    sharded model save and load the same optimizer-state keys
    (``ebc.embedding_bags.t0.weight``: ``exp_avg``, ...).

    Example::

        >>> import torch
        >>> from torchrec import EmbeddingBagConfig
        >>> from torchrec_cowclip import CowClipEmbeddingBagCollection
        >>> model = torch.nn.Module()
        >>> model.ebc = CowClipEmbeddingBagCollection([EmbeddingBagConfig(
        ...     name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f"])])
        >>> list(model_fused_optimizer(model).state_dict()["state"])
        ['ebc.embedding_bags.t0.weight']
    """
    parts: List[Tuple[str, KeyedOptimizer]] = []

    def visit(module: nn.Module, path: str) -> None:
        if isinstance(module, FusedOptimizerModule):
            parts.append((path, module.fused_optimizer))
            return
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return CombinedOptimizer(parts)

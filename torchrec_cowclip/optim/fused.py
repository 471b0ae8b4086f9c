"""The fused optimizer handle of a CowClip embedding collection.

Like TorchRec's fused TBE optimizers, the update happens inside backward, so
:meth:`step` and :meth:`zero_grad` do nothing. The object is a TorchRec
:class:`~torchrec.optim.keyed.KeyedOptimizer` so that everything built on those works
unchanged: ``state_dict()``/``load_state_dict()`` carry each table's moments or
accumulators and its step count, ``CombinedOptimizer`` can join it with the dense
optimizer, and LR schedules (``torch.optim.lr_scheduler``, TorchRec's
``WarmupOptimizer``) can edit ``param_groups[0]["lr"]`` between steps.

Example::

    >>> ebc = CowClipEmbeddingBagCollection(tables, optimizer="adam", lr=1e-4)
    >>> opt = ebc.fused_optimizer
    >>> opt.param_groups[0]["lr"] = 5e-5          # takes effect at the next backward
    >>> torch.save(opt.state_dict(), "fused_opt.pt")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Iterable, Mapping, Optional, Set, Tuple

import torch
from torch import Tensor
from torchrec.optim.fused import FusedOptimizer

from torchrec_cowclip.optim.functional import OPTIMIZERS, CountLR, CowClip

if TYPE_CHECKING:
    from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection


def validate_hyperparameters(
    lr: float,
    betas: Tuple[float, float],
    eps: float,
    weight_decay: float,
    cowclip: Optional[CowClip],
    count_lr: Optional[CountLR] = None,
) -> None:
    """Raises ValueError naming the first bad hyperparameter (NaN, inf and negative
    values included: ``inf >= 0`` holds, so finiteness is checked on its own)."""
    for name, value, low_ok in (("lr", lr, True), ("eps", eps, False),
                                ("weight_decay", weight_decay, True)):
        if not (math.isfinite(value) and (value >= 0.0 if low_ok else value > 0.0)):
            raise ValueError(f"{name} must be {'>=' if low_ok else '>'} 0 and finite, got {value!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if cowclip is not None and not isinstance(cowclip, CowClip):
        raise TypeError(f"cowclip must be a CowClip or None, got {type(cowclip).__name__}")
    if count_lr is not None and not isinstance(count_lr, CountLR):
        raise TypeError(f"count_lr must be a CountLR or None, got {type(count_lr).__name__}")


def validate_param_group(group: Mapping[str, Any]) -> None:
    """Checks a live fused-optimizer param group before an update reads it.

    A schedule or a user may edit ``param_groups[0]`` between steps; a NaN, inf or
    negative value there would silently write non-finite weights. A few Python float
    comparisons per step, run before any row changes.

    Raises:
        ValueError: naming the param group key and its value.
    """
    try:
        validate_hyperparameters(
            float(group["lr"]), tuple(float(b) for b in group["betas"]),  # type: ignore[arg-type]
            float(group["eps"]), float(group["weight_decay"]), group["cowclip"],
            group.get("count_lr"),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"fused optimizer param_groups[0]: {e}") from None


@dataclass(frozen=True)
class CowClipOptions:
    """How the sharded tables are trained: the arguments of
    :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`, minus the tables.

    Example::

        >>> opts = CowClipOptions(optimizer="adam", lr=1e-4, cowclip=CowClip(1.0, 3.2e-5),
        ...                       unclipped_tables=frozenset({"lin"}))
        >>> opts.hyperparameters()["lr"]
        0.0001
    """

    optimizer: str = "adam"
    lr: float = 1e-4
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    cowclip: Optional[CowClip] = CowClip()
    unclipped_tables: FrozenSet[str] = field(default_factory=frozenset)
    count_lr: Optional[CountLR] = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        object.__setattr__(self, "unclipped_tables", frozenset(self.unclipped_tables))
        validate_hyperparameters(
            self.lr, self.betas, self.eps, self.weight_decay, self.cowclip, self.count_lr
        )

    @classmethod
    def from_module(cls, module: "CowClipEmbeddingBagCollection") -> "CowClipOptions":
        """The options a CowClip collection is trained with now (its fused optimizer's
        live hyperparameters, so an ``lr`` changed by a schedule is kept)."""
        hyper = module.fused_optimizer.hyperparameters
        return cls(
            optimizer=module.fused_optimizer.optimizer_name,
            lr=float(hyper["lr"]),
            betas=tuple(hyper["betas"]),  # type: ignore[arg-type]
            eps=float(hyper["eps"]),
            weight_decay=float(hyper["weight_decay"]),
            cowclip=hyper["cowclip"],
            unclipped_tables=frozenset(module.unclipped_tables),
            count_lr=hyper.get("count_lr"),
        )

    def hyperparameters(self) -> Dict[str, Any]:
        """The fused optimizer's param group entries (``lr``, ``betas``, ...)."""
        return {
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "cowclip": self.cowclip,
            "count_lr": self.count_lr,
        }

    def check_tables(self, table_names: Iterable[str]) -> None:
        """Raises ValueError if ``unclipped_tables`` names a table the module lacks."""
        names = list(table_names)
        unknown = sorted(self.unclipped_tables - set(names))
        if unknown:
            raise ValueError(
                f"unclipped_tables names tables that do not exist: {unknown}; tables are {names}"
            )


class CowClipFusedOptimizer(FusedOptimizer):
    """KeyedOptimizer view of the fused CowClip update of one embedding collection.

    Args:
        params: table parameters by key (``embedding_bags.<table>.weight``).
        state: per parameter, its optimizer state views (``exp_avg``/``exp_avg_sq`` for
            Adam, ``sum`` for row-wise Adagrad) and ``step``.
        optimizer: the update rule's name.
        hyperparameters: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``cowclip``,
            ``count_lr``; kept in ``param_groups[0]`` and read at every backward.
    """

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        state: Dict[Any, Dict[str, Tensor]],
        optimizer: str,
        hyperparameters: Mapping[str, Any],
    ) -> None:
        self.optimizer_name = optimizer
        group = {"params": list(params.values()), **hyperparameters}
        super().__init__(dict(params), state, [group])

    def step(self, closure: Any = None) -> None:
        """No-op: the update was applied during backward."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        """No-op: fused parameters never hold a ``.grad``."""

    def init_state(self, sparse_grad_parameter_names: Optional[Set[str]] = None) -> None:
        """No-op: state is allocated eagerly, so in-place loading works from the start."""

    @property
    def hyperparameters(self) -> Dict[str, Any]:
        """The live param group (edit it to change lr and friends between steps)."""
        return self.param_groups[0]  # type: ignore[index]

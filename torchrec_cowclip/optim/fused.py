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
    >>> from torchrec_cowclip import CowClipEmbeddingBagCollection
    >>> ebc = CowClipEmbeddingBagCollection(
    ...     [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
    ...     optimizer="adam", lr=1e-4)
    >>> opt = ebc.fused_optimizer
    >>> opt.param_groups[0]["lr"] = 5e-5          # takes effect at the next backward
    >>> sorted(opt.state_dict()["state"]["embedding_bags.t.weight"])
    ['exp_avg', 'exp_avg_sq', 'step']
    >>> import os, tempfile
    >>> torch.save(opt.state_dict(), os.path.join(tempfile.mkdtemp(), "fused_opt.pt"))
"""

from __future__ import annotations

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
    """Raises ValueError naming the first bad hyperparameter."""
    if not (lr >= 0.0):
        raise ValueError(f"lr must be >= 0, got {lr!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not (eps > 0.0):
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if not (weight_decay >= 0.0):
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if cowclip is not None and not isinstance(cowclip, CowClip):
        raise TypeError(f"cowclip must be a CowClip or None, got {type(cowclip).__name__}")
    if count_lr is not None and not isinstance(count_lr, CountLR):
        raise TypeError(f"count_lr must be a CountLR or None, got {type(count_lr).__name__}")


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

"""The CowClip training options a sharded collection is built with.

One frozen value object travels from the sharder to every sharded kernel, so that all
shards of all tables of a module step with the same rule. For a
:class:`~torchrec_cowclip.CowClipEmbeddingBagCollection` the options are read from the
module itself (:meth:`CowClipOptions.from_module`): sharding it keeps its optimizer,
hyperparameters and unclipped tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, Optional, Tuple, Type

import torch
import torchrec.optim as torchrec_optim

from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.optim.functional import OPTIMIZERS, CowClip
from torchrec_cowclip.optim.fused import validate_hyperparameters

#: The torch/TorchRec optimizer class whose state size TorchRec's planner knows for each
#: update rule: Adam keeps two values per weight, row-wise Adagrad one per row, SGD none.
PLANNER_OPTIMIZER_CLASS: Dict[str, Type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "rowwise_adagrad": torchrec_optim.RowWiseAdagrad,
    "sgd": torch.optim.SGD,
}


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

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        object.__setattr__(self, "unclipped_tables", frozenset(self.unclipped_tables))
        validate_hyperparameters(self.lr, self.betas, self.eps, self.weight_decay, self.cowclip)

    @classmethod
    def from_module(cls, module: CowClipEmbeddingBagCollection) -> "CowClipOptions":
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
        )

    def hyperparameters(self) -> Dict[str, Any]:
        """The fused optimizer's param group entries (``lr``, ``betas``, ...)."""
        return {
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "cowclip": self.cowclip,
        }

    def check_tables(self, table_names: Iterable[str]) -> None:
        """Raises ValueError if ``unclipped_tables`` names a table the module lacks."""
        names = list(table_names)
        unknown = sorted(self.unclipped_tables - set(names))
        if unknown:
            raise ValueError(
                f"unclipped_tables names tables that do not exist: {unknown}; tables are {names}"
            )

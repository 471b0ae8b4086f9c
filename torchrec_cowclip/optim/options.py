"""How CowClip tables are trained: one options object for every layer.

:class:`CowClipOptions` is what :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`,
its sharder, the model factory and the trainer accept and pass on, validated once where it
is built; the fused optimizer's ``param_groups[0]`` is its live, editable form.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, Mapping, Optional, Tuple

from torchrec_cowclip.optim.config import CountLR, CowClip, Helen
from torchrec_cowclip.optim.rules import OPTIMIZERS, UpdateRule, update_rule


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
    for name, value, zero_ok in (
        ("lr", lr, True),
        ("eps", eps, False),
        ("weight_decay", weight_decay, True),
    ):
        if not (math.isfinite(value) and (value >= 0.0 if zero_ok else value > 0.0)):
            raise ValueError(
                f"{name} must be {'>=' if zero_ok else '>'} 0 and finite, got {value!r}"
            )
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if cowclip is not None and not isinstance(cowclip, CowClip):
        raise TypeError(f"cowclip must be a CowClip or None, got {type(cowclip).__name__}")
    if count_lr is not None and not isinstance(count_lr, CountLR):
        raise TypeError(f"count_lr must be a CountLR or None, got {type(count_lr).__name__}")


@dataclass(frozen=True)
class CowClipOptions:
    """How CowClip tables are trained: the arguments of
    :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`, minus the tables.

    Example::

        >>> from torchrec_cowclip import CowClip
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
    #: Train the tables with Helen's two-pass step (``helen_step``) instead of one
    #: backward; not a param-group entry (it changes how a step runs, not the row step).
    helen: Optional[Helen] = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        object.__setattr__(self, "unclipped_tables", frozenset(self.unclipped_tables))
        validate_hyperparameters(
            self.lr, self.betas, self.eps, self.weight_decay, self.cowclip, self.count_lr
        )
        if self.helen is not None and not isinstance(self.helen, Helen):
            raise TypeError(f"helen must be a Helen or None, got {type(self.helen).__name__}")

    @classmethod
    def from_keywords(
        cls,
        options: Optional["CowClipOptions"],
        keywords: Mapping[str, Any],
        where: str,
        spelling: Optional[Mapping[str, str]] = None,
    ) -> "CowClipOptions":
        """The one adapter of the constructors' older spelling: ``options`` itself, or,
        when None, the options the separate ``keywords`` describe.

        Args:
            options: the options object, or None.
            keywords: the older keywords given (``optimizer=``, ``lr=``, ...).
            where: the constructor, for messages (``CowClipEmbeddingBagCollection()``).
            spelling: keyword -> field, where a constructor prefixes them
                (``build_model``'s ``embedding_lr`` -> ``lr``); default: the field names.

        Raises:
            TypeError: a keyword that names no field.
            ValueError: both ``options`` and keywords are given.
        """
        names = spelling if spelling is not None else {f: f for f in _FIELDS}
        unknown = sorted(k for k in keywords if k not in names)
        if unknown:
            raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}")
        fields = {names[k]: v for k, v in keywords.items()}
        if options is None:
            return cls(**fields)
        if not isinstance(options, CowClipOptions):
            raise TypeError(f"options must be a CowClipOptions, got {type(options).__name__}")
        if keywords:
            raise ValueError(
                f"{where}: give options= or the keyword arguments {sorted(keywords)}, not both"
            )
        return options

    @classmethod
    def from_param_group(
        cls, group: Mapping[str, Any], optimizer: str, unclipped_tables: Iterable[str] = ()
    ) -> "CowClipOptions":
        """The options a fused optimizer's live ``param_groups[0]`` holds now (a schedule
        may have edited ``lr``), validated: a NaN, infinite or negative value raises
        ValueError naming it, before any row is updated."""
        betas = group["betas"]
        try:
            return cls(
                optimizer=optimizer,
                lr=float(group["lr"]),
                betas=(float(betas[0]), float(betas[1])),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                cowclip=group["cowclip"],
                unclipped_tables=frozenset(unclipped_tables),
                count_lr=group.get("count_lr"),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"fused optimizer param_groups[0]: {e}") from None

    def replace(self, **changes: Any) -> "CowClipOptions":
        """A copy with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    @property
    def rule(self) -> UpdateRule:
        """The registered update rule :attr:`optimizer` names."""
        return update_rule(self.optimizer)

    def hyperparameters(self) -> Dict[str, Any]:
        """The fused optimizer's param group entries (``lr``, ``betas``, ``eps``,
        ``weight_decay``, ``cowclip``, ``count_lr``), which are also the row step's
        hyperparameter keywords (:func:`~torchrec_cowclip.optim.row_step.row_step_`)."""
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


#: Every field at its default: the one place the defaults are stated (the keyword
#: spellings and the in-backward optimizer classes read theirs from here).
DEFAULT_OPTIONS = CowClipOptions()

_FIELDS = tuple(f.name for f in dataclasses.fields(CowClipOptions))

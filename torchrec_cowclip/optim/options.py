"""How CowClip tables are trained: one family of frozen, validated settings.

:class:`CowClipOptions` is what :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`,
its sharder, the model factory and the trainer accept (``options=``) and pass on, validated
once where it is built; the fused optimizer's ``param_groups[0]`` is its live, editable
form. Its parts are the clip (:class:`CowClip`), the optional per-id-frequency learning
rate (:class:`CountLR`) and Helen's perturbation (:class:`Helen`). The math that uses them
is :mod:`torchrec_cowclip.optim.functional`'s; ``docs/algorithm.md`` states both. TorchRec's
own doors (a sharder's ``fused_params``, ``apply_optimizer_in_backward`` marks) are read
onto the same object by :mod:`torchrec_cowclip.optim.torchrec_config`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, Mapping, Optional, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.optim.functional import count_lr_multiplier
from torchrec_cowclip.optim.rules import OPTIMIZERS, UpdateRule, update_rule

__all__ = [
    "DEFAULT_OPTIONS",
    "OUTPUT_DTYPES",
    "CountLR",
    "CowClip",
    "CowClipOptions",
    "Helen",
    "checked_options",
    "validate_hyperparameters",
]


#: The pooled outputs' types a collection can give (``CowClipOptions.output_dtype``).
OUTPUT_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CowClip:
    """Parameters of the CowClip clip: ``tau_j = c_j * max(r * ||W[j]||, zeta)``.

    Args:
        r: clip ratio against the row's own weight norm (paper default 1.0).
        zeta: lower bound on the per-occurrence threshold, so rows with a tiny norm can
            still move. The TF reference's ``--bound`` maps to
            ``zeta = r**2 * sqrt(D) * bound`` (see :meth:`from_reference`).

    Example::

        >>> CowClip(r=1.0, zeta=1e-5)
        CowClip(r=1.0, zeta=1e-05)
        >>> round(CowClip.from_reference(r=1.0, bound=1e-5, embedding_dim=10).zeta, 7)
        3.16e-05
    """

    r: float = 1.0
    zeta: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("r", "zeta"):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or value != value
                or value
                in (
                    float("inf"),
                    float("-inf"),
                )
            ):
                raise ValueError(f"CowClip.{name} must be a finite number, got {value!r}")
        if self.r <= 0:
            raise ValueError(f"CowClip.r must be > 0, got {self.r}")
        if self.zeta < 0:
            raise ValueError(f"CowClip.zeta must be >= 0, got {self.zeta}")

    @classmethod
    def from_reference(cls, r: float, bound: float, embedding_dim: int) -> "CowClip":
        """Maps the TF reference's flags to the paper's ``zeta``.

        The reference computes ``clip = r * cnt * max(||w||, r * sqrt(D) * bound)``,
        i.e. ``cnt * max(r * ||w||, r**2 * sqrt(D) * bound)``.
        """
        return cls(r=r, zeta=r * r * (embedding_dim**0.5) * bound)


@dataclass(frozen=True)
class CountLR:
    """Per-id-frequency embedding learning rate: ``lr_j = lr * min(c_j, cap) ** power``.

    Not in the paper or the TF reference (step 5 uses one ``lr`` for every row); an
    extension searched in ``docs/scaling.md``, where it did not beat one ``lr`` for every
    row on average, so no recipe uses it. The reasoning: one step at batch ``s * b``
    replaces ``s`` steps at batch ``b``. An id seen ``c_j >= s`` times in the large batch
    would have been updated in about every one of those ``s`` small steps, an id seen once
    in only one of them; Adam moves a row by about ``lr`` per update whatever its
    gradient's size, so at a fixed ``lr`` the large batch slows frequent ids down by up to
    ``s`` and leaves rare ids as they were. ``power = 1`` gives a row back ``min(c_j, s)``
    updates' worth of movement (for gradients that agree from step to step), ``0.5`` the
    random-walk ``sqrt`` of it; ``cap = s`` (the batch scale) keeps ``lr_j = lr`` at the
    base batch and never exceeds ``s`` small steps. ``c_j`` is the same count the clip uses.

    Args:
        power: the exponent; 0 turns the scaling off, a negative one slows frequent ids.
        cap: the count above which the rate stops growing, ``>= 1``.

    Example::

        >>> CountLR(power=0.5, cap=16).multiplier(torch.tensor([1, 4, 100])).tolist()
        [1.0, 2.0, 4.0]
    """

    power: float = 0.5
    cap: float = 1.0

    def __post_init__(self) -> None:
        for name in ("power", "cap"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"CountLR.{name} must be a finite number, got {value!r}")
        if self.cap < 1:
            raise ValueError(
                f"CountLR.cap must be >= 1 (a row is seen at least once), got {self.cap}"
            )

    def multiplier(self, counts: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[U]`` ``min(c_j, cap) ** power`` for the rows' counts ``c_j``
        (:func:`~torchrec_cowclip.optim.functional.count_lr_multiplier`)."""
        return count_lr_multiplier(counts, self.power, self.cap, dtype)


@dataclass(frozen=True)
class Helen:
    """Helen (Zhu et al., WWW 2024): sharpness-aware minimisation whose perturbation of
    each embedding row grows with the row's frequency in the batch.

    Per step and table, with ``n_j`` the count of row ``j`` in the batch (CowClip's count,
    over every feature that uses the table), ``G`` the table's gradient on its touched rows
    and ``g_j`` row ``j``'s: ``e_j = rho * max(n_j / max_k n_k, bound) * g_j / (||G||_F +
    1e-12)`` (:func:`~torchrec_cowclip.optim.functional.helen_perturbation`); the rows take their step with the gradient at
    ``W + e``. ``perturb_dense`` also perturbs the dense parameters, plain SAM with their
    global gradient norm (:func:`~torchrec_cowclip.optim.functional.sam_perturbations`). ``docs/algorithm.md``, "Helen".

    Args:
        rho: perturbation radius (the reference's default 0.05); 0 makes the second pass
            evaluate the unperturbed weights.
        bound: lower bound on a row's frequency share ``n_j / max_k n_k``, in [0, 1]
            (the reference's default 0.3).
        perturb_dense: SAM on the dense parameters too (their ``.grad`` then holds the
            second pass's gradient); default: they keep the first pass's gradient.

    Example::

        >>> Helen()
        Helen(rho=0.05, bound=0.3, perturb_dense=False)
        >>> Helen(rho=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: Helen.rho must be >= 0 and finite, got -1.0
    """

    rho: float = 0.05
    bound: float = 0.3
    perturb_dense: bool = False

    def __post_init__(self) -> None:
        for name in ("rho", "bound"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"Helen.{name} must be a number, got {value!r}")
        if not (math.isfinite(self.rho) and self.rho >= 0.0):
            raise ValueError(f"Helen.rho must be >= 0 and finite, got {self.rho!r}")
        if not (math.isfinite(self.bound) and 0.0 <= self.bound <= 1.0):
            raise ValueError(f"Helen.bound must be in [0, 1], got {self.bound!r}")
        if not isinstance(self.perturb_dense, bool):
            raise ValueError(f"Helen.perturb_dense must be a bool, got {self.perturb_dense!r}")


def validate_hyperparameters(values: Mapping[str, Any]) -> None:
    """Raises ValueError naming the first bad hyperparameter of ``values`` (``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``cowclip`` and the optional ``count_lr``; NaN,
    inf and negative values included: ``inf >= 0`` holds, so finiteness is checked on its
    own), TypeError naming a missing one."""
    missing = [k for k in ("lr", "betas", "eps", "weight_decay", "cowclip") if k not in values]
    if missing:
        raise TypeError(f"missing hyperparameter {missing[0]!r}")
    lr, betas, eps = values["lr"], values["betas"], values["eps"]
    weight_decay, cowclip = values["weight_decay"], values["cowclip"]
    count_lr = values.get("count_lr")
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
    #: Half (float16 / bfloat16) tables round their updated rows back stochastically
    #: (unbiased; FBGEMM's default), or, False, to nearest. Fixed when the module is built.
    stochastic_rounding: bool = True
    #: The type of the pooled outputs (FBGEMM's ``output_dtype``): float32, or float16 /
    #: bfloat16, pooled in float32 and cast once. Fixed when the module is built.
    output_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        object.__setattr__(self, "unclipped_tables", frozenset(self.unclipped_tables))
        validate_hyperparameters(self.__dict__)
        if self.helen is not None and not isinstance(self.helen, Helen):
            raise TypeError(f"helen must be a Helen or None, got {type(self.helen).__name__}")
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be a bool, got {self.stochastic_rounding!r}")
        if self.output_dtype not in OUTPUT_DTYPES:
            raise ValueError(
                f"output_dtype must be one of {', '.join(str(d) for d in OUTPUT_DTYPES)}, "
                f"got {self.output_dtype!r}"
            )

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
        hyperparameter keywords (:func:`~torchrec_cowclip.optim.row_step.gather_step_scatter_`)."""
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


#: Every field at its default: the one place the defaults are stated (the in-backward
#: optimizer classes read theirs from here).
DEFAULT_OPTIONS = CowClipOptions()


def checked_options(options: Optional[CowClipOptions]) -> CowClipOptions:
    """``options`` as given to a collection or a sharder: None is :data:`DEFAULT_OPTIONS`;
    anything but a ``CowClipOptions`` raises TypeError naming its type."""
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, CowClipOptions):
        raise TypeError(
            f"options must be a torchrec_cowclip.CowClipOptions, got {type(options).__name__}"
        )
    return options

"""Large-batch scaling rules ("recipes"). The default, ``paper``, is the paper's rule
(``docs/algorithm.md``, "The scaling rule and the recipes"): from the base batch (1024) to
batch ``b``, with ``s = b / base``:

- embeddings: Adam, learning rate unchanged; L2 ``lambda`` scaled linearly (``* s``);
- dense weights: Adam, learning rate scaled by ``sqrt(s)``, linear warm-up over the
  first epoch;
- CowClip ``r = 1`` and ``zeta = r**2 * sqrt(D) * bound`` from the reference's bound.

Other recipes (:data:`RECIPES`, the trainer's ``--recipe``) change how each value scales
with ``s``, the warm-up and the clip; ``docs/scaling.md`` has the evidence for each.

Example::

    >>> hp = scale_hyperparameters(batch_size=16384, dataset="criteo", embedding_dim=10)
    >>> round(hp.dense_lr, 6), hp.l2, hp.embedding_lr
    (0.0032, 0.00016, 0.0001)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Union

from torchrec_cowclip.optim.options import CountLR, Helen

#: How a value grows with the batch scale ``s = batch / base``.
SCALINGS: Dict[str, Any] = {
    "fixed": lambda s: 1.0,
    "sqrt": math.sqrt,
    "linear": lambda s: s,
}


def scale_factor(rule: str, s: float) -> float:
    """The factor a value is multiplied by at scale ``s`` under ``rule`` (fixed/sqrt/linear).

    Example::

        >>> scale_factor("fixed", 16.0), scale_factor("sqrt", 16.0), scale_factor("linear", 16.0)
        (1.0, 4.0, 16.0)
    """
    if rule not in SCALINGS:
        raise ValueError(f"scaling rule must be one of {', '.join(SCALINGS)}, got {rule!r}")
    return float(SCALINGS[rule](s))


@dataclass(frozen=True)
class Recipe:
    """A named large-batch recipe: how each hyperparameter scales from the base batch.

    Attributes:
        name: the ``--recipe`` name.
        dense_lr_scaling, embedding_lr_scaling, l2_scaling: ``fixed``, ``sqrt`` or
            ``linear`` in ``s = batch / base``.
        warmup_epochs: linear warm-up of the dense lr, in epochs.
        clip_r: CowClip's ratio ``r``.
        bound: the reference's ``bound``, ``zeta = r**2 * sqrt(D) * bound``; None takes
            the data profile's (1e-5 Criteo, 1e-4 Avazu).
        count_lr_power: per-id-frequency embedding lr, ``lr * min(c_j, s) ** power`` for
            a row seen ``c_j`` times in the batch (:class:`~torchrec_cowclip.optim.options.CountLR`,
            not in the paper); 0 = one lr for every row.
        helen_rho: train with Helen (:class:`~torchrec_cowclip.optim.options.Helen`)
            with this radius at the base batch; None: no Helen.
        helen_rho_scaling: how the radius grows with ``s``. A table's perturbation has
            norm up to ``rho`` spread over the rows the batch touches, about ``s`` times
            more of them at ``s`` times the batch: ``sqrt`` keeps a row's share of it.
        helen_bound: Helen's lower bound on a row's frequency share.
        cowclip: whether the recipe trains with the CowClip clip (the scaling study's
            baselines, :data:`BASELINES`, do not).
        summary: one line for ``--help`` and the README.
    """

    name: str
    dense_lr_scaling: str = "sqrt"
    embedding_lr_scaling: str = "fixed"
    l2_scaling: str = "linear"
    warmup_epochs: float = 1.0
    clip_r: float = 1.0
    bound: Optional[float] = None
    count_lr_power: float = 0.0
    helen_rho: Optional[float] = None
    helen_rho_scaling: str = "fixed"
    helen_bound: float = Helen.bound
    cowclip: bool = True
    summary: str = ""

    def __post_init__(self) -> None:
        rules = (self.dense_lr_scaling, self.embedding_lr_scaling, self.l2_scaling)
        for rule in rules + (self.helen_rho_scaling,):
            scale_factor(rule, 1.0)  # validates the name
        if self.clip_r <= 0 or self.warmup_epochs < 0:
            raise ValueError(f"recipe {self.name}: clip_r must be > 0 and warmup_epochs >= 0")


#: The trainer's ``--recipe`` choices; ``paper`` is the default. Why each is what it is:
#: docs/scaling.md, "Why each --recipe is what it is". The no-clip :data:`BASELINES`
#: follow below and are added here.
RECIPES: Dict[str, Recipe] = {
    "paper": Recipe(
        name="paper",
        summary="the paper's rule: embedding lr fixed, dense lr x sqrt(s), L2 x s, "
        "1 epoch warm-up, r = 1, zeta = sqrt(D) * bound",
    ),
    "fixed-l2": Recipe(
        name="fixed-l2",
        l2_scaling="fixed",
        warmup_epochs=0.0,
        summary="the paper's rule with L2 NOT scaled and no warm-up: embedding lr fixed, "
        "dense lr x sqrt(s), L2 unchanged, r = 1, zeta = sqrt(D) * bound "
        "(docs/scaling.md)",
    ),
    "fixed-l2-count": Recipe(
        name="fixed-l2-count",
        l2_scaling="fixed",
        warmup_epochs=0.0,
        count_lr_power=0.5,
        summary="fixed-l2 plus the per-id-frequency embedding lr lr * min(c_j, s) ** 0.5 "
        "(docs/scaling.md)",
    ),
    "helen-fixed-l2": Recipe(
        name="helen-fixed-l2",
        l2_scaling="fixed",
        warmup_epochs=0.0,
        helen_rho=0.005,
        helen_rho_scaling="sqrt",
        summary="fixed-l2 plus Helen (two passes per step): rho = 0.005 * sqrt(s), "
        "bound 0.3 (docs/scaling.md)",
    ),
}


#: The plain large-batch rules the scaling study measures CowClip against
#: (benchmarks/scaling.py's methods ``sqrt``, ``linear``, ``none``): no clip, the
#: embedding and dense lr scaled alike. They are ``--recipe`` choices too (in
#: :data:`RECIPES`), so that a sweep's baseline cell is an ordinary ``train`` run.
BASELINES: Dict[str, Recipe] = {
    name: Recipe(
        name=name,
        dense_lr_scaling=lr_scaling,
        embedding_lr_scaling=lr_scaling,
        l2_scaling=l2_scaling,
        cowclip=False,
        summary=summary,
    )
    for name, lr_scaling, l2_scaling, summary in (
        ("sqrt", "sqrt", "linear", "no clip; embedding and dense lr x sqrt(s), L2 x s"),
        ("linear", "linear", "linear", "no clip; embedding and dense lr x s, L2 x s"),
        (
            "none",
            "fixed",
            "fixed",
            "no clip, no scaling: the base batch's lrs and L2 at every batch",
        ),
    )
}
RECIPES.update(BASELINES)


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; ValueError naming the choices otherwise."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {name!r}") from None


#: Base-batch settings of the reference README (DeepFM, batch 1024).
PROFILES: Dict[str, Dict[str, float]] = {
    "criteo": {"dense_lr": 8e-4, "l2": 1e-5, "embedding_lr": 1e-4, "bound": 1e-5},
    "avazu": {"dense_lr": 1e-4, "l2": 1e-5, "embedding_lr": 1e-4, "bound": 1e-4},
}


@dataclass(frozen=True)
class ScaledHyperparameters:
    """Every value the trainer uses, after scaling and user overrides.

    ``l2`` is the reference's ``lambda``; the embedding update's coupled
    ``weight_decay`` is ``2 * l2`` (the gradient of ``lambda * ||W||^2``).
    """

    batch_size: int
    base_batch_size: int
    scale: float
    dense_lr: float
    embedding_lr: float
    l2: float
    clip_r: float
    clip_zeta: float
    warmup_epochs: float
    profile: str
    recipe: str = "paper"
    count_lr_power: float = 0.0
    helen_rho: Optional[float] = None
    helen_bound: float = Helen.bound
    cowclip: bool = True

    @property
    def embedding_weight_decay(self) -> float:
        return 2.0 * self.l2

    @property
    def count_lr(self) -> Optional[CountLR]:
        """The fused update's per-row lr rule (cap = the batch scale ``s``), or None."""
        if self.count_lr_power == 0.0:
            return None
        return CountLR(power=self.count_lr_power, cap=max(1.0, self.scale))

    def helen(self, perturb_dense: bool = False) -> Optional[Helen]:
        """Helen's settings at this batch (None: one pass per step)."""
        if self.helen_rho is None:
            return None
        return Helen(rho=self.helen_rho, bound=self.helen_bound, perturb_dense=perturb_dense)

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["embedding_weight_decay"] = self.embedding_weight_decay
        return d


def scale_hyperparameters(
    batch_size: int,
    *,
    dataset: str = "criteo",
    base_batch_size: int = 1024,
    embedding_dim: int = 10,
    dense_lr: Optional[float] = None,
    embedding_lr: Optional[float] = None,
    l2: Optional[float] = None,
    clip_r: Optional[float] = None,
    clip_zeta: Optional[float] = None,
    warmup_epochs: Optional[float] = None,
    recipe: Union[str, Recipe] = "paper",
    count_lr_power: Optional[float] = None,
    helen_rho: Optional[float] = None,
    helen_bound: Optional[float] = None,
    base_dense_lr: Optional[float] = None,
    base_embedding_lr: Optional[float] = None,
    base_l2: Optional[float] = None,
) -> ScaledHyperparameters:
    """Applies a recipe's scaling rule; any explicitly given value overrides the rule.

    Args:
        batch_size: the training batch.
        dataset: ``"criteo"`` or ``"avazu"`` base settings (any other data uses Criteo's).
        dense_lr, embedding_lr, l2: final values that replace the scaled ones.
        clip_r, warmup_epochs, count_lr_power: replace the recipe's.
        helen_rho, helen_bound: Helen's radius (used as given, at any batch) and bound,
            replacing the recipe's (whose radius scales with ``s``).
        clip_zeta: replaces ``r**2 * sqrt(embedding_dim) * bound``.
        recipe: a name of :data:`RECIPES` (default ``paper``), or a :class:`Recipe`
            (one of :data:`BASELINES`, or a variant made with ``dataclasses.replace``).
        base_dense_lr, base_embedding_lr, base_l2: the values at the base batch, which the
            recipe then scales, instead of the data profile's.

    Example::

        >>> hp = scale_hyperparameters(8192, recipe="paper", warmup_epochs=0.5)
        >>> hp.recipe, hp.warmup_epochs, hp.clip_r
        ('paper', 0.5, 1.0)
    """
    if batch_size <= 0 or base_batch_size <= 0:
        raise ValueError(f"batch sizes must be > 0, got {batch_size} and {base_batch_size}")
    rec = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    profile = dataset if dataset in PROFILES else "criteo"
    given = {"dense_lr": base_dense_lr, "embedding_lr": base_embedding_lr, "l2": base_l2}
    base = {**PROFILES[profile], **{k: v for k, v in given.items() if v is not None}}
    s = batch_size / base_batch_size
    r = rec.clip_r if clip_r is None else clip_r
    bound = base["bound"] if rec.bound is None else rec.bound
    return ScaledHyperparameters(
        batch_size=batch_size,
        base_batch_size=base_batch_size,
        scale=s,
        dense_lr=(
            dense_lr
            if dense_lr is not None
            else base["dense_lr"] * scale_factor(rec.dense_lr_scaling, s)
        ),
        embedding_lr=(
            embedding_lr
            if embedding_lr is not None
            else base["embedding_lr"] * scale_factor(rec.embedding_lr_scaling, s)
        ),
        l2=l2 if l2 is not None else base["l2"] * scale_factor(rec.l2_scaling, s),
        clip_r=r,
        clip_zeta=clip_zeta if clip_zeta is not None else r * r * embedding_dim**0.5 * bound,
        warmup_epochs=rec.warmup_epochs if warmup_epochs is None else warmup_epochs,
        profile=profile,
        recipe=rec.name,
        count_lr_power=rec.count_lr_power if count_lr_power is None else count_lr_power,
        helen_rho=(
            helen_rho
            if helen_rho is not None
            else None
            if rec.helen_rho is None
            else rec.helen_rho * scale_factor(rec.helen_rho_scaling, s)
        ),
        helen_bound=rec.helen_bound if helen_bound is None else helen_bound,
        cowclip=rec.cowclip,
    )

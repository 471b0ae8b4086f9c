"""The paper's large-batch scaling rule (``../shared/docs/cowclip-spec.md``, "The
scaling rule"): from the base batch (1024) to batch ``b``, with ``s = b / base``:

- embeddings: Adam, learning rate unchanged; L2 ``lambda`` scaled linearly (``* s``);
- dense weights: Adam, learning rate scaled by ``sqrt(s)``, linear warm-up over the
  first epoch;
- CowClip ``r = 1`` and ``zeta = r**2 * sqrt(D) * bound`` from the reference's bound.

Example::

    >>> hp = scale_hyperparameters(batch_size=16384, dataset="criteo", embedding_dim=10)
    >>> round(hp.dense_lr, 6), hp.l2, hp.embedding_lr
    (0.0032, 0.00016, 0.0001)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

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

    @property
    def embedding_weight_decay(self) -> float:
        return 2.0 * self.l2

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
    clip_r: float = 1.0,
    clip_zeta: Optional[float] = None,
    warmup_epochs: float = 1.0,
) -> ScaledHyperparameters:
    """Applies the scaling rule; any explicitly given value overrides the rule.

    Args:
        batch_size: the training batch.
        dataset: ``"criteo"`` or ``"avazu"`` base settings (any other data uses Criteo's).
        dense_lr, embedding_lr, l2: final values that replace the scaled ones.
        clip_zeta: replaces ``r**2 * sqrt(embedding_dim) * bound``.
    """
    if batch_size <= 0 or base_batch_size <= 0:
        raise ValueError(f"batch sizes must be > 0, got {batch_size} and {base_batch_size}")
    profile = dataset if dataset in PROFILES else "criteo"
    base = PROFILES[profile]
    s = batch_size / base_batch_size
    return ScaledHyperparameters(
        batch_size=batch_size,
        base_batch_size=base_batch_size,
        scale=s,
        dense_lr=dense_lr if dense_lr is not None else base["dense_lr"] * s**0.5,
        embedding_lr=embedding_lr if embedding_lr is not None else base["embedding_lr"],
        l2=l2 if l2 is not None else base["l2"] * s,
        clip_r=clip_r,
        clip_zeta=(
            clip_zeta if clip_zeta is not None
            else clip_r * clip_r * embedding_dim**0.5 * base["bound"]
        ),
        warmup_epochs=warmup_epochs,
        profile=profile,
    )

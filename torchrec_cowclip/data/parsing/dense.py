"""Dense-feature transforms: missing -> 0, negatives -> 0, values above ``DENSE_CLIP``
-> ``DENSE_CLIP``, then log or min-max.

* ``"log"`` (default): ``log(1 + x)``; Criteo's counts span 0..1e6, and the log keeps
  the MLP's inputs O(1) without needing statistics.
* ``"minmax"``: ``(x - min) / (max - min)`` with min and max of the training rows
  (computed in the vocabulary pass), the reference's ``MinMaxScaler``; a constant
  column maps to 0. Rows outside the training range (explicit test files) are not
  clipped.
* ``"none"``: the filled, clamped values as float32.

Negatives are clamped because Criteo's few negative counts (I2 >= -3) are noise and
``log(1 + x)`` is undefined below -1. Values above ``DENSE_CLIP`` (1e9, 40x Criteo's
largest count, I5 <= 2.3e7) are clipped to it and counted (``meta["dense_clipped"]``,
``CTRDataset.dense_clipped`` and a logged warning): one stray 1e300 would otherwise
overflow float32 under ``"none"`` and, under ``"minmax"``, squash its whole column to 0.

Example::

    >>> import numpy as np
    >>> x = np.array([[np.nan, 3.0], [-2.0, 1.0]])
    >>> transform_dense(x, "log").astype(float).round(3).tolist()
    [[0.0, 1.386], [0.0, 0.693]]
    >>> stats = DenseStats(2); stats.update(x)
    >>> transform_dense(x, "minmax", stats).tolist()
    [[0.0, 1.0], [0.0, 0.0]]
    >>> clipped = np.zeros(2, np.int64)
    >>> transform_dense(np.array([[1e300, 2.0]]), "none", clipped=clipped).tolist(), clipped.tolist()
    ([[1000000000.0, 2.0]], [1, 0])
"""

from __future__ import annotations

from typing import Dict, Literal, Optional

import numpy as np

from torchrec_cowclip.data.errors import DataOptionError

DenseTransform = Literal["log", "minmax", "none"]
DENSE_TRANSFORMS = ("log", "minmax", "none")
DENSE_CLIP = 1e9


def check_transform(kind: str) -> DenseTransform:
    if kind not in DENSE_TRANSFORMS:
        raise DataOptionError(
            f"dense_transform (--dense-transform) must be one of {DENSE_TRANSFORMS}, got {kind!r}"
        )
    return kind  # type: ignore[return-value]  # one of DENSE_TRANSFORMS: checked above


def fill_and_clamp(x: np.ndarray, clipped: Optional[np.ndarray] = None) -> np.ndarray:
    """Missing (NaN) and negative values become 0, values above ``DENSE_CLIP`` become
    ``DENSE_CLIP`` (float64, new array); ``clipped`` (per column) counts the latter."""
    x = np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0)
    if clipped is not None and len(x):
        clipped += (x > DENSE_CLIP).sum(axis=0)
    return np.clip(x, 0.0, DENSE_CLIP, out=x)


class DenseStats:
    """Running per-column min and max of filled, clamped dense values."""

    def __init__(self, n_dense: int) -> None:
        self.min = np.full(n_dense, np.inf)
        self.max = np.full(n_dense, -np.inf)

    def update(self, x: np.ndarray) -> None:
        if len(x) == 0:
            return
        v = fill_and_clamp(x)
        np.minimum(self.min, v.min(axis=0), out=self.min)
        np.maximum(self.max, v.max(axis=0), out=self.max)

    def to_arrays(self) -> Dict[str, np.ndarray]:
        return {"dense_min": self.min, "dense_max": self.max}

    @classmethod
    def from_arrays(cls, arrays: Dict[str, np.ndarray]) -> "DenseStats":
        stats = cls(len(arrays["dense_min"]))
        stats.min = np.asarray(arrays["dense_min"], dtype=np.float64)
        stats.max = np.asarray(arrays["dense_max"], dtype=np.float64)
        return stats


def transform_dense(
    x: np.ndarray,
    kind: str,
    stats: Optional[DenseStats] = None,
    clipped: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Apply ``kind`` to raw dense values (NaN = missing); returns float32 ``[n, n_dense]``.

    ``clipped``, an int64 array with one entry per column, counts the values clipped
    at ``DENSE_CLIP``.
    """
    kind = check_transform(kind)
    v = fill_and_clamp(x, clipped)
    if kind == "log":
        v = np.log1p(v)
    elif kind == "minmax":
        if stats is None:
            raise ValueError("dense_transform='minmax' needs the training min/max (DenseStats)")
        lo = np.where(np.isfinite(stats.min), stats.min, 0.0)
        span = np.where(np.isfinite(stats.max), stats.max, 0.0) - lo
        safe = np.where(span > 0, span, 1.0)
        v = np.where(span > 0, (v - lo) / safe, 0.0)
    return v.astype(np.float32)

"""Dense features: each column's transform, the statistics of the training rows, and the
plan that turns stored values into the model's inputs.

A dense value goes through two stages:

1. **Stored** (at conversion, value by value, no statistics): the column's pointwise
   function, in float64: ``log`` takes ``log(1 + x)`` of ``x >= 0`` (a negative value is
   one it *cannot take*: counted per column, reported, and set to 0, Criteo's convention
   for its few negative counts), ``signed-log`` takes ``sign(x) * log(1 + |x|)`` (``log``
   for ``x >= 0``, mirrored below: every value is kept); ``standardize``, ``minmax`` and
   ``none`` store ``x``. Then a value beyond ``+-DENSE_CLIP`` (1e30) is clipped to it and
   counted: only a value that float32 and its statistics cannot hold (one stray ``1e300``)
   is touched, so a Unix timestamp (``1.7e9``) or one in nanoseconds is stored as it is
   (float32: 7 significant digits). A missing value stays NaN. These are the cache's
   ``dense.npy``; their statistics are float64.
2. **Model input** (:class:`DensePlan`, fitted on the training rows only): per column
   ``(v - shift) / scale``: ``standardize`` with the training rows' mean and standard
   deviation (population, like scikit-learn's ``StandardScaler``), ``minmax`` with their
   minimum and range (the TF reference's ``MinMaxScaler``; rows outside the training range
   are not clipped), the others unchanged. Then a missing value becomes 0: the training
   mean under ``standardize``, the minimum under ``minmax``, ``log(1 + 0)`` under ``log``.
   With ``missing_indicator`` a 0/1 input is added for each column that has missing values
   in the training rows (scikit-learn's ``SimpleImputer(add_indicator=True)``). With
   ``buckets`` each column also enters as the one-hot of its quantile bucket (boundaries:
   the training rows' quantiles, :func:`quantile_edges`; a missing value in none): a step
   function the first-order term can learn, where the value has threshold effects (a
   standard click-model input, as a categorical feature would give it).

The transform is chosen per column by a spec: one transform for every column
(``"standardize"``), columns by name (``"price=log,score=standardize"``), or both (a bare
transform is the default of the columns not named). Statistics and plans are plain JSON
(:meth:`DenseStats.to_json`, :meth:`DensePlan.to_json`), so a run's transforms can score
new rows exactly as they trained (:meth:`DensePlan.transform`).

Example::

    >>> spec = DenseTransformSpec.parse("standardize, price=log", default="signed-log")
    >>> spec.resolve(["price", "score"], "table")
    ('log', 'standardize')
    >>> raw = np.array([[np.nan, 3.0], [-2.0, 1.0], [1.0, 2.0]])
    >>> clipped, negative = np.zeros(2, np.int64), np.zeros(2, np.int64)
    >>> stored = stored_values(raw, ("log", "standardize"), clipped, negative)
    >>> stored.astype(float).round(3).tolist(), negative.tolist()
    ([[nan, 3.0], [0.0, 1.0], [0.693, 2.0]], [1, 0])
    >>> stats = DenseStats(["price", "score"]); stats.update(stored)
    >>> plan = DensePlan.fit(stats, ("log", "standardize"), missing_indicator=True)
    >>> plan.output_names
    ('price', 'score', 'price:missing')
    >>> plan.apply(stored).astype(float).round(3).tolist()
    [[0.0, 1.225, 1.0], [0.0, -1.225, 0.0], [0.693, 0.0, 0.0]]
    >>> DensePlan.from_json(plan.to_json()) == plan
    True
    >>> plan = DensePlan.fit(stats, ("log", "none"), edges=quantile_edges(stored, 2))
    >>> plan.output_names, plan.apply(stored)[:, 2:].tolist()
    (('price', 'score', 'price:q0', 'price:q1', 'score:q0', 'score:q1'), [[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from torchrec_cowclip.data.errors import DataOptionError

#: The transforms a dense column can take, and what each does (``--dense-transform``'s help).
DENSE_TRANSFORM_HELP: Dict[str, str] = {
    "log": "log(1 + x); a negative x cannot take it: counted, reported and set to 0",
    "signed-log": "sign(x) * log(1 + |x|): log(1 + x) for x >= 0, mirrored below",
    "standardize": "(x - mean) / std of the training rows",
    "minmax": "(x - min) / (max - min) of the training rows",
    "none": "x as it is",
}
DENSE_TRANSFORMS: Tuple[str, ...] = tuple(DENSE_TRANSFORM_HELP)
#: The transforms whose model inputs need statistics of the training rows.
STATISTICAL_TRANSFORMS = frozenset({"standardize", "minmax"})
#: Stored values beyond +-DENSE_CLIP (after the pointwise function) are clipped to it and
#: counted: float32 holds up to 3.4e38, and their squares must stay finite in float64.
DENSE_CLIP = 1e30
#: Runs written before the clip moved after the transform clipped raw values at 1e9
#: first (their plan's JSON has ``clip`` and no ``clip_after_transform``): such a plan
#: scores new rows the way it trained.
LEGACY_DENSE_CLIP = 1e9
#: The suffix of a missing-value indicator's name (``price:missing``).
MISSING_SUFFIX = ":missing"
#: The suffix of a quantile bucket's one-hot input, before its number (``price:q3``).
BUCKET_SUFFIX = ":q"
#: At most this many training rows (evenly spaced) give the bucket boundaries.
BUCKET_SAMPLE_ROWS = 1 << 20
#: Rows read at a time when the statistics of a set of stored rows are taken.
FIT_BLOCK_ROWS = 1 << 20
_OPTION = "dense_transform (--dense-transform)"


def check_transform(kind: str) -> str:
    """``kind`` if it names a transform, else :class:`DataOptionError` listing them."""
    if kind not in DENSE_TRANSFORMS:
        raise DataOptionError(
            f"{_OPTION}: {kind!r} is not a transform; choose one of {', '.join(DENSE_TRANSFORMS)}"
        )
    return kind


@dataclass(frozen=True)
class DenseTransformSpec:
    """Which transform each dense column takes: ``default`` for every column not named in
    ``columns`` (``(name, transform)`` pairs, in the order given).

    Example::

        >>> DenseTransformSpec.parse("price=log", default="signed-log").text()
        'signed-log,price=log'
        >>> DenseTransformSpec.parse("log,price=none,price=log", default="log")
        Traceback (most recent call last):
        ...
        torchrec_cowclip.data.errors.DataOptionError: dense_transform (--dense-transform): column 'price' is given twice
    """

    default: str
    columns: Tuple[Tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str, default: str) -> "DenseTransformSpec":
        """Parse ``"[TRANSFORM,]COLUMN=TRANSFORM,..."`` (whitespace around items ignored);
        ``default`` is the transform of the columns neither named nor covered by a bare one.

        Raises:
            DataOptionError: an unknown transform, two bare defaults, a column named twice
                or without a name.
        """
        check_transform(default)
        bare: Optional[str] = None
        columns: List[Tuple[str, str]] = []
        for item in (part.strip() for part in str(text).split(",")):
            if not item:
                continue
            name, eq, transform = (p.strip() for p in item.partition("="))
            if not eq:
                if bare is not None:
                    raise DataOptionError(
                        f"{_OPTION}: two transforms for every column ({bare!r} and {item!r}); "
                        "name the columns of the second (COLUMN=TRANSFORM)"
                    )
                bare = check_transform(item)
                continue
            if not name:
                raise DataOptionError(f"{_OPTION}: {item!r} names no column (COLUMN=TRANSFORM)")
            if any(name == c for c, _ in columns):
                raise DataOptionError(f"{_OPTION}: column {name!r} is given twice")
            columns.append((name, check_transform(transform)))
        return cls(bare or default, tuple(columns))

    def text(self) -> str:
        """The canonical spec (default first), as it enters cache keys."""
        return ",".join([self.default, *(f"{c}={t}" for c, t in self.columns)])

    def named(self) -> Tuple[str, ...]:
        """The columns the spec names."""
        return tuple(c for c, _ in self.columns)

    def check_names(self, names: Sequence[str], where: str) -> None:
        """Refuse columns of the spec that are not among the dense ``names`` of ``where``."""
        unknown = [c for c in self.named() if c not in names]
        if unknown:
            raise DataOptionError(
                f"{where}: {_OPTION} names {', '.join(map(repr, unknown))}, which "
                f"{'is' if len(unknown) == 1 else 'are'} not a dense column; the dense "
                f"columns are {list(names)}"
            )

    def resolve(self, names: Sequence[str], where: str) -> Tuple[str, ...]:
        """The transform of each of the dense columns ``names`` (of source ``where``)."""
        self.check_names(names, where)
        chosen = dict(self.columns)
        return tuple(chosen.get(n, self.default) for n in names)

    def replaced(self, old: str, new: str) -> "DenseTransformSpec":
        """The same spec with transform ``old`` read as ``new`` everywhere."""
        swap = {old: new}
        return DenseTransformSpec(
            swap.get(self.default, self.default),
            tuple((c, swap.get(t, t)) for c, t in self.columns),
        )


def stored_values(
    x: np.ndarray,
    transforms: Sequence[str],
    clipped: Optional[np.ndarray] = None,
    negative: Optional[np.ndarray] = None,
    clip_before: Optional[float] = None,
) -> np.ndarray:
    """Stage 1 (see the module docstring): raw float values ``[n, k]`` (NaN = missing) ->
    the stored float32 values (NaN = missing).

    ``clipped`` and ``negative`` (int64, one entry per column) count the values clipped at
    ``+-DENSE_CLIP`` and the negative values a ``log`` column cannot take. ``clip_before``:
    a legacy plan's bound, applied to the raw values before the transform instead.

    Example::

        >>> stored_values(np.array([[1.7e9, 1e300]]), ("standardize", "log")).tolist()
        [[1700000000.0, 690.7755126953125]]
    """
    v = np.array(x, dtype=np.float64)
    if v.ndim != 2 or v.shape[1] != len(transforms):
        raise ValueError(f"expected [n, {len(transforms)}] dense values, got {list(v.shape)}")
    if len(v) == 0:
        return v.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        bound = DENSE_CLIP if clip_before is None else clip_before
        if clip_before is not None:
            _clip(v, bound, clipped)
        columns = np.asarray(transforms)
        log = np.flatnonzero(columns == "log")
        if len(log):
            part = v[:, log]
            below = part < 0
            if negative is not None:
                negative[log] += below.sum(axis=0)
            part[below] = 0.0
            v[:, log] = np.log1p(part)
        signed = np.flatnonzero(columns == "signed-log")
        if len(signed):
            part = v[:, signed]
            v[:, signed] = np.sign(part) * np.log1p(np.abs(part))
        if clip_before is None:
            _clip(v, bound, clipped)
    return v.astype(np.float32)


def _clip(v: np.ndarray, bound: float, clipped: Optional[np.ndarray]) -> None:
    if clipped is not None:
        clipped += (np.abs(v) > bound).sum(axis=0)
    np.clip(v, -bound, bound, out=v)


def constant_columns(
    stats: "DenseStats", transforms: Sequence[str], names: Sequence[str]
) -> List[str]:
    """One line per dense column that carries (almost) nothing into the model, judged
    by the stored values' statistics: constant after its transform (every present value
    the same), or varying by less than 1e-3 of its size under a transform that does not
    centre it (a Unix timestamp under ``signed-log``: ``21.25 +- 0.0004``).

    Example::

        >>> s = DenseStats(["a", "ts", "x"])
        >>> s.update(np.array([[1.0, 21.2500, 0.0], [1.0, 21.2504, 5.0]]))
        >>> for line in constant_columns(s, ("none", "signed-log", "log"), s.names):
        ...     print(line)
        dense column 'a' is constant after its transform none (every training value 1): it carries nothing into the model
        dense column 'ts' varies by 0.0002 around 21.2502 after signed-log: nearly constant to the model; if it is a Unix time, --time-columns ts (instead of --dense) gives the model its hour of day and day of week
    """
    lines = []
    for j, (name, transform) in enumerate(zip(names, transforms)):
        if stats.count[j] < 2:
            continue
        mean, std = float(stats.mean[j]), float(stats.std[j])
        if stats.max[j] == stats.min[j]:
            lines.append(
                f"dense column {name!r} is constant after its transform {transform} (every "
                f"training value {stats.min[j]:.6g}): it carries nothing into the model"
            )
        elif transform not in STATISTICAL_TRANSFORMS and std < 1e-3 * abs(mean):
            fix = (
                f"if it is a Unix time, --time-columns {name} (instead of --dense) gives the "
                "model its hour of day and day of week"
                if _timestamp_like(mean, transform)
                else f"--dense-transform {name}=standardize centres and scales it"
            )
            lines.append(
                f"dense column {name!r} varies by {std:.3g} around {mean:.6g} after "
                f"{transform}: nearly constant to the model; {fix}"
            )
    return lines


def dense_notes(
    stats: "DenseStats",
    transforms: Sequence[str],
    clipped: Mapping[str, int],
    negative: Mapping[str, int],
    rows: int,
) -> List[str]:
    """What the conversion did to the dense values of ``rows`` rows, one line each (empty
    if nothing): the values ``clipped`` at ``+-DENSE_CLIP`` and the ``negative`` values a
    ``log`` column set to 0 (both per column, as counted by :func:`stored_values`), and
    the columns (nearly) constant after their transform (:func:`constant_columns` of
    ``stats``, the converted rows' statistics).

    Example::

        >>> s = DenseStats(["price"]); s.update(np.array([[0.0], [2.0]]))
        >>> dense_notes(s, ("log",), {}, {"price": 1}, rows=4)
        ['negative values set to 0: log(1 + x) cannot take them (price 1 (25.0%)); --dense-transform price=signed-log (or standardize, minmax, none) keeps them']
    """
    notes = []
    if clipped:
        notes.append(
            f"clipped {sum(clipped.values()):,} dense values beyond "
            f"+-{DENSE_CLIP:g} (per column: {dict(clipped)})"
        )
    if negative:
        shown = ", ".join(f"{n} {v:,} ({v / max(rows, 1):.1%})" for n, v in negative.items())
        notes.append(
            f"negative values set to 0: log(1 + x) cannot take them ({shown}); "
            f"--dense-transform {next(iter(negative))}=signed-log (or standardize, minmax, "
            "none) keeps them"
        )
    return notes + constant_columns(stats, transforms, stats.names)


def _timestamp_like(mean: float, transform: str) -> bool:
    """Whether a column's mean after ``transform`` is that of Unix seconds or milliseconds
    between 1973 and 2100 (where a nearly constant column is most likely a timestamp)."""
    raw = math.expm1(mean) if transform in ("log", "signed-log") and mean < 700 else mean
    return 1e8 <= raw <= 4.2e9 or 1e11 <= raw <= 4.2e12


class DenseStats:
    """Per column of stored values: count of present values, missing values, mean,
    standard deviation (population), minimum and maximum; blocks combine exactly
    (Chan's pairwise update), so a streaming pass gives the whole set's figures.

    Example::

        >>> s = DenseStats(["a"]); s.update(np.array([[1.0], [np.nan]])); s.update(np.array([[3.0]]))
        >>> s.count.tolist(), s.missing.tolist(), s.mean.tolist(), s.std.tolist()
        ([2], [1], [2.0], [1.0])
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        k = len(self.names)
        self.count = np.zeros(k, dtype=np.int64)
        self.missing = np.zeros(k, dtype=np.int64)
        self.mean = np.zeros(k)
        self._m2 = np.zeros(k)
        self.min = np.full(k, np.inf)
        self.max = np.full(k, -np.inf)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self._m2 / np.maximum(self.count, 1))

    def update(self, v: np.ndarray) -> None:
        """Adds a block of stored values ``[n, k]`` (NaN = missing)."""
        if len(v) == 0:
            return
        v = np.asarray(v, dtype=np.float64)
        present = ~np.isnan(v)
        n_b = present.sum(axis=0)
        self.missing += len(v) - n_b
        with np.errstate(invalid="ignore", divide="ignore"):
            total = np.where(present, v, 0.0).sum(axis=0)
            mean_b = np.where(n_b > 0, total / np.maximum(n_b, 1), 0.0)
            m2_b = np.where(present, (v - mean_b) ** 2, 0.0).sum(axis=0)
            np.fmin(self.min, np.where(present, v, np.inf).min(axis=0), out=self.min)
            np.fmax(self.max, np.where(present, v, -np.inf).max(axis=0), out=self.max)
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self.mean
        share = np.where(n > 0, n_b / np.maximum(n, 1), 0.0)
        self.mean = self.mean + delta * share
        self._m2 = self._m2 + m2_b + delta**2 * n_a * share
        self.count = n

    def to_json(self) -> Dict[str, Any]:
        """Plain JSON (no NaN or infinity: an empty column's figures are null)."""

        def values(a: np.ndarray) -> List[Optional[float]]:
            return [float(x) if math.isfinite(x) else None for x in a.tolist()]

        return {
            "names": list(self.names),
            "count": self.count.tolist(),
            "missing": self.missing.tolist(),
            "mean": values(self.mean),
            "std": values(self.std),
            "min": values(self.min),
            "max": values(self.max),
        }

    @classmethod
    def of_rows(cls, stored: np.ndarray, rows: np.ndarray, names: Sequence[str]) -> "DenseStats":
        """The statistics of the stored values of ``rows`` (sorted: a memory-mapped
        ``stored`` is read in order) of ``stored`` ``[N, len(names)]``, read
        ``FIT_BLOCK_ROWS`` rows at a time."""
        stats = cls(names)
        for start in range(0, len(rows), FIT_BLOCK_ROWS):
            stats.update(np.asarray(stored[rows[start : start + FIT_BLOCK_ROWS]]))
        return stats

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "DenseStats":
        stats = cls(d["names"])

        def values(key: str, empty: float) -> np.ndarray:
            return np.array([empty if x is None else float(x) for x in d[key]], dtype=np.float64)

        stats.count = np.asarray(d["count"], dtype=np.int64)
        stats.missing = np.asarray(d["missing"], dtype=np.int64)
        stats.mean = values("mean", 0.0)
        stats._m2 = values("std", 0.0) ** 2 * stats.count
        stats.min, stats.max = values("min", np.inf), values("max", -np.inf)
        return stats


def plan_needs_statistics(
    transforms: Sequence[str], missing_indicator: bool, buckets: int = 0
) -> bool:
    """Whether fitting a plan reads the training rows (a statistical transform, which
    columns miss values, or quantile buckets)."""
    return missing_indicator or buckets > 0 or any(t in STATISTICAL_TRANSFORMS for t in transforms)


def quantile_edges(stored: np.ndarray, buckets: int) -> Tuple[Tuple[float, ...], ...]:
    """Per column of stored values ``[n, k]`` (NaN = missing), the inner boundaries of
    ``buckets`` equal-count buckets of its present values: at each ``i / buckets``
    quantile (``i = 1 .. buckets - 1``), halfway between the training values on either
    side of it (the same split of the training rows, but no boundary on a value: a value
    the exported program reads as float32 input, an ulp away from the float64 text
    predict parses, falls in the same bucket). A column with few distinct values gets
    fewer buckets (one that is constant or empty, none). A value ``v`` falls in bucket
    ``#{edges <= v}``.

    Example::

        >>> quantile_edges(np.array([[1.0, 0.0], [2.0, 0.0], [3.0, np.nan], [4.0, 0.0]]), 4)
        ((1.5, 2.5, 3.5), ())
    """
    v = np.asarray(stored, dtype=np.float64)
    if buckets < 2 or len(v) == 0:
        return tuple(() for _ in range(v.shape[1] if v.ndim == 2 else 0))
    levels = np.arange(1, buckets) / buckets
    edges: List[Tuple[float, ...]] = []
    for j in range(v.shape[1]):
        present = v[:, j][~np.isnan(v[:, j])]
        if len(present) == 0 or present.min() == present.max():
            edges.append(())
            continue
        values = np.unique(present)
        above = np.searchsorted(values, np.quantile(present, levels), side="left")
        above = np.unique(above[above >= 1])  # none at the minimum: an empty lowest bucket
        edges.append(tuple(float(e) for e in (values[above - 1] + values[above]) / 2))
    return tuple(edges)


@dataclass(frozen=True)
class DensePlan:
    """Stored dense values -> model inputs (stage 2 of the module docstring).

    Attributes:
        names, transforms: the dense columns and their transforms.
        shift, scale: per column, ``input = (stored - shift) / scale``.
        indicators: the columns that get a 0/1 missing-value input (in column order).
        fitted_on: what the statistics were taken over (for reports).
    """

    names: Tuple[str, ...]
    transforms: Tuple[str, ...]
    shift: Tuple[float, ...]
    scale: Tuple[float, ...]
    indicators: Tuple[str, ...] = ()
    fitted_on: str = ""
    #: A legacy run's bound on the raw values, clipped before the transform (None: the
    #: stored values are clipped at ``DENSE_CLIP`` after it).
    clip_before: Optional[float] = None
    #: Per column, the smallest and largest stored value (after the transform) of the
    #: training rows; empty where the run did not record them (an older run folder).
    low: Tuple[float, ...] = ()
    high: Tuple[float, ...] = ()
    #: Per column, the inner boundaries of its quantile buckets on stored values
    #: (:func:`quantile_edges`); empty: no bucket inputs (for every column, or this one).
    edges: Tuple[Tuple[float, ...], ...] = ()

    @classmethod
    def fit(
        cls,
        stats: Optional[DenseStats],
        transforms: Sequence[str],
        missing_indicator: bool = False,
        fitted_on: str = "",
        names: Optional[Sequence[str]] = None,
        edges: Tuple[Tuple[float, ...], ...] = (),
    ) -> "DensePlan":
        """The plan for columns with ``transforms`` given their training ``stats`` (which
        may be None when :func:`plan_needs_statistics` says none are needed; then
        ``names`` names the columns), and the quantile buckets' ``edges`` of each column
        (:func:`quantile_edges` of the training rows; empty: no bucket inputs)."""
        edges = edges if any(edges) else ()
        if stats is None:
            if plan_needs_statistics(transforms, missing_indicator) or names is None:
                raise ValueError("these dense transforms need the training rows' statistics")
            k = len(transforms)
            plan = cls(tuple(names), tuple(transforms), (0.0,) * k, (1.0,) * k, (), fitted_on)
            return replace(plan, edges=edges)
        shift, scale = [], []
        for j, t in enumerate(transforms):
            a, b = 0.0, 1.0
            if stats.count[j] > 0 and t == "standardize":
                a, b = float(stats.mean[j]), float(stats.std[j])
            elif stats.count[j] > 0 and t == "minmax":
                a, b = float(stats.min[j]), float(stats.max[j] - stats.min[j])
            shift.append(a)
            scale.append(b if b > 0 and math.isfinite(b) else 1.0)  # a constant column -> 0
        indicators = tuple(
            n for n, m in zip(stats.names, stats.missing.tolist()) if missing_indicator and m
        )
        plan = cls(
            stats.names, tuple(transforms), tuple(shift), tuple(scale), indicators, fitted_on
        )
        return replace(plan.with_range(stats), edges=edges)

    @classmethod
    def fit_rows(
        cls,
        stats: DenseStats,
        transforms: Sequence[str],
        stored: np.ndarray,
        rows: np.ndarray,
        missing_indicator: bool = False,
        buckets: int = 0,
        fitted_on: str = "",
    ) -> "DensePlan":
        """The plan fitted on the training ``rows`` of the stored values ``stored``
        ``[N, k]``: :meth:`fit` with their statistics ``stats`` (:meth:`DenseStats.of_rows`,
        or the conversion's when they are the training files), and ``buckets`` quantile
        buckets per column whose edges (:func:`quantile_edges`) come from at most
        ``BUCKET_SAMPLE_ROWS`` of the rows, evenly spaced (none without ``buckets``)."""
        edges: Tuple[Tuple[float, ...], ...] = ()
        if buckets >= 2 and stored.shape[1] and len(rows):
            step = max(1, -(-len(rows) // BUCKET_SAMPLE_ROWS))
            edges = quantile_edges(np.asarray(stored[rows[::step]]), buckets)
        return cls.fit(stats, transforms, missing_indicator, fitted_on, edges=edges)

    def with_range(self, stats: "DenseStats") -> "DensePlan":
        """This plan with the training range of ``stats`` (stored values) recorded."""
        low = tuple(float(v) if math.isfinite(v) else math.nan for v in stats.min.tolist())
        high = tuple(float(v) if math.isfinite(v) else math.nan for v in stats.max.tolist())
        return replace(self, low=low, high=high)

    def outside(self, stored: np.ndarray) -> Optional[np.ndarray]:
        """Per column, how many of ``stored`` (``[n, k]``, after the transform) lie
        outside the training range (missing values do not count); None without a range.

        Example::

            >>> s = DenseStats(["a"]); s.update(np.array([[0.0], [2.0]]))
            >>> plan = DensePlan.fit(s, ("none",))
            >>> plan.outside(np.array([[-1.0], [1.0], [3.0], [np.nan]])).tolist()
            [2]
        """
        if not self.low:
            return None
        v = np.asarray(stored, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            out = (v < np.asarray(self.low)) | (v > np.asarray(self.high))
        return out.sum(axis=0).astype(np.int64)

    @property
    def output_names(self) -> Tuple[str, ...]:
        """The model's dense inputs: the columns, the indicators, then each column's
        quantile buckets (one-hot)."""
        buckets = tuple(
            f"{n}{BUCKET_SUFFIX}{b}"
            for n, e in zip(self.names, self.edges)
            if e
            for b in range(len(e) + 1)
        )
        return self.names + tuple(n + MISSING_SUFFIX for n in self.indicators) + buckets

    def apply(self, stored: np.ndarray) -> np.ndarray:
        """Model inputs (float32 ``[n, len(output_names)]``) of stored values ``[n, k]``."""
        v = np.asarray(stored, dtype=np.float64)
        missing = np.isnan(v)
        out = (v - np.asarray(self.shift)) / np.asarray(self.scale)
        out[missing] = 0.0
        if self.indicators:
            columns = [self.names.index(n) for n in self.indicators]
            out = np.concatenate([out, missing[:, columns].astype(np.float64)], axis=1)
        hot = [
            (np.searchsorted(e, v[:, j], side="right")[:, None] == np.arange(len(e) + 1))
            & ~missing[:, j : j + 1]
            for j, e in enumerate(self.edges)
            if e
        ]
        if hot:
            out = np.concatenate([out, *hot], axis=1)
        return out.astype(np.float32)

    def transform(self, raw: np.ndarray) -> np.ndarray:
        """Model inputs of raw values (NaN = missing): both stages, for new rows to score."""
        return self.apply(stored_values(raw, self.transforms, clip_before=self.clip_before))

    def to_json(self) -> Dict[str, Any]:
        """Plain JSON: one entry per column, and what the plan was fitted on."""
        return {
            "columns": [
                {
                    "name": n,
                    "transform": t,
                    "shift": a,
                    "scale": b,
                    "missing_indicator": n in self.indicators,
                    **(
                        {"low": _json_number(self.low[j]), "high": _json_number(self.high[j])}
                        if self.low
                        else {}
                    ),
                    **({"buckets": list(self.edges[j])} if self.edges else {}),
                }
                for j, (n, t, a, b) in enumerate(
                    zip(self.names, self.transforms, self.shift, self.scale)
                )
            ],
            "clip": DENSE_CLIP if self.clip_before is None else self.clip_before,
            "clip_after_transform": self.clip_before is None,
            "fitted_on": self.fitted_on,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "DensePlan":
        columns = d["columns"]
        for c in columns:
            check_transform(c["transform"])
        return cls(
            tuple(c["name"] for c in columns),
            tuple(c["transform"] for c in columns),
            tuple(float(c["shift"]) for c in columns),
            tuple(float(c["scale"]) for c in columns),
            tuple(c["name"] for c in columns if c["missing_indicator"]),
            str(d.get("fitted_on", "")),
            None if d.get("clip_after_transform") else float(d.get("clip", LEGACY_DENSE_CLIP)),
            *_ranges(columns),
            edges=_edges(columns),
        )

    def summary(self) -> str:
        """One line: the transforms by column, and the indicators."""
        groups: Dict[str, List[str]] = {}
        for n, t in zip(self.names, self.transforms):
            groups.setdefault(t, []).append(n)
        parts = [f"{t} ({_names(ns)})" for t, ns in groups.items()]
        if self.indicators:
            parts.append(f"missing-value indicators for {_names(self.indicators)}")
        bucketed = [n for n, e in zip(self.names, self.edges) if e]
        if bucketed:
            most = max(len(e) + 1 for e in self.edges)
            parts.append(f"up to {most} quantile buckets (one-hot) of {_names(bucketed)}")
        return "; ".join(parts) or "no dense columns"


def _names(names: Sequence[str]) -> str:
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]}, ..., {names[-1]}: {len(names)} columns"


def _json_number(v: float) -> Optional[float]:
    return v if math.isfinite(v) else None


def _ranges(columns: Sequence[Mapping[str, Any]]) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """The recorded training ranges of a plan's columns (empty when not recorded)."""
    if not columns or any("low" not in c for c in columns):
        return (), ()

    def value(v: Any) -> float:
        return math.nan if v is None else float(v)

    return tuple(value(c["low"]) for c in columns), tuple(value(c["high"]) for c in columns)


def _edges(columns: Sequence[Mapping[str, Any]]) -> Tuple[Tuple[float, ...], ...]:
    """The recorded bucket boundaries of a plan's columns (empty when none were)."""
    if not any(c.get("buckets") for c in columns):
        return ()
    return tuple(tuple(float(e) for e in c.get("buckets") or ()) for c in columns)

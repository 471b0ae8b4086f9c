"""Synthetic Criteo-like click logs with a planted logistic model.

Layout: 13 dense features ``I1..I13`` and 26 categorical features ``C1..C26``, like
Criteo. The rows are drawn as follows.

**Cardinalities.** Criteo Kaggle's published per-feature cardinalities
(``CRITEO_KAGGLE_CARDINALITIES``: 3 to 10,131,227) times ``cardinality_scale``,
rounded, capped at ``max_cardinality`` and at least 1.

**Id frequencies (power law).** Within a feature of cardinality ``K`` the id of
frequency rank ``r`` (``r = 1..K``) is drawn with probability proportional to
``r ** -s`` (Zipf); a fixed random permutation maps ranks to ids, so frequent ids
are not simply the small ones. The exponent ``s`` is fitted per feature so that the
most frequent 1% of its ids (at least one id) receive ``top1_share`` of its
occurrences. Default ``top1_share = 0.70``: the classic Zipf law (``s = 1``) gives
0.68 at K = 1M and 0.72 at K = 10M (Criteo's C3, C12), so 0.70 reproduces a Zipf
head at Criteo's sizes, and fixing the share rather than ``s`` keeps small features
(K = 3..105) from being nearly uniform. It is a chosen target, not a statistic
measured on the 45M-row file (the project's 200-row sample cannot measure it). The
fitted exponents, for the uncapped Kaggle sizes: K=3 -> 1.79, 24 -> 2.28, 583 -> 1.46,
14,992 -> 1.13, 142,572 -> 1.05, 1M -> 1.01, 10.1M -> 0.99.

**Dense features.** Count-like: missing with a per-feature probability (roughly
Criteo Kaggle's rates, 0% for I2 to 77% for I12), else ``floor(exp(N(mu, sigma)))``
with per-feature medians from 0 to ~3,000; they go through the same
``dense_transform`` as real data (``log(1 + x)`` by default).

**Labels (planted model).** ``P(click) = sigmoid(logit)`` with::

    logit = b + sum_f w_f[id_f]                      (every id, frequent or rare: N(0, 0.24^2))
              + sum_j v_j * (log1p(x_j) - m_j)       (dense, v_j ~ N(0, 0.15^2))
              + sum_{(f,g) in PAIRS} <U_f[id_f], U_g[id_g]>   (rank 4, U ~ N(0, 0.4^2))

``PAIRS`` = (C1, C2), (C3, C14), (C6, C9), (C10, C24): small x small, huge x small
and large x large fields. Rare ids carry weights as large as frequent ones, so part
of the signal sits in the tail, as the CowClip paper argues it does on Criteo: at
the defaults the logit's variance (about 2.1) splits into ids 1.29 (of which ids
outside their field's top 1%: 0.43), dense 0.48 and interactions 0.33. ``b`` is
solved on a fixed 65,536-row calibration draw so that the mean click probability is
``positive_rate`` (default 0.25; Criteo Kaggle has 25.6% positives). The planted
logit's own AUC on its labels (the Bayes limit of any model) is 0.81 at the
defaults (1M rows) and 0.75-0.80 at ``cardinality_scale=0.01`` depending on the
seed, comparable to the best published Criteo AUCs (~0.81); ``planted_logit.npy``
is kept in the cache and the AUC in ``meta.json``.

Every number above is a :class:`SyntheticConfig` field (``id_sigma``,
``rare_id_sigma``, ``dense_sigma``, ``latent_dim``, ``latent_sigma``, ``pairs``,
``top1_share``); :func:`logit_variance` measures the split for any config and the
cache's ``meta.json`` keeps it (``logit_variance``).

**The hard profile** (``synthetic-hard:ROWS``, :data:`HARD_PROFILE`): the same
generator with more of the signal where a model learns it slowly, in interactions
and in rare ids. Twelve pairs instead of four (the four above plus (C4, C16),
(C12, C21), (C7, C15), (C10, C26), (C11, C18), (C13, C19), (C3, C24), (C1, C8):
pairs among mid and large fields), rank 8 and ``latent_sigma = 0.34`` (0.107 of
variance per pair, 0.102 before); a heavier tail, ``top1_share = 0.35`` (the top 1%
of ids get 35% of the occurrences, not 70%), and ``rare_id_sigma = 0.26`` for the ids
outside the top 1% (0.24 for the others); dense weights ``dense_sigma = 0.10``. At
the defaults' sizes (1M rows, seed 0) the logit's variance (3.2, 2.1 before) splits
into ids 1.66 (outside the top 1%: 1.14, before 0.43), dense 0.26 and interactions
1.31 (0.33 before), and the planted AUC is 0.85 (0.81); at
``cardinality_scale=0.05, max_cardinality=50000``: variance 2.37 = ids 1.07 (tail
0.81) + dense 0.20 + interactions 1.11, planted AUC 0.82 (seeds 1, 2: 0.83, 0.84; the
default profile there: 1.36 = ids 0.71 (tail 0.32) + dense 0.52 + interactions 0.12,
planted AUC 0.77, seeds 1, 2: 0.79). At that size (1M rows, seeds 0-2) DeepFM (DNN
64-64, Adam, embedding lr 1e-3, batch 64, its best epoch) reaches test AUC 0.717-0.742
on the hard profile, about 0.10 below the planted AUC, against 0.741-0.768 on the
default, 0.02-0.03 below; and plain Adam at batch 8192 loses 0.008-0.010 of it on
the hard profile in every seed, while on the default it loses none (-0.001..+0.002).

**Reproducibility.** Rows are generated in fixed chunks of 65,536 from
``SeedSequence([seed, 2, chunk])``, parameters from ``SeedSequence([seed, 0])``:
the same options give bit-identical arrays, and ``synthetic:N`` is a prefix of
``synthetic:M`` for ``N < M``. Generation speed is in docs/performance.md.

As a source kind (``synthetic:ROWS``, ``synthetic-hard:ROWS``), the rows are one part written through the
same pipeline and writer as the files of the other kinds, with the planted logit as
an extra array. Their missing dense values are stored as NaN, as a file's are, and the
dataset's plan makes the model inputs (``parsing.dense``).

Example::

    >>> cfg = SyntheticConfig(rows=1000, seed=1, cardinality_scale=0.01, max_cardinality=5000)
    >>> dense, sparse, labels, logit = synthetic_arrays(cfg)
    >>> dense.shape, sparse.shape, bool((sparse < cfg.cardinalities()).all())
    ((1000, 13), (1000, 26), True)
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from torchrec_cowclip.data.errors import BadRowLog, DataOptionError
from torchrec_cowclip.data.parsing.dense import (
    DensePlan,
    DenseStats,
    DenseTransformSpec,
    stored_values,
)
from torchrec_cowclip.data.parsing.fields import check_labels
from torchrec_cowclip.data.parsing.rows import RowBlock, SparseCheck
from torchrec_cowclip.data.pipeline.encode import Conversion, SparseEncoding
from torchrec_cowclip.data.registry import SourceKind, register_source
from torchrec_cowclip.data.schema import (
    CRITEO_DENSE_NAMES,
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_SPARSE_NAMES,
    Schema,
)
from torchrec_cowclip.data.source_options import SourceOptions, option_field

CHUNK_ROWS = 1 << 16
CALIBRATION_ROWS = 1 << 16
TOP_FRACTION = 0.01
SIGMA_ID = 0.24
SIGMA_DENSE = 0.15
LATENT_DIM = 4
SIGMA_LATENT = 0.40  # <U_f, U_g> has std LATENT_DIM**0.5 * SIGMA_LATENT**2 = 0.32 per pair
PAIRS: Tuple[Tuple[str, str], ...] = (("C1", "C2"), ("C3", "C14"), ("C6", "C9"), ("C10", "C24"))
# The ``synthetic-hard:`` profile (module docstring, "The hard profile"): SyntheticConfig
# fields that differ from the defaults.
HARD_PROFILE: Dict[str, Any] = dict(
    top1_share=0.35,
    rare_id_sigma=0.26,
    dense_sigma=0.10,
    latent_dim=8,
    latent_sigma=0.34,
    pairs=PAIRS
    + (
        ("C4", "C16"),
        ("C12", "C21"),
        ("C7", "C15"),
        ("C10", "C26"),
        ("C11", "C18"),
        ("C13", "C19"),
        ("C3", "C24"),
        ("C1", "C8"),
    ),
)

# Per dense feature I1..I13: probability of missing, median count, log-scale spread.
DENSE_MISSING = np.array(
    [0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22]
)
DENSE_MEDIAN = np.array([1.0, 3.0, 8.0, 5.0, 3000.0, 30.0, 3.0, 8.0, 40.0, 1.0, 1.0, 0.5, 5.0])
DENSE_SPREAD = np.array([1.2, 1.5, 1.3, 1.0, 1.5, 1.6, 1.4, 0.9, 1.3, 0.8, 1.0, 1.0, 1.3])


@dataclass(frozen=True)
class SyntheticConfig:
    """Options of the synthetic generator (see the module docstring).

    Args:
        rows: number of rows.
        seed: everything is a function of the seed and the other options.
        cardinality_scale: factor on Criteo Kaggle's cardinalities.
        max_cardinality: cap on any feature's cardinality.
        top1_share: share of occurrences of each feature's top 1% ids.
        positive_rate: target mean click probability.
        dense_transform: the dense columns' transform spec (``parsing.dense``; default
            ``"log"``, a column not named takes ``log``).
        id_sigma: std of the per-id weights ``w_f`` of the ids in their field's top 1%.
        rare_id_sigma: std of ``w_f`` for every other id (the tail).
        dense_sigma: std of the dense weights ``v_j``.
        latent_dim: rank of the pairwise interactions.
        latent_sigma: std of the interaction factors ``U_f``.
        pairs: the interacting field pairs, by name (``("C1", "C2")``).
    """

    rows: int
    seed: int = 0
    cardinality_scale: float = 1.0
    max_cardinality: int = 1_000_000
    top1_share: float = 0.70
    positive_rate: float = 0.25
    dense_transform: str = "log"
    id_sigma: float = SIGMA_ID
    rare_id_sigma: float = SIGMA_ID
    dense_sigma: float = SIGMA_DENSE
    latent_dim: int = LATENT_DIM
    latent_sigma: float = SIGMA_LATENT
    pairs: Tuple[Tuple[str, str], ...] = PAIRS

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise DataOptionError(f"synthetic rows must be >= 1, got {self.rows}")
        if not self.cardinality_scale > 0:
            raise DataOptionError(
                f"cardinality_scale (--synthetic-scale) must be > 0, got {self.cardinality_scale}"
            )
        if self.max_cardinality < 1:
            raise DataOptionError(
                f"max_cardinality (--synthetic-max-cardinality) must be >= 1, got {self.max_cardinality}"
            )
        for name in ("top1_share", "positive_rate"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise DataOptionError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        object.__setattr__(self, "dense_transform", self.dense_spec().text())
        for name in ("id_sigma", "rare_id_sigma", "dense_sigma", "latent_sigma"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise DataOptionError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.latent_dim < 1:
            raise DataOptionError(f"latent_dim must be >= 1, got {self.latent_dim}")
        for pair in self.pairs:
            if len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(CRITEO_SPARSE_NAMES):
                raise DataOptionError(
                    f"pairs: each pair must be two different fields of C1..C26, got {pair!r}"
                )
        # Normalised so that a list of lists (JSON) and a tuple of tuples are one config.
        object.__setattr__(self, "pairs", tuple((str(f), str(g)) for f, g in self.pairs))

    def cardinalities(self) -> Tuple[int, ...]:
        """Per-feature cardinality: Kaggle's, scaled, capped, at least 1."""
        return tuple(
            max(1, min(self.max_cardinality, int(round(k * self.cardinality_scale))))
            for k in CRITEO_KAGGLE_CARDINALITIES
        )

    def schema(self) -> Schema:
        return Schema(CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, self.cardinalities())

    def dense_spec(self) -> DenseTransformSpec:
        """:attr:`dense_transform` parsed (a column not named takes ``log``)."""
        return DenseTransformSpec.parse(self.dense_transform, default="log")

    def payload(self) -> Dict[str, Any]:
        """The options as JSON. The options added with the hard profile are left out at
        their defaults, so that configs that do not set them keep their cache keys."""
        out = asdict(self)
        defaults = {f.name: f.default for f in fields(self)}
        for name in _PROFILE_FIELDS:
            if out[name] == defaults[name]:
                del out[name]
        if "pairs" in out:
            out["pairs"] = [list(p) for p in self.pairs]
        return out


_PROFILE_FIELDS = (
    "id_sigma",
    "rare_id_sigma",
    "dense_sigma",
    "latent_dim",
    "latent_sigma",
    "pairs",
)


def _power_sum(n: int, s: float) -> float:
    """``sum_{r=1..n} r**-s``: exact for the first 4096 terms, Euler-Maclaurin beyond
    (relative error < 1e-12 there), so fitting a 10M-id feature costs microseconds."""
    head = min(n, 4096)
    total = float(np.sum(np.arange(1, head + 1, dtype=np.float64) ** -s))
    if n <= head:
        return total
    a, b = head + 1, n
    if abs(s - 1.0) < 1e-12:
        integral = math.log(b / a)
    else:
        integral = (b ** (1 - s) - a ** (1 - s)) / (1 - s)
    # Powers with a float exponent are Any to mypy (a negative base gives a complex);
    # the bases here are >= 1.
    ends: float = (a**-s + b**-s) / 2
    deriv: float = (-s * b ** (-s - 1) + s * a ** (-s - 1)) / 12
    return total + integral + ends + deriv


@lru_cache(maxsize=None)
def fit_zipf_exponent(
    cardinality: int, top_share: float, top_fraction: float = TOP_FRACTION
) -> float:
    """Exponent ``s`` such that the top ``ceil(top_fraction * K)`` ranks of a Zipf(s)
    law over ``K = cardinality`` ids carry ``top_share`` of the mass (0 if a uniform
    law already does).

    Example::

        >>> round(fit_zipf_exponent(3, 0.7), 2), round(fit_zipf_exponent(1_000_000, 0.7), 2)
        (1.79, 1.01)
    """
    k = int(cardinality)
    top = max(1, math.ceil(top_fraction * k))
    if top >= k or top_share <= top / k:
        return 0.0
    lo, hi = 0.0, 16.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _power_sum(top, mid) / _power_sum(k, mid) < top_share:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class SyntheticChunk(NamedTuple):
    """One chunk of rows: raw dense (NaN = missing), ids, labels, planted logit."""

    dense_raw: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    logit: np.ndarray


class PlantedModel:
    """The sampling laws and planted logistic model of one :class:`SyntheticConfig`.

    Example::

        >>> model = PlantedModel(SyntheticConfig(rows=10, cardinality_scale=0.001))
        >>> model.cardinalities[:3], [round(s, 2) for s in model.exponents[:3]]
        ((1, 1, 10131), [0.0, 0.0, 1.15])
        >>> chunk = model.chunk(0)
        >>> chunk.sparse.shape, round(float(chunk.labels.mean()), 1)
        ((65536, 26), 0.2)
    """

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        self.cardinalities = config.cardinalities()
        self.exponents = [fit_zipf_exponent(k, config.top1_share) for k in self.cardinalities]
        self.pairs = [
            (CRITEO_SPARSE_NAMES.index(f), CRITEO_SPARSE_NAMES.index(g)) for f, g in config.pairs
        ]
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([config.seed, 0])))
        self._cdf: List[np.ndarray] = []
        self._rank_to_id: List[np.ndarray] = []
        self._weight: List[np.ndarray] = []
        for k, s in zip(self.cardinalities, self.exponents):
            p = np.arange(1, k + 1, dtype=np.float64) ** -s
            cdf = np.cumsum(p)
            cdf /= cdf[-1]
            self._cdf.append(cdf)
            rank_to_id = rng.permutation(k).astype(np.int64)
            self._rank_to_id.append(rank_to_id)
            sigma = np.full(k, config.id_sigma)
            sigma[rank_to_id[_top_ranks(k) :]] = config.rare_id_sigma
            self._weight.append(rng.normal(0.0, sigma, k).astype(np.float32))
        self._latent: Dict[int, np.ndarray] = {
            f: rng.normal(
                0.0, config.latent_sigma, (self.cardinalities[f], config.latent_dim)
            ).astype(np.float32)
            for f in sorted({f for pair in self.pairs for f in pair})
        }
        self.dense_weight = rng.normal(0.0, config.dense_sigma, len(CRITEO_DENSE_NAMES))
        self._dense_mu = np.log(DENSE_MEDIAN + 1.0)
        # A rough centring of the dense term (presence rate x median log-count) keeps
        # the solved bias close to the logit's mean instead of absorbing dense offsets.
        self._dense_center = (1 - DENSE_MISSING) * self._dense_mu
        self.bias = 0.0
        cal = self._draw(
            np.random.Generator(np.random.PCG64(np.random.SeedSequence([config.seed, 1]))),
            CALIBRATION_ROWS,
        )
        self.bias = _solve_bias(cal.logit.astype(np.float64), config.positive_rate)

    def _draw(self, rng: np.random.Generator, n: int) -> SyntheticChunk:
        n_sparse = len(self.cardinalities)
        u = rng.random((n, n_sparse))
        sparse = np.empty((n, n_sparse), dtype=np.int64)
        logit = np.full(n, self.bias, dtype=np.float64)
        for f in range(n_sparse):
            rank = np.searchsorted(self._cdf[f], u[:, f], side="right")
            np.minimum(rank, self.cardinalities[f] - 1, out=rank)
            ids = self._rank_to_id[f][rank]
            sparse[:, f] = ids
            logit += self._weight[f][ids]
        for f, g in self.pairs:
            logit += np.einsum(
                "ij,ij->i", self._latent[f][sparse[:, f]], self._latent[g][sparse[:, g]]
            )
        z = rng.standard_normal((n, len(CRITEO_DENSE_NAMES)))
        counts = np.floor(np.exp(self._dense_mu + DENSE_SPREAD * z)) - 1.0
        np.maximum(counts, 0.0, out=counts)
        missing = rng.random(counts.shape) < DENSE_MISSING
        counts[missing] = np.nan
        logit += (np.log1p(np.nan_to_num(counts, nan=0.0)) - self._dense_center) @ self.dense_weight
        labels = (rng.random(n) < _sigmoid(logit)).astype(np.float32)
        return SyntheticChunk(counts, sparse, labels, logit.astype(np.float32))

    def logit_terms(self, chunk: SyntheticChunk) -> Dict[str, np.ndarray]:
        """The planted logit of ``chunk``'s rows minus the bias, split into its terms:
        ``ids_head`` (ids in their field's top 1%), ``ids_tail`` (every other id),
        ``dense`` and ``pairs``; they add up to ``chunk.logit - bias`` up to rounding.

        Example::

            >>> model = PlantedModel(SyntheticConfig(rows=10, cardinality_scale=0.001))
            >>> c = model.chunk(0)
            >>> parts = model.logit_terms(c)
            >>> sorted(parts), bool(abs(sum(parts.values()) + model.bias - c.logit).max() < 1e-4)
            (['dense', 'ids_head', 'ids_tail', 'pairs'], True)
        """
        n = len(chunk.labels)
        terms = {name: np.zeros(n) for name in ("ids_head", "ids_tail", "dense", "pairs")}
        for f, k in enumerate(self.cardinalities):
            ids = chunk.sparse[:, f]
            head = np.zeros(k, dtype=bool)
            head[self._rank_to_id[f][: _top_ranks(k)]] = True
            w = self._weight[f][ids]
            terms["ids_head"] += np.where(head[ids], w, 0.0)
            terms["ids_tail"] += np.where(head[ids], 0.0, w)
        for f, g in self.pairs:
            u, v = self._latent[f][chunk.sparse[:, f]], self._latent[g][chunk.sparse[:, g]]
            terms["pairs"] += np.einsum("ij,ij->i", u, v)
        log_counts = np.log1p(np.nan_to_num(chunk.dense_raw, nan=0.0))
        terms["dense"] = (log_counts - self._dense_center) @ self.dense_weight
        return terms

    def chunk(self, index: int) -> SyntheticChunk:
        """Rows ``[index * CHUNK_ROWS, (index + 1) * CHUNK_ROWS)`` of every dataset of this config."""
        seq = np.random.SeedSequence([self.config.seed, 2, index])
        return self._draw(np.random.Generator(np.random.PCG64(seq)), CHUNK_ROWS)

    def chunks(self) -> Iterator[SyntheticChunk]:
        """The config's ``rows`` rows, chunk by chunk (the last one truncated)."""
        rows = self.config.rows
        for index in range((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
            c = self.chunk(index)
            keep = min(CHUNK_ROWS, rows - index * CHUNK_ROWS)
            if keep < CHUNK_ROWS:
                c = SyntheticChunk(*(a[:keep] for a in c))
            yield c


def _top_ranks(cardinality: int) -> int:
    """How many ranks are a field's "top 1%" (at least one)."""
    return max(1, math.ceil(TOP_FRACTION * cardinality))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _solve_bias(logit: np.ndarray, rate: float) -> float:
    lo, hi = -30.0, 30.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if _sigmoid(logit + mid).mean() < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def rank_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties averaged.

    Args:
        labels: 0/1 click labels (anything else raises, which also catches swapped
            arguments).
        scores: higher = more likely a click (e.g. the planted logit).

    Example::

        >>> rank_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.6, 0.4, 0.9]))
        0.75
    """
    labels = np.asarray(labels)
    if check_labels(labels)[1].any():
        raise ValueError(
            "rank_auc(labels, scores): labels must be 0/1 (were the arguments swapped?)"
        )
    labels = labels > 0.5
    order = np.argsort(scores, kind="mergesort")
    s = np.asarray(scores)[order]
    ranks = np.empty(len(s))
    ranks_sorted = np.arange(1, len(s) + 1, dtype=np.float64)
    # Tied scores share their average rank, so a tie counts as half a correct pair.
    starts = np.r_[0, np.flatnonzero(np.diff(s)) + 1]
    ends = np.r_[starts[1:], len(s)]
    avg = (ranks_sorted[starts] + ranks_sorted[ends - 1]) / 2
    ranks[order] = np.repeat(avg, ends - starts)
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def synthetic_arrays(
    config: SyntheticConfig,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All rows in memory: ``(dense float32, sparse int64, labels float32, logit float32)``.

    For tests and small experiments; ``open_dataset("synthetic:ROWS", ...)`` streams to disk instead.
    """
    model = PlantedModel(config)
    chunks = list(model.chunks())
    transforms = config.dense_spec().resolve(CRITEO_DENSE_NAMES, "synthetic")
    stored = stored_values(np.concatenate([c.dense_raw for c in chunks]), transforms)
    stats = DenseStats(CRITEO_DENSE_NAMES)
    stats.update(stored)
    dense = DensePlan.fit(stats, transforms).apply(stored)
    return (
        dense,
        np.concatenate([c.sparse for c in chunks]),
        np.concatenate([c.labels for c in chunks]),
        np.concatenate([c.logit for c in chunks]),
    )


_ROWS = re.compile(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([kKmM]?)\s*")


def parse_rows(spec: str, text: str) -> int:
    """The row count of ``synthetic:ROWS`` (``200000``, ``200_000``, ``200k``, ``1M``).

    Raises:
        DataOptionError: naming the spec, if ``text`` is not a positive whole count.
    """
    m = _ROWS.fullmatch(text)
    value = 0.0
    if m:
        value = float(m.group(1).replace("_", "")) * {"": 1, "k": 1e3, "m": 1e6}[m.group(2).lower()]
    if not m or value != int(value) or value < 1:
        raise DataOptionError(
            f"{spec}: synthetic:ROWS needs a positive whole row count such as 200000, 200k or 1M; "
            f"got {text!r}"
        )
    return int(value)


class _SyntheticRows:
    """The rows of one config as a row source with one part (the config itself), named
    as the user spelled its kind (``synthetic-hard:40000000``)."""

    def __init__(self, config: SyntheticConfig, kind: str) -> None:
        self.config = config
        self.kind = kind
        self._model: Optional[PlantedModel] = None

    def model(self) -> PlantedModel:
        if self._model is None:
            self._model = PlantedModel(self.config)
        return self._model

    def names(self, part: SyntheticConfig) -> Tuple[List[str], List[str]]:
        return list(CRITEO_DENSE_NAMES), list(CRITEO_SPARSE_NAMES)

    def part_name(self, part: SyntheticConfig) -> str:
        return f"{self.kind}:{part.rows}"

    def blocks(
        self, part: SyntheticConfig, log: BadRowLog, sparse_check: Optional[SparseCheck] = None
    ) -> Iterator[RowBlock]:
        first = 1
        for c in self.model().chunks():
            n = len(c.labels)
            yield RowBlock(
                path=self.part_name(part),
                lines=np.arange(first, first + n, dtype=np.int64),
                labels=c.labels,
                dense=c.dense_raw,
                sparse=c.sparse,
                extra={"planted_logit": c.logit},
            )
            first += n


class PlantedIds(SparseEncoding):
    """The generator's ids, already in ``[0, cardinality)``."""

    def __init__(self, cardinalities: Sequence[int]) -> None:
        self._cardinalities = tuple(int(k) for k in cardinalities)

    def cardinalities(self) -> Tuple[int, ...]:
        return self._cardinalities

    def encode(self, sparse: np.ndarray) -> np.ndarray:
        return sparse

    def describe(self) -> Dict[str, Any]:
        return {"kind": "synthetic ids"}


def logit_variance(model: PlantedModel, rows: int = CALIBRATION_ROWS) -> Dict[str, float]:
    """Variance of the planted logit and of its terms (:meth:`PlantedModel.logit_terms`)
    over ``rows`` rows of the calibration stream (the module docstring's variance split).

    Example::

        >>> v = logit_variance(PlantedModel(SyntheticConfig(rows=1, cardinality_scale=0.001)))
        >>> sorted(v)
        ['dense', 'ids_head', 'ids_tail', 'pairs', 'total']
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([model.config.seed, 1])))
    chunk = model._draw(rng, rows)
    out = {name: float(t.var()) for name, t in model.logit_terms(chunk).items()}
    out["total"] = float(chunk.logit.astype(np.float64).var())
    return out


def _planted_meta(rows: _SyntheticRows, out_dir: Path, meta: Dict[str, Any]) -> Dict[str, Any]:
    model = rows.model()
    head = 1 << 21  # the planted AUC is measured on the first 2M rows
    labels = np.array(np.load(out_dir / "labels.npy", mmap_mode="r")[:head])
    logit = np.array(np.load(out_dir / "planted_logit.npy", mmap_mode="r")[:head])
    return {
        "synthetic": {
            **rows.config.payload(),
            "zipf_exponents": [round(s, 6) for s in model.exponents],
            "bias": model.bias,
            "pairs": [list(p) for p in rows.config.pairs],
            "logit_variance": logit_variance(model),
            "positive_fraction": float(labels.mean()),
            "planted_auc": rank_auc(labels, logit),
            "planted_auc_rows": int(len(labels)),
        }
    }


@dataclass(frozen=True)
class SyntheticOptions(SourceOptions):
    """``synthetic:`` options (see :class:`SyntheticConfig`)."""

    where: ClassVar[str] = "synthetic"
    fixed_dense_names: ClassVar[Optional[Tuple[str, ...]]] = CRITEO_DENSE_NAMES

    # The generator's seed: its own flag, so that the trainer's --seed (weights, order,
    # splits) reaches every kind; the trainer passes --seed here unless it is given.
    seed: int = option_field(0, "--synthetic-seed")
    cardinality_scale: float = option_field(1.0, "--synthetic-scale")
    max_cardinality: int = option_field(1_000_000, "--synthetic-max-cardinality")
    top1_share: float = option_field(0.70)
    positive_rate: float = option_field(0.25)
    id_sigma: float = option_field(SIGMA_ID)
    rare_id_sigma: float = option_field(SIGMA_ID)
    dense_sigma: float = option_field(SIGMA_DENSE)
    latent_dim: int = option_field(LATENT_DIM)
    latent_sigma: float = option_field(SIGMA_LATENT)
    pairs: Tuple[Tuple[str, str], ...] = option_field(PAIRS)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.config(1)  # validates the generator's options

    def config(self, rows: int) -> SyntheticConfig:
        return SyntheticConfig(
            rows=rows,
            **{f.name: getattr(self, f.name) for f in fields(self)},
        )


@dataclass(frozen=True)
class SyntheticHardOptions(SyntheticOptions):
    """``synthetic-hard:`` options: :class:`SyntheticOptions` with :data:`HARD_PROFILE`'s
    defaults (each can still be set)."""

    top1_share: float = option_field(HARD_PROFILE["top1_share"])
    rare_id_sigma: float = option_field(HARD_PROFILE["rare_id_sigma"])
    dense_sigma: float = option_field(HARD_PROFILE["dense_sigma"])
    latent_dim: int = option_field(HARD_PROFILE["latent_dim"])
    latent_sigma: float = option_field(HARD_PROFILE["latent_sigma"])
    pairs: Tuple[Tuple[str, str], ...] = option_field(HARD_PROFILE["pairs"])


@register_source
class SyntheticSource(
    SourceKind, name="synthetic", usage="synthetic:ROWS", options=SyntheticOptions
):
    """``synthetic:ROWS``: Criteo-like rows with a planted model."""

    def check_args(self, spec: str, args: List[str]) -> None:
        if len(args) != 1:
            raise DataOptionError(f"{spec}: {self.usage} takes one row count, got {args}")
        parse_rows(spec, args[0])

    def check_test_paths(self, test_paths: Sequence[str]) -> None:
        if test_paths:
            raise DataOptionError(
                f"{self.name}: takes no test files (--test-data), got {list(test_paths)}"
            )

    def planned_sizes(
        self, args: List[str], opts: SyntheticOptions
    ) -> Optional[Tuple[Schema, int, int]]:
        """The tables from the options: no row is generated, no planted model built (its
        dense inputs are its 13 columns: the generator's rows take no missing-value
        indicators)."""
        rows = parse_rows(self.name, args[0])
        schema = opts.config(rows).schema()
        return schema, schema.n_dense, rows

    def payload(
        self, args: List[str], test_paths: List[str], opts: SyntheticOptions
    ) -> Dict[str, Any]:
        return {"synthetic": opts.config(parse_rows(self.name, args[0])).payload()}

    def conversion(
        self, args: List[str], test_paths: List[str], opts: SyntheticOptions
    ) -> Conversion:
        config = opts.config(parse_rows(self.name, args[0]))
        rows = _SyntheticRows(config, self.name)
        return Conversion(
            rows,
            [config],
            [],
            PlantedIds(config.cardinalities()),
            stats_key={"train": [config.payload()], "layout": {"layout": "synthetic"}},
            dense_transform=config.dense_transform,
            on_bad_row="error",  # generated rows are valid by construction
            where=self.name,
            source_format="synthetic criteo-like",
            extra=("planted_logit",),
            finish=lambda out_dir, meta: _planted_meta(rows, out_dir, meta),
        )


@register_source
class SyntheticHardSource(
    SyntheticSource,
    name="synthetic-hard",
    usage="synthetic-hard:ROWS",
    options=SyntheticHardOptions,
):
    """``synthetic-hard:ROWS``: the same generator with :data:`HARD_PROFILE`."""

"""``open_dataset``: the one entry point from a source spec to a memory-mapped dataset.

Spec kinds:

* ``criteo:PATH[,PATH...]``: raw Criteo (Kaggle ``train.txt``, 1TB ``day_N``[.gz],
  or the same layout as CSV with a header);
* ``criteo-npy:DIR``: TorchRec's preprocessed ``day_N_{dense,sparse,labels}.npy``
  (a directory, or one prefix such as ``DIR/day_23``);
* ``avazu:PATH[,PATH...]``: Avazu CSV;
* ``table:PATH[,PATH...]``: CSV/TSV/parquet with ``label=``, ``dense=``, ``sparse=``;
* ``synthetic:ROWS``: Criteo-like rows with a planted model (``200000``, ``200k``, ``1M``);
  ``synthetic-hard:ROWS``: the same generator, more signal in interactions and rare ids.

Each kind is a registered :class:`~torchrec_cowclip.data.registry.SourceKind` with
its own options dataclass; :func:`open_dataset` is the front that sorts its keyword
options onto the kind's dataclass. The first call converts the source into
``cache_dir`` (see ``cache``); later calls with the same files and options verify
and open the cached arrays without parsing anything.

Example::

    >>> import tempfile
    >>> ds = open_dataset("synthetic:5000", tempfile.mkdtemp(), cardinality_scale=0.001)
    >>> len(ds), ds.dense.dtype, ds.schema.n_sparse
    (5000, dtype('float32'), 26)
    >>> train, val, test = ds.split(test_fraction=0.1, val_fraction=0.1)
    >>> batch = next(iter(ds.batches(train, batch_size=512, shuffle=True)))
    >>> batch.dense_features.shape, batch.sparse_features.keys()[:2]
    (torch.Size([512, 13]), ['C1', 'C2'])
"""

from __future__ import annotations

import logging
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.errors import DataError, DataOptionError
from torchrec_cowclip.data.parsing.dense import (
    DensePlan,
    DenseStats,
    dense_notes,
    plan_needs_statistics,
)
from torchrec_cowclip.data.pipeline.batches import BatchIterator
from torchrec_cowclip.data.pipeline.cache import build_entry, read_entry, source_digest_memo
from torchrec_cowclip.data.pipeline.encode import Conversion, convert
from torchrec_cowclip.data.pipeline.splits import split_indices
from torchrec_cowclip.data.registry import SourceKind, source_kind, source_kinds
from torchrec_cowclip.data.schema import Schema
from torchrec_cowclip.data.source_options import SourceOptions

logger = logging.getLogger(__name__)

SPEC_KINDS = source_kinds()
PathLike = Union[str, Path]


class EncoderOverride(Protocol):
    """Encoders given from outside instead of learnt from the training parts (a warm
    start encodes new rows with its run's vocabularies, grown, and dense statistics)."""

    def key(self) -> Dict[str, Any]:
        """What the override contributes to the cache key (JSON values)."""
        ...

    def apply(self, conversion: Conversion) -> Conversion:
        """``conversion`` with the override's encoding and statistics in place."""
        ...


class CTRDataset:
    """A converted dataset: memory-mapped arrays plus their description.

    Opening verifies the entry's files against its ``meta.json`` (see ``cache``).

    Attributes:
        dense: float32 ``[N, n_dense]`` memmap of the *stored* dense values: each
            column's pointwise transform applied, NaN where a value is missing (see
            ``parsing.dense``); the model's inputs are ``dense_plan.apply(dense[rows])``,
            which :meth:`batches` and :meth:`dense_inputs` give.
        sparse: int32/int64 ``[N, n_sparse]`` memmap of encoded ids.
        labels: float32 ``[N]`` memmap of 0/1.
        schema: feature names and table sizes.
        source: the spec (and test files) it was built from.
        meta: the cache entry's ``meta.json``.
        path: the cache entry directory.
        dense_stats: the statistics of the stored dense values of the training files
            (taken at conversion).
        dense_plan: stored dense values -> model inputs; at open, fitted on the training
            files (the rows before ``test_start``); :meth:`fit_dense_plan` fits it on the
            training split instead.
        notes: what the conversion changed or dropped, one line each (empty if nothing):
            skipped rows, clipped values, negative values a ``log`` column set to 0, and
            the dense columns that are (nearly) constant after their transform;
            :func:`open_dataset` logs them.
        missing_indicator: whether plans add missing-value indicators.
        dense_buckets: how many quantile buckets (one-hot inputs) plans give each dense
            column; 0: none.

    Raises:
        CacheCorrupt: a file of the entry does not match its ``meta.json`` (one line
            naming it; :func:`open_dataset` rebuilds such an entry instead).

    Example::

        >>> import tempfile
        >>> ds = open_dataset("criteo:tests/data/criteo_sample.tsv", tempfile.mkdtemp())
        >>> CTRDataset(ds.path).sparse.shape
        (200, 26)
        >>> ds.dense_plan.summary(), ds.dense_inputs(np.arange(2)).shape
        ('log (I1, ..., I13: 13 columns)', (2, 13))
    """

    def __init__(
        self, path: PathLike, missing_indicator: bool = False, dense_buckets: int = 0
    ) -> None:
        self.path = Path(path)
        self.meta: Dict[str, Any] = read_entry(self.path)
        self.dense: np.ndarray = np.load(self.path / "dense.npy", mmap_mode="r")
        self.sparse: np.ndarray = np.load(self.path / "sparse.npy", mmap_mode="r")
        self.labels: np.ndarray = np.load(self.path / "labels.npy", mmap_mode="r")
        self.schema = Schema.from_json(self.meta["schema"])
        self.source: str = self.meta.get("source", str(self.path))
        rows = int(self.meta["rows"])
        shapes = (self.dense.shape, self.sparse.shape, self.labels.shape)
        if shapes != ((rows, self.schema.n_dense), (rows, self.schema.n_sparse), (rows,)):
            raise DataError(
                f"cache entry {self.path} is inconsistent: shapes {shapes}, meta rows {rows}",
                path=self.path,
            )
        self.missing_indicator = bool(missing_indicator)
        self.dense_buckets = int(dense_buckets)
        n_train = rows if self.test_start is None else self.test_start
        self.dense_stats = DenseStats.from_json(self.meta["dense_stats"])
        self.dense_plan: DensePlan = DensePlan.fit_rows(
            self.dense_stats,
            self.dense_transforms,
            self.dense,
            np.arange(n_train, dtype=np.int64),
            self.missing_indicator,
            self.dense_buckets,
            fitted_on=f"the {n_train:,} rows of the training files",
        )
        self.notes: List[str] = [str(self.meta.get("bad_row_summary"))] if self.bad_rows else []
        self.notes += dense_notes(
            self.dense_stats,
            self.dense_transforms,
            self.dense_clipped,
            self.dense_negative_under_log,
            rows,
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return (
            f"CTRDataset({self.source!r}, rows={len(self)}, dense={self.schema.n_dense}, "
            f"sparse={self.schema.n_sparse}, path={str(self.path)!r})"
        )

    @property
    def bad_rows(self) -> Dict[str, int]:
        """Rows skipped per reason (empty unless ``on_bad_row="skip"`` found some)."""
        return dict(self.meta.get("bad_rows", {}))

    @property
    def dense_transforms(self) -> Tuple[str, ...]:
        """Each dense column's transform (``parsing.dense``)."""
        return tuple(self.meta["dense_transforms"])

    @property
    def dense_clipped(self) -> Dict[str, int]:
        """Dense values clipped at ``+-DENSE_CLIP`` per feature (empty if none were)."""
        return dict(self.meta.get("dense_clipped", {}))

    @property
    def dense_negative_under_log(self) -> Dict[str, int]:
        """Per ``log`` column, the negative values it could not take (set to 0)."""
        return dict(self.meta.get("dense_negative_under_log", {}))

    @property
    def test_start(self) -> Optional[int]:
        """First row of the explicit test files, or None for a random split."""
        return self.meta.get("test_start")

    @property
    def planted_logit(self) -> Optional[np.ndarray]:
        """Synthetic data only: the planted model's logit per row (float32 memmap)."""
        p = self.path / "planted_logit.npy"
        return np.load(p, mmap_mode="r") if p.exists() else None

    def split(
        self, test_fraction: float = 0.1, val_fraction: float = 0.0, seed: Optional[int] = None
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(train, val, test)`` row indices: explicit test files if there were any,
        else a random split (``seed`` defaults to the one given to ``open_dataset``)."""
        seed = int(self.meta.get("seed", 0)) if seed is None else seed
        return split_indices(
            len(self), test_fraction, val_fraction, seed, test_start=self.test_start
        )

    def fit_dense_plan(self, rows: np.ndarray) -> DensePlan:
        """Fits :attr:`dense_plan` on the stored dense values of ``rows`` (the training
        split: statistics of no other row enter it) and returns it. Reads those rows
        once, in blocks, when a transform needs statistics or the plan adds
        missing-value indicators or buckets; a plan that needs none takes the training
        range scoring names values outside of from the training files'
        (:attr:`dense_stats`: no pass over the split)."""
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        needs_rows = plan_needs_statistics(
            self.dense_transforms, self.missing_indicator, self.dense_buckets
        )
        self.dense_plan = DensePlan.fit_rows(
            DenseStats.of_rows(self.dense, rows, self.schema.dense_names)
            if needs_rows
            else self.dense_stats,
            self.dense_transforms,
            self.dense,
            rows,
            self.missing_indicator,
            self.dense_buckets,
            fitted_on=f"the {len(rows):,} rows of the training split",
        )
        return self.dense_plan

    def dense_inputs(self, rows: Optional[np.ndarray] = None) -> np.ndarray:
        """The model's dense inputs of ``rows`` (all rows if None): :attr:`dense_plan`
        applied to their stored values."""
        stored = self.dense if rows is None else self.dense[np.asarray(rows)]
        return self.dense_plan.apply(np.asarray(stored))

    def batches(
        self, indices: Optional[np.ndarray] = None, batch_size: int = 1024, **kwargs: Any
    ) -> BatchIterator:
        """A :class:`~torchrec_cowclip.data.pipeline.batches.BatchIterator` over ``indices``."""
        return BatchIterator(self, indices, batch_size, **kwargs)


#: File name endings that say a ``--data`` value without a kind is a file of one's own.
_TABLE_SUFFIXES = (".csv", ".tsv", ".txt", ".parquet", ".pq", ".gz", ".bz2", ".xz", ".zst")


def _looks_like_files(spec: str) -> bool:
    """Whether ``spec`` names files (an existing path, or a table's extension) rather
    than a kind."""
    paths = [p.strip() for p in spec.split(",") if p.strip()]
    return bool(paths) and all(
        Path(p).expanduser().exists() or p.lower().endswith(_TABLE_SUFFIXES) for p in paths
    )


def parse_spec(spec: str) -> Tuple[str, List[str]]:
    """``"criteo:a,b"`` -> ``("criteo", ["a", "b"])``; the kind checks its arguments.

    Raises:
        DataOptionError: an unknown kind or missing argument (the message lists the
            kinds and their usage), or arguments the kind refuses (``synthetic:0``).
    """
    kind, sep, rest = spec.partition(":")
    kind = kind.strip().lower()
    kinds = source_kinds()
    args = [p.strip() for p in rest.split(",") if p.strip()]
    if (not sep or kind not in kinds) and _looks_like_files(spec):
        raise DataOptionError(
            f"--data {spec}: no data kind; a click log of your own (CSV, TSV, parquet) is "
            f"table:{spec} with --label, --dense and --sparse naming its columns (other "
            f"kinds: {', '.join(k + ':' for k in kinds if k != 'table')})"
        )
    if not sep or kind not in kinds or not args:
        raise DataOptionError(
            f"bad dataset spec {spec!r}: expected KIND:ARG with KIND one of {', '.join(kinds)} "
            f"({', '.join(source_kind(k).usage for k in kinds)})"
        )
    source_kind(kind).check_args(spec, args)
    return kind, args


def _known_options() -> Dict[str, Tuple[Any, Optional[str], List[str]]]:
    """Every option some kind takes: ``(default, CLI flag, the kinds taking it)``."""
    known: Dict[str, Tuple[Any, Optional[str], List[str]]] = {}
    for name in source_kinds():
        for f in fields(source_kind(name).options):
            default = None if f.default is MISSING else f.default
            known.setdefault(f.name, (default, f.metadata.get("flag"), []))[2].append(name)
    return known


def kind_options(kind: SourceKind, options: Mapping[str, Any]) -> SourceOptions:
    """The kind's options dataclass from ``open_dataset``'s keyword options.

    None means "not given", and so does another kind's option at its default (the
    trainer passes every kind's options); another kind's option set otherwise is
    refused, naming it, its flag and the kinds that take it.
    """
    known = _known_options()
    own = {f.name for f in fields(kind.options)}
    given: Dict[str, Any] = {}
    for name, value in options.items():
        if name not in known:
            raise TypeError(f"open_dataset() got an unexpected keyword argument {name!r}")
        default, flag, takers = known[name]
        if value is None or (name not in own and value == default):
            continue
        if name not in own:
            raise DataOptionError(
                f"{kind.name}: does not take {name}"
                + (f" ({flag})" if flag else "")
                + f"; it applies to {', '.join(k + ':' for k in takers)} only"
            )
        given[name] = value
    return kind.options(**given)


def open_dataset(
    spec: str,
    cache_dir: PathLike,
    *,
    test_paths: Optional[Sequence[PathLike]] = None,
    rebuild: bool = False,
    encoders: Optional[EncoderOverride] = None,
    **options: Any,
) -> CTRDataset:
    """Convert (once), verify and open a CTR dataset.

    Args:
        spec: ``criteo:PATH[,PATH...]``, ``criteo-npy:DIR``, ``avazu:PATH``,
            ``table:PATH`` or ``synthetic:ROWS`` (or a kind registered since).
        cache_dir: where converted datasets (and statistics) are kept.
        test_paths: explicit test files (same kind as the spec); otherwise
            :meth:`CTRDataset.split` splits at random.
        rebuild: convert again even if a cache entry exists.
        encoders: encode with these instead of what the training parts would teach
            (part of the cache key).
        **options: the kind's options (its dataclass's fields): ``dense_transform``
            (every kind); ``on_bad_row`` (every kind read from files); ``min_count``,
            ``hash_size`` (text kinds; ``hash_size`` also ``criteo-npy:``); ``label``,
            ``dense``, ``sparse``, ``delimiter`` (``table:``, ``avazu:``; ``delimiter``
            also ``criteo:``); ``seed`` (the generator's, also the default seed of
            :meth:`CTRDataset.split`), ``cardinality_scale``, ``max_cardinality``,
            ``top1_share``, ``positive_rate`` (``synthetic:``, ``synthetic-hard:``).
            None, or another kind's option at its default, counts as not given.

    Raises:
        DataOptionError: a bad spec (the message lists the kinds) or option (named,
            with its CLI flag).
        FileNotFoundError: a source path that does not exist (named in the message).
        DataError: an empty file, a bad row in ``"error"`` mode, inconsistent files, a
            corrupt cache entry whose source is gone.
    """
    kind_name, args = parse_spec(spec)
    kind = source_kind(kind_name)
    opts = kind_options(kind, options)
    tests = [str(p) for p in (test_paths or [])]
    kind.check_test_paths(tests)
    kind.check_sources(args, tests, opts)
    root = Path(cache_dir).expanduser()
    with source_digest_memo(root):
        payload = kind.payload(args, tests, opts)
    if encoders is not None:
        payload = {**payload, "encoders": encoders.key()}
    source = spec + (f" (test: {','.join(tests)})" if tests else "")

    def build(tmp: Path) -> Dict[str, Any]:
        with source_digest_memo(root):
            conversion = kind.conversion(args, tests, opts)
        if encoders is not None:
            conversion = encoders.apply(conversion)
        meta = convert(conversion, tmp, stats_cache=root)
        meta.update(source=source, seed=int(getattr(opts, "seed", 0)))
        return meta

    ds = CTRDataset(
        build_entry(root, kind.name, payload, build, rebuild=rebuild),
        missing_indicator=bool(getattr(opts, "missing_indicator", False)),
        dense_buckets=int(getattr(opts, "dense_buckets", 0)),
    )
    for note in ds.notes:
        logger.warning("%s: %s", source, note)
    return ds

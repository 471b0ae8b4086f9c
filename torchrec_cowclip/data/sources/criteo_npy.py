"""TorchRec's preprocessed Criteo binary layout (``day_N_{dense,sparse,labels}.npy``).

``torchrec.datasets.scripts.npy_preproc_criteo`` (``BinaryCriteoUtils.tsv_to_npys``)
writes, per day file (or ``train``/``test`` for Kaggle):

* ``<prefix>_dense.npy``: float32 ``[N, 13]``, **already log-transformed**: missing
  -> 0, then ``log(x - min + 2)`` with ``min`` the file's smallest dense value;
* ``<prefix>_sparse.npy``: int64 ``[N, 26]`` = ``int(value, 16)`` (missing -> 0); after
  ``contiguous_preproc_criteo`` (``<prefix>_sparse_contig_freq.npy``) or
  ``shuffle_preproc_criteo``: int32, contiguous ids;
* ``<prefix>_labels.npy``: int32 ``[N, 1]`` (``-1`` for the unlabeled Kaggle test set).

These files are read through ``np.load(mmap_mode="r")`` a chunk of rows at a time,
as a row source like the text formats (same bad-row checks and reporting, same
writer). Dense values are kept as stored for ``dense_transform="log"`` or ``"none"``
(they are log values already; like every source's, they are clipped to
``+-DENSE_CLIP``); the other transforms apply to the stored values (``"minmax"``,
``"standardize"`` fitted on the training rows). Sparse ids are kept (table size =
largest id + 1 over the training and test days, found by a cached statistics pass)
or hashed with ``id % hash_size`` (no row is reserved for missing: TorchRec has
already mapped missing to 0). Labels other than 0/1, non-finite dense values and
negative ids (without ``hash_size``) are bad rows, reported as ``file:row`` (the
labels, dense or sparse file) with 1-based rows.

A spec path is a directory (all its prefixes, in day order) or one prefix such as
``DIR/day_23``.

Example::

    >>> import tempfile, pathlib
    >>> import numpy as np
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> np.save(d / "day_0_dense.npy", np.zeros((4, 13), np.float32))
    >>> np.save(d / "day_0_sparse.npy", np.arange(104).reshape(4, 26))
    >>> np.save(d / "day_0_labels.npy", np.array([[0], [1], [0], [1]], np.int32))
    >>> [t.prefix for t in find_npy_days(d)]
    ['day_0']
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union, cast

import numpy as np

from torchrec_cowclip.data.errors import (
    BAD_DENSE,
    BAD_LABEL,
    BAD_SPARSE_ID,
    BadRowLog,
    DataError,
    DataOptionError,
)
from torchrec_cowclip.data.parsing.fields import check_labels
from torchrec_cowclip.data.parsing.rows import RowBlock, SparseCheck, validate_block
from torchrec_cowclip.data.pipeline.cache import fingerprint
from torchrec_cowclip.data.pipeline.encode import (
    Conversion,
    HashSize,
    SparseEncoding,
    TableSizes,
    json_sizes,
)
from torchrec_cowclip.data.registry import SourceKind, register_source
from torchrec_cowclip.data.schema import CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, resolve_sizes
from torchrec_cowclip.data.source_options import FileSourceOptions, option_field

CHUNK_ROWS = 1 << 18
_SPARSE_SUFFIXES = ("_sparse.npy", "_sparse_contig_freq.npy")


@dataclass(frozen=True)
class NpyDay:
    """The three files of one prefix."""

    prefix: str
    dense: Path
    sparse: Path
    labels: Path

    @property
    def files(self) -> List[Path]:
        return [self.dense, self.sparse, self.labels]


def _natural_key(name: str) -> Tuple[Any, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _day(directory: Path, prefix: str) -> NpyDay:
    sparse = next(
        (
            directory / f"{prefix}{s}"
            for s in _SPARSE_SUFFIXES
            if (directory / f"{prefix}{s}").exists()
        ),
        None,
    )
    labels = directory / f"{prefix}_labels.npy"
    sparse_path = sparse or directory / f"{prefix}_sparse.npy"
    missing = [str(p) for p in [sparse_path, labels] if not p.exists()]
    if missing:
        raise FileNotFoundError(f"criteo-npy prefix {directory / prefix} lacks {missing}")
    return NpyDay(prefix, directory / f"{prefix}_dense.npy", sparse_path, labels)


def find_npy_days(path: Union[str, Path]) -> List[NpyDay]:
    """The day files of a directory (natural order: day_2 before day_10), or of one prefix."""
    p = Path(path).expanduser()
    if p.is_dir():
        prefixes = sorted(
            (x.name[: -len("_dense.npy")] for x in p.glob("*_dense.npy")), key=_natural_key
        )
        if not prefixes:
            raise FileNotFoundError(f"no <prefix>_dense.npy files (TorchRec Criteo layout) in {p}")
        return [_day(p, prefix) for prefix in prefixes]
    if (p.parent / f"{p.name}_dense.npy").exists():
        return [_day(p.parent, p.name)]
    raise FileNotFoundError(
        f"criteo-npy path not found: {p} (expected a directory or a prefix like DIR/day_0)"
    )


def npy_source_files(paths: Sequence[Union[str, Path]]) -> List[Path]:
    """Every file the days of ``paths`` consist of (for cache fingerprints)."""
    return [f for p in paths for d in find_npy_days(p) for f in d.files]


def _open(day: NpyDay) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrays = []
    for f in day.files:
        if f.stat().st_size == 0:
            raise DataError(f"data file is empty: {f}", path=f)
        try:
            arrays.append(np.load(f, mmap_mode="r"))
        except ValueError as e:
            raise DataError(f"{f}: not a .npy file ({e})", path=f) from e
    dense, sparse, labels = arrays
    if dense.ndim != 2 or sparse.ndim != 2 or labels.ndim not in (1, 2):
        raise DataError(
            f"{day.prefix}: expected dense [N, D], sparse [N, S], labels [N] or [N, 1]; got "
            f"{dense.shape}, {sparse.shape}, {labels.shape}",
            path=day.dense,
        )
    if not (len(dense) == len(sparse) == len(labels)):
        raise DataError(
            f"row counts differ: {day.dense} {len(dense)}, {day.sparse} {len(sparse)}, "
            f"{day.labels} {len(labels)}",
            path=day.dense,
        )
    if not np.issubdtype(sparse.dtype, np.integer):
        raise DataError(
            f"{day.sparse}: sparse ids must be integers, got {sparse.dtype}", path=day.sparse
        )
    return dense, sparse, labels.reshape(len(labels))


def _dense_names(n: int) -> List[str]:
    return list(CRITEO_DENSE_NAMES) if n == 13 else [f"int_{i}" for i in range(n)]


def _sparse_names(n: int) -> List[str]:
    return list(CRITEO_SPARSE_NAMES) if n == 26 else [f"cat_{i}" for i in range(n)]


class NpyRowSource:
    """Row blocks of TorchRec npy days (``sparse`` an int64 ``[n, n_sparse]`` matrix)."""

    def names(self, day: NpyDay) -> Tuple[List[str], List[str]]:
        dense, sparse, _ = _open(day)
        return _dense_names(dense.shape[1]), _sparse_names(sparse.shape[1])

    def part_name(self, day: NpyDay) -> str:
        return str(day.dense.parent.resolve() / day.prefix)

    def blocks(
        self, day: NpyDay, log: BadRowLog, sparse_check: Optional[SparseCheck] = None
    ) -> Iterator[RowBlock]:
        dense, sparse, labels = _open(day)
        dense_names = _dense_names(dense.shape[1])
        paths = {
            BAD_LABEL: str(day.labels),
            BAD_DENSE: str(day.dense),
            BAD_SPARSE_ID: str(day.sparse),
        }
        for start in range(0, len(labels), CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, len(labels))
            d = np.asarray(dense[start:stop], dtype=np.float64)
            y = np.asarray(labels[start:stop])
            labels_f, bad_label = check_labels(y)
            block = RowBlock(
                path=str(day.labels),
                lines=np.arange(start + 1, stop + 1, dtype=np.int64),
                labels=labels_f,
                dense=d,
                sparse=np.asarray(sparse[start:stop], dtype=np.int64),
                paths=paths,
            )
            block = validate_block(
                block, log, bad_label, ~np.isfinite(d), dense_names, y, d.T, sparse_check
            )
            if len(block):
                yield block


def _negative_ids(sparse: np.ndarray) -> Optional[Tuple[np.ndarray, str, List[str]]]:
    # numpy's stubs type a reduction along an axis as a scalar or an array: here, an array.
    bad = cast(np.ndarray, (sparse < 0).any(axis=1))
    if not bad.any():
        return None
    details = [
        f"negative id in {sparse[i].tolist()} (pass hash_size)"
        for i in np.flatnonzero(bad).tolist()
    ]
    return bad, BAD_SPARSE_ID, details


class StoredIds(SparseEncoding):
    """Ids kept as stored; each table has ``max id + 1`` rows over every day (test included)."""

    counts = True
    count_test = True

    def start(self, sparse_names: Sequence[str]) -> None:
        self.max_id = np.full(len(sparse_names), -1, dtype=np.int64)

    def check(self) -> Optional[SparseCheck]:
        return _negative_ids

    def update(self, sparse: np.ndarray) -> None:
        if len(sparse):
            np.maximum(self.max_id, sparse.max(axis=0), out=self.max_id)

    def save(self, directory: Path) -> None:
        np.save(directory / "max_id.npy", self.max_id)

    def load(self, directory: Path) -> None:
        self.max_id = np.load(directory / "max_id.npy")

    def cardinalities(self) -> Tuple[int, ...]:
        return tuple(int(m) + 1 for m in np.maximum(self.max_id, 0))

    def encode(self, sparse: np.ndarray) -> np.ndarray:
        return sparse

    def describe(self) -> Dict[str, Any]:
        return {"kind": "as stored", "cardinality": "max id + 1"}

    def stats_key(self) -> Dict[str, Any]:
        return {"ids": "as stored"}


class ModuloIds(SparseEncoding):
    """Ids hashed into ``hash_size`` rows per table with ``id % hash_size``."""

    def __init__(self, hash_size: TableSizes) -> None:
        self.hash_size = hash_size

    def start(self, sparse_names: Sequence[str]) -> None:
        sizes = np.array(resolve_sizes(self.hash_size, sparse_names), dtype=np.int64)
        if (sizes < 1).any():
            raise DataOptionError(f"hash_size (--hash-size) must be >= 1, got {sizes.tolist()}")
        self.sizes = sizes

    def cardinalities(self) -> Tuple[int, ...]:
        return tuple(self.sizes.tolist())

    def encode(self, sparse: np.ndarray) -> np.ndarray:
        ids: np.ndarray = np.mod(sparse, self.sizes)
        return ids

    def describe(self) -> Dict[str, Any]:
        return {"kind": "hash", "method": "mod"}


@dataclass(frozen=True)
class NpyOptions(FileSourceOptions):
    """``criteo-npy:`` options.

    Args:
        hash_size: None keeps the stored ids; else table sizes to take them modulo.
    """

    hash_size: HashSize = option_field(None, "--hash-size")


@register_source
class CriteoNpySource(SourceKind, name="criteo-npy", usage="criteo-npy:DIR", options=NpyOptions):
    """``criteo-npy:DIR``: TorchRec's preprocessed Criteo days."""

    def payload(self, args: List[str], test_paths: List[str], opts: NpyOptions) -> Dict[str, Any]:
        return {
            "sources": fingerprint(npy_source_files(args)),
            "test": fingerprint(npy_source_files(test_paths)) if test_paths else [],
            "hash_size": json_sizes(opts.hash_size),
            "on_bad_row": opts.on_bad_row,
            "dense_transform": opts.dense_spec().text(),
        }

    def conversion(self, args: List[str], test_paths: List[str], opts: NpyOptions) -> Conversion:
        encoding = StoredIds() if opts.hash_size is None else ModuloIds(opts.hash_size)
        stats_key: Dict[str, Any] = {
            "train": fingerprint(npy_source_files(args)),
            "layout": {"layout": "criteo-npy"},
        }
        if encoding.count_test:
            stats_key["test"] = fingerprint(npy_source_files(test_paths))
        # The stored values are log values already: "log" keeps them as they are.
        spec = opts.dense_spec().replaced("log", "none")
        as_stored = spec.text() == "none"
        return Conversion(
            NpyRowSource(),
            [d for p in args for d in find_npy_days(p)],
            [d for p in test_paths for d in find_npy_days(p)],
            encoding,
            stats_key=stats_key,
            dense_transform=spec.text(),
            on_bad_row=opts.on_bad_row,
            source_format="torchrec criteo npy",
            dense_transform_label=(
                "as stored (torchrec log)"
                if as_stored
                else f"{spec.text()} of the stored (torchrec log) values"
            ),
            where=self.name,
        )

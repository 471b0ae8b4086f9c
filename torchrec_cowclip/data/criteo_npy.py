"""TorchRec's preprocessed Criteo binary layout (``day_N_{dense,sparse,labels}.npy``).

``torchrec.datasets.scripts.npy_preproc_criteo`` (``BinaryCriteoUtils.tsv_to_npys``)
writes, per day file (or ``train``/``test`` for Kaggle):

* ``<prefix>_dense.npy``: float32 ``[N, 13]``, **already log-transformed**: missing
  -> 0, then ``log(x - min + 2)`` with ``min`` the file's smallest dense value;
* ``<prefix>_sparse.npy``: int64 ``[N, 26]`` = ``int(value, 16)`` (missing -> 0); after
  ``contiguous_preproc_criteo`` (``<prefix>_sparse_contig_freq.npy``) or
  ``shuffle_preproc_criteo``: int32, contiguous ids;
* ``<prefix>_labels.npy``: int32 ``[N, 1]`` (``-1`` for the unlabeled Kaggle test set).

These files are read through ``np.load(mmap_mode="r")`` a chunk of rows at a time.
Dense values are kept as stored for ``dense_transform="log"`` or ``"none"`` (they are
log values already); ``"minmax"`` scales them. Sparse ids are kept (table size =
largest id + 1) or hashed with ``id % hash_size`` (no row is reserved for missing:
TorchRec has already mapped missing to 0). Labels other than 0/1 and negative ids
(without ``hash_size``) are bad rows, reported as ``file:row`` with 1-based rows.

A spec path is a directory (all its prefixes, in day order) or one prefix such as
``/data/criteo/day_23``.

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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.dense import DenseStats, check_transform, transform_dense
from torchrec_cowclip.data.encode import INT32_MAX, HashSize, conversion_meta
from torchrec_cowclip.data.errors import BAD_DENSE, BAD_LABEL, BAD_SPARSE_ID, BadRowLog, DataError
from torchrec_cowclip.data.npyfile import NpyAppender
from torchrec_cowclip.data.schema import CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, Schema, resolve_sizes

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
        (directory / f"{prefix}{s}" for s in _SPARSE_SUFFIXES if (directory / f"{prefix}{s}").exists()),
        None,
    )
    labels = directory / f"{prefix}_labels.npy"
    missing = [str(p) for p in [sparse or directory / f"{prefix}_sparse.npy", labels] if not p.exists()]
    if missing:
        raise FileNotFoundError(f"criteo-npy prefix {directory / prefix} lacks {missing}")
    return NpyDay(prefix, directory / f"{prefix}_dense.npy", sparse, labels)  # type: ignore[arg-type]


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


def _chunks(day: NpyDay, log: BadRowLog, hashed: bool) -> Any:
    dense, sparse, labels = _open(day)
    for start in range(0, len(labels), CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, len(labels))
        d = np.asarray(dense[start:stop], dtype=np.float64)
        s = np.asarray(sparse[start:stop], dtype=np.int64)
        y = np.asarray(labels[start:stop])
        checks = [
            (~((y == 0) | (y == 1)), BAD_LABEL, day.labels, lambda i: f"got {y[i]!r}"),
            (~np.isfinite(d).all(axis=1), BAD_DENSE, day.dense, lambda i: f"got {d[i].tolist()}"),
        ]
        if not hashed:
            checks.append(
                (
                    (s < 0).any(axis=1),
                    BAD_SPARSE_ID,
                    day.sparse,
                    lambda i: f"negative id in {s[i].tolist()} (pass hash_size)",
                )
            )
        flagged = np.zeros(len(y), dtype=bool)
        bad: List[Tuple[int, str, Path, str]] = []
        for mask, reason, path, detail in checks:
            for i in np.flatnonzero(mask & ~flagged).tolist():
                bad.append((start + i + 1, reason, path, detail(i)))
            flagged |= mask
        for row, reason, path, detail in sorted(bad):
            log.add(path, row, reason, detail)
        keep = ~flagged
        if not keep.all():
            d, s, y = d[keep], s[keep], y[keep]
        yield d, s, y.astype(np.float32)


def convert_criteo_npy(
    paths: Sequence[Union[str, Path]],
    test_paths: Sequence[Union[str, Path]],
    out_dir: Path,
    *,
    on_bad_row: str = "error",
    hash_size: HashSize = None,
    dense_transform: str = "log",
) -> Dict[str, Any]:
    """Convert TorchRec Criteo ``.npy`` days into cache arrays in ``out_dir``; returns meta fields."""
    check_transform(dense_transform)
    train_days = [d for p in paths for d in find_npy_days(p)]
    test_days = [d for p in test_paths for d in find_npy_days(p)]
    n_dense, n_sparse = _open(train_days[0])[0].shape[1], _open(train_days[0])[1].shape[1]
    for day in train_days + test_days:
        dense, sparse, _ = _open(day)
        if dense.shape[1] != n_dense or sparse.shape[1] != n_sparse:
            raise DataError(
                f"{day.prefix}: {dense.shape[1]} dense / {sparse.shape[1]} sparse columns, "
                f"expected {n_dense} / {n_sparse}",
                path=day.dense,
            )
    dense_names = CRITEO_DENSE_NAMES if n_dense == 13 else tuple(f"int_{i}" for i in range(n_dense))
    sparse_names = CRITEO_SPARSE_NAMES if n_sparse == 26 else tuple(f"cat_{i}" for i in range(n_sparse))
    hashed = hash_size is not None
    sizes = np.array(resolve_sizes(hash_size, sparse_names), dtype=np.int64) if hashed else None
    if sizes is not None and (sizes < 1).any():
        raise ValueError(f"hash_size must be >= 1, got {sizes.tolist()}")

    stats: Optional[DenseStats] = None
    cardinalities: Tuple[int, ...] = tuple(sizes.tolist()) if sizes is not None else ()
    if not hashed or dense_transform == "minmax":
        stats = DenseStats(n_dense)
        max_id = np.full(n_sparse, -1, dtype=np.int64)
        log1 = BadRowLog(on_bad_row)  # type: ignore[arg-type]
        for day in train_days + test_days:
            for d, s, _ in _chunks(day, log1, hashed):
                if day in train_days:
                    stats.update(d)
                if len(s):
                    np.maximum(max_id, s.max(axis=0), out=max_id)
        if not hashed:
            cardinalities = tuple(int(m) + 1 for m in np.maximum(max_id, 0))
    sparse_dtype = np.int32 if max(cardinalities) <= INT32_MAX else np.int64
    log = BadRowLog(on_bad_row)  # type: ignore[arg-type]
    test_start: Optional[int] = None
    file_rows = []
    with (
        NpyAppender(out_dir / "dense.npy", np.float32, (n_dense,)) as dense_w,
        NpyAppender(out_dir / "sparse.npy", sparse_dtype, (n_sparse,)) as sparse_w,
        NpyAppender(out_dir / "labels.npy", np.float32, ()) as labels_w,
    ):
        for k, day in enumerate(train_days + test_days):
            if k == len(train_days):
                test_start = labels_w.rows
            before, start = labels_w.rows, time.time()
            for d, s, y in _chunks(day, log, hashed):
                if dense_transform == "minmax":
                    dense_w.append(transform_dense(d, "minmax", stats))
                else:
                    dense_w.append(d.astype(np.float32))
                sparse_w.append(np.mod(s, sizes) if sizes is not None else s)
                labels_w.append(y)
            rows = labels_w.rows - before
            if rows == 0:
                raise DataError(f"no valid rows in {day.dense} ({log.summary()})", path=day.dense)
            file_rows.append(
                {
                    "path": str(day.dense.parent.resolve() / day.prefix),
                    "rows": rows,
                    "seconds": round(time.time() - start, 3),
                }
            )
        total = labels_w.rows
    return conversion_meta(
        Schema(dense_names, sparse_names, cardinalities),
        total, test_start, file_rows, log, sparse_dtype, stats,
        encoding=(
            {"kind": "hash", "method": "mod"}
            if hashed
            else {"kind": "as stored", "cardinality": "max id + 1"}
        ),
        dense_transform=(
            dense_transform if dense_transform == "minmax" else "as stored (torchrec log)"
        ),
        source_format="torchrec criteo npy",
    )


def npy_source_files(paths: Sequence[Union[str, Path]]) -> List[Path]:
    """Every file the days of ``paths`` consist of (for cache fingerprints)."""
    return [f for p in paths for d in find_npy_days(p) for f in d.files]

"""Conversion of a row source (Criteo, Avazu, CSV/TSV/parquet tables) into cache arrays.

At most two streaming passes, never holding more than one block in memory:

1. *Statistics pass*, over the training files only, when needed (vocabulary
   encoding, or ``dense_transform="minmax"``): counts every categorical value and
   tracks dense min/max. Its result is itself a cache entry (``<kind>-stats-<key>``),
   so changing ``min_count``, the transform of another run or the test files
   re-encodes without re-counting.
2. *Encoding pass*, over training then test files: encodes ids, transforms dense
   values and appends to ``dense.npy``/``sparse.npy``/``labels.npy``.

Example::

    >>> import tempfile, pathlib
    >>> from torchrec_cowclip.data.criteo import CRITEO_LAYOUT
    >>> from torchrec_cowclip.data.rows import TextRowSource
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> meta = convert_rows(TextRowSource(CRITEO_LAYOUT), ["/work/shared/data/criteo_sample.tsv"], [],
    ...                     out, EncodeOptions(), stats_cache=out / "stats")
    >>> meta["rows"], meta["schema"]["sparse_names"][0]
    (200, 'C1')
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.cache import build_entry, fingerprint
from torchrec_cowclip.data.dense import DenseStats, check_transform, transform_dense
from torchrec_cowclip.data.errors import BadRowLog, DataError
from torchrec_cowclip.data.hashing import HashEncoder, HashMethod
from torchrec_cowclip.data.npyfile import NpyAppender
from torchrec_cowclip.data.rows import RowSource
from torchrec_cowclip.data.schema import Schema, resolve_sizes
from torchrec_cowclip.data.vocab import Vocabulary

logger = logging.getLogger(__name__)

HashSize = Union[int, Sequence[int], Mapping[str, int], None]
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class EncodeOptions:
    """How raw rows become cache arrays.

    Args:
        on_bad_row: ``"error"`` (raise ``DataError`` at the first bad row) or ``"skip"``.
        min_count: vocabulary mode: values seen fewer times share the OOV id 0.
        hash_size: None for vocabulary encoding; else a table size (int, per-feature
            sequence or ``{name: size}``) to hash into.
        hash_method: ``"hex"`` (Criteo) or ``"fnv"`` (any string); see ``hashing``.
        dense_transform: ``"log"``, ``"minmax"`` or ``"none"``; see ``dense``.
    """

    on_bad_row: str = "error"
    min_count: int = 1
    hash_size: Any = None
    hash_method: HashMethod = "fnv"
    dense_transform: str = "log"

    def __post_init__(self) -> None:
        BadRowLog(self.on_bad_row)  # type: ignore[arg-type]
        check_transform(self.dense_transform)
        if int(self.min_count) < 1:
            raise ValueError(f"min_count must be >= 1, got {self.min_count}")
        if self.hash_size is not None and self.min_count != 1:
            raise ValueError(
                "min_count applies to vocabulary encoding; it cannot be combined with hash_size"
            )

    def payload(self) -> Dict[str, Any]:
        d = asdict(self)
        if isinstance(self.hash_size, Mapping):
            d["hash_size"] = dict(sorted(self.hash_size.items()))
        elif self.hash_size is not None and not isinstance(self.hash_size, int):
            d["hash_size"] = list(self.hash_size)
        if self.hash_size is None:
            d.pop("hash_method")
        return d


def _names(source: RowSource, paths: Sequence[Union[str, Path]]) -> Tuple[List[str], List[str]]:
    names = source.names(paths[0])
    for p in paths[1:]:
        other = source.names(p)
        if other != names:
            raise DataError(f"{p}: columns {other} differ from {paths[0]}'s {names}", path=p)
    return names


def _stats_pass(
    source: RowSource,
    paths: Sequence[Union[str, Path]],
    opts: EncodeOptions,
    sparse_names: List[str],
    n_dense: int,
    hasher: Optional[HashEncoder],
    out: Path,
) -> Dict[str, Any]:
    log = BadRowLog(opts.on_bad_row)  # type: ignore[arg-type]
    vocab = Vocabulary(sparse_names) if hasher is None else None
    stats = DenseStats(n_dense)
    rows = 0
    check = hasher.check if hasher is not None else None
    for path in paths:
        start, before = time.time(), rows
        for block in source.blocks(path, log, check):
            if vocab is not None:
                vocab.update(block.sparse)
            stats.update(block.dense)
            rows += len(block)
        _log_rate("counted", path, rows - before, start)
    if vocab is not None:
        vocab.save(out / "vocab.npz")
    with open(out / "dense_stats.npz", "wb") as f:
        np.savez(f, **stats.to_arrays())
    return {"rows": rows, "bad_rows": log.counts}


def _log_rate(what: str, path: Union[str, Path], rows: int, start: float) -> None:
    secs = max(time.time() - start, 1e-9)
    logger.info("%s %d rows of %s in %.1fs (%.0f rows/s)", what, rows, path, secs, rows / secs)


def convert_rows(
    source: RowSource,
    train_paths: Sequence[Union[str, Path]],
    test_paths: Sequence[Union[str, Path]],
    out_dir: Path,
    opts: EncodeOptions,
    *,
    stats_cache: Union[str, Path],
    stats_payload: Optional[Mapping[str, Any]] = None,
    source_format: Optional[str] = None,
) -> Dict[str, Any]:
    """Write ``dense.npy``, ``sparse.npy``, ``labels.npy`` for the rows of the files into
    ``out_dir`` and return the meta fields describing them.

    Args:
        source: reads row blocks from one file (text or parquet).
        train_paths: files whose rows come first and feed the statistics pass.
        test_paths: files appended after them (``meta["test_start"]`` marks the first
            test row); encoded with the training vocabulary and min/max.
        out_dir: where to write.
        opts: encoding options.
        stats_cache: cache root for the statistics-pass entry.
        stats_payload: what the source's layout contributes to that entry's key.
        source_format: how the files were read, recorded as ``meta["source_format"]``.
    """
    if not train_paths:
        raise ValueError("no training files given")
    dense_names, sparse_names = _names(source, [*train_paths, *test_paths])
    hasher: Optional[HashEncoder] = None
    if opts.hash_size is not None:
        sizes = resolve_sizes(opts.hash_size, sparse_names)
        hasher = HashEncoder(sizes, opts.hash_method, names=sparse_names)
    needs_stats = hasher is None or opts.dense_transform == "minmax"

    vocab: Optional[Vocabulary] = None
    stats: Optional[DenseStats] = None
    if needs_stats:
        payload = {
            "train": fingerprint(train_paths),
            "layout": dict(stats_payload or {}),
            "on_bad_row": opts.on_bad_row,
            "hash_check": opts.hash_method if hasher is not None else None,
            "vocabulary": hasher is None,
        }
        entry = build_entry(
            stats_cache,
            "stats",
            payload,
            lambda tmp: _stats_pass(
                source, train_paths, opts, sparse_names, len(dense_names), hasher, tmp
            ),
        )
        if hasher is None:
            vocab = Vocabulary.load(entry / "vocab.npz")
        with np.load(entry / "dense_stats.npz") as z:
            stats = DenseStats.from_arrays(dict(z))

    if hasher is not None:
        cardinalities = hasher.cardinalities
    else:
        assert vocab is not None
        cardinalities = vocab.cardinalities(opts.min_count)
    sparse_dtype = np.int32 if max(cardinalities, default=1) <= INT32_MAX else np.int64
    log = BadRowLog(opts.on_bad_row)  # type: ignore[arg-type]
    check = hasher.check if hasher is not None else None
    file_rows: List[Dict[str, Any]] = []
    test_start: Optional[int] = None
    with (
        NpyAppender(out_dir / "dense.npy", np.float32, (len(dense_names),)) as dense_w,
        NpyAppender(out_dir / "sparse.npy", sparse_dtype, (len(sparse_names),)) as sparse_w,
        NpyAppender(out_dir / "labels.npy", np.float32, ()) as labels_w,
    ):
        for k, path in enumerate([*train_paths, *test_paths]):
            if k == len(train_paths):
                test_start = labels_w.rows
            start, before = time.time(), labels_w.rows
            for block in source.blocks(path, log, check):
                if hasher is not None:
                    ids = hasher.encode(block.sparse)
                else:
                    ids = vocab.encode(block.sparse, opts.min_count)  # type: ignore[union-attr]
                dense_w.append(transform_dense(block.dense, opts.dense_transform, stats))
                sparse_w.append(ids)
                labels_w.append(block.labels)
            rows = labels_w.rows - before
            _log_rate("encoded", path, rows, start)
            if rows == 0:
                raise DataError(f"no valid data rows in {path} ({log.summary()})", path=path)
            file_rows.append({"path": str(Path(path).resolve()), "rows": rows})
        total = labels_w.rows
    if log.total:
        logger.warning("%s: %s", ", ".join(str(p) for p in train_paths), log.summary())
    return conversion_meta(
        Schema(tuple(dense_names), tuple(sparse_names), tuple(cardinalities)),
        total, test_start, file_rows, log, sparse_dtype, stats,
        encoding=(
            {"kind": "hash", "method": opts.hash_method, "missing_id": 0}
            if hasher is not None
            else {"kind": "vocabulary", "min_count": opts.min_count, "oov_id": 0, "missing_id": 1}
        ),
        dense_transform=opts.dense_transform,
        **({} if source_format is None else {"source_format": source_format}),
    )


def conversion_meta(
    schema: Schema,
    rows: int,
    test_start: Optional[int],
    file_rows: Any,
    log: BadRowLog,
    sparse_dtype: Any,
    stats: Optional[DenseStats],
    *,
    encoding: Dict[str, Any],
    dense_transform: str,
    **extra: Any,
) -> Dict[str, Any]:
    """The ``meta.json`` content every converter writes for its cache entry."""
    return {
        "schema": schema.to_json(),
        "rows": rows,
        "test_start": test_start,
        "file_rows": file_rows,
        "bad_rows": dict(log.counts),
        "bad_row_examples": list(log.examples),
        "bad_row_summary": log.summary(),
        "sparse_dtype": np.dtype(sparse_dtype).name,
        "encoding": encoding,
        "dense_transform": dense_transform,
        "dense_stats": (
            None if stats is None else {"min": stats.min.tolist(), "max": stats.max.tolist()}
        ),
        **extra,
    }

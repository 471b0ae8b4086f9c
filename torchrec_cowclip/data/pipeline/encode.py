"""Conversion of any row source into cache arrays: the one pipeline every kind runs.

A source kind describes its conversion (:class:`Conversion`): a row source reading
validated blocks from its parts (files, npy days, synthetic rows), the training and
test parts, and a :class:`SparseEncoding` turning raw categoricals into ids. The
pipeline makes at most two streaming passes, never holding more than one block in
memory:

1. *Statistics pass*, for an encoding that counts (a vocabulary): over the training
   parts (and the test parts for an encoding that must see every id), counting
   categoricals. Its result is itself a cache entry (``stats-<key>``), so changing
   ``min_count``, the dense transform or the test files re-encodes without re-counting.
2. *Encoding pass*, over training then test parts: encodes ids, stores the dense values
   (clipped, each column's pointwise transform, NaN where missing: see ``dense``) while
   taking their statistics over the training parts (``meta["dense_stats"]``, from which
   a dataset's default :class:`~torchrec_cowclip.data.parsing.dense.DensePlan` is fitted),
   and appends to the arrays through the one
   :class:`~torchrec_cowclip.data.pipeline.writer.CacheWriter`.

Every part is reported as it goes (``logger.info``: the rows so far, rows/s and, for
plain text files, the share read, every 10 s), and what was counted (clipped values,
values a transform cannot take, bad rows) goes into the meta, which ``open_dataset``
reports once per open.

The entry keeps what encoded its categoricals (``meta["encoder"]``: the encoding's saved
state, a vocabulary's ``vocab.npz``), so that a trained model's run folder can encode
new rows exactly as these were, with no cache left.

Example::

    >>> import tempfile, pathlib
    >>> from torchrec_cowclip.data.sources.criteo import CRITEO_LAYOUT
    >>> from torchrec_cowclip.data.parsing.rows import TextRowSource
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> paths = ["tests/data/criteo_sample.tsv"]
    >>> conversion = Conversion(TextRowSource(CRITEO_LAYOUT), paths, [],
    ...                         VocabularyEncoding(min_count=1), stats_key={"demo": 1})
    >>> meta = convert(conversion, out, stats_cache=out / "stats")
    >>> meta["rows"], meta["schema"]["sparse_names"][0], meta["encoding"]["kind"]
    (200, 'C1', 'vocabulary')
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.errors import BadRowLog, DataError, DataOptionError
from torchrec_cowclip.data.parsing.dense import DenseStats, DenseTransformSpec, stored_values
from torchrec_cowclip.data.parsing.hashing import HashEncoder, HashMethod
from torchrec_cowclip.data.parsing.rows import (
    RowBlock,
    RowSource,
    SparseCheck,
    TextLayout,
    TextRowSource,
)
from torchrec_cowclip.data.parsing.vocab import Vocabulary
from torchrec_cowclip.data.pipeline.cache import build_entry, fingerprint
from torchrec_cowclip.data.pipeline.writer import CacheWriter
from torchrec_cowclip.data.schema import Schema, resolve_sizes
from torchrec_cowclip.data.source_options import FileSourceOptions, option_field

logger = logging.getLogger(__name__)

#: Rows per table: one for every table, one per table in order, or ``{name: rows}``.
TableSizes = Union[int, Sequence[int], Mapping[str, int]]
HashSize = Optional[TableSizes]
INT32_MAX = 2**31 - 1


def json_sizes(hash_size: HashSize) -> Any:
    """``hash_size`` as it enters a cache key (a mapping sorted by name)."""
    if hash_size is None or isinstance(hash_size, int):
        return hash_size
    if isinstance(hash_size, Mapping):
        return dict(sorted((str(k), int(v)) for k, v in hash_size.items()))
    return [int(x) for x in hash_size]


@dataclass(frozen=True)
class EncodedOptions(FileSourceOptions):
    """Options of the sources whose categoricals are text (Criteo, Avazu, tables).

    Args:
        min_count: vocabulary encoding: values seen fewer times share the OOV id 0.
        hash_size: None for vocabulary encoding; else a table size (int, per-feature
            sequence or ``{name: size}``) to hash into.
        missing_indicator: the dataset's dense plan adds a 0/1 input per dense column
            with missing values in the training rows (it changes no stored array, so it
            is not part of the cache key).
        dense_buckets: the dataset's dense plan adds each dense column's quantile bucket
            among this many (of the training rows) as one-hot inputs; 0: none (not part
            of the cache key either).
    """

    min_count: int = option_field(1, "--min-count")
    hash_size: HashSize = option_field(None, "--hash-size")
    missing_indicator: bool = option_field(False, "--missing-indicator")
    dense_buckets: int = option_field(0, "--dense-buckets")

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.min_count) < 1:
            raise DataOptionError(f"min_count (--min-count) must be >= 1, got {self.min_count}")
        if int(self.dense_buckets) < 0 or int(self.dense_buckets) == 1:
            raise DataOptionError(
                f"dense_buckets (--dense-buckets) must be 0 (none) or at least 2, got "
                f"{self.dense_buckets}"
            )
        if self.hash_size is not None and self.min_count != 1:
            raise DataOptionError(
                f"min_count (--min-count {self.min_count}) applies to vocabulary encoding; "
                f"it cannot be combined with hash_size (--hash-size {self.hash_size})"
            )

    def encoding(self, method: HashMethod) -> "SparseEncoding":
        """Vocabulary encoding, or hashing with ``method`` when ``hash_size`` is set."""
        if self.hash_size is None:
            return VocabularyEncoding(self.min_count)
        return HashingEncoding(self.hash_size, method)

    def payload(self, method: HashMethod) -> Dict[str, Any]:
        """The options as they enter the cache key."""
        d: Dict[str, Any] = {
            "on_bad_row": self.on_bad_row,
            "min_count": self.min_count,
            "hash_size": json_sizes(self.hash_size),
            "dense_transform": self.dense_spec().text(),
        }
        if self.hash_size is not None:
            d["hash_method"] = method
        return d


class SparseEncoding(ABC):
    """How a source's raw categoricals become ids in ``[0, cardinality)``.

    ``start(sparse_names)`` is called once before either pass. An encoding that
    ``counts`` sees the statistics pass's blocks (``update``), over the test parts too
    if ``count_test``, and keeps what it learnt in the statistics entry
    (``save``/``load``); the defaults here learn nothing. ``check()`` returns the
    check of the rows it cannot encode (bad rows), if any.
    """

    counts = False
    count_test = False

    def start(self, sparse_names: Sequence[str]) -> None:
        pass

    def check(self) -> Optional[SparseCheck]:
        return None

    def update(self, sparse: Any) -> None:
        pass

    def save(self, directory: Path) -> None:
        pass

    def load(self, directory: Path) -> None:
        pass

    @abstractmethod
    def cardinalities(self) -> Tuple[int, ...]:
        """Rows of each feature's table (after the statistics pass, if any)."""

    @abstractmethod
    def encode(self, sparse: Any) -> np.ndarray:
        """Ids ``[n, n_sparse]`` of one block's categoricals."""

    @abstractmethod
    def describe(self) -> Dict[str, Any]:
        """``meta["encoding"]``."""

    def stats_key(self) -> Dict[str, Any]:
        """What the encoding contributes to the statistics entry's key."""
        return {}


class VocabularyEncoding(SparseEncoding):
    """Exact label encoding by a vocabulary over the training parts (see ``vocab``)."""

    counts = True
    vocab: Vocabulary

    def __init__(self, min_count: int) -> None:
        self.min_count = int(min_count)

    def start(self, sparse_names: Sequence[str]) -> None:
        self.vocab = Vocabulary(sparse_names)

    def update(self, sparse: Any) -> None:
        self.vocab.update(sparse)

    def save(self, directory: Path) -> None:
        self.vocab.save(directory / "vocab.npz")

    def load(self, directory: Path) -> None:
        self.vocab = Vocabulary.load(directory / "vocab.npz")

    def cardinalities(self) -> Tuple[int, ...]:
        return self.vocab.cardinalities(self.min_count)

    def encode(self, sparse: Any) -> np.ndarray:
        return self.vocab.encode(sparse, self.min_count)

    def describe(self) -> Dict[str, Any]:
        return {"kind": "vocabulary", "min_count": self.min_count, "oov_id": 0, "missing_id": 1}

    def stats_key(self) -> Dict[str, Any]:
        return {"hash_check": None, "vocabulary": True}


class HashingEncoding(SparseEncoding):
    """Hashing of text categoricals into fixed table sizes (see ``hashing``)."""

    hasher: HashEncoder

    def __init__(self, hash_size: TableSizes, method: HashMethod) -> None:
        self.hash_size, self.method = hash_size, method

    def start(self, sparse_names: Sequence[str]) -> None:
        sizes = resolve_sizes(self.hash_size, sparse_names)
        self.hasher = HashEncoder(sizes, self.method, names=sparse_names)

    def check(self) -> Optional[SparseCheck]:
        return self.hasher.check

    def cardinalities(self) -> Tuple[int, ...]:
        return self.hasher.cardinalities

    def encode(self, sparse: Any) -> np.ndarray:
        return self.hasher.encode(sparse)

    def describe(self) -> Dict[str, Any]:
        return {"kind": "hash", "method": self.method, "missing_id": 0}

    def stats_key(self) -> Dict[str, Any]:
        return {"hash_check": self.method, "vocabulary": False}


@dataclass
class Conversion:
    """What a source kind hands to :func:`convert`.

    Args:
        source: reads validated blocks from one part.
        train, test: the parts; test rows come last (``meta["test_start"]``) and are
            encoded with the training statistics.
        encoding: raw categoricals -> ids.
        stats_key: what identifies the statistics pass (the training parts'
            fingerprint, the layout); the pipeline adds the bad-row mode and encoding.
        dense_transform: the dense columns' transform spec (see ``dense``), resolved
            against the source's dense names (a column it names that is not one of them
            is refused).
        on_bad_row: ``"error"`` or ``"skip"``.
        source_format: recorded as ``meta["source_format"]``.
        dense_transform_label: recorded as ``meta["dense_transform"]`` instead of
            ``dense_transform`` (a source whose values are transformed already).
        extra: names of the extra per-row vectors the blocks carry.
        finish: called with the finished entry directory and meta; returns more meta.
        where: how errors name the source (its kind).
    """

    source: RowSource
    train: Sequence[Any]
    test: Sequence[Any]
    encoding: SparseEncoding
    stats_key: Mapping[str, Any]
    dense_transform: str = "log"
    on_bad_row: str = "error"
    source_format: Optional[str] = None
    dense_transform_label: Optional[str] = None
    extra: Tuple[str, ...] = ()
    finish: Optional[Callable[[Path, Dict[str, Any]], Dict[str, Any]]] = field(default=None)
    where: str = "data"


def _names(c: Conversion) -> Tuple[List[str], List[str]]:
    parts = [*c.train, *c.test]
    names = c.source.names(parts[0])
    for p in parts[1:]:
        other = c.source.names(p)
        if other != names:
            name, first = c.source.part_name(p), c.source.part_name(parts[0])
            raise DataError(f"{name}: columns {other} differ from {first}'s {names}", path=name)
    return names


#: Seconds between two progress lines of one part.
PROGRESS_EVERY_S = 10.0


class _PartProgress:
    """Progress lines for one part of a pass: rows so far, rate, share read if known."""

    def __init__(self, what: str, name: str) -> None:
        self.what, self.name = what, name
        self.start = self.last = time.time()
        self.rows = 0

    def add(self, block: RowBlock) -> None:
        self.rows += len(block)
        now = time.time()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        rate = self.rows / max(now - self.start, 1e-9)
        done = block.fraction
        share = "" if done is None else f", {done:.0%} read"
        eta = (
            f", about {(1 - done) * (now - self.start) / done:.0f} s to go"
            if done is not None and done > 0
            else ""
        )
        logger.info(
            "%s %s: %s rows so far (%s rows/s%s%s)",
            self.what,
            self.name,
            f"{self.rows:,}",
            f"{rate:,.0f}",
            share,
            eta,
        )

    def done(self) -> None:
        secs = max(time.time() - self.start, 1e-9)
        logger.info(
            "%s %s rows of %s in %.1fs (%s rows/s)",
            self.what,
            f"{self.rows:,}",
            self.name,
            secs,
            f"{self.rows / secs:,.0f}",
        )


def _stats_pass(c: Conversion, out: Path) -> Dict[str, Any]:
    log = BadRowLog(c.on_bad_row)  # type: ignore[arg-type]  # a str: BadRowLog checks it
    check = c.encoding.check()
    rows = 0
    parts = [*c.train, *(c.test if c.encoding.count_test else ())]
    for part in parts:
        progress = _PartProgress("counted", c.source.part_name(part))
        for block in c.source.blocks(part, log, check):
            c.encoding.update(block.sparse)
            progress.add(block)
        progress.done()
        rows += progress.rows
    c.encoding.save(out)
    return {"rows": rows, "bad_rows": log.counts}


def _keep_encoder(c: Conversion, out_dir: Path) -> Dict[str, Any]:
    """Writes into the entry what encoded its categoricals and returns ``meta["encoder"]``:
    the encoding and the files of its state."""
    before = set(p.name for p in out_dir.iterdir())
    if c.encoding.counts:
        c.encoding.save(out_dir)
    return {
        "files": sorted(p.name for p in out_dir.iterdir() if p.name not in before),
        "encoding": c.encoding.describe(),
    }


def convert(c: Conversion, out_dir: Path, *, stats_cache: Union[str, Path]) -> Dict[str, Any]:
    """Write the cache arrays of ``c``'s rows into ``out_dir``; return the meta fields
    describing them (``checks`` included).

    Args:
        c: the conversion.
        out_dir: where to write.
        stats_cache: cache root for the statistics-pass entry.
    """
    if not c.train:
        raise DataOptionError("no training files given")
    dense_names, sparse_names = _names(c)
    spec = DenseTransformSpec.parse(c.dense_transform, default="log")
    transforms = spec.resolve(dense_names, c.where)
    c.encoding.start(sparse_names)
    if c.encoding.counts:
        payload = {
            **c.stats_key,
            "on_bad_row": c.on_bad_row,
            **c.encoding.stats_key(),
        }
        entry = build_entry(stats_cache, "stats", payload, lambda tmp: _stats_pass(c, tmp))
        c.encoding.load(entry)

    cardinalities = c.encoding.cardinalities()
    sparse_dtype = np.int32 if max(cardinalities, default=1) <= INT32_MAX else np.int64
    log = BadRowLog(c.on_bad_row)  # type: ignore[arg-type]  # a str: BadRowLog checks it
    check = c.encoding.check()
    k = len(dense_names)
    clipped, negative = np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64)
    stats = DenseStats(dense_names)
    with CacheWriter(out_dir, k, len(sparse_names), sparse_dtype, c.extra) as w:
        for i, part in enumerate([*c.train, *c.test]):
            name = c.source.part_name(part)
            is_train = i < len(c.train)
            w.begin(name, test=not is_train)
            progress = _PartProgress("wrote", name)
            for block in c.source.blocks(part, log, check):
                dense = stored_values(block.dense, transforms, clipped, negative)
                if is_train:
                    stats.update(dense)
                w.append(dense, c.encoding.encode(block.sparse), block.labels, block.extra)
                progress.add(block)
            w.end(name, log.summary())
            progress.done()

    def per_column(counts: np.ndarray) -> Dict[str, int]:
        return {n: int(v) for n, v in zip(dense_names, counts.tolist()) if v}

    meta: Dict[str, Any] = {
        "schema": Schema(tuple(dense_names), tuple(sparse_names), tuple(cardinalities)).to_json(),
        "rows": w.rows,
        "test_start": w.test_start,
        "file_rows": w.file_rows,
        "bad_rows": dict(log.counts),
        "bad_row_examples": list(log.examples),
        "bad_row_summary": log.summary(),
        "sparse_dtype": np.dtype(sparse_dtype).name,
        "encoding": c.encoding.describe(),
        "dense_transform": c.dense_transform_label or spec.text(),
        "dense_transforms": list(transforms),
        "dense_stats": stats.to_json(),
        "dense_clipped": per_column(clipped),
        "dense_negative_under_log": per_column(negative),
        "checks": w.arrays(),
        "encoder": _keep_encoder(c, out_dir),
    }
    if c.source_format is not None:
        meta["source_format"] = c.source_format
    if c.finish is not None:
        meta.update(c.finish(out_dir, meta))
    return meta


def text_payload(
    paths: Sequence[Union[str, Path]],
    test_paths: Sequence[Union[str, Path]],
    opts: EncodedOptions,
    method: HashMethod,
    columns: Mapping[str, Any],
) -> Dict[str, Any]:
    """The cache key payload of a text source (Criteo, Avazu, table)."""
    return {
        "sources": fingerprint(paths),
        "test": fingerprint(test_paths),
        "options": opts.payload(method),
        "columns": dict(columns),
    }


def text_conversion(
    layout: TextLayout,
    paths: Sequence[Union[str, Path]],
    test_paths: Sequence[Union[str, Path]],
    opts: EncodedOptions,
    method: HashMethod,
    *,
    layout_name: str,
    source_format: str,
) -> Conversion:
    """The conversion of delimited text files laid out as ``layout`` says."""
    return Conversion(
        TextRowSource(layout),
        paths,
        test_paths,
        opts.encoding(method),
        stats_key={
            "train": fingerprint(paths),
            "layout": {"layout": layout_name, **layout.payload()},
        },
        dense_transform=opts.dense_spec().text(),
        on_bad_row=opts.on_bad_row,
        source_format=source_format,
        where=layout_name,
    )

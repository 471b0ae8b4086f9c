"""Encoders fixed by a trained run: its vocabularies with their ids frozen (and grown by
the new values of a warm start) and its table sizes.

A trained model is only as good as the ids it was trained on, so the rows it scores
later must be encoded exactly as its training rows were. A cache entry keeps what
encoded it (``meta["encoder"]``, see ``encode``); :func:`keep_encoder` turns that
into a run folder's encoder files and :func:`restore_encoder` reads them back:

* a vocabulary becomes an :class:`IdVocabulary`: per column, the kept values in id
  order (``id = 2 + position``; 0 is out of vocabulary, 1 missing, as in ``vocab``).
  A vocabulary numbers its kept values in byte order, so the ids are the same;
* hashing and ids used as stored keep no state: the run's options rebuild them.

The dense columns need no encoder here: the run folder keeps the run's fitted dense plan
(``data.parsing.dense.DensePlan``), which scores raw values as training did.

A warm start (``train --init-from RUN``) encodes its new data with
:class:`GrowingVocabulary`: RUN's ids never move, and the values the new training
rows hold at least ``min_count`` times that RUN does not know are appended, in byte
order, after them (so its tables grow by rows that start as training initialises
them). Encodings without a vocabulary keep at least RUN's table sizes
(:class:`AtLeastSizes`).

Example::

    >>> from torchrec_cowclip.data.parsing.vocab import Vocabulary
    >>> v = Vocabulary(["C1"]); v.update([np.array([b"b", b"a", b"b"])])
    >>> frozen = IdVocabulary.from_vocabulary(v, min_count=1)
    >>> frozen.encode([np.array([b"a", b"b", b"", b"z"])])[:, 0].tolist()  # OOV 0, missing 1
    [2, 3, 1, 0]
    >>> new = Vocabulary(["C1"]); new.update([np.array([b"z", b"a", b"c"])])
    >>> grown = frozen.grown(new, min_count=1)
    >>> grown.cardinalities(), grown.encode([np.array([b"a", b"b", b"c", b"z"])])[:, 0].tolist()
    ((6,), [2, 3, 4, 5])
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.errors import DataError
from torchrec_cowclip.data.parsing.hashing import HashMethod
from torchrec_cowclip.data.parsing.rows import SparseCheck
from torchrec_cowclip.data.parsing.vocab import (
    FIRST_VALUE_ID,
    MISSING_ID,
    OOV_ID,
    Vocabulary,
    find_keys,
    load_key_columns,
    pack_keys,
    save_key_columns,
)
from torchrec_cowclip.data.pipeline.encode import (
    HashingEncoding,
    SparseEncoding,
    TableSizes,
)
from torchrec_cowclip.data.schema import Schema
from torchrec_cowclip.data.sources.criteo_npy import ModuloIds

#: The file an :class:`IdVocabulary` is saved in (run folders, cache entries).
ID_VOCABULARY_FILE = "id_vocab.npz"
_PACK_BYTES = 8


class IdVocabulary:
    """Per categorical column, its kept values in id order (``id = 2 + position``).

    Args:
        names: the columns, in order.
        keys: per column, the values (``S`` arrays) in id order; distinct.
        counts: per column, each value's occurrences in the training rows.
    """

    def __init__(
        self, names: Sequence[str], keys: Sequence[np.ndarray], counts: Sequence[np.ndarray]
    ) -> None:
        if not (len(names) == len(keys) == len(counts)):
            raise ValueError(f"{len(names)} names, {len(keys)} key and {len(counts)} count arrays")
        self.names: List[str] = list(names)
        self.keys: List[np.ndarray] = [np.asarray(k, dtype=np.bytes_) for k in keys]
        self.counts: List[np.ndarray] = [np.asarray(n, dtype=np.int64) for n in counts]
        self._sorted_columns: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    @classmethod
    def from_vocabulary(cls, vocab: Vocabulary, min_count: int) -> "IdVocabulary":
        """The ids :meth:`Vocabulary.encode` gives at ``min_count``, frozen."""
        keys, counts = [], []
        for c in range(len(vocab.names)):
            kept = vocab.counts(c) >= min_count
            keys.append(vocab.keys(c)[kept])
            counts.append(vocab.counts(c)[kept])
        return cls(vocab.names, keys, counts)

    def cardinalities(self) -> Tuple[int, ...]:
        """Rows of each column's table: its values plus the OOV and missing ids."""
        return tuple(FIRST_VALUE_ID + len(k) for k in self.keys)

    def _lookup(self, c: int) -> Tuple[np.ndarray, np.ndarray]:
        """``(sorted keys, their ids)`` of column ``c`` (packed to uint64 when short)."""
        if c not in self._sorted_columns:
            keys = self.keys[c]
            order = np.argsort(keys, kind="stable")
            ordered = keys[order]
            if keys.dtype.itemsize <= _PACK_BYTES:
                ordered = pack_keys(ordered)
            self._sorted_columns[c] = (ordered, order.astype(np.int64) + FIRST_VALUE_ID)
        return self._sorted_columns[c]

    def encode(self, sparse: Sequence[np.ndarray]) -> np.ndarray:
        """Ids ``int64 [n, n_columns]`` of one block (``S`` arrays; ``b""`` missing)."""
        if len(sparse) != len(self.names):
            raise ValueError(f"got {len(sparse)} columns for a vocabulary of {len(self.names)}")
        n = len(sparse[0]) if len(sparse) else 0
        out = np.empty((n, len(sparse)), dtype=np.int64)
        for c, col in enumerate(sparse):
            ordered, ids_of = self._lookup(c)
            pos, found = find_keys(ordered, col)
            ids = np.full(n, OOV_ID, dtype=np.int64)
            ids[found] = ids_of[pos[found]]
            ids[col == b""] = MISSING_ID
            out[:, c] = ids
        return out

    def grown(self, new: Vocabulary, min_count: int) -> "IdVocabulary":
        """This vocabulary with the values of ``new`` seen at least ``min_count`` times
        that it lacks appended (in byte order); its own ids stay."""
        if new.names != self.names:
            raise DataError(
                f"the new data's categorical columns {new.names} differ from the run's {self.names}"
            )
        keys, counts = [], []
        for c in range(len(self.names)):
            candidates, seen = new.keys(c), new.counts(c)
            candidates, seen = candidates[seen >= min_count], seen[seen >= min_count]
            ordered, _ = self._lookup(c)
            _, known = find_keys(ordered, candidates)
            keys.append(np.concatenate([self.keys[c], candidates[~known]]))
            counts.append(np.concatenate([self.counts[c], seen[~known]]))
        return IdVocabulary(self.names, keys, counts)

    def save(self, path: Union[str, Path]) -> None:
        """Writes an ``.npz`` (the format of :meth:`Vocabulary.save`, keys in id order)."""
        save_key_columns(path, self.names, self.keys, self.counts)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "IdVocabulary":
        """Reads what :meth:`save` wrote (``allow_pickle=False``)."""
        return cls(*load_key_columns(path))

    def digest(self) -> str:
        """16 hex digits of the keys in id order (what the ids mean)."""
        h = hashlib.sha256()
        for name, keys in zip(self.names, self.keys):
            h.update(name.encode() + b"\0" + str(keys.dtype).encode())
            h.update(np.ascontiguousarray(keys).tobytes())
        return h.hexdigest()[:16]


class GrowingVocabulary(SparseEncoding):
    """A warm start's encoding: ``base``'s ids, grown by the values of the new training
    rows seen at least ``min_count`` times (counted in the statistics pass)."""

    counts = True

    def __init__(self, base: IdVocabulary, min_count: int) -> None:
        self.base, self.min_count = base, int(min_count)
        self._new: Optional[Vocabulary] = None
        self._table: Optional[IdVocabulary] = None

    def start(self, sparse_names: Sequence[str]) -> None:
        if list(sparse_names) != self.base.names:
            raise DataError(
                f"the new data's categorical columns {list(sparse_names)} differ from the "
                f"run's {self.base.names}"
            )
        self._new, self._table = Vocabulary(sparse_names), None

    def update(self, sparse: Any) -> None:
        assert self._new is not None, "start() first"
        self._new.update(sparse)

    def table(self) -> IdVocabulary:
        """The grown vocabulary (after the statistics pass, or once loaded)."""
        if self._table is None:
            assert self._new is not None, "start() first"
            self._table = self.base.grown(self._new, self.min_count)
        return self._table

    def save(self, directory: Path) -> None:
        self.table().save(directory / ID_VOCABULARY_FILE)

    def load(self, directory: Path) -> None:
        self._table = IdVocabulary.load(directory / ID_VOCABULARY_FILE)

    def cardinalities(self) -> Tuple[int, ...]:
        return self.table().cardinalities()

    def encode(self, sparse: Any) -> np.ndarray:
        return self.table().encode(sparse)

    def describe(self) -> Dict[str, Any]:
        return {
            "kind": "id vocabulary",
            "min_count": self.min_count,
            "oov_id": OOV_ID,
            "missing_id": MISSING_ID,
            "grown_from": self.base.digest(),
        }

    def stats_key(self) -> Dict[str, Any]:
        return {"hash_check": None, "vocabulary": "grown", "base": self.base.digest()}


class AtLeastSizes(SparseEncoding):
    """``inner`` with tables at least ``minimum`` rows each (a warm start keeps its run's
    tables whole when the new data would size them smaller)."""

    def __init__(self, inner: SparseEncoding, minimum: Sequence[int]) -> None:
        self.inner, self.minimum = inner, tuple(int(m) for m in minimum)
        self.counts, self.count_test = inner.counts, inner.count_test

    def start(self, sparse_names: Sequence[str]) -> None:
        if len(sparse_names) != len(self.minimum):
            raise DataError(
                f"the new data has {len(sparse_names)} categorical columns, the run "
                f"{len(self.minimum)}"
            )
        self.inner.start(sparse_names)

    def check(self) -> Optional[SparseCheck]:
        return self.inner.check()

    def update(self, sparse: Any) -> None:
        self.inner.update(sparse)

    def save(self, directory: Path) -> None:
        self.inner.save(directory)

    def load(self, directory: Path) -> None:
        self.inner.load(directory)

    def cardinalities(self) -> Tuple[int, ...]:
        return tuple(max(a, b) for a, b in zip(self.inner.cardinalities(), self.minimum))

    def encode(self, sparse: Any) -> np.ndarray:
        return self.inner.encode(sparse)

    def describe(self) -> Dict[str, Any]:
        return self.inner.describe()

    def stats_key(self) -> Dict[str, Any]:
        return {**self.inner.stats_key(), "at_least": list(self.minimum)}


class IdentityIds(SparseEncoding):
    """Ids that are row numbers already (TorchRec npy days, synthetic rows)."""

    def __init__(self, cardinalities: Sequence[int]) -> None:
        self._cardinalities = tuple(int(c) for c in cardinalities)

    def cardinalities(self) -> Tuple[int, ...]:
        return self._cardinalities

    def encode(self, sparse: Any) -> np.ndarray:
        return np.asarray(sparse, dtype=np.int64)

    def describe(self) -> Dict[str, Any]:
        return {"kind": "as stored"}


def keep_encoder(entry: Path, encoder: Mapping[str, Any], directory: Path) -> Dict[str, Any]:
    """Writes the encoder of the cache entry ``entry`` (its ``meta["encoder"]``) into
    ``directory`` as a run folder keeps it, and returns its description: the encoding
    and its vocabulary file, an :class:`IdVocabulary` (None for encodings without)."""
    encoding = dict(encoder["encoding"])
    if encoding["kind"] == "vocabulary":
        vocab = Vocabulary.load(entry / "vocab.npz")
        IdVocabulary.from_vocabulary(vocab, int(encoding["min_count"])).save(
            directory / ID_VOCABULARY_FILE
        )
        encoding["kind"] = "id vocabulary"
    elif encoding["kind"] == "id vocabulary":
        IdVocabulary.load(entry / ID_VOCABULARY_FILE).save(directory / ID_VOCABULARY_FILE)
    return {
        "encoding": encoding,
        "vocabulary": ID_VOCABULARY_FILE if encoding["kind"] == "id vocabulary" else None,
    }


def restore_encoder(
    kept: Mapping[str, Any], schema: Schema, hash_size: Optional[TableSizes], directory: Path
) -> SparseEncoding:
    """The encoding :func:`keep_encoder` described, its files in ``directory`` (ready:
    ``encode(sparse) -> ids``, ``check()``).

    Raises:
        DataError: an encoding this version does not know (a newer run folder).
    """
    encoding = kept["encoding"]
    kind = encoding["kind"]
    restored: SparseEncoding
    if kind == "id vocabulary":
        restored = _FrozenVocabulary(IdVocabulary.load(directory / str(kept["vocabulary"])))
    elif kind == "hash" and encoding.get("method") in ("hex", "fnv"):
        if hash_size is None:
            raise DataError(f"{directory}: a hashed run without hash_size in its options")
        method: HashMethod = encoding["method"]
        restored = HashingEncoding(hash_size, method)
    elif kind == "hash" and encoding.get("method") == "mod":
        restored = ModuloIds(hash_size if hash_size is not None else schema.cardinalities)
    elif kind in ("as stored", "synthetic ids"):
        restored = IdentityIds(schema.cardinalities)
    else:
        raise DataError(
            f"{directory}: categorical encoding {kind!r} is not known to this version "
            "of torchrec_cowclip (a newer run folder?)"
        )
    restored.start(schema.sparse_names)
    return restored


class _FrozenVocabulary(SparseEncoding):
    """An :class:`IdVocabulary` as an encoding that learns nothing."""

    def __init__(self, table: IdVocabulary) -> None:
        self.table = table

    def cardinalities(self) -> Tuple[int, ...]:
        return self.table.cardinalities()

    def encode(self, sparse: Any) -> np.ndarray:
        return self.table.encode(sparse)

    def describe(self) -> Dict[str, Any]:
        return {"kind": "id vocabulary", "oov_id": OOV_ID, "missing_id": MISSING_ID}

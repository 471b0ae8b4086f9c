"""Exact per-feature vocabularies (label encoding) built in one streaming pass.

Each distinct value of each categorical column gets its own id, like the reference's
``LabelEncoder`` over the whole file. Ids are laid out as:

* ``0``: out of vocabulary - values seen fewer than ``min_count`` times in the
  vocabulary pass, and values never seen there (e.g. only in explicit test files);
* ``1``: missing (empty field), its own id as in the reference (which fills it with a
  placeholder string before encoding);
* ``2 + k``: the k-th kept value in byte order (the reference's ``LabelEncoder`` also
  numbers classes in sorted order, so ids match it up to the offset of 2).

Counts are kept with the keys, so one vocabulary serves every ``min_count``.
Values of at most 8 bytes (all of Criteo's and Avazu's) are handled as big-endian
uint64 integers, whose order is the byte order of the strings: sorting and searching
integers is much faster than fixed-width strings (docs/performance.md, "Measured reasons behind code choices"). A column falls back to byte
strings for good once a longer value shows up.
Memory is one fixed-width byte string and one int64 per distinct value (Criteo
Kaggle: 33.8M values, about 0.6 GB); for Criteo 1TB use hashing instead.

Example::

    >>> import numpy as np
    >>> v = Vocabulary(["C1"])
    >>> v.update([np.array([b"b", b"a", b"b", b""])])
    >>> v.encode([np.array([b"a", b"b", b"", b"zz"])], min_count=1)[:, 0].tolist()
    [2, 3, 1, 0]
    >>> v.encode([np.array([b"a", b"b"])], min_count=2)[:, 0].tolist(), v.cardinalities(2)
    ([0, 2], (3,))
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.errors import DataError
from torchrec_cowclip.data.parsing.fields import byte_matrix
from torchrec_cowclip.readback import open_member

OOV_ID = 0
MISSING_ID = 1
FIRST_VALUE_ID = 2

_MIN_MERGE = 1 << 20
_PACK_BYTES = 8


def pack_keys(col: np.ndarray) -> np.ndarray:
    """``S`` values of at most 8 bytes as uint64 with the same order and equality.

    The empty value packs to 0, below every non-empty value.
    """
    n, width = len(col), col.dtype.itemsize
    if width > _PACK_BYTES:
        raise ValueError(f"cannot pack {width}-byte values")
    b = np.zeros((n, _PACK_BYTES), dtype=np.uint8)
    b[:, :width] = np.ascontiguousarray(col).view(np.uint8).reshape(n, width)
    return b.view(">u8").reshape(n).astype(np.uint64)


def unpack_keys(keys: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_keys` (as ``S8``)."""
    return keys.astype(">u8").view("S8")


def find_keys(keys: np.ndarray, col: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(position in keys, found)`` of each value of ``col`` (an ``S`` array) in the
    sorted ``keys``: uint64 packed values (:func:`pack_keys`) or an ``S`` array.

    Example::

        >>> pos, found = find_keys(pack_keys(np.array([b"a", b"c"])), np.array([b"c", b"b"]))
        >>> pos.tolist(), found.tolist()
        ([1, 1], [True, False])
    """
    n = len(col)
    if len(keys) == 0:
        return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
    too_long = None
    if keys.dtype == np.uint64:
        if col.dtype.itemsize > _PACK_BYTES:
            # A packed column's vocabulary holds no value longer than 8 bytes.
            too_long = byte_matrix(col)[1] > _PACK_BYTES
            query = pack_keys(col.astype(f"S{_PACK_BYTES}"))
        else:
            query = pack_keys(col)
    else:
        query = col
    pos = np.searchsorted(keys, query)
    np.minimum(pos, len(keys) - 1, out=pos)
    found = keys[pos] == query
    if too_long is not None:
        found &= ~too_long
    return pos.astype(np.int64), found


class Vocabulary:
    """Distinct values and their counts, per categorical column.

    Args:
        names: the categorical columns' names, in column order.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names: List[str] = list(names)
        n = len(self.names)
        self._keys: List[np.ndarray] = [np.zeros(0, dtype=np.uint64) for _ in range(n)]
        self._counts: List[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(n)]
        self._pending: List[List[Tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
        self._pending_size = [0] * n
        self._kept: Dict[Tuple[int, int], np.ndarray] = {}

    def update(self, sparse: Sequence[np.ndarray]) -> None:
        """Count the values of one block (``S`` array per column; ``b""`` = missing)."""
        if len(sparse) != len(self.names):
            raise ValueError(f"got {len(sparse)} columns for a vocabulary of {len(self.names)}")
        self._kept.clear()
        for c, col in enumerate(sparse):
            col = col[col != b""]
            if len(col) == 0:
                continue
            keys, counts = np.unique(self._as_keys(c, col), return_counts=True)
            self._pending[c].append((keys, counts.astype(np.int64)))
            self._pending_size[c] += len(keys)
            # Merging lazily keeps the cost near O(total log total) instead of a
            # full re-sort of a multi-million-value column for every block.
            if self._pending_size[c] > max(_MIN_MERGE, len(self._keys[c])):
                self._merge(c)

    def _packed(self, c: int) -> bool:
        return self._keys[c].dtype == np.uint64

    def _as_keys(self, c: int, col: np.ndarray) -> np.ndarray:
        """``col`` in column ``c``'s key representation, unpacking the column if needed."""
        if self._packed(c):
            if col.dtype.itemsize <= _PACK_BYTES:
                return pack_keys(col)
            self._merge(c)
            self._keys[c] = unpack_keys(self._keys[c])
            self._kept = {k: v for k, v in self._kept.items() if k[0] != c}
        return col

    def _merge(self, c: int) -> None:
        if not self._pending[c]:
            return
        keys = np.concatenate([self._keys[c]] + [k for k, _ in self._pending[c]])
        counts = np.concatenate([self._counts[c]] + [n for _, n in self._pending[c]])
        uniq, inverse = np.unique(keys, return_inverse=True)
        # float64 sums are exact below 2**53 occurrences
        summed = np.bincount(inverse.reshape(-1), weights=counts, minlength=len(uniq)).astype(
            np.int64
        )
        self._keys[c], self._counts[c] = uniq, summed
        self._pending[c], self._pending_size[c] = [], 0

    def _finish(self) -> None:
        for c in range(len(self.names)):
            self._merge(c)

    def keys(self, column: int) -> np.ndarray:
        """Sorted distinct values of a column (``S`` array)."""
        self._finish()
        keys = self._keys[column]
        return unpack_keys(keys) if self._packed(column) else keys

    def counts(self, column: int) -> np.ndarray:
        """Occurrences of each value of ``keys(column)``."""
        self._finish()
        return self._counts[column]

    def _kept_keys(self, column: int, min_count: int) -> np.ndarray:
        key = (column, min_count)
        if key not in self._kept:
            self._finish()
            keys, counts = self._keys[column], self._counts[column]
            self._kept[key] = keys if min_count <= 1 else keys[counts >= min_count]
        return self._kept[key]

    def cardinalities(self, min_count: int = 1) -> Tuple[int, ...]:
        """Table size per column: kept values plus the OOV and missing ids."""
        return tuple(
            FIRST_VALUE_ID + len(self._kept_keys(c, min_count)) for c in range(len(self.names))
        )

    def encode(self, sparse: Sequence[np.ndarray], min_count: int = 1) -> np.ndarray:
        """Ids ``int64 [n, n_columns]`` of one block."""
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        n = len(sparse[0]) if len(sparse) else 0
        out = np.empty((n, len(sparse)), dtype=np.int64)
        for c, col in enumerate(sparse):
            pos, found = find_keys(self._kept_keys(c, min_count), col)
            ids = np.where(found, pos + FIRST_VALUE_ID, OOV_ID).astype(np.int64)
            ids[col == b""] = MISSING_ID
            out[:, c] = ids
        return out

    def save(self, path: Union[str, Path]) -> None:
        """Write the vocabulary to an ``.npz`` file (no pickling: keys are ``S`` arrays)."""
        self._finish()
        columns = range(len(self.names))
        save_key_columns(path, self.names, [self.keys(c) for c in columns], self._counts)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Vocabulary":
        """Read a vocabulary written by :meth:`save`."""
        names, keys, counts = load_key_columns(path)
        vocab = cls(names)
        for c, (column, seen) in enumerate(zip(keys, counts)):
            vocab._keys[c] = pack_keys(column) if column.dtype.itemsize <= _PACK_BYTES else column
            vocab._counts[c] = seen
        return vocab


def save_key_columns(
    path: Union[str, Path],
    names: Sequence[str],
    keys: Sequence[np.ndarray],
    counts: Sequence[np.ndarray],
) -> None:
    """Per column, its values (``S`` array) and their counts, as an ``.npz`` without
    pickling: ``names``, ``keys_<c>``, ``counts_<c>``."""
    arrays: Dict[str, np.ndarray] = {"names": np.array(list(names), dtype=np.str_)}
    for c, (column, seen) in enumerate(zip(keys, counts)):
        arrays[f"keys_{c}"] = column
        arrays[f"counts_{c}"] = seen
    with open(path, "wb") as f:
        np.savez(f, allow_pickle=False, **arrays)


def load_key_columns(
    path: Union[str, Path],
) -> Tuple[List[str], List[np.ndarray], List[np.ndarray]]:
    """``(names, keys, counts)`` of what :func:`save_key_columns` wrote
    (``allow_pickle=False``; its arrays stored, not compressed, so what they hold is
    bounded by the file's size).

    Raises:
        DataError: a compressed member (which could expand beyond any bound) or a file
            that is not such an archive.
    """
    with open_member(path) as (f, _):  # opened once: the archive checked is the one read
        try:
            with zipfile.ZipFile(f) as archive:
                packed = [
                    i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED
                ]
        except zipfile.BadZipFile as e:
            raise DataError(f"{path}: not a vocabulary archive ({e})", path=path) from None
        if packed:
            raise DataError(
                f"{path}: {packed[0]} is compressed; a vocabulary stores its arrays as they "
                "are (np.savez), so their size is bounded by the file's",
                path=path,
            )
        f.seek(0)
        with np.load(f, allow_pickle=False) as z:
            names = [str(x) for x in z["names"]]
            keys = [z[f"keys_{c}"] for c in range(len(names))]
            counts = [z[f"counts_{c}"].astype(np.int64) for c in range(len(names))]
    return names, keys, counts

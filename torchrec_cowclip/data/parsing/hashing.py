"""Stable hashing of categorical values into fixed-size tables.

Two hashes, both independent of the process (unlike Python's salted ``hash()``):

* ``"hex"``: the value read as a hexadecimal integer, ``int(value, 16)``. Criteo's
  categorical values are 8-hex-digit hashes already, so this keeps TorchRec's own
  convention (its preprocessing stores ``int(value, 16)``). A value that is not hex
  (or has more than 16 digits) is a bad row.
* ``"fnv"``: 64-bit FNV-1a of the value's bytes followed by the splitmix64 finaliser.
  FNV-1a alone mixes the low bits poorly for short strings, and the low bits are
  what ``mod size`` keeps; the finaliser spreads every input bit over all 64.

Encoding into a table of ``size`` rows keeps row 0 for a missing (empty) value, so
missing never collides with a real value: ``id = 1 + h % (size - 1)``.

Example::

    >>> import numpy as np
    >>> enc = HashEncoder(sizes=[1000], method="hex")
    >>> enc.encode([np.array([b"05db9164", b""])]).tolist()  # 1 + int("05db9164", 16) % 999
    [[59], [0]]
    >>> int(fnv1a64(np.array([b"a"]))[0]) == fnv1a64_scalar(b"a")
    True
"""

from __future__ import annotations

from typing import List, Literal, Optional, Sequence, Tuple

import numpy as np

from torchrec_cowclip.data.errors import BAD_HEX
from torchrec_cowclip.data.parsing.fields import byte_matrix, rows_all

HashMethod = Literal["hex", "fnv"]

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)

_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
# The same, with the NUL padding of short ``S`` values marked apart from bad bytes.
_PAD = 16
_HEX_LUT_PAD = _HEX_LUT.copy()
_HEX_LUT_PAD[0] = _PAD


def hex_to_uint64(col: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read ``S`` values as hexadecimal integers.

    Returns:
        ``(values uint64, missing, bad)``: ``missing`` marks empty values, ``bad``
        non-empty values that are not 1..16 hex digits.
    """
    n = len(col)
    if n == 0:
        z = np.zeros(0, dtype=bool)
        return np.zeros(0, dtype=np.uint64), z, z
    col = np.ascontiguousarray(col)
    width = col.dtype.itemsize
    if width in (2, 4, 8, 16):
        fast = _hex_fixed_width(col, width)
        if fast is not None:
            return fast
    b, length = byte_matrix(col)
    nib = _HEX_LUT[b]
    inside = np.arange(width)[None, :] < length[:, None]
    bad = ((nib > 15) & inside).any(axis=1) | (length > 16)
    missing = length == 0
    acc = np.zeros(n, dtype=np.uint64)
    nib64 = nib.astype(np.uint64)
    for j in range(min(width, 16)):
        acc = np.where(inside[:, j], (acc << np.uint64(4)) | (nib64[:, j] & np.uint64(15)), acc)
    return acc, missing, bad


def _hex_fixed_width(
    col: np.ndarray, width: int
) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Fast path when every value is empty or exactly ``width`` hex digits (Criteo: 8).

    Pairs of nibbles are packed into bytes and the bytes read as one big-endian
    integer, instead of a loop over digit positions. None if the column does not
    qualify, and the general path takes over.
    """
    b = col.view(np.uint8).reshape(len(col), width)
    nib = _HEX_LUT_PAD[b]
    missing = nib[:, 0] == _PAD
    is_digit = nib <= 15
    if missing.any():
        ok = np.where(missing, rows_all(nib == _PAD), rows_all(is_digit))
    else:
        ok = rows_all(is_digit)
    if not ok.all():
        return None
    packed = (nib[:, 0::2] << 4) | (nib[:, 1::2] & 15)
    values = packed.view(f">u{width // 2}").reshape(len(col)).astype(np.uint64)
    values[missing] = 0
    return values, missing, np.zeros(len(col), dtype=bool)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def fnv1a64(col: np.ndarray) -> np.ndarray:
    """64-bit FNV-1a of each ``S`` value, finalised with splitmix64 (uint64).

    Equal to the scalar definition: ``h = 0xcbf29ce484222325; for byte: h = (h ^ byte)
    * 0x100000001b3 mod 2**64``, then splitmix64's finaliser.
    """
    n = len(col)
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    if n == 0:
        return h
    b, length = byte_matrix(col)
    b64 = b.astype(np.uint64)
    for j in range(b.shape[1]):
        h = np.where(j < length, (h ^ b64[:, j]) * _FNV_PRIME, h)
    return _splitmix64(h)


def fnv1a64_scalar(value: bytes) -> int:
    """The same hash for one value, in plain Python (a reference for tests and tools)."""
    h = 0xCBF29CE484222325
    for byte in value:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return h ^ (h >> 31)


class HashEncoder:
    """Encode each categorical column by hashing into its own table size.

    Args:
        sizes: table size per sparse column (>= 2: row 0 is kept for "missing").
        method: ``"hex"`` or ``"fnv"`` (see the module docstring).
        names: column names, for error messages.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        method: HashMethod = "fnv",
        names: Optional[Sequence[str]] = None,
    ) -> None:
        if method not in ("hex", "fnv"):
            raise ValueError(f"hash method must be 'hex' or 'fnv', got {method!r}")
        self.sizes: Tuple[int, ...] = tuple(int(s) for s in sizes)
        if any(s < 2 for s in self.sizes):
            raise ValueError(
                f"hash sizes must be >= 2 (row 0 is kept for missing values), got {self.sizes}"
            )
        self.method: HashMethod = method
        self.names = (
            list(names) if names is not None else [f"sparse[{i}]" for i in range(len(self.sizes))]
        )
        # check() and encode() usually see the same block back to back; decoding hex
        # once saves a third of the parsing time.
        self._memo: Optional[
            Tuple[List[np.ndarray], List[Tuple[np.ndarray, np.ndarray, np.ndarray]]]
        ] = None

    def _hex(self, sparse: List[np.ndarray]) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        if self._memo is not None and self._memo[0] is sparse:
            return self._memo[1]
        decoded = [hex_to_uint64(col) for col in sparse]
        self._memo = (sparse, decoded)
        return decoded

    @property
    def cardinalities(self) -> Tuple[int, ...]:
        return self.sizes

    def check(self, sparse: List[np.ndarray]) -> Optional[Tuple[np.ndarray, str, List[str]]]:
        """Rows whose values cannot be hashed (non-hex under ``"hex"``), or None if all can.

        Returns ``(bad_mask, reason, details)`` with one detail string per bad row.
        """
        if self.method != "hex" or not sparse:
            return None
        bads = [d[2] for d in self._hex(sparse)]
        any_bad = np.logical_or.reduce(bads)
        if not any_bad.any():
            return None
        details = []
        for i in np.flatnonzero(any_bad).tolist():
            c = next(k for k, bad in enumerate(bads) if bad[i])
            details.append(
                f"{self.names[c]}={sparse[c][i].decode('utf-8', 'replace')!r} is not hex"
            )
        return any_bad, BAD_HEX, details

    def encode(self, sparse: List[np.ndarray]) -> np.ndarray:
        """Ids ``int64 [n, n_sparse]``, each in ``[0, size)``."""
        n = len(sparse[0]) if sparse else 0
        out = np.empty((n, len(sparse)), dtype=np.int64)
        decoded = self._hex(sparse) if self.method == "hex" else None
        for c, (col, size) in enumerate(zip(sparse, self.sizes)):
            if decoded is not None:
                h, missing, _ = decoded[c]
            else:
                h = fnv1a64(col)
                missing = col == b""
            ids = (h % np.uint64(size - 1)).astype(np.int64) + 1
            ids[missing] = 0
            out[:, c] = ids
        self._memo = None
        return out

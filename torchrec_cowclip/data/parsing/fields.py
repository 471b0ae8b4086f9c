"""Vectorised decoding of text fields (numpy ``S`` arrays) into labels and dense values.

The parsers hand over each column as a fixed-width byte-string array (``b""`` =
empty field). Criteo's dense columns are small integers, so the common case is
decoded with integer arithmetic on the bytes; anything else (``"260.0"``,
``"1e3"``) falls back to Python's ``float`` on the distinct values only.

A number is decimal text, the one rule of every reader (files and in-memory columns):
an optional sign, digits with an optional fraction (or a fraction alone), an optional
exponent, surrounding spaces allowed. Python's ``float`` also takes ``1_000``,
``infinity`` and ``nan``; those are refused here, as ``0x10`` is (pandas reads none of
them as a number either).

Example::

    >>> import numpy as np
    >>> values, bad = parse_numeric(np.array([b"12", b"", b"-3", b"2.5", b"x"]))
    >>> values[[0, 2, 3]].tolist(), bool(np.isnan(values[1])), bad.tolist()
    ([12.0, -3.0, 2.5], True, [False, False, False, False, True])
    >>> parse_numeric(np.array([b" 1e3", b"1_000", b"0x10", b"inf"]))[1].tolist()
    [False, True, True, True]
"""

from __future__ import annotations

import re
from typing import Tuple, cast

import numpy as np

_MAX_INT_DIGITS = 18  # 10**18 < 2**63: the integer fast path cannot overflow int64
# Decimal text (see the module docstring); float() decides the value.
_DECIMAL = re.compile(rb"[ \t]*[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[ \t]*")


def byte_matrix(col: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(bytes [n, W] uint8, lengths [n])`` of an ``S{W}`` array, without copying.

    Lengths count the non-NUL bytes: numpy pads ``S`` values with NULs, and text
    fields never contain one (a stray NUL makes the value invalid wherever it matters).
    """
    col = np.ascontiguousarray(col)
    width = col.dtype.itemsize
    b = col.view(np.uint8).reshape(len(col), width)
    return b, np.count_nonzero(b, axis=1)


def rows_all(mask: np.ndarray) -> np.ndarray:
    """``mask.all(axis=1)`` for a C-contiguous bool matrix, fast for short rows.

    numpy reduces short rows one at a time; reading each row's bytes as one integer
    (rows padded to 8 bytes) tests a whole row with a single comparison.
    """
    n, width = mask.shape
    if width == 0:
        return np.ones(n, dtype=bool)
    if width > 8:
        # numpy's stubs type a reduction along an axis as a scalar or an array: here, an array.
        return cast(np.ndarray, mask.all(axis=1))
    if width != 8:
        padded = np.ones((n, 8), dtype=bool)
        padded[:, :width] = mask
        mask = padded
    rows = np.ascontiguousarray(mask).view(np.uint64).reshape(n)
    all_true: np.ndarray = rows == np.uint64(0x0101010101010101)
    return all_true


def parse_numeric(col: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Decode decimal text to float64.

    Args:
        col: ``S`` array of fields.

    Returns:
        ``(values, bad)``: ``values`` is float64 with NaN where the field is empty;
        ``bad`` marks non-empty fields that are not a finite number.
    """
    n = len(col)
    values = np.full(n, np.nan)
    bad = np.zeros(n, dtype=bool)
    if n == 0:
        return values, bad
    b, length = byte_matrix(col)
    width = b.shape[1]
    missing = length == 0
    digit = b - np.uint8(48)  # wraps for non-digits, so ``< 10`` tests "is a digit"
    is_digit = digit < 10
    signed = (b[:, 0] == 45) | (b[:, 0] == 43)  # '-' or '+'
    pos = np.arange(width)
    inside = pos[None, :] < length[:, None]
    ok_char = is_digit | ~inside
    ok_char[:, 0] |= signed
    is_int = rows_all(ok_char) & (length > signed) & (length <= _MAX_INT_DIGITS + signed)
    if is_int.any():
        acc = np.zeros(n, dtype=np.int64)
        d64 = digit.astype(np.int64)
        for j in range(min(width, _MAX_INT_DIGITS + 1)):
            take = inside[:, j] & is_digit[:, j]
            acc = np.where(take, acc * 10 + d64[:, j], acc)
        acc = np.where(b[:, 0] == 45, -acc, acc)
        values[is_int] = acc[is_int]
    rest = ~is_int & ~missing
    if rest.any():
        idx = np.flatnonzero(rest)
        uniq, inverse = np.unique(col[idx], return_inverse=True)
        parsed = np.empty(len(uniq))
        for k, raw in enumerate(uniq.tolist()):
            parsed[k] = float(raw) if _DECIMAL.fullmatch(raw) else np.nan
        vals = parsed[inverse.reshape(-1)]
        values[idx] = vals
        bad[idx] = ~np.isfinite(vals)
    return values, bad


def check_labels(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The one label rule of every source: a label is exactly 0 or 1.

    Args:
        values: numeric labels (NaN for a missing or non-numeric field).

    Returns:
        ``(labels float32, bad)``; a bad label reads 0 in ``labels``.

    Example::

        >>> labels, bad = check_labels(np.array([1.0, 0.0, 2.0, np.nan]))
        >>> labels.tolist(), bad.tolist()
        ([1.0, 0.0, 0.0, 0.0], [False, False, True, True])
    """
    v = np.asarray(values, dtype=np.float64)
    bad = ~((v == 0.0) | (v == 1.0))
    return np.where(bad, 0.0, v).astype(np.float32), bad


def parse_labels(col: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Decode a text label column (``"0"``, ``"1"``, ``"1.0"``...) by :func:`check_labels`.

    Returns:
        ``(labels float32, bad)``.
    """
    one = col == b"1"
    labels = one.astype(np.float32)
    bad = ~(one | (col == b"0"))
    if bad.any():
        # The common "0"/"1" fields skip the general parser; the rest go through it.
        values, _ = parse_numeric(col[bad])
        labels[bad], bad[bad] = check_labels(values)
    return labels, bad

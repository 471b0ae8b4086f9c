"""Append-only ``.npy`` writer for arrays whose length is known only at the end.

Streaming parsers do not know how many rows survive until they finish, and counting
lines first would mean reading a 45M-row (or gzip) file twice. The writer reserves a
fixed 128-byte header (the ``.npy`` v1.0 format allows any header length; 128 keeps
the data 64-byte aligned), appends rows, and rewrites the header with the final
shape on close. The result is a standard ``.npy`` file that ``np.load(mmap_mode="r")``
opens.

Example::

    >>> import tempfile, os
    >>> import numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "a.npy")
    >>> with NpyAppender(path, np.float32, (2,)) as w:
    ...     w.append(np.ones((3, 2), np.float32)); w.append(np.zeros((1, 2), np.float32))
    >>> np.load(path, mmap_mode="r").shape
    (4, 2)
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import TracebackType
from typing import Optional, Tuple, Type, Union

import numpy as np
from numpy.typing import DTypeLike

_MAGIC = b"\x93NUMPY\x01\x00"
_HEADER_BYTES = 128


def _header(dtype: np.dtype, shape: Tuple[int, ...]) -> bytes:
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (
        np.lib.format.dtype_to_descr(dtype),
        shape,
    )
    room = _HEADER_BYTES - len(_MAGIC) - 2
    body = text.encode("latin1")
    if len(body) + 1 > room:
        raise ValueError(f"shape {shape} does not fit a {_HEADER_BYTES}-byte .npy header")
    body = body + b" " * (room - len(body) - 1) + b"\n"
    return _MAGIC + struct.pack("<H", room) + body


class NpyAppender:
    """Write rows of shape ``row_shape`` to ``path`` as a growing ``.npy`` array.

    Args:
        path: output file.
        dtype: element type; appended arrays are cast to it.
        row_shape: shape of one row, e.g. ``(13,)`` or ``()`` for a vector.
    """

    def __init__(self, path: Union[str, Path], dtype: DTypeLike, row_shape: Tuple[int, ...]) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(int(x) for x in row_shape)
        self.rows = 0
        self._f = open(self.path, "wb")
        self._f.write(_header(self.dtype, (0, *self.row_shape)))

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path}: rows of shape {rows.shape[1:]}, expected {self.row_shape}")
        self._f.write(rows.tobytes())
        self.rows += rows.shape[0]

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.seek(0)
        self._f.write(_header(self.dtype, (self.rows, *self.row_shape)))
        self._f.close()

    def __enter__(self) -> "NpyAppender":
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()

"""Append-only ``.npy`` writer for arrays whose length is known only at the end.

Streaming parsers do not know how many rows survive until they finish, and counting
lines first would mean reading a 45M-row (or gzip) file twice. The writer reserves a
fixed 128-byte header (the ``.npy`` v1.0 format allows any header length; 128 keeps
the data 64-byte aligned), appends rows, and rewrites the header with the final
shape on close. The result is a standard ``.npy`` file that ``np.load(mmap_mode="r")``
opens.

The writer also checksums the data bytes (everything after the header) as it writes
them, so the cache can record a checksum without reading its arrays back
(:meth:`NpyAppender.record`; ``readback.check_file`` compares a file with it).

Example::

    >>> import tempfile, os
    >>> import numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "a.npy")
    >>> with NpyAppender(path, np.float32, (2,)) as w:
    ...     w.append(np.ones((3, 2), np.float32)); w.append(np.zeros((1, 2), np.float32))
    >>> np.load(path, mmap_mode="r").shape
    (4, 2)
    >>> w.record()["shape"], w.record()["bytes"], w.record()["data_offset"]
    ([4, 2], 160, 128)
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from types import TracebackType
from typing import Any, Dict, Optional, Tuple, Type, TypeVar, Union

import numpy as np
from numpy.typing import DTypeLike

from torchrec_cowclip.readback import CRC32

T = TypeVar("T", bound="Closing")
_MAGIC = b"\x93NUMPY\x01\x00"
_HEADER_BYTES = 128
# CRC-32 (zlib): corruption detection, not an adversary's; faster than blake2b here
# (docs/performance.md, "Cache verification").
CHECKSUM = CRC32


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


class Closing:
    """A ``with`` block closes it: the base of the writers, which must always finish
    their files (the header of an ``.npy`` file is written last)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: T) -> T:
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()


class NpyAppender(Closing):
    """Write rows of shape ``row_shape`` to ``path`` as a growing ``.npy`` array.

    Args:
        path: output file.
        dtype: element type; appended arrays are cast to it.
        row_shape: shape of one row, e.g. ``(13,)`` or ``()`` for a vector.
    """

    def __init__(
        self, path: Union[str, Path], dtype: DTypeLike, row_shape: Tuple[int, ...]
    ) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(int(x) for x in row_shape)
        self.rows = 0
        self._crc = 0
        self._f = open(self.path, "wb")
        self._f.write(_header(self.dtype, (0, *self.row_shape)))

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.row_shape:
            raise ValueError(
                f"{self.path}: rows of shape {rows.shape[1:]}, expected {self.row_shape}"
            )
        data = rows.reshape(-1).data.cast("B")
        self._crc = zlib.crc32(data, self._crc)
        self._f.write(data)
        self.rows += rows.shape[0]

    def record(self) -> Dict[str, Any]:
        """Shape, dtype, file size, where the data starts and the data's checksum."""
        return {
            "shape": [self.rows, *self.row_shape],
            "dtype": self.dtype.str,
            "bytes": _HEADER_BYTES + self.rows * int(np.prod(self.row_shape)) * self.dtype.itemsize,
            "data_offset": _HEADER_BYTES,
            CHECKSUM: f"{self._crc:08x}",
        }

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.seek(0)
        self._f.write(_header(self.dtype, (self.rows, *self.row_shape)))
        self._f.close()

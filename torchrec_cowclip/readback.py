"""Reading back the files the project wrote (run folders, checkpoints, caches, sweeps):
one way to open one, one JSON reader, and one check of a file against its record.

Such files travel and can be crafted, so each is opened once, by
:func:`open_member`: ``O_NOFOLLOW`` (a link is refused, not followed), ``O_NONBLOCK``
(a FIFO or a device swapped in cannot block the open), and the open descriptor's own
``fstat`` decides (a plain file, or a refusal); what is read comes from that
descriptor, never from the name again, so nothing can be swapped in between a check
and a read.

:func:`read_json` reads a JSON object through it, within stated bounds: at most
``limit`` bytes (:data:`MAX_JSON_BYTES` unless told), nested at most
:data:`MAX_JSON_DEPTH` deep, each key once in its object (a second ``"version"`` is a
forgery, not a correction), every string encodable as UTF-8 (no lone surrogate, which
no file name or option can hold). Anything else is refused by
:class:`RefusedFileError`, one line naming the file and the reason.

:func:`check_file` compares a file, opened once the same way, with the record the
project wrote of it (:func:`file_record`, or an ``.npy`` writer's own record): its size,
an ``.npy`` header's shape and dtype, and its digest (:data:`CRC32` or :data:`SHA256`);
it says why the file differs, or None.

Example::

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "manifest.json")
    >>> with open(path, "w") as f:
    ...     _ = f.write('{"version": 99, "version": 2}')
    >>> read_json(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    torchrec_cowclip.readback.RefusedFileError: .../manifest.json: refused: the key 'version' appears twice in one object (a file this project writes names each key once)
    >>> os.mkfifo(path + ".fifo")
    >>> read_json(path + ".fifo")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    torchrec_cowclip.readback.RefusedFileError: .../manifest.json.fifo: refused: not a regular file (a directory, device, FIFO or socket)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, List, Mapping, Optional, Set, Tuple, Union

import numpy as np

from torchrec_cowclip.failures import ConfigError

#: The most bytes :func:`read_json` reads unless told (a description, a record).
MAX_JSON_BYTES = 64 << 20
#: How deep :func:`read_json` lets arrays and objects nest (the project writes at most 6).
MAX_JSON_DEPTH = 64

#: The digests a file's record names: CRC-32 (the cache's and the checkpoints' own files,
#: against accidents) or SHA-256 (files that travel: run folders; the sources a cache key
#: names).
CRC32 = "crc32"
SHA256 = "sha256"
_READ_BYTES = 8 << 20

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)

__all__ = [
    "CRC32",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "RefusedFileError",
    "SHA256",
    "check_file",
    "file_record",
    "open_member",
    "parse_json",
    "read_bytes",
    "read_json",
    "sha256_of",
]


class RefusedFileError(ConfigError):
    """A file the project reads back that is not what it writes (a link, a FIFO, too
    large, not the JSON it writes); the message names the file and the reason."""


def _refuse(path: Union[str, Path], why: str) -> RefusedFileError:
    return RefusedFileError(f"{path}: refused: {why}")


def _first_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


@contextmanager
def open_member(path: Union[str, Path]) -> Iterator[Tuple[BinaryIO, os.stat_result]]:
    """``(file, its fstat)`` of ``path`` opened once for reading, as the module
    docstring says; closed when the block ends.

    Raises:
        FileNotFoundError: it does not exist (callers say what that means).
        RefusedFileError: a symbolic link, not a regular file, a name that cannot be
            encoded, or unreadable (the reason named).
    """
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise
    except UnicodeEncodeError:
        raise _refuse(repr(str(path)), "a name that cannot be encoded as a file name") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link, not a file") from None
        raise _refuse(path, f"unreadable ({_first_line(e)})") from None
    f = os.fdopen(fd, "rb")
    f.raw.name = str(path)  # type: ignore[attr-defined]  # errors name the file, not the fd
    with f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "not a regular file (a directory, device, FIFO or socket)")
        os.set_blocking(fd, True)
        yield f, st


def read_bytes(path: Union[str, Path], limit: int) -> bytes:
    """The bytes of ``path`` (opened by :func:`open_member`), refused beyond ``limit``.

    Raises:
        FileNotFoundError, RefusedFileError: as :func:`open_member`; or larger than
            ``limit`` bytes.
    """
    with open_member(path) as (f, st):
        if st.st_size > limit:
            raise _refuse(path, f"{st.st_size} bytes, more than the {limit} such a file may have")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise _refuse(path, f"unreadable ({_first_line(e)})") from None
    if len(data) > limit:  # grew since the fstat
        raise _refuse(path, f"more than the {limit} bytes such a file may have")
    return data


class _DuplicateKey(ValueError):
    pass


def _pairs(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # a key twice: name the first repeated one
        seen: Set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


def _checked(value: Any, depth: int) -> None:
    """Refuses (ValueError) nesting beyond :data:`MAX_JSON_DEPTH` and strings that do
    not encode as UTF-8."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} deep")
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, dict):
        for key, item in value.items():
            key.encode("utf-8")
            _checked(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _checked(item, depth + 1)


def parse_json(path: Union[str, Path], text: Union[str, bytes]) -> Any:
    """The JSON value of ``text`` (read from ``path``, which refusals name): nested at
    most :data:`MAX_JSON_DEPTH` deep, each key once per object, every string encodable.

    Raises:
        RefusedFileError: anything else, in one line.
    """
    try:
        value = json.loads(
            text.decode("utf-8") if isinstance(text, bytes) else text, object_pairs_hook=_pairs
        )
        _checked(value, 1)
    except _DuplicateKey as e:
        raise _refuse(
            path,
            f"the key {e.args[0]!r} appears twice in one object (a file this project "
            "writes names each key once)",
        ) from None
    except RecursionError:
        raise _refuse(path, f"JSON nested more than {MAX_JSON_DEPTH} deep") from None
    except UnicodeError as e:
        raise _refuse(
            path, f"text that is not UTF-8 or a string no file can hold ({getattr(e, 'reason', e)})"
        ) from None
    except ValueError as e:
        raise _refuse(path, f"not JSON ({_first_line(e)})") from None
    return value


def read_json(path: Union[str, Path], limit: int = MAX_JSON_BYTES) -> Dict[str, Any]:
    """The JSON object in ``path``, read as the module docstring says.

    Raises:
        FileNotFoundError: it does not exist.
        RefusedFileError: anything else it cannot be, in one line.
    """
    value = parse_json(path, read_bytes(path, limit))
    if not isinstance(value, dict):
        raise _refuse(path, f"not a JSON object (a {type(value).__name__})")
    return value


def _digest_read(kind: str, f: BinaryIO, offset: int = 0) -> Tuple[int, str]:
    """``(bytes read, digest)`` of the open file ``f`` from ``offset`` on, streamed in
    8 MiB reads (memory stays flat; hashlib releases the GIL on large buffers): CRC-32
    (the cache's and the checkpoints' own files, against accidents) or SHA-256 (files
    that travel: run folders; the sources a cache key names). Its cost:
    docs/performance.md, "Source digests"."""
    h = hashlib.sha256() if kind == SHA256 else None
    crc, size = 0, 0
    f.seek(offset)
    while chunk := f.read(_READ_BYTES):
        if h is None:
            crc = zlib.crc32(chunk, crc)
        else:
            h.update(chunk)
        size += len(chunk)
    return size, f"{crc:08x}" if h is None else h.hexdigest()


def sha256_of(path: Union[str, Path], offset: int = 0) -> Tuple[int, str]:
    """``(bytes read, SHA-256 hex digest)`` of ``path`` from ``offset`` on."""
    with open(path, "rb") as f:
        return _digest_read(SHA256, f, offset)


def file_record(path: Path, digest: str = CRC32) -> Dict[str, Any]:
    """Size and digest (``"crc32"`` or ``"sha256"``) of a file written without a
    checksum of its own (e.g. ``.npz``)."""
    with open_member(path) as (f, _):
        size, value = _digest_read(digest, f)
    return {"bytes": size, digest: value}


def check_file(path: Path, record: Mapping[str, Any], checksum: bool = True) -> Optional[str]:
    """Why ``path`` is not the file ``record`` describes, or None if it is.

    The size (and for an ``.npy`` record the header's shape and dtype: a 128-byte
    read) is always compared; ``checksum=True`` also reads the bytes and compares
    their digest (the record's SHA-256 if it has one, else its CRC-32).
    """
    try:
        with open_member(path) as (f, st):
            return _file_differs(f, st, record, checksum)
    except FileNotFoundError:
        return "missing"
    except RefusedFileError as e:  # a link, a device or a FIFO (which never ends a read)
        return str(e).partition(": refused: ")[2]


def _file_differs(
    f: BinaryIO, st: os.stat_result, record: Mapping[str, Any], checksum: bool
) -> Optional[str]:
    """:func:`check_file` on the file it opened."""
    size = st.st_size
    if size != record["bytes"]:
        return f"size {size} bytes, expected {record['bytes']}"
    if "shape" in record:
        try:
            np.lib.format.read_magic(f)
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        except ValueError as e:
            return f"unreadable header ({e})"
        if list(shape) != list(record["shape"]) or dtype.str != record["dtype"]:
            return (
                f"header says {dtype.str}{list(shape)}, expected {record['dtype']}{record['shape']}"
            )
    if checksum:
        digest = SHA256 if SHA256 in record else CRC32
        if _digest_read(digest, f, record.get("data_offset", 0))[1] != record[digest]:
            return "checksum mismatch"
    return None

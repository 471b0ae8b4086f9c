"""Reading back the files the project wrote (run folders, checkpoints, caches, sweeps):
one way to open one, and one JSON reader.

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
import json
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, List, Set, Tuple, Union

from torchrec_cowclip.failures import ConfigError

#: The most bytes :func:`read_json` reads unless told (a description, a record).
MAX_JSON_BYTES = 64 << 20
#: How deep :func:`read_json` lets arrays and objects nest (the project writes at most 6).
MAX_JSON_DEPTH = 64

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "RefusedFileError",
    "open_member",
    "parse_json",
    "read_bytes",
    "read_json",
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

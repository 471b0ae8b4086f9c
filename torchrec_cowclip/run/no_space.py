"""A write that fails for want of space, said in one line: ``no space left on device: PATH``.

A full disk does not always say so. ``open``, ``write`` and ``close`` raise
``OSError(ENOSPC)`` (``EDQUOT`` past a quota), but torch's zip writer (``torch.save``,
under DCP and ``torch.export.save``) sees a short write and raises ``RuntimeError: ...
unexpected pos 704 vs 598``, and DCP wraps each rank's error in a
``CheckpointException``. :func:`no_space` looks through all of them: an ``ENOSPC`` or
``EDQUOT`` anywhere in the error's chain, or an error without an errno while the file
system that was written holds less than :data:`NEARLY_FULL_BYTES` (a short write fills a
disk to its last block, so what is left then is less than that).

Every writer of a run (the model folder, checkpoints, ``metrics.json`` and the logs, a
sweep's ``cell.json``, predict's scores, export's files) turns such a failure into
:class:`NoSpaceError` naming what it was writing, after removing its partial output;
the command line exits 4 with that line, and the same command works once space is freed.

Example::

    >>> import errno
    >>> error = OSError(errno.ENOSPC, "No space left on device")
    >>> str(no_space(error, "runs/x/model"))
    'no space left on device: runs/x/model'
    >>> no_space(OSError(errno.EACCES, "Permission denied"), "runs/x") is None
    True
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Union

#: The errnos of a write refused for want of space (a full disk, an exhausted quota).
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: A file system with less free space than this, right after a write failed without an
#: errno, is taken to have been full.
NEARLY_FULL_BYTES = 1 << 20


class NoSpaceError(OSError):
    """A write failed for want of space; ``filename`` is what was being written."""

    def __init__(self, path: Union[str, Path]) -> None:
        super().__init__(errno.ENOSPC, "no space left on device", str(path))

    def __str__(self) -> str:
        return f"no space left on device: {self.filename}"


def one_line(error: BaseException) -> str:
    """An OS error as ``reason: path`` (a :class:`NoSpaceError` reads ``no space left on
    device: PATH``); others as their message's first line."""
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{where}"
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def _chain(error: BaseException) -> List[BaseException]:
    """``error``, its causes and contexts, and the per-rank errors a DCP
    ``CheckpointException`` carries (``failures``: rank -> (error, traceback))."""
    found: List[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if e in found:
            continue
        found.append(e)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                inner = value[0] if isinstance(value, tuple) else value
                if isinstance(inner, BaseException):
                    todo.append(inner)
    return found


def free_bytes(path: Union[str, Path]) -> Optional[int]:
    """The bytes an unprivileged write may still use on the file system of ``path`` (or
    of its nearest existing parent); None if that cannot be told."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def no_space(error: BaseException, path: Union[str, Path]) -> Optional[NoSpaceError]:
    """The :class:`NoSpaceError` naming ``path`` if ``error`` (raised while writing
    ``path``) comes from a lack of space, else None (see the module docstring).

    Call it before removing the partial output: that frees the space it used.
    """
    chain = _chain(error)
    if any(isinstance(e, OSError) and e.errno in SPACE_ERRNOS for e in chain):
        return NoSpaceError(path)
    if any(isinstance(e, OSError) and e.errno is not None for e in chain):
        return None  # the OS said why, and it is not space
    free = free_bytes(path)
    return NoSpaceError(path) if free is not None and free < NEARLY_FULL_BYTES else None


@contextlib.contextmanager
def space_checked(
    path: Union[str, Path], cleanup: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Inside the block, a failed write (an ``OSError``, torch's ``RuntimeError``, DCP's
    ``CheckpointException``) runs ``cleanup()`` (which removes the partial output) and,
    if it came from a lack of space, becomes :class:`NoSpaceError` naming ``path``;
    any other error is raised as it was."""
    try:
        yield
    except BaseException as e:
        written = isinstance(e, (OSError, RuntimeError)) or hasattr(e, "failures")
        full = no_space(e, path) if written and not isinstance(e, NoSpaceError) else None
        with contextlib.suppress(OSError):  # the error in hand says more than this one
            cleanup()
        if full is not None:
            raise full from None
        raise

"""The package's log on stderr while a command runs (:func:`package_log_shown`): what
converting data is doing and its notes (rows skipped, values clipped or set to 0) from
rank 0, errors from every rank."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, a redirect):
    logging assigns ``stream``, which here is always the current stderr."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _Lines(logging.Formatter):
    """A record as its message, a warning or worse marked as such."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


_HANDLER = _Stderr()
_HANDLER.setFormatter(_Lines("%(message)s"))


@contextlib.contextmanager
def package_log_shown(rank: int) -> Iterator[None]:
    """The package's log on stderr while the command runs, INFO from rank 0 and ERROR from
    the others. Its records do not also reach the root logger's handlers meanwhile (one
    that an imported library configured would print each twice); the logger is restored
    after."""
    logger = logging.getLogger("torchrec_cowclip")
    saved = logger.level, logger.propagate
    logger.addHandler(_HANDLER)
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(_HANDLER)
        logger.level, logger.propagate = saved

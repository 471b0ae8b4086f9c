"""Stopping a run cleanly on SIGTERM (a preemption) or SIGINT (Ctrl-C).

While the trainer runs, :class:`StopRequest` replaces both handlers: the first signal
only records that a stop was asked for (one line on stderr), so the step in flight -
its fused update included - completes; the trainer then writes a checkpoint, releases
the ``--out`` lock and ends with :class:`RunStopped`, which the command line turns into
exit status :data:`EXIT_STOPPED` (75, ``EX_TEMPFAIL``: try again later, with
``--resume``). A second signal restores the previous handler and re-delivers itself, so
an impatient Ctrl-C still stops at once (the last checkpoint stays).

In a multi-process run every rank must stop after the same step; the trainer agrees on
it with one small all-reduce per step (see ``Runtime.step_summary``).

Example::

    >>> import os, signal
    >>> stop = StopRequest(say=print)
    >>> with stop.installed():
    ...     os.kill(os.getpid(), signal.SIGTERM)
    ...     stop.requested
    received SIGTERM: finishing the current step, then writing a checkpoint (signal again to stop at once)
    'SIGTERM'
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, Dict, Iterator, Optional

from torchrec_cowclip.failures import EXIT_STOPPED

__all__ = ["EXIT_STOPPED", "RunStopped", "StopRequest", "raising_on_sigterm"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(Exception):
    """The run stopped on a signal after writing a checkpoint; ``--resume`` continues."""

    exit_status = EXIT_STOPPED


@contextlib.contextmanager
def raising_on_sigterm(what: str) -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`RunStopped` (``stopped by SIGTERM:
    what``) where the program is, so that every writer's clean-up runs (a temporary is
    removed, nothing half-written stays) and the command exits 75 in one line, as a
    stopped training run does. For commands without a step to finish (predict,
    evaluate, export); the main thread only (elsewhere the block runs unchanged).

    Example::

        >>> import os, signal
        >>> with raising_on_sigterm("nothing was written"):
        ...     try:
        ...         os.kill(os.getpid(), signal.SIGTERM)
        ...     except RunStopped as e:
        ...         print(e)
        stopped by SIGTERM: nothing was written
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Optional[FrameType]) -> None:
        raise RunStopped(f"stopped by SIGTERM: {what}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StopRequest:
    """Records SIGTERM/SIGINT while :meth:`installed` is active.

    Args:
        say: where the one-line notice goes (stderr; ranks other than 0 pass a no-op).
    """

    def __init__(self, say: Callable[[str], None] = _say) -> None:
        self.requested: Optional[str] = None
        self._say = say
        self._previous: Dict[int, Any] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:  # the second one: stop now, the old way
            self._restore()
            signal.raise_signal(signum)
            return
        self.requested = name
        self._say(
            f"received {name}: finishing the current step, then writing a checkpoint "
            "(signal again to stop at once)"
        )

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """Handles the signals inside the block (only in the main thread, where Python
        delivers them; elsewhere the block runs with the handlers unchanged)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._previous = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        try:
            yield self
        finally:
            self._restore()

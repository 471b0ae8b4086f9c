"""One run per ``--out``: an exclusive lock for the run's life, refusal of a directory
that holds another run, ``--overwrite``, ``--resume auto``, and removal of what a killed
run left half-done.

The lock is ``fcntl.flock`` on ``<out>/.lock``, which holds the holder's pid. flock
belongs to the open file, so a process that dies (even by SIGKILL) frees it; a lock file
left behind by a dead run is simply taken over. A clean exit removes the file, while
still holding the lock, so that a process waiting on the old file notices (the inode
check in :meth:`RunDirLock.acquire`) instead of locking a file nobody else sees.

Example::

    >>> out = Path("runs/x")
    >>> lock = claim_run_dir(out, False, False, checkpoints=CheckpointStore(out / CHECKPOINTS_DIR))
    >>> (Path("runs/x") / LOCK_NAME).read_text() == str(os.getpid())
    True
    >>> lock.release()
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Union

from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.process_context import ONE_PROCESS, ProcessContext
from torchrec_cowclip.run.checkpoints import CHECKPOINTS_DIR, CheckpointStore

LOCK_NAME = ".lock"

# What a training run writes into --out (train/: checkpoints and metrics.json;
# log.py: the CSVs and TensorBoard's tb/; curves.py: curves.png; model_folder.py: model/).
# Only these, and their temporary forms (see stale_temp_files), are ever deleted; anything
# else in --out is left alone.
RUN_FILES = ("checkpoints", "metrics.json", "steps.csv", "epochs.csv", "tb", "curves.png", "model")


class RunDirError(ConfigError):
    """``--out`` is in use by another process, or holds another run's files."""


#: Where a run given no ``--out`` goes.
DEFAULT_RUNS_ROOT = Path("runs")


def new_run_dir(root: Path = DEFAULT_RUNS_ROOT, process: ProcessContext = ONE_PROCESS) -> Path:
    """The directory of a run given no ``--out``: a new ``root/<YYYYmmdd-HHMMSS>`` (then
    ``-2``, ``-3``, ... in the same second), created here so that two runs never share
    one; under torchrun (``process``) ``root/torchrun-<run id>``, the same for every rank and restart of
    the job (rank 0 creates it), so ``--resume auto`` finds it again.

    Example::

        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> a, b = new_run_dir(root), new_run_dir(root)
        >>> a != b and a.is_dir() and b.is_dir()
        True
    """
    if process.run_id:
        return root / f"torchrun-{process.run_id}"
    if process.is_distributed:  # TrainConfig.validate() refused this
        raise RunDirError("several processes share one run directory: give --out")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    for k in itertools.count(1):
        path = root / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _unlock(fd: int, path: str, inode: int) -> None:
    # Unlink first (only our own file), then close: closing drops the lock.
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


class RunDirLock:
    """An exclusive hold on a run directory; released by :meth:`release`, when garbage
    collected, at interpreter exit, or by the OS when the process dies."""

    def __init__(self, path: Optional[Path], fd: int = -1, inode: int = 0) -> None:
        self.path = path
        self._finalizer = (
            weakref.finalize(self, _unlock, fd, str(path), inode) if path is not None else None
        )

    @classmethod
    def acquire(cls, out: Path) -> "RunDirLock":
        """Takes the lock of ``out`` (which must exist) at once or raises
        :class:`RunDirError` naming the holder's pid."""
        path = out / LOCK_NAME
        return cls.acquire_file(
            path,
            lambda holder: f"--out {out} is in use by another run (pid {holder}, holding "
            f"{path}): wait for it, stop it, or choose another --out",
        )

    @classmethod
    def acquire_file(cls, path: Path, busy: Callable[[str], str]) -> "RunDirLock":
        """Takes the lock file ``path`` (created if absent) at once, or raises
        :class:`RunDirError` with ``busy(holder's pid)``."""
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RunDirError(busy(holder)) from None
            inode = os.fstat(fd).st_ino
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = -1
            if current == inode:
                break
            os.close(fd)  # the holder removed this file as we locked it: take the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return cls(path, fd, inode)

    @classmethod
    def not_held(cls) -> "RunDirLock":
        """A stand-in for processes that do not own the directory (ranks other than 0)."""
        return cls(None)

    def release(self) -> None:
        """Removes the lock file and frees the lock (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()


def lock_holder(out: Path) -> Optional[int]:
    """The pid written in ``out``'s lock file if some process holds it, else None."""
    path = out / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)
    return None


def run_files(out: Path, names: Sequence[str] = RUN_FILES) -> List[Path]:
    """The files and directories of a run present in ``out``, their temporary forms
    included (not the lock file)."""
    present = [out / n for n in names if (out / n).exists()]
    return present + stale_temp_files(out, names)


def stale_temp_files(out: Path, names: Sequence[str] = RUN_FILES) -> List[Path]:
    """Temporary forms of ``names`` that only a killed write leaves behind (``NAME.tmp``,
    e.g. ``metrics.json.tmp``). Inside ``checkpoints/``,
    :meth:`~torchrec_cowclip.run.checkpoints.CheckpointStore.remove_unfinished` removes a
    killed checkpoint write."""
    return [out / f"{name}.tmp" for name in names if (out / f"{name}.tmp").exists()]


def _remove(paths: Sequence[Path], say: Callable[[str], None], store: CheckpointStore) -> None:
    """Removes a run's files; inside ``checkpoints/`` (``store``'s directory) only this
    project's checkpoints and pointers (a foreign directory there is left, and named)."""
    for p in paths:
        if p == store.root and p.is_dir() and not p.is_symlink():
            _, left = store.remove_own()
            if left:
                say(f"left {', '.join(str(x) for x in left)} alone: not this project's checkpoints")
        elif p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _refuse_unproven_start(store: CheckpointStore) -> None:
    """Refuses ``--resume auto``'s fresh start where ``checkpoints/`` holds anything but
    this project's unfinished writes: a pointer or a directory there says an earlier
    attempt got past a checkpoint (its manifests damaged or deleted since), so its logs
    are not "left by an attempt that wrote none", and nothing is removed."""
    if not store.root.is_dir():
        return
    unfinished = set(store.unfinished())
    other = [e.name for e in sorted(store.root.iterdir()) if e not in unfinished]
    if other:
        raise RunDirError(
            f"--resume auto: {store.root} holds {', '.join(other[:4])}"
            f"{' ...' if len(other) > 4 else ''} but no complete checkpoint (none has the "
            "manifest naming its directory): an earlier attempt wrote checkpoints that are "
            "damaged now, so nothing was removed; restore them, or add --overwrite to "
            "start anew"
        )


def has_checkpoint(out: Path) -> bool:
    """Whether ``out`` holds a complete ``latest`` checkpoint (not verified here)."""
    return CheckpointStore(out / CHECKPOINTS_DIR).newest("latest") is not None


def claim_run_dir(
    out: Path,
    resume: Union[bool, str],
    overwrite: bool,
    main: bool = True,
    say: Callable[[str], None] = _say,
    *,
    checkpoints: CheckpointStore,
) -> RunDirLock:
    """Makes ``out`` this run's: creates it, takes its lock, refuses another run's files
    unless resuming or ``overwrite`` (which deletes them, saying what), and removes the
    temporary files a killed run left (saying which).

    Args:
        out: the run directory.
        resume: ``--resume``: True, the files present are this run's own; ``"auto"``,
            the same when ``out`` holds a complete checkpoint, and otherwise a fresh start
            that removes what an attempt killed before its first checkpoint left (a
            finished run, with ``metrics.json``, is refused instead).
        overwrite: ``--overwrite``: delete a previous run's files first.
        main: False on ranks other than 0 of a multi-process run, which share rank 0's
            directory and claim nothing.
        say: where the notes go (stderr by default).
        checkpoints: the run's checkpoint store in ``out/checkpoints``, which the claim
            asks for a checkpoint and removes through (the start's, made once, which
            the run's checkpoints then keep).

    Raises:
        RunDirError: ``out`` is locked by another process (naming its pid), cannot be
            written (naming the reason), or holds a run's files and neither ``resume``
            nor ``overwrite`` is set.
    """
    if not main:
        return RunDirLock.not_held()
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = RunDirLock.acquire(out)
    except RunDirError:
        raise
    except OSError as e:
        raise RunDirError(
            f"--out {out} cannot be written: {e.strerror or e}"
            + (f" ({e.filename})" if e.filename and str(e.filename) != str(out) else "")
            + ": choose a writable --out"
        ) from None
    try:
        # What this claim removes, and the note that says so: one removal at the end.
        previous = run_files(out)
        names = ", ".join(p.name for p in previous)
        if previous and overwrite:
            removing, note = previous, f"--overwrite: removed {names} from {out}"
        elif previous and resume == "auto" and checkpoints.newest("latest") is None:
            if (out / "metrics.json").exists():
                raise RunDirError(
                    f"--out {out} holds a finished run's files ({names}) "
                    "but no checkpoint to resume: add --overwrite to delete them or choose another --out"
                )
            _refuse_unproven_start(checkpoints)
            removing = previous
            note = (
                f"--resume auto: no checkpoint in {out}, starting anew; removed "
                f"{names}, left by an attempt that wrote none"
            )
        elif previous and not resume:
            raise RunDirError(
                f"--out {out} holds another run's files ({names}): "
                "add --resume to continue that run or --overwrite to delete them"
            )
        else:  # resuming, or nothing there: only what a killed write left (in previous)
            removing = stale_temp_files(out)
            note = (
                f"removed {', '.join(p.name for p in removing)} from {out}, left by an "
                "interrupted write"
            )
        if removing:
            _remove(removing, say, checkpoints)
            say(note)
    except BaseException:
        lock.release()
        raise
    return lock

"""Score files written whole or not at all, by one writer at a time: CSV, or parquet
(with pyarrow).

A :class:`ScoreWriter` first claims its output: an exclusive lock on ``.NAME.lock``
beside it (``flock``: freed by the OS when its process dies, even by SIGKILL), so a
second ``predict`` to the same ``--output`` is refused at once, naming the first one's
pid; under the lock it removes the ``.NAME.tmp-PID`` a killed run left. It writes into
its own temporary beside the output and puts it in place when the last row is in: with
``overwrite`` by ``os.replace`` (atomic on one file system), without by a hard link that
fails if the output appeared meanwhile (so it is never replaced unasked). A scoring run
that fails half-way (a bad row, a full disk, Ctrl-C, SIGTERM) leaves no partial output
and the previous file, if any, untouched. Columns: the passthrough id column if asked
for, then ``probability``. CSV probabilities are written with 9 significant digits,
which round-trips a float32 exactly.

Example::

    >>> import tempfile, pathlib
    >>> import numpy as np
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "scores.csv"
    >>> with ScoreWriter(out, keep_name="id") as w:
    ...     w.write(np.array([0.25, 0.5], np.float32), np.array(["a", "b"], dtype=object))
    >>> out.read_text().splitlines()
    ['id,probability', 'a,0.25', 'b,0.5']
    >>> sorted(p.name for p in out.parent.iterdir())   # no lock or temporary left
    ['scores.csv']
"""

from __future__ import annotations

import contextlib
import csv
import errno
import logging
import os
from pathlib import Path
from types import TracebackType
from typing import Any, Optional, Sequence, Type, Union

import numpy as np

from torchrec_cowclip.data.errors import DataOptionError
from torchrec_cowclip.run.no_space import space_checked
from torchrec_cowclip.run.out_dir import RunDirLock

logger = logging.getLogger(__name__)

CSV_SUFFIXES = (".csv", ".tsv", ".txt")
PARQUET_SUFFIXES = (".parquet", ".pq")
SCORE_COLUMN = "probability"


def check_output(path: Union[str, Path], overwrite: bool = False) -> Path:
    """Refuses, before anything is scored, an output of an unknown format, a directory,
    an existing file without ``overwrite``, or one under a file. A missing directory is
    created when the writer starts (:class:`ScoreWriter`), as ``--out`` is."""
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix not in CSV_SUFFIXES + PARQUET_SUFFIXES:
        raise DataOptionError(
            f"--output {path}: write .csv, .tsv or .parquet (the suffix names the format)"
        )
    if path.is_dir():
        raise DataOptionError(f"--output {path} is a directory: name a file")
    if path.exists() and not overwrite:
        raise DataOptionError(f"--output {path} exists: add --overwrite to replace it")
    above = next(p for p in path.parents if p.exists() or p == p.parent)
    if not above.is_dir():
        raise DataOptionError(f"--output {path}: {above} is a file, not a directory")
    return path


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_not_inputs(
    flag: str, path: Path, inputs: Sequence[Union[str, Path]], run_folder: Path
) -> None:
    """Refuses an output that is one of the command's input files (``--overwrite`` would
    replace the rows by their scores) or lies inside the run folder (whose manifest it
    would break)."""
    for given in inputs:
        if _same_file(path, Path(given).expanduser()):
            raise DataOptionError(
                f"{flag} {path} is the input file {given}: its scores would replace its rows; "
                f"choose another {flag}"
            )
    inside = run_folder.resolve()
    if inside in path.resolve().parents:
        raise DataOptionError(
            f"{flag} {path} lies inside the run folder {run_folder}: choose a path outside it"
        )


def claim_output(flag: str, path: Path, temporaries: Sequence[str]) -> RunDirLock:
    """Locks ``path`` for this process (``.NAME.lock`` beside it) and removes the
    temporaries a killed writer of it left (the glob patterns ``temporaries``, in its
    directory: no live writer holds them, since the lock is ours).

    Raises:
        RunDirError: another process writes ``path`` (its pid named).
    """
    lock = RunDirLock.acquire_file(
        path.with_name(f".{path.name}.lock"),
        lambda holder: f"{flag} {path} is being written by another process (pid {holder}): "
        f"wait for it, or choose another {flag}",
    )
    try:
        stale = sorted({p for pattern in temporaries for p in path.parent.glob(pattern)})
        for p in stale:
            p.unlink()
        if stale:
            logger.info(
                "removed %s, left by an interrupted write of %s",
                ", ".join(p.name for p in stale),
                path,
            )
    except BaseException:
        lock.release()
        raise
    return lock


def publish(tmp: Path, path: Path, overwrite: bool) -> None:
    """Puts the finished ``tmp`` in place of ``path``: ``os.replace`` with
    ``overwrite``; without, a hard link that fails if ``path`` exists by now (where the
    file system has no hard links, a last check and ``os.replace``)."""
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise DataOptionError(
            f"{path} appeared while it was being written: not replaced (add --overwrite to "
            "replace it)"
        ) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if path.exists():
            raise DataOptionError(
                f"{path} appeared while it was being written: not replaced"
            ) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


class ScoreWriter:
    """Writes probabilities (and a passthrough column) to ``path`` atomically, as the
    one writer of ``path`` (see the module docstring)."""

    def __init__(
        self, path: Union[str, Path], keep_name: Optional[str] = None, overwrite: bool = False
    ) -> None:
        self.path = Path(path)
        self.keep_name = keep_name
        self.overwrite = overwrite
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.parquet = self.path.suffix.lower() in PARQUET_SUFFIXES
        self.rows = 0
        self._file: Any = None
        self._writer: Any = None
        self._lock: Optional[RunDirLock] = None

    def __enter__(self) -> "ScoreWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = claim_output("--output", self.path, [f".{self.path.name}.tmp-*"])
        try:
            if self.path.exists() and not self.overwrite:
                raise DataOptionError(f"--output {self.path} exists: add --overwrite to replace it")
            with space_checked(self.path):
                self._open()
        except BaseException:
            self._release()
            raise
        return self

    def _open(self) -> None:
        if self.parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            fields = [pa.field(SCORE_COLUMN, pa.float32())]
            if self.keep_name is not None:
                fields.insert(0, pa.field(self.keep_name, pa.string()))
            self._schema = pa.schema(fields)
            self._writer = pq.ParquetWriter(str(self.tmp), self._schema)
        else:
            self._file = open(self.tmp, "w", newline="")
            delimiter = "\t" if self.path.suffix.lower() in (".tsv", ".txt") else ","
            self._writer = csv.writer(self._file, delimiter=delimiter, lineterminator="\n")
            header = [SCORE_COLUMN] if self.keep_name is None else [self.keep_name, SCORE_COLUMN]
            self._writer.writerow(header)

    def write(self, scores: np.ndarray, keep: Optional[np.ndarray] = None) -> None:
        """Appends one batch of rows."""
        scores = np.asarray(scores, dtype=np.float32)
        with space_checked(self.path):
            if self.parquet:
                import pyarrow as pa

                columns = [pa.array(scores, type=pa.float32())]
                if self.keep_name is not None:
                    assert keep is not None
                    columns.insert(0, pa.array([None if k is None else str(k) for k in keep]))
                self._writer.write_table(pa.Table.from_arrays(columns, schema=self._schema))
            else:
                text = [f"{float(v):.9g}" for v in scores.tolist()]
                if self.keep_name is None:
                    self._writer.writerows([t] for t in text)
                else:
                    assert keep is not None
                    self._writer.writerows(zip((str(k) for k in keep.tolist()), text))
        self.rows += len(scores)

    def __exit__(
        self,
        kind: Optional[Type[BaseException]],
        error: Optional[BaseException],
        trace: Optional[TracebackType],
    ) -> None:
        try:
            with space_checked(self.path):
                if self.parquet:
                    self._writer.close()
                else:
                    self._file.flush()
                    os.fsync(self._file.fileno())
                    self._file.close()
                if kind is None:
                    publish(self.tmp, self.path, self.overwrite)
        finally:
            if self._file is not None and not self._file.closed:
                with contextlib.suppress(OSError):  # after a failed flush: the error in hand
                    self._file.close()
            self.tmp.unlink(missing_ok=True)
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

"""Score files written whole or not at all: CSV, or parquet (with pyarrow).

A :class:`ScoreWriter` writes into a temporary file beside the output and renames it into
place when the last row is in (``os.replace``: atomic on one file system), so a scoring
run that fails half-way (a bad row, a full disk, Ctrl-C) leaves no partial output and
the previous file, if any, untouched. Columns: the passthrough id column if asked for,
then ``probability``. CSV probabilities are written with 9 significant digits, which
round-trips a float32 exactly.

Example::

    >>> import tempfile, pathlib
    >>> import numpy as np
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "scores.csv"
    >>> with ScoreWriter(out, keep_name="id") as w:
    ...     w.write(np.array([0.25, 0.5], np.float32), np.array(["a", "b"], dtype=object))
    >>> out.read_text().splitlines()
    ['id,probability', 'a,0.25', 'b,0.5']
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from types import TracebackType
from typing import Any, Optional, Type, Union

import numpy as np

from torchrec_cowclip.data.errors import DataOptionError

CSV_SUFFIXES = (".csv", ".tsv", ".txt")
PARQUET_SUFFIXES = (".parquet", ".pq")
SCORE_COLUMN = "probability"


def check_output(path: Union[str, Path], overwrite: bool = False) -> Path:
    """Refuses, before anything is scored, an output of an unknown format, a directory,
    an existing file without ``overwrite``, or one in a missing directory."""
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
    if not path.parent.is_dir():
        raise DataOptionError(f"--output {path}: directory {path.parent} does not exist")
    return path


class ScoreWriter:
    """Writes probabilities (and a passthrough column) to ``path`` atomically."""

    def __init__(self, path: Union[str, Path], keep_name: Optional[str] = None) -> None:
        self.path = Path(path)
        self.keep_name = keep_name
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.parquet = self.path.suffix.lower() in PARQUET_SUFFIXES
        self.rows = 0
        self._file: Any = None
        self._writer: Any = None

    def __enter__(self) -> "ScoreWriter":
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
        return self

    def write(self, scores: np.ndarray, keep: Optional[np.ndarray] = None) -> None:
        """Appends one batch of rows."""
        scores = np.asarray(scores, dtype=np.float32)
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
            if self.parquet:
                self._writer.close()
            else:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
            if kind is None:
                os.replace(self.tmp, self.path)
        finally:
            if self.tmp.exists():
                self.tmp.unlink()

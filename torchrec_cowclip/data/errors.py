"""Bad input rows: the error raised for them and the tally kept when they are skipped.

Every parser reports a bad row the same way: a path, a 1-based line number (for ``.npy``
and parquet sources, the 1-based row number) and a reason from a small fixed set, so
``on_bad_row="skip"`` can count rows per reason and ``on_bad_row="error"`` can say
exactly where to look.

Example::

    >>> log = BadRowLog("skip")
    >>> log.add("day_0", 17, WRONG_COLUMN_COUNT, "expected 40 columns, got 39")
    >>> log.counts
    {'wrong column count': 1}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Literal, Optional, Union

OnBadRow = Literal["error", "skip"]

# Reason keys are part of meta.json; keep them stable.
WRONG_COLUMN_COUNT = "wrong column count"
BAD_LABEL = "label not 0/1"
BAD_DENSE = "non-numeric dense value"
BAD_HEX = "bad hex categorical"
BAD_SPARSE_ID = "bad sparse id"
BAD_TIME = "bad timestamp"

MAX_EXAMPLES = 20


class DataError(ValueError):
    """A data file is unusable: a bad row, an empty file, a schema mismatch.

    ``str(err)`` reads ``"<path>:<line>: <reason>: <detail>"`` when a row is at fault.

    Example::

        >>> try:
        ...     raise DataError("bad", path="train.txt", line=3, reason=BAD_LABEL)
        ... except ValueError as e:
        ...     print(e.line)
        3
    """

    def __init__(
        self,
        message: str,
        *,
        path: Union[str, Path, None] = None,
        line: Optional[int] = None,
        reason: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.line = line
        self.reason = reason


class DataOptionError(DataError):
    """A data option or spec argument that cannot be used; the message names it.

    A ``ValueError`` (and a :class:`DataError`, which the CLI prints as one line).

    Example::

        >>> str(DataOptionError("synthetic:0: the row count must be >= 1"))
        'synthetic:0: the row count must be >= 1'
    """


def row_error(path: Union[str, Path], line: int, reason: str, detail: str = "") -> DataError:
    """The ``DataError`` for one bad row, with ``file:line`` first in the message."""
    msg = f"{path}:{line}: {reason}" + (f": {detail}" if detail else "")
    return DataError(msg, path=path, line=line, reason=reason)


@dataclass
class BadRowLog:
    """Raises on the first bad row (``mode="error"``) or tallies them (``"skip"``).

    Args:
        mode: ``"error"`` or ``"skip"``.

    Example::

        >>> try:
        ...     BadRowLog("error").add("a.tsv", 2, BAD_LABEL, "got '2'")
        ... except DataError as e:
        ...     print(e)
        a.tsv:2: label not 0/1: got '2'
    """

    mode: OnBadRow = "error"
    counts: Dict[str, int] = field(default_factory=dict)
    examples: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in ("error", "skip"):
            raise DataOptionError(
                f"on_bad_row (--on-bad-row) must be 'error' or 'skip', got {self.mode!r}"
            )

    def add(self, path: Union[str, Path], line: int, reason: str, detail: str = "") -> None:
        """Record one bad row; in ``"error"`` mode raise its ``DataError`` instead."""
        err = row_error(path, line, reason, detail)
        if self.mode == "error":
            raise err
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(str(err))

    @property
    def total(self) -> int:
        """Number of rows skipped so far."""
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line such as ``"skipped 3 bad rows: label not 0/1=2, wrong column count=1"``."""
        if not self.counts:
            return "no bad rows"
        parts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        return f"skipped {self.total} bad rows: {parts}"

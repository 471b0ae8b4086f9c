"""Validated row blocks: labels, raw dense values and raw categorical values.

A *row source* turns one input file into a stream of :class:`RowBlock` s whose rows are
all well formed; bad rows are reported to a :class:`~torchrec_cowclip.data.errors.BadRowLog`
(which raises in ``"error"`` mode, at the first bad row of the file). Encoding
(vocabulary or hashing) and dense transforms happen later, in
:mod:`torchrec_cowclip.data.pipeline.encode`.

Example::

    >>> import tempfile, pathlib
    >>> from torchrec_cowclip.data.errors import BadRowLog
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "t.tsv"
    >>> _ = p.write_text("1\\t5\\tab\\n2\\t1\\tcd\\n0\\t\\t\\n")
    >>> src = TextRowSource(TextLayout(n_columns=3, label=0, dense=(1,), sparse=(2,),
    ...                                dense_names=("I1",), sparse_names=("C1",)))
    >>> log = BadRowLog("skip")
    >>> blocks = list(src.blocks(p, log))
    >>> blocks[0].labels.tolist(), blocks[0].lines.tolist(), log.counts
    ([1.0, 0.0], [1, 3], {'label not 0/1': 1})
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.errors import (
    BAD_DENSE,
    BAD_LABEL,
    BAD_TIME,
    WRONG_COLUMN_COUNT,
    BadRowLog,
    DataError,
)
from torchrec_cowclip.data.parsing.delimited import DelimitedFile, infer_delimiter
from torchrec_cowclip.data.parsing.fields import parse_labels, parse_numeric
from torchrec_cowclip.data.parsing.time import (
    time_feature_names,
    time_features,
    trend_feature_names,
)

# Given the raw categoricals of a block: None if every row is encodable, else
# (bad-row mask, reason, one detail per bad row).
SparseCheck = Callable[[Any], Optional[Tuple[np.ndarray, str, List[str]]]]
ColumnRef = Union[int, str]


@dataclass
class RowBlock:
    """Well-formed rows of one block of one part (file) of a source.

    ``dense`` is float64 with NaN for missing values; ``sparse`` the raw categoricals
    in the form the source's encoding takes (for text, one ``S`` array per column with
    ``b""`` for missing); ``lines`` 1-based line (or row) numbers in ``path``;
    ``extra`` further per-row vectors the source keeps; ``paths`` overrides ``path``
    per bad-row reason (a source whose columns live in separate files); ``fraction``
    how much of the part has been read once this block is (None if unknown), for
    progress reports.
    """

    path: str
    lines: np.ndarray
    labels: np.ndarray
    dense: np.ndarray
    sparse: Any
    extra: Dict[str, np.ndarray] = field(default_factory=dict)
    paths: Dict[str, str] = field(default_factory=dict)
    fraction: Optional[float] = None

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, keep: np.ndarray) -> "RowBlock":
        sparse = (
            self.sparse[keep]
            if isinstance(self.sparse, np.ndarray)
            else [c[keep] for c in self.sparse]
        )
        return RowBlock(
            path=self.path,
            lines=self.lines[keep],
            labels=self.labels[keep],
            dense=self.dense[keep],
            sparse=sparse,
            extra={k: v[keep] for k, v in self.extra.items()},
            paths=self.paths,
            fraction=self.fraction,
        )


def validate_block(
    block: RowBlock,
    log: BadRowLog,
    bad_label: np.ndarray,
    bad_dense: np.ndarray,
    dense_names: Sequence[str],
    raw_labels: np.ndarray,
    raw_dense: Union[np.ndarray, Sequence[np.ndarray]],
    sparse_check: Optional[SparseCheck],
    wrong_count: Sequence[Tuple[int, str]] = (),
    bad_time: Sequence[Tuple[str, np.ndarray, np.ndarray]] = (),
) -> RowBlock:
    """Report the bad rows of ``block`` in line order and return the good ones.

    ``bad_dense`` is ``[n, n_dense]``: which dense values are bad; ``bad_time`` one
    ``(column, bad mask, raw fields)`` per time column. Each bad row is reported once,
    under its first failing check in this order: column count, label, dense, time,
    categorical; a detail shows the raw field (``raw_labels[i]``, ``raw_dense[column][i]``).
    A dense field that is no number at all names ``--na-values``, in case it means
    missing (``'?'``).
    """
    bad: List[Tuple[int, str, str]] = [(line, WRONG_COLUMN_COUNT, d) for line, d in wrong_count]
    flagged = np.asarray(bad_label, dtype=bool).copy()
    for i in np.flatnonzero(bad_label).tolist():
        bad.append((int(block.lines[i]), BAD_LABEL, f"got {_show(raw_labels[i])}"))
    dense_rows = bad_dense.any(axis=1) if bad_dense.size else np.zeros(len(block), dtype=bool)
    for i in np.flatnonzero(dense_rows & ~flagged).tolist():
        c = int(np.argmax(bad_dense[i]))
        raw = raw_dense[c][i]
        bad.append(
            (int(block.lines[i]), BAD_DENSE, f"{dense_names[c]}={_show(raw)}{_na_hint(raw)}")
        )
    flagged |= dense_rows
    for name, mask, raw_time in bad_time:
        for i in np.flatnonzero(mask & ~flagged).tolist():
            bad.append(
                (
                    int(block.lines[i]),
                    BAD_TIME,
                    f"{name}={_show(raw_time[i])} (Unix seconds or milliseconds, or an ISO "
                    "8601 date-time)",
                )
            )
        flagged |= mask
    if sparse_check is not None and len(block):
        checked = sparse_check(block.sparse)
        if checked is not None:
            mask, reason, details = checked
            for i, detail in zip(np.flatnonzero(mask).tolist(), details):
                if not flagged[i]:
                    bad.append((int(block.lines[i]), reason, detail))
            flagged |= mask
    if not bad:
        return block
    for line, reason, detail in sorted(bad):
        log.add(block.paths.get(reason, block.path), line, reason, detail)
    return block.take(~flagged)


def no_labels(n: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(raw labels, labels, bad-label mask)`` of ``n`` rows read without a label
    column: empty fields, NaN labels, none bad."""
    return np.zeros(n, dtype="S1"), np.full(n, np.nan, np.float32), np.zeros(n, dtype=bool)


def _na_hint(raw: Any) -> str:
    """``--na-values`` named for a text field that is no number (``'?'``, ``'NA'``)."""
    if not isinstance(raw, bytes):
        return ""
    text = raw.decode("utf-8", "replace").strip()
    try:
        float(text)
    except ValueError:
        return f" (if it means a missing value: --na-values {text})"
    return ""


def _show(raw: Any) -> str:
    if isinstance(raw, bytes):
        return repr(raw.decode("utf-8", "replace"))
    return repr(raw.item() if isinstance(raw, np.generic) else raw)


@dataclass(frozen=True)
class TextLayout:
    """Where label, dense and categorical values sit in a delimited file.

    Columns are given by index, or by name when the file has a header.

    Args:
        delimiter: one character; None infers it from the extension.
        fallback_delimiter: used when ``delimiter`` is None and the extension says nothing.
        header: True, False, or ``"auto"`` (a header if the first line's label and
            dense fields are all non-numeric names; see ``_names_a_header``).
        n_columns: fields per line; None takes the header's length.
        label, dense, sparse: column indices or header names; ``label=None`` reads no
            label (a file to score: every label is NaN).
        dense_names, sparse_names: feature names when columns are given by index.
        na_values: field texts that mean a missing value in the dense and categorical
            columns besides the empty field (pandas' ``na_values``: ``("N/A", "-")``).
        time: time columns (indices or header names), each read as a timestamp and
            appended to the categoricals as its hour of day and day of week
            (:mod:`~torchrec_cowclip.data.parsing.time`); ``time_names`` name them when
            given by index.
        trend: each time column also appended to the dense columns as its trend, the
            timestamp in days (``--time-trend``).
    """

    delimiter: Optional[str] = None
    fallback_delimiter: Optional[str] = None
    header: Union[bool, str] = False
    n_columns: Optional[int] = None
    label: Optional[ColumnRef] = 0
    dense: Tuple[ColumnRef, ...] = ()
    sparse: Tuple[ColumnRef, ...] = ()
    dense_names: Optional[Tuple[str, ...]] = None
    sparse_names: Optional[Tuple[str, ...]] = None
    na_values: Tuple[str, ...] = ()
    time: Tuple[ColumnRef, ...] = ()
    time_names: Optional[Tuple[str, ...]] = None
    trend: bool = False

    def open(self, path: Union[str, Path]) -> DelimitedFile:
        header: Union[bool, Callable[[List[bytes]], bool]] = (
            self._names_a_header if self.header == "auto" else bool(self.header)
        )
        delimiter = self.delimiter
        if delimiter is None and infer_delimiter(path) is None:
            delimiter = self.fallback_delimiter
        return DelimitedFile(path, delimiter=delimiter, header=header, n_columns=self.n_columns)

    def _names_a_header(self, fields: List[bytes]) -> bool:
        """``header="auto"``: the first line is a header only if its label and dense
        fields are all names (non-empty, not numbers). A data row has a number or an
        empty field among them, so a first row with a bad label stays a (bad) row."""
        refs = [*([] if self.label is None else [self.label]), *self.dense]
        columns = [r for r in refs if isinstance(r, int) and r < len(fields)]
        if len(columns) != len(refs):
            return False
        values = np.array([fields[c].strip() for c in columns])
        _, bad = parse_numeric(values)
        return bool(bad.all())

    def payload(self) -> Dict[str, Any]:
        """JSON description of the layout, for cache keys (``na_values`` and the time
        columns only when given, so that layouts without them keep the keys they had)."""
        return {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in asdict(self).items()
            if k not in ("na_values", "time", "time_names", "trend") or v
        }

    def resolve(
        self, f: DelimitedFile
    ) -> Tuple[Optional[int], List[int], List[int], List[str], List[str]]:
        """Column indices (the label's None without one; the categoricals' followed by
        the time columns') and feature names (the categoricals' followed by the time
        columns' parts) for one opened file."""

        def index(ref: ColumnRef) -> int:
            if isinstance(ref, int):
                return ref
            if f.header is None:
                raise ValueError(f"{f.path}: column {ref!r} is named but the file has no header")
            if ref not in f.header:
                raise DataError(f"{f.path}: no column {ref!r}; columns are {f.header}", path=f.path)
            return f.header.index(ref)

        label = None if self.label is None else index(self.label)
        dense = [index(r) for r in self.dense]
        sparse = [index(r) for r in (*self.sparse, *self.time)]

        def names(refs: Tuple[ColumnRef, ...], given: Optional[Tuple[str, ...]]) -> List[str]:
            if given is not None:
                return list(given)
            return [
                r if isinstance(r, str) else (f.header[r] if f.header else f"col{r}") for r in refs
            ]

        time = names(self.time, self.time_names)
        return (
            label,
            dense,
            sparse,
            names(self.dense, self.dense_names) + (trend_feature_names(time) if self.trend else []),
            names(self.sparse, self.sparse_names) + time_feature_names(time),
        )


def missing_as_empty(values: np.ndarray, na_values: Sequence[str]) -> np.ndarray:
    """``values`` (an ``S`` array of fields) with those whose stripped text is one of
    ``na_values`` made empty, the missing value every reader knows.

    Example::

        >>> missing_as_empty(np.array([b"1.5", b" N/A", b"x"]), ("N/A",)).tolist()
        [b'1.5', b'', b'x']
    """
    if not len(na_values) or not len(values):
        return values
    na = np.isin(np.char.strip(values), [v.encode() for v in na_values])
    if not na.any():
        return values
    out = values.copy()
    out[na] = b""
    return out


class RowSource(Protocol):
    """Reads validated row blocks from one *part* of a source: a text or parquet file,
    a TorchRec npy day, the rows of a synthetic config."""

    def names(self, part: Any) -> Tuple[List[str], List[str]]:
        """``(dense_names, sparse_names)`` of ``part``."""
        ...

    def part_name(self, part: Any) -> str:
        """How ``part`` is named in ``meta["file_rows"]`` and in errors."""
        ...

    def blocks(
        self, part: Any, log: BadRowLog, sparse_check: Optional[SparseCheck] = None
    ) -> Iterator[RowBlock]:
        """Validated blocks of ``part``; bad rows go to ``log``."""
        ...


class TextRowSource:
    """Row blocks of delimited text files laid out as ``layout`` says.

    Example::

        >>> from torchrec_cowclip.data.sources.criteo import CRITEO_LAYOUT
        >>> src = TextRowSource(CRITEO_LAYOUT)
        >>> src.names("tests/data/criteo_sample.tsv")[1][:2]
        ['C1', 'C2']
    """

    def __init__(self, layout: TextLayout) -> None:
        self.layout = layout

    def part_name(self, part: Union[str, Path]) -> str:
        return str(Path(part).resolve())

    def names(self, path: Union[str, Path]) -> Tuple[List[str], List[str]]:
        """``(dense_names, sparse_names)`` as read from ``path``."""
        _, _, _, dense_names, sparse_names = self.layout.resolve(self.layout.open(path))
        return dense_names, sparse_names

    def blocks(
        self, path: Union[str, Path], log: BadRowLog, sparse_check: Optional[SparseCheck] = None
    ) -> Iterator[RowBlock]:
        f = self.layout.open(path)
        label_col, dense_cols, sparse_cols, dense_names, _ = self.layout.resolve(f)
        n_time = len(self.layout.time)
        time_cols = sparse_cols[len(sparse_cols) - n_time :]
        sparse_cols = sparse_cols[: len(sparse_cols) - n_time]
        time_names = [str(t) for t in (self.layout.time_names or self.layout.time)]
        labeled = [] if label_col is None else [label_col]
        wanted = sorted(set([*labeled, *dense_cols, *sparse_cols, *time_cols]))
        for raw in f.blocks(wanted):
            n = len(raw.lines)
            if label_col is None:
                raw_labels, labels, bad_label = no_labels(n)
            else:
                raw_labels = raw.columns[label_col]
                labels, bad_label = parse_labels(raw_labels)
            dense = np.empty((n, len(dense_cols)))
            bad_dense = np.zeros((n, len(dense_cols)), dtype=bool)
            raw_dense = [
                missing_as_empty(raw.columns[c], self.layout.na_values) for c in dense_cols
            ]
            for j, col in enumerate(raw_dense):
                dense[:, j], bad_dense[:, j] = parse_numeric(col)
            sparse = [missing_as_empty(raw.columns[c], self.layout.na_values) for c in sparse_cols]
            bad_time = []
            for name, c in zip(time_names, time_cols):
                raw_time = missing_as_empty(raw.columns[c], self.layout.na_values)
                parts, days, bad_t = time_features(raw_time)
                sparse += parts
                bad_time.append((name, bad_t, raw_time))
                if self.layout.trend:  # after the dense columns (their bad values: bad_time)
                    dense = np.concatenate([dense, days[:, None]], axis=1)
            block = RowBlock(
                path=str(path),
                lines=raw.lines,
                labels=labels,
                dense=dense,
                sparse=sparse,
                fraction=raw.fraction,
            )
            block = validate_block(
                block,
                log,
                bad_label,
                bad_dense,
                dense_names,
                raw_labels,
                raw_dense,
                sparse_check,
                raw.bad_lines,
                bad_time,
            )
            if len(block):
                yield block

"""What a trained model scores: files and in-memory columns, encoded as its training rows were.

:func:`open_input` turns what a user hands over into an :class:`Input`, a stream of
:class:`EncodedBlock` s (dense values transformed, categoricals encoded by the run's
vocabulary or hashing, labels where there are some), in input order:

* a path, or ``KIND:PATH[,PATH...]`` of the run's kind: the files are read the way the
  training files were (the run folder's reader: a text layout with its delimiter and
  header, or parquet, or the kind's own reader) through the same row sources, so every
  check of training applies (a bad row is refused as ``file:line: reason``). A file
  without the label column is scored all the same (predict); the label is read only
  when asked for (evaluate). Criteo's positional layout is recognised with or without
  its leading label column (Kaggle's ``test.txt`` has none);
* a mapping of column name -> values (lists, numpy arrays), a pandas ``DataFrame`` or
  a pyarrow ``Table``: the schema's dense and categorical columns by name (pandas and
  pyarrow are not needed otherwise).

Dense values go through the run's dense plan (each column's transform, with the
statistics of the training split, and its missing-value indicators). Values never
seen in training become the out-of-vocabulary id 0 (as they did in
training's explicit test files) and are counted per column (``EncodedBlock.unseen``);
an id outside its table (a stored id larger than any training saw) is mapped to row 0
too and counted. A categorical column handed over as numbers while the run's vocabulary
holds text that numbers cannot spell (zip code ``'00501'`` read by pandas as ``501``) is
named in a warning: read it as text (``dtype=str``).

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.train import TrainConfig, train
    >>> from torchrec_cowclip.run.model_folder import RunFolder
    >>> tmp = tempfile.mkdtemp()
    >>> result = train(TrainConfig(data="criteo:tests/data/criteo_sample.tsv", hidden=(8,),
    ...                            batch_size=64, progress=False, out=f"{tmp}/run",
    ...                            cache_dir=f"{tmp}/cache"))
    >>> run = RunFolder.open(result.run_dir)
    >>> blocks = list(open_input(run, "tests/data/criteo_sample.csv").blocks())
    >>> block = blocks[0]   # the sample with a header line; scored without its label
    >>> tuple(block.dense.shape), tuple(block.ids.shape), bool(block.labels.isnan().all())
    ((200, 13), (200, 26), True)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from torchrec_cowclip.data.errors import BadRowLog, DataError, DataOptionError
from torchrec_cowclip.data.parsing.columns import (
    check_file_columns,
    first_line,
    guess_delimiter,
    parse_delimiter,
    refuse_repeated_columns,
    shown_delimiter,
    split_line,
)
from torchrec_cowclip.data.parsing.delimited import infer_delimiter
from torchrec_cowclip.data.parsing.dense import stored_values
from torchrec_cowclip.data.parsing.fields import check_labels, parse_numeric
from torchrec_cowclip.data.parsing.rows import (
    RowBlock,
    TextLayout,
    TextRowSource,
    missing_as_empty,
)
from torchrec_cowclip.data.parsing.time import days_of_seconds, parts_of_seconds, time_features
from torchrec_cowclip.data.parsing.vocab import OOV_ID
from torchrec_cowclip.data.pipeline.run_encoders import IdVocabulary
from torchrec_cowclip.data.registry import source_kinds
from torchrec_cowclip.data.sources.table import ParquetRowSource, is_parquet
from torchrec_cowclip.run.model_folder import RunFolder

#: The row id an id outside its table is scored with (every encoding's OOV or missing row).
FALLBACK_ID = 0


class UnseenValuesWarning(UserWarning):
    """Categorical values arrive in a form the run's vocabulary cannot match."""


@dataclass
class EncodedBlock:
    """Rows ready for the model.

    Attributes:
        dense: float32 ``[n, inputs]``, the dense plan's model inputs (as in training).
        ids: int64 ``[n, n_sparse]``, each within its table.
        labels: float32 ``[n]``; NaN where the input had no label.
        keep: the passthrough column's values (``--id-column``), or None.
        out_of_range: how many ids were outside their table (scored as row 0).
        unseen: per categorical column, the values (not missing) its vocabulary lacks,
            scored with the out-of-vocabulary row; None for hashed ids (no vocabulary).
        outside: per dense column, the values outside the training range after the
            transform (scored as they are); None where the run recorded no range.
    """

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor
    keep: Optional[np.ndarray] = None
    out_of_range: int = 0
    unseen: Optional[np.ndarray] = None
    outside: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class RunEncoder:
    """Encodes raw row blocks (:class:`~torchrec_cowclip.data.parsing.rows.RowBlock`)
    as the run encoded its training rows."""

    def __init__(self, run: RunFolder) -> None:
        self.encoding = run.encoder()
        self.plan = run.dense_plan()
        self.cardinalities = np.asarray(run.schema.cardinalities, dtype=np.int64)
        self.text_ids = run.reader["format"] in ("text", "parquet")
        table = getattr(self.encoding, "table", None)
        #: The run's vocabulary (None for hashed or stored ids).
        self.vocabulary: Optional[IdVocabulary] = table if isinstance(table, IdVocabulary) else None

    def check(self) -> Any:
        """The encoding's check of raw categoricals (hex under hashing), or None."""
        return self.encoding.check()

    def encode(self, block: RowBlock, keep: Optional[np.ndarray] = None) -> EncodedBlock:
        ids = np.asarray(self.encoding.encode(block.sparse), dtype=np.int64)
        unseen = None
        if self.vocabulary is not None:
            present = np.stack([np.asarray(c) != b"" for c in block.sparse], axis=1)
            unseen = ((ids == OOV_ID) & present).sum(axis=0).astype(np.int64)
        outside = (ids < 0) | (ids >= self.cardinalities[None, :])
        n_outside = int(outside.sum())
        if n_outside:
            ids[outside] = FALLBACK_ID
        stored = stored_values(block.dense, self.plan.transforms, clip_before=self.plan.clip_before)
        dense = self.plan.apply(stored)
        return EncodedBlock(
            dense=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
            ids=torch.from_numpy(np.ascontiguousarray(ids)),
            labels=torch.from_numpy(np.asarray(block.labels, dtype=np.float32)),
            keep=keep,
            out_of_range=n_outside,
            unseen=unseen,
            outside=self.plan.outside(stored),
        )

    def numbers_for_text(self, column: int, values: np.ndarray) -> Optional[str]:
        """A warning when categorical ``column`` arrives as numbers (``values``' dtype)
        while the vocabulary holds text that numbers cannot spell (``'00501'``, ``'a7'``),
        else None."""
        if self.vocabulary is None or values.dtype.kind not in "iuf":
            return None
        keys = self.vocabulary.keys[column][:1000]
        odd = next((k for k in keys.tolist() if not _spelled_by_a_number(k)), None)
        if odd is None:
            return None
        name = self.vocabulary.names[column]
        return (
            f"categorical column {name!r} arrived as numbers ({values.dtype}) but the run's "
            f"vocabulary holds text such as {odd.decode(errors='replace')!r} that numbers "
            f"cannot spell, so those values score as unseen: read it as text (pandas: "
            f"dtype={{{name!r}: str}})"
        )


class Input:
    """A stream of :class:`EncodedBlock` s in input order (see :func:`open_input`).

    Attributes:
        has_labels: whether the blocks carry labels.
        name: how messages name the input.
    """

    has_labels: bool
    name: str

    def blocks(self) -> Iterator[EncodedBlock]:
        raise NotImplementedError


def _label_name(run: RunFolder) -> str:
    """The label column's name in the run's files (``label`` for positional layouts)."""
    layout = run.text_layout()
    if layout is not None and isinstance(layout.label, str):
        return layout.label
    reader = run.reader
    return str(reader.get("label") or "label")


def _delimiter_of(layout: TextLayout, path: str) -> str:
    """The delimiter ``layout`` reads ``path`` with (its own, the extension's, its fallback).

    Raises:
        DataOptionError: none of them says (an unknown extension).
    """
    if layout.delimiter is not None:
        return layout.delimiter
    inferred = infer_delimiter(path)
    if inferred is not None:
        return inferred.decode()
    if layout.fallback_delimiter is None:
        raise DataOptionError(
            f"cannot infer the delimiter of {path} from its extension: pass --delimiter"
        )
    return layout.fallback_delimiter


def _shifted(refs: Tuple[Any, ...], label: int) -> Tuple[Any, ...]:
    return tuple(r - 1 if isinstance(r, int) and r > label else r for r in refs)


class FileInput(Input):
    """The files of a ``KIND:PATH`` (or plain path) spec, read as the run's were."""

    def __init__(
        self,
        run: RunFolder,
        paths: Sequence[str],
        *,
        labels: bool = False,
        delimiter: Optional[str] = None,
        keep: Optional[str] = None,
    ) -> None:
        self.run, self.paths, self.delimiter, self.keep_column = run, list(paths), delimiter, keep
        self.encoder = RunEncoder(run)
        self.name = ",".join(self.paths)
        self._parts = [self._part(p, labels) for p in self.paths]
        self.has_labels = all(has for _, _, has, _ in self._parts)

    def _part(self, path: str, labels: bool) -> Tuple[Any, Any, bool, Optional[Any]]:
        """``(row source, part, has labels, passthrough reader)`` for one path."""
        run = self.run
        layout = run.text_layout()
        reader = run.reader
        by_name = reader["format"] == "parquet" or (
            layout is not None and isinstance(layout.label, str)
        )
        if is_parquet(path) and by_name:
            return self._parquet_part(path, labels)
        if layout is None and reader["format"] == "parquet":
            layout = TextLayout(
                header=True,
                label=reader["label"],
                dense=tuple(reader["dense"]),
                sparse=tuple(reader["sparse"]),
                na_values=run.na_values(),
                time=tuple(reader.get("time") or ()),
                trend=bool(reader.get("trend")),
            )
        if layout is not None:
            return self._text_part(layout, path, labels)
        if self.delimiter is not None or self.keep_column is not None:
            flag = "--delimiter" if self.delimiter is not None else "--id-column"
            raise DataOptionError(f"{flag} applies to text and parquet files, not {run.kind.name}:")
        conversion = run.kind.conversion([path], [], run.options())
        if len(conversion.train) != 1:
            raise DataOptionError(f"{path}: expected one part, found {len(conversion.train)}")
        return conversion.source, conversion.train[0], True, None

    def _text_part(
        self, layout: TextLayout, path: str, labels: bool
    ) -> Tuple[Any, Any, bool, Optional[Any]]:
        if self.delimiter is not None:
            layout = dataclasses.replace(layout, delimiter=parse_delimiter(self.delimiter))
        has_label = True
        delimiter = _delimiter_of(layout, path)
        if isinstance(layout.label, str):
            # The run's columns against the file's first line (with a hint at a wrong
            # delimiter or a missing header), before any row is read.
            header = check_file_columns(
                path,
                delimiter,
                {
                    "the run's dense columns": [str(c) for c in layout.dense],
                    "the run's categorical columns": [str(c) for c in layout.sparse],
                    "the run's time columns": [str(c) for c in layout.time],
                },
                where=self.run.kind.name,
            )
            has_label = layout.label in header
            if labels:
                refuse_repeated_columns(path, header, [layout.label])
        elif isinstance(layout.label, int) and layout.n_columns is not None:
            line = first_line(path)
            first = split_line(line, delimiter)
            n_columns: int = layout.n_columns
            if len(first) == n_columns - 1:
                has_label = False
                layout = dataclasses.replace(
                    layout,
                    label=None,
                    n_columns=n_columns - 1,
                    dense=_shifted(layout.dense, layout.label),
                    sparse=_shifted(layout.sparse, layout.label),
                )
            elif len(first) != n_columns:
                other = guess_delimiter(line, delimiter)
                hint = (
                    f" (wrong delimiter? on {shown_delimiter(other)} it splits into "
                    f"{len(split_line(line, other))}: give --delimiter {shown_delimiter(other)})"
                    if other
                    else ""
                )
                raise DataError(
                    f"{path}:1 has {len(first)} fields split on {shown_delimiter(delimiter)}; "
                    f"the run's files had {n_columns} (or {n_columns - 1} without the label)"
                    + hint,
                    path=path,
                    line=1,
                )
        if labels and not has_label:
            raise DataError(
                f"{path}: no label column {_label_name(self.run)!r}: evaluate needs labels "
                "(predict scores a file without them)",
                path=path,
            )
        if not labels and layout.label is not None:
            layout = dataclasses.replace(layout, label=None)  # scores need no label
        keep = None if self.keep_column is None else self._text_keep(layout, path)
        return TextRowSource(layout), path, has_label and labels, keep

    def _text_keep(self, layout: TextLayout, path: str) -> Any:
        f = layout.open(path)
        column = self.keep_column
        assert column is not None
        if f.header is not None and column in f.header:
            index = f.header.index(column)
        elif f.header is None and column.isdigit() and int(column) < f.n_columns:
            index = int(column)
        else:
            where = (
                f"columns are {f.header}"
                if f.header
                else "the file has no header: give a 0-based column number"
            )
            raise DataError(f"{path}: no --id-column {column!r}; {where}", path=path)

        def values() -> Iterator[np.ndarray]:
            for raw in f.blocks([index]):
                if raw.bad_lines:  # the row source refuses these lines first
                    return
                yield np.char.decode(raw.columns[index], "utf-8", "replace")

        return values()

    def _parquet_part(self, path: str, labels: bool) -> Tuple[Any, Any, bool, Optional[Any]]:
        layout = self.run.text_layout()
        if layout is not None:
            label, dense, sparse = layout.label, layout.dense, layout.sparse
            time: Sequence[Any] = layout.time
            trend = layout.trend
        else:
            reader = self.run.reader
            label, dense, sparse = reader["label"], reader["dense"], reader["sparse"]
            time = reader.get("time") or ()
            trend = bool(reader.get("trend"))
        import pyarrow.parquet as pq

        present = pq.ParquetFile(path).schema_arrow.names
        has_label = label in present
        if labels and not has_label:
            raise DataError(
                f"{path}: no label column {label!r}: evaluate needs labels (predict scores "
                "a file without them)",
                path=path,
            )
        source = ParquetRowSource(
            str(label) if labels else None,
            [str(c) for c in dense],
            [str(c) for c in sparse],
            self.run.na_values(),
            [str(c) for c in time],
            trend,
        )
        keep = None
        if self.keep_column is not None:
            if self.keep_column not in present:
                raise DataError(
                    f"{path}: no --id-column {self.keep_column!r}; columns are {present}",
                    path=path,
                )
            keep = (
                np.asarray(batch.column(0).to_pylist(), dtype=object)
                for batch in pq.ParquetFile(path).iter_batches(
                    batch_size=1 << 16, columns=[self.keep_column]
                )
            )
        return source, path, has_label and labels, keep

    def blocks(self) -> Iterator[EncodedBlock]:
        check = self.encoder.check()
        for source, part, _, keep in self._parts:
            pending = _Aligned(keep)
            for block in source.blocks(part, BadRowLog("error"), check):
                yield self.encoder.encode(block, pending.take(len(block)))


class _Aligned:
    """The passthrough values of a file, handed out by row counts (the row source and
    the passthrough reader cut the file into blocks on their own)."""

    def __init__(self, chunks: Optional[Iterator[np.ndarray]]) -> None:
        self.chunks, self.buffer = chunks, np.zeros(0, dtype=object)

    def take(self, n: int) -> Optional[np.ndarray]:
        if self.chunks is None:
            return None
        while len(self.buffer) < n:
            chunk = next(self.chunks, None)
            if chunk is None:
                break
            self.buffer = np.concatenate([self.buffer, np.asarray(chunk, dtype=object)])
        head, self.buffer = self.buffer[:n], self.buffer[n:]
        return head


# --- in-memory columns ------------------------------------------------------------------


def _spelled_by_a_number(key: bytes) -> bool:
    """Whether a number's decimal digits give ``key`` (``b"501"``, not ``b"00501"``)."""
    try:
        return str(int(key)).encode() == key
    except ValueError:
        return False


def _to_bytes(values: Any) -> np.ndarray:
    """Categorical values as an ``S`` array of their text (missing: ``b""``): strings as
    UTF-8, integers (and integral floats) as decimal digits, as a file would hold them."""
    arr = np.asarray(values)
    if arr.dtype.kind == "S":
        return arr
    if arr.dtype.kind == "U":
        return np.char.encode(arr, "utf-8")
    if arr.dtype.kind in "iub":
        return arr.astype(np.int64).astype(str).astype(np.bytes_)
    out = []
    for v in arr.tolist():
        if v is None or (isinstance(v, float) and math.isnan(v)):
            out.append(b"")
        elif isinstance(v, bytes):
            out.append(v)
        elif isinstance(v, float) and v.is_integer():
            out.append(str(int(v)).encode())
        else:
            out.append(str(v).encode("utf-8"))
    return np.array(out, dtype=np.bytes_) if out else np.zeros(0, "S1")


def _to_numbers(values: Any, name: str, na_values: Sequence[str] = ()) -> np.ndarray:
    """Dense values as float64 (None / NaN / empty / one of ``na_values``: missing), by the
    rule of the files' reader (``data.parsing.fields``): an infinity, like text that is not
    a decimal number, is refused."""
    arr = np.asarray(values)
    if arr.dtype.kind in "iufb":
        parsed = arr.astype(np.float64)
        bad = np.isinf(parsed)
    else:
        parsed, bad = parse_numeric(missing_as_empty(_to_bytes(arr), na_values))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise DataError(f"column {name!r}, row {row}: {arr[row]!r} is not a finite number")
    return parsed


def _time_parts(
    values: Any, name: str, na_values: Sequence[str]
) -> Tuple[List[np.ndarray], np.ndarray]:
    """A time column's hour and weekday, and its days (the trend's raw value;
    ``data.parsing.time``): numbers as Unix seconds or milliseconds, text as ISO 8601,
    numpy/pandas datetimes as they are."""
    arr = np.asarray(values)
    if arr.dtype.kind == "M":
        seconds = arr.astype("datetime64[ms]").astype(np.int64) / 1000.0
        seconds[np.isnat(arr)] = np.nan
        return parts_of_seconds(seconds)[0], days_of_seconds(seconds)
    parts, days, bad = time_features(missing_as_empty(_to_bytes(arr), na_values))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"column {name!r}, row {row}: {arr[row]!r} is not a timestamp (Unix seconds or "
            "milliseconds, or an ISO 8601 date-time)"
        )
    return parts, days


def _columns_of(data: Any) -> Mapping[str, Any]:
    """A mapping of column name -> values from a mapping, a pandas DataFrame or a
    pyarrow Table (duck-typed: neither library is imported)."""
    if isinstance(data, Mapping):
        return data
    if hasattr(data, "column_names") and hasattr(data, "column"):  # pyarrow.Table
        return {name: data.column(name).to_pylist() for name in data.column_names}
    if hasattr(data, "columns") and hasattr(data, "__getitem__"):  # pandas.DataFrame
        return {str(name): data[name].to_numpy() for name in data.columns}
    raise TypeError(
        "predict takes a path, a 'KIND:PATH' string, a mapping of column -> values, a "
        f"pandas DataFrame or a pyarrow Table; got {type(data).__name__}"
    )


class ColumnsInput(Input):
    """In-memory columns by the schema's names (one block)."""

    def __init__(
        self, run: RunFolder, data: Any, *, labels: bool = False, keep: Optional[str] = None
    ) -> None:
        self.run, self.encoder = run, RunEncoder(run)
        self.name = "the given columns"
        self.columns = _columns_of(data)
        label = _label_name(run)
        self.time = list(run.time_columns())
        self.categorical = list(run.row_categorical_columns())
        self.dense = list(run.row_dense_columns())
        wanted = [*self.dense, *self.categorical, *self.time, *([keep] if keep else [])]
        missing = [c for c in wanted if c not in self.columns]
        if missing:
            raise DataError(
                f"no column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
                f"of the run's schema in the given columns ({list(self.columns)})"
            )
        if labels and label not in self.columns:
            raise DataError(f"no label column {label!r} in the given columns: evaluate needs it")
        lengths = {len(np.asarray(self.columns[c], dtype=object)) for c in wanted}
        if len(lengths) > 1:
            raise DataError(f"the given columns differ in length: {sorted(lengths)}")
        self.label, self.keep, self.has_labels = label, keep, labels

    def blocks(self) -> Iterator[EncodedBlock]:
        schema, columns = self.run.schema, self.columns
        na = self.run.na_values()
        dense_columns = [_to_numbers(columns[c], c, na) for c in self.dense]
        sparse: Any = [missing_as_empty(_to_bytes(columns[c]), na) for c in self.categorical]
        for name in self.time:
            parts, days = _time_parts(columns[name], name, na)
            sparse += parts
            if len(self.dense) < schema.n_dense:
                dense_columns.append(days)
        n = len(sparse[0])
        dense = np.stack(dense_columns, axis=1) if dense_columns else np.zeros((n, 0))
        if not self.encoder.text_ids:
            sparse = np.stack([np.asarray(columns[c], dtype=np.int64) for c in self.categorical], 1)
        if self.has_labels:
            labels, bad = check_labels(_to_numbers(columns[self.label], self.label))
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                raise DataError(f"column {self.label!r}, row {row}: the label is not 0 or 1")
        else:
            labels = np.full(n, np.nan, dtype=np.float32)
        block = RowBlock(
            path=self.name, lines=np.arange(1, n + 1), labels=labels, dense=dense, sparse=sparse
        )
        for c, name in enumerate(self.categorical):
            warning = self.encoder.numbers_for_text(c, np.asarray(columns[name]))
            if warning is not None:
                warnings.warn(warning, UnseenValuesWarning, stacklevel=4)
        check = self.encoder.check()
        problem = check(block.sparse) if check is not None and n else None
        if problem is not None:
            mask, reason, details = problem
            row = int(np.flatnonzero(mask)[0])
            raise DataError(f"row {row}: {reason}: {details[0]}")
        keep = None if self.keep is None else np.asarray(columns[self.keep], dtype=object)
        yield self.encoder.encode(block, keep)


def open_input(
    run: RunFolder,
    data: Any,
    *,
    labels: bool = False,
    delimiter: Optional[str] = None,
    keep: Optional[str] = None,
) -> Input:
    """The :class:`Input` of ``data`` (see the module docstring).

    Args:
        run: the run folder whose encoders apply.
        data: a path, ``KIND:PATH[,PATH...]``, a mapping of columns, a pandas
            ``DataFrame`` or a pyarrow ``Table``.
        labels: read the label column (evaluate); refused where there is none.
        delimiter: the files' field separator, if not the run's.
        keep: a column carried through to the output (an id).

    Raises:
        DataError: a missing column (named), a file of another layout, a bad row.
        DataOptionError: a spec of another kind than the run's.
        FileNotFoundError: a path that does not exist.
    """
    if not isinstance(data, (str, Path)):
        return ColumnsInput(run, data, labels=labels, keep=keep)
    text = str(data)
    kind, sep, rest = text.partition(":")
    if sep and kind.strip().lower() in source_kinds():
        if kind.strip().lower() != run.kind.name:
            raise DataOptionError(
                f"--data {text}: the run was trained on {run.kind.name}: data; give "
                f"{run.kind.name}:PATH or the path alone"
            )
        paths = [p.strip() for p in rest.split(",") if p.strip()]
    else:
        paths = [text]
    if not paths:
        raise DataOptionError(f"--data {text}: no path")
    if run.reader["format"] in ("text", "parquet"):
        paths = [str(Path(p).expanduser()) for p in paths]
        for p in paths:
            if not Path(p).exists():
                raise FileNotFoundError(f"data file not found: {p}")
    return FileInput(run, paths, labels=labels, delimiter=delimiter, keep=keep)

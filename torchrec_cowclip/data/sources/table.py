"""Generic tables: CSV, TSV or any delimited text, or parquet, with named label, dense and
sparse columns.

A text file's delimiter comes from its extension (``.csv`` comma, ``.tsv``/``.txt`` tab)
unless ``delimiter=`` (``--delimiter``) gives it; any other extension needs it. The first
line names the columns, unless the file has no header: ``header=False``
(``--no-header``), with ``columns=`` (``--columns a,b,c``) naming the fields in order (or
the positions ``0, 1, ...`` naming them), as pandas' ``header=None`` / ``names=``; giving
``columns`` alone also says there is no header. A UTF-8 byte-order mark before the first
line is dropped. Parquet is read in record batches through pyarrow, imported only when a
parquet file is opened (it is not a dependency of this project: ``pip install pyarrow``
to use it). Categorical values are used as text (an integer column's values as their
decimal digits) and encoded by vocabulary or FNV-1a hashing, exactly as for Avazu.

The column choice is checked before any row is read (``parsing.columns``): the label is
never a feature, a column is dense or categorical but not both, no name twice (names are
stripped: ``"price, age"`` is ``price`` and ``age``), and every name exists, with
``wrong delimiter?`` / ``no header?`` hints when a file's first line points there. Dense
columns take ``signed-log`` by default (``log(1 + x)`` of a count, mirrored for negative
values, so a signed column keeps its sign); ``--dense-transform`` chooses per column.

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.data import CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, open_dataset
    >>> ds = open_dataset("table:tests/data/criteo_sample.csv", tempfile.mkdtemp(),
    ...                   label="label", dense=CRITEO_DENSE_NAMES, sparse=CRITEO_SPARSE_NAMES)
    >>> ds.sparse.shape, float(ds.labels.sum()) >= 0, ds.dense_transforms[0]
    ((200, 26), True, 'signed-log')
    >>> columns = ["label", *CRITEO_DENSE_NAMES, *CRITEO_SPARSE_NAMES]
    >>> tsv = open_dataset("table:tests/data/criteo_sample.tsv", tempfile.mkdtemp(),
    ...                    columns=columns, label="label", sparse=CRITEO_SPARSE_NAMES)
    >>> len(tsv), tsv.schema.n_dense
    (200, 0)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.errors import BadRowLog, DataError, DataOptionError
from torchrec_cowclip.data.parsing.columns import (
    check_choice,
    check_file_columns,
    first_line,
    guess_delimiter,
    normalize_names,
    parse_delimiter,
    shown_delimiter,
    split_line,
)
from torchrec_cowclip.data.parsing.delimited import infer_delimiter
from torchrec_cowclip.data.parsing.dense import DenseTransformSpec
from torchrec_cowclip.data.parsing.fields import check_labels, parse_numeric
from torchrec_cowclip.data.parsing.rows import (
    RowBlock,
    SparseCheck,
    TextLayout,
    missing_as_empty,
    no_labels,
    validate_block,
)
from torchrec_cowclip.data.parsing.time import (
    TREND_TRANSFORM,
    days_of_seconds,
    parts_of_seconds,
    seconds_of_arrow,
    time_feature_names,
    time_features,
    trend_feature_names,
)
from torchrec_cowclip.data.pipeline.cache import fingerprint
from torchrec_cowclip.data.pipeline.encode import (
    Conversion,
    EncodedOptions,
    text_conversion,
    text_payload,
)
from torchrec_cowclip.data.registry import SourceKind, register_source
from torchrec_cowclip.data.source_options import option_field

PARQUET_SUFFIXES = (".parquet", ".pq")
_PARQUET_BATCH = 65536


def is_parquet(path: Union[str, Path]) -> bool:
    return Path(path).suffix.lower() in PARQUET_SUFFIXES


def _pyarrow() -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reading parquet needs pyarrow, which this project does not install: pip install pyarrow"
        ) from e
    return pyarrow


class ParquetRowSource:
    """Row blocks of parquet files (label, dense and sparse columns by name; ``label=None``
    reads no label: every label is NaN). Each ``time`` column becomes its hour of day and
    day of week after the categoricals (:mod:`~torchrec_cowclip.data.parsing.time`; a
    parquet timestamp or date column as it is) and, with ``trend``, its days after the
    dense columns."""

    def __init__(
        self,
        label: Optional[str],
        dense: Sequence[str],
        sparse: Sequence[str],
        na_values: Sequence[str] = (),
        time: Sequence[str] = (),
        trend: bool = False,
    ) -> None:
        self.label, self.dense, self.sparse = label, list(dense), list(sparse)
        self.na_values = tuple(na_values)
        self.time = list(time)
        self.trend = trend

    def _open(self, path: Union[str, Path]) -> Any:
        pa = _pyarrow()
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"data file not found: {p}")
        try:
            f = pa.parquet.ParquetFile(p)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{p}: not a readable parquet file ({e})", path=p) from e
        names = f.schema_arrow.names
        missing = [c for c in self._columns() if c not in names]
        if missing:
            raise DataError(f"{p}: no columns {missing}; columns are {names}", path=p)
        if f.metadata.num_rows == 0:
            raise DataError(f"data file is empty: {p}", path=p)
        return f

    def _columns(self) -> List[str]:
        labeled = [] if self.label is None else [self.label]
        return list(dict.fromkeys([*labeled, *self.dense, *self.sparse, *self.time]))

    def names(self, path: Union[str, Path]) -> Tuple[List[str], List[str]]:
        self._open(path)
        trend = trend_feature_names(self.time) if self.trend else []
        return [*self.dense, *trend], [*self.sparse, *time_feature_names(self.time)]

    def _time_parts(
        self, pa: Any, batch: Any
    ) -> Tuple[List[np.ndarray], List[np.ndarray], List[Tuple[str, np.ndarray, np.ndarray]]]:
        """The time columns' parts, days and ``(column, bad mask, raw fields)`` of one
        batch."""
        parts: List[np.ndarray] = []
        days: List[np.ndarray] = []
        bad: List[Tuple[str, np.ndarray, np.ndarray]] = []
        for c in self.time:
            col = batch.column(c)
            seconds = seconds_of_arrow(pa, col)
            if seconds is not None:
                parts += parts_of_seconds(seconds)[0]
                days.append(days_of_seconds(seconds))
                continue
            raw = missing_as_empty(_as_bytes(pa, col), self.na_values)
            got, day, bad_t = time_features(raw)
            parts += got
            days.append(day)
            bad.append((c, bad_t, raw))
        return parts, days, bad

    def part_name(self, path: Union[str, Path]) -> str:
        return str(Path(path).resolve())

    def blocks(
        self, path: Union[str, Path], log: BadRowLog, sparse_check: Optional[SparseCheck] = None
    ) -> Iterator[RowBlock]:
        pa = _pyarrow()
        f = self._open(path)
        first_row = 1
        for batch in f.iter_batches(batch_size=_PARQUET_BATCH, columns=self._columns()):
            n = batch.num_rows
            if self.label is None:
                raw_labels, labels, bad_label = no_labels(n)
            else:
                raw_labels = _as_bytes(pa, batch.column(self.label))
                labels, bad_label = check_labels(
                    _numeric(pa, batch.column(self.label), raw_labels)[0]
                )
            raw_dense = [
                missing_as_empty(_as_bytes(pa, batch.column(c)), self.na_values) for c in self.dense
            ]
            dense = np.empty((n, len(self.dense)))
            bad_dense = np.zeros((n, len(self.dense)), dtype=bool)
            for j, c in enumerate(self.dense):
                dense[:, j], bad_dense[:, j] = _numeric(pa, batch.column(c), raw_dense[j])
            time, days, bad_time = self._time_parts(pa, batch)
            if self.trend:  # after the dense columns (their bad values: bad_time)
                dense = np.concatenate([dense, *(d[:, None] for d in days)], axis=1)
            block = RowBlock(
                path=str(path),
                lines=np.arange(first_row, first_row + n, dtype=np.int64),
                labels=labels,
                dense=dense,
                sparse=[
                    missing_as_empty(_as_bytes(pa, batch.column(c)), self.na_values)
                    for c in self.sparse
                ]
                + time,
            )
            first_row += n
            block = validate_block(
                block,
                log,
                bad_label,
                bad_dense,
                self.dense,
                raw_labels,
                raw_dense,
                sparse_check,
                bad_time=bad_time,
            )
            if len(block):
                yield block


def _as_bytes(pa: Any, col: Any) -> np.ndarray:
    """A parquet column as an ``S`` array of its text (null -> ``b""``)."""
    if not (
        pa.types.is_string(col.type)
        or pa.types.is_large_string(col.type)
        or pa.types.is_binary(col.type)
    ):
        col = pa.compute.cast(col, pa.string())
    values = col.to_pylist()
    return np.array(
        [b"" if v is None else (v if isinstance(v, bytes) else v.encode()) for v in values],
        dtype=np.bytes_,
    )


def _numeric(pa: Any, col: Any, raw: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Float64 values (NaN = null) and a mask of non-numeric / non-finite values."""
    if (
        pa.types.is_integer(col.type)
        or pa.types.is_floating(col.type)
        or pa.types.is_boolean(col.type)
    ):
        values = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
        return values, np.isinf(values)
    return parse_numeric(raw)


def table_layout(
    label: str,
    dense: Sequence[str],
    sparse: Sequence[str],
    delimiter: Optional[str] = None,
    names: Optional[Sequence[str]] = None,
    na_values: Sequence[str] = (),
    time: Sequence[str] = (),
    trend: bool = False,
) -> TextLayout:
    """Layout of a text table: with a header naming its columns, or, given ``names`` (the
    columns of a header-less file, in order), without one."""
    if names is None:
        return TextLayout(
            delimiter=delimiter,
            header=True,
            label=label,
            dense=tuple(dense),
            sparse=tuple(sparse),
            na_values=tuple(na_values),
            time=tuple(time),
            trend=trend,
        )
    index = {n: i for i, n in enumerate(names)}
    return TextLayout(
        delimiter=delimiter,
        header=False,
        n_columns=len(names),
        label=index[label],
        dense=tuple(index[n] for n in dense),
        sparse=tuple(index[n] for n in sparse),
        dense_names=tuple(dense),
        sparse_names=tuple(sparse),
        na_values=tuple(na_values),
        time=tuple(index[n] for n in time),
        time_names=tuple(time) if time else None,
        trend=trend,
    )


@dataclass(frozen=True)
class ColumnOptions(EncodedOptions):
    """Options of the sources whose columns are chosen by name (tables, Avazu).

    Args:
        label, dense, sparse: column names (surrounding whitespace stripped).
        delimiter: field separator of text files (default: from the extension): one
            character, or ``tab``, ``comma``, ``semicolon``, ``pipe``, ``space``.
        dense_transform: as for every kind; the default here is ``signed-log``.
    """

    where: ClassVar[str] = "table"

    dense_transform: str = option_field("signed-log", "--dense-transform")
    label: Optional[str] = option_field(None, "--label")
    dense: Optional[Sequence[str]] = option_field(None, "--dense")
    sparse: Optional[Sequence[str]] = option_field(None, "--sparse")
    delimiter: Optional[str] = option_field(None, "--delimiter")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.label is not None:
            object.__setattr__(self, "label", str(self.label).strip())
        object.__setattr__(self, "dense", normalize_names(self.dense, "--dense"))
        object.__setattr__(self, "sparse", normalize_names(self.sparse, "--sparse"))
        if self.delimiter is not None:
            object.__setattr__(self, "delimiter", parse_delimiter(self.delimiter))
        check_choice(self.label, self.dense or (), self.sparse or (), self.where)
        self.dense_spec().check_names([*(self.dense or ()), *self.derived_dense()], self.where)

    def derived_dense(self) -> List[str]:
        """The dense features the source derives from other columns (none here)."""
        return []

    def wanted(self, label: Optional[str] = None) -> Dict[str, Sequence[str]]:
        """The chosen columns by flag (``label`` standing in for an unset label)."""
        chosen = self.label if self.label is not None else label
        return {
            "--label": [chosen] if chosen is not None else [],
            "--dense": list(self.dense or ()),
            "--sparse": list(self.sparse or ()),
        }

    def key_columns(self) -> Dict[str, Any]:
        """The column choices as they enter the cache key."""
        return {
            "label": self.label,
            "dense": list(self.dense) if self.dense is not None else None,
            "sparse": list(self.sparse) if self.sparse is not None else None,
            "delimiter": self.delimiter,
        }


def column_payload(args: List[str], test_paths: List[str], opts: ColumnOptions) -> Dict[str, Any]:
    """The cache key payload of a source with named columns (FNV-1a hashing)."""
    return text_payload(args, test_paths, opts, "fnv", opts.key_columns())


@dataclass(frozen=True)
class TableOptions(ColumnOptions):
    """``table:`` options: ``label`` and ``sparse`` are required.

    Args:
        header: whether a text file's first line names its columns (``--no-header``:
            it does not).
        columns: the columns of header-less text files, in order (``--columns``); giving
            them says there is no header. Without them a header-less file's columns are
            named by position, ``0, 1, ...``.
        na_values: texts that mean a missing value in the dense and categorical columns
            besides the empty field or a parquet null (``--na-values N/A,-``, as pandas'
            ``na_values=``): a dense one then takes the missing value's path (0 after the
            transform, ``--missing-indicator``), a categorical one the missing id.
        time_columns: columns read as timestamps (``--time-columns``), each becoming
            two categorical features, its hour of day and day of week
            (:mod:`~torchrec_cowclip.data.parsing.time`).
        time_trend: each time column also a dense feature, its time since the training
            split's start (``NAME_days``, min-max on the training split; ``--time-trend``).
    """

    header: bool = option_field(True, "--no-header")
    columns: Optional[Sequence[str]] = option_field(None, "--columns")
    na_values: Optional[Sequence[str]] = option_field(None, "--na-values")
    time_columns: Optional[Sequence[str]] = option_field(None, "--time-columns")
    time_trend: bool = option_field(False, "--time-trend")

    def __post_init__(self) -> None:
        if self.label is None or self.sparse is None:
            raise DataOptionError(
                "table: sources need label= (--label) and sparse= (--sparse) column names "
                "(and dense= (--dense), possibly empty)"
            )
        super().__post_init__()
        names = normalize_names(self.columns, "--columns")
        object.__setattr__(self, "columns", names)
        if self.na_values is not None:
            na = tuple(dict.fromkeys(str(v).strip() for v in self.na_values))
            if not na or "" in na:
                raise DataOptionError(
                    f"na_values (--na-values): expected texts such as N/A,-, got {self.na_values!r} "
                    "(an empty field is missing already)"
                )
            object.__setattr__(self, "na_values", na)
        time = normalize_names(self.time_columns, "--time-columns")
        object.__setattr__(self, "time_columns", time or None)
        if self.time_trend and not time:
            raise DataOptionError(
                f"{self.where}: time_trend (--time-trend) adds a trend per time column: "
                "declare them with --time-columns"
            )
        taken = {self.label: "--label", **dict.fromkeys(self.dense or (), "--dense")}
        taken.update(dict.fromkeys(self.sparse or (), "--sparse"))
        for t in time or ():
            if t in taken:
                raise DataOptionError(
                    f"{self.where}: time column {t!r} (--time-columns) is also {taken[t]}: a "
                    "time column becomes its hour of day and day of week; drop it from "
                    f"{taken[t]}"
                )
        if names is not None:
            object.__setattr__(self, "header", False)
            check_choice(self.label, self.dense or (), self.sparse or (), self.where, names)
            missing = [t for t in time or () if t not in names]
            if missing:
                raise DataOptionError(
                    f"{self.where}: no column {', '.join(map(repr, missing))} "
                    f"(--time-columns); the columns are {list(names)}"
                )

    def wanted(self, label: Optional[str] = None) -> Dict[str, Sequence[str]]:
        return {**super().wanted(label), "--time-columns": list(self.time_columns or ())}

    def key_columns(self) -> Dict[str, Any]:
        d = super().key_columns()
        if not self.header:  # only then, so header files keep the keys they had
            d.update(header=False, columns=list(self.columns or ()) or None)
        if self.na_values:
            d.update(na_values=list(self.na_values))
        if self.time_columns:
            d.update(time_columns=list(self.time_columns))
        if self.time_trend:
            d.update(time_trend=True)
        return d

    def derived_dense(self) -> List[str]:
        """The trend features (``time_trend``), after the dense columns."""
        if not self.time_trend:
            return []
        return trend_feature_names(normalize_names(self.time_columns, "--time-columns") or ())

    def dense_spec(self) -> DenseTransformSpec:
        """:attr:`dense_transform` parsed; with ``time_trend``, each trend feature takes
        ``minmax`` (the training split's start and span) unless named."""
        spec = super().dense_spec()
        trend = [n for n in self.derived_dense() if n not in spec.named()]
        if not trend:
            return spec
        return replace(spec, columns=(*spec.columns, *((n, TREND_TRANSFORM) for n in trend)))

    def names(self, path: Union[str, Path], delimiter: str) -> Optional[List[str]]:
        """The columns of a header-less file (None for a file with a header)."""
        if self.header:
            return None
        if self.columns is not None:
            return list(self.columns)
        return [str(i) for i in range(len(split_line(first_line(path), delimiter)))]


def text_delimiter(path: Union[str, Path], given: Optional[str]) -> str:
    """The delimiter of a text table: ``given``, else the one its extension implies.

    Raises:
        DataOptionError: neither says (the message suggests one from the first line).
    """
    if given is not None:
        return given
    inferred = infer_delimiter(path)
    if inferred is not None:
        return inferred.decode()
    guess = guess_delimiter(first_line(path))
    suggestion = (
        f" (its first line splits on {shown_delimiter(guess)}: --delimiter "
        f"{shown_delimiter(guess)})"
        if guess
        else ""
    )
    raise DataOptionError(
        f"{path}: cannot tell the delimiter from the extension {Path(path).suffix or '(none)'!r}"
        f" (.csv is comma, .tsv/.txt tab): give --delimiter{suggestion}"
    )


@register_source
class TableSource(SourceKind, name="table", usage="table:PATH[,PATH...]", options=TableOptions):
    """``table:PATH[,PATH...]``: delimited text or parquet files with named columns."""

    def check_sources(self, args: List[str], test_paths: List[str], opts: TableOptions) -> None:
        all_paths = [*args, *test_paths]
        if self._is_parquet(all_paths):
            given = [
                flag
                for flag, set_ in (
                    ("--delimiter", opts.delimiter is not None),
                    ("--no-header / --columns", not opts.header),
                )
                if set_
            ]
            if given:
                raise DataOptionError(
                    f"table: {' and '.join(given)} apply to text files; {all_paths[0]} is parquet"
                )
            assert opts.label is not None and opts.sparse is not None  # TableOptions checked
            for p in all_paths:
                ParquetRowSource(
                    opts.label, opts.dense or (), opts.sparse, time=opts.time_columns or ()
                ).names(p)
            return
        for p in all_paths:
            check_file_columns(
                p,
                text_delimiter(p, opts.delimiter),
                opts.wanted(),
                header=opts.header,
                columns=opts.columns,
            )

    def payload(self, args: List[str], test_paths: List[str], opts: TableOptions) -> Dict[str, Any]:
        return column_payload(args, test_paths, opts)

    def _is_parquet(self, all_paths: Sequence[str]) -> bool:
        kinds = {is_parquet(p) for p in all_paths}
        if len(kinds) > 1:
            raise DataOptionError(f"table: files must be all parquet or all text, got {all_paths}")
        return kinds == {True}

    def conversion(self, args: List[str], test_paths: List[str], opts: TableOptions) -> Conversion:
        assert opts.label is not None and opts.sparse is not None  # TableOptions checked them
        dense, sparse = list(opts.dense or ()), list(opts.sparse)
        if not self._is_parquet([*args, *test_paths]):
            delimiter = text_delimiter(args[0], opts.delimiter)
            return text_conversion(
                table_layout(
                    opts.label,
                    dense,
                    sparse,
                    opts.delimiter,
                    opts.names(args[0], delimiter),
                    opts.na_values or (),
                    opts.time_columns or (),
                    opts.time_trend,
                ),
                args,
                test_paths,
                opts,
                "fnv",
                layout_name="table",
                source_format="delimited text",
            )
        layout: Dict[str, Any] = {
            "layout": "parquet",
            "label": opts.label,
            "dense": dense,
            "sparse": sparse,
        }
        if opts.na_values:
            layout["na_values"] = list(opts.na_values)
        if opts.time_columns:
            layout["time"] = list(opts.time_columns)
        if opts.time_trend:
            layout["trend"] = True
        return Conversion(
            ParquetRowSource(
                opts.label,
                dense,
                sparse,
                opts.na_values or (),
                opts.time_columns or (),
                opts.time_trend,
            ),
            args,
            test_paths,
            opts.encoding("fnv"),
            stats_key={"train": fingerprint(args), "layout": layout},
            dense_transform=opts.dense_spec().text(),
            on_bad_row=opts.on_bad_row,
            source_format="parquet",
            where="table",
        )

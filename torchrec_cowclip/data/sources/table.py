"""Generic tables: CSV, TSV or parquet files with named label, dense and sparse columns.

Text files need a header line naming the columns; the delimiter comes from the
extension (``.csv`` comma, ``.tsv``/``.txt`` tab) unless given. Parquet is read in
record batches through pyarrow, imported only when a parquet file is opened (it is
not a dependency of this project: ``pip install pyarrow`` to use it). Categorical
values are used as text (an integer column's values as their decimal digits) and
encoded by vocabulary or FNV-1a hashing, exactly as for Avazu. A text table has a
header by definition (a UTF-8 byte-order mark before it is dropped); ``label=``
(``--label``) and ``sparse=`` (``--sparse``) must name its columns.

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.data import CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, open_dataset
    >>> ds = open_dataset("table:tests/data/criteo_sample.csv", tempfile.mkdtemp(),
    ...                   label="label", dense=CRITEO_DENSE_NAMES, sparse=CRITEO_SPARSE_NAMES)
    >>> ds.sparse.shape, float(ds.labels.sum()) >= 0
    ((200, 26), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.errors import BadRowLog, DataError, DataOptionError
from torchrec_cowclip.data.options import option_field
from torchrec_cowclip.data.parsing.delimited import infer_delimiter
from torchrec_cowclip.data.parsing.fields import check_labels, parse_numeric
from torchrec_cowclip.data.parsing.rows import (
    RowBlock,
    SparseCheck,
    TextLayout,
    no_labels,
    validate_block,
)
from torchrec_cowclip.data.pipeline.cache import fingerprint
from torchrec_cowclip.data.pipeline.encode import (
    Conversion,
    EncodedOptions,
    text_conversion,
    text_payload,
)
from torchrec_cowclip.data.registry import SourceKind, register_source

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
    reads no label: every label is NaN)."""

    def __init__(self, label: Optional[str], dense: Sequence[str], sparse: Sequence[str]) -> None:
        self.label, self.dense, self.sparse = label, list(dense), list(sparse)

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
        return list(dict.fromkeys([*labeled, *self.dense, *self.sparse]))

    def names(self, path: Union[str, Path]) -> Tuple[List[str], List[str]]:
        self._open(path)
        return list(self.dense), list(self.sparse)

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
            raw_dense = [_as_bytes(pa, batch.column(c)) for c in self.dense]
            dense = np.empty((n, len(self.dense)))
            bad_dense = np.zeros((n, len(self.dense)), dtype=bool)
            for j, c in enumerate(self.dense):
                dense[:, j], bad_dense[:, j] = _numeric(pa, batch.column(c), raw_dense[j])
            block = RowBlock(
                path=str(path),
                lines=np.arange(first_row, first_row + n, dtype=np.int64),
                labels=labels,
                dense=dense,
                sparse=[_as_bytes(pa, batch.column(c)) for c in self.sparse],
            )
            first_row += n
            block = validate_block(
                block, log, bad_label, bad_dense, self.dense, raw_labels, raw_dense, sparse_check
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
    label: str, dense: Sequence[str], sparse: Sequence[str], delimiter: Optional[str] = None
) -> TextLayout:
    """Layout of a text table with a header naming its columns."""
    return TextLayout(
        delimiter=delimiter, header=True, label=label, dense=tuple(dense), sparse=tuple(sparse)
    )


@dataclass(frozen=True)
class ColumnOptions(EncodedOptions):
    """Options of the sources whose columns are chosen by name (tables, Avazu).

    Args:
        label, dense, sparse: column names.
        delimiter: field separator of text files (default: from the extension).
    """

    label: Optional[str] = option_field(None, "--label")
    dense: Optional[Sequence[str]] = option_field(None, "--dense")
    sparse: Optional[Sequence[str]] = option_field(None, "--sparse")
    delimiter: Optional[str] = option_field(None)

    def columns(self) -> Dict[str, Any]:
        """The column choices as they enter the cache key."""
        return {
            "label": self.label,
            "dense": list(self.dense) if self.dense is not None else None,
            "sparse": list(self.sparse) if self.sparse is not None else None,
            "delimiter": self.delimiter,
        }


def column_payload(args: List[str], test_paths: List[str], opts: ColumnOptions) -> Dict[str, Any]:
    """The cache key payload of a source with named columns (FNV-1a hashing)."""
    return text_payload(args, test_paths, opts, "fnv", opts.columns())


@dataclass(frozen=True)
class TableOptions(ColumnOptions):
    """``table:`` options: ``label`` and ``sparse`` are required."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.label is None or self.sparse is None:
            raise DataOptionError(
                "table: sources need label= (--label) and sparse= (--sparse) column names "
                "(and dense= (--dense), possibly empty)"
            )


@register_source
class TableSource(SourceKind, name="table", usage="table:PATH[,PATH...]", options=TableOptions):
    """``table:PATH[,PATH...]``: CSV/TSV/parquet files with named columns."""

    def payload(self, args: List[str], test_paths: List[str], opts: TableOptions) -> Dict[str, Any]:
        self._is_parquet(args, test_paths, opts)  # refuses mixed or undelimitable files up front
        return column_payload(args, test_paths, opts)

    def _is_parquet(self, args: List[str], test_paths: List[str], opts: TableOptions) -> bool:
        all_paths = [*args, *test_paths]
        kinds = {is_parquet(p) for p in all_paths}
        if len(kinds) > 1:
            raise DataOptionError(f"table: files must be all parquet or all text, got {all_paths}")
        if kinds == {False} and opts.delimiter is None:
            for p in all_paths:
                if infer_delimiter(p) is None:
                    raise DataOptionError(
                        f"cannot infer the delimiter of {p} from its extension; pass delimiter="
                    )
        return kinds == {True}

    def conversion(self, args: List[str], test_paths: List[str], opts: TableOptions) -> Conversion:
        assert opts.label is not None and opts.sparse is not None  # TableOptions checked them
        dense, sparse = list(opts.dense or ()), list(opts.sparse)
        if not self._is_parquet(args, test_paths, opts):
            return text_conversion(
                table_layout(opts.label, dense, sparse, opts.delimiter),
                args,
                test_paths,
                opts,
                "fnv",
                layout_name="table",
                source_format="delimited text",
            )
        layout = {"layout": "parquet", "label": opts.label, "dense": dense, "sparse": sparse}
        return Conversion(
            ParquetRowSource(opts.label, dense, sparse),
            args,
            test_paths,
            opts.encoding("fnv"),
            stats_key={"train": fingerprint(args), "layout": layout},
            dense_transform=opts.dense_transform,
            on_bad_row=opts.on_bad_row,
            source_format="parquet",
        )

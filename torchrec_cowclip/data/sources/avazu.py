"""Avazu click logs: CSV with a header, label ``click``, 22 categorical columns.

The ``id`` column is an impression id (unique per row) and is dropped; every other
column, ``hour`` included, is categorical, as in the reference. There are no dense
columns. Encoding is the exact vocabulary or 64-bit FNV-1a hashing (Avazu values are
not all hex). The file has a header by definition (a UTF-8 byte-order mark before it
is dropped).

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.data import open_dataset
    >>> ds = open_dataset("avazu:tests/data/avazu_sample.csv", tempfile.mkdtemp())
    >>> ds.dense.shape, ds.sparse.shape, ds.schema.sparse_names[:3]
    ((100, 0), (100, 22), ('hour', 'C1', 'banner_pos'))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Union

from torchrec_cowclip.data.errors import DataError
from torchrec_cowclip.data.parsing.columns import check_file_columns
from torchrec_cowclip.data.parsing.delimited import read_header
from torchrec_cowclip.data.parsing.rows import TextLayout
from torchrec_cowclip.data.pipeline.encode import Conversion, text_conversion
from torchrec_cowclip.data.registry import SourceKind, register_source
from torchrec_cowclip.data.sources.table import ColumnOptions, column_payload

AVAZU_LABEL = "click"
AVAZU_DROPPED = ("id",)
AVAZU_N_SPARSE = 22


def avazu_layout(
    path: Union[str, Path],
    label: Optional[str] = None,
    dense: Optional[Sequence[str]] = None,
    sparse: Optional[Sequence[str]] = None,
    delimiter: Optional[str] = None,
) -> TextLayout:
    """The layout of an Avazu file, from its header.

    Defaults: label ``click``, no dense columns, every column other than ``id`` and
    the label categorical.
    """
    header = read_header(path, delimiter=delimiter or ",")
    label = label or AVAZU_LABEL
    if label not in header:
        raise DataError(f"{path}: no label column {label!r}; columns are {header}", path=path)
    dense = tuple(dense or ())
    if sparse is None:
        sparse = tuple(
            c for c in header if c != label and c not in AVAZU_DROPPED and c not in dense
        )
    return TextLayout(
        delimiter=delimiter or ",", header=True, label=label, dense=dense, sparse=tuple(sparse)
    )


@dataclass(frozen=True)
class AvazuOptions(ColumnOptions):
    """``avazu:`` options: the columns default to Avazu's (see :func:`avazu_layout`)."""

    where: ClassVar[str] = "avazu"


@register_source
class AvazuSource(SourceKind, name="avazu", usage="avazu:PATH[,PATH...]", options=AvazuOptions):
    """``avazu:PATH[,PATH...]``: Avazu CSV files; categoricals hashed with FNV-1a."""

    def check_sources(self, args: List[str], test_paths: List[str], opts: AvazuOptions) -> None:
        for p in [*args, *test_paths]:
            check_file_columns(
                p, opts.delimiter or ",", opts.wanted(label=AVAZU_LABEL), where=self.name
            )

    def payload(self, args: List[str], test_paths: List[str], opts: AvazuOptions) -> Dict[str, Any]:
        return column_payload(args, test_paths, opts)

    def conversion(self, args: List[str], test_paths: List[str], opts: AvazuOptions) -> Conversion:
        layout = avazu_layout(args[0], opts.label, opts.dense, opts.sparse, opts.delimiter)
        return text_conversion(
            layout, args, test_paths, opts, "fnv", layout_name="avazu", source_format="avazu csv"
        )

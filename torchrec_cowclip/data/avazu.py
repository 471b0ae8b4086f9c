"""Avazu click logs: CSV with a header, label ``click``, 22 categorical columns.

The ``id`` column is an impression id (unique per row) and is dropped; every other
column, ``hour`` included, is categorical, as in the reference. There are no dense
columns. Encoding is the exact vocabulary or 64-bit FNV-1a hashing (Avazu values are
not all hex).

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.data import open_dataset
    >>> ds = open_dataset("avazu:/work/shared/data/avazu_sample.csv", tempfile.mkdtemp())
    >>> ds.dense.shape, ds.sparse.shape, ds.schema.sparse_names[:3]
    ((100, 0), (100, 22), ('hour', 'C1', 'banner_pos'))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

from torchrec_cowclip.data.delimited import read_header
from torchrec_cowclip.data.encode import EncodeOptions, convert_rows
from torchrec_cowclip.data.errors import DataError
from torchrec_cowclip.data.rows import TextLayout, TextRowSource

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
        sparse = tuple(c for c in header if c != label and c not in AVAZU_DROPPED and c not in dense)
    return TextLayout(
        delimiter=delimiter or ",", header=True, label=label, dense=dense, sparse=tuple(sparse)
    )


def convert_avazu(
    paths: Sequence[Union[str, Path]],
    test_paths: Sequence[Union[str, Path]],
    out_dir: Path,
    opts: EncodeOptions,
    stats_cache: Union[str, Path],
    *,
    label: Optional[str] = None,
    dense: Optional[Sequence[str]] = None,
    sparse: Optional[Sequence[str]] = None,
    delimiter: Optional[str] = None,
) -> Dict[str, Any]:
    """Convert Avazu CSV files into cache arrays in ``out_dir``; returns meta fields."""
    layout = avazu_layout(paths[0], label=label, dense=dense, sparse=sparse, delimiter=delimiter)
    return convert_rows(
        TextRowSource(layout),
        paths,
        test_paths,
        out_dir,
        opts,
        stats_cache=stats_cache,
        stats_payload={"layout": "avazu", **layout.payload()},
        source_format="avazu csv",
    )

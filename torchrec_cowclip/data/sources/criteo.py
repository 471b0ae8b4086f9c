"""Criteo click logs in their raw layout: Kaggle ``train.txt`` and the 1TB ``day_N`` files.

One row per line: ``label, I1..I13, C1..C26``, tab-separated, no header; dense
values are integers (empty = missing, a few negative), categoricals are 8-hex-digit
hashes (empty = missing). gzip files (``day_0.gz``) are read as they are. Raw Criteo
has no header, so a first line is a data row like any other: a UTF-8 byte-order mark
before it is dropped, and a non-numeric label there is a bad row (an error, or
skipped under ``on_bad_row="skip"``). The one exception is the same layout
comma-separated with a header line (e.g. the project's ``tests/data/criteo_sample.csv``;
a ``.csv`` name selects the comma): a first line whose label and 13 dense fields are
all names (non-empty, not numbers) is taken as that header.

Categoricals are either label-encoded exactly (a vocabulary over the training files,
like the reference) or hashed with ``id = 1 + int(value, 16) % (hash_size - 1)``
(TorchRec's ``int(value, 16)`` convention); a non-hex value is then a bad row.
Parsing speeds are in docs/performance.md.

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.data import open_dataset
    >>> ds = open_dataset("criteo:tests/data/criteo_sample.tsv", tempfile.mkdtemp())
    >>> ds.dense.shape, ds.sparse.shape, ds.schema.sparse_names[:2]
    ((200, 13), (200, 26), ('C1', 'C2'))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from torchrec_cowclip.data.parsing.columns import parse_delimiter
from torchrec_cowclip.data.parsing.rows import TextLayout
from torchrec_cowclip.data.pipeline.encode import (
    Conversion,
    EncodedOptions,
    text_conversion,
    text_payload,
)
from torchrec_cowclip.data.registry import SourceKind, register_source
from torchrec_cowclip.data.schema import CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES
from torchrec_cowclip.data.source_options import option_field

CRITEO_LAYOUT = TextLayout(
    delimiter=None,
    fallback_delimiter="\t",
    header="auto",
    n_columns=1 + len(CRITEO_DENSE_NAMES) + len(CRITEO_SPARSE_NAMES),
    label=0,
    dense=tuple(range(1, 14)),
    sparse=tuple(range(14, 40)),
    dense_names=CRITEO_DENSE_NAMES,
    sparse_names=CRITEO_SPARSE_NAMES,
)


@dataclass(frozen=True)
class CriteoOptions(EncodedOptions):
    """``criteo:`` options: those of every text source, and the delimiter.

    Args:
        delimiter: overrides the one implied by the file names (``--delimiter``).
        dense_transform: default ``log``: missing -> 0, negative values (a few in I2:
            noise) -> 0, counted and reported, then ``log(1 + x)``, as DLRM and TorchRec
            preprocess Criteo; ``minmax`` is the TF reference's scaling.
    """

    where: ClassVar[str] = "criteo"
    fixed_dense_names: ClassVar[Optional[Tuple[str, ...]]] = CRITEO_DENSE_NAMES

    delimiter: Optional[str] = option_field(None, "--delimiter")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delimiter is not None:
            object.__setattr__(self, "delimiter", parse_delimiter(self.delimiter))


@register_source
class CriteoSource(SourceKind, name="criteo", usage="criteo:PATH[,PATH...]", options=CriteoOptions):
    """``criteo:PATH[,PATH...]``: raw Criteo files; categoricals hashed as hex."""

    def _layout(self, opts: CriteoOptions) -> TextLayout:
        return (
            CRITEO_LAYOUT
            if opts.delimiter is None
            else replace(CRITEO_LAYOUT, delimiter=opts.delimiter)
        )

    def payload(
        self, args: List[str], test_paths: List[str], opts: CriteoOptions
    ) -> Dict[str, Any]:
        columns = {"label": None, "dense": None, "sparse": None, "delimiter": opts.delimiter}
        return text_payload(args, test_paths, opts, "hex", columns)

    def conversion(self, args: List[str], test_paths: List[str], opts: CriteoOptions) -> Conversion:
        return text_conversion(
            self._layout(opts),
            args,
            test_paths,
            opts,
            "hex",
            layout_name="criteo",
            source_format="criteo raw (label, I1..I13, C1..C26)",
        )

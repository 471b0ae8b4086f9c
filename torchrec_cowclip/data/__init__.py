"""CTR data for CowClip training: Criteo (raw and TorchRec npy), Avazu, generic tables,
synthetic Criteo-like logs; a verified memory-mapped cache; splits; TorchRec batches.

The public API is what this module exports; the submodules hold the parts (parsers,
encodings, the cache) for readers and for new source kinds (see ``registry``).

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.data import open_dataset
    >>> ds = open_dataset("criteo:tests/data/criteo_sample.tsv", tempfile.mkdtemp(),
    ...                   hash_size=100_000)
    >>> train, val, test = ds.split(test_fraction=0.1, val_fraction=0.1, seed=0)
    >>> for batch in ds.batches(train, batch_size=64, shuffle=True, seed=0, epoch=0):
    ...     pass
    >>> batch.sparse_features.keys()[:3], len(ds)
    (['C1', 'C2', 'C3'], 200)

The names built on TorchRec's batch types (the batches and the dataset that yields them)
load on first use, so that the rest - the schemas and Criteo Kaggle's cardinalities that
the GPU benchmark's torch-only part reads - imports without torchrec.
"""

__all__ = [
    "ArrayDataset",
    "BAD_DENSE",
    "BAD_HEX",
    "BAD_LABEL",
    "BAD_SPARSE_ID",
    "BatchIterator",
    "CRITEO_DENSE_NAMES",
    "CRITEO_KAGGLE_CARDINALITIES",
    "CRITEO_SPARSE_NAMES",
    "CTRDataset",
    "CacheCorrupt",
    "DENSE_CLIP",
    "DENSE_TRANSFORMS",
    "DataError",
    "DataOptionError",
    "DensePlan",
    "DenseStats",
    "DenseTransformSpec",
    "FileSourceOptions",
    "MISSING_ID",
    "OOV_ID",
    "PlantedModel",
    "SPEC_KINDS",
    "Schema",
    "SourceKind",
    "SourceOptions",
    "SyntheticConfig",
    "WRONG_COLUMN_COUNT",
    "epoch_order",
    "make_batch",
    "open_dataset",
    "parse_spec",
    "rank_auc",
    "register_source",
    "source_kinds",
    "split_indices",
    "synthetic_arrays",
]

from typing import TYPE_CHECKING

from torchrec_cowclip._lazy import lazy_exports
from torchrec_cowclip.data.errors import (
    BAD_DENSE,
    BAD_HEX,
    BAD_LABEL,
    BAD_SPARSE_ID,
    WRONG_COLUMN_COUNT,
    DataError,
    DataOptionError,
)
from torchrec_cowclip.data.parsing.dense import (
    DENSE_CLIP,
    DENSE_TRANSFORMS,
    DensePlan,
    DenseStats,
    DenseTransformSpec,
)
from torchrec_cowclip.data.parsing.vocab import MISSING_ID, OOV_ID
from torchrec_cowclip.data.pipeline.cache import CacheCorrupt
from torchrec_cowclip.data.pipeline.splits import split_indices
from torchrec_cowclip.data.registry import SourceKind, register_source, source_kinds
from torchrec_cowclip.data.schema import (
    CRITEO_DENSE_NAMES,
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_SPARSE_NAMES,
    Schema,
)
from torchrec_cowclip.data.source_options import FileSourceOptions, SourceOptions
from torchrec_cowclip.data.sources.synthetic import (
    PlantedModel,
    SyntheticConfig,
    rank_auc,
    synthetic_arrays,
)

if TYPE_CHECKING:
    from torchrec_cowclip.data.pipeline.batches import (
        ArrayDataset,
        BatchIterator,
        epoch_order,
        make_batch,
    )
    from torchrec_cowclip.data.pipeline.dataset import (
        SPEC_KINDS,
        CTRDataset,
        open_dataset,
        parse_spec,
    )

_LAZY = {
    **dict.fromkeys(
        ("ArrayDataset", "BatchIterator", "epoch_order", "make_batch"),
        "torchrec_cowclip.data.pipeline.batches",
    ),
    **dict.fromkeys(
        ("SPEC_KINDS", "CTRDataset", "open_dataset", "parse_spec"),
        "torchrec_cowclip.data.pipeline.dataset",
    ),
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

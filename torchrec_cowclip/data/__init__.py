"""CTR data for CowClip training: Criteo (raw and TorchRec npy), Avazu, generic tables,
synthetic Criteo-like logs; a memory-mapped cache; splits; TorchRec batches.

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.data import open_dataset
    >>> ds = open_dataset("criteo:/work/shared/data/criteo_sample.tsv", tempfile.mkdtemp(),
    ...                   hash_size=100_000)
    >>> train, val, test = ds.split(test_fraction=0.1, val_fraction=0.1, seed=0)
    >>> for batch in ds.batches(train, batch_size=64, shuffle=True, seed=0, epoch=0):
    ...     pass
    >>> batch.sparse_features.keys()[:3], len(ds)
    (['C1', 'C2', 'C3'], 200)
"""

from torchrec_cowclip.data.batches import ArrayDataset, BatchIterator, epoch_order, make_batch
from torchrec_cowclip.data.cache import CACHE_VERSION, build_entry, cache_key, read_meta
from torchrec_cowclip.data.criteo import CRITEO_LAYOUT, convert_criteo
from torchrec_cowclip.data.criteo_npy import convert_criteo_npy, find_npy_days
from torchrec_cowclip.data.dataset import SPEC_KINDS, CTRDataset, open_dataset, parse_spec
from torchrec_cowclip.data.dense import DENSE_TRANSFORMS, DenseStats, transform_dense
from torchrec_cowclip.data.encode import EncodeOptions, convert_rows
from torchrec_cowclip.data.errors import (
    BAD_DENSE,
    BAD_HEX,
    BAD_LABEL,
    BAD_SPARSE_ID,
    WRONG_COLUMN_COUNT,
    BadRowLog,
    DataError,
)
from torchrec_cowclip.data.hashing import HashEncoder, fnv1a64, fnv1a64_scalar, hex_to_uint64
from torchrec_cowclip.data.schema import (
    CRITEO_DENSE_NAMES,
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_SPARSE_NAMES,
    Schema,
)
from torchrec_cowclip.data.splits import split_indices
from torchrec_cowclip.data.synthetic import (
    PlantedModel,
    SyntheticConfig,
    fit_zipf_exponent,
    rank_auc,
    synthetic_arrays,
)
from torchrec_cowclip.data.vocab import MISSING_ID, OOV_ID, Vocabulary

__all__ = [
    "ArrayDataset",
    "BAD_DENSE",
    "BAD_HEX",
    "BAD_LABEL",
    "BAD_SPARSE_ID",
    "BadRowLog",
    "BatchIterator",
    "CACHE_VERSION",
    "CRITEO_DENSE_NAMES",
    "CRITEO_KAGGLE_CARDINALITIES",
    "CRITEO_LAYOUT",
    "CRITEO_SPARSE_NAMES",
    "CTRDataset",
    "DENSE_TRANSFORMS",
    "DataError",
    "DenseStats",
    "EncodeOptions",
    "HashEncoder",
    "MISSING_ID",
    "OOV_ID",
    "PlantedModel",
    "SPEC_KINDS",
    "Schema",
    "SyntheticConfig",
    "Vocabulary",
    "WRONG_COLUMN_COUNT",
    "build_entry",
    "cache_key",
    "convert_criteo",
    "convert_criteo_npy",
    "convert_rows",
    "epoch_order",
    "find_npy_days",
    "fit_zipf_exponent",
    "fnv1a64",
    "fnv1a64_scalar",
    "hex_to_uint64",
    "make_batch",
    "open_dataset",
    "parse_spec",
    "rank_auc",
    "read_meta",
    "split_indices",
    "synthetic_arrays",
    "transform_dense",
]

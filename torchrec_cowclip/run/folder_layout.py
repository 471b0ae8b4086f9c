"""What a run folder (``<out>/model/``) is made of: its file and directory names, its
format and version, the keys of its descriptions, and the error that refuses one
(:mod:`~torchrec_cowclip.run.model_folder` reads a folder, :mod:`.folder_writer` writes
one, :mod:`.folder_checks` checks one).

Example::

    >>> jsonable({"hidden": (8, 4)}), VERSION_DIGESTS[VERSION]
    ({'hidden': [8, 4]}, 'sha256')
"""

from __future__ import annotations

from typing import Any, Mapping

from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.readback import CRC32, SHA256

MODEL_DIR = "model"

MANIFEST = "manifest.json"

MODEL_FILE = "model.json"

DATA_FILE = "data.json"

WEIGHTS_DIR = "weights"

ENCODERS_DIR = "encoders"

FORMAT = "torchrec_cowclip run folder"

#: The run-folder format this version writes (2: SHA-256 per file); it reads 1 and 2.
VERSION = 2

#: The digest each format version's manifest records per file.
VERSION_DIGESTS = {1: CRC32, 2: SHA256}

#: The most bytes a description (manifest.json, model.json, data.json) may have.
MAX_DESCRIPTION_BYTES = 64 << 20

#: The key of the model's tensors in a weights checkpoint.
WEIGHTS_KEY = "weights"

#: How the weights a run reported are named: the last step's, or early stopping's best.
WEIGHT_NAMES = ("final", "best")

#: The keys of ``model.json`` (:func:`describe_model`) and ``data.json`` (:func:`describe_data`).
MODEL_KEYS = (
    "model",
    "arguments",
    "weights",
    "reported",
    "metrics",
    "eval_batch_size",
    "init_from",
    "config",
    "torchrec_cowclip",
)

DATA_KEYS = (
    "kind",
    "spec",
    "test_spec",
    "options",
    "schema",
    "reader",
    "encoder",
    "dense_transforms",
    "dense_plan",
    "source_format",
    "rows",
)

#: The model factory's arguments a run folder keeps (:meth:`ModelSpec.arguments <torchrec_cowclip.models.spec.ModelSpec.arguments>`).
ARGUMENTS = (
    "num_dense",
    "sparse_names",
    "cardinalities",
    "embedding_dim",
    "hidden",
    "cross_layers",
    "init_std",
    "embedding_backend",
    "embedding_dtype",
    "init_seed",
)


class RunFolderError(ConfigError):
    """A run folder that cannot be used as it is (missing, of another format or a newer
    version, changed since it was written); the message names the file."""


def jsonable(value: Any) -> Any:
    """``value`` with tuples (and nested tuples) as lists, as JSON holds them."""
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value

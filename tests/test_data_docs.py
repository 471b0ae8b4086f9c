"""The usage examples in the data package's docstrings run and say what they show."""

from __future__ import annotations

import doctest
import importlib
import inspect
from pathlib import Path

import pytest

MODULES = [
    "errors",
    "schema",
    "fields",
    "delimited",
    "hashing",
    "vocab",
    "dense",
    "rows",
    "npyfile",
    "cache",
    "encode",
    "criteo",
    "avazu",
    "table",
    "criteo_npy",
    "synthetic",
    "splits",
    "batches",
    "dataset",
    "__init__",
]
# Some examples read the project's sample files by their absolute path.
SHARED = Path("/work/shared/data")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(
        "torchrec_cowclip.data" + ("" if name == "__init__" else f".{name}")
    )
    if "/work/shared/data" in inspect.getsource(module) and not SHARED.exists():
        pytest.skip("examples use /work/shared/data")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0

"""The usage examples in the data package's docstrings run and say what they show."""

from __future__ import annotations

import doctest
import importlib
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
# The examples name the sample files by their path from the repository root.
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module(
        "torchrec_cowclip.data" + ("" if name == "__init__" else f".{name}")
    )
    monkeypatch.chdir(REPO)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0

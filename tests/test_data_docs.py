"""The usage examples in the data package's docstrings run and say what they show.

They read the sample rows through paths relative to the repository root
(``tests/data/...``), as ``pytest --doctest-modules torchrec_cowclip/data`` run from
the root does.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import torchrec_cowclip.data

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["__init__"] + sorted(m.name for m in pkgutil.iter_modules(torchrec_cowclip.data.__path__))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    module = importlib.import_module(
        "torchrec_cowclip.data" + ("" if name == "__init__" else f".{name}")
    )
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0


def test_no_path_outside_the_repository() -> None:
    for path in sorted((ROOT / "torchrec_cowclip" / "data").glob("*.py")):
        text = path.read_text()
        assert "../shared" not in text and "/work/" not in text, path

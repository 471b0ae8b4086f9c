"""pytest set-up shared by the test suite (tests/) and the docstring examples
(``pytest --doctest-modules torchrec_cowclip``, run by ``make test``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

# Eager fused update unless asked otherwise, for the examples too: a cold TorchInductor
# compile costs seconds per graph (tests/conftest.py says which tests compile on purpose).
os.environ.setdefault("TORCHREC_COWCLIP_COMPILE", "0")

REPO = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _examples_run_from_the_repository_root(request: pytest.FixtureRequest) -> Iterator[None]:
    """Docstring examples name files by their path from the repository root (e.g.
    ``tests/data/criteo_sample.tsv``), as a reader who runs them from a clone would; an
    example that writes files writes them under ``tempfile.mkdtemp()``."""
    if isinstance(request.node, pytest.DoctestItem):
        request.getfixturevalue("monkeypatch").chdir(REPO)
    yield

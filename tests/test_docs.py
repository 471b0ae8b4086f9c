"""The README's usage snippet and the docstring examples of the core modules run as written."""

import doctest
import re
from pathlib import Path

import pytest

import torchrec_cowclip.embedding.row_gradients as row_gradients
import torchrec_cowclip.optim.functional as functional
import torchrec_cowclip.optim.reference as reference
import torchrec_cowclip.train.scaling as scaling

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_snippet_runs():
    snippet = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(snippet, str(README), "exec"), namespace)  # noqa: S102 - our own README
    stats = namespace["ebc"].clip_stats()
    assert stats["t0"].rows_updated == 3 and stats["t0"].steps == 1  # rows 1, 2, 3 of f0


@pytest.mark.parametrize(
    "module",
    [functional, reference, row_gradients, scaling],
    ids=lambda m: m.__name__.rsplit(".", 1)[-1],
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0

"""The repository stands on its own: no tracked file points outside the clone.

A user's clone has no sibling ``shared`` folder beside it and no ``/work`` tree, so a docstring,
example, test or document that names one is broken for them. The algorithm document is
``docs/algorithm.md`` and the sample rows are in ``tests/data/``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(REPO).as_posix()

# The sibling shared folder (../ or ..\ then shared), the /work tree, and absolute paths into home or root
# directories (/home/NAME, /root/..., /Users/NAME).
OUTSIDE = re.compile(
    r"\.\.[/\\]shared\b"
    r"|(?<![\w.~-])(?:/work/|/root/|/(?:home|Users)/\w)"
)


def tracked_files() -> List[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [name for name in out.stdout.decode().split("\0") if name]


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    offending = []
    for name in tracked_files():
        path = REPO / name
        if name == THIS or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (the PNG figures)
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offending.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not offending, "paths outside the repository:\n" + "\n".join(offending)


@pytest.mark.parametrize(
    "line, outside",
    [
        # (built from parts, so that this file does not name the folder itself)
        ("see " + ".." + "/shared/docs/cowclip-spec.md", True),
        ('SAMPLE = Path("/work/shared/data")', True),
        ("cache in /home/alice/cache", True),
        ("written to /root/.cache/x", True),
        ("tests/data/criteo_sample.tsv", False),
        ("criteo:/data/criteo/train.txt", False),
        ("a shared table, shared by two features", False),
        ("framework/work/x and ~/workspace", False),
    ],
)
def test_the_pattern_tells_outside_paths_from_repository_ones(line: str, outside: bool) -> None:
    assert bool(OUTSIDE.search(line)) is outside

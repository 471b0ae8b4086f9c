"""Every example script runs from a clone, on the sample rows shipped in tests/data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))


def test_every_example_is_covered():
    assert {p.name for p in EXAMPLES} == {
        "cowclip_in_your_model.py",
        "quickstart.py",
        "train_dcn_avazu.py",
        "train_deepfm_criteo.py",
    }


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(tmp_path, script):
    args = [sys.executable, str(script)]
    if script.stem.startswith("train_"):
        args += [
            "--batch-size",
            "64",
            "--out",
            str(tmp_path / "run"),
            "--cache-dir",
            str(tmp_path / "c"),
        ]
    for _ in range(2 if script.stem.startswith("train_") else 1):  # a re-run replaces its run
        run = subprocess.run(
            args,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        )
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    if script.stem.startswith("train_"):
        metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
        assert metrics["steps"] > 0 and metrics["epochs"] == 1

"""Every example script runs from a clone as its docstring says, on the sample rows
shipped in tests/data."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
#: A clean environment, but the suite's native-library cache (built once, reused).
ENV = {
    "OMP_NUM_THREADS": "1",
    "PATH": "/usr/bin:/bin",
    "PYTHONPATH": str(REPO),
    **{k: os.environ[k] for k in ("TORCH_EXTENSIONS_DIR",) if k in os.environ},
}


def _run(command: List[str], cwd: Path) -> "subprocess.CompletedProcess[str]":
    """``command`` from ``cwd`` with the clone on the path; asserts it succeeded."""
    run = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run


def docstring_commands(script: Path) -> List[Tuple[str, List[str]]]:
    """The ``.venv/bin/python examples/X.py ARGS`` commands of ``script``'s docstring that
    need no data of the reader's (no ``/data/`` path): ``(script path, ARGS)``."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    found = re.findall(r"^\s*\.venv/bin/python (examples/\S+\.py)(.*)$", doc, re.M)
    return [(path, args.split()) for path, args in found if "/data/" not in args]


def test_every_example_is_covered():
    assert {p.name for p in EXAMPLES} == {
        "cowclip_in_your_model.py",
        "dlrm_criteo.py",
        "quickstart.py",
        "train_dcn_avazu.py",
        "train_deepfm_criteo.py",
    }


@pytest.mark.parametrize(
    "script", [p for p in EXAMPLES if p.name != "dlrm_criteo.py"], ids=lambda p: p.stem
)
def test_example_runs_as_its_docstring_says(tmp_path, script):
    commands = docstring_commands(script)
    assert commands, f"{script.name}: its docstring shows no command to run on the sample rows"
    for path, args in commands:
        assert path == f"examples/{script.name}"
        repeats = 2 if script.stem.startswith("train_") else 1  # a re-run replaces its run
        for _ in range(repeats):
            run = _run([sys.executable, str(REPO / path), *args], tmp_path)
    if script.stem.startswith("train_"):
        out = {"train_deepfm_criteo": "deepfm-criteo", "train_dcn_avazu": "dcn-avazu"}[script.stem]
        metrics = json.loads((tmp_path / "runs" / out / "metrics.json").read_text())
        assert metrics["steps"] == 2 and metrics["epochs"] == 1
        assert "AUC" in run.stdout


def _dlrm(tmp_path: Path, npy: Path, processes: int, *flags: str) -> dict:
    """examples/dlrm_criteo.py under torchrun on ``processes`` processes, tiny; its summary."""
    run = _run(
        [
            str(Path(sys.executable).with_name("torchrun")),
            "--standalone",
            "--nproc_per_node",
            str(processes),
            str(REPO / "examples" / "dlrm_criteo.py"),
            "--in-memory-binary-criteo-path",
            str(npy),
            "--batch-size",
            "32",
            "--num-embeddings",
            "1000",
            "--embedding-dim",
            "8",
            "--dense-arch-layer-sizes",
            "16,8",
            "--over-arch-layer-sizes",
            "16,1",
            "--warmup-steps",
            "2",
            "--cache-dir",
            str(tmp_path / "cache"),
            *flags,
        ],
        tmp_path,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_dlrm_example_trains_and_resumes_on_1_and_2_processes(tmp_path):
    from cowclip_testing import write_criteo_npy_days

    npy = write_criteo_npy_days(REPO / "tests" / "data" / "criteo_sample.tsv", tmp_path / "npy")
    ck = tmp_path / "ck"
    straight = _dlrm(tmp_path, npy, 1, "--epochs", "2", "--checkpoint-dir", str(ck))
    assert len(straight["test_auc"]) == 2 and straight["world_size"] == 1
    assert (ck / "epoch_1" / ".metadata").exists() and (ck / "epoch_2" / ".metadata").exists()
    # Resume from epoch 1 (the latest checkpoint once epoch 2's is gone): the same second
    # epoch, exactly; then the same checkpoint on two processes (DCP re-shards it).
    (ck / "epoch_2").rename(tmp_path / "epoch_2_of_the_straight_run")
    flags = ("--epochs", "2", "--checkpoint-dir", str(ck), "--resume")
    resumed = _dlrm(tmp_path, npy, 1, *flags)
    assert resumed["test_auc"] == straight["test_auc"][1:]
    (ck / "epoch_2").rename(tmp_path / "epoch_2_of_the_resumed_run")
    two = _dlrm(tmp_path, npy, 2, *flags)
    assert two["world_size"] == 2
    assert abs(two["test_auc"][0] - straight["test_auc"][1]) < 1e-3  # float summation order

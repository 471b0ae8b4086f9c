"""Multi-process training through the real launchers: torchrun and the torchx component.

Each job is tiny (2 CPU processes, gloo) and bounded by timeouts, so a hang fails the
test instead of CI.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from tiny import cli_args

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
TINY = cli_args(
    command=None,
    model="deepfm",
    data="synthetic:12000",
    batch_size=2048,
    hidden=(16, 16),
    synthetic_scale=0.01,
    synthetic_max_cardinality=3000,
    lr_embed="1e-2",
    no_progress=True,
    dist_timeout=60,
)


def _env() -> dict:
    env = dict(os.environ)
    # torchx's local scheduler starts `torchrun` from PATH: the venv's.
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _torchrun(args, timeout=240):
    cmd = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "torchrec_cowclip",
        "train",
        *args,
    ]
    return subprocess.run(
        cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def test_torchrun_two_processes_train_resume_and_agree(tmp_path):
    out = tmp_path / "tw"
    common = TINY + [
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(out),
        "--sharding",
        "table_wise",
    ]
    first = _torchrun(common + ["--epochs", "1"])
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["sharding"] == "table_wise"
    assert metrics["steps"] == 12000 * 9 // 10 // 2048 and 0.5 < metrics["auc"] <= 1.0
    assert (out / "checkpoints" / "latest").is_file()
    # The summary is printed once (rank 0), not once per process.
    assert first.stdout.count('"auc"') == 1
    # The start says how the run is spread, and TorchRec's planner and DDP say nothing
    # this run could act on (README, "Scale out"; torchrec_cowclip/notices.py).
    assert "processes: 2 | sharding table_wise (every table): table_wise 52" in first.stderr
    noise = [line for line in first.stderr.splitlines() if "Warning" in line or "WARNING" in line]
    assert noise == [], noise
    # Resume from the sharded checkpoint for a second epoch.
    second = _torchrun(common + ["--epochs", "2", "--resume"])
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["epochs"] == 2 and resumed["epoch_auc"][0] == metrics["epoch_auc"][0]
    assert resumed["steps"] == 2 * metrics["steps"]


def test_torchx_component_runs_with_local_cwd(tmp_path):
    out = tmp_path / "tx"
    cmd = [
        str(VENV_BIN / "torchx"),
        "run",
        "-s",
        "local_cwd",
        "launch/components.py:train",
        "-j",
        "1x2",
        "--",
        *TINY,
        "--epochs",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(out),
        "--sharding",
        "column_wise",
    ]
    run = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "SUCCEEDED" in run.stdout + run.stderr or (out / "metrics.json").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["sharding"] == "column_wise"


def test_row_wise_sharding_trains_through_torchrun(tmp_path):
    out = tmp_path / "rw"
    run = _torchrun(
        TINY
        + [
            "--cache-dir",
            str(tmp_path / "c"),
            "--out",
            str(out),
            "--sharding",
            "row_wise",
            "--epochs",
            "1",
        ],
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["sharding"] == "row_wise" and metrics["rows_updated"] > 0


def test_unknown_sharding_is_a_cli_error(tmp_path):
    run = _torchrun(
        TINY
        + ["--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--sharding", "grid"],
        timeout=60,
    )
    assert run.returncode != 0 and "invalid choice: 'grid'" in run.stderr


def test_the_torchx_component_restarts_and_resumes_with_no_person():
    """``--max_restarts`` reaches torchrun (as ``PET_MAX_RESTARTS``, its own option
    variable) and the training gets ``--resume auto``, so a restarted job continues
    from its newest checkpoint; an explicit --resume/--overwrite is kept as given."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("components", REPO / "launch" / "components.py")
    components = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(components)
    role = components.train("--out", "runs/x", max_restarts=3).roles[0]
    assert role.env["PET_MAX_RESTARTS"] == "3"
    assert role.args[-1].endswith("--out runs/x --resume auto")
    retried = components.train("--out", "runs/x", max_retries=2).roles[0]
    assert retried.max_retries == 2 and retried.args[-1].endswith("--resume auto")
    plain = components.train("--out", "runs/x", "--overwrite", max_restarts=1).roles[0]
    assert (
        "--resume" not in plain.args[-1]
        and components.train("--out", "o").roles[0].env.get("PET_MAX_RESTARTS") is None
    )

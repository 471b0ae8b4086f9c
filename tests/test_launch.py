"""Multi-process training through the real launchers: torchrun and the torchx component.

Each job is tiny (2 CPU processes, gloo) and bounded by timeouts, so a hang fails the
test instead of CI.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def _components():
    import importlib.util

    spec = importlib.util.spec_from_file_location("components", REPO / "launch" / "components.py")
    components = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(components)
    return components


def test_the_torchx_component_restarts_and_resumes_with_no_person():
    """``--max_restarts`` reaches torchrun (as ``PET_MAX_RESTARTS``, its own option
    variable) and the training gets ``--resume auto``, so a restarted job continues
    from its newest checkpoint; an explicit --resume/--overwrite is kept as given."""
    components = _components()
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


# --- launch specs sized for the host: resources and the dry-run specs of each scheduler ------

#: An 8-GPU host's replica by default: 6 CPUs and 32 GiB per GPU (launch/components.py).
GPU_HOST = {"cpu": 48, "memMB": 262144, "gpu": 8}
DRYRUN_ARGS = ["-j", "2x8", "--gpu", "8", "--", "--model", "dlrm", "--out", "runs/x"]


def test_the_component_sizes_each_replica_for_its_host():
    components = _components()

    def resource(*args, **kwargs):
        r = components.train("--model", "dlrm", *args, **kwargs).roles[0].resource
        return {"cpu": r.cpu, "memMB": r.memMB, "gpu": r.gpu}

    assert resource(j="2x8", gpu=8) == GPU_HOST
    assert resource(j="1x4", gpu=4) == {"cpu": 24, "memMB": 131072, "gpu": 4}
    # Without GPUs, per process: 2 CPUs and 8 GiB.
    assert resource(j="1x4") == {"cpu": 8, "memMB": 32768, "gpu": 0}
    assert resource(j="2x8", gpu=8, cpu=20, memMB=100_000) == {
        "cpu": 20,
        "memMB": 100_000,
        "gpu": 8,
    }
    # A resource torchx knows by name: its CPUs, memory and GPUs.
    named = resource(j="2x8", h="aws_p4d.24xlarge")
    assert named == {"cpu": 96, "memMB": 1_132_416, "gpu": 8}
    with pytest.raises(ValueError, match="--cpu must be >= 0, got -1"):
        resource(j="1x2", cpu=-1)


def _dryrun(scheduler: str, *args: str, env=None) -> str:
    cmd = [str(VENV_BIN / "torchx"), "run", "--dryrun", *args, "-s", scheduler,
           "launch/components.py:train", *DRYRUN_ARGS]  # fmt: skip
    run = subprocess.run(
        cmd, cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run.stdout + run.stderr


def _torchrun_command(spec: str) -> str:
    """The command a replica runs, whitespace folded (YAML and shell wrap it)."""
    text = " ".join(spec.split())
    return text[text.index("torchrun --rdzv_backend c10d") :]


def test_the_slurm_dry_run_asks_for_the_host_s_cpus_and_memory():
    spec = _dryrun("slurm")
    replicas = [line for line in spec.splitlines() if line.startswith("#SBATCH --job-name")]
    assert len(replicas) == 2
    for line in replicas:
        assert "--ntasks-per-node=1 --cpus-per-task=48 --mem=262144 --gpus-per-task=8" in line
    command = _torchrun_command(spec)
    assert "--nnodes 2 --nproc_per_node 8" in command
    assert "-m torchrec_cowclip train --model dlrm --out runs/x" in command


def test_the_local_docker_dry_run_needs_no_docker_with_an_empty_workspace():
    spec = _dryrun("local_docker", "--workspace", "")
    assert spec.count("nano_cpus: 48000000000") == 2 and spec.count("mem_limit: 262144m") == 2
    assert spec.count("Count: 8") == 2
    assert "-m torchrec_cowclip train --model dlrm --out runs/x" in _torchrun_command(spec)


def test_the_kubernetes_dry_run_asks_for_the_host_s_cpus_and_memory():
    kubernetes = pytest.importorskip("kubernetes", reason="torchx's kubernetes scheduler needs it")
    # torchx imports it where this process found it; .torchxconfig names Volcano's queue;
    # --workspace "" builds no image.
    found = str(Path(kubernetes.__file__).resolve().parents[1])
    env = {**_env(), "PYTHONPATH": os.pathsep.join([found, os.environ.get("PYTHONPATH", "")])}
    spec = _dryrun("kubernetes", "--workspace", "", env=env)
    request = spec[spec.index("=== SCHEDULER REQUEST ===") :]
    assert "queue: default" in request and request.count("replicas: 1") == 2
    limits = " ".join(request.split()).count(
        "limits: cpu: 48000m memory: 262144M nvidia.com/gpu: '8'"
    )
    assert limits == 2
    command = _torchrun_command(request)
    assert "--nnodes 2 --nproc_per_node 8" in command
    assert "-m torchrec_cowclip train --model dlrm --out runs/x" in command

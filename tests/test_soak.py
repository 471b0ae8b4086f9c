"""Soak: a small CLI training SIGKILLed 20 times at random (seeded) points of training,
checkpointing, evaluation and start-up, each time followed by ``--resume``, ends with the
uninterrupted run's metrics and a clean ``--out``.

The runs are forked from one ``multiprocessing`` fork server that has imported the
trainer once, so a run starts in well under a second instead of paying torch's import
each time; each run is still its own process, killed by the OS with SIGKILL.
"""

import csv
import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

from torchrec_cowclip.train.checkpoint import CheckpointStore
from torchrec_cowclip.train.cli import main
from torchrec_cowclip.train.run_dir import LOCK_NAME, lock_holder

KILLS = 20
SEED = 13
# 2,700 training rows at batch 128: 22 steps an epoch, 88 in all; a checkpoint every 2.
# The kills are placed by steps logged, not by time, so that a faster machine does not
# finish the run before the 20th kill.
ARGV = [
    "train",
    "--data",
    "synthetic:3000",
    "--synthetic-scale",
    "0.001",
    "--synthetic-max-cardinality",
    "200",
    "--hidden",
    "8,8",
    "--embedding-dim",
    "4",
    "--batch-size",
    "128",
    "--epochs",
    "4",
    "--checkpoint-every",
    "2",
    "--log-every",
    "1",
    "--eval-batch-size",
    "4096",
    "--threads",
    "1",
    "--no-progress",
]
COMPARED = (
    "auc",
    "logloss",
    "epoch_auc",
    "epoch_logloss",
    "best_epoch",
    "epochs",
    "steps",
    "train_samples",
    "rows_updated",
    "rows_clipped",
    "rows_nonfinite",
    "clipped_per_table",
)


def _last_step(out: Path) -> int:
    """The step of steps.csv's last complete row (the run logs every step), 0 if none."""
    try:
        lines = (out / "steps.csv").read_bytes().split(b"\n")[1:-1]
    except FileNotFoundError:
        return 0
    return int(lines[-1].split(b",")[0]) if lines else 0


def _rows(path: Path, columns=None):
    with path.open(newline="") as f:
        return [
            {k: v for k, v in row.items() if columns is None or k in columns}
            for row in csv.DictReader(f)
        ]


def _start(ctx, argv):
    process = ctx.Process(target=main, args=(argv,))
    process.start()
    return process


def test_twenty_random_kills_each_resumed_give_the_uninterrupted_metrics(tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torchrec_cowclip.train.trainer"])
    common = ARGV + ["--cache-dir", str(tmp_path / "cache")]
    t0 = time.perf_counter()
    full = _start(ctx, common + ["--out", str(tmp_path / "full")])
    full.join(120)
    assert full.exitcode == 0
    expected = json.loads((tmp_path / "full" / "metrics.json").read_text())
    uninterrupted_s = time.perf_counter() - t0

    out = tmp_path / "killed"
    rng = random.Random(SEED)
    kills, mid_write, fresh_starts, startup_kills = 0, 0, 0, 0
    while kills < KILLS:
        if (out / "checkpoints" / "latest").exists():
            argv = common + ["--out", str(out), "--resume"]
        else:  # killed before its first checkpoint: start again
            argv = common + ["--out", str(out)] + (["--overwrite"] if out.exists() else [])
            fresh_starts += 1
        furthest = _last_step(out)
        process = _start(ctx, argv)
        startup = rng.random() < 0.2
        if startup:  # during start-up and restore: within 0.5 s, before a new step
            target, deadline = furthest + 1, time.monotonic() + rng.uniform(0.0, 0.5)
            startup_kills += 1
        else:  # 1-4 steps past the furthest step reached, then 0-10 ms on: in a step, a
            # checkpoint write or an evaluation
            target, deadline = furthest + rng.randint(1, 4), time.monotonic() + 60
        while process.is_alive() and time.monotonic() < deadline:
            if _last_step(out) >= target:
                break
            time.sleep(0.002)
        if not startup:
            time.sleep(rng.uniform(0.0, 0.01))
        assert process.is_alive(), (
            f"kill {kills + 1}: the run ended first (exit {process.exitcode})"
        )
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        assert process.exitcode == -signal.SIGKILL
        kills += 1
        # A checkpoint directory no pointer names yet: the kill hit a write.
        mid_write += len(list((out / "checkpoints").glob("latest-*"))) > 1
    reached = _last_step(out)

    final = _start(ctx, common + ["--out", str(out), "--resume"])
    final.join(120)
    assert final.exitcode == 0
    resumed = json.loads((out / "metrics.json").read_text())
    assert {k: resumed[k] for k in COMPARED} == {k: expected[k] for k in COMPARED}
    # Each step and epoch logged once, with the uninterrupted run's values (running_loss
    # restarts with each process; samples_per_s is a timing).
    assert _rows(out / "steps.csv", ("step", "loss", "dense_lr")) == _rows(
        tmp_path / "full" / "steps.csv", ("step", "loss", "dense_lr")
    )
    assert _rows(out / "epochs.csv") == _rows(tmp_path / "full" / "epochs.csv")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["checkpoints", "metrics.json", "steps.csv", "epochs.csv", "tb"]
    ), "stray files left"
    assert [p.name.split("-")[0] for p in sorted((out / "checkpoints").iterdir())] == [
        "latest",
        "latest",
    ], "a killed checkpoint write was left behind"
    assert not (out / LOCK_NAME).exists() and lock_holder(out) is None
    latest = CheckpointStore(out / "checkpoints").trainer_state("latest")
    assert latest["progress"]["global_step"] == 88
    print(
        f"soak: {kills} kills survived ({startup_kills} in start-up, {mid_write} inside a "
        f"checkpoint write, {fresh_starts} before a first checkpoint; the last at step {reached} of "
        f"88); uninterrupted run "
        f"{uninterrupted_s:.1f} s, whole soak {time.perf_counter() - t0:.1f} s"
    )

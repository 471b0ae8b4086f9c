"""Soak: a small CLI training SIGKILLed 20 times at random (seeded) points of training,
checkpointing, evaluation and start-up, each time restarted with ``--resume auto``, ends
with the uninterrupted run's metrics and a clean ``--out``; SIGTERM and SIGINT stop a run
after its step with a checkpoint and exit status 75; and (``-m slow``) two processes under
``torchrun --max-restarts`` survive 10 SIGKILLs of a random rank with no person.

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

import pytest
from tiny import tiny_cli
from trainer_cases import EXACT

from torchrec_cowclip.cli import main
from torchrec_cowclip.run.checkpoints import WRITING_MARKER, CheckpointStore
from torchrec_cowclip.run.out_dir import LOCK_NAME, lock_holder
from torchrec_cowclip.run.stop import EXIT_STOPPED
from torchrec_cowclip.train.console import TIMING_COLUMNS

KILLS = 20
SEED = 13
# 2,700 training rows at batch 128: 21 steps an epoch, 84 in all; a checkpoint every 2.
STEPS = 84
# The kills are placed by steps logged, not by time, so that a faster machine does not
# finish the run before the 20th kill.
ARGV = tiny_cli(batch_size=128, epochs=4, checkpoint_every=2)
COMPARED = ("auc", "logloss", "epochs", *EXACT)


def _last_step(out: Path) -> int:
    """The step of steps.csv's last complete row (the run logs every step), 0 if none."""
    try:
        lines = (out / "steps.csv").read_bytes().split(b"\n")[1:-1]
    except FileNotFoundError:
        return 0
    return int(lines[-1].split(b",")[0]) if lines else 0


def _rows(path: Path, columns=None):
    """The rows of a run's CSV log, ``columns`` only if given, never the timings (the
    epoch time, samples/s and peak memory differ between two runs of one command)."""
    with path.open(newline="") as f:
        return [
            {
                k: v
                for k, v in row.items()
                if (columns is None or k in columns) and k not in TIMING_COLUMNS
            }
            for row in csv.DictReader(f)
        ]


def _start(ctx, argv):
    process = ctx.Process(target=main, args=(argv,))
    process.start()
    return process


def test_twenty_random_kills_each_resumed_give_the_uninterrupted_metrics(tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torchrec_cowclip.train.start"])
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
        # No person decides: the same command every time (a fresh start until a first
        # checkpoint exists, a resume afterwards).
        fresh_starts += CheckpointStore(out / "checkpoints").newest("latest") is None
        argv = common + ["--out", str(out), "--resume", "auto"]
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
        # A directory with our marker and no manifest: the kill hit a write.
        mid_write += any((out / "checkpoints").glob(f"*/{WRITING_MARKER}"))
    reached = _last_step(out)

    final = _start(ctx, common + ["--out", str(out), "--resume", "auto"])
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
        ["checkpoints", "metrics.json", "steps.csv", "epochs.csv", "tb", "curves.png", "model"]
    ), "stray files left"
    # The pointer and the last two complete checkpoints; no killed write left behind.
    assert [p.name.split("-")[0] for p in sorted((out / "checkpoints").iterdir())] == [
        "latest",
        "latest",
        "latest",
    ], f"a killed checkpoint write was left behind: {sorted((out / 'checkpoints').iterdir())}"
    assert not (out / LOCK_NAME).exists() and lock_holder(out) is None
    latest = CheckpointStore(out / "checkpoints").trainer_state("latest")
    assert latest["progress"]["global_step"] == STEPS
    print(
        f"soak: {kills} kills survived ({startup_kills} in start-up, {mid_write} inside a "
        f"checkpoint write, {fresh_starts} before a first checkpoint; the last at step {reached} of "
        f"{STEPS}); uninterrupted run "
        f"{uninterrupted_s:.1f} s, whole soak {time.perf_counter() - t0:.1f} s"
    )


def _main_logged(argv, log):
    """``main(argv)`` with stderr in ``log`` (a forked run's messages, for the test)."""
    import sys

    with open(log, "w") as f:
        os.dup2(f.fileno(), 2)
        sys.stderr = f
        main(argv)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint(tmp_path, sig):
    """Failure 5: SIGTERM (a preemption) or SIGINT wrote no checkpoint and printed a
    traceback from inside the fused update. Now the step finishes, a checkpoint is
    written, the lock released, one line said and the exit status is 75; the same
    command (``--resume auto``) then ends with the uninterrupted run's metrics."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torchrec_cowclip.train.start"])
    # No periodic checkpoint: only the signal's.
    common = ARGV + ["--cache-dir", str(tmp_path / "cache"), "--checkpoint-every", "0"]
    full = _start(ctx, common + ["--out", str(tmp_path / "full")])
    full.join(120)
    expected = json.loads((tmp_path / "full" / "metrics.json").read_text())
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    argv = common + ["--out", str(out), "--resume", "auto"]
    process = ctx.Process(target=_main_logged, args=(argv, str(log)))
    process.start()
    deadline = time.monotonic() + 120
    while _last_step(out) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(process.pid, sig)
    process.join(60)
    assert process.exitcode == EXIT_STOPPED
    err = log.read_text()
    assert "Traceback" not in err, err
    step = _last_step(out)
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            f"torchrec-cowclip: stopped by {sig.name} after step {step} (epoch 1, batch {step} of 21): "
            f"the last good checkpoint is {out}/checkpoints/latest-e0-s{step} (step {step};"
        )
    ), err
    assert f"received {sig.name}: finishing the current step" in err
    assert CheckpointStore(out / "checkpoints").newest("latest").step == step >= 3
    assert not (out / LOCK_NAME).exists() and lock_holder(out) is None
    resumed = _start(ctx, argv)
    resumed.join(120)
    assert resumed.exitcode == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert {k: metrics[k] for k in COMPARED} == {k: expected[k] for k in COMPARED}


# --- two processes under torchrun, no person ------------------------------------------------

ELASTIC_KILLS = 10
ELASTIC_ARGV = tiny_cli(
    data="synthetic:12000",
    epochs=2,
    checkpoint_every=3,
    sharding="row_wise",
    dist_timeout=30,
    resume="auto",
)
# 10,800 training rows at batch 256: 42 steps an epoch, 84 in all.
ELASTIC_STEPS = 84


def _torchrun(argv, restarts, log):
    import subprocess
    import sys
    from pathlib import Path

    venv_bin = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{venv_bin}:{os.environ['PATH']}"}
    cmd = [
        str(venv_bin / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.2",
        "-m",
        "torchrec_cowclip",
        *argv,
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _workers(agent_pid):
    """``{rank: pid}`` of the training processes torchrun runs now."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry)
    return found


@pytest.mark.slow
def test_two_processes_under_torchrun_survive_ten_killed_ranks(tmp_path):
    """Failure 5 on two processes: ``torchrun --max-restarts`` could not resume a job one
    of whose ranks died. Here a seeded random rank is SIGKILLed 10 times, at random steps
    (3-12 past the furthest logged, some 0-2 s into a restart); torchrun restarts the
    job each time with the same command, and the final metrics.json, steps.csv and
    epochs.csv equal the uninterrupted run's."""
    common = ELASTIC_ARGV + ["--cache-dir", str(tmp_path / "cache")]
    t0 = time.perf_counter()
    with open(tmp_path / "full.log", "w") as log:
        full = _torchrun(common + ["--out", str(tmp_path / "full")], 0, log)
        assert full.wait(600) == 0, (tmp_path / "full.log").read_text()[-3000:]
    expected = json.loads((tmp_path / "full" / "metrics.json").read_text())
    uninterrupted_s = time.perf_counter() - t0

    out = tmp_path / "killed"
    rng = random.Random(SEED)
    log = open(tmp_path / "killed.log", "w")
    agent = _torchrun(common + ["--out", str(out)], ELASTIC_KILLS, log)
    kills, killed_ranks, steps_at_kill = 0, [], []
    try:
        while kills < ELASTIC_KILLS:
            deadline = time.monotonic() + 300
            workers = {}
            while len(workers) < 2 and time.monotonic() < deadline and agent.poll() is None:
                workers = _workers(agent.pid)
                time.sleep(0.05)
            assert agent.poll() is None, (
                f"torchrun ended (exit {agent.returncode}) before kill {kills + 1}"
            )
            if rng.random() < 0.2:  # in a restart: start-up, restore
                time.sleep(rng.uniform(0.0, 2.0))
            else:
                target = _last_step(out) + rng.randint(3, 12)
                while _last_step(out) < target and time.monotonic() < deadline:
                    time.sleep(0.005)
            rank = rng.randrange(2)
            steps_at_kill.append(_last_step(out))
            os.kill(workers[rank], signal.SIGKILL)
            killed_ranks.append(rank)
            kills += 1
            while set(_workers(agent.pid).values()) & set(workers.values()):
                time.sleep(0.05)  # the old workers are gone: the next ones are a restart
        assert agent.wait(900) == 0, (tmp_path / "killed.log").read_text()[-4000:]
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["world_size"] == 2 and resumed["steps"] == ELASTIC_STEPS
    assert {k: resumed[k] for k in COMPARED} == {k: expected[k] for k in COMPARED}
    assert _rows(out / "steps.csv", ("step", "loss", "dense_lr")) == _rows(
        tmp_path / "full" / "steps.csv", ("step", "loss", "dense_lr")
    )
    assert _rows(out / "epochs.csv") == _rows(tmp_path / "full" / "epochs.csv")
    store = CheckpointStore(out / "checkpoints")
    assert store.unfinished() == [] and store.newest("latest").step == ELASTIC_STEPS
    assert not (out / LOCK_NAME).exists()
    print(
        f"elastic soak: {kills} kills of ranks {killed_ranks} at logged steps {steps_at_kill} "
        f"of {ELASTIC_STEPS}; uninterrupted run {uninterrupted_s:.0f} s, whole soak "
        f"{time.perf_counter() - t0:.0f} s"
    )

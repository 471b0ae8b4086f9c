"""Errors found late or raw (issue 21, failure 7): every flag is checked before any work,
and what the environment does wrong - a full disk, a read-only ``--out``, a truncated
``.gz`` input, tables too large for the machine, a configuration that trains no step or
evaluates nothing - is one line naming the path, table or flag, with its exit status.
(A hung rank's ``CollectiveError``: ``tests/test_elastic.py``.)"""

from __future__ import annotations

import errno
import gzip
import os
import pathlib
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny import TINY_CLI, cli_args

from torchrec_cowclip.cli import main
from torchrec_cowclip.run.checkpoints import CheckpointStore
from torchrec_cowclip.run.out_dir import LOCK_NAME

REPO = Path(__file__).resolve().parents[1]
CRITEO_SAMPLE = REPO / "tests" / "data" / "criteo_sample.tsv"
DEV_FULL = Path("/dev/full")  # every write fails with ENOSPC: a disk that is full


def _run(argv, capsys):
    """``main(argv)``'s exit status and its last stderr line (which must be the only
    line of an error: no traceback)."""
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return status, err.strip().splitlines()[-1] if err.strip() else ""


def _on_a_full_disk(monkeypatch, matches):
    """Opens for writing of the files ``matches(path)`` selects go to /dev/full."""
    real_open = pathlib.Path.open

    def open_(self, mode="r", *args, **kwargs):
        if "w" in mode and matches(self):
            return real_open(DEV_FULL, mode, *args, **kwargs)
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)


@pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full on this machine")
def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_last_one(
    tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    argv = TINY_CLI + [
        "--out",
        str(out),
        "--cache-dir",
        str(tmp_path / "c"),
        "--checkpoint-every",
        "2",
    ]
    assert _run(argv + ["--max-steps", "2"], capsys)[0] == 0
    _on_a_full_disk(monkeypatch, lambda p: p.suffix == ".distcp")
    status, line = _run(argv + ["--max-steps", "4", "--resume"], capsys)
    assert status == 4
    checkpoints = out / "checkpoints"
    assert line == (
        f"torchrec-cowclip: error: no space left on device: {checkpoints}/latest-e0-s4; removed "
        "the unfinished directory; the last good checkpoint "
        f"is {checkpoints}/latest-e0-s2 (step 2; --resume continues from it)"
    )
    store = CheckpointStore(checkpoints)
    assert [c.step for c in store.complete("latest")] == [2] and store.unfinished() == []
    assert not (out / LOCK_NAME).exists()
    monkeypatch.undo()  # space again: the same command continues
    assert _run(argv + ["--max-steps", "4", "--resume", "auto"], capsys)[0] == 0
    assert store.newest("latest").step == 4


@pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full on this machine")
def test_a_full_disk_when_writing_metrics_is_one_line_naming_the_file(
    tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    _on_a_full_disk(monkeypatch, lambda p: p.name == "metrics.json.tmp")
    status, line = _run(
        TINY_CLI + ["--out", str(out), "--cache-dir", str(tmp_path / "c"), "--max-steps", "2"],
        capsys,
    )
    assert status == 4
    assert line == f"torchrec-cowclip: error: no space left on device: {out}/metrics.json"
    assert not (out / "metrics.json.tmp").exists() and not (out / LOCK_NAME).exists()


def test_a_read_only_out_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "read-only" / "run"
    real_mkdir = pathlib.Path.mkdir

    def mkdir(self, *args, **kwargs):  # what a read-only mount answers
        if str(self).startswith(str(tmp_path / "read-only")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    status, line = _run(TINY_CLI + ["--out", str(out), "--cache-dir", str(tmp_path / "c")], capsys)
    assert status == 2
    assert line == (
        f"torchrec-cowclip: error: --out {out} cannot be written: Read-only file system: "
        "choose a writable --out"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_an_out_without_write_permission_is_one_line(tmp_path, capsys):
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        status, line = _run(TINY_CLI + ["--out", str(parent / "run")], capsys)
    finally:
        parent.chmod(0o755)
    assert status == 2 and "cannot be written: Permission denied" in line


def test_a_truncated_gzip_input_is_one_line_naming_the_file(tmp_path, capsys):
    packed = gzip.compress(CRITEO_SAMPLE.read_bytes())
    data = tmp_path / "day_0.gz"
    data.write_bytes(packed[: len(packed) // 2])
    argv = cli_args(
        data=f"criteo:{data}", batch_size=32, out=tmp_path / "o", cache_dir=tmp_path / "c"
    )
    status, line = _run(argv, capsys)
    assert status == 2
    assert line.startswith(f"torchrec-cowclip: error: {data}: damaged compressed file (")
    assert line.endswith("): re-download or re-compress it")


def test_raw_hash_ids_are_refused_before_the_tables_are_allocated(tmp_path, capsys):
    """A ``criteo-npy:`` day with TorchRec's raw 32-bit hashes (no contiguous ids) made
    2**32-row tables and died in the allocator; now one line names the table and
    --hash-size, and with --hash-size it trains."""
    days = tmp_path / "npy"
    days.mkdir()
    rng = np.random.default_rng(0)
    np.save(days / "day_0_dense.npy", rng.random((300, 13), dtype=np.float32))
    np.save(days / "day_0_sparse.npy", rng.integers(0, 2**32, (300, 26), dtype=np.int64))
    np.save(days / "day_0_labels.npy", rng.integers(0, 2, (300, 1)).astype(np.int32))
    argv = cli_args(
        data=f"criteo-npy:{days}",
        batch_size=64,
        hidden=8,
        no_progress=True,
        cache_dir=tmp_path / "c",
    )
    status, line = _run(argv + ["--out", str(tmp_path / "raw")], capsys)
    assert status == 2
    assert (
        line.startswith("torchrec-cowclip: error: table emb_C") and " rows x 10, float32 " in line
    )
    assert "more than the" in line and line.endswith("--hash-size (e.g. --hash-size 1000000)")
    assert not (tmp_path / "raw" / "checkpoints").exists()
    assert _run(argv + ["--out", str(tmp_path / "hashed"), "--hash-size", "1000"], capsys)[0] == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--batch-size", "4096"],
            "--batch-size 4096 is larger than the 2,700 training rows of "
            "synthetic:3000: no full batch, so no step would train; lower --batch-size",
        ),
        (
            ["--test-fraction", "0.0001"],
            "the test split of synthetic:3000 is empty: raise --test-fraction / --test-data",
        ),
        (
            ["--val-fraction", "0.0001"],
            "the validation split of synthetic:3000 is empty: raise --val-fraction",
        ),
    ],
)
def test_a_run_that_would_train_or_evaluate_nothing_is_refused_before_any_step(
    tmp_path, capsys, flags, message
):
    out = tmp_path / "run"
    status, line = _run(
        TINY_CLI + ["--out", str(out), "--cache-dir", str(tmp_path / "c")] + flags, capsys
    )
    assert status == 2 and line == f"torchrec-cowclip: error: {message}", line
    assert not (out / "steps.csv").exists() and not (out / "checkpoints").exists()
    assert not (out / LOCK_NAME).exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--batch-size", "1023"],
            "--batch-size 1023 must be divisible by the number of processes (2)",
        ),
        (["--row-clip-stats"], "--row-clip-stats counts rows of unsharded tables: run one process"),
        (
            ["--embedding-backend", "torchrec", "--no-cowclip"],
            "multi-process runs shard the CowClip tables: use --embedding-backend cowclip",
        ),
    ],
)
def test_flags_that_n_processes_cannot_run_are_refused_before_any_work(
    tmp_path, capsys, monkeypatch, flags, message
):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets, before the process group
    status, line = _run(
        TINY_CLI + ["--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c")] + flags,
        capsys,
    )
    assert status == 2 and message in line, line
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


def test_resume_auto_starts_anew_when_an_attempt_wrote_no_checkpoint(tmp_path, capsys):
    """What torchrun's restart finds after a rank died before the first checkpoint: the
    attempt's logs. ``--resume auto`` removes exactly those and starts anew; a finished
    run's files without a checkpoint are refused instead."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "steps.csv").write_text("step,loss\n1,0.5\n")
    (out / "notes.txt").write_text("mine")
    argv = TINY_CLI + ["--out", str(out), "--cache-dir", str(tmp_path / "c"), "--max-steps", "2"]
    status, _ = _run(argv + ["--resume", "auto"], capsys)
    assert status == 0 and (out / "notes.txt").read_text() == "mine"
    shutil.rmtree(out / "checkpoints")
    status, line = _run(argv + ["--resume", "auto"], capsys)
    assert status == 2 and "holds a finished run's files" in line and "no checkpoint" in line

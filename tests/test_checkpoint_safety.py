"""Checkpoints no one can abuse or lose (issue 21, one process).

Failures 1-3 of the issue, each as it was reported: a crafted ``trainer_state.pt`` or
DCP ``.metadata`` ran its code on ``--resume``; deleting the ``latest`` pointer made
``--resume`` delete the last complete checkpoint (and a foreign directory); damaged or
mixed checkpoint files resumed silently. And the ``--keep-checkpoints`` fallback.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from checkpoint_testing import CreatesAFile, reseal, snapshot, write_payload
from distributed_harness import load_result, plain, save_result
from tiny import TINY_CLI, tiny_config

from torchrec_cowclip.cli import main
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.run.checkpoints import (
    MANIFEST,
    TRAINER_STATE,
    CheckpointStore,
    DamagedCheckpointError,
    UnsafeFileError,
)
from torchrec_cowclip.run.out_dir import LOCK_NAME
from torchrec_cowclip.train import TrainConfig
from torchrec_cowclip.train.start import start_run

# 2,700 training rows at batch 256: 10 steps an epoch; checkpoints at steps 2 and 4.
COMPARED = ("auc", "logloss", "epoch_auc", "steps", "train_samples", "rows_updated")
CLI = TINY_CLI + ["--checkpoint-every", "2"]


def _config(root: Path, **overrides) -> TrainConfig:
    return tiny_config(root, checkpoint_every=2, **overrides)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped by --max-steps at step 4, with complete checkpoints at 2 and 4, and
    the uninterrupted run's metrics."""
    root = tmp_path_factory.mktemp("stopped")
    full = start_run(replace(_config(root), out=str(root / "full")).resolve()).run()
    start_run(_config(root, max_steps=4).resolve()).run()
    return root, {k: full[k] for k in COMPARED}


@pytest.fixture
def run(stopped, tmp_path):
    """A private copy of the stopped run: (root, its checkpoints, the full run's metrics)."""
    root, expected = stopped
    shutil.copytree(root / "run", tmp_path / "run")
    (tmp_path / "cache").symlink_to(root / "cache")
    return tmp_path, tmp_path / "run" / "checkpoints", expected


def _checkpoint(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"latest-e0-s{step}"


def test_the_stopped_run_has_two_complete_checkpoints(run):
    _, checkpoints, _ = run
    store = CheckpointStore(checkpoints)
    assert [c.path.name for c in store.complete("latest")] == ["latest-e0-s4", "latest-e0-s2"]
    manifest = json.loads((_checkpoint(checkpoints, 4) / MANIFEST).read_text())
    assert manifest["step"] == 4 and len(manifest["fingerprint"]) == 16
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", TRAINER_STATE}
    assert all(r["bytes"] > 0 and len(r["crc32"]) == 8 for r in manifest["files"].values())


# --- 1. opening a checkpoint runs no code ---------------------------------------------------


def test_the_payload_is_real(tmp_path):
    """The payload the tests plant does create its file when unpickled without a guard."""
    created = tmp_path / "created"
    pickle.loads(pickle.dumps(CreatesAFile(created)))
    assert created.exists()


@pytest.mark.parametrize("target", [TRAINER_STATE, ".metadata"])
def test_a_crafted_checkpoint_file_is_refused_and_never_runs(run, target, capsys):
    root, checkpoints, _ = run
    created = root / "pwned"
    victim = _checkpoint(checkpoints, 4) / target
    write_payload(victim, created)
    reseal(victim.parent)  # the attacker rewrites the manifest too
    before = snapshot(root / "run")
    with pytest.raises(SystemExit) as exit_info:
        main(CLI + ["--out", str(root / "run"), "--cache-dir", str(root / "cache"), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.startswith(f"torchrec-cowclip: error: {victim}: refused to load"), err
    assert "posix.system" in err or "system" in err
    assert not created.exists(), "the checkpoint's code ran"
    assert snapshot(root / "run") == before, "a refused resume changed the run directory"
    assert not (root / "run" / LOCK_NAME).exists()


def test_a_crafted_file_is_refused_also_when_the_resume_would_be_refused(run):
    root, checkpoints, _ = run
    created = root / "pwned"
    victim = _checkpoint(checkpoints, 4) / TRAINER_STATE
    write_payload(victim, created)
    reseal(victim.parent)
    with pytest.raises(UnsafeFileError, match=re.escape(str(victim))):
        start_run(_config(root, resume=True, batch_size=512).resolve()).run()  # another setting too
    assert not created.exists()


# --- 2. --resume deletes nothing it should keep -------------------------------------------


@pytest.mark.parametrize("pointer", ["deleted", "emptied"])
def test_without_its_pointer_resume_finds_the_newest_checkpoint(run, pointer, capsys):
    root, checkpoints, expected = run
    if pointer == "deleted":
        (checkpoints / "latest").unlink()
    else:
        (checkpoints / "latest").write_text("")
    metrics = start_run(_config(root, resume=True).resolve()).run()
    assert "resumed from step 4 of epoch 1" in capsys.readouterr().err
    assert {k: metrics[k] for k in COMPARED} == expected
    assert (checkpoints / "latest").read_text() == "latest-e1-s10"


def test_foreign_directories_and_copies_are_never_deleted_or_used(run, capsys):
    root, checkpoints, expected = run
    other = checkpoints / "notes-of-another-tool"
    other.mkdir()
    (other / "data.bin").write_bytes(b"mine")
    copy = checkpoints / "my-copy-of-step-4"
    shutil.copytree(_checkpoint(checkpoints, 4), copy)
    copied = snapshot(copy)
    metrics = start_run(_config(root, resume=True).resolve()).run()
    err = capsys.readouterr().err
    assert f"left {copy}, {other} alone: not checkpoints of this project" in err
    assert {k: metrics[k] for k in COMPARED} == expected
    assert (other / "data.bin").read_bytes() == b"mine" and snapshot(copy) == copied
    # The run's own older checkpoints were pruned; the copy and the foreign files stay.
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(
        ["latest", "latest-e0-s10", "latest-e1-s10", copy.name, other.name]
    )
    # --overwrite deletes this project's checkpoints only.
    start_run(_config(root, overwrite=True, max_steps=2).resolve()).run()
    assert (other / "data.bin").exists() and snapshot(copy) == copied


def test_an_unfinished_write_of_ours_is_removed_and_nothing_else(run, capsys):
    root, checkpoints, _ = run
    store = CheckpointStore(checkpoints)
    # A write killed before its manifest: our marker, no manifest.
    killed = checkpoints / "latest-e0-s6"
    shutil.copytree(_checkpoint(checkpoints, 4), killed)
    (killed / MANIFEST).unlink()
    (killed / ".torchrec_cowclip-writing").write_text("{}")
    assert store.unfinished() == [killed]
    start_run(_config(root, resume=True, max_steps=4).resolve()).run()
    assert f"removed {killed}, left by an interrupted checkpoint write" in capsys.readouterr().err
    assert not killed.exists() and _checkpoint(checkpoints, 4).exists()


# --- 3. damaged checkpoints never resume silently ------------------------------------------


def _flip_a_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("weights", "checksum mismatch"),
        ("truncated", "size"),
        ("mixed", "checksum mismatch"),
        ("extra file", "not part of this checkpoint"),
    ],
)
def test_a_damaged_latest_falls_back_to_the_previous_checkpoint(run, damage, reason, capsys):
    root, checkpoints, expected = run
    newest = _checkpoint(checkpoints, 4)
    if damage == "weights":
        _flip_a_byte(newest / "__0_0.distcp")
    elif damage == "truncated":
        data = (newest / "__0_0.distcp").read_bytes()
        (newest / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    elif damage == "mixed":  # another checkpoint's file in this one
        shutil.copy(_checkpoint(checkpoints, 2) / TRAINER_STATE, newest / TRAINER_STATE)
    else:
        shutil.copy(_checkpoint(checkpoints, 2) / "__0_0.distcp", newest / "__1_0.distcp")
    metrics = start_run(_config(root, resume=True).resolve()).run()
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "is damaged" in x)
    assert line.startswith(f"checkpoint {newest} is damaged ({newest}/") and reason in line
    assert line.endswith(f"falling back to {_checkpoint(checkpoints, 2)}")
    assert "resumed from step 2 of epoch 1" in err
    assert {k: metrics[k] for k in COMPARED} == expected


def test_with_no_intact_checkpoint_the_resume_is_refused_naming_the_file(run, capsys):
    root, checkpoints, _ = run
    for step in (2, 4):
        _flip_a_byte(_checkpoint(checkpoints, step) / "__0_0.distcp")
    with pytest.raises(SystemExit) as exit_info:
        main(CLI + ["--out", str(root / "run"), "--cache-dir", str(root / "cache"), "--resume"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"torchrec-cowclip: error: no intact 'latest' checkpoint in {checkpoints}: "
        f"{_checkpoint(checkpoints, 4)}/__0_0.distcp: checksum mismatch (the manifest lists "
        "other bytes); restore the file, or start anew with --overwrite"
    )
    with pytest.raises(DamagedCheckpointError):
        CheckpointStore(checkpoints).intact("latest")


def test_a_checkpoint_of_an_older_version_is_refused_as_unverifiable(run):
    root, checkpoints, _ = run
    for step in (2, 4):
        (_checkpoint(checkpoints, step) / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="has no manifest: written by an older version"):
        start_run(_config(root, resume=True).resolve()).run()


@pytest.mark.parametrize("keep", [1, 3])
def test_keep_checkpoints_keeps_the_last_k(tmp_path, keep):
    start_run(_config(tmp_path, max_steps=8, keep_checkpoints=keep).resolve()).run()
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["latest"] + sorted(f"latest-e0-s{s}" for s in (8, 6, 4)[:keep])


def test_a_rank_result_file_is_read_as_plain_data_and_never_runs(tmp_path):
    """The distributed tests read their ranks' result files as checkpoints are read:
    options saved as plain data come back equal; a crafted pickle is refused, not run."""
    path, created = tmp_path / "results.pt", tmp_path / "created"
    options = CowClipOptions(optimizer="sgd", unclipped_tables=frozenset({"t1"}))
    save_result({"options": options, "clips": {"t0": (2, 1)}}, str(path))
    loaded = load_result(str(path))
    assert loaded == {"options": plain(options), "clips": {"t0": (2, 1)}}
    assert loaded["options"]["cowclip"] == {"r": 1.0, "zeta": 1e-5}
    assert loaded["options"]["unclipped_tables"] == ["t1"]
    write_payload(path, created)
    with pytest.raises(pickle.UnpicklingError):
        load_result(str(path))
    assert not created.exists()

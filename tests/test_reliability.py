"""Runs that defend themselves (issue 13, trainer side): --resume checks the checkpoint's
settings and data, one run per --out, non-finite hyperparameters and checkpoints refused,
stale temp files removed, and every flag error one line."""

import doctest
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_testing import reseal, snapshot
from serving_cases import cli_refusal
from tiny import TINY_CLI, bag_config, tiny_config
from torchrec import KeyedJaggedTensor

import torchrec_cowclip.run.resume_guard as resume_guard
from torchrec_cowclip import CowClipEmbeddingBagCollection
from torchrec_cowclip.cli import main
from torchrec_cowclip.optim.fused import validate_hyperparameters
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.run.checkpoints import (
    TRAINER_STATE,
    WRITING_MARKER,
    CheckpointStore,
    NonFiniteStateError,
    nonfinite_tensors,
)
from torchrec_cowclip.run.out_dir import (
    LOCK_NAME,
    RUN_FILES,
    RunDirError,
    lock_holder,
)
from torchrec_cowclip.run.resume_guard import ResumeRefused
from torchrec_cowclip.train.config import RECORDED_SETTINGS
from torchrec_cowclip.train.loop import NonFiniteLossError
from torchrec_cowclip.train.start import start_run

REPO = Path(__file__).resolve().parents[1]
CRITEO_SAMPLE = REPO / "tests" / "data" / "criteo_sample.tsv"


def _saved_state(run: Path) -> dict:
    """The trainer state of the run's latest checkpoint."""
    return CheckpointStore(run / "checkpoints").trainer_state("latest")


def _config(out, cache, **overrides):
    return tiny_config(**{"out": str(out), "cache_dir": str(cache), **overrides})


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run stopped by --max-steps after 4 of its 10 steps, with its checkpoint."""
    root = tmp_path_factory.mktemp("interrupted")
    start_run(_config(root / "run", root / "cache", max_steps=4).resolve()).run()
    return root


def test_resume_guard_docstring_example():
    result = doctest.testmod(resume_guard, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# Each changes the result; (override, flag, checkpoint's value, this command's value).
REFUSED = [
    (dict(batch_size=512), "--batch-size", "256", "512"),
    (dict(seed=1), "--seed", "0", "1"),
    (dict(data="synthetic:2500"), "--data", "synthetic:3000", "synthetic:2500"),
    (dict(model="wdl"), "--model", "deepfm", "wdl"),
    (dict(embedding_optimizer="sgd"), "--embedding-optimizer", "adam", "sgd"),
    (dict(lr=1e-2), "--lr", "0.0004", "0.01"),
    (dict(lr_embed=1e-2), "--lr-embed", "0.0001", "0.01"),
    (dict(l2=1e-3), "--l2", "2.5e-06", "0.001"),
    (dict(recipe="fixed-l2"), "--recipe", "paper", "fixed-l2"),
    (dict(cowclip=False), "CowClip (--no-cowclip)", "on", "off"),
    (dict(clip_zeta=1e-3), "--clip-zeta", "2e-05", "0.001"),
    (dict(hidden=(16,)), "--hidden", "8,8", "16"),
    (dict(embedding_dim=8), "--embedding-dim", "4", "8"),
    (dict(val_fraction=0.1), "--val-fraction", "0", "0.1"),
    (dict(synthetic_scale=0.002), "--synthetic-scale", "0.001", "0.002"),
    (dict(threads=2), "--threads", "1", "2"),
    (dict(base_batch_size=512), "--base-batch-size", "1024", "512"),
]


@pytest.mark.parametrize("override, flag, old, new", REFUSED, ids=[r[1] for r in REFUSED])
def test_resume_with_a_result_changing_setting_is_refused_before_anything_changes(
    interrupted, override, flag, old, new
):
    out = interrupted / "run"
    before = snapshot(out)
    cfg = _config(out, interrupted / "cache", resume=True, **override)
    with pytest.raises(ResumeRefused) as refused:
        start_run(cfg.resolve()).run()
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--resume refused: the checkpoint in {out}")
    assert re.search(
        rf"{re.escape(flag)} {re.escape(old)}(, this command has | vs ){re.escape(new)}", message
    ), message
    assert snapshot(out) == before, "a refused resume changed the run directory"
    assert not (out / LOCK_NAME).exists()


def test_resume_refusal_names_every_difference_and_fewer_epochs(interrupted):
    with pytest.raises(ResumeRefused) as refused:
        start_run(
            _config(
                interrupted / "run", interrupted / "cache", resume=True, seed=3, model="dcn"
            ).resolve()
        ).run()
    message = str(refused.value)
    assert "--model deepfm, this command has dcn" in message
    assert (
        "; --seed 0 vs 3" in message
        and "; --data content 3000 rows in cache entry synthetic-" in message
    )
    base = _saved_state(interrupted / "run")["run_record"]["settings"]
    saved = {"settings": {**base, "epochs": 3}, "data": {"rows": 1, "cache_entry": "x"}}
    now = {"settings": base, "data": {"rows": 1, "cache_entry": "x"}}
    assert resume_guard.resume_differences(saved, now, RECORDED_SETTINGS) == [
        ("--epochs", "3", "1 (a resumed run may only add epochs)")
    ]


def test_resume_refused_when_the_data_files_changed(tmp_path):
    data = tmp_path / "day.tsv"
    shutil.copy(CRITEO_SAMPLE, data)
    kw = dict(
        data=f"criteo:{data}",
        batch_size=32,
        test_fraction=0.2,
        synthetic_scale=None,
        synthetic_max_cardinality=None,
    )
    start_run(_config(tmp_path / "run", tmp_path / "cache", max_steps=2, **kw).resolve()).run()
    before = snapshot(tmp_path / "run")
    lines = CRITEO_SAMPLE.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:150]))  # same --data, other content
    with pytest.raises(
        ResumeRefused,
        match=r"--data content 200 rows in cache entry criteo-\w+, "
        r"this command has 150 rows in cache entry criteo-\w+",
    ):
        start_run(_config(tmp_path / "run", tmp_path / "cache", resume=True, **kw).resolve()).run()
    assert snapshot(tmp_path / "run") == before


def test_resume_of_a_checkpoint_without_run_record_is_refused(interrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(interrupted / "run", out)
    checkpoint = CheckpointStore(out / "checkpoints").path_of("latest")
    state = torch.load(checkpoint / TRAINER_STATE, weights_only=True)
    del state["run_record"]  # as written before the record existed
    torch.save(state, checkpoint / TRAINER_STATE)
    reseal(checkpoint)
    with pytest.raises(ResumeRefused, match="has no run record"):
        start_run(_config(out, interrupted / "cache", resume=True).resolve()).run()


HARMLESS = [
    dict(epochs=2),
    dict(progress=True),
    dict(log_every=3),
    dict(checkpoint_every=2),
    dict(max_steps=8),
    dict(lr=4e-4),  # the recipe's own value, given explicitly
    "cache_dir",
]


@pytest.mark.parametrize(
    "override", HARMLESS, ids=lambda o: o if isinstance(o, str) else next(iter(o))
)
def test_resume_with_a_harmless_change_is_accepted(interrupted, tmp_path, capsys, override):
    out = tmp_path / "run"
    shutil.copytree(interrupted / "run", out)
    if override == "cache_dir":
        override = dict(cache_dir=str(tmp_path / "moved-cache"))
    cfg = _config(out, interrupted / "cache", resume=True, **override)
    metrics = start_run(cfg.resolve()).run()
    assert "resumed from step 4 of epoch 1 (batch 4 of 10)" in capsys.readouterr().err
    assert metrics["steps"] == override.get("max_steps", 10 * override.get("epochs", 1))


def test_resume_drops_the_log_rows_written_after_the_checkpoint(interrupted, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(interrupted / "run", out)
    steps = (out / "steps.csv").read_text().splitlines(keepends=True)
    assert len(steps) == 5  # header + steps 1-4, the checkpoint's step
    # What a run killed at step 6 leaves: two rows the checkpoint does not cover.
    (out / "steps.csv").write_text("".join(steps) + "5,0.5,0.5,1.0,1e-4\n6,0.5,0.5,1.0,1e-4\n")
    start_run(_config(out, interrupted / "cache", resume=True).resolve()).run()
    assert "dropped 2 log rows written after the checkpoint" in capsys.readouterr().err
    logged = [row.split(",")[0] for row in (out / "steps.csv").read_text().splitlines()[1:]]
    assert logged == [str(i) for i in range(1, 11)]


# --- one run per --out -------------------------------------------------------------------

_HOLD_LOCK = (
    "import sys, time; from pathlib import Path; "
    "from torchrec_cowclip.run.checkpoints import CheckpointStore; "
    "from torchrec_cowclip.run.out_dir import claim_run_dir; "
    "out = Path(sys.argv[1]); "
    "lock = claim_run_dir(out, False, False, checkpoints=CheckpointStore(out / 'checkpoints')); "
    "print('locked', flush=True); time.sleep(120)"
)


def test_a_second_run_into_a_locked_out_fails_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(out)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert lock_holder(out) == holder.pid
        err = cli_refusal(
            capsys, "train", "--data", "synthetic:3000", "--out", out, "--cache-dir",
            tmp_path / "cache",
        )  # fmt: skip
        assert f"--out {out} is in use by another run (pid {holder.pid}" in err
    finally:
        holder.kill()  # SIGKILL: no clean-up runs in the holder
        holder.wait()
    # The dead holder's lock file is still there, but its lock died with it.
    assert (out / LOCK_NAME).exists() and lock_holder(out) is None
    start_run(_config(out, tmp_path / "cache", max_steps=2).resolve()).run()
    assert not (out / LOCK_NAME).exists(), "a finished run removes its lock file"


def test_an_out_holding_another_run_is_refused_unless_overwrite(interrupted, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(interrupted / "run", out)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    with pytest.raises(
        RunDirError,
        match=rf"--out {re.escape(str(out))} holds another run's files "
        r"\(checkpoints, metrics.json, steps.csv, tb, curves.png, model\): add --resume",
    ):
        start_run(_config(out, interrupted / "cache", max_steps=2).resolve())
    assert snapshot(out) == before
    capsys.readouterr()
    metrics = start_run(
        _config(out, interrupted / "cache", max_steps=2, overwrite=True).resolve()
    ).run()
    assert (
        "--overwrite: removed checkpoints, metrics.json, steps.csv, tb, curves.png, model from"
        in capsys.readouterr().err
    )
    assert metrics["steps"] == 2 and (out / "notes.txt").read_text() == "mine"
    steps = (out / "steps.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in steps] == ["step", "1", "2"], "the old run's rows are gone"


def test_run_files_lists_everything_a_run_writes(interrupted):
    assert {p.name for p in (interrupted / "run").iterdir()} <= set(RUN_FILES)


def test_stale_temp_files_are_removed_at_start(interrupted, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(interrupted / "run", out)
    # What a SIGKILL during a checkpoint write / the metrics write leaves.
    half = out / "checkpoints" / "latest-e0-s99"
    half.mkdir()
    (half / WRITING_MARKER).write_text("{}")
    (half / "__0_0.distcp").write_bytes(b"half a checkpoint")
    (out / "checkpoints" / "latest.tmp").write_text("latest-e0-s9")
    (out / "metrics.json.tmp").write_text("{")
    start_run(_config(out, interrupted / "cache", resume=True).resolve()).run()
    err = capsys.readouterr().err
    assert f"removed metrics.json.tmp from {out}, left by an interrupted write" in err
    assert f"removed {half}, left by an interrupted checkpoint write" in err
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["checkpoints", "metrics.json", "steps.csv", "epochs.csv", "tb", "curves.png", "model"]
    )
    # The pointer and the last two complete checkpoints (--keep-checkpoints 2).
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest",
        "latest-e0-s4",
        "latest-e1-s10",
    ]


# --- non-finite hyperparameters and checkpoints ------------------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("lr", math.inf),
        ("lr", math.nan),
        ("lr", -1.0),
        ("eps", math.inf),
        ("weight_decay", math.nan),
    ],
)
def test_optimizer_constructor_rejects_non_finite_and_negative(key, value):
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, cowclip=None)
    with pytest.raises(ValueError, match=f"{key} must be >=? 0 and finite, got {value}"):
        validate_hyperparameters({**kw, key: value})


def _ebc():
    torch.manual_seed(0)
    return CowClipEmbeddingBagCollection(
        tables=[bag_config("t0", 4, 20, ["f0"])], options=CowClipOptions(optimizer="adam", lr=1e-2)
    )


def _step(ebc):
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])
    )
    ebc(kjt).values().square().sum().backward()


@pytest.mark.parametrize(
    "key, value",
    [
        ("lr", math.inf),
        ("lr", math.nan),
        ("lr", -1e-3),
        ("weight_decay", math.inf),
        ("eps", math.nan),
        ("betas", (0.9, math.nan)),
    ],
)
def test_param_group_edited_to_non_finite_raises_before_any_weight_changes(key, value):
    ebc = _ebc()
    _step(ebc)

    def optimizer_state():
        return {
            (k, name): t.clone()
            for k, per_param in ebc.fused_optimizer.state_dict()["state"].items()
            for name, t in per_param.items()
        }

    before = optimizer_state()
    assert before
    weights = ebc.state_dict()["embedding_bags.t0.weight"].clone()
    steps = ebc.clip_stats()["t0"].steps
    ebc.fused_optimizer.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: {key}"):
        _step(ebc)
    torch.testing.assert_close(
        ebc.state_dict()["embedding_bags.t0.weight"], weights, rtol=0, atol=0
    )
    assert ebc.clip_stats()["t0"].steps == steps
    after = optimizer_state()
    assert after.keys() == before.keys() and all(
        torch.equal(after[k], v) for k, v in before.items()
    )


def test_nonfinite_tensors_names_each_bad_tensor_once_per_tensor():
    state = {
        "model": {"w": torch.ones(3), "b": torch.tensor([1.0, math.nan]), "ids": torch.arange(3)},
        "optimizer": [
            {"exp_avg": torch.tensor([math.inf])},
            torch.full((4,), 3e38),
        ],  # sum overflows
        "progress": {"epoch": 1},
    }
    assert nonfinite_tensors(state) == ["model.b", "optimizer.0.exp_avg"]


def test_a_checkpoint_with_non_finite_weights_is_never_written(tmp_path):
    trainer = start_run(_config(tmp_path / "run", tmp_path / "cache", max_steps=2).resolve())
    trainer.run()
    before = snapshot(tmp_path / "run")
    name, param = next(iter(trainer.runtime.model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = math.inf
    with pytest.raises(
        NonFiniteStateError,
        match=rf"refusing to write .*latest-\S+: non-finite values in "
        rf"model.model.{re.escape(name)}.*the last good checkpoint is "
        r".*latest-\S+ \(step 2",
    ):
        trainer.save()
    assert snapshot(tmp_path / "run") == before
    assert _saved_state(tmp_path / "run")["progress"]["global_step"] == 2


def _poison_loss_at(monkeypatch, call):
    from torchrec_cowclip.models import task as task_module

    original, calls = task_module.CTRTrainTask.forward, {"n": 0}

    def poisoned(self, batch):
        calls["n"] += 1
        loss, out = original(self, batch)
        if calls["n"] == call:
            loss = loss * float("nan")
        return loss, (loss.detach(),) + out[1:]

    monkeypatch.setattr(task_module.CTRTrainTask, "forward", poisoned)


def test_non_finite_loss_names_only_this_runs_checkpoint(interrupted, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(interrupted / "run", out)  # another run's checkpoint, deleted by --overwrite
    _poison_loss_at(monkeypatch, 2)
    with pytest.raises(
        NonFiniteLossError, match="at step 2 .*stopping: this run wrote no checkpoint"
    ):
        start_run(_config(out, interrupted / "cache", overwrite=True).resolve()).run()
    shutil.rmtree(out)
    shutil.copytree(interrupted / "run", out)
    monkeypatch.undo()
    _poison_loss_at(monkeypatch, 3)  # a resumed run: the checkpoint it resumed from counts
    with pytest.raises(
        NonFiniteLossError,
        match=rf"at step 7 .*the last good checkpoint is "
        rf"{re.escape(str(out))}/checkpoints/latest-\S+ \(step 4;",
    ):
        start_run(_config(out, interrupted / "cache", resume=True).resolve()).run()


def test_skipped_rows_per_reason_are_in_metrics_json(tmp_path):
    lines = CRITEO_SAMPLE.read_text().splitlines(keepends=True)
    data = tmp_path / "day.tsv"
    data.write_text("".join(lines[:100]) + "1\t2\t3\n" + "".join(lines[100:]))  # one short row
    metrics = start_run(
        _config(
            tmp_path / "run",
            tmp_path / "cache",
            data=f"criteo:{data}",
            batch_size=32,
            test_fraction=0.2,
            on_bad_row="skip",
            max_steps=2,
            synthetic_scale=None,
            synthetic_max_cardinality=None,
        ).resolve()
    ).run()
    skipped = metrics["dataset"]["bad_rows_skipped"]
    assert sum(skipped.values()) == 1 and metrics["dataset"]["rows"] == 200, skipped


# --- every flag error: one line, exit 2, no traceback ------------------------------------

FLAG_ERRORS = [
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--lr-embed", "inf"], "--lr-embed must be a finite number"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--l2", "nan"], "--l2 must be a finite number"),
    (["--clip-zeta", "nan"], "--clip-zeta must be a finite number"),
    (["--clip-r", "inf"], "--clip-r must be a finite number"),
    (["--clip-r", "-1"], "--clip-r must be > 0"),
    (["--warmup-epochs", "nan"], "--warmup-epochs must be a finite number"),
    (["--count-lr-power", "nan"], "--count-lr-power must be a finite number"),
    (["--init-std", "inf"], "--init-std must be a finite number"),
    (["--dist-timeout", "nan"], "--dist-timeout must be a finite number"),
    (["--l2=-1e-5"], "--l2 must be >= 0"),
    (["--clip-r", "2", "--no-cowclip"], "--clip-r 2 has no effect with --no-cowclip"),
    (["--clip-zeta", "1e-5", "--no-cowclip"], "--clip-zeta 1e-05 has no effect with --no-cowclip"),
    (
        ["--sharding", "table_wise"],
        "--sharding table_wise shards tables over processes: this is one process",
    ),
    (["--device", "cuda:99"], "--device cuda:99: this machine has"),
    (["--device", "tpu"], "--device must be auto, cpu or cuda[:N], got 'tpu'"),
    (["--resume", "--overwrite"], "give one"),
    (["--helen-rho", "nan"], "--helen-rho: Helen.rho must be >= 0 and finite, got nan"),
    (["--helen-rho=-0.1"], "--helen-rho: Helen.rho must be >= 0 and finite"),
    (["--helen-rho", "0.05", "--helen-bound", "2"], "--helen-bound: Helen.bound must be in [0, 1]"),
    (["--helen-bound", "0.5"], "--helen-bound 0.5 has no effect without --helen-rho"),
    (["--helen-perturb-dense"], "--helen-perturb-dense has no effect without --helen-rho"),
    (
        ["--helen-rho", "0.05", "--embedding-backend", "torchrec", "--no-cowclip"],
        "Helen (--helen-rho, or a recipe with Helen) trains the fused CowClip tables: use "
        "--embedding-backend cowclip",
    ),
    # Found only after the data build or the compile before (issue 21, failure 7).
    (["--log-every", "0"], "--log-every must be > 0, got 0"),
    (["--threads=-1"], "--threads must be >= 0, got -1"),
    (["--model", "dcn", "--cross-layers", "0"], "--cross-layers must be > 0, got 0"),
    (["--seed=-1"], "--seed must be in [0, 2**32), got -1"),
    (["--synthetic-seed", "4294967296"], "--synthetic-seed must be in [0, 2**32), got 4294967296"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be > 0, got 0"),
    (["--resume", "auto", "--overwrite"], "give one"),
    (
        ["--data", f"table:{CRITEO_SAMPLE}", "--synthetic-scale", "0.1"],
        "table: does not take cardinality_scale (--synthetic-scale); it applies to synthetic:",
    ),
]


@pytest.mark.parametrize("flags, message", FLAG_ERRORS, ids=[" ".join(f[0]) for f in FLAG_ERRORS])
def test_flag_errors_are_one_line_naming_the_flag(tmp_path, capsys, flags, message):
    err = cli_refusal(
        capsys, "train", "--data", "synthetic:3000", "--out", tmp_path / "o", "--cache-dir",
        tmp_path / "c", *flags,
    )  # fmt: skip
    assert message in err, err
    assert not (tmp_path / "o").exists(), "nothing is created before the flags are checked"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["train", "--data", "synthetic:3000", "--out", str(tmp_path / "o"), "--device", "cuda"]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda: this machine has no CUDA device" in err and err.count("\n") == 1


def test_refused_resume_through_the_cli_is_one_line(interrupted, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            TINY_CLI
            + ["--out", str(interrupted / "run"), "--cache-dir", str(interrupted / "cache")]
            + ["--resume", "--batch-size", "512"]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("torchrec-cowclip: error: --resume refused:") and err.count("\n") == 1

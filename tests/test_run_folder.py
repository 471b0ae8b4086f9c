"""The run folder (``<out>/model``): self-contained, verified, safe to load, and what
``train()`` returns with it."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
from serving_cases import cli_refusal, copy_run, reseal_run_folder, trained_sample
from tiny import tiny_config

import torchrec_cowclip
from torchrec_cowclip.run.checkpoints import CheckpointStore
from torchrec_cowclip.run.model_folder import MANIFEST, RunFolder, RunFolderError
from torchrec_cowclip.run.out_dir import RunDirError
from torchrec_cowclip.run.safe_load import UnsafeFileError
from torchrec_cowclip.train import TrainResult, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return trained_sample(tmp_path_factory.mktemp("run_folder"))


_copy = copy_run  # a copy of the trained run to damage


def test_the_run_folder_holds_what_scoring_needs(trained):
    model = trained["run"] / "model"
    names = {str(p.relative_to(model)) for p in model.rglob("*") if p.is_file()}
    assert {"manifest.json", "model.json", "data.json", "encoders/id_vocab.npz"} <= names
    assert any(n.startswith("weights/final/") and n.endswith(".distcp") for n in names)
    run = RunFolder.open(trained["run"])
    assert run.reported == "final" and sorted(run.weights) == ["final"]
    data = run.data_info
    # The data schema: the kind's every option, the columns, how the files were read.
    assert data["kind"] == "table" and data["options"]["label"] == "label"
    assert data["options"]["sparse"][:2] == ["C1", "C2"] and "on_bad_row" in data["options"]
    assert data["reader"]["layout"]["header"] is True
    assert data["schema"]["dense_names"][0] == "I1"
    assert data["encoder"]["encoding"]["kind"] == "id vocabulary"
    assert run.metrics["auc"] == pytest.approx(trained["metrics"]["auc"])
    assert run.model_info["arguments"]["hidden"] == [8]


def test_it_needs_no_cache_and_moves_anywhere(trained, tmp_path):
    moved = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(trained["run"], moved)
    before = torchrec_cowclip.load_model(trained["run"]).predict(trained["test"])
    shutil.rmtree(trained["root"] / "cache", ignore_errors=True)
    after = torchrec_cowclip.load_model(moved).predict(trained["test"])
    np.testing.assert_array_equal(before, after)
    # The model/ folder itself opens too.
    assert RunFolder.open(moved / "model").path == moved


def test_a_changed_file_is_refused_naming_it(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    weights = next((run / "model" / "weights" / "final").glob("*.distcp"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(RunFolderError, match=rf"{weights.name}: checksum mismatch"):
        RunFolder.open(run)
    out = tmp_path / "scores.csv"
    err = cli_refusal(capsys, "predict", "--run", run, "--data", trained["test"], "--output", out)
    assert "checksum mismatch" in err and not out.exists()


def test_a_file_outside_the_manifest_is_refused(trained, tmp_path):
    run = _copy(trained, tmp_path)
    (run / "model" / "weights" / "final" / "__1_0.distcp").write_bytes(b"extra")
    with pytest.raises(RunFolderError, match="not part of this run folder"):
        RunFolder.open(run)


def test_a_newer_or_foreign_format_is_refused(trained, tmp_path):
    run = _copy(trained, tmp_path)
    manifest_path = run / "model" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(RunFolderError, match="format version 99.*reads versions up to 2"):
        RunFolder.open(run)
    manifest_path.write_text(json.dumps({**manifest, "format": "something else"}))
    with pytest.raises(RunFolderError, match="not a torchrec_cowclip run folder"):
        RunFolder.open(run)


def test_an_unfinished_run_is_not_a_run_folder(trained, tmp_path):
    run = _copy(trained, tmp_path)
    shutil.rmtree(run / "model")
    with pytest.raises(RunFolderError, match="has not finished.*--resume"):
        RunFolder.open(run)


def test_a_crafted_pickle_is_refused_even_with_a_matching_manifest(trained, tmp_path):
    run = _copy(trained, tmp_path)

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(run / "model" / "weights" / "final" / ".metadata", "wb") as f:
        pickle.dump(Payload(), f)
    reseal_run_folder(run / "model")
    with pytest.raises(UnsafeFileError, match="refused to load"):
        torchrec_cowclip.load_model(run)


def test_a_second_run_into_the_folder_is_refused_and_overwrite_replaces_it(trained, tmp_path):
    config = tiny_config(tmp_path, max_steps=2)
    train(config)
    with pytest.raises(RunDirError, match="model"):
        train(config)
    train(tiny_config(tmp_path, max_steps=3, overwrite=True))
    assert RunFolder.open(tmp_path / "run").metrics["steps"] == 3
    assert not (tmp_path / "run" / "model.tmp").exists()


def test_train_returns_the_metrics_with_the_run_dir_and_model(tmp_path):
    result = train(
        tiny_config(tmp_path, val_fraction=0.1, early_stop_patience=1, epochs=2, lr_embed=1e-2)
    )
    assert isinstance(result, TrainResult) and isinstance(result, dict)
    assert result["steps"] > 0 and result.metrics["auc"] == result["auc"]
    assert json.loads((result.run_dir / "metrics.json").read_text())["auc"] == result["auc"]
    assert not result.model.training
    # Early stopping keeps the last step's weights and the best epoch's; the best are reported.
    run = RunFolder.open(result.run_dir)
    assert sorted(run.weights) == ["best", "final"] and run.reported == "best"
    model = torchrec_cowclip.load_model(result.run_dir)
    assert model.weights == "best"
    loaded = dict(model.model.state_dict())
    for key, value in result.model.state_dict().items():
        np.testing.assert_array_equal(loaded[key].numpy(), value.numpy(), err_msg=key)
    assert torchrec_cowclip.load_model(result.run_dir, weights="final").weights == "final"


def _worsening_validation(monkeypatch):
    """Validation AUC 0.7, 0.69, 0.68, ...: the first epoch is the best."""
    from torchrec_cowclip.train.loop import TrainingLoop

    real = TrainingLoop._evaluate

    def evaluate(self, indices, name=None):
        result = real(self, indices, name)
        if name == "validation":
            result = {**result, "auc": 0.7 - 0.01 * self.progress.epoch}
        return result

    monkeypatch.setattr(TrainingLoop, "_evaluate", evaluate)


def test_a_validation_split_keeps_the_best_epochs_weights_without_early_stopping(
    tmp_path, monkeypatch, capsys
):
    """The issue's case: best_epoch 2 was reported but only the last epoch was kept."""
    _worsening_validation(monkeypatch)
    result = train(tiny_config(tmp_path, val_fraction=0.1, epochs=3, lr_embed=1e-2))
    assert result["best_epoch"] == 1 and result["epochs"] == 3
    assert result["weights"] == {"default": "final", "kept": ["final", "best"], "best_epoch": 1}
    run = RunFolder.open(result.run_dir)
    assert sorted(run.weights) == ["best", "final"] and run.reported == "final"
    err = capsys.readouterr().err
    assert "weights/final (the last step's, epoch 3), which predict and evaluate use by " in err
    assert "best (epoch 1, the best validation AUC): --weights best" in err
    final = torchrec_cowclip.load_model(result.run_dir)
    best = torchrec_cowclip.load_model(result.run_dir, weights="best")
    assert final.weights == "final" and best.weights == "best"
    live = result.model.state_dict()  # the model train returns is the last step's
    for key, value in final.model.state_dict().items():
        np.testing.assert_array_equal(live[key].numpy(), value.numpy(), err_msg=key)
    store = CheckpointStore(result.run_dir / "checkpoints")
    tensors = {"model": {f"model.{k}": v.clone() for k, v in best.model.state_dict().items()}}
    saved = {k: v.clone() for k, v in tensors["model"].items()}
    store.load(next(iter(store.complete("best"))), tensors)  # epoch 1's checkpoint
    for key, value in saved.items():
        np.testing.assert_array_equal(tensors["model"][key].numpy(), value.numpy(), err_msg=key)
    assert any(not np.array_equal(live[k[6:]].numpy(), v.numpy()) for k, v in saved.items())


def test_early_stopping_is_announced_on_the_console(tmp_path, monkeypatch, capsys):
    _worsening_validation(monkeypatch)
    result = train(
        tiny_config(tmp_path, val_fraction=0.1, epochs=4, early_stop_patience=1, lr_embed=1e-2)
    )
    assert result["stopped_early"] and result["epochs"] == 2
    err = capsys.readouterr().err
    assert (
        "early stopping after epoch 2 of 4: no better validation AUC for 1 epoch(s) "
        "(--early-stop-patience 1); the best was epoch 1 (0.70000), whose weights the run "
        "keeps and reports"
    ) in err
    assert "weights/best (epoch 1, the best validation AUC), which predict and evaluate" in err

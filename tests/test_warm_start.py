"""``train --init-from RUN``: a finished run's model keeps learning on the next file, with
its vocabularies grown, its weights (and optimizer state) carried, and any mismatch of
the command with RUN refused in one line before anything is written."""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from serving_cases import AVAZU_CSV, DENSE, SPARSE, TABLE_COLUMNS, cli_refusal, train_table
from tiny import cli_args

from torchrec_cowclip.cli import main
from torchrec_cowclip.data.pipeline.run_encoders import IdVocabulary
from torchrec_cowclip.data.sources.synthetic import PlantedModel, SyntheticConfig
from torchrec_cowclip.run.model_folder import RunFolder, RunFolderError
from torchrec_cowclip.train import ConfigError, TrainConfig
from torchrec_cowclip.train.start import start_run
from torchrec_cowclip.train.warm_start import WarmStartRefused, warm_start_config

#: Both days' model (explicit, so that the fresh run on day 2 is the same model).
MODEL = dict(batch_size=512, epochs=1, hidden=(32,), embedding_dim=8, lr_embed=1e-2, seed=0)


def _write_days(root: Path) -> dict:
    """Three files of one planted click model: day 1, day 2 (8,000 rows each; day 2 holds
    ids day 1 never saw) and a test day."""
    config = SyntheticConfig(rows=24000, seed=3, cardinality_scale=0.01, max_cardinality=2000)
    chunks = list(PlantedModel(config).chunks())
    dense = np.concatenate([c.dense_raw for c in chunks])
    sparse = np.concatenate([c.sparse for c in chunks])
    labels = np.concatenate([c.labels for c in chunks])
    parts = {"day1": range(0, 8000), "day2": range(8000, 16000), "test": range(16000, 24000)}
    files = {name: root / f"{name}.csv" for name in parts}
    for name, rows in parts.items():
        with open(files[name], "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["label", *DENSE, *SPARSE])
            for i in rows:
                values = ["" if np.isnan(v) else int(v) for v in dense[i]]
                writer.writerow(
                    [int(labels[i]), *values, *[format(int(s), "x") for s in sparse[i]]]
                )
    return files


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("warm_start")
    files = _write_days(root)
    cache = root / "cache"
    day1 = train_table(root / "day1", files["day1"], files["test"], cache, **MODEL)
    return {"root": root, "cache": cache, "day1_metrics": day1, **files}


def test_a_warm_start_on_the_next_day_keeps_improving(days, tmp_path):
    cache = days["cache"]
    warm = train_table(
        tmp_path / "day2",
        days["day2"],
        days["test"],
        cache,
        init_from=days["root"] / "day1",
        **MODEL,
    )
    fresh = train_table(tmp_path / "fresh", days["day2"], days["test"], cache, **MODEL)
    assert warm["auc"] > days["day1_metrics"]["auc"] + 0.01
    assert warm["auc"] > fresh["auc"]
    # Day 1's ids stay; day 2's new values are appended after them.
    old = RunFolder.open(days["root"] / "day1")
    new = RunFolder.open(tmp_path / "day2")
    old_vocab = IdVocabulary.load(old.model_dir / old.data_info["encoder"]["vocabulary"])
    new_vocab = IdVocabulary.load(new.model_dir / new.data_info["encoder"]["vocabulary"])
    grown = 0
    for before, after in zip(old_vocab.keys, new_vocab.keys):
        np.testing.assert_array_equal(after[: len(before)], before)
        grown += len(after) > len(before)
    assert grown >= 5
    assert new.model_info["init_from"] == str(days["root"] / "day1")
    assert new.schema.cardinalities > old.schema.cardinalities


def test_weights_and_optimizer_state_come_from_run_and_new_rows_start_fresh(days, tmp_path):
    run = days["root"] / "day1"
    config = warm_start_config(
        run,
        data=f"table:{days['day2']}",
        test_data=f"table:{days['test']}",
        out=str(tmp_path / "day2"),
        cache_dir=str(days["cache"]),
        init_optimizer_state=True,
        progress=False,
        batch_size=512,
    )
    assert config.hidden == (32,) and config.embedding_dim == 8 and config.sparse == SPARSE
    trainer = start_run(config.resolve())
    try:
        before = {k: v.clone() for k, v in trainer.runtime.model.state_dict().items()}
        said = trainer.warm.load_into(trainer.runtime)
    finally:
        trainer.run_dir.release()
    assert "tables grew" in said and "optimizer state of" in said
    saved = RunFolder.open(run).build_model().state_dict()
    after = trainer.runtime.model.state_dict()
    table = "fields.collection.embedding_bags.emb_C3.weight"
    rows = saved[table].shape[0]
    assert after[table].shape[0] > rows
    torch.testing.assert_close(after[table][:rows], saved[table], rtol=0, atol=0)
    torch.testing.assert_close(after[table][rows:], before[table][rows:], rtol=0, atol=0)
    torch.testing.assert_close(after["linear.bias"], saved["linear.bias"], rtol=0, atol=0)
    state = trainer.runtime.optimizer.state_dict()["state"]
    assert int(state["dense.model.linear.bias"]["step"]) == days["day1_metrics"]["steps"]
    moments = state[f"embedding.model.{table}"]["exp_avg"]
    assert moments[:rows].abs().sum() > 0 and moments[rows:].abs().sum() == 0


def test_the_dense_plan_is_runs_not_the_new_datas(days, tmp_path):
    run = tmp_path / "standardized"
    train_table(run, days["day1"], days["test"], days["cache"], **MODEL,
                dense_transform="standardize", missing_indicator=True)  # fmt: skip
    saved = RunFolder.open(run).dense_plan()
    config = warm_start_config(
        run, data=f"table:{days['day2']}", out=str(tmp_path / "day2"),
        cache_dir=str(days["cache"]), progress=False,
    )  # fmt: skip
    trainer = start_run(config.resolve())
    trainer.run_dir.release()
    kept = trainer.data.dataset.dense_plan
    assert dataclasses.replace(kept, fitted_on=saved.fitted_on) == saved  # day 1's inputs
    # ... said as day 1's: the start line's statistics are not of the rows it trains on.
    assert kept.fitted_on == f"{saved.fitted_on} of --init-from {run}", kept.fitted_on
    assert saved.transforms == ("standardize",) * 13 and saved.indicators
    own = trainer.data.dataset.fit_dense_plan(trainer.data.train_idx)  # what day 2 alone would give
    assert own.shift != saved.shift


def test_the_cli_takes_runs_settings_for_flags_not_given(days, tmp_path, capsys):
    out = tmp_path / "day2"
    argv = cli_args(
        data=f"table:{days['day2']}", test_data=f"table:{days['test']}", out=out,
        cache_dir=days["cache"], init_from=days["root"] / "day1", no_progress=True,
        seed=5,
    )  # fmt: skip
    assert main(argv) == 0
    config = json.loads((out / "model" / "model.json").read_text())["config"]
    assert config["hidden"] == [32] and config["embedding_dim"] == 8 and config["label"] == "label"
    # The case: without --batch-size it trained at 1024, not RUN's batch.
    assert config["batch_size"] == 512 and config["lr_embed"] == 1e-2 and config["seed"] == 5
    err = capsys.readouterr().err
    assert "initialised from" in err
    line = next(x for x in err.splitlines() if x.startswith("from --init-from"))
    assert "(flags not given): " in line and "--batch-size 512" in line, line
    assert "--lr-embed 0.01" in line and "--hidden 32" in line and "--seed" not in line, line
    # Issue 46: the start line's statistics are said to be RUN's, not of the rows it trains on.
    dense = next(x for x in err.splitlines() if x.startswith("dense inputs: "))
    assert "; statistics of the " in dense and "of --init-from " in dense, dense
    assert dense.rstrip().endswith("day1") or "day1 (read in" in dense, dense


def test_a_command_that_does_not_fit_run_is_refused_before_anything_is_written(
    days, tmp_path, capsys
):
    run = days["root"] / "day1"
    common = dict(data=f"table:{days['day2']}", cache_dir=str(days["cache"]), progress=False)
    out = tmp_path / "out"
    with pytest.raises(WarmStartRefused, match=r"trained with --hidden 32, this command has 16"):
        start_run(warm_start_config(run, out=str(out), hidden=(16,), **common).resolve())
    with pytest.raises(
        WarmStartRefused,
        match=r"--hidden 32, this command has 8; --dense-transform signed-log vs minmax",
    ):
        start_run(TrainConfig(init_from=str(run), out=str(out), dense_transform="minmax", hidden=(8,),
                            embedding_dim=8, **TABLE_COLUMNS, **common).resolve())  # fmt: skip
    with pytest.raises(WarmStartRefused, match="is this run's --out"):
        start_run(warm_start_config(run, out=str(run), **common).resolve())
    with pytest.raises(RunFolderError, match="not a run folder"):
        start_run(
            TrainConfig(init_from=str(tmp_path), out=str(out), **TABLE_COLUMNS, **common).resolve()
        )
    with pytest.raises(ConfigError, match="--init-optimizer-state carries --init-from's"):
        TrainConfig(init_optimizer_state=True).validate()
    assert not out.exists()
    no_checkpoints = tmp_path / "copy"
    shutil.copytree(run, no_checkpoints)
    shutil.rmtree(no_checkpoints / "checkpoints")
    config = warm_start_config(
        no_checkpoints, out=str(out), init_optimizer_state=True, max_steps=1, **common
    )
    # Refused with RUN, before --out is made or any data read (issue 45).
    with pytest.raises(WarmStartRefused, match="has no checkpoint to take the optimizer state"):
        start_run(config.resolve())
    assert not out.exists()
    err = cli_refusal(
        capsys, "train", "--data", f"table:{days['day2']}", "--init-from", run, "--out",
        tmp_path / "cli", "--cache-dir", days["cache"], "--sparse", "C1,C2", "--no-progress",
    )  # fmt: skip
    assert "--init-from" in err and "--sparse C1,C2,C3" in err and "this command has C1,C2" in err
    assert not (tmp_path / "cli").exists()


def test_new_data_with_other_columns_is_refused(tmp_path):
    small = dict(batch_size=32, hidden=(8,), embedding_dim=4, progress=False)
    cache = str(tmp_path / "cache")
    start_run(TrainConfig(data=f"avazu:{AVAZU_CSV}", out=str(tmp_path / "a"), cache_dir=cache,
                        **small).resolve()).run()  # fmt: skip
    rows = list(csv.reader(open(AVAZU_CSV, newline="")))
    extra = tmp_path / "extra.csv"
    with open(extra, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(
            [[*rows[0], "new_column"]] + [[*r, "x"] for r in rows[1:]]
        )
    config = warm_start_config(tmp_path / "a", data=f"avazu:{extra}", out=str(tmp_path / "b"),
                               cache_dir=cache, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"categorical columns \[.*'new_column'\] are not RUN's"):
        start_run(config.resolve()).run()

"""The trainer: scaling rule, a short run that learns, checkpoint/resume, CLI errors."""

import csv
import json
import math
import os

import numpy as np
import pytest
import torch
from tiny import SMALL_RUN, tiny_config

from torchrec_cowclip.cli import main
from torchrec_cowclip.data import open_dataset, rank_auc
from torchrec_cowclip.run.checkpoints import CheckpointMismatchError, CheckpointStore
from torchrec_cowclip.train import TrainConfig, scale_hyperparameters
from torchrec_cowclip.train.config import ConfigError
from torchrec_cowclip.train.loop import NonFiniteLossError
from torchrec_cowclip.train.start import start_run

# The paper's table (Criteo, DeepFM; docs/algorithm.md): batch -> (dense lr, L2 lambda).
SPEC_TABLE = {
    1024: (8e-4, 1e-5),
    2048: (11.31e-4, 2e-5),
    4096: (16e-4, 4e-5),
    8192: (22.62e-4, 8e-5),
    16384: (32e-4, 16e-5),
    32768: (45.25e-4, 32e-5),
    65536: (64e-4, 64e-5),
    131072: (90.50e-4, 128e-5),
}


@pytest.mark.parametrize("batch", sorted(SPEC_TABLE))
def test_scaling_rule_reproduces_the_reference_table(batch):
    hp = scale_hyperparameters(batch, dataset="criteo", embedding_dim=10)
    lr, l2 = SPEC_TABLE[batch]
    assert hp.dense_lr == pytest.approx(lr, rel=5e-4)
    assert hp.l2 == pytest.approx(l2)
    assert hp.embedding_lr == 1e-4 and hp.embedding_weight_decay == pytest.approx(2 * l2)
    assert hp.clip_r == 1.0 and hp.clip_zeta == pytest.approx(math.sqrt(10) * 1e-5)


def test_scaling_rule_avazu_and_overrides():
    hp = scale_hyperparameters(131072, dataset="avazu", embedding_dim=10)
    assert hp.dense_lr == pytest.approx(1e-4 * math.sqrt(128))
    assert hp.l2 == pytest.approx(128e-5)
    assert hp.clip_zeta == pytest.approx(math.sqrt(10) * 1e-4)
    hp = scale_hyperparameters(4096, dense_lr=1e-3, l2=0.0, clip_zeta=0.5)
    assert (hp.dense_lr, hp.l2, hp.clip_zeta) == (1e-3, 0.0, 0.5)


def _config(tmp_path, **overrides):
    return tiny_config(tmp_path, SMALL_RUN, **overrides)


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("learn")
    cfg = _config(tmp, epochs=2)
    return cfg, start_run(cfg.resolve()).run()


def test_short_run_learns_the_planted_model(learned):
    cfg, metrics = learned
    ds = open_dataset(
        cfg.data,
        cfg.cache_dir,
        seed=cfg.seed,
        cardinality_scale=cfg.synthetic_scale,
        max_cardinality=cfg.synthetic_max_cardinality,
    )
    data = cfg.resolve().data  # the val_fraction the run took (its data kind's default)
    _, _, test = ds.split(data.test_fraction, data.val_fraction, cfg.seed)
    planted = rank_auc(np.asarray(ds.labels)[test], np.asarray(ds.planted_logit)[test])
    # Chance is 0.5; the planted model's own logit bounds what any model can reach.
    assert metrics["auc"] > 0.62, metrics["epoch_auc"]
    assert metrics["auc"] < planted + 0.01
    assert metrics["epoch_auc"][1] > metrics["epoch_auc"][0] - 0.005
    assert metrics["logloss"] < 0.56


def test_metrics_json_and_logs(learned):
    cfg, metrics = learned
    out = os.path.join(cfg.out)
    written = json.loads(open(os.path.join(out, "metrics.json")).read())
    for key in (
        "auc",
        "logloss",
        "epoch_auc",
        "epoch_logloss",
        "best_epoch",
        "train_samples_per_s",
        "epochs",
        "batch_size",
        "rows_updated",
        "rows_clipped",
        "hyperparameters",
    ):
        assert key in written, key
    assert written["epochs"] == 2 and len(written["epoch_auc"]) == 2
    assert written["batch_size"] == 1024 and written["train_samples_per_s"] > 0
    assert written["rows_updated"] > 0 and written["rows_clipped"] >= 0
    hp = written["hyperparameters"]
    assert hp["embedding_lr"] == 1e-2 and hp["dense_lr"] == pytest.approx(8e-4)
    assert hp["l2"] == pytest.approx(1e-5) and hp["cowclip"]["r"] == 1.0
    assert open(os.path.join(out, "epochs.csv")).read().count("\n") == 3
    assert any(
        name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(out, "tb"))
    )


def test_run_draws_its_loss_and_auc_curves(learned):
    cfg, metrics = learned
    png = open(os.path.join(cfg.out, "curves.png"), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # The epoch rows say where each epoch ended, for the AUC curve's x axis.
    with open(os.path.join(cfg.out, "epochs.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [metrics["steps"] // 2, metrics["steps"]]
    assert int(rows[-1]["train_samples"]) == metrics["train_samples"]


def test_a_failed_plot_warns_and_keeps_the_run(tmp_path, monkeypatch, capsys):
    import torchrec_cowclip.train.metrics as metrics

    def broken(out, title, *marks):
        raise ValueError("no axes today")

    monkeypatch.setattr(metrics, "write_run_curves", broken)
    cfg = tiny_config(tmp_path)
    start_run(cfg.resolve()).run()
    assert os.path.exists(os.path.join(cfg.out, "metrics.json"))
    assert (
        f"warning: no curves.png in {cfg.out}: ValueError: no axes today" in capsys.readouterr().err
    )


def test_resume_after_interruption_gives_the_uninterrupted_metrics(tmp_path):
    full = start_run(_config(tmp_path, out=str(tmp_path / "full"), epochs=2).resolve()).run()
    # Interrupted mid-epoch 1 (27 steps per epoch), then resumed from its checkpoint.
    part = start_run(
        _config(tmp_path, out=str(tmp_path / "part"), epochs=2, max_steps=40).resolve()
    ).run()
    assert part["steps"] == 40
    resumed = start_run(
        _config(tmp_path, out=str(tmp_path / "part"), epochs=2, resume=True).resolve()
    ).run()
    assert resumed["steps"] == full["steps"]
    assert resumed["epoch_auc"] == full["epoch_auc"]
    assert resumed["epoch_logloss"] == full["epoch_logloss"]
    assert resumed["rows_updated"] == full["rows_updated"]


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import state_dict_saver

    store = CheckpointStore(tmp_path / "checkpoints")
    store.save("latest", "s1", {"model": {"w": torch.ones(3)}}, {"step": 1}, step=1)
    real_save = state_dict_saver.save

    def killed_mid_write(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # files on disk, no manifest yet
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(state_dict_saver, "save", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        store.save("latest", "s2", {"model": {"w": torch.full((3,), 2.0)}}, {"step": 2}, step=2)
    monkeypatch.undo()
    restored = {"model": {"w": torch.zeros(3)}}
    assert store.load("latest", restored)["step"] == 1
    assert restored["model"]["w"].tolist() == [1.0, 1.0, 1.0]
    # The killed write is ours and unfinished: the next start removes it, and only it.
    assert store.remove_unfinished() == [tmp_path / "checkpoints" / "latest-s2"]
    store.save("latest", "s3", {"model": {"w": torch.full((3,), 3.0)}}, {"step": 3}, step=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "latest-s1",
        "latest-s3",
    ]


def test_checkpoint_refuses_a_model_of_another_shape(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save("latest", "s1", {"model": {"emb": torch.ones(10, 4)}}, {"step": 1}, step=1)
    with pytest.raises(
        CheckpointMismatchError, match=r"'model.emb' is \[10, 4\] there and \[12, 4\] here"
    ):
        store.load("latest", {"model": {"emb": torch.zeros(12, 4)}})
    with pytest.raises(CheckpointMismatchError, match="not in it"):
        store.load("latest", {"model": {"emb": torch.zeros(10, 4), "other": torch.zeros(2)}})


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    from torchrec_cowclip.models import task as task_module

    cfg = _config(tmp_path, checkpoint_every=3)
    trainer = start_run(cfg.resolve())
    original = task_module.CTRTrainTask.forward
    calls = {"n": 0}

    def poisoned(self, batch):
        calls["n"] += 1
        loss, out = original(self, batch)
        if calls["n"] == 5:
            loss = loss * float("nan")
            out = (loss.detach(),) + out[1:]
        return loss, out

    monkeypatch.setattr(task_module.CTRTrainTask, "forward", poisoned)
    with pytest.raises(NonFiniteLossError, match="loss became nan at step 5"):
        trainer.run()
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    assert store.trainer_state("latest")["progress"]["global_step"] == 3
    tensors = trainer.runtime.tensors()
    store.load("latest", tensors)
    assert all(torch.isfinite(v).all() for v in tensors["model"].values())


def test_early_stopping_restores_the_best_epoch(tmp_path):
    cfg = _config(
        tmp_path, epochs=4, val_fraction=0.1, early_stop_patience=1, lr_embed=0.3, lr=0.05
    )
    metrics = start_run(cfg.resolve()).run()
    best = metrics["best_epoch"]
    assert metrics["auc"] == metrics["epoch_auc"][best - 1]
    if metrics["stopped_early"]:
        assert metrics["epochs"] < 4
        assert metrics["epoch_val_auc"][-1] <= max(metrics["epoch_val_auc"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--data", "synthetic:100", "--batch-size", "0"], "--batch-size must be > 0"),
        (["train", "--data", "nosuchkind:x"], "nosuchkind"),
        (["train", "--data", "criteo:/does/not/exist.tsv"], "/does/not/exist.tsv"),
        (["train", "--data", "synthetic:100", "--early-stop-patience", "2"], "--val-fraction"),
        (["train", "--data", "synthetic:100", "--embedding-backend", "torchrec"], "--no-cowclip"),
    ],
)
def test_cli_errors_name_the_bad_flag(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_unknown_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--data", "synthetic:100", "--model", "resnet"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'resnet'" in capsys.readouterr().err


def test_cli_run_prints_no_torch_fx_deprecation_notice(tmp_path, capsys, caplog):
    # torch logs the notice once per process, at the first KJT built: reset that.
    import torch.fx._symbolic_trace as symbolic_trace

    symbolic_trace.is_fx_tracing_warning.cache_clear()
    assert (
        main(
            [
                "train",
                "--data",
                "synthetic:3000",
                "--synthetic-scale",
                "0.01",
                "--synthetic-max-cardinality",
                "500",
                "--hidden",
                "8",
                "--batch-size",
                "512",
                "--max-steps",
                "2",
                "--no-progress",
                "--out",
                str(tmp_path / "o"),
                "--cache-dir",
                str(tmp_path / "c"),
            ]
        )
        == 0
    )
    assert '"steps": 2' in capsys.readouterr().out
    notices = [r for r in caplog.records if "is_fx_tracing" in r.getMessage()]
    assert notices == []


def test_config_validation():
    with pytest.raises(ConfigError, match="--test-fraction"):
        TrainConfig(test_fraction=1.5).validate()
    with pytest.raises(ConfigError, match="no test set"):
        TrainConfig(test_fraction=0.0).validate()


def test_cli_model_choices_are_the_factory_registry():
    from torchrec_cowclip.models import MODELS as FACTORIES
    from torchrec_cowclip.train.config import MODELS

    assert set(MODELS) == set(FACTORIES) and "dlrm_dcn" in MODELS


@pytest.mark.parametrize("model", ["wdl", "dcn", "dcnv2", "dlrm", "dlrm_dcn"])
def test_every_model_trains_through_the_cli_path(tmp_path, model):
    # 24 steps give test AUC 0.70-0.77 over these models (counter-based init, seed 0);
    # with lr 0 (nothing learned) they score 0.46-0.50, and 16 steps leave the DLRMs at 0.54-0.56.
    metrics = start_run(_config(tmp_path, model=model, max_steps=24, lr=1e-2).resolve()).run()
    assert metrics["steps"] == 24 and metrics["auc"] > 0.62, metrics["auc"]
    assert math.isfinite(metrics["logloss"]) and metrics["rows_updated"] > 0


def test_stock_torchrec_backend_trains_with_dense_adam(tmp_path):
    metrics = start_run(
        _config(tmp_path, embedding_backend="torchrec", cowclip=False, max_steps=4).resolve()
    ).run()
    assert metrics["steps"] == 4 and metrics["rows_updated"] is None
    assert math.isfinite(metrics["logloss"])


def test_row_clip_stats_report_clip_rates_by_id_frequency(tmp_path):
    """--row-clip-stats: a small init makes the clip bind; the per-frequency buckets cover
    every update of the clipped tables and agree with the per-table counters."""
    cfg = _config(tmp_path, init_std=1e-4, row_clip_stats=True, epochs=1, max_steps=6)
    metrics = start_run(cfg.resolve()).run()
    buckets = metrics["clip_by_frequency"]
    assert [b["low"] for b in buckets] == [1, 2, 11, 101, 1001]
    clipped_tables = {k: v for k, v in metrics["clipped_per_table"].items() if k.startswith("emb_")}
    assert sum(b["rows_updated"] for b in buckets) == sum(
        v["rows_updated"] for v in clipped_tables.values()
    )
    assert sum(b["rows_clipped"] for b in buckets) == sum(
        v["rows_clipped"] for v in clipped_tables.values()
    )
    assert sum(b["rows_clipped"] for b in buckets) > 0
    assert all(0.0 <= b["clip_rate"] <= 1.0 for b in buckets)
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert on_disk["clip_by_frequency"] == buckets


def test_row_clip_stats_survive_a_resume(tmp_path):
    """Per-row clip counters are checkpointed: an interrupted and resumed run reports the
    uninterrupted run's clip rates by id frequency."""
    kw = dict(init_std=1e-4, row_clip_stats=True, epochs=1)
    full = start_run(_config(tmp_path, out=str(tmp_path / "full"), **kw).resolve()).run()
    start_run(_config(tmp_path, out=str(tmp_path / "part"), max_steps=10, **kw).resolve()).run()
    resumed = start_run(
        _config(tmp_path, out=str(tmp_path / "part"), resume=True, **kw).resolve()
    ).run()
    assert resumed["steps"] == full["steps"]
    assert sum(b["rows_clipped"] for b in full["clip_by_frequency"]) > 0
    assert resumed["clip_by_frequency"] == full["clip_by_frequency"]


def test_row_clip_stats_need_the_cowclip_backend(tmp_path):
    with pytest.raises(ConfigError, match="--row-clip-stats"):
        _config(
            tmp_path, row_clip_stats=True, embedding_backend="torchrec", cowclip=False
        ).validate()


def test_the_start_hands_the_loop_its_pieces_and_the_loop_holds_no_settings(tmp_path):
    from dataclasses import fields, is_dataclass

    from torchrec_cowclip.train.config import TrainSettings
    from torchrec_cowclip.train.finish import RunFinish
    from torchrec_cowclip.train.loop import TrainingLoop
    from torchrec_cowclip.train.report import RunReport

    settings = _config(tmp_path).resolve()
    loop = start_run(settings)
    try:
        assert isinstance(loop, TrainingLoop) and loop.plan is settings.run
        assert isinstance(loop.report, RunReport) and isinstance(loop.finish, RunFinish)
        held = list(vars(loop).values())
        # Its own settings are the run's group; nothing it holds is (or carries) the rest.
        assert not any(isinstance(v, TrainSettings) for v in held)
        assert not any(
            isinstance(getattr(v, f.name), TrainSettings)
            for v in held
            if is_dataclass(v) and not isinstance(v, type)
            for f in fields(v)
        )
        # What the loop tells starts with where the run writes, made by the start.
        assert loop.report.lines[0].startswith(f"run {tmp_path / 'run'}: 1 epoch(s)")
    finally:
        loop.run_dir.release()


def test_the_report_refuses_to_tell_before_it_is_open(tmp_path):
    from torchrec_cowclip.train.report import RunReport

    report = RunReport(tmp_path, [], (1, 1, 0, 1), log_every=1, main=True, bars=False)
    with pytest.raises(RuntimeError, match=r"the run's report is not open: open\(\) it first"):
        report.info("a line")
    assert not (tmp_path / "epochs.csv").exists()


def test_a_failed_start_releases_out_and_removes_the_directory_it_made(tmp_path, monkeypatch):
    import torchrec_cowclip.train.start as start

    def broken(*args, **kwargs):
        raise OSError("the data went away")

    settings = _config(tmp_path, out=None).resolve()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(start, "open_training_data", broken)
    with pytest.raises(OSError, match="the data went away"):
        start_run(settings)
    assert list((tmp_path / "runs").iterdir()) == []  # made, then removed: empty
    monkeypatch.undo()
    # --out given: the failed start released it, so the next start claims it at once.
    given = _config(tmp_path, out=str(tmp_path / "given")).resolve()
    monkeypatch.setattr(start, "open_training_data", broken)
    with pytest.raises(OSError):
        start_run(given)
    monkeypatch.undo()
    start_run(given).run_dir.release()

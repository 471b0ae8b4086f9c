"""What a run tells its user: flags that explain themselves, the start summary, one line
per epoch with its time, loss, speed and memory, per-epoch row counts, progress while
converting and evaluating, a whole-run ETA, best_epoch only with a validation split, the
known warnings filtered, and a default --out that never refuses."""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import warnings
from pathlib import Path

import pytest
from tiny import TINY_CLI, TINY_FILE_RUN, tiny_cli, tiny_config

from torchrec_cowclip.cli import build_parser, main
from torchrec_cowclip.cli_help import HelpFormatter
from torchrec_cowclip.train import train
from torchrec_cowclip.train.command import add_train_arguments, config_from_args

# --------------------------------------------------------------------------- --help


def _command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _train_help() -> str:
    return _command("train").format_help()


def _flag_helps(parser: argparse.ArgumentParser) -> dict:
    """Each flag's help as ``--help`` renders it (the default included)."""
    formatter = parser._get_formatter()
    return {
        a.option_strings[-1]: formatter._expand_help(a)
        for a in parser._actions
        if a.option_strings and a.dest != "help" and a.help is not argparse.SUPPRESS
    }


def _train_flag_helps() -> dict:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_train_arguments(parser)
    return _flag_helps(parser)


def _subcommands() -> list:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_the_help_test_covers_every_subcommand():
    assert _subcommands() == ["evaluate", "export", "plan", "predict", "sweep", "train"]


@pytest.mark.parametrize("command", _subcommands())
def test_every_flag_has_help_and_shows_its_default_once(command):
    parser = _command(command)
    helps = _flag_helps(parser)
    # train's data and model flags in plan too
    assert len(helps) > {"train": 40, "sweep": 40, "plan": 30}.get(command, 4)
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if action.help is argparse.SUPPRESS:  # the sweep's refusals of per-cell flags
            continue
        flag = action.option_strings[-1]
        assert action.help and len(action.help) > 10, f"{command} {flag} has no help"
        shown = helps[flag]
        if action.required:  # it has no default: its help says it is required
            assert "required" in shown and "default" not in shown, f"{command} {flag}: {shown}"
        elif flag != "--data":
            assert shown.count("default") >= 1 or "required" in shown, (
                f"{command} {flag} shows no default: {shown}"
            )
        assert shown.count("(default:") <= 1, f"{command} {flag} shows its default twice: {shown}"
        assert "(default: True)" not in shown and "(default: False)" not in shown, shown
        assert "(default: None)" not in shown, shown


def test_flags_are_grouped_and_the_models_are_all_named():
    text = _train_help()
    groups = re.findall(r"^([a-z][a-z ]+):$", text, re.M)
    assert groups == ["options", "data", "model", "optimizer and recipe", "run", "distributed"]
    from torchrec_cowclip.models import MODELS

    model_help = _train_flag_helps()["--model"]
    assert all(f"{name}:" in model_help for name in MODELS) and "dlrm_dcn" in model_help
    assert "clip_by_frequency" in _train_flag_helps()["--row-clip-stats"]
    assert "default: CowClip clips" in _train_flag_helps()["--no-cowclip"]


def test_another_command_can_reuse_trains_arguments():
    parser = argparse.ArgumentParser(prog="sweep", formatter_class=HelpFormatter)
    add_train_arguments(parser)
    parser.add_argument("--batch-sizes", default="1024,2048")
    args = parser.parse_args(["--data", "synthetic:1000", "--batch-sizes", "512"])
    assert args.batch_sizes == "512" and args.model == "deepfm" and args.out is None
    config = config_from_args(args)  # the sweep's own arguments are left out
    assert config.data == "synthetic:1000" and config.batch_size == 1024


# --------------------------------------------------------------------------- a run's lines


def _epochs_csv(out: Path) -> list:
    with open(out / "epochs.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_start_summary_epoch_lines_and_per_epoch_rows(tmp_path, capsys):
    out = tmp_path / "run"
    argv = tiny_cli(epochs=2, batch_size=512) + [
        "--out",
        str(out),
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert re.search(r"tables: 52 \(26 of dim 4, 26 of dim 1\), [\d,]+ rows, largest emb_C\d+", err)
    assert re.search(r"parameters: [\d,]+ in tables \+ [\d,]+ dense = [\d,]+", err)
    rates = json.loads((out / "metrics.json").read_text())["dataset"]["positive_rate"]
    assert f"positive labels: {rates['train']:.2%} of train, {rates['test']:.2%} of test" in err
    assert 0.05 < rates["train"] < 0.95 and rates["validation"] is None
    assert "processes: 1 (the whole model in this process)" in err
    assert "dense inputs: log (I1, ..., I13: 13 columns); statistics of the 2,700 rows" in err
    lines = [line for line in err.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2, err
    assert re.match(
        # The test split's calibration (mean prediction / positive rate) since issue 46.
        r"epoch 1/2: test_auc 0\.\d{5}, test_logloss \d\.\d{5}, test_calibration \d+\.\d{3}, "
        r"train_loss \d\.\d{5} \| \d+s, "
        r"[\d,]+ samples/s, peak RSS [\d,]+ MB \| rows updated [\d,]+, clipped \d+ \| run ETA \d+s",
        lines[0],
    ), lines[0]
    assert "run ETA" not in lines[1]  # the last epoch
    rows = _epochs_csv(out)
    metrics = json.loads((out / "metrics.json").read_text())
    per_epoch = [int(r["rows_updated"]) for r in rows]
    assert sum(per_epoch) == metrics["rows_updated"] and all(n > 0 for n in per_epoch)
    assert int(rows[1]["rows_updated_total"]) == metrics["rows_updated"]
    assert all(float(r["epoch_s"]) > 0 and float(r["peak_rss_mb"]) > 50 for r in rows)
    assert float(rows[0]["train_loss"]) > 0 and float(rows[0]["train_samples_per_s"]) > 0
    # No validation split: no best epoch is claimed; the final epoch is reported.
    assert metrics["best_epoch"] is None and metrics["final_epoch"] == 2
    assert metrics["model_size"]["table_parameters"] > 0


def test_best_epoch_needs_a_validation_split(tmp_path):
    metrics = train(tiny_config(tmp_path, epochs=2, val_fraction=0.1, batch_size=512))
    assert metrics["best_epoch"] in (1, 2)
    assert metrics["epoch_val_auc"][metrics["best_epoch"] - 1] == max(metrics["epoch_val_auc"])


def test_evaluation_and_conversion_show_progress(tmp_path, capsys, monkeypatch):
    from torchrec_cowclip.data.pipeline import encode

    monkeypatch.setattr(encode, "PROGRESS_EVERY_S", 0.0)  # a line per block
    out = tmp_path / "run"
    argv = [a for a in TINY_CLI if a != "--no-progress"]
    assert main(argv + ["--out", str(out), "--cache-dir", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert "evaluating test (300 rows)" in err
    assert re.search(r"wrote synthetic:3000: [\d,]+ rows so far \([\d,]+ rows/s", err), err
    assert "wrote 3,000 rows of synthetic:3000" in err


# --------------------------------------------------------------------------- noise


def test_a_python_api_run_logs_no_fx_notice_and_warns_no_checkpoint_notice(tmp_path, caplog):
    import torch.fx._symbolic_trace as symbolic_trace

    symbolic_trace.is_fx_tracing_warning.cache_clear()  # torch says it once per process
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        train(tiny_config(tmp_path, checkpoint_every=2, max_steps=4))
    assert not [r for r in caplog.records if "is_fx_tracing" in r.getMessage()]
    texts = [str(w.message) for w in seen]
    assert not [t for t in texts if "torch.distributed is disabled" in t], texts


def test_skipped_bad_rows_are_reported_once(tmp_path, caplog):
    lines = Path("tests/data/criteo_sample.tsv").read_text().splitlines(keepends=True)
    bad = tmp_path / "day_0"
    bad.write_text("".join(lines[:10] + ["x\tnot a row\n"] + lines[10:]))
    with caplog.at_level(logging.WARNING):
        metrics = train(
            tiny_config(
                tmp_path,
                TINY_FILE_RUN,
                data=f"criteo:{bad}",
                on_bad_row="skip",
                batch_size=64,
            )
        )
    said = [r.getMessage() for r in caplog.records if "skipped 1 bad rows" in r.getMessage()]
    assert len(said) == 1, said
    assert metrics["dataset"]["bad_rows_skipped"] == {"wrong column count": 1}


# --------------------------------------------------------------------------- --out


def test_the_default_out_never_refuses_and_an_explicit_existing_one_does(tmp_path, capsys):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        argv = TINY_CLI + ["--max-steps", "1", "--cache-dir", str(tmp_path / "c")]
        assert main(argv) == 0 and main(argv) == 0
        runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
        assert len(runs) == 2 and all(re.fullmatch(r"\d{8}-\d{6}(-\d+)?", r) for r in runs), runs
        assert all((tmp_path / "runs" / r / "metrics.json").exists() for r in runs)
        capsys.readouterr()
        with pytest.raises(SystemExit) as refused:
            main(argv + ["--out", f"runs/{runs[0]}"])
        assert refused.value.code == 2
        assert "holds another run's files" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(argv + ["--resume"])
        assert "--resume continues the run in --out: give --out" in capsys.readouterr().err
    finally:
        os.chdir(cwd)

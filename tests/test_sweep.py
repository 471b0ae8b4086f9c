"""``torchrec-cowclip sweep``: a small sweep on a CSV writes its table, CSV, JSON and PNGs;
finished cells are never trained again; a killed sweep continues; bad commands and cells
with other settings are refused in one line."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from torchrec_cowclip import cli
from torchrec_cowclip.failures import EXIT_DIVERGED
from torchrec_cowclip.run.out_dir import lock_holder
from torchrec_cowclip.sweep import report, runner
from torchrec_cowclip.train.command import config_from_args, train_argv, train_parser
from torchrec_cowclip.train.config import TrainConfig

PNG = b"\x89PNG\r\n\x1a\n"
CELLS = ["b128-fixed-l2-s0", "b128-fixed-l2-count-s0", "b512-fixed-l2-s0", "b512-fixed-l2-count-s0"]


def _write_clicks(path: Path, rows: int = 2000) -> Path:
    """A small click log with a learnable signal: one dense and three categorical columns."""
    rng = np.random.default_rng(0)
    site, ad, slot = rng.integers(0, 20, rows), rng.integers(0, 50, rows), rng.integers(0, 5, rows)
    price = rng.normal(size=rows)
    logit = 0.15 * (site % 5) - 0.3 + 0.8 * price + 0.6 * (slot == 2)
    click = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    lines = ["click,price,site,ad,slot"] + [
        f"{c},{abs(p) * 10:.3f},s{s},ad{a},{t}"
        for c, p, s, a, t in zip(click, price, site, ad, slot)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep-data")
    clicks = _write_clicks(root / "clicks.csv")
    flags = [
        f"--data=table:{clicks}",
        "--label=click",
        "--dense=price",
        "--sparse=site,ad,slot",
        "--hidden=8",
        "--embedding-dim=4",
        "--val-fraction=0.1",
        "--lr-embed=0.01",
        "--epochs=2",
        "--log-every=2",
        "--eval-batch-size=4096",
        f"--cache-dir={root / 'cache'}",
        "--base-batch-size=128",
    ]
    return root, flags


def _sweep(*argv: str) -> int:
    return cli.main(["sweep", *argv])


@pytest.fixture(scope="module")
def swept(data, tmp_path_factory):
    """4 cells, 3 runs: at the base batch fixed-l2-count is fixed-l2's run."""
    root, flags = data
    out = tmp_path_factory.mktemp("sweep") / "out"
    grid = ["--batch-sizes=128,512", "--recipes=fixed-l2,fixed-l2-count", "--seeds=0"]
    argv = flags + grid + [f"--out={out}", "--parallel=2", "--cores=2"]
    assert _sweep(*argv) == 0
    return argv, out


def _error_line(err: str) -> str:
    """The refusal: stderr's last line, and no traceback before it (a data conversion
    may report its progress first)."""
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def _mtimes(out: Path) -> dict:
    return {
        name: (out / "cells" / name / "metrics.json").stat().st_mtime_ns
        for name in CELLS
        if (out / "cells" / name / "metrics.json").exists()
    }


def test_a_sweep_writes_its_table_csv_json_and_plots(swept, capsys):
    argv, out = swept
    with open(out / "sweep.csv", newline="") as f:
        rows = {r["cell"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == sorted(CELLS)
    for name, r in rows.items():
        assert r["status"] == "finished", (name, r["status"])
        assert 0.0 < float(r["best_auc"]) < 1.0 and 0.0 < float(r["last_auc"]) < 1.0
        assert float(r["best_logloss"]) > 0 and float(r["samples_per_s"]) > 0
        assert int(r["epochs"]) == 2 and r["best_by"] == "val" and int(r["rows_updated"]) > 0
    # The base batch's fixed-l2-count cell reports fixed-l2's run, trained once.
    shared = rows["b128-fixed-l2-count-s0"]
    assert shared["shares"] == "b128-fixed-l2-s0" and shared["run"] == "cells/b128-fixed-l2-s0"
    assert shared["best_auc"] == rows["b128-fixed-l2-s0"]["best_auc"]
    assert not (out / "cells" / "b128-fixed-l2-count-s0" / "metrics.json").exists()
    for name in ("b128-fixed-l2-s0", "b512-fixed-l2-s0"):
        assert float(rows[name.replace("512", "128")]["best_auc_change"]) == 0.0
    change = 100 * (
        float(rows["b512-fixed-l2-s0"]["best_auc"]) - float(rows["b128-fixed-l2-s0"]["best_auc"])
    )
    assert float(rows["b512-fixed-l2-s0"]["best_auc_change"]) == pytest.approx(change)
    assert float(rows["b512-fixed-l2-s0"]["scale"]) == 4.0

    def no_nan(constant):
        raise AssertionError(f"sweep.json holds {constant}: not JSON")

    report = json.loads((out / "sweep.json").read_text(), parse_constant=no_nan)
    assert len(report["cells"]) == 4 and report["sweep"]["base_batch"] == 128
    assert [(s["recipe"], s["batch_size"]) for s in report["summary"]] == [
        ("fixed-l2", 128),
        ("fixed-l2", 512),
        ("fixed-l2-count", 128),
        ("fixed-l2-count", 512),
    ]
    assert "| fixed-l2 | 512 | 4 | 1/1 |" in (out / "sweep.md").read_text()
    for png in ("sweep_auc.png", "sweep_curves.png", "sweep_time.png"):
        assert (out / png).read_bytes()[:8] == PNG, png
    # Each trained cell is an ordinary train run of the config its record holds, with its
    # own curves, and the command that makes the same run.
    record = json.loads((out / "cells" / "b512-fixed-l2-count-s0" / "cell.json").read_text())
    assert record["command"][:2] == ["torchrec-cowclip", "train"]
    again = config_from_args(cli.build_parser().parse_args(record["command"][1:]))
    assert TrainConfig.from_dict(record["config"]) == again
    assert (again.batch_size, again.recipe, again.seed, again.epochs) == (
        512,
        "fixed-l2-count",
        0,
        2,
    )
    assert [a["outcome"] for a in record["attempts"]] == ["finished"]
    for name in ("b128-fixed-l2-s0", "b512-fixed-l2-s0", "b512-fixed-l2-count-s0"):
        assert (out / "cells" / name / "curves.png").read_bytes()[:8] == PNG


def test_a_finished_sweep_trains_nothing_again(swept, capsys):
    argv, out = swept
    before = _mtimes(out)
    capsys.readouterr()
    assert _sweep(*argv) == 0
    captured = capsys.readouterr()
    assert "3 of 4 cells finished (or diverged) before: not run again" in captured.err
    assert "starting" not in captured.err and "continuing" not in captured.err
    assert _mtimes(out) == before
    assert "fixed-l2-count" in captured.out and "base" in captured.out  # the table


def test_report_only_rebuilds_the_report_from_the_cells(swept, tmp_path, capsys):
    _, out = swept
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    for name in ("sweep.csv", "sweep.json", "sweep.md", "sweep_auc.png"):
        (copy / name).unlink()
    assert _sweep("--report-only", f"--out={copy}") == 0
    assert (copy / "sweep.csv").read_text() == (out / "sweep.csv").read_text().replace(
        str(out), str(copy)
    )
    assert (copy / "sweep_auc.png").read_bytes()[:8] == PNG
    assert "fixed-l2-count" in capsys.readouterr().out


def test_a_killed_sweep_continues_where_it_stopped(swept, tmp_path, capsys):
    """The finished sweep, extended by a recipe and killed (SIGKILL) while a new cell
    trains: the cell dies with the sweep (a SIGTERM: it checkpoints and frees its folder);
    the same command then continues that cell, trains the one never started, and trains
    none of the finished cells again."""
    argv, out = swept
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = _mtimes(copy)
    argv = [a for a in argv if not a.startswith(("--out=", "--recipes=", "--parallel="))]
    argv += [f"--out={copy}", "--recipes=fixed-l2,fixed-l2-count,none"]
    killed = copy / "cells" / "b128-none-s0"
    # A checkpoint at every step (how often is free to change between runs of a sweep):
    # the cell is still training when the kill lands.
    sweep = subprocess.Popen(
        [sys.executable, "-m", "torchrec_cowclip", "sweep", *argv, "--checkpoint-every=1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while not (killed / "checkpoints" / "latest").exists():
            assert sweep.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.05)
    finally:
        sweep.send_signal(signal.SIGKILL)
        sweep.wait()
    deadline = time.monotonic() + 60
    while lock_holder(killed) is not None:  # the cell's train process stops by itself
        assert time.monotonic() < deadline, f"{killed} still held by pid {lock_holder(killed)}"
        time.sleep(0.1)
    assert not (killed / "metrics.json").exists()
    assert "received SIGTERM" in (killed / "train.log").read_text()
    capsys.readouterr()
    assert _sweep(*argv, "--delete-finished-checkpoints", "--delete-finished-models") == 0
    err = capsys.readouterr().err
    assert "3 of 6 cells finished (or diverged) before: not run again" in err
    assert "cell b128-none-s0: continuing its checkpoint" in err
    assert "cell b512-none-s0: starting" in err
    assert err.count("starting") == 1 and err.count("continuing") == 1
    assert _mtimes(copy) == before  # the finished cells untouched
    assert "resumed from step" in (killed / "train.log").read_text()
    metrics = json.loads((killed / "metrics.json").read_text())
    assert metrics["epochs"] == 2 and metrics["hyperparameters"]["cowclip"] is None  # no clip
    attempts = json.loads((killed / "cell.json").read_text())["attempts"]
    assert "outcome" not in attempts[0]  # the killed sweep never saw it end
    assert (attempts[1]["outcome"], attempts[1]["continues"]) == ("finished", True)
    with open(copy / "sweep.csv", newline="") as f:
        assert {r["cell"]: r["status"] for r in csv.DictReader(f)}["b512-none-s0"] == "finished"
    # --delete-finished-checkpoints: the cells finished by this command keep no checkpoint.
    assert not (killed / "checkpoints").exists() and attempts[1]["checkpoints_deleted"] > 0
    assert not (copy / "cells" / "b512-none-s0" / "checkpoints").exists()
    assert (copy / "cells" / "b512-fixed-l2-s0" / "checkpoints").is_dir()
    # --delete-finished-models: their run folders go too; the earlier cells keep theirs.
    assert not (killed / "model").exists() and attempts[1]["model_deleted"] is True
    assert (copy / "cells" / "b512-fixed-l2-s0" / "model" / "manifest.json").is_file()
    assert (killed / "curves.png").is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch-sizes=128,abc"], "--batch-sizes: expected comma-separated positive integers"),
        (["--batch-sizes=0,128"], "--batch-sizes: expected comma-separated positive integers"),
        (["--batch-sizes=128,128"], "--batch-sizes: 128 given twice"),
        (
            ["--batch-sizes=128", "--recipes=paper,nope"],
            "--recipes: unknown recipe 'nope'; choose from paper,",
        ),
        (["--batch-sizes=128", "--seeds=0,x"], "--seeds: expected comma-separated integers"),
        (["--batch-sizes=128", "--seeds=-1"], "--seeds: expected comma-separated integers"),
        (
            ["--batch-sizes=128", "--batch-size=256"],
            "--batch-size: a sweep sets it per cell: give --batch-sizes",
        ),
        (["--batch-sizes=128", "--seed=1"], "--seed: a sweep sets it per cell: give --seeds"),
        (
            ["--batch-sizes=128", "--recipe=paper"],
            "--recipe: a sweep sets it per cell: give --recipes",
        ),
        (["--batch-sizes=128", "--resume"], "--resume: a sweep always continues where it stopped"),
        (["--batch-sizes=128", "--overwrite"], "--overwrite: a sweep never deletes a run"),
        (
            ["--batch-sizes=128", "--parallel=3", "--cores=2"],
            "--parallel 3 cells need at least as many --cores, got 2",
        ),
        (
            ["--batch-sizes=128", "--parallel=2", "--threads=2", "--cores=2"],
            "= 4 threads exceed --cores 2",
        ),
        (
            ["--batch-sizes=128,160", "--equal=steps"],
            "--equal steps: batch 160 x 2 epoch(s) is not a whole number",
        ),
        ([], "--batch-sizes is required"),
        (
            ["--batch-sizes=128", "--recipes=none", "--clip-r=2"],
            "cell b128-none-s0: --clip-r 2 has no effect with --recipe none (no clip)",
        ),
        (
            ["--batch-sizes=128", "--lr-embed=1e-3,x"],
            "--lr-embed: expected comma-separated positive rates such as 1e-4,1e-3, got '1e-3,x'",
        ),
        (
            ["--batch-sizes=128", "--lr=1e-3,1e-3"],
            "--lr: 0.001 given twice in '1e-3,1e-3'",
        ),
        (
            ["--batch-sizes=128,100000"],
            "cell b100000-paper-s0: --batch-size 100000 is larger than the 1,620 training rows",
        ),
    ],
)
def test_bad_sweep_commands_are_refused_in_one_line(data, tmp_path, capsys, extra, message):
    _, flags = data
    out = tmp_path / "out"
    capsys.readouterr()
    assert _sweep(*flags, *extra, f"--out={out}") == 2
    err = capsys.readouterr().err
    assert _error_line(err).startswith("torchrec-cowclip sweep: error: "), err
    assert message in _error_line(err)
    assert not out.exists()  # refused before anything was written


def test_report_only_of_an_empty_directory_is_refused(tmp_path, capsys):
    assert _sweep("--report-only", f"--out={tmp_path}") == 2
    assert f"no sweep cells in {tmp_path}" in capsys.readouterr().err


def test_a_sweep_or_cell_with_other_settings_is_refused(swept, tmp_path, capsys):
    argv, out = swept
    before = _mtimes(out)
    assert _sweep(*[a for a in argv if a != "--epochs=2"], "--epochs=3") == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds a sweep with other settings (--epochs 2 there, 3 here)" in err
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    record_path = copy / "cells" / "b512-fixed-l2-s0" / "cell.json"
    record = json.loads(record_path.read_text())
    record["settings"]["hidden"] = [16]
    record_path.write_text(json.dumps(record))
    argv = [a for a in argv if not a.startswith("--out=")] + [f"--out={copy}"]
    assert _sweep(*argv) == 2
    err = capsys.readouterr().err
    line = _error_line(err)
    assert (
        f"cell b512-fixed-l2-s0 in {copy} was run with other settings (--hidden 16 there, 8 here)"
        in line
    )
    assert _mtimes(out) == before


def test_a_cell_config_travels_in_its_record_and_its_command_makes_the_same_run():
    parser = train_parser()
    config = TrainConfig(
        data="table:x.csv",
        label="click",
        dense=["a", "b"],
        hidden=(16, 8),
        lr=3.5e-4,
        cowclip=False,
        progress=False,
        resume="auto",
        threads=2,
        out="o",
    )
    assert TrainConfig.from_dict(json.loads(json.dumps(config.as_dict()))) == config
    argv = train_argv(parser, config)
    assert "--no-cowclip" in argv and argv[argv.index("--hidden") + 1] == "16,8"
    assert argv[argv.index("--resume") + 1] == "auto"
    assert config_from_args(parser.parse_args(argv)) == config


def test_a_diverged_cell_is_a_kept_result():
    assert runner._outcome(EXIT_DIVERGED, finished=False) == "diverged"
    assert runner._outcome(75, finished=False) == "stopped"
    assert runner._outcome(0, finished=True) == "finished"
    assert runner._outcome(4, finished=False) == "failed"
    assert os.name != "posix" or runner._outcome(-signal.SIGTERM, finished=False) == "stopped"


def test_a_damaged_cell_record_is_refused_before_any_cell_runs(swept, tmp_path, capsys):
    argv, out = swept
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    record_path = copy / "cells" / "b512-fixed-l2-s0" / "cell.json"
    record = json.loads(record_path.read_text())
    record["attempts"][-1]["threads"] = "two"
    record_path.write_text(json.dumps(record))
    before = {p: p.read_bytes() for p in (copy / "cells").glob("*/cell.json")}
    argv = [a for a in argv if not a.startswith("--out=")] + [f"--out={copy}"]
    assert _sweep(*argv) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == (
        f"torchrec-cowclip sweep: error: {record_path}: the last attempt's threads is 'two', "
        "not a whole number >= 1 (a damaged or hand-edited file): restore it, or move the "
        "cell's folder away"
    )
    assert {p: p.read_bytes() for p in before} == before


def test_a_full_disk_writing_cell_records_is_one_line(swept, tmp_path, capsys, monkeypatch):
    import pathlib

    argv, out = swept
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    argv = [a for a in argv if not a.startswith("--out=")] + [f"--out={copy}"]
    real_write = pathlib.Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "cell.json.tmp":
            with open("/dev/full", "w") as f:
                f.write("x" * 65536)
                f.flush()
        return real_write(self, *args, **kwargs)

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this machine")
    monkeypatch.setattr(pathlib.Path, "write_text", full)
    assert _sweep(*argv) == 4
    line = _error_line(capsys.readouterr().err)
    first = copy / "cells" / CELLS[0] / "cell.json"
    assert line == f"torchrec-cowclip sweep: error: no space left on device: {first}"
    assert not list(copy.rglob("cell.json.tmp"))
    monkeypatch.undo()
    assert _sweep(*argv) == 0  # space again: the same command works


def test_an_undefined_auc_never_wins_the_best_epoch(tmp_path):
    from torchrec_cowclip.sweep import report

    metrics = {"epoch_auc": [None, 0.7, 0.6], "epoch_val_auc": [None, 0.6, 0.65]}
    assert report._best_epoch(metrics) == (2, "val")
    assert report._best_epoch({"epoch_auc": [0.7, None]}) == (0, "test")


# --------------------------------------------------------------------------- lr search


def test_lists_of_learning_rates_make_one_cell_each():
    from torchrec_cowclip.sweep.grid import plan_cells

    base = TrainConfig(data="synthetic:100000", epochs=1, lr_embed=None)
    cells = plan_cells(base, [1024], ["paper"], [0],
                       rates={"lr_embed": [1e-4, 1e-3], "lr": [5e-4]})  # fmt: skip
    assert [c.name for c in cells] == ["b1024-paper-le0.0001-s0", "b1024-paper-le0.001-s0"]
    assert [c.config.lr_embed for c in cells] == [1e-4, 1e-3]
    assert {c.config.lr for c in cells} == {5e-4} and cells[0].variant == "paper --lr-embed 0.0001"
    both = plan_cells(base, [1024], ["paper"], [0],
                      rates={"lr_embed": [1e-4, 1e-3], "lr": [1e-4, 1e-3]})  # fmt: skip
    assert len(both) == 4 and both[1].name == "b1024-paper-le0.0001-lr0.001-s0"
    # One value each: the names (and so a sweep's folders) of a sweep without a search.
    one = plan_cells(base, [1024], ["paper"], [0], rates={"lr_embed": [1e-3], "lr": [None]})
    assert [c.name for c in one] == ["b1024-paper-s0"] and one[0].config.lr_embed == 1e-3


def test_the_learning_rates_a_sweep_lists_are_trains_options_as_declared(capsys, monkeypatch):
    """--lr-embed and --lr are train's flags with train's help (the table: default
    included, which a sweep's cells take too), then what a list of them means."""
    from torchrec_cowclip.train.options import declarations

    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        _sweep("--help")
    shown = " ".join(capsys.readouterr().out.split())  # the help's words, unwrapped
    declared = {o.name: o for o in declarations(TrainConfig)}
    for name in ("lr_embed", "lr"):
        option = declared[name]
        said = f"{option.flag} LR1,LR2,... {option.option.help}; or several, comma-separated"
        assert said in shown, name
    base = TrainConfig(data="table:x.csv", label="y", sparse=["a"]).with_data_defaults()[0]
    assert "3e-3 for table:" in declared["lr_embed"].option.help and base.lr_embed == 3e-3


def test_a_learning_rate_search_draws_the_same_table_and_plots(tmp_path):
    """Cells that differ in --lr-embed are rows of their own in the table, compared
    with their own base batch, and series of their own in the figures."""
    from torchrec_cowclip.sweep.grid import plan_cells
    from torchrec_cowclip.sweep.plots import write_plots

    base = TrainConfig(data="synthetic:100000", epochs=1, base_batch_size=1024)
    grid = {"lr_embed": [1e-4, 1e-3]}
    cells = plan_cells(base, [1024, 4096], ["paper"], [0], rates=grid)
    (tmp_path / report.SETTINGS_FILE).write_text(
        json.dumps({"settings": {"base_batch_size": 1024}})
    )
    for i, cell in enumerate(cells):
        run = tmp_path / "cells" / cell.name
        run.mkdir(parents=True)
        record = {"cell": cell.name, "batch_size": cell.batch_size, "recipe": cell.recipe,
                  "seed": cell.seed, "rates": cell.rates, "variant": cell.variant}  # fmt: skip
        (run / "cell.json").write_text(json.dumps(record))
        auc = 0.70 + 0.01 * i
        metrics = {"epoch_auc": [auc], "epoch_logloss": [0.5], "epochs": 1, "steps": 10,
                   "train_samples": 10_000, "train_samples_per_s": 1e4,
                   "rows_updated": 100, "rows_clipped": 0,
                   "hyperparameters": {"embedding_lr": cell.config.lr_embed}}  # fmt: skip
        (run / "metrics.json").write_text(json.dumps(metrics))
        (run / "epochs.csv").write_text(
            f"epoch,step,train_samples,test_auc,train_loss\n1,10,10000,{auc},0.5\n"
        )
    built = report.build_report(tmp_path)
    assert [(s["variant"], s["batch_size"]) for s in built["summary"]] == [
        ("paper --lr-embed 0.0001", 1024),
        ("paper --lr-embed 0.0001", 4096),
        ("paper --lr-embed 0.001", 1024),
        ("paper --lr-embed 0.001", 4096),
    ]
    # b1024 le1e-4: 0.70, b1024 le1e-3: 0.71, b4096 le1e-4: 0.72, b4096 le1e-3: 0.73
    changes = {
        (r["variant"], r["batch_size"]): round(r["best_auc_change"], 6) for r in built["cells"]
    }
    assert changes[("paper --lr-embed 0.001", 4096)] == 2.0
    table = report.format_table(built["summary"], 1024)
    assert "paper --lr-embed 0.001" in table
    assert sum("base" in line for line in table.splitlines()[1:]) == 2  # one base row each
    paths = write_plots(built, tmp_path)
    assert all(p.read_bytes()[:8] == PNG for p in paths.values())


def test_a_learning_rate_search_chooses_on_validation_and_plots_against_the_rate(tmp_path):
    """The issue's case: the table's best AUC was test AUC, the cells' epochs were not
    shown, and sweep_auc.png had batch size on its x axis with one point and two panels
    of zeros. Now the validation AUC that chose each epoch is a column, the best cell is
    chosen by it (test AUC beside it, named), each cell's epochs are shown, and the
    figure plots validation and test AUC against --lr-embed on plain log ticks."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from torchrec_cowclip.sweep.plots import (
        curves_figure,
        rates_figure,
        searched_rate,
        time_figure,
        write_plots,
    )

    (tmp_path / report.SETTINGS_FILE).write_text(
        json.dumps({"settings": {"base_batch_size": 1024, "epochs": 6,
                                 "early_stop_patience": 2}})
    )  # fmt: skip
    # lr 1e-3: better on validation, worse on test; lr 1e-2 the other way round.
    runs = {1e-3: ([0.70, 0.74, 0.73, 0.72], [0.71, 0.72, 0.74, 0.73]),
            1e-2: ([0.72, 0.71, 0.70], [0.76, 0.75, 0.74])}  # fmt: skip
    for rate, (val, test) in runs.items():
        name = f"b1024-paper-le{rate:g}-s0"
        run = tmp_path / "cells" / name
        run.mkdir(parents=True)
        record = {"cell": name, "batch_size": 1024, "recipe": "paper", "seed": 0,
                  "rates": {"lr_embed": rate}, "variant": f"paper --lr-embed {rate:g}"}  # fmt: skip
        (run / "cell.json").write_text(json.dumps(record))
        metrics = {"epoch_auc": test, "epoch_val_auc": val, "epoch_logloss": [0.5] * len(val),
                   "epochs": len(val), "steps": 10, "train_samples": 10_000,
                   "train_samples_per_s": 1e4, "rows_updated": 100, "rows_clipped": 0,
                   "load_average": [1.0, 2.5, 3.0], "hyperparameters": {}}  # fmt: skip
        (run / "metrics.json").write_text(json.dumps(metrics))
        rows = "".join(
            f"{e + 1},{e + 1},{(e + 1) * 150_000},{t},{v},0.5\n"
            for e, (t, v) in enumerate(zip(test, val))
        )
        (run / "epochs.csv").write_text(
            "epoch,step,train_samples,test_auc,val_auc,train_loss\n" + rows
        )
    built = report.build_report(tmp_path)
    cells = {c["rates"]["lr_embed"]: c for c in built["cells"]}
    assert (cells[1e-3]["best_epoch"], cells[1e-3]["best_val_auc"], cells[1e-3]["best_auc"]) == (
        2, 0.74, 0.72)  # fmt: skip
    assert cells[1e-3]["epochs"] == 4 and cells[1e-2]["epochs"] == 3
    assert cells[1e-3]["load"] == 2.5
    line = report.best_cell(built["summary"])
    assert line == (
        "best cell by validation AUC: paper --lr-embed 0.001 at batch 1024 (validation "
        "0.7400, test 0.7200)"
    )
    table = report.format_table(built["summary"], 1024).splitlines()
    assert "epochs" in table[0] and "val AUC" in table[0] and "test AUC" in table[0]
    assert " 4 " in table[1] and "0.7400" in table[1] and "0.7200" in table[1]
    assert "up to 6 epoch(s)" in report.title(built)
    assert searched_rate(built["cells"]) == "lr_embed"
    fig = rates_figure(built, "lr_embed")
    (ax,) = fig.axes[:1]
    assert len([a for a in fig.axes if a.has_data()]) == 1  # no panel of zeros
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "--lr-embed (batch 1024)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.001", "0.01"]
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["paper s0: test", "paper s0: validation"]
    curves = curves_figure(built, tmp_path)
    auc_ax = curves.axes[0]
    assert auc_ax.get_ylabel() == "validation AUC" and "star: best epoch" in auc_ax.get_title()
    stars = [line for ax in curves.axes for line in ax.get_lines() if line.get_marker() == "*"]
    assert sorted(float(line.get_ydata()[0]) for line in stars) == [0.72, 0.74]
    FigureCanvasAgg(curves).draw()
    ticks = [t.get_text() for t in auc_ax.get_xticklabels() if t.get_text()]
    assert ticks and not any("e+" in t for t in ticks), ticks
    assert (
        "load average (5 min) as the cells ended: 2.5-2.5"
        in time_figure(built)._suptitle.get_text()
    )
    paths = write_plots(built, tmp_path)
    assert all(p.read_bytes()[:8] == PNG for p in paths.values())
    (tmp_path / "cells" / "b1024-paper-le0.01-s0" / "metrics.json").write_text(json.dumps(
        {**json.loads((tmp_path / "cells" / "b1024-paper-le0.01-s0" / "metrics.json").read_text()),
         "epoch_val_auc": []}))  # fmt: skip
    line = report.best_cell(report.build_report(tmp_path)["summary"])
    assert line.startswith("best cell by test AUC: paper --lr-embed 0.01 at batch 1024 (0.7600)")
    assert "made on the test set" in line

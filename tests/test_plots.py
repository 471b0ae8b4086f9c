"""The figures a run and a sweep draw: training against validation loss with the early
stop marked, tick labels that do not run into each other nor read ``7x10^0``, and a loss
for a sweep cell shorter than ``--log-every``."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg

from torchrec_cowclip.run.curves import run_curves_figure
from torchrec_cowclip.sweep.plots import curves_figure, time_figure


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _tick_labels(ax, which: str = "x") -> list:
    axis = ax.xaxis if which == "x" else ax.yaxis
    return [t for t in axis.get_ticklabels() if t.get_text() and t.get_visible()]


def _assert_apart(fig) -> None:
    """No two x tick labels of a panel overlap on the rendered figure."""
    FigureCanvasAgg(fig).draw()
    for ax in fig.axes:
        boxes = sorted((t.get_window_extent() for t in _tick_labels(ax)), key=lambda b: b.x0)
        for left, right in zip(boxes, boxes[1:]):
            assert left.x1 <= right.x0, (ax.get_title(), [t.get_text() for t in _tick_labels(ax)])


def _cell(out: Path, name: str, batch: int, steps_rows: list, epochs: int) -> dict:
    run = out / "cells" / name
    _write(run / "steps.csv", "step,loss,running_loss\n" + "".join(steps_rows))
    rows = "".join(
        f"{e + 1},{(e + 1) * 10},{(e + 1) * 123_456 * batch},{0.7 + 0.01 * e},{0.5 - 0.01 * e}\n"
        for e in range(epochs)
    )
    _write(run / "epochs.csv", "epoch,step,train_samples,test_auc,train_loss\n" + rows)
    return {"cell": name, "batch_size": batch, "recipe": "paper", "seed": 0,
            "status": "finished", "run": f"cells/{name}"}  # fmt: skip


def _report(out: Path) -> dict:
    cells = [
        # fewer steps than --log-every: no steps.csv row at all
        _cell(out, "b64-paper-s0", 64, [], 2),
        _cell(out, "b1024-paper-s0", 1024, [f"{s},0.6,0.6\n" for s in range(20, 200, 20)], 2),
    ]
    summary = [
        {"recipe": "paper", "batch_size": b, "scale": b / 64, "seeds": 1, "seeds_done": 1,
         **{f"{k}_{s}": v for k, v in (("train_s_per_epoch", t), ("samples_per_s", 1e5 / t))
            for s in ("mean", "min", "max")}}
        for b, t in ((64, 7.0), (1024, 2.0))
    ]  # fmt: skip
    return {"cells": cells, "summary": summary, "sweep": {"base_batch": 64, "settings": {}}}


def test_sweep_curves_draw_a_loss_for_a_cell_shorter_than_log_every(tmp_path):
    fig = curves_figure(_report(tmp_path), tmp_path)
    loss_ax = fig.axes[1]
    short = [line for line in loss_ax.get_lines() if line.get_label() == "64 s0"]
    assert [len(line.get_xdata()) for line in short] == [2], short
    _assert_apart(fig)


def test_sweep_time_ticks_read_as_plain_numbers(tmp_path):
    fig = time_figure(_report(tmp_path))
    FigureCanvasAgg(fig).draw()
    labels = [t.get_text() for ax in fig.axes for t in _tick_labels(ax, "y")]
    assert labels and not any("times" in t or "^" in t or "$" in t for t in labels), labels
    assert "5" in labels or "2" in labels, labels


def test_run_curves_show_validation_loss_and_the_early_stop(tmp_path):
    _write(tmp_path / "steps.csv", "step,loss,running_loss\n1,0.69,0.69\n2,0.6,0.68\n")
    _write(
        tmp_path / "epochs.csv",
        "epoch,step,test_auc,val_auc,train_loss,val_logloss\n"
        "1,1000000,0.70,0.71,0.52,0.50\n2,2000000,0.69,0.70,0.48,0.51\n",
    )
    fig = run_curves_figure(tmp_path, best_epoch=1, stopped_early=True)
    loss_ax = fig.axes[0]
    labels = [line.get_label() for line in loss_ax.get_lines()]
    assert {"training, epoch mean", "validation", "early stop: best epoch", "stopped"} <= set(
        labels
    ), labels
    best = next(ln for ln in loss_ax.get_lines() if ln.get_label() == "early stop: best epoch")
    assert list(best.get_xdata()) == [1_000_000, 1_000_000]
    _assert_apart(fig)

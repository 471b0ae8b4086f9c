"""A sweep's figures (PNG, headless; :mod:`torchrec_cowclip.run.curves`):

- ``sweep_auc.png``, the paper's figure: test AUC against the batch size per recipe (best
  epoch), and the change against the base batch at the best and at the last epoch, in AUC
  points; the mean over seeds, the bars their min..max. A learning-rate search at one
  batch size (``--lr-embed 1e-3,1e-2``) plots instead the validation AUC (solid) and the
  test AUC (dashed) of each cell's best epoch against the searched rate on a log axis,
  one series per recipe and seed; a sweep of one batch size has no change panels (they
  would be zeros);
- ``sweep_curves.png``: per recipe, every cell's validation AUC (where it has a validation
  split; test AUC otherwise) after each epoch, its best epoch marked with a star, and its
  training loss, against the training samples seen (comparable across batch sizes);
- ``sweep_time.png``: training seconds per epoch and training samples per second
  against the batch size, titled with the machine's load average as the cells ended.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from torchrec_cowclip.run.curves import (
    column,
    epoch_ends,
    new_figure,
    plain_log_ticks,
    read_csv,
    save_png,
    sparse_ticks,
)
from torchrec_cowclip.sweep.grid import LR_GRID, train_flag
from torchrec_cowclip.sweep.report import title

AUC_PNG, CURVES_PNG, TIME_PNG = "sweep_auc.png", "sweep_curves.png", "sweep_time.png"


def _batch_axis(ax: Any, batches: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(batches))
    ax.set_xticklabels([f"{b // 1024}K" if b % 1024 == 0 else str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.grid(True, alpha=0.3)


def _recipes(summary: Sequence[Dict[str, Any]]) -> List[str]:
    """The series of the figures: each recipe with its grid learning rates."""
    return list(dict.fromkeys(_variant(s) for s in summary))


def _variant(row: Dict[str, Any]) -> str:
    return str(row.get("variant") or row["recipe"])


def _errorbars(ax: Any, rows: Sequence[Dict[str, Any]], key: str, label: str) -> None:
    rows = [r for r in rows if math.isfinite(r[f"{key}_mean"])]
    if not rows:
        return
    ys = [r[f"{key}_mean"] for r in rows]
    err = [
        [y - r[f"{key}_min"] for y, r in zip(ys, rows)],
        [r[f"{key}_max"] - y for y, r in zip(ys, rows)],
    ]
    ax.errorbar([r["batch_size"] for r in rows], ys, yerr=err, marker="o", capsize=3, label=label)


def searched_rate(cells: Sequence[Dict[str, Any]]) -> Optional[str]:
    """The learning rate a sweep at one batch size searched (``lr_embed`` or ``lr``, the
    first with several values), else None.

    Example::

        >>> searched_rate([{"batch_size": 1024, "rates": {"lr_embed": r}} for r in (1e-3, 1e-2)])
        'lr_embed'
    """
    if len({c["batch_size"] for c in cells}) != 1:
        return None
    for key in LR_GRID:
        if len({(c.get("rates") or {}).get(key) for c in cells} - {None}) > 1:
            return key
    return None


def plot_rates(report: Dict[str, Any], key: str, path: Path) -> Path:
    """``sweep_auc.png`` of a learning-rate search (:func:`rates_figure`)."""
    return save_png(rates_figure(report, key), path)


def rates_figure(report: Dict[str, Any], key: str) -> Any:
    """Per recipe and seed, the validation AUC that chose each cell's epoch (solid) and
    that epoch's test AUC (dashed) against the searched rate ``key`` (log axis, the
    searched values as plain ticks)."""
    cells = [c for c in report["cells"] if math.isfinite(c["best_auc"])]
    fig, axes = new_figure(1, 1)
    ax = axes[0][0]
    rates = sorted({float(c["rates"][key]) for c in cells})
    for recipe in dict.fromkeys(c["recipe"] for c in cells):
        for seed in sorted({c["seed"] for c in cells if c["recipe"] == recipe}):
            mine = sorted(
                (c for c in cells if c["recipe"] == recipe and c["seed"] == seed),
                key=lambda c: float(c["rates"][key]),
            )
            xs = [float(c["rates"][key]) for c in mine]
            val = [c["best_val_auc"] for c in mine]
            (line,) = ax.plot(xs, [c["best_auc"] for c in mine], "--", marker="s", ms=4,
                              label=f"{recipe} s{seed}: test")  # fmt: skip
            if any(math.isfinite(v) for v in val):
                ax.plot(xs, val, "-", marker="o", ms=4, color=line.get_color(),
                        label=f"{recipe} s{seed}: validation")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xticks(rates)
    ax.set_xticklabels([f"{r:g}" for r in rates])
    ax.minorticks_off()
    ax.set_xlabel(f"{train_flag(key)} (batch {cells[0]['batch_size'] if cells else '?'})")
    ax.set_ylabel("AUC of the best epoch", fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.suptitle(title(report), fontsize=9)
    return fig


def plot_auc(report: Dict[str, Any], path: Path) -> Path:
    """``sweep_auc.png``: best-epoch AUC, and its change and the last epoch's against the
    base batch, against the batch size per recipe (a learning-rate search at one batch
    size: :func:`plot_rates`)."""
    key = searched_rate(report["cells"])
    if key is not None:
        return plot_rates(report, key, path)
    summary = report["summary"]
    base = report["sweep"]["base_batch"]
    batches = sorted({s["batch_size"] for s in summary})
    panels = [("best_auc", "test AUC, best epoch")]
    if len(batches) > 1:  # at one batch size every change is 0
        panels += [
            ("best_auc_change", f"best-epoch AUC change\nagainst batch {base}, points"),
            ("last_auc_change", f"last-epoch AUC change\nagainst batch {base}, points"),
        ]
    fig, axes = new_figure(1, len(panels))
    for ax, (key, label) in zip(axes[0], panels):
        for recipe in _recipes(summary):
            _errorbars(ax, [s for s in summary if _variant(s) == recipe], key, recipe)
        if key.endswith("change"):
            ax.axhline(0.0, color="grey", lw=0.8)
            ax.axhspan(-0.1, 0.1, color="tab:green", alpha=0.08, lw=0)  # within 0.1 point
        _batch_axis(ax, batches)
        ax.set_ylabel(label, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title(report), fontsize=9)
    return save_png(fig, path)


def plot_curves(report: Dict[str, Any], out: Path, path: Path) -> Path:
    """``sweep_curves.png``: one row per recipe, every cell's test AUC per epoch and
    training loss (running mean, and each epoch's mean as points) against the training
    samples seen."""
    return save_png(curves_figure(report, out), path)


def curves_figure(report: Dict[str, Any], out: Path) -> Any:
    """The figure of :func:`plot_curves`."""
    cells = [c for c in report["cells"] if c["status"] in ("finished", "shared", "unfinished")]
    recipes = _recipes(report["summary"]) or ["(no cell)"]
    batches = sorted({c["batch_size"] for c in cells})
    fig, axes = new_figure(len(recipes), 2, panel=(5.2, 3.0))
    import matplotlib

    colours = matplotlib.colormaps["viridis"]
    styles = ["-", "--", ":", "-."]
    seeds = sorted({c["seed"] for c in cells})
    for (auc_ax, loss_ax), recipe in zip(axes, recipes):
        for c in (c for c in cells if _variant(c) == recipe):
            run = Path(out) / c["run"]
            steps, epochs = read_csv(run / "steps.csv"), read_csv(run / "epochs.csv")
            colour = colours(batches.index(c["batch_size"]) / max(len(batches) - 1, 1))
            style = styles[seeds.index(c["seed"]) % len(styles)]
            label = f"{c['batch_size']} s{c['seed']}"
            samples = column(epochs, "train_samples")
            if not samples or any(math.isnan(x) for x in samples):
                samples = [e * c["batch_size"] for e in epoch_ends(epochs, steps)]
            chosen = "val_auc" if epochs and "val_auc" in epochs[0] else "test_auc"
            aucs = column(epochs, chosen)
            auc_ax.plot(samples, aucs, style, marker="o", ms=3, color=colour,
                        label=label)  # fmt: skip
            best = c.get("best_epoch")
            if best is not None and 0 < int(best) <= min(len(samples), len(aucs)):
                auc_ax.plot([samples[int(best) - 1]], [aucs[int(best) - 1]], "*", ms=10,
                            color=colour)  # fmt: skip
            if steps:
                loss = "running_loss" if "running_loss" in steps[0] else "loss"
                loss_ax.plot([s * c["batch_size"] for s in column(steps, "step")],
                             column(steps, loss), style, lw=0.9, color=colour, label=label)  # fmt: skip
            # Each epoch's mean loss as points: a cell with fewer steps than --log-every
            # has no steps.csv row, and still a loss.
            if epochs and "train_loss" in epochs[0]:
                loss_ax.plot(samples, column(epochs, "train_loss"), "o", ms=3, color=colour,
                             label=None if steps else label)  # fmt: skip
        shown = "validation" if any(c.get("best_by") == "val" for c in cells) else "test"
        auc_ax.set(xlabel="training samples", ylabel=f"{shown} AUC",
                   title=f"{recipe}: {shown} AUC per epoch (star: best epoch)")  # fmt: skip
        loss_ax.set(xlabel="training samples", ylabel="training logloss", title=f"{recipe}: loss")
        for ax in (auc_ax, loss_ax):
            ax.grid(True, alpha=0.3)
            sparse_ticks(ax.xaxis)
        if auc_ax.get_legend_handles_labels()[0]:
            auc_ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title(report), fontsize=9)
    return fig


def plot_time(report: Dict[str, Any], path: Path) -> Path:
    """``sweep_time.png``: training seconds per epoch and samples per second against the
    batch size per recipe (mean over seeds, bars min..max)."""
    return save_png(time_figure(report), path)


def time_figure(report: Dict[str, Any]) -> Any:
    """The figure of :func:`plot_time`."""
    summary = report["summary"]
    batches = sorted({s["batch_size"] for s in summary})
    fig, axes = new_figure(1, 2)
    for ax, (key, label) in zip(
        axes[0],
        (
            ("train_s_per_epoch", "training seconds per epoch"),
            ("samples_per_s", "training samples/s"),
        ),
    ):
        for recipe in _recipes(summary):
            _errorbars(ax, [s for s in summary if _variant(s) == recipe], key, recipe)
        _batch_axis(ax, batches)
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
        ax.set_ylabel(label, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    loads = [c["load"] for c in report["cells"] if c.get("load") is not None]
    load = (
        f"load average (5 min) as the cells ended: {min(loads):.1f}-{max(loads):.1f} on "
        f"{os.cpu_count()} CPUs"
        if loads
        else "load average not recorded"
    )
    fig.suptitle(f"{title(report)}\n{load}", fontsize=9)
    return fig


def write_plots(report: Dict[str, Any], out: Path) -> Dict[str, Path]:
    """The three figures in ``out``."""
    out = Path(out)
    return {
        "auc": plot_auc(report, out / AUC_PNG),
        "curves": plot_curves(report, out, out / CURVES_PNG),
        "time": plot_time(report, out / TIME_PNG),
    }

"""PNG figures, drawn headless: a training run's loss and AUC curves (``curves.png`` in
its ``--out``), and the helpers the sweep's figures share (:mod:`torchrec_cowclip.sweep.plots`).

Figures are built with matplotlib's object API (``matplotlib.figure.Figure``), which
renders with the Agg backend and never opens a window or touches pyplot's global state,
so a run on a server without a display, or several runs in one process, plot alike.
matplotlib is imported when a figure is drawn, not when this module is.

Example::

    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp())
    >>> _ = (out / "steps.csv").write_text("step,loss,running_loss\\n1,0.69,0.69\\n2,0.6,0.68\\n")
    >>> _ = (out / "epochs.csv").write_text("epoch,step,test_auc\\n1,2,0.71\\n")
    >>> write_run_curves(out).name, (out / CURVES_PNG).read_bytes()[:4] == b"\\x89PNG"
    ('curves.png', True)
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: The figure a training run writes into its ``--out``.
CURVES_PNG = "curves.png"


def new_figure(rows: int, cols: int, panel: Tuple[float, float] = (4.6, 3.4)) -> Tuple[Any, Any]:
    """A ``rows x cols`` figure of ``panel``-sized (inches) axes: ``(figure, axes[r][c])``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(panel[0] * cols, panel[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def save_png(fig: Any, path: Path, dpi: int = 100) -> Path:
    """Writes ``fig`` to ``path`` through ``path.tmp`` and a rename: a kill leaves the old
    picture or the new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fig.savefig(tmp, format="png", dpi=dpi)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_csv(path: Path) -> List[Dict[str, str]]:
    """The rows of a run's CSV log (``steps.csv``, ``epochs.csv``); [] if it is absent."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def number(text: Optional[str]) -> float:
    """A CSV cell as a float; NaN for an empty or missing one."""
    if text is None or text in ("", "None"):
        return math.nan
    try:
        return float(text)
    except ValueError:
        return math.nan


def column(rows: Sequence[Dict[str, str]], name: str) -> List[float]:
    return [number(r.get(name)) for r in rows]


def epoch_ends(epochs: Sequence[Dict[str, str]], steps: Sequence[Dict[str, str]]) -> List[float]:
    """The step at which each epoch of ``epochs.csv`` ended. Logs written before the
    epoch rows carried their step count give ``epoch * (last logged step / epochs)``."""
    ends = column(epochs, "step")
    if ends and not any(math.isnan(x) for x in ends):
        return ends
    last = max(column(steps, "step"), default=math.nan)
    per_epoch = last / len(epochs) if epochs else math.nan
    return [(i + 1) * per_epoch for i in range(len(epochs))]


def plain_log_ticks(axis: Any) -> None:
    """Tick labels of a log-scaled ``axis`` as plain numbers (``7``, ``20``, ``1.5K``),
    not matplotlib's ``7x10^0``."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: short_number(v)))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def short_number(value: float) -> str:
    """``1234567`` -> ``'1.2M'``, ``20000`` -> ``'20K'``, ``7.0`` -> ``'7'``, ``0.5`` -> ``'0.5'``.

    Example::

        >>> [short_number(v) for v in (7.0, 0.5, 1500, 20000, 153000, 1234567, 3e9)]
        ['7', '0.5', '1.5K', '20K', '153K', '1.2M', '3G']
    """
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            scaled = value / scale
            # Two significant digits, but never an exponent: 153K, not 1.5e+02K.
            return (f"{scaled:.2g}" if abs(scaled) < 100 else f"{scaled:.0f}") + suffix
    return f"{value:.3g}"


def sparse_ticks(axis: Any, count: int = 4) -> None:
    """At most ``count`` major ticks on ``axis``, labelled by :func:`short_number`, so
    that the labels of a narrow panel do not run into each other."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axis.set_major_locator(MaxNLocator(nbins=count, min_n_ticks=2))
    axis.set_major_formatter(FuncFormatter(lambda v, _: short_number(v)))


def run_curves_figure(
    out: Path, title: str = "", best_epoch: Optional[int] = None, stopped_early: bool = False
) -> Any:
    """The figure of :func:`write_run_curves`."""
    out = Path(out)
    steps, epochs = read_csv(out / "steps.csv"), read_csv(out / "epochs.csv")
    fig, axes = new_figure(1, 2)
    loss_ax, auc_ax = axes[0]
    x = column(steps, "step")
    if steps:
        loss_ax.plot(x, column(steps, "loss"), color="tab:blue", alpha=0.3, lw=0.8, label="loss")
        if "running_loss" in steps[0]:
            loss_ax.plot(x, column(steps, "running_loss"), color="tab:blue", label="running mean")
    ends = epoch_ends(epochs, steps)
    for key, label, colour in (
        ("train_loss", "training, epoch mean", "tab:blue"),
        ("val_logloss", "validation", "tab:orange"),
    ):
        if epochs and key in epochs[0]:
            loss_ax.plot(ends, column(epochs, key), marker="o", color=colour, label=label)
    for key, label in (("test_auc", "test"), ("val_auc", "validation")):
        if epochs and key in epochs[0]:
            auc_ax.plot(ends, column(epochs, key), marker="o", label=label)
    if best_epoch is not None and 0 < best_epoch <= len(ends):
        what = "early stop: best epoch" if stopped_early else "best epoch"
        for ax in (loss_ax, auc_ax):
            ax.axvline(ends[best_epoch - 1], color="tab:red", ls="--", lw=1, label=what)
    if stopped_early and ends:
        for ax in (loss_ax, auc_ax):
            ax.axvline(ends[-1], color="grey", ls=":", lw=1, label="stopped")
    loss_ax.set(xlabel="step", ylabel="logloss", title="training and validation loss")
    auc_ax.set(xlabel="step (end of epoch)", ylabel="AUC", title="AUC after each epoch")
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
        sparse_ticks(ax.xaxis)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def write_run_curves(
    out: Path, title: str = "", best_epoch: Optional[int] = None, stopped_early: bool = False
) -> Path:
    """Draws ``out/curves.png`` from the run's ``steps.csv`` and ``epochs.csv``: the
    training loss against the step (each logged step's loss, and its running mean) with
    each epoch's mean training loss and validation loss, and the test and validation AUC
    at each epoch's end; the best epoch (1-based) is marked, and an early stop. Returns
    the path."""
    fig = run_curves_figure(out, title, best_epoch, stopped_early)
    return save_png(fig, Path(out) / CURVES_PNG)

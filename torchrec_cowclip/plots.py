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


def write_run_curves(out: Path, title: str = "") -> Path:
    """Draws ``out/curves.png`` from the run's ``steps.csv`` and ``epochs.csv``: the
    training loss against the step (each logged step's loss, and its running mean), and
    the test and validation AUC at each epoch's end. Returns the path."""
    out = Path(out)
    steps, epochs = read_csv(out / "steps.csv"), read_csv(out / "epochs.csv")
    fig, axes = new_figure(1, 2)
    loss_ax, auc_ax = axes[0]
    x = column(steps, "step")
    if steps:
        loss_ax.plot(x, column(steps, "loss"), color="tab:blue", alpha=0.3, lw=0.8, label="loss")
        if "running_loss" in steps[0]:
            loss_ax.plot(x, column(steps, "running_loss"), color="tab:blue", label="running mean")
        loss_ax.legend(fontsize=8)
    loss_ax.set(xlabel="step", ylabel="training logloss", title="training loss")
    ends = epoch_ends(epochs, steps)
    for key, label in (("test_auc", "test"), ("val_auc", "validation")):
        if epochs and key in epochs[0]:
            auc_ax.plot(ends, column(epochs, key), marker="o", label=label)
    if epochs:
        auc_ax.legend(fontsize=8)
    auc_ax.set(xlabel="step (end of epoch)", ylabel="AUC", title="AUC after each epoch")
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_png(fig, out / CURVES_PNG)

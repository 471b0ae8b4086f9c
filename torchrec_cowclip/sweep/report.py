"""A sweep's results: one row per cell (``sweep.csv``, ``sweep.json``), their summary
per recipe and batch size over seeds, and the table the console and ``sweep.md`` show.

The *best* epoch of a cell is the one with the best validation AUC when the run has a
validation split (``--val-fraction``: the epoch a user would keep), else the one with the
best test AUC (``best_by`` says which). ``best_val_auc`` is the validation AUC that chose
it, ``best_auc`` that epoch's *test* AUC; the best cell is chosen by validation AUC too
(:func:`best_cell`), and where a cell has no validation split the report says the choice
is on the test set. AUC changes are in AUC points (x100) against the
cell of the same recipe and seed at the base batch (``--base-batch-size`` when the sweep
ran it, else its smallest batch size).

Example::

    >>> rows = [
    ...     {"recipe": "paper", "batch_size": 1024, "seed": 0, "best_auc": 0.75, "last_auc": 0.74},
    ...     {"recipe": "paper", "batch_size": 8192, "seed": 0, "best_auc": 0.749, "last_auc": 0.745},
    ... ]
    >>> add_changes(rows, base_batch=1024)
    >>> [round(r["best_auc_change"], 3) for r in rows], round(rows[1]["last_auc_change"], 3)
    ([0.0, -0.1], 0.5)
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from torchrec_cowclip.run.log import write_text_atomically
from torchrec_cowclip.sweep.runner import (
    CELLS_DIR,
    SETTINGS_FILE,
    SweepError,
    cell_dir,
    cell_status,
    iter_cell_records,
    read_json,
    write_json,
)
from torchrec_cowclip.train.scaling import RECIPES

#: sweep.csv's columns, one row per cell.
CSV_COLUMNS = (
    "cell",
    "batch_size",
    "scale",
    "recipe",
    "variant",
    "seed",
    "status",
    "epochs",
    "steps",
    "train_samples",
    "best_epoch",
    "best_by",
    "best_val_auc",
    "best_auc",
    "best_logloss",
    "last_auc",
    "last_logloss",
    "best_auc_change",
    "last_auc_change",
    "wall_s",
    "load",
    "train_s",
    "train_s_per_epoch",
    "samples_per_s",
    "rows_updated",
    "rows_clipped",
    "clipped_fraction",
    "clip",
    "dense_lr",
    "embedding_lr",
    "l2",
    "run",
    "shares",
)

NAN = math.nan


def _auc_value(value: Any) -> float:
    """An epoch's AUC as a number: NaN where it was undefined (None: one class)."""
    return NAN if value is None else float(value)


def _best_epoch(metrics: Dict[str, Any]) -> Tuple[int, str]:
    """Index of the best epoch and what chose it (``val`` or ``test``); an undefined
    AUC never wins."""
    test = [_auc_value(v) for v in metrics.get("epoch_auc") or []]
    val = [_auc_value(v) for v in metrics.get("epoch_val_auc") or []]

    def best(values: List[float]) -> int:
        return max(
            range(len(values)), key=lambda i: -math.inf if math.isnan(values[i]) else values[i]
        )

    if val and len(val) == len(test):
        return best(val), "val"
    return best(test), "test"


def _wall_s(record: Dict[str, Any]) -> float:
    return float(sum(a.get("wall_s", 0.0) for a in record.get("attempts") or []))


def cell_row(out: Path, record: Dict[str, Any], base_batch_size: int) -> Dict[str, Any]:
    """The CSV row of one cell from its ``cell.json`` and its run's ``metrics.json`` (the
    shared run's for a cell that shares one)."""
    run_name = record.get("shares") or record["cell"]
    run = cell_dir(out, run_name)
    run_record = record if run_name == record["cell"] else (read_json(run / "cell.json") or {})
    row: Dict[str, Any] = {c: None for c in CSV_COLUMNS}
    row.update(
        cell=record["cell"],
        batch_size=record["batch_size"],
        scale=record["batch_size"] / base_batch_size,
        recipe=record["recipe"],
        variant=record.get("variant") or record["recipe"],
        rates=record.get("rates") or {},
        seed=record["seed"],
        status=cell_status(out, run_name),
        run=f"{CELLS_DIR}/{run_name}",
        shares=record.get("shares"),
        wall_s=_wall_s(run_record),
        best_auc=NAN,
        best_val_auc=NAN,
        last_auc=NAN,
    )
    metrics = read_json(run / "metrics.json")
    if metrics is None or not metrics.get("epoch_auc"):
        return row
    best, best_by = _best_epoch(metrics)
    val = metrics.get("epoch_val_auc") or []
    train_s = metrics["train_samples"] / max(metrics["train_samples_per_s"], 1e-9)
    hp = metrics.get("hyperparameters") or {}
    updated, clipped = metrics.get("rows_updated"), metrics.get("rows_clipped")
    row.update(
        epochs=metrics["epochs"],
        steps=metrics["steps"],
        train_samples=metrics["train_samples"],
        best_epoch=best + 1,
        best_by=best_by,
        best_val_auc=_auc_value(val[best]) if best_by == "val" else NAN,
        best_auc=_auc_value(metrics["epoch_auc"][best]),
        best_logloss=metrics["epoch_logloss"][best],
        last_auc=_auc_value(metrics["epoch_auc"][-1]),
        last_logloss=metrics["epoch_logloss"][-1],
        train_s=train_s,
        # The 5-minute load average as the cell ended (None for older runs).
        load=(metrics.get("load_average") or [None, None])[1],
        train_s_per_epoch=train_s / max(metrics["epochs"], 1),
        samples_per_s=metrics["train_samples_per_s"],
        rows_updated=updated,
        rows_clipped=clipped,
        clipped_fraction=clipped / updated if (clipped is not None and updated) else None,
        clip=hp.get("cowclip") is not None,
        dense_lr=hp.get("dense_lr"),
        embedding_lr=hp.get("embedding_lr"),
        l2=hp.get("l2"),
    )
    return row


def base_batch(rows: Sequence[Dict[str, Any]], base_batch_size: int) -> int:
    """The batch the changes are measured against: ``base_batch_size`` when the sweep has
    cells there, else its smallest batch size."""
    batches = sorted({r["batch_size"] for r in rows})
    return base_batch_size if base_batch_size in batches or not batches else batches[0]


def _variant(row: Dict[str, Any]) -> str:
    """The recipe with the cell's grid learning rates (``paper --lr-embed 0.001``)."""
    return str(row.get("variant") or row["recipe"])


def add_changes(rows: List[Dict[str, Any]], base_batch: int) -> None:
    """Sets ``best_auc_change`` / ``last_auc_change`` (AUC points, x100) of every row
    against the same recipe (and grid learning rates) and seed at ``base_batch`` (NaN
    without that cell's AUC)."""
    base = {(_variant(r), r["seed"]): r for r in rows if r["batch_size"] == base_batch}
    for r in rows:
        b = base.get((_variant(r), r["seed"]))
        for key in ("best_auc", "last_auc"):
            ref = b[key] if b is not None else NAN
            r[f"{key}_change"] = 100.0 * (r[key] - ref)


def _finite(values: Sequence[Any]) -> List[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _stats(values: Sequence[Any]) -> Dict[str, float]:
    xs = _finite(values)
    if not xs:
        return {"mean": NAN, "sd": NAN, "min": NAN, "max": NAN}
    return {
        "mean": statistics.fmean(xs),
        "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "min": min(xs),
        "max": max(xs),
    }


def recipe_rank(recipe: str) -> Tuple[int, str]:
    """Recipes in the trainer's order (``--recipe``'s choices), any other after them."""
    names = list(RECIPES)
    return (names.index(recipe) if recipe in names else len(names), recipe)


def _variant_rank(row: Dict[str, Any]) -> Tuple[Tuple[int, str], float, float]:
    """Recipes in :func:`recipe_rank`'s order, then the grid rates ascending."""
    rates = row.get("rates") or {}
    return (
        recipe_rank(row["recipe"]),
        float(rates.get("lr_embed", 0.0)),
        float(rates.get("lr", 0.0)),
    )


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One record per (recipe with its grid learning rates, batch size): seeds finished
    of seeds planned, and mean / sd / min / max over the finished seeds of the AUCs,
    their changes, the clip rate and the time; recipes in :func:`recipe_rank`'s order
    (rates ascending), batch sizes ascending."""
    out = []
    variants = list(dict.fromkeys(_variant(r) for r in sorted(rows, key=_variant_rank)))
    for variant in variants:
        of_variant = [r for r in rows if _variant(r) == variant]
        for batch in sorted({r["batch_size"] for r in of_variant}):
            group = [r for r in of_variant if r["batch_size"] == batch]
            done = [r for r in group if math.isfinite(r["best_auc"])]
            record: Dict[str, Any] = {
                "recipe": group[0]["recipe"],
                "variant": variant,
                "batch_size": batch,
                "scale": group[0]["scale"],
                "seeds": len(group),
                "seeds_done": len(done),
                "statuses": sorted({r["status"] for r in group}),
            }
            record["chosen_on"] = (
                "validation" if done and all(r.get("best_by") == "val" for r in done) else "test"
            )
            for key in (
                "epochs",
                "best_val_auc",
                "best_auc",
                "last_auc",
                "best_auc_change",
                "last_auc_change",
                "clipped_fraction",
                "train_s_per_epoch",
                "samples_per_s",
                "best_logloss",
                "last_logloss",
            ):
                for stat, value in _stats([r[key] for r in done]).items():
                    record[f"{key}_{stat}"] = value
            out.append(record)
    return out


def _auc(s: Dict[str, Any], key: str) -> str:
    mean = s[f"{key}_mean"]
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.4f}" + (f" ±{s[f'{key}_sd']:.4f}" if s["seeds_done"] > 1 else "")


def _change(s: Dict[str, Any], key: str, base: int) -> str:
    if s["batch_size"] == base:
        return "base"
    mean = s[f"{key}_mean"]
    if not math.isfinite(mean):
        return "-"
    if s["seeds_done"] == 1:
        return f"{mean:+.2f}"
    return f"{mean:+.2f} ({s[f'{key}_min']:+.2f}..{s[f'{key}_max']:+.2f})"


def _seeds(s: Dict[str, Any]) -> str:
    text = f"{s['seeds_done']}/{s['seeds']}"
    others = [x for x in s["statuses"] if x not in ("finished", "shared")]
    return text + (f" {','.join(others)}" if others else "")


def _epochs(s: Dict[str, Any]) -> str:
    low, high = s["epochs_min"], s["epochs_max"]
    if not math.isfinite(low):
        return "-"
    return f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"


TABLE_HEADERS = (
    "recipe",
    "batch",
    "x base",
    "seeds",
    "epochs",
    "val AUC",
    "test AUC",
    "change, points",
    "last test AUC",
    "change, points ",
    "clipped",
    "s/epoch",
    "samples/s",
)


def table_rows(summary: Sequence[Dict[str, Any]], base: int) -> List[List[str]]:
    rows = []
    for s in summary:
        clipped = s["clipped_fraction_mean"]
        rows.append(
            [
                str(s.get("variant") or s["recipe"]),
                f"{s['batch_size']}",
                f"{s['scale']:g}",
                _seeds(s),
                _epochs(s),
                _auc(s, "best_val_auc"),
                _auc(s, "best_auc"),
                _change(s, "best_auc_change", base),
                _auc(s, "last_auc"),
                _change(s, "last_auc_change", base),
                f"{100 * clipped:.3g}%" if math.isfinite(clipped) else "-",
                f"{s['train_s_per_epoch_mean']:.1f}"
                if math.isfinite(s["train_s_per_epoch_mean"])
                else "-",
                f"{s['samples_per_s_mean']:,.0f}"
                if math.isfinite(s["samples_per_s_mean"])
                else "-",
            ]
        )
    return rows


def format_table(summary: Sequence[Dict[str, Any]], base: int, markdown: bool = False) -> str:
    """The summary as aligned text (or a Markdown table): per recipe and batch size, the
    seeds done, the epochs trained (min-max over seeds: early stopping ends cells at
    different epochs), the validation AUC that chose the best epoch and that epoch's test
    AUC (mean ± sd over seeds), its change against the base batch in AUC points (mean
    (min..max) over seeds), the last epoch's test AUC and change, the share of row
    updates clipped, training seconds per epoch and training samples per second.

    Example::

        >>> s = summarize([{"recipe": "none", "batch_size": 64, "scale": 1.0, "seed": 0,
        ...                 "status": "finished", "epochs": 3, "best_by": "val",
        ...                 "best_val_auc": 0.71, "best_auc": 0.7, "last_auc": 0.7,
        ...                 "best_auc_change": 0.0, "last_auc_change": 0.0,
        ...                 "clipped_fraction": None, "train_s_per_epoch": 2.0,
        ...                 "samples_per_s": 5e4, "best_logloss": 0.5, "last_logloss": 0.5}])
        >>> print(format_table(s, 64, markdown=True))
        | recipe | batch | x base | seeds | epochs | val AUC | test AUC | change, points | last test AUC | change, points  | clipped | s/epoch | samples/s |
        |---|---|---|---|---|---|---|---|---|---|---|---|---|
        | none | 64 | 1 | 1/1 | 3 | 0.7100 | 0.7000 | base | 0.7000 | base | - | 2.0 | 50,000 |
        >>> best_cell(s)
        'best cell by validation AUC: none at batch 64 (validation 0.7100, test 0.7000)'
    """
    rows = table_rows(summary, base)
    if markdown:
        lines = ["| " + " | ".join(TABLE_HEADERS) + " |", "|" + "---|" * len(TABLE_HEADERS)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(TABLE_HEADERS)]
    left = {0}  # the recipe's column reads left to right; numbers align right

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(TABLE_HEADERS)] + [line(r) for r in rows])


def best_cell(summary: Sequence[Dict[str, Any]]) -> str:
    """The line naming the best (recipe with its rates, batch size) by mean validation
    AUC over seeds, with its test AUC beside it; where some cell has no validation split,
    by test AUC, and the line says that this choice is on the test set."""
    done = [s for s in summary if math.isfinite(s["best_auc_mean"])]
    if not done:
        return "best cell: none finished"
    on_val = all(s["chosen_on"] == "validation" for s in done)
    key = "best_val_auc_mean" if on_val else "best_auc_mean"
    top = max(done, key=lambda s: s[key])
    name = f"{top.get('variant') or top['recipe']} at batch {top['batch_size']}"
    if on_val:
        return (
            f"best cell by validation AUC: {name} (validation {top['best_val_auc_mean']:.4f}, "
            f"test {top['best_auc_mean']:.4f})"
        )
    return (
        f"best cell by test AUC: {name} ({top['best_auc_mean']:.4f}); some cells have no "
        "validation split (--val-fraction), so this choice, and each cell's best epoch, is "
        "made on the test set: its AUC is optimistic"
    )


def _csv_text(rows: Sequence[Dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow(
            {
                k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
                for k, v in r.items()
            }
        )
    return buffer.getvalue()


def _json_safe(value: Any) -> Any:
    """NaN as null: sweep.json is read by any JSON parser, and NaN is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _row(out: Path, record: Dict[str, Any], base_batch_size: int) -> Dict[str, Any]:
    """:func:`cell_row`, a run's ``metrics.json`` of another shape refused in one line."""
    try:
        return cell_row(out, record, base_batch_size)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as e:
        metrics = cell_dir(out, record.get("shares") or record["cell"]) / "metrics.json"
        raise SweepError(
            f"{metrics}: not what a run writes ({type(e).__name__}: {e}); move the cell away"
        ) from None


def build_report(out: Path) -> Dict[str, Any]:
    """Every cell of the sweep in ``out`` as rows, their summary, the base batch and the
    sweep's settings (``sweep.json``'s content)."""
    settings = read_json(Path(out) / SETTINGS_FILE) or {}
    base_batch_size = (settings.get("settings") or {}).get("base_batch_size", 1024)
    if (
        not isinstance(base_batch_size, int)
        or isinstance(base_batch_size, bool)
        or base_batch_size < 1
    ):
        raise SweepError(
            f"{Path(out) / SETTINGS_FILE}: 'base_batch_size' is {base_batch_size!r}, not a "
            "whole number >= 1: not what the sweep writes; restore it or move it away"
        )
    records = list(iter_cell_records(out))  # every cell.json checked before any is used
    rows = [_row(Path(out), rec, base_batch_size) for rec in records]
    base = base_batch(rows, base_batch_size)
    for r in rows:
        r["scale"] = r["batch_size"] / base_batch_size
    add_changes(rows, base)
    rows.sort(key=lambda r: (r["seed"], r["batch_size"], _variant_rank(r)))
    return {
        "sweep": {
            "out": str(out),
            **settings,
            "base_batch": base,
            "changes": f"AUC points (x100) against the same recipe and seed at batch {base}",
            "best_epoch": "best validation AUC where the run has a validation split, "
            "else best test AUC (best_by)",
        },
        "cells": rows,
        "summary": summarize(rows),
    }


def write_report(out: Path, report: Dict[str, Any]) -> Dict[str, Path]:
    """``sweep.csv``, ``sweep.json`` and ``sweep.md`` (the table) in ``out``."""
    out = Path(out)
    paths = {"csv": out / "sweep.csv", "json": out / "sweep.json", "md": out / "sweep.md"}
    write_text_atomically(paths["csv"], _csv_text(report["cells"]))
    write_json(paths["json"], _json_safe(report))
    base = report["sweep"]["base_batch"]
    write_text_atomically(
        paths["md"],
        f"{title(report)}\n\n{format_table(report['summary'], base, markdown=True)}\n\n"
        f"{best_cell(report['summary'])}.\n\n"
        f"Changes: {report['sweep']['changes']}; best epoch: {report['sweep']['best_epoch']}.\n",
    )
    return paths


def title(report: Dict[str, Any]) -> str:
    """One line naming the sweep: model, data, epochs, base batch."""
    s = report["sweep"].get("settings") or {}
    equal = report["sweep"].get("equal", "epochs")
    upto = "up to " if s.get("early_stop_patience") else ""
    length = (
        f"{upto}{s.get('epochs')} epoch(s) at every batch"
        if equal == "epochs"
        else f"{upto}the steps of {s.get('epochs')} epoch(s) at the base batch"
    )
    return (
        f"{s.get('model', '?')} on {s.get('data', '?')}, {length}, base batch "
        f"{s.get('base_batch_size', '?')}"
    )

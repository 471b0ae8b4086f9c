"""Large-batch scaling study: does CowClip + the paper's scaling rule keep test AUC as the
batch grows, compared with plain large-batch baselines, and does the clip ever bind?

For one model (``--model deepfm|dcn|dcnv2|wdl``) and one data set (``--data``), trains at
every batch size of ``--batch-sizes`` for the same number of ``--epochs``, with each method
of ``--methods`` and each seed of ``--seeds``:

- ``cowclip``: CowClip on, with a trainer recipe (``--recipe``, default ``paper``: the
  paper's scaling rule, embedding lr unchanged, dense lr * sqrt(s), L2 lambda * s,
  s = batch / base, r = 1, zeta = sqrt(D) * bound); ``--embed-lr-scaling``,
  ``--l2-scaling``, ``--dense-lr-scaling``, ``--count-lr-power``, ``--clip-r``,
  ``--clip-zeta`` change the recipe for this method only (the recipe search of
  ``docs/scaling.md``);
- ``sqrt``: no clipping, embedding AND dense lr * sqrt(s), L2 lambda * s;
- ``linear``: no clipping, embedding AND dense lr * s, L2 lambda * s;
- ``none``: no clipping, no scaling (the base batch's lrs and L2 at every batch);
  ``adam`` is the same run under the study's name for it (plain Adam);
- ``helen``: ``none`` plus the trainer's Helen embedding optimizer (``helen_rho``
  ``--helen-rho``, default 0.05; ``helen_bound`` ``--helen-bound``, default 0.3);
- ``helen+cowclip``: CowClip with the ``fixed-l2`` recipe (whatever ``--recipe`` says)
  plus Helen as above; the cowclip-only flags (``--clip-r``, ... ) apply to it too.

The default ``--methods`` are the first four; the helen methods need a trainer whose
``TrainConfig`` has ``helen_rho`` and ``helen_bound`` (checked before the first run).

``--equal-steps`` trains batch ``b`` for ``epochs * b / base`` epochs instead (the base
batch's number of steps); with ``--early-stop-patience N`` a run stops once validation AUC
has not improved for N epochs.

All methods keep the same dense warm-up (``--warmup-epochs``, default the recipe's: 1 epoch)
and the same initialisation (``--init-std``, default 1e-2; docs/algorithm.md, "When does
the clip bind?", predicts more clipping with a small init such as 1e-4). The base values
(at ``--base-batch-size``) are the trainer's profile (Criteo's, or Avazu's for
``avazu:`` data) unless ``--base-lr`` / ``--base-lr-embed`` / ``--base-l2`` replace them.

Per run it records the final and per-epoch test AUC / logloss, the training time per
step (``step_ms``: the trainer's training seconds, without evaluation, over its steps), and with ``--val-fraction``
the test AUC / logloss of the epoch with the best validation AUC (the epoch a user would
keep: CTR models on Criteo-like data overfit after one or two epochs, so the last epoch
alone can rank methods by how little they trained), steps, wall time, train throughput,
and how often the clip bound: overall (rows clipped / rows updated, all epochs) and early
(the same ratio over the first epoch only, from the cumulative counters the trainer
writes to each run's ``epochs.csv``). With ``--row-clip-stats`` each run also counts
updates and clips per embedding row and reports them by id frequency in the training split
(``clip_per_id_frequency_bucket`` in scaling.json; the trainer's ``--row-clip-stats``);
without it, per-table counts only.

Output (under ``--out``, default ``benchmarks/results/scaling``): one trainer run
directory per (method, batch, seed) in ``runs/`` (``metrics.json``, ``epochs.csv``,
``steps.csv``), ``scaling.csv`` and ``scaling.json`` (one record per run), and
``scaling_auc.png`` (AUC vs batch size per method: last epoch, best-validation epoch, and
minus the base batch of the same seed; min/max over seeds as error bars) when matplotlib is
installed. The table (batch x method) is printed last; its "minus base batch" columns give
each seed's own difference to its base-batch run (the goal is judged in every seed), then
their mean and min..max. All runs share one data cache
(``--cache-dir``). ``--combine DIR ...`` merges earlier studies' outputs without training;
``--label`` names a recipe variant so it can sit beside the paper's. The full study, with
its commands and results, is ``docs/scaling.md``.

Quick run (about 2-4 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/scaling.py --data synthetic:100000 \\
        --synthetic-scale 0.01 --synthetic-max-cardinality 5000 --hidden 64,64 \\
        --batch-sizes 512,2048,8192 --base-batch-size 512 --epochs 2 --base-lr-embed 1e-2 \\
        --out benchmarks/results/scaling-quick

Full run (the paper's sweep 1K..128K, a few hundred steps per epoch at 128K; hours on
CPU, use a GPU box)::

    .venv/bin/python benchmarks/scaling.py --model deepfm --data synthetic:30M \\
        --batch-sizes 1024,2048,4096,8192,16384,32768,65536,131072 --epochs 2 --seeds 0,1,2
    # the same with a small init, where the clip is expected to bind more often:
    .venv/bin/python benchmarks/scaling.py --init-std 1e-4 --out benchmarks/results/scaling-init1e-4

Real data (Criteo Kaggle ``train.txt`` / Avazu ``train``, see the README's data kinds; the
cache is built once and shared by every run)::

    .venv/bin/python benchmarks/scaling.py --data criteo:/data/criteo/train.txt --epochs 1 \\
        --cache-dir data_cache --out benchmarks/results/scaling-criteo
    .venv/bin/python benchmarks/scaling.py --data avazu:/data/avazu/train --test-fraction 0.2 \\
        --out benchmarks/results/scaling-avazu
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when imported by path
from common import RESULTS, write_csv, write_json, write_png  # noqa: E402

from torchrec_cowclip import Helen  # noqa: E402
from torchrec_cowclip.train import TrainConfig, train  # noqa: E402
from torchrec_cowclip.train.scaling import (  # noqa: E402
    BASELINES,
    SCALINGS,
    Recipe,
    get_recipe,
    scale_hyperparameters,
)

METHODS = ("cowclip", "sqrt", "linear", "none")  # the default --methods
HELEN_METHODS = ("helen", "helen+cowclip")
ALL_METHODS = ("adam",) + METHODS + HELEN_METHODS
HELEN_FIELDS = ("helen_rho", "helen_bound")
HELEN_RECIPE = "fixed-l2"  # the recipe of helen+cowclip
DEFAULT_BATCHES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
BUCKET_NOTE = (
    "clip counts per id-frequency bucket: only with --row-clip-stats "
    "(clip_per_id_frequency_bucket in scaling.json); per table always (clipped_per_table)"
)


def _profile(data: str) -> str:
    return "avazu" if data.startswith("avazu:") else "criteo"


def method_recipe(
    method: str, recipe: str = "paper", rules: Optional[Dict[str, Any]] = None
) -> Recipe:
    """The scaling rule of ``method``: a trainer recipe (``cowclip``: ``recipe`` changed by
    ``rules``; ``helen+cowclip``: :data:`HELEN_RECIPE`) or one of the baselines
    (``sqrt``, ``linear``, ``none``; ``adam`` and ``helen`` are ``none``'s)."""
    if method not in ALL_METHODS:
        raise ValueError(f"method must be one of {', '.join(ALL_METHODS)}, got {method!r}")
    if method in ("cowclip", "helen+cowclip"):
        rec = get_recipe(HELEN_RECIPE if method == "helen+cowclip" else recipe)
        return replace(rec, **(rules or {}))
    return BASELINES["none" if method in ("adam", "helen") else method]


def method_hyperparameters(
    method: str,
    batch_size: int,
    *,
    base_batch_size: int = 1024,
    data: str = "synthetic:1",
    base_lr: Optional[float] = None,
    base_lr_embed: Optional[float] = None,
    base_l2: Optional[float] = None,
    recipe: str = "paper",
    rules: Optional[Dict[str, str]] = None,
    clip_r: Optional[float] = None,
    clip_zeta: Optional[float] = None,
    helen_rho: float = Helen.rho,
    helen_bound: float = Helen.bound,
) -> Dict[str, Any]:
    """The TrainConfig fields (lr, lr_embed, l2, cowclip, ...) of one method at one batch size.

    The values are :func:`scale_hyperparameters`'s under :func:`method_recipe`, from the
    trainer's profile at the base batch unless ``base_lr`` / ``base_lr_embed`` / ``base_l2``
    replace it, so ``cowclip`` yields exactly the trainer's values for ``recipe``. ``rules``
    (``dense_lr_scaling``, ``embedding_lr_scaling``, ``l2_scaling`` -> fixed/sqrt/linear;
    ``count_lr_power`` -> a float) and ``clip_r`` / ``clip_zeta`` change the recipe for the
    cowclip methods only (``cowclip``, ``helen+cowclip``); the helen methods add
    ``helen_rho`` / ``helen_bound``.
    """
    clipped = method in ("cowclip", "helen+cowclip")
    rec = method_recipe(method, recipe, rules if clipped else None)
    hp = scale_hyperparameters(
        batch_size,
        dataset=_profile(data),
        base_batch_size=base_batch_size,
        recipe=rec,
        base_dense_lr=base_lr,
        base_embedding_lr=base_lr_embed,
        base_l2=base_l2,
    )
    fields: Dict[str, Any] = {"cowclip": hp.cowclip}
    if clipped:
        fields["recipe"] = HELEN_RECIPE if method == "helen+cowclip" else recipe
    fields.update(lr=hp.dense_lr, lr_embed=hp.embedding_lr, l2=hp.l2)
    if clipped:
        fields["count_lr_power"] = hp.count_lr_power
        for name, value in (("clip_r", clip_r), ("clip_zeta", clip_zeta)):
            if value is not None:
                fields[name] = value
    if method in HELEN_METHODS:
        fields.update(helen_rho=helen_rho, helen_bound=helen_bound)
    return fields


def check_trainer_fields(
    methods: Sequence[str], config_fields: Optional[Sequence[str]] = None
) -> None:
    """Refuses the helen methods, before any run, when the trainer's ``TrainConfig`` (or
    ``config_fields``) has no ``helen_rho`` / ``helen_bound``."""
    have = {f.name for f in fields(TrainConfig)} if config_fields is None else set(config_fields)
    wanted = [m for m in methods if m in HELEN_METHODS]
    missing = [name for name in HELEN_FIELDS if name not in have]
    if wanted and missing:
        raise ValueError(
            f"--methods {','.join(wanted)}: the installed trainer's TrainConfig "
            f"(torchrec_cowclip/train/config.py) has no {', '.join(missing)}"
        )


def _val_selected(m: Dict[str, Any]) -> Dict[str, Any]:
    """Test AUC / logloss at the epoch of best validation AUC (None without a val split)."""
    val = list(m.get("epoch_val_auc") or [])
    if not val or len(val) != len(m["epoch_auc"]):
        return {"val_epoch": None, "val_auc": None, "val_sel_auc": None, "val_sel_logloss": None}
    best = max(range(len(val)), key=val.__getitem__)
    return {
        "val_epoch": best + 1,
        "val_auc": val[best],
        "val_sel_auc": m["epoch_auc"][best],
        "val_sel_logloss": m["epoch_logloss"][best],
    }


def _ratio(clipped: Optional[int], updated: Optional[int]) -> Optional[float]:
    if clipped is None or not updated:
        return None
    return clipped / updated


def _read_epochs_csv(path: Path) -> List[Dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _int_or_none(text: Optional[str]) -> Optional[int]:
    if text in (None, "", "None"):
        return None
    return int(float(text))


def run_one(
    *,
    method: str,
    batch_size: int,
    seed: int,
    model: str,
    data: str,
    epochs: int,
    out_root: Path,
    cache_dir: str,
    base_batch_size: int = 1024,
    init_std: float = 1e-2,
    base_lr: Optional[float] = None,
    base_lr_embed: Optional[float] = None,
    base_l2: Optional[float] = None,
    extra: Optional[Dict[str, Any]] = None,
    method_options: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Trains one (method, batch, seed) run in a fresh directory and returns its record.

    ``method_options`` go to :func:`method_hyperparameters` (recipe, rules, clip_r, clip_zeta);
    its ``label`` (if any) names the cowclip method in the record and tables instead of
    ``cowclip``, so that a recipe variant can sit beside the paper's in one table.
    """
    check_trainer_fields([method])
    method_options = dict(method_options or {})
    label = method_options.pop("label", None)
    hp = method_hyperparameters(
        method,
        batch_size,
        base_batch_size=base_batch_size,
        data=data,
        base_lr=base_lr,
        base_lr_embed=base_lr_embed,
        base_l2=base_l2,
        **method_options,
    )
    name = label if (label and method == "cowclip") else method
    out = out_root / "runs" / f"{model}-{name}-b{batch_size}-s{seed}"
    if out.exists():
        shutil.rmtree(out)  # epochs.csv appends: start clean
    # Options given for the whole study (extra: warm-up, DNN, data) apply to every method.
    cfg = TrainConfig(
        model=model,
        data=data,
        out=str(out),
        cache_dir=cache_dir,
        batch_size=batch_size,
        base_batch_size=base_batch_size,
        epochs=epochs,
        init_std=init_std,
        seed=seed,
        progress=False,
        **{**hp, **(extra or {})},
    )
    t0 = time.perf_counter()
    m = train(cfg)
    wall = time.perf_counter() - t0
    epoch_rows = _read_epochs_csv(out / "epochs.csv")
    first = epoch_rows[0] if epoch_rows else {}
    upd1, clip1 = _int_or_none(first.get("rows_updated")), _int_or_none(first.get("rows_clipped"))
    h = m["hyperparameters"]
    # The trainer times its training steps only (no evaluation, no data loading set-up).
    train_s = m["train_samples"] / m["train_samples_per_s"] if m["train_samples_per_s"] else None
    return {
        "model": model,
        "method": name,
        "batch_size": batch_size,
        "seed": seed,
        "data": data,
        "epochs": m["epochs"],
        "steps": m["steps"],
        "steps_per_epoch": m["steps"] // max(m["epochs"], 1),
        "auc": m["auc"],
        "logloss": m["logloss"],
        "epoch_auc": list(m["epoch_auc"]),
        "epoch_logloss": list(m["epoch_logloss"]),
        **_val_selected(m),
        "wall_s": wall,
        "train_samples_per_s": m["train_samples_per_s"],
        "train_s": train_s,
        "step_ms": 1e3 * train_s / m["steps"] if (train_s is not None and m["steps"]) else None,
        "rows_updated": m["rows_updated"],
        "rows_clipped": m["rows_clipped"],
        "clipped_frac": _ratio(m["rows_clipped"], m["rows_updated"]),
        "epoch1_rows_updated": upd1,
        "epoch1_rows_clipped": clip1,
        "epoch1_clipped_frac": _ratio(clip1, upd1),
        "clipped_per_table": m["clipped_per_table"],
        "clip_per_id_frequency_bucket": m.get("clip_by_frequency"),
        "dense_lr": h["dense_lr"],
        "embedding_lr": h["embedding_lr"],
        "l2": h["l2"],
        "cowclip": h["cowclip"],
        "init_std": init_std,
        "base_batch_size": base_batch_size,
        "warmup_epochs": h["warmup_epochs"],
        "recipe": h.get("recipe"),
        "clip_r": h["clip_r"],
        "clip_zeta": h["clip_zeta"],
        "count_lr_power": h.get("count_lr_power", 0.0),
        **{name: h.get(name) for name in HELEN_FIELDS},
        "out": str(out),
    }


def run_study(
    *,
    model: str = "deepfm",
    data: str,
    batch_sizes: Sequence[int],
    methods: Sequence[str] = METHODS,
    seeds: Sequence[int] = (0,),
    epochs: int = 2,
    out_root: Path,
    cache_dir: Optional[str] = None,
    base_batch_size: int = 1024,
    verbose: bool = True,
    equal_steps: bool = False,
    **run_options: Any,
) -> List[Dict[str, Any]]:
    """Every (batch, method, seed) run; returns the records in that order. ``run_options``
    (``init_std``, ``base_lr``, ``base_lr_embed``, ``base_l2``, ``extra``,
    ``method_options``) go to every :func:`run_one`.

    ``equal_steps``: batch ``b`` trains ``epochs * b / base_batch_size`` epochs (rounded),
    i.e. as many steps as the base batch takes in ``epochs``; with the trainer's
    ``early_stop_patience`` (in ``extra``) a run stops once validation AUC has not improved
    for that many epochs, which selects the same epoch as the full run would.
    """
    check_trainer_fields(methods)
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    cache_dir = cache_dir or str(out_root / "cache")
    records = []
    total = len(batch_sizes) * len(methods) * len(seeds)
    fixed = dict(model=model, data=data, out_root=out_root, cache_dir=cache_dir)
    fixed.update(base_batch_size=base_batch_size, **run_options)
    for b in batch_sizes:
        for method in methods:
            for seed in seeds:
                run_epochs = max(1, round(epochs * b / base_batch_size)) if equal_steps else epochs
                rec = run_one(method=method, batch_size=b, seed=seed, epochs=run_epochs, **fixed)
                records.append(rec)
                if verbose:
                    print(
                        f"[{len(records)}/{total}] batch {b} {method} seed {seed}: "
                        f"AUC {rec['auc']:.4f} logloss {rec['logloss']:.4f} "
                        f"clipped {_pct(rec['clipped_frac'])} {rec['wall_s']:.1f}s "
                        f"({_ms(rec.get('step_ms'))} ms/step)",
                        file=sys.stderr,
                        flush=True,
                    )
    return records


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _method_rank(method: str) -> tuple:
    """The methods in their usual order, then labelled variants by name."""
    return (ALL_METHODS.index(method), "") if method in ALL_METHODS else (len(ALL_METHODS), method)


def _headline_auc(r: Dict[str, Any]) -> float:
    """The val-best epoch's test AUC when there is a validation split, else the last epoch's."""
    return r["val_sel_auc"] if r.get("val_sel_auc") is not None else r["auc"]


def summarize(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (batch, method): mean over seeds, the seed spread of AUC, and the AUC
    minus the smallest batch's of the same seed ("delta": the method's own run there, else
    cowclip's, which has every method's hyperparameters at the base batch). Each seed is
    its own synthetic data set, so the paired delta is far less noisy than the raw AUC."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["batch_size"], r["method"]), []).append(r)
    smallest = min((r["batch_size"] for r in records), default=0)
    base: Dict[str, Dict[int, float]] = {}
    for r in records:
        if r["batch_size"] == smallest:
            base.setdefault(r["method"], {})[r["seed"]] = _headline_auc(r)
    rows = []
    for (b, method), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], _method_rank(kv[0][1]))
    ):
        aucs = [r["auc"] for r in rs]
        sel = [r["val_sel_auc"] for r in rs if r.get("val_sel_auc") is not None]
        sel_ll = [r["val_sel_logloss"] for r in rs if r.get("val_sel_logloss") is not None]
        upd = sum(r["rows_updated"] or 0 for r in rs)
        clip = sum(r["rows_clipped"] or 0 for r in rs)
        upd1 = sum(r["epoch1_rows_updated"] or 0 for r in rs)
        clip1 = sum(r["epoch1_rows_clipped"] or 0 for r in rs)
        ref = base.get(method) or base.get("cowclip") or {}
        by_seed = sorted(
            (r["seed"], _headline_auc(r) - ref[r["seed"]]) for r in rs if r["seed"] in ref
        )
        deltas = [d for _, d in by_seed]
        step_ms = [r["step_ms"] for r in rs if r.get("step_ms") is not None]
        rows.append(
            {
                "batch_size": b,
                "method": method,
                "seeds": len(rs),
                "auc_mean": statistics.fmean(aucs),
                "auc_min": min(aucs),
                "auc_max": max(aucs),
                "auc_std": statistics.stdev(aucs) if len(aucs) > 1 else 0.0,
                "val_sel_auc_mean": statistics.fmean(sel) if len(sel) == len(rs) else None,
                "val_sel_auc_min": min(sel) if len(sel) == len(rs) else None,
                "val_sel_auc_max": max(sel) if len(sel) == len(rs) else None,
                "val_sel_logloss_mean": statistics.fmean(sel_ll)
                if len(sel_ll) == len(rs)
                else None,
                "val_epochs": [r.get("val_epoch") for r in rs],
                "delta_mean": statistics.fmean(deltas) if deltas else None,
                "delta_min": min(deltas) if deltas else None,
                "delta_max": max(deltas) if deltas else None,
                "delta_by_seed": [[seed, d] for seed, d in by_seed],
                "logloss_mean": statistics.fmean(r["logloss"] for r in rs),
                "steps": rs[0]["steps"],
                "clipped_frac": _ratio(clip, upd) if rs[0]["cowclip"] else None,
                "epoch1_clipped_frac": _ratio(clip1, upd1) if rs[0]["cowclip"] else None,
                "wall_s_mean": statistics.fmean(r["wall_s"] for r in rs),
                "step_ms_mean": statistics.fmean(step_ms) if len(step_ms) == len(rs) else None,
            }
        )
    return rows


def _f4(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def _signed(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.4f}"


def _per_seed(r: Dict[str, Any]) -> str:
    return " ".join(f"s{seed} {d:+.4f}" for seed, d in r.get("delta_by_seed") or []) or "-"


def format_table(summary: List[Dict[str, Any]]) -> str:
    """The summary as a Markdown table: test AUC / logloss at the last epoch and, with a
    validation split, at the epoch of best validation AUC ("val-best"), means over seeds;
    the headline AUC minus the base batch's of the same seed, seed by seed, then mean and
    min..max; the training time per step."""
    head = (
        "| batch | method | seeds | AUC last epoch | min..max | logloss last | AUC val-best "
        "epoch | min..max | logloss val-best | val-best epochs | steps | clipped % (all) | "
        "clipped % (epoch 1) | minus base batch, per seed | mean | min..max | ms/step | wall s |"
    )
    lines = [head, "|" + "---|" * 19]
    for r in summary:
        lines.append(
            f"| {r['batch_size']} | {r['method']} | {r['seeds']} | {r['auc_mean']:.4f} | "
            f"{r['auc_min']:.4f}..{r['auc_max']:.4f} | {r['logloss_mean']:.4f} | "
            f"{_f4(r.get('val_sel_auc_mean'))} | {_f4(r.get('val_sel_auc_min'))}.."
            f"{_f4(r.get('val_sel_auc_max'))} | {_f4(r.get('val_sel_logloss_mean'))} | "
            f"{','.join(str(e) for e in r.get('val_epochs', []) if e is not None) or '-'} | "
            f"{r['steps']} | "
            f"{_pct(r['clipped_frac']) if r['clipped_frac'] is not None else '- (no clip)'} | "
            f"{_pct(r['epoch1_clipped_frac']) if r['epoch1_clipped_frac'] is not None else '-'} | "
            f"{_per_seed(r)} | {_signed(r.get('delta_mean'))} | "
            f"{_signed(r.get('delta_min'))}..{_signed(r.get('delta_max'))} | "
            f"{_ms(r.get('step_ms_mean'))} | {r['wall_s_mean']:.1f} |"
        )
    return "\n".join(lines)


CSV_FIELDS = (
    "model",
    "method",
    "batch_size",
    "seed",
    "data",
    "epochs",
    "steps",
    "steps_per_epoch",
    "auc",
    "logloss",
    "val_epoch",
    "val_auc",
    "val_sel_auc",
    "val_sel_logloss",
    "epoch_auc",
    "epoch_logloss",
    "wall_s",
    "train_samples_per_s",
    "train_s",
    "step_ms",
    "rows_updated",
    "rows_clipped",
    "clipped_frac",
    "epoch1_rows_updated",
    "epoch1_rows_clipped",
    "epoch1_clipped_frac",
    "dense_lr",
    "embedding_lr",
    "l2",
    "init_std",
    "base_batch_size",
    "warmup_epochs",
    "recipe",
    "clip_r",
    "clip_zeta",
    "helen_rho",
    "helen_bound",
    "out",
)


def write_outputs(
    records: List[Dict[str, Any]], out_root: Path, meta: Dict[str, Any]
) -> Dict[str, Path]:
    """scaling.csv (one row per run), scaling.json (runs, summary, notes) and the plot."""
    out_root = Path(out_root)
    paths = {"csv": out_root / "scaling.csv", "json": out_root / "scaling.json"}
    rows = [
        {
            **r,
            "epoch_auc": ";".join(f"{x:.6f}" for x in r["epoch_auc"]),
            "epoch_logloss": ";".join(f"{x:.6f}" for x in r["epoch_logloss"]),
        }
        for r in records
    ]
    write_csv(paths["csv"], rows, CSV_FIELDS, extrasaction="ignore")
    summary = summarize(records)
    write_json(
        paths["json"], {"meta": meta, "notes": [BUCKET_NOTE], "summary": summary, "runs": records}
    )
    plot = plot_auc(summary, out_root / "scaling_auc.png", title=meta.get("title", ""))
    if plot is not None:
        paths["plot"] = plot
    return paths


def plot_auc(summary: List[Dict[str, Any]], path: Path, title: str = "") -> Optional[Path]:
    """AUC vs batch size per method, min..max over seeds as error bars; None without matplotlib.

    A method with no run at the smallest batch starts from cowclip's point there (the
    study runs only cowclip at the base batch, where all methods share hyperparameters).
    """
    return path if write_png(path, lambda plt: _draw_auc(plt, summary, title), dpi=90) else None


def _draw_auc(plt: Any, summary: List[Dict[str, Any]], title: str) -> Any:
    # A second panel for the val-best epoch when every run has a validation split.
    panels = [("auc", "test AUC, last epoch")]
    val = bool(summary) and all(r.get("val_sel_auc_mean") is not None for r in summary)
    if val:
        panels.append(("val_sel_auc", "test AUC, best-validation epoch"))
    if summary and all(r.get("delta_mean") is not None for r in summary):
        panels.append(
            (
                "delta",
                ("best-validation-epoch" if val else "last-epoch")
                + " AUC\nminus base batch, same seed",
            )
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        smallest = min(r["batch_size"] for r in summary)
        shared = [r for r in summary if r["method"] == "cowclip" and r["batch_size"] == smallest]
        for method in sorted({r["method"] for r in summary}, key=_method_rank):
            rows = [r for r in summary if r["method"] == method]
            # Every method has the base batch's hyperparameters at the base batch, so a study
            # that ran only cowclip there draws each line from that one point.
            if shared and rows[0]["batch_size"] != smallest:
                rows = shared + rows
            xs = [r["batch_size"] for r in rows]
            ys = [r[f"{key}_mean"] for r in rows]
            err = [
                [y - r[f"{key}_min"] for y, r in zip(ys, rows)],
                [r[f"{key}_max"] - y for y, r in zip(ys, rows)],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
        if key == "delta":
            ax.axhline(0.0, color="grey", linewidth=0.8)
            # Zoom on the region where methods hold AUC; a diverging method would otherwise
            # flatten every other line (it stays in the table).
            floor = -0.015
            if min(r["delta_min"] for r in summary) < floor:
                top = max(r["delta_max"] for r in summary)
                ax.set_ylim(floor, max(top, 0.0) + 0.002)
                ax.text(
                    0.98,
                    0.97,
                    f"zoomed: values below {floor} off scale",
                    fontsize=7,
                    ha="right",
                    va="top",
                    transform=ax.transAxes,
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(label, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig


def _int_list(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="deepfm", choices=("deepfm", "dcn", "dcnv2", "wdl"))
    p.add_argument(
        "--data",
        default="synthetic:30M",
        help="a --data spec of the trainer (default synthetic:30M: about 200 steps "
        "per epoch at batch 131072); criteo:PATH, avazu:PATH, ... for real data",
    )
    p.add_argument("--batch-sizes", type=_int_list, default=list(DEFAULT_BATCHES))
    p.add_argument("--base-batch-size", type=int, default=1024)
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {','.join(ALL_METHODS)} (default {','.join(METHODS)})",
    )
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0: one seed)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument(
        "--equal-steps",
        action="store_true",
        help="train batch b for EPOCHS * b / base epochs: the base batch's number "
        "of steps (use with --early-stop-patience to stop overfit runs early)",
    )
    p.add_argument(
        "--early-stop-patience",
        type=int,
        default=0,
        help="the trainer's: stop after this many epochs without a better "
        "validation AUC (needs --val-fraction; 0: never)",
    )
    p.add_argument("--init-std", type=float, default=1e-2)
    p.add_argument("--base-lr", type=float, default=None, help="dense lr at the base batch")
    p.add_argument(
        "--base-lr-embed", type=float, default=None, help="embedding lr at the base batch"
    )
    p.add_argument("--base-l2", type=float, default=None, help="L2 lambda at the base batch")
    p.add_argument(
        "--warmup-epochs",
        type=float,
        default=None,
        help="dense lr warm-up of every method (default: the recipe's, 1 epoch)",
    )
    p.add_argument("--recipe", default="paper", help="trainer recipe of the cowclip method")
    for flag in ("--dense-lr-scaling", "--embed-lr-scaling", "--l2-scaling"):
        p.add_argument(
            flag,
            choices=tuple(SCALINGS),
            default=None,
            help="cowclip method only: replaces the recipe's rule",
        )
    p.add_argument("--clip-r", type=float, default=None, help="cowclip method only: CowClip r")
    p.add_argument(
        "--count-lr-power",
        type=float,
        default=None,
        help="cowclip method only: per-id-frequency embedding lr, "
        "lr * min(count in batch, batch/base) ** POWER (replaces the recipe's)",
    )
    p.add_argument(
        "--label",
        default=None,
        help="name of the cowclip method in the outputs (default cowclip), e.g. "
        "cowclip+RECIPE to put a recipe beside the paper's with --combine",
    )
    p.add_argument(
        "--clip-zeta", type=float, default=None, help="cowclip method only: CowClip zeta"
    )
    p.add_argument("--hidden", default=None, help="DNN sizes, e.g. 400,400,400 (trainer default)")
    p.add_argument("--synthetic-scale", type=float, default=None)
    p.add_argument("--synthetic-max-cardinality", type=int, default=None)
    p.add_argument("--test-fraction", type=float, default=0.1)
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="validation split carved from the training rows; the table then also "
        "shows the test AUC at the best validation epoch",
    )
    p.add_argument("--eval-batch-size", type=int, default=65536)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--row-clip-stats",
        action="store_true",
        help="per run, clip rates by id frequency (the trainer's --row-clip-stats)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=str(RESULTS / "scaling"))
    p.add_argument("--cache-dir", default=None, help="shared data cache (default OUT/cache)")
    p.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="DIR",
        help="no training: merge the scaling.json of these earlier --out folders "
        "into --out (table, CSV, JSON, plot)",
    )
    p.add_argument("--title", default="", help="--combine: the plot's title")
    p.add_argument(
        "--min-auc",
        type=float,
        default=None,
        help="exit 1 if a run's test AUC is not above this (a study that must learn)",
    )
    for name, default in zip(HELEN_FIELDS, (Helen.rho, Helen.bound)):
        flag = "--" + name.replace("_", "-")
        p.add_argument(
            flag, type=float, default=default, help=f"helen methods: the trainer's {name}"
        )
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in ALL_METHODS]
    if bad:
        p.error(f"--methods: unknown {bad}; choose from {', '.join(ALL_METHODS)}")
    try:
        check_trainer_fields(args.methods)
    except ValueError as e:
        p.error(str(e))
    args.seeds = _int_list(args.seeds)
    return args


def combine(dirs: Sequence[str], out_root: Path, title: str = "") -> List[Dict[str, Any]]:
    """Merges the runs of earlier studies (their ``scaling.json``) into one set of outputs
    under ``out_root``, without training: e.g. the base batch and the large batches run as
    two invocations, or seeds run one after another."""
    records: List[Dict[str, Any]] = []
    metas = []
    for d in dirs:
        data = json.loads((Path(d) / "scaling.json").read_text())
        records += data["runs"]
        metas.append(data["meta"])
    out_root.mkdir(parents=True, exist_ok=True)
    meta = {
        "combined_from": list(dirs),
        "title": title or metas[0].get("title", ""),
        "total_wall_s": sum(m.get("total_wall_s", 0.0) for m in metas),
    }
    write_outputs(records, out_root, meta)
    return records


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.combine:
        records = combine(args.combine, Path(args.out), args.title)
        print(format_table(summarize(records)))
        return 0
    extra: Dict[str, Any] = {
        "test_fraction": args.test_fraction,
        "val_fraction": args.val_fraction,
        "eval_batch_size": args.eval_batch_size,
        "threads": args.threads,
        "device": args.device,
        "row_clip_stats": args.row_clip_stats,
        "early_stop_patience": args.early_stop_patience,
    }
    if args.warmup_epochs is not None:
        extra["warmup_epochs"] = args.warmup_epochs
    if args.hidden:
        extra["hidden"] = tuple(_int_list(args.hidden))
    rules = {
        name: value
        for name, value in (
            ("dense_lr_scaling", args.dense_lr_scaling),
            ("embedding_lr_scaling", args.embed_lr_scaling),
            ("l2_scaling", args.l2_scaling),
            ("count_lr_power", args.count_lr_power),
        )
        if value is not None
    }
    method_options = {
        "recipe": args.recipe,
        "rules": rules,
        "clip_r": args.clip_r,
        "clip_zeta": args.clip_zeta,
        "label": args.label,
        "helen_rho": args.helen_rho,
        "helen_bound": args.helen_bound,
    }
    if args.synthetic_scale is not None:
        extra["synthetic_scale"] = args.synthetic_scale
    if args.synthetic_max_cardinality is not None:
        extra["synthetic_max_cardinality"] = args.synthetic_max_cardinality
    out_root = Path(args.out)
    t0 = time.perf_counter()
    # The study's own flags pass through under their names.
    study_flags = (
        "model",
        "data",
        "batch_sizes",
        "methods",
        "seeds",
        "epochs",
        "cache_dir",
        "base_batch_size",
        "init_std",
        "base_lr",
        "base_lr_embed",
        "base_l2",
        "equal_steps",
    )
    records = run_study(
        **{name: getattr(args, name) for name in study_flags},
        out_root=out_root,
        extra=extra,
        method_options=method_options,
    )
    meta = {
        k: (v if isinstance(v, (int, float, str, list, type(None))) else str(v))
        for k, v in vars(args).items()
    }
    meta["total_wall_s"] = time.perf_counter() - t0
    changed = ", ".join(
        f"{k}={v}"
        for k, v in {**rules, "clip_r": args.clip_r, "clip_zeta": args.clip_zeta}.items()
        if v is not None
    )
    meta["title"] = (
        f"{args.model} on {args.data}, {args.epochs} epoch(s), "
        f"init_std {args.init_std:g}, seeds {args.seeds}, cowclip = recipe "
        f"{args.recipe}{' with ' + changed if changed else ''}"
    )
    paths = write_outputs(records, out_root, meta)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    print(f"note: {BUCKET_NOTE}")
    print(
        f"\n{meta['title']} (base batch {args.base_batch_size}; clipped % = rows clipped / "
        f"rows updated, CowClip runs only)"
    )
    print(format_table(summarize(records)))
    if args.min_auc is not None:
        short = auc_shortfalls(records, args.min_auc)
        for line in short:
            print(line)
        return 1 if short else 0
    return 0


def auc_shortfalls(records: Sequence[Mapping[str, Any]], min_auc: float) -> List[str]:
    """One line for each run whose test AUC is not above ``min_auc`` (or not finite).

    Example::

        >>> auc_shortfalls([{"batch_size": 512, "method": "cowclip", "seed": 0, "auc": 0.5}], 0.55)
        ['batch 512 cowclip seed 0: AUC 0.5000 is not above --min-auc 0.55']
    """
    return [
        f"batch {r['batch_size']} {r['method']} seed {r['seed']}: AUC {r['auc']:.4f} "
        f"is not above --min-auc {min_auc:g}"
        for r in records
        if not (math.isfinite(r["auc"]) and r["auc"] > min_auc)
    ]


if __name__ == "__main__":
    raise SystemExit(main())

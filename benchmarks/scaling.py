"""Large-batch scaling study: does CowClip + the paper's scaling rule keep test AUC as the
batch grows, compared with plain large-batch baselines, and does the clip ever bind?

For one model (``--model deepfm|dcn|dcnv2|wdl``) and one data set (``--data``), trains at
every batch size of ``--batch-sizes`` for the same number of ``--epochs``, with each method
of ``--methods`` and each seed of ``--seeds``:

- ``cowclip``: CowClip on (r, zeta from the trainer), the spec's scaling rule (the trainer's
  defaults): embedding lr unchanged, dense lr * sqrt(s), L2 lambda * s, s = batch / base;
- ``sqrt``: no clipping, embedding AND dense lr * sqrt(s), L2 lambda * s;
- ``linear``: no clipping, embedding AND dense lr * s, L2 lambda * s;
- ``none``: no clipping, no scaling (the base batch's lrs and L2 at every batch).

All methods keep the trainer's dense warm-up (``--warmup-epochs``, default 1 epoch) and
the same initialisation (``--init-std``, default 1e-2; the spec's "When does the clip
actually bind?" predicts more clipping with a small init such as 1e-4). The base values
(at ``--base-batch-size``) are the trainer's profile (Criteo's, or Avazu's for
``avazu:`` data) unless ``--base-lr`` / ``--base-lr-embed`` / ``--base-l2`` replace them.

Per run it records the final and per-epoch test AUC / logloss, steps, wall time, train
throughput, and how often the clip bound: overall (rows clipped / rows updated, all
epochs) and early (the same ratio over the first epoch only, from the cumulative
counters the trainer writes to each run's ``epochs.csv``). Counts per id-frequency
bucket are NOT available: the trainer only counts updated/clipped rows per table, so the
output reports per-table counts and says so; nothing here estimates buckets.

Output (under ``--out``, default ``benchmarks/results/scaling``): one trainer run
directory per (method, batch, seed) in ``runs/`` (``metrics.json``, ``epochs.csv``,
``steps.csv``), ``scaling.csv`` and ``scaling.json`` (one record per run), and
``scaling_auc.png`` (AUC vs batch size per method, min/max over seeds as error bars) when
matplotlib is installed. The table (batch x method) is printed last. All runs share one
data cache (``--cache-dir``).

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
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from torchrec_cowclip.train import TrainConfig, train  # noqa: E402
from torchrec_cowclip.train.scaling import scale_hyperparameters  # noqa: E402

METHODS = ("cowclip", "sqrt", "linear", "none")
DEFAULT_BATCHES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
BUCKET_NOTE = (
    "clip counts per id-frequency bucket are not available: the trainer counts updated and "
    "clipped rows per table only (clipped_per_table in scaling.json); no bucket figures are "
    "reported or estimated"
)


def _profile(data: str) -> str:
    return "avazu" if data.startswith("avazu:") else "criteo"


def method_hyperparameters(
    method: str,
    batch_size: int,
    *,
    base_batch_size: int = 1024,
    data: str = "synthetic:1",
    base_lr: Optional[float] = None,
    base_lr_embed: Optional[float] = None,
    base_l2: Optional[float] = None,
) -> Dict[str, Any]:
    """The TrainConfig fields (lr, lr_embed, l2, cowclip) of one method at one batch size.

    Base values default to the trainer's profile at the base batch
    (:func:`scale_hyperparameters`); ``cowclip`` yields exactly the trainer's defaults when
    no base value is overridden.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    base = scale_hyperparameters(base_batch_size, dataset=_profile(data),
                                 base_batch_size=base_batch_size)
    lr0 = base.dense_lr if base_lr is None else base_lr
    emb0 = base.embedding_lr if base_lr_embed is None else base_lr_embed
    l20 = base.l2 if base_l2 is None else base_l2
    s = batch_size / base_batch_size
    if method == "cowclip":
        return {"cowclip": True, "lr": lr0 * math.sqrt(s), "lr_embed": emb0, "l2": l20 * s}
    if method == "sqrt":
        return {"cowclip": False, "lr": lr0 * math.sqrt(s), "lr_embed": emb0 * math.sqrt(s),
                "l2": l20 * s}
    if method == "linear":
        return {"cowclip": False, "lr": lr0 * s, "lr_embed": emb0 * s, "l2": l20 * s}
    return {"cowclip": False, "lr": lr0, "lr_embed": emb0, "l2": l20}


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
) -> Dict[str, Any]:
    """Trains one (method, batch, seed) run in a fresh directory and returns its record."""
    hp = method_hyperparameters(method, batch_size, base_batch_size=base_batch_size, data=data,
                                base_lr=base_lr, base_lr_embed=base_lr_embed, base_l2=base_l2)
    out = out_root / "runs" / f"{model}-{method}-b{batch_size}-s{seed}"
    if out.exists():
        shutil.rmtree(out)  # epochs.csv appends: start clean
    cfg = TrainConfig(
        model=model, data=data, out=str(out), cache_dir=cache_dir, batch_size=batch_size,
        base_batch_size=base_batch_size, epochs=epochs, init_std=init_std, seed=seed,
        progress=False, **hp, **(extra or {}),
    )
    t0 = time.perf_counter()
    m = train(cfg)
    wall = time.perf_counter() - t0
    epoch_rows = _read_epochs_csv(out / "epochs.csv")
    first = epoch_rows[0] if epoch_rows else {}
    upd1, clip1 = _int_or_none(first.get("rows_updated")), _int_or_none(first.get("rows_clipped"))
    h = m["hyperparameters"]
    return {
        "model": model, "method": method, "batch_size": batch_size, "seed": seed,
        "data": data, "epochs": m["epochs"], "steps": m["steps"],
        "steps_per_epoch": m["steps"] // max(m["epochs"], 1),
        "auc": m["auc"], "logloss": m["logloss"],
        "epoch_auc": list(m["epoch_auc"]), "epoch_logloss": list(m["epoch_logloss"]),
        "wall_s": wall, "train_samples_per_s": m["train_samples_per_s"],
        "rows_updated": m["rows_updated"], "rows_clipped": m["rows_clipped"],
        "clipped_frac": _ratio(m["rows_clipped"], m["rows_updated"]),
        "epoch1_rows_updated": upd1, "epoch1_rows_clipped": clip1,
        "epoch1_clipped_frac": _ratio(clip1, upd1),
        "clipped_per_table": m["clipped_per_table"],
        "clip_per_id_frequency_bucket": None,
        "dense_lr": h["dense_lr"], "embedding_lr": h["embedding_lr"], "l2": h["l2"],
        "cowclip": h["cowclip"], "init_std": init_std, "base_batch_size": base_batch_size,
        "warmup_epochs": h["warmup_epochs"], "out": str(out),
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
    init_std: float = 1e-2,
    base_lr: Optional[float] = None,
    base_lr_embed: Optional[float] = None,
    base_l2: Optional[float] = None,
    extra: Optional[Dict[str, Any]] = None,
    verbose: bool = True,
) -> List[Dict[str, Any]]:
    """Every (batch, method, seed) run; returns the records in that order."""
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    cache_dir = cache_dir or str(out_root / "cache")
    records = []
    total = len(batch_sizes) * len(methods) * len(seeds)
    for b in batch_sizes:
        for method in methods:
            for seed in seeds:
                rec = run_one(method=method, batch_size=b, seed=seed, model=model, data=data,
                              epochs=epochs, out_root=out_root, cache_dir=cache_dir,
                              base_batch_size=base_batch_size, init_std=init_std,
                              base_lr=base_lr, base_lr_embed=base_lr_embed, base_l2=base_l2,
                              extra=extra)
                records.append(rec)
                if verbose:
                    print(f"[{len(records)}/{total}] batch {b} {method} seed {seed}: "
                          f"AUC {rec['auc']:.4f} logloss {rec['logloss']:.4f} "
                          f"clipped {_pct(rec['clipped_frac'])} {rec['wall_s']:.1f}s",
                          file=sys.stderr, flush=True)
    return records


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"


def summarize(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (batch, method): mean over seeds, and the seed spread of AUC."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["batch_size"], r["method"]), []).append(r)
    rows = []
    order = {m: i for i, m in enumerate(METHODS)}
    for (b, method), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        aucs = [r["auc"] for r in rs]
        upd = sum(r["rows_updated"] or 0 for r in rs)
        clip = sum(r["rows_clipped"] or 0 for r in rs)
        upd1 = sum(r["epoch1_rows_updated"] or 0 for r in rs)
        clip1 = sum(r["epoch1_rows_clipped"] or 0 for r in rs)
        rows.append({
            "batch_size": b, "method": method, "seeds": len(rs),
            "auc_mean": statistics.fmean(aucs), "auc_min": min(aucs), "auc_max": max(aucs),
            "auc_std": statistics.stdev(aucs) if len(aucs) > 1 else 0.0,
            "logloss_mean": statistics.fmean(r["logloss"] for r in rs),
            "steps": rs[0]["steps"],
            "clipped_frac": _ratio(clip, upd) if rs[0]["cowclip"] else None,
            "epoch1_clipped_frac": _ratio(clip1, upd1) if rs[0]["cowclip"] else None,
            "wall_s_mean": statistics.fmean(r["wall_s"] for r in rs),
        })
    return rows


def format_table(summary: List[Dict[str, Any]]) -> str:
    head = ("| batch | method | seeds | AUC (mean) | AUC min..max | logloss | steps | "
            "clipped % (all) | clipped % (epoch 1) | wall s |")
    lines = [head, "|" + "---|" * 10]
    for r in summary:
        lines.append(
            f"| {r['batch_size']} | {r['method']} | {r['seeds']} | {r['auc_mean']:.4f} | "
            f"{r['auc_min']:.4f}..{r['auc_max']:.4f} | {r['logloss_mean']:.4f} | {r['steps']} | "
            f"{_pct(r['clipped_frac']) if r['clipped_frac'] is not None else '- (no clip)'} | "
            f"{_pct(r['epoch1_clipped_frac']) if r['epoch1_clipped_frac'] is not None else '-'} | "
            f"{r['wall_s_mean']:.1f} |"
        )
    return "\n".join(lines)


CSV_FIELDS = (
    "model", "method", "batch_size", "seed", "data", "epochs", "steps", "steps_per_epoch",
    "auc", "logloss", "epoch_auc", "epoch_logloss", "wall_s", "train_samples_per_s",
    "rows_updated", "rows_clipped", "clipped_frac", "epoch1_rows_updated",
    "epoch1_rows_clipped", "epoch1_clipped_frac", "dense_lr", "embedding_lr", "l2",
    "init_std", "base_batch_size", "warmup_epochs", "out",
)


def write_outputs(records: List[Dict[str, Any]], out_root: Path, meta: Dict[str, Any]) -> Dict[str, Path]:
    """scaling.csv (one row per run), scaling.json (runs, summary, notes) and the plot."""
    out_root = Path(out_root)
    paths = {"csv": out_root / "scaling.csv", "json": out_root / "scaling.json"}
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in records:
            row = dict(r)
            row["epoch_auc"] = ";".join(f"{x:.6f}" for x in r["epoch_auc"])
            row["epoch_logloss"] = ";".join(f"{x:.6f}" for x in r["epoch_logloss"])
            w.writerow(row)
    summary = summarize(records)
    paths["json"].write_text(json.dumps(
        {"meta": meta, "notes": [BUCKET_NOTE], "summary": summary, "runs": records},
        indent=2, default=str))
    plot = plot_auc(summary, out_root / "scaling_auc.png", title=meta.get("title", ""))
    if plot is not None:
        paths["plot"] = plot
    return paths


def plot_auc(summary: List[Dict[str, Any]], path: Path, title: str = "") -> Optional[Path]:
    """AUC vs batch size per method, min..max over seeds as error bars; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot "
              "(pip install matplotlib to get scaling_auc.png)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in METHODS:
        rows = [r for r in summary if r["method"] == method]
        if not rows:
            continue
        xs = [r["batch_size"] for r in rows]
        ys = [r["auc_mean"] for r in rows]
        err = [[y - r["auc_min"] for y, r in zip(ys, rows)],
               [r["auc_max"] - y for y, r in zip(ys, rows)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("test AUC")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _int_list(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepfm", choices=("deepfm", "dcn", "dcnv2", "wdl"))
    p.add_argument("--data", default="synthetic:30M",
                   help="a --data spec of the trainer (default synthetic:30M: about 200 steps "
                        "per epoch at batch 131072); criteo:PATH, avazu:PATH, ... for real data")
    p.add_argument("--batch-sizes", type=_int_list, default=list(DEFAULT_BATCHES))
    p.add_argument("--base-batch-size", type=int, default=1024)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0: one seed)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--init-std", type=float, default=1e-2)
    p.add_argument("--base-lr", type=float, default=None, help="dense lr at the base batch")
    p.add_argument("--base-lr-embed", type=float, default=None, help="embedding lr at the base batch")
    p.add_argument("--base-l2", type=float, default=None, help="L2 lambda at the base batch")
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--hidden", default=None, help="DNN sizes, e.g. 400,400,400 (trainer default)")
    p.add_argument("--synthetic-scale", type=float, default=None)
    p.add_argument("--synthetic-max-cardinality", type=int, default=None)
    p.add_argument("--test-fraction", type=float, default=0.1)
    p.add_argument("--eval-batch-size", type=int, default=65536)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "scaling"))
    p.add_argument("--cache-dir", default=None, help="shared data cache (default OUT/cache)")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
    args.seeds = _int_list(args.seeds)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    extra: Dict[str, Any] = {"warmup_epochs": args.warmup_epochs,
                             "test_fraction": args.test_fraction,
                             "eval_batch_size": args.eval_batch_size,
                             "threads": args.threads, "device": args.device}
    if args.hidden:
        extra["hidden"] = tuple(_int_list(args.hidden))
    if args.synthetic_scale is not None:
        extra["synthetic_scale"] = args.synthetic_scale
    if args.synthetic_max_cardinality is not None:
        extra["synthetic_max_cardinality"] = args.synthetic_max_cardinality
    out_root = Path(args.out)
    t0 = time.perf_counter()
    records = run_study(
        model=args.model, data=args.data, batch_sizes=args.batch_sizes, methods=args.methods,
        seeds=args.seeds, epochs=args.epochs, out_root=out_root, cache_dir=args.cache_dir,
        base_batch_size=args.base_batch_size, init_std=args.init_std, base_lr=args.base_lr,
        base_lr_embed=args.base_lr_embed, base_l2=args.base_l2, extra=extra,
    )
    meta = {k: (v if isinstance(v, (int, float, str, list, type(None))) else str(v))
            for k, v in vars(args).items()}
    meta["total_wall_s"] = time.perf_counter() - t0
    meta["title"] = (f"{args.model} on {args.data}, {args.epochs} epoch(s), "
                     f"init_std {args.init_std:g}, seeds {args.seeds}")
    paths = write_outputs(records, out_root, meta)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    print(f"note: {BUCKET_NOTE}")
    print(f"\n{meta['title']} (base batch {args.base_batch_size}; clipped % = rows clipped / "
          f"rows updated, CowClip runs only)")
    print(format_table(summarize(records)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

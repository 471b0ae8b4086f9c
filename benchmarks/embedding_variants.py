"""Embedding step (forward + backward + update) of five implementations, Criteo-shaped.

Variants, all on identical inputs (single-hot power-law ids, one id per feature per
sample as Criteo, the same fixed upstream gradient):

a. ``ours adam+cowclip``: ``CowClipEmbeddingBagCollection(optimizer="adam", cowclip=...)``;
b. ``ours rowwise_adagrad+cowclip``: the same with ``optimizer="rowwise_adagrad"``;
c. ``fbgemm rowwise_adagrad``: FBGEMM's fused ``SplitTableBatchedEmbeddingBagsCodegen``,
   ``EXACT_ROWWISE_ADAGRAD``, no clipping (the reference point of the ratios);
d. ``fbgemm rowwise_adagrad+COWCLIP``: the same TBE with FBGEMM's own
   ``WeightDecayMode.COWCLIP`` and a ``CowClipDefinition`` (row-wise Adagrad only; clips
   with FBGEMM's running row counter, not this batch's count);
e. ``plain pytorch port``: the TF reference written in plain PyTorch: one
   ``[sum rows, D]`` ``nn.Parameter`` looked up with ``F.embedding`` (dense gradient),
   per-row CowClip on the dense gradient (``bincount`` counts, row norms, scale) and
   ``torch.optim.Adam`` over every row.

Tables: the 26 of Criteo Kaggle (``CRITEO_KAGGLE_CARDINALITIES``), each capped at
``--max-rows`` (default 100,000; ``--full`` for the real 33.8M rows). Every (dim, batch)
configuration is timed with all variants interleaved: each round runs every variant
once on the same batch, the order rotated each round (``common.run_interleaved``),
so a machine shared with other jobs slows all variants alike; the report gives medians
and paired ratios (median over rounds of the per-round ratio).

Also reported: optimizer-state bytes per embedding row (measured from the state
tensors), and peak RSS of each variant in its own subprocess (``VmHWM`` of
``/proc/self/status``; the delta over the process's peak before the variant was built).

Run (about 5 minutes on 2 cores with the defaults)::

    .venv/bin/python benchmarks/embedding_variants.py
    .venv/bin/python benchmarks/embedding_variants.py --dims 10,16,64 --batch-sizes 1024,16384,131072
    .venv/bin/python benchmarks/embedding_variants.py --full --variants ours_adam,plain --dims 16 --batch-sizes 16384
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by path
from common import (  # noqa: E402
    ADAM_LR,
    COWCLIP,
    EPS,
    RESULTS,
    SEED,
    Batch,
    child_memory,
    cpu_model,
    criteo_table_rows,
    fbgemm_cowclip_options,
    fbgemm_step,
    format_table,
    grouped_bars,
    make_ours,
    make_tbe,
    optimizer_state_bytes,
    ours_step,
    paired_ratio,
    run_interleaved,
    self_command,
    single_hot_batches,
    slow_rounds,
    vm_hwm_kib,
    write_csv,
    write_json,
    write_png,
)

warnings.filterwarnings("ignore")

NUM_BATCHES = 4  # distinct pre-generated batches, cycled
NAMES = {
    "ours_adam": "ours adam+cowclip",
    "ours_adagrad": "ours rowwise_adagrad+cowclip",
    "fbgemm": "fbgemm rowwise_adagrad",
    "fbgemm_cowclip": "fbgemm rowwise_adagrad+COWCLIP",
    "plain": "plain pytorch port (dense adam)",
}
REFERENCE = "fbgemm"


class PlainPort:
    """The TF reference in plain PyTorch: dense embedding gradient, CowClip on every
    row of it, dense Adam over every row."""

    def __init__(self, rows: Sequence[int], dim: int) -> None:
        self.offsets = torch.tensor([0, *np.cumsum(rows)[:-1].tolist()], dtype=torch.int64)
        self.total = int(sum(rows))
        self.weight = torch.nn.Parameter(torch.randn(self.total, dim) * 0.01)
        self.optimizer = torch.optim.Adam([self.weight], lr=ADAM_LR, eps=EPS)
        self.tables = len(rows)

    def global_ids(self, batch: Batch) -> Tensor:
        # feature-major [T * B] single-hot ids -> [B, T] rows of the one big table
        return (batch.indices.view(self.tables, -1) + self.offsets[:, None]).t()

    def step(self, ids: Tensor, grad: Tensor) -> None:
        out = F.embedding(ids, self.weight)  # [B, T, D], dense gradient
        (out.reshape(out.shape[0], -1) * grad).sum().backward()
        g = self.weight.grad
        with torch.no_grad():
            counts = torch.bincount(ids.reshape(-1), minlength=self.total).to(g.dtype)
            g_norm = torch.linalg.vector_norm(g, dim=1)
            w_norm = torch.linalg.vector_norm(self.weight, dim=1)
            tau = counts * torch.clamp(COWCLIP.r * w_norm, min=COWCLIP.zeta)
            scale = torch.where(
                g_norm > tau, tau / g_norm.clamp(min=1e-30), torch.ones_like(g_norm)
            )
            g.mul_(scale.unsqueeze(1))
        self.optimizer.step()
        self.optimizer.zero_grad()


def build_variant(
    key: str, rows: Sequence[int], dim: int, grad: Tensor, batches: Sequence[Batch]
) -> Tuple[Any, Callable[[Batch], None]]:
    """``(module, step(batch))`` of one variant."""
    if key in ("ours_adam", "ours_adagrad"):
        ebc = make_ours(rows, dim, "adam" if key == "ours_adam" else "rowwise_adagrad")
        return ebc, ours_step(ebc, grad)
    if key in ("fbgemm", "fbgemm_cowclip"):
        tbe = make_tbe(rows, dim, **(fbgemm_cowclip_options() if key == "fbgemm_cowclip" else {}))
        return tbe, fbgemm_step(tbe, grad)
    if key == "plain":
        port = PlainPort(rows, dim)
        ids = {id(b): port.global_ids(b).contiguous() for b in batches}
        return port, lambda b: port.step(ids[id(b)], grad)
    raise ValueError(f"unknown variant {key!r}; valid: {sorted(NAMES)}")


def state_bytes_per_row(key: str, module: Any, total_rows: int) -> float:
    """Optimizer state (not weights, not gradients) bytes divided by the rows."""
    total = 0
    if key.startswith("ours"):
        total = optimizer_state_bytes(module.fused_optimizer)
    elif key.startswith("fbgemm"):
        # momentum1_host (row-wise Adagrad), row_counter_host / prev_iter_host (COWCLIP)
        for name in dir(module):
            buf = getattr(module, name, None)
            if (
                name.endswith("_host")
                and name != "weights_host"
                and isinstance(buf, Tensor)
                and buf.numel() >= total_rows
            ):
                total += buf.numel() * buf.element_size()
    else:
        total = optimizer_state_bytes(module.optimizer)
    return total / total_rows


# --- memory (one subprocess per variant) -------------------------------------------


def memory_child(args: argparse.Namespace) -> None:
    rows = criteo_table_rows(None if args.full else args.max_rows)
    dim, batch_size = args.dims[0], args.batch_sizes[0]
    batches = single_hot_batches(rows, batch_size, args.zipf, 2, SEED)
    grad = torch.randn(batch_size, len(rows) * dim)
    gc.collect()
    before = vm_hwm_kib()
    module, step = build_variant(args.memory_child, rows, dim, grad, batches)
    for k in range(3):
        step(batches[k % len(batches)])
    after = vm_hwm_kib()
    print(json.dumps({"before_kib": before, "peak_kib": after}))
    del module


def measure_memory(args: argparse.Namespace, key: str, dim: int, batch_size: int) -> Dict[str, Any]:
    flags = dict(dims=dim, batch_sizes=batch_size, max_rows=args.max_rows, zipf=args.zipf)
    words = ["--memory-child", key, *(["--full"] if args.full else [])]
    cmd = self_command(__file__, *words, **flags)
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return child_memory(cmd)


# --- main --------------------------------------------------------------------------


def ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=ints, default=[16], help="comma list (10, 16, 64, ...)")
    p.add_argument(
        "--batch-sizes", type=ints, default=[1024, 16384], help="comma list, up to 131072"
    )
    p.add_argument("--max-rows", type=int, default=100_000, help="cap on every table's rows")
    p.add_argument("--full", action="store_true", help="uncapped Criteo Kaggle tables (33.8M rows)")
    p.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=list(NAMES),
        help=f"comma list of {','.join(NAMES)}",
    )
    p.add_argument("--rounds", type=int, default=60, help="timed rounds per configuration")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--time-limit", type=float, default=100.0, help="seconds of timed rounds per configuration"
    )
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    p.add_argument(
        "--memory-at",
        type=ints,
        default=None,
        metavar="DIM,BATCH",
        help="measure peak RSS at this configuration (default: the largest)",
    )
    p.add_argument(
        "--out", default=str(RESULTS), help="directory for embedding_variants.{csv,json,png}"
    )
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key in args.variants:
        if key not in NAMES:
            p.error(f"unknown variant {key!r}; valid: {','.join(NAMES)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return {}
    torch.manual_seed(SEED)
    rows = criteo_table_rows(None if args.full else args.max_rows)
    total_rows = sum(rows)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU: {cpu_model()} "
        f"({os.cpu_count()} logical cores)"
    )
    print(
        f"26 Criteo Kaggle tables, {'uncapped' if args.full else f'capped at {args.max_rows:,} rows'}: "
        f"{total_rows:,} rows in all; ids power-law, exponent {args.zipf}"
    )
    results: List[Dict[str, Any]] = []
    errors: Dict[str, str] = {}
    for dim in args.dims:
        for batch_size in args.batch_sizes:
            batches = single_hot_batches(rows, batch_size, args.zipf, NUM_BATCHES, SEED)
            grad = torch.randn(batch_size, len(rows) * dim)
            uniq = statistics.fmean(b.unique_rows for b in batches)
            variants: Dict[str, Callable[[Batch], None]] = {}
            modules: Dict[str, Any] = {}
            for key in args.variants:
                try:
                    module, step = build_variant(key, rows, dim, grad, batches)
                    step(batches[0])  # fails here if the kernel refuses the configuration
                    modules[key], variants[key] = module, step
                except Exception as e:  # noqa: BLE001 - report and go on
                    errors[key] = f"{type(e).__name__}: {e}"
                    print(
                        f"variant {NAMES[key]} failed at dim {dim} batch {batch_size}: {errors[key]}"
                    )
            print(
                f"\ndim {dim}, batch {batch_size:,}: {uniq:,.0f} distinct rows per step; "
                f"{args.warmup} warm-up + up to {args.rounds} interleaved rounds ...",
                flush=True,
            )
            timings = run_interleaved(
                {NAMES[k]: v for k, v in variants.items()},
                batches,
                args.rounds,
                args.warmup,
                args.time_limit,
            )
            ref = timings.get(NAMES[REFERENCE])
            for key in variants:
                t = timings[NAMES[key]]
                row = {
                    "dim": dim,
                    "batch_size": batch_size,
                    "variant": NAMES[key],
                    "key": key,
                    "median_ms": t.median,
                    "min_ms": t.minimum,
                    "rounds": len(t.samples),
                    "distinct_rows_per_step": uniq,
                    "state_bytes_per_row": state_bytes_per_row(key, modules[key], total_rows),
                    "vs_fbgemm_paired": paired_ratio(t, ref) if ref else None,
                    "plain_over_this_paired": (
                        paired_ratio(timings[NAMES["plain"]], t) if "plain" in variants else None
                    ),
                    "slow_rounds": slow_rounds(timings),
                }
                results.append(row)
            del modules, variants, timings
            gc.collect()

    memory: Dict[str, Any] = {}
    if not args.no_memory:
        mdim, mbatch = args.memory_at or [max(args.dims), max(args.batch_sizes)]
        print(
            f"\npeak RSS per variant, own subprocess, dim {mdim} batch {mbatch:,} ...", flush=True
        )
        for key in args.variants:
            memory[NAMES[key]] = measure_memory(args, key, mdim, mbatch)
        memory["_config"] = {"dim": mdim, "batch_size": mbatch}

    write_csv(os.path.join(args.out, "embedding_variants.csv"), results)
    out = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "total_rows": total_rows,
        "full": args.full,
        "max_rows": args.max_rows,
        "results": results,
        "memory": memory,
        "errors": errors,
    }
    write_json(os.path.join(args.out, "embedding_variants.json"), out)
    write_png(
        os.path.join(args.out, "embedding_variants.png"),
        grouped_bars(
            results,
            lambda r: (r["dim"], r["batch_size"]),
            lambda g: f"D{g[0]} B{g[1]}",
            "median_ms",
            "median ms / step",
        ),
    )

    def fmt(x: Optional[float], spec: str = ".2f") -> str:
        return "" if x is None else format(x, spec)

    table = [
        [
            "dim",
            "batch",
            "variant",
            "median ms",
            "min ms",
            "rounds",
            "vs fbgemm",
            "plain/this",
            "state B/row",
        ]
    ]
    for r in results:
        table.append(
            [
                str(r["dim"]),
                f"{r['batch_size']:,}",
                r["variant"],
                f"{r['median_ms']:.1f}",
                f"{r['min_ms']:.1f}",
                str(r["rounds"]),
                fmt(r["vs_fbgemm_paired"]),
                fmt(r["plain_over_this_paired"]),
                f"{r['state_bytes_per_row']:.0f}",
            ]
        )
    if memory:
        mem = [["variant", "peak RSS MiB", "delta MiB"]]
        for k, v in memory.items():
            if k.startswith("_"):
                continue
            mem.append(
                [k, fmt(v.get("peak_mib"), ".0f"), fmt(v.get("delta_mib"), ".0f")]
                if "error" not in v
                else [k, "error", v["error"][:60]]
            )
        print(
            f"\npeak RSS (VmHWM) of one variant per subprocess, dim {memory['_config']['dim']}, "
            f"batch {memory['_config']['batch_size']:,} (delta: over the peak before the variant was built):"
        )
        print(format_table(mem))
    for k, e in errors.items():
        print(f"FAILED {NAMES[k]}: {e}")
    print(
        f"\nms/step, {total_rows:,} rows, median over interleaved rounds; 'vs fbgemm' and 'plain/this' "
        "are paired ratios (median of per-round ratios); state B/row: optimizer state per embedding row"
    )
    print(format_table(table))
    return out


if __name__ == "__main__":
    main()

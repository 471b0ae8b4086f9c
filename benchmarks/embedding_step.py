"""Time per training step of the embedding layer: ours against FBGEMM's fused TBE.

What it measures: forward + backward + in-backward optimizer update, per step, on CPU, of

1. ``CowClipEmbeddingBagCollection(optimizer="adam", cowclip=CowClip(...))``;
2. ``CowClipEmbeddingBagCollection(optimizer="rowwise_adagrad", cowclip=CowClip(...))``;
3. FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` with
   ``EXACT_ROWWISE_ADAGRAD`` (``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``), the
   fused kernel TorchRec itself uses on CPU - the reference point;

plus, for ours with Adam, the forward alone (under ``torch.no_grad()``) and the
backward + update part of the full step.

Every variant sees the same inputs: a few pre-generated single-hot batches (one id per
feature per sample, as Criteo) with power-law ids, ``p(rank k) ~ k**-zipf`` per table
(ranks mapped to rows by a fixed random permutation per table, as hashing would), and
one fixed random upstream gradient ``g``. Ours steps with
``(ebc(kjt).values() * g).sum().backward()``; the TBE with
``(tbe(kjt.values(), kjt.offsets()) * g).sum().backward()``. Runs are interleaved: each
round runs every variant once, in an order rotated every round, and the report gives
the median and minimum ms/step per variant and the ratio ours / FBGEMM of medians.

It also prints a memory-bandwidth floor for ours with Adam: the bytes a step must move
(pooled lookup reads plus read + write of the touched rows' weight and two Adam
moments) divided by the measured copy bandwidth of this machine.

Run (default shape: 26 tables x 100,000 rows, dim 16, batch 16,384; about 2 minutes
on 2 cores)::

    .venv/bin/python benchmarks/embedding_step.py
    .venv/bin/python benchmarks/embedding_step.py --steps 50 --threads 1 --json out.json

Writes ``embedding_step.json``, ``embedding_step.csv`` (one row per variant) and
``embedding_step.png`` (median ms per variant and the floor; with matplotlib) to ``--out``
(default ``benchmarks/results``); ``--json PATH`` also writes the JSON there.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

# fbgemm_gpu and torchrec warn about CUDA/FX details irrelevant to a CPU benchmark.
warnings.filterwarnings("ignore")
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by path
import common as bench  # noqa: E402
from common import (  # noqa: E402
    RESULTS,
    SEED,
    Batch,
    Timing,
    copy_bandwidth,
    cpu_model,
    floor_bytes,
    format_table,
    paired_ratio,
    run_interleaved,
    single_hot_batches,
    slow_rounds,
    write_csv,
    write_json,
    write_png,
)

NUM_BATCHES = 4  # distinct pre-generated batches, cycled

FBGEMM_NAME = "fbgemm TBE rowwise_adagrad"
ADAM_NAME = "ours adam+cowclip"
ADAGRAD_NAME = "ours rowwise_adagrad+cowclip"
FORWARD_NAME = "ours adam: forward only (no_grad)"


@dataclass(frozen=True)
class Shape:
    tables: int
    rows: int
    dim: int
    batch_size: int

    @property
    def table_rows(self) -> List[int]:
        return [self.rows] * self.tables


def ours_forward(ebc: Any) -> Callable[[Batch], None]:
    def step(batch: Batch) -> None:
        with torch.no_grad():
            ebc(batch.kjt)

    return step


def ours_step_split(ebc: Any, grad: Tensor, backward_ms: Timing) -> Callable[[Batch], None]:
    """The full step, also recording the time of its backward (+ fused update) part."""

    def step(batch: Batch) -> None:
        loss = (ebc(batch.kjt).values() * grad).sum()
        start = time.perf_counter()
        loss.backward()
        backward_ms.samples.append((time.perf_counter() - start) * 1e3)

    return step


# --- report ------------------------------------------------------------------------


def csv_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per timed variant (and the backward + update part of ours with Adam)."""
    parts = dict(
        result["variants"], **{"ours adam: backward + fused update": result["adam_backward_update"]}
    )
    return [
        {
            "variant": name,
            **{k: v for k, v in t.items() if k != "samples_ms"},
            "vs_fbgemm_median": result["ratio_median_vs_fbgemm"].get(name),
            "vs_fbgemm_paired": result["ratio_paired_vs_fbgemm"].get(name),
            "floor_ms_adam": result["floor_ms_adam"],
        }
        for name, t in parts.items()
    ]


def plot(result: Dict[str, Any]) -> Callable[[Any], Any]:
    """Median ms per variant as bars, the memory-bandwidth floor of ours adam as a line."""

    def draw(plt: Any) -> Any:
        rows = csv_rows(result)
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.barh([r["variant"] for r in rows], [r["median_ms"] for r in rows], color="tab:blue")
        ax.axvline(
            result["floor_ms_adam"],
            color="tab:red",
            linestyle="--",
            label=f"memory-bandwidth floor, ours adam ({result['floor_ms_adam']:.1f} ms)",
        )
        ax.invert_yaxis()
        ax.set_xlabel("median ms / step")
        s = result["shape"]
        ax.set_title(
            f"embedding step: {s['tables']} x {s['rows']:,} rows, dim {s['dim']}, "
            f"batch {s['batch_size']:,}",
            fontsize=9,
        )
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    return draw


def write_outputs(result: Dict[str, Any], out: str, json_path: Optional[str]) -> None:
    """``embedding_step.{json,csv,png}`` in ``out`` (PNG only with matplotlib), and the
    JSON also at ``json_path`` if given."""
    for path in [os.path.join(out, "embedding_step.json")] + ([json_path] if json_path else []):
        write_json(path, result)
    write_csv(os.path.join(out, "embedding_step.csv"), csv_rows(result))
    write_png(os.path.join(out, "embedding_step.png"), plot(result))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16_384)
    parser.add_argument("--steps", type=int, default=200, help="timed rounds (steps per variant)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    # 1.0: about 170K distinct rows per step at the default shape.
    parser.add_argument("--zipf", type=float, default=1.0, help="power-law exponent of the ids")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="stop the timed rounds early after this long (default 120)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--json", type=str, default=None, metavar="PATH", help="also write results here"
    )
    parser.add_argument(
        "--out",
        default=str(RESULTS),
        help="directory for embedding_step.{json,csv,png}",
    )
    args = parser.parse_args(argv)
    for name in ("tables", "rows", "dim", "batch_size", "steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.warmup < 0 or args.zipf < 0:
        parser.error("--warmup and --zipf must be >= 0")
    if args.threads is not None and args.threads <= 0:
        parser.error("--threads must be > 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    shape = Shape(args.tables, args.rows, args.dim, args.batch_size)

    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"CPU: {cpu_model()} ({os.cpu_count()} logical cores)"
    )
    print(
        f"shape: {shape.tables} tables x {shape.rows:,} rows, dim {shape.dim}, "
        f"batch {shape.batch_size:,}, single-hot; ids power-law p(rank k) ~ k**-{args.zipf:.2f} "
        f"(zipf exponent {args.zipf:.2f}) per table"
    )

    batches = single_hot_batches(shape.table_rows, shape.batch_size, args.zipf, NUM_BATCHES, SEED)
    unique = [b.unique_rows for b in batches]
    mean_unique = statistics.fmean(unique)
    print(
        f"distinct rows per step (all tables): mean {mean_unique:,.0f} "
        f"(min {min(unique):,}, max {max(unique):,}) over {len(batches)} cycled batches; "
        f"lookups per step {shape.tables * shape.batch_size:,}"
    )

    bandwidth_before = copy_bandwidth()
    grad = torch.randn(shape.batch_size, shape.tables * shape.dim)
    adam = bench.make_ours(shape.table_rows, shape.dim, "adam")
    adagrad = bench.make_ours(shape.table_rows, shape.dim, "rowwise_adagrad")
    with torch.no_grad():  # all three start from the same tables
        initial = [adam.embedding_bags[f"t{t}"].weight for t in range(shape.tables)]
        for t in range(shape.tables):
            adagrad.embedding_bags[f"t{t}"].weight.copy_(initial[t])
    tbe = bench.make_tbe(shape.table_rows, shape.dim, initial=initial)

    adam_backward = Timing()
    variants: Dict[str, Callable[[Batch], None]] = {
        ADAM_NAME: ours_step_split(adam, grad, adam_backward),
        ADAGRAD_NAME: bench.ours_step(adagrad, grad),
        FBGEMM_NAME: bench.fbgemm_step(tbe, grad),
        FORWARD_NAME: ours_forward(adam),
    }
    print(
        f"running {args.warmup} warm-up + {args.steps} timed rounds of {len(variants)} "
        "variants, interleaved ...",
        flush=True,
    )
    timings = run_interleaved(variants, batches, args.steps, args.warmup, args.time_limit)
    adam_backward.samples = adam_backward.samples[args.warmup :]
    for name, module in ((ADAM_NAME, adam), (ADAGRAD_NAME, adagrad)):
        steps = module.clip_stats()["t0"].steps
        assert steps == args.warmup + len(timings[name].samples), f"{name}: {steps} updates"

    # Best of a measurement before and after the rounds: a copy that another process
    # slows down only under-states the bandwidth (and over-states the floor).
    bandwidth = max(bandwidth_before, copy_bandwidth())
    floor = floor_bytes(shape.batch_size * shape.tables, shape.dim, mean_unique)
    floor_ms = floor / bandwidth * 1e3
    reference = timings[FBGEMM_NAME].median
    ratios = {name: timings[name].median / reference for name in (ADAM_NAME, ADAGRAD_NAME)}
    paired = {
        name: paired_ratio(timings[name], timings[FBGEMM_NAME])
        for name in (ADAM_NAME, ADAGRAD_NAME)
    }
    rounds_done = len(timings[FBGEMM_NAME].samples)
    slow = slow_rounds(timings)

    result: Dict[str, Any] = {
        "shape": asdict(shape),
        "zipf_exponent": args.zipf,
        "distinct_rows_per_step": {"mean": mean_unique, "per_batch": unique},
        "steps_requested": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "variants": {name: t.summary() for name, t in timings.items()},
        "adam_backward_update": adam_backward.summary(),
        "rounds": rounds_done,
        "slow_rounds": slow,
        "ratio_median_vs_fbgemm": ratios,
        "ratio_paired_vs_fbgemm": paired,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "floor_ms_adam": floor_ms,
    }
    write_outputs(result, args.out, args.json)

    print()
    print(
        f"memory-bandwidth floor (ours adam): {floor / 1e6:.1f} MB "
        f"per step / {bandwidth / 1e9:.1f} GB/s copy bandwidth (512 MB copy, read+write) "
        f"= {floor_ms:.1f} ms; ours adam median is {timings[ADAM_NAME].median / floor_ms:.1f}x "
        "the floor"
    )
    if slow:
        print(
            f"note: {slow} of {rounds_done} rounds took over 2x the fastest round (the "
            "machine was slowed down meanwhile); trust min and the paired ratio more"
        )
    rows = [["variant", "median ms", "min ms", "mean ms", "vs fbgemm", "paired"]]
    for name in (ADAM_NAME, ADAGRAD_NAME, FBGEMM_NAME):
        t = timings[name]
        rows.append(
            [
                name,
                f"{t.median:.1f}",
                f"{t.minimum:.1f}",
                f"{statistics.fmean(t.samples):.1f}",
                f"{t.median / reference:.2f}",
                f"{paired[name]:.2f}" if name in paired else "1.00",
            ]
        )
    forward = timings[FORWARD_NAME]
    rows.append(
        [
            "  ours adam: forward only (no_grad)",
            f"{forward.median:.1f}",
            f"{forward.minimum:.1f}",
            f"{statistics.fmean(forward.samples):.1f}",
            "",
            "",
        ]
    )
    rows.append(
        [
            "  ours adam: backward + fused update",
            f"{adam_backward.median:.1f}",
            f"{adam_backward.minimum:.1f}",
            f"{statistics.fmean(adam_backward.samples):.1f}",
            "",
            "",
        ]
    )
    rows.append(["  memory-bandwidth floor (ours adam)", f"{floor_ms:.1f}", "", "", "", ""])
    print(
        f"\nper step, {rounds_done} interleaved rounds, {torch.get_num_threads()} threads "
        "(vs fbgemm: median / fbgemm median; paired: median of per-round ratios):"
    )
    print(format_table(rows))
    print(f"adam+cowclip / fbgemm rowwise_adagrad = {ratios[ADAM_NAME]:.2f}")
    print(f"rowwise_adagrad+cowclip / fbgemm rowwise_adagrad = {ratios[ADAGRAD_NAME]:.2f}")

    return result


if __name__ == "__main__":
    main()

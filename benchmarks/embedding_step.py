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
import csv
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

# fbgemm_gpu and torchrec warn about CUDA/FX details irrelevant to a CPU benchmark.
warnings.filterwarnings("ignore")
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by path
from text_table import format_table  # noqa: E402,F401 - the other benchmarks use es.format_table

ADAM_LR = 1e-3
ADAGRAD_LR = 1e-2
EPS = 1e-8
COWCLIP = CowClip(r=1.0, zeta=1e-5)
NUM_BATCHES = 4  # distinct pre-generated batches, cycled
SEED = 0

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


@dataclass
class Batch:
    """One step's input, in both forms (the TBE's are the KJT's own tensors)."""

    kjt: KeyedJaggedTensor
    indices: Tensor  # [T * B] feature-major ids, per-table (no table offset)
    offsets: Tensor  # [T * B + 1]
    unique_rows: int  # distinct (table, row) pairs the batch touches


@dataclass
class Timing:
    """Per-step wall times of one variant, in milliseconds."""

    samples: List[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def minimum(self) -> float:
        return min(self.samples)

    def summary(self) -> Dict[str, Any]:
        return {
            "median_ms": self.median,
            "min_ms": self.minimum,
            "mean_ms": statistics.fmean(self.samples),
            "max_ms": max(self.samples),
            "steps": float(len(self.samples)),
            "samples_ms": list(self.samples),
        }


# --- inputs ------------------------------------------------------------------------


def zipf_cdf(rows: int, exponent: float) -> np.ndarray:
    """CDF of the truncated power law ``p(k) ~ k**-exponent`` over ranks ``1..rows``."""
    weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def make_batches(shape: Shape, exponent: float, count: int, seed: int) -> List[Batch]:
    """``count`` single-hot batches of power-law ids, the same hot rows in every batch."""
    rng = np.random.default_rng(seed)
    cdf = zipf_cdf(shape.rows, exponent)
    rank_to_row = [rng.permutation(shape.rows) for _ in range(shape.tables)]
    keys = [f"f{t}" for t in range(shape.tables)]
    batches: List[Batch] = []
    for _ in range(count):
        per_table = [
            rank_to_row[t][
                np.minimum(np.searchsorted(cdf, rng.random(shape.batch_size)), shape.rows - 1)
            ]
            for t in range(shape.tables)
        ]
        unique_rows = sum(int(np.unique(ids).size) for ids in per_table)
        values = torch.from_numpy(np.concatenate(per_table).astype(np.int64))
        lengths = torch.ones(shape.tables * shape.batch_size, dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        batches.append(Batch(kjt, kjt.values(), kjt.offsets(), unique_rows))
    return batches


# --- the modules under test --------------------------------------------------------


def table_configs(shape: Shape) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=shape.dim,
            num_embeddings=shape.rows,
            feature_names=[f"f{t}"],
        )
        for t in range(shape.tables)
    ]


def make_ours(shape: Shape, optimizer: str) -> CowClipEmbeddingBagCollection:
    lr = ADAM_LR if optimizer == "adam" else ADAGRAD_LR
    return CowClipEmbeddingBagCollection(
        table_configs(shape), optimizer=optimizer, lr=lr, eps=EPS, cowclip=COWCLIP
    )


def make_fbgemm(
    shape: Shape, initial: Sequence[Tensor]
) -> SplitTableBatchedEmbeddingBagsCodegen:
    """FBGEMM's fused TBE on CPU, started from the same weights as ours."""
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(shape.rows, shape.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * shape.tables,
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=ADAGRAD_LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        for dst, src in zip(tbe.split_embedding_weights(), initial):
            dst.copy_(src)
    return tbe


def ours_step(ebc: CowClipEmbeddingBagCollection, grad: Tensor) -> Callable[[Batch], None]:
    def step(batch: Batch) -> None:
        (ebc(batch.kjt).values() * grad).sum().backward()

    return step


def ours_forward(ebc: CowClipEmbeddingBagCollection) -> Callable[[Batch], None]:
    def step(batch: Batch) -> None:
        with torch.no_grad():
            ebc(batch.kjt)

    return step


def ours_step_split(
    ebc: CowClipEmbeddingBagCollection, grad: Tensor, backward_ms: Timing
) -> Callable[[Batch], None]:
    """The full step, also recording the time of its backward (+ fused update) part."""

    def step(batch: Batch) -> None:
        loss = (ebc(batch.kjt).values() * grad).sum()
        start = time.perf_counter()
        loss.backward()
        backward_ms.samples.append((time.perf_counter() - start) * 1e3)

    return step


def fbgemm_step(
    tbe: SplitTableBatchedEmbeddingBagsCodegen, grad: Tensor
) -> Callable[[Batch], None]:
    def step(batch: Batch) -> None:
        (tbe(batch.indices, batch.offsets) * grad).sum().backward()

    return step


# --- measurement -------------------------------------------------------------------


def run_interleaved(
    variants: Dict[str, Callable[[Batch], None]],
    batches: Sequence[Batch],
    rounds: int,
    warmup: int,
    time_limit_s: float,
) -> Dict[str, Timing]:
    """Each round runs every variant once on the same batch, the order rotated by one
    every round; the first ``warmup`` rounds are not recorded. Timed rounds stop early
    once ``time_limit_s`` has passed, so sample ``i`` of every variant is round ``i``."""
    names = list(variants)
    timings = {name: Timing() for name in names}
    gc.collect()
    gc.disable()
    try:
        deadline = float("inf")
        for r in range(warmup + rounds):
            if r == warmup:
                deadline = time.perf_counter() + time_limit_s
            batch = batches[r % len(batches)]
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                variants[name](batch)
                elapsed = (time.perf_counter() - start) * 1e3
                if r >= warmup:
                    timings[name].samples.append(elapsed)
            if time.perf_counter() > deadline:
                print(f"time limit reached after {r + 1 - warmup} of {rounds} timed rounds")
                break
    finally:
        gc.enable()
    return timings


def paired_ratio(ours: Timing, reference: Timing) -> float:
    """Median over rounds of ``ours / reference`` within the same round: robust to the
    machine slowing down for a stretch of rounds, which hits both sides of a pair."""
    return statistics.median(a / b for a, b in zip(ours.samples, reference.samples))


def slow_rounds(timings: Dict[str, Timing], factor: float = 2.0) -> int:
    """Rounds that took over ``factor`` times the fastest round (a throttled machine)."""
    totals = [sum(step) for step in zip(*(t.samples for t in timings.values()))]
    return sum(total > factor * min(totals) for total in totals)


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Best observed bytes moved (read + write) per second by a large tensor copy."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def floor_bytes(shape: Shape, unique_rows: float, state_per_row: int = 2) -> float:
    """Bytes ours with Adam must move per step: the pooled lookup reads ``B*T*D``
    floats; the update reads and writes weight + ``state_per_row`` moments of every
    touched row. (Gradients, ids and outputs are left out: a lower bound.)"""
    lookup = shape.batch_size * shape.tables * shape.dim * 4
    update = unique_rows * (1 + state_per_row) * shape.dim * 4 * 2
    return float(lookup + update)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --- report ------------------------------------------------------------------------


def csv_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per timed variant (and the backward + update part of ours with Adam)."""
    parts = dict(result["variants"], **{"ours adam: backward + fused update": result["adam_backward_update"]})
    return [
        {
            "variant": name, **{k: v for k, v in t.items() if k != "samples_ms"},
            "vs_fbgemm_median": result["ratio_median_vs_fbgemm"].get(name),
            "vs_fbgemm_paired": result["ratio_paired_vs_fbgemm"].get(name),
            "floor_ms_adam": result["floor_ms_adam"],
        }
        for name, t in parts.items()
    ]


def plot(result: Dict[str, Any], path: str) -> None:
    """Median ms per variant as bars, the memory-bandwidth floor of ours adam as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = csv_rows(result)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh([r["variant"] for r in rows], [r["median_ms"] for r in rows], color="tab:blue")
    ax.axvline(result["floor_ms_adam"], color="tab:red", linestyle="--",
               label=f"memory-bandwidth floor, ours adam ({result['floor_ms_adam']:.1f} ms)")
    ax.invert_yaxis()
    ax.set_xlabel("median ms / step")
    s = result["shape"]
    ax.set_title(f"embedding step: {s['tables']} x {s['rows']:,} rows, dim {s['dim']}, batch {s['batch_size']:,}",
                 fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_outputs(result: Dict[str, Any], out: str, json_path: Optional[str]) -> None:
    """``embedding_step.{json,csv,png}`` in ``out`` (PNG only with matplotlib), and the
    JSON also at ``json_path`` if given."""
    os.makedirs(out, exist_ok=True)
    for path in [os.path.join(out, "embedding_step.json")] + ([json_path] if json_path else []):
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    rows = csv_rows(result)
    with open(os.path.join(out, "embedding_step.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib  # noqa: F401
        plot(result, os.path.join(out, "embedding_step.png"))
    except ImportError:
        print("matplotlib is not installed: no PNG (CSV and JSON written)")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16_384)
    parser.add_argument("--steps", type=int, default=200, help="timed rounds (steps per variant)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    parser.add_argument(
        "--zipf", type=float, default=1.0,
        help="power-law exponent of the id distribution (1.0: ~170K distinct rows per "
        "step at the default shape)",
    )
    parser.add_argument(
        "--time-limit", type=float, default=120.0, metavar="SECONDS",
        help="stop the timed rounds early after this long (default 120)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=str, default=None, metavar="PATH", help="also write results here")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
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

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"CPU: {cpu_model()} ({os.cpu_count()} logical cores)")
    print(f"shape: {shape.tables} tables x {shape.rows:,} rows, dim {shape.dim}, "
          f"batch {shape.batch_size:,}, single-hot; ids power-law p(rank k) ~ k**-{args.zipf:.2f} "
          f"(zipf exponent {args.zipf:.2f}) per table")

    batches = make_batches(shape, args.zipf, NUM_BATCHES, SEED)
    unique = [b.unique_rows for b in batches]
    mean_unique = statistics.fmean(unique)
    print(f"distinct rows per step (all tables): mean {mean_unique:,.0f} "
          f"(min {min(unique):,}, max {max(unique):,}) over {len(batches)} cycled batches; "
          f"lookups per step {shape.tables * shape.batch_size:,}")

    bandwidth_before = copy_bandwidth()
    grad = torch.randn(shape.batch_size, shape.tables * shape.dim)
    adam = make_ours(shape, "adam")
    adagrad = make_ours(shape, "rowwise_adagrad")
    with torch.no_grad():  # all three start from the same tables
        initial = [adam.embedding_bags[f"t{t}"].weight for t in range(shape.tables)]
        for t in range(shape.tables):
            adagrad.embedding_bags[f"t{t}"].weight.copy_(initial[t])
    tbe = make_fbgemm(shape, initial)

    adam_backward = Timing()
    variants: Dict[str, Callable[[Batch], None]] = {
        ADAM_NAME: ours_step_split(adam, grad, adam_backward),
        ADAGRAD_NAME: ours_step(adagrad, grad),
        FBGEMM_NAME: fbgemm_step(tbe, grad),
        FORWARD_NAME: ours_forward(adam),
    }
    print(f"running {args.warmup} warm-up + {args.steps} timed rounds of {len(variants)} "
          "variants, interleaved ...", flush=True)
    timings = run_interleaved(variants, batches, args.steps, args.warmup, args.time_limit)
    adam_backward.samples = adam_backward.samples[args.warmup:]
    for name, module in ((ADAM_NAME, adam), (ADAGRAD_NAME, adagrad)):
        steps = module.clip_stats()["t0"].steps
        assert steps == args.warmup + len(timings[name].samples), f"{name}: {steps} updates"

    # Best of a measurement before and after the rounds: a copy that another process
    # slows down only under-states the bandwidth (and over-states the floor).
    bandwidth = max(bandwidth_before, copy_bandwidth())
    floor_ms = floor_bytes(shape, mean_unique) / bandwidth * 1e3
    reference = timings[FBGEMM_NAME].median
    ratios = {
        name: timings[name].median / reference for name in (ADAM_NAME, ADAGRAD_NAME)
    }
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
    print(f"memory-bandwidth floor (ours adam): {floor_bytes(shape, mean_unique) / 1e6:.1f} MB "
          f"per step / {bandwidth / 1e9:.1f} GB/s copy bandwidth (512 MB copy, read+write) "
          f"= {floor_ms:.1f} ms; ours adam median is {timings[ADAM_NAME].median / floor_ms:.1f}x "
          "the floor")
    if slow:
        print(f"note: {slow} of {rounds_done} rounds took over 2x the fastest round (the "
              "machine was slowed down meanwhile); trust min and the paired ratio more")
    rows = [["variant", "median ms", "min ms", "mean ms", "vs fbgemm", "paired"]]
    for name in (ADAM_NAME, ADAGRAD_NAME, FBGEMM_NAME):
        t = timings[name]
        rows.append([name, f"{t.median:.1f}", f"{t.minimum:.1f}",
                     f"{statistics.fmean(t.samples):.1f}", f"{t.median / reference:.2f}",
                     f"{paired[name]:.2f}" if name in paired else "1.00"])
    forward = timings[FORWARD_NAME]
    rows.append(["  ours adam: forward only (no_grad)", f"{forward.median:.1f}",
                 f"{forward.minimum:.1f}", f"{statistics.fmean(forward.samples):.1f}", "", ""])
    rows.append(["  ours adam: backward + fused update", f"{adam_backward.median:.1f}",
                 f"{adam_backward.minimum:.1f}", f"{statistics.fmean(adam_backward.samples):.1f}",
                 "", ""])
    rows.append(["  memory-bandwidth floor (ours adam)", f"{floor_ms:.1f}", "", "", "", ""])
    print(f"\nper step, {rounds_done} interleaved rounds, {torch.get_num_threads()} threads "
          "(vs fbgemm: median / fbgemm median; paired: median of per-round ratios):")
    print(format_table(rows))
    print(f"adam+cowclip / fbgemm rowwise_adagrad = {ratios[ADAM_NAME]:.2f}")
    print(f"rowwise_adagrad+cowclip / fbgemm rowwise_adagrad = {ratios[ADAGRAD_NAME]:.2f}")

    return result


if __name__ == "__main__":
    main()

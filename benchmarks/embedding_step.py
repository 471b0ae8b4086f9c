"""Time per training step of the embedding layer: ours against FBGEMM's fused TBE.

What it measures: forward + backward + in-backward optimizer update, per step, on CPU, of

1. ``CowClipEmbeddingBagCollection(optimizer="adam", cowclip=CowClip(...))`` (the
   default CPU path: the native kernels of ``torchrec_cowclip/embedding/native.py``);
2. ``CowClipEmbeddingBagCollection(optimizer="rowwise_adagrad", cowclip=CowClip(...))``;
3. FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` with ``EXACT_ROWWISE_ADAGRAD``
   (``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``), the fused kernel TorchRec itself
   uses on CPU - the reference point of ours with Adam;
4. the same TBE in FBGEMM's ``WeightDecayMode.COWCLIP`` - the like-for-like reference of
   ours with row-wise Adagrad;
5. ours with Adam on the previous CPU path (``TORCHREC_COWCLIP_COMPILE=inductor``: torch
   sort + segment ``embedding_bag`` + the Inductor-compiled row step);
6. with ``--half``: ours with Adam on float16 and on bfloat16 tables;
7. with ``--rules``: ours with the rules TorchRec users set beyond the paper's - per-element
   Adagrad (``EXACT_ADAGRAD``) and AdamW (decoupled weight decay 1e-4) - each with the clip,
   reported as paired ratios to ours with Adam and with row-wise Adagrad;

plus, for ours with Adam, the forward alone (under ``torch.no_grad()``) and the
backward + update part of the full step.

Every variant sees the same inputs: a few pre-generated single-hot batches (one id per
feature per sample, as Criteo) with power-law ids, ``p(rank k) ~ k**-zipf`` per table
(ranks mapped to rows by a fixed random permutation per table, as hashing would), and
one fixed random upstream gradient ``g``. A step is ``ebc(kjt).values().backward(g)``
(the TBE: ``tbe(indices, offsets).backward(g)``): no loss of the benchmark's own in the
timing (``--loss mul-sum`` times ``(values * g).sum().backward()`` instead, as the
versions before the native kernels did: about 7 ms more for every variant at the default
shape). Runs are interleaved: each round runs every variant once, in an order rotated
every round; the report gives the median and minimum ms/step per variant and the paired
ratios (median over rounds of the per-round ratio), and the load averages of the machine
before and after (``/proc/loadavg``).

It also prints a memory-bandwidth floor for ours with Adam: the bytes a step must move
(pooled lookup reads plus read + write of the touched rows' weight and two Adam
moments) divided by the measured copy bandwidth of this machine, and the table and
optimizer-state bytes of each variant.

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
    load_average,
    paired_ratio,
    run_interleaved,
    single_hot_batches,
    slow_rounds,
    write_csv,
    write_json,
    write_png,
)

from torchrec_cowclip.optim.row_step import set_compiled_update  # noqa: E402

NUM_BATCHES = 4  # distinct pre-generated batches, cycled

FBGEMM_NAME = "fbgemm TBE rowwise_adagrad"
FBGEMM_COWCLIP_NAME = "fbgemm TBE rowwise_adagrad+COWCLIP"
ADAM_NAME = "ours adam+cowclip"
ADAGRAD_NAME = "ours rowwise_adagrad+cowclip"
INDUCTOR_NAME = "ours adam+cowclip, Inductor update"
FORWARD_NAME = "ours adam: forward only (no_grad)"
HALF_NAMES = {"fp16": "ours adam+cowclip, fp16 tables", "bf16": "ours adam+cowclip, bf16 tables"}
#: ``--rules``: the variant of each rule (AdamW with decoupled weight decay 1e-4).
RULE_NAMES = {"adagrad": "ours adagrad+cowclip (per-element)", "adamw": "ours adamw+cowclip"}
RULE_WEIGHT_DECAY = {"adagrad": 0.0, "adamw": 1e-4}


@dataclass(frozen=True)
class Shape:
    tables: int
    rows: int
    dim: int
    batch_size: int

    @property
    def table_rows(self) -> List[int]:
        return [self.rows] * self.tables


def backward_step(module: Any, grad: Tensor, loss: str) -> Callable[[Batch], None]:
    """One step of ours (a KJT in) or of the TBE (indices and offsets in)."""

    def pooled(batch: Batch) -> Tensor:
        if hasattr(module, "fused_optimizer") and not hasattr(module, "split_embedding_weights"):
            out: Tensor = module(batch.kjt).values()
            return out
        result: Tensor = module(batch.indices, batch.offsets)
        return result

    def step(batch: Batch) -> None:
        if loss == "mul-sum":
            (pooled(batch) * grad).sum().backward()
        else:
            pooled(batch).backward(grad)

    return step


def ours_forward(ebc: Any) -> Callable[[Batch], None]:
    def step(batch: Batch) -> None:
        with torch.no_grad():
            ebc(batch.kjt)

    return step


def ours_step_split(
    ebc: Any, grad: Tensor, backward_ms: Timing, loss: str
) -> Callable[[Batch], None]:
    """The full step, also recording the time of its backward (+ fused update) part."""

    def step(batch: Batch) -> None:
        values = ebc(batch.kjt).values()
        start = time.perf_counter()
        if loss == "mul-sum":
            (values * grad).sum().backward()
        else:
            values.backward(grad)
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
            "vs_fbgemm_cowclip_paired": result["ratio_paired_vs_fbgemm_cowclip"].get(name),
            "storage_bytes": result["storage_bytes"].get(name),
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
        "--loss",
        choices=("backward", "mul-sum"),
        default="backward",
        help="what a step's backward starts from: backward(g) on the pooled values "
        "(default), or (values * g).sum() as before the native kernels",
    )
    parser.add_argument(
        "--half", action="store_true", help="also time ours with Adam on fp16 and bf16 tables"
    )
    parser.add_argument(
        "--rules",
        action="store_true",
        help="also time ours with per-element Adagrad and with AdamW",
    )
    parser.add_argument(
        "--no-inductor",
        action="store_true",
        help="leave out ours on the Inductor-compiled update (its first step compiles)",
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

    load_before = load_average()
    print(f"load average before: {load_before}")
    bandwidth_before = copy_bandwidth()
    grad = torch.randn(shape.batch_size, shape.tables * shape.dim)
    adam = bench.make_ours(shape.table_rows, shape.dim, "adam")
    adagrad = bench.make_ours(shape.table_rows, shape.dim, "rowwise_adagrad")
    ours_modules: Dict[str, Any] = {ADAM_NAME: adam, ADAGRAD_NAME: adagrad}
    if not args.no_inductor:
        # Its row kernel (the Inductor row step) is chosen when it is built.
        previous = set_compiled_update("inductor")
        ours_modules[INDUCTOR_NAME] = bench.make_ours(shape.table_rows, shape.dim, "adam")
        set_compiled_update(previous)
    if args.half:
        for kind, name in HALF_NAMES.items():
            ours_modules[name] = bench.make_ours(
                shape.table_rows, shape.dim, "adam", data_type=kind
            )
    if args.rules:
        for rule, name in RULE_NAMES.items():
            ours_modules[name] = bench.make_ours(
                shape.table_rows, shape.dim, rule, weight_decay=RULE_WEIGHT_DECAY[rule]
            )
    with torch.no_grad():  # all start from the same tables
        initial = [adam.embedding_bags[f"t{t}"].weight for t in range(shape.tables)]
        for module in ours_modules.values():
            for t in range(shape.tables):
                module.embedding_bags[f"t{t}"].weight.copy_(initial[t])
    tbe = bench.make_tbe(shape.table_rows, shape.dim, initial=initial)
    tbe_cowclip = bench.make_tbe(
        shape.table_rows, shape.dim, initial=initial, **bench.fbgemm_cowclip_options()
    )

    adam_backward = Timing()
    variants: Dict[str, Callable[[Batch], None]] = {
        ADAM_NAME: ours_step_split(adam, grad, adam_backward, args.loss),
        ADAGRAD_NAME: backward_step(adagrad, grad, args.loss),
        FBGEMM_NAME: backward_step(tbe, grad, args.loss),
        FBGEMM_COWCLIP_NAME: backward_step(tbe_cowclip, grad, args.loss),
        FORWARD_NAME: ours_forward(adam),
    }
    if not args.no_inductor:
        variants[INDUCTOR_NAME] = backward_step(ours_modules[INDUCTOR_NAME], grad, args.loss)
        print("compiling the Inductor variant's update (first step) ...", flush=True)
        variants[INDUCTOR_NAME](batches[0])
    for name in (*HALF_NAMES.values(), *RULE_NAMES.values()):
        if name in ours_modules:
            variants[name] = backward_step(ours_modules[name], grad, args.loss)
    print(
        f"running {args.warmup} warm-up + {args.steps} timed rounds of {len(variants)} "
        "variants, interleaved ...",
        flush=True,
    )
    timings = run_interleaved(variants, batches, args.steps, args.warmup, args.time_limit)
    adam_backward.samples = adam_backward.samples[args.warmup :]
    load_after = load_average()
    for name, module in ((ADAM_NAME, adam), (ADAGRAD_NAME, adagrad)):
        steps = module.clip_stats()["t0"].steps
        assert steps == args.warmup + len(timings[name].samples), f"{name}: {steps} updates"
    storage = {name: module.table_storage_bytes() for name, module in ours_modules.items()}
    for name, module in ((FBGEMM_NAME, tbe), (FBGEMM_COWCLIP_NAME, tbe_cowclip)):
        storage[name] = bench.tbe_storage_bytes(module)

    # Best of a measurement before and after the rounds: a copy that another process
    # slows down only under-states the bandwidth (and over-states the floor).
    bandwidth = max(bandwidth_before, copy_bandwidth())
    floor = floor_bytes(shape.batch_size * shape.tables, shape.dim, mean_unique)
    floor_ms = floor / bandwidth * 1e3
    reference = timings[FBGEMM_NAME].median
    compared = [n for n in timings if n not in (FBGEMM_NAME, FORWARD_NAME)]
    ratios = {name: timings[name].median / reference for name in compared}
    paired = {name: paired_ratio(timings[name], timings[FBGEMM_NAME]) for name in compared}
    paired_cowclip = {
        name: paired_ratio(timings[name], timings[FBGEMM_COWCLIP_NAME])
        for name in compared
        if name != FBGEMM_COWCLIP_NAME
    }
    rules_paired = {
        name: {
            "vs_adam": paired_ratio(timings[name], timings[ADAM_NAME]),
            "vs_rowwise_adagrad": paired_ratio(timings[name], timings[ADAGRAD_NAME]),
        }
        for name in RULE_NAMES.values()
        if name in timings
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
        "ratio_paired_vs_fbgemm_cowclip": paired_cowclip,
        "ratio_paired_rules": rules_paired,
        "floor_ratio_adam": timings[ADAM_NAME].median / floor_ms,
        "storage_bytes": storage,
        "loss": args.loss,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "compile_mode": os.environ.get("TORCHREC_COWCLIP_COMPILE", "auto"),
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
    rows = [
        ["variant", "median ms", "min ms", "mean ms", "paired vs fbgemm", "paired vs COWCLIP", "MB"]
    ]
    for name in timings:
        if name == FORWARD_NAME:
            continue
        t = timings[name]
        rows.append(
            [
                name,
                f"{t.median:.1f}",
                f"{t.minimum:.1f}",
                f"{statistics.fmean(t.samples):.1f}",
                f"{paired[name]:.2f}" if name in paired else "1.00",
                f"{paired_cowclip[name]:.2f}" if name in paired_cowclip else "1.00",
                f"{storage[name] / 1e6:.0f}" if name in storage else "",
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
            "",
        ]
    )
    rows.append(["  memory-bandwidth floor (ours adam)", f"{floor_ms:.1f}", "", "", "", "", ""])
    print(
        f"\nper step, {rounds_done} interleaved rounds, {torch.get_num_threads()} threads "
        "(vs fbgemm: median / fbgemm median; paired: median of per-round ratios):"
    )
    print(format_table(rows))
    print(f"adam+cowclip / fbgemm rowwise_adagrad (paired) = {paired[ADAM_NAME]:.2f}")
    print(
        f"rowwise_adagrad+cowclip / fbgemm rowwise_adagrad COWCLIP (paired) = "
        f"{paired_cowclip[ADAGRAD_NAME]:.2f}"
    )
    for name, pair in rules_paired.items():
        print(
            f"{name} / ours adam+cowclip (paired) = {pair['vs_adam']:.2f}; "
            f"/ ours rowwise_adagrad+cowclip = {pair['vs_rowwise_adagrad']:.2f}"
        )
    print(f"adam+cowclip / memory-bandwidth floor = {timings[ADAM_NAME].median / floor_ms:.1f}")
    print(f"load average before: {load_before}; after: {load_after}")

    return result


if __name__ == "__main__":
    main()

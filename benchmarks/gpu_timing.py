"""GPU timings: the Triton kernels alone, the embedding step against FBGEMM's TBE, a
CUDA-graph-captured DeepFM step, and DeepFM samples/s from batch 16K to 128K.

Meant for a machine with one NVIDIA GPU, torch and Triton (and, for every part but the
first, torchrec and fbgemm_gpu); ``benchmarks/gpu.sh`` runs it after ``pytest -m gpu``
(the correctness of what is timed here, on the same device). Every part also runs on CPU
at tiny sizes (``--device cpu --quick``; the Triton kernels under Triton's interpreter,
``TRITON_INTERPRET=1``), which is how ``tests/test_benchmark_outputs.py`` keeps it working
without a GPU. The update path of our collections is ``--compile`` (default on CUDA ``1``:
the Triton kernels).

Parts (``--parts``; default all on CUDA, all but ``cuda_graph`` on CPU):

1. ``kernels`` (torch and Triton only, ``gpu_kernels.py``): one table batch of Criteo
   Kaggle's 26 tables, the Triton path's lookup, grouping and fused update per step (Adam
   and row-wise Adagrad, CowClip on), the same step captured in a CUDA graph, and the path
   before the Triton kernels (ATen lookup and grouping, the Inductor row step).
2. ``embedding``: forward + backward + fused update per step on the 26 tables of Criteo
   Kaggle (``CRITEO_KAGGLE_CARDINALITIES``, full size unless ``--max-rows``), dim 16,
   batches 16K and 128K, single-hot power-law ids: ours Adam + CowClip and row-wise
   Adagrad + CowClip (``--compile``'s kernel), ours Adam + CowClip on the Inductor row
   step, and FBGEMM's TBE with ``EXACT_ROWWISE_ADAGRAD`` (no clipping), its own COWCLIP
   mode and ``ADAM`` where this fbgemm_gpu has them; plus our row step alone (compiled and
   eager) on the rows one batch touches. Interleaved rounds (``common.run_interleaved``),
   CUDA events on CUDA; and the memory-bandwidth floor of ours from a measured device copy.
3. ``cuda_graph``: the paper's DeepFM (Criteo Kaggle's cardinalities, capped by
   ``--max-rows``) trained one step at a time - forward, backward with the fused update,
   the dense Adam step (``capturable=True``) - eagerly and as one captured CUDA graph
   replayed on new single-hot batches copied into its static inputs (CUDA only).
4. ``deepfm``: DeepFM (D 10, DNN 400-400-400, Adam + CowClip tables, dense Adam) trained
   the way the trainer does it (``BatchIterator`` over the memory-mapped binary cache,
   shuffled, ``prefetch=2``, through TorchRec's ``TrainPipelineBase``, ``float(loss)``
   every step) on ``synthetic:N`` with Criteo Kaggle's full cardinalities, at each batch of
   ``--deepfm-batches`` (16K to 128K). Generating all 45.8M rows would not fit the time
   budget, so it builds an N-row cache (timed), measures steps/s over the timed steps, and
   EXTRAPOLATES one epoch of 45,840,617 rows at batch 131,072; it says so, and whether the
   goal (< 60 s per epoch on one H200) is met.

Run::

    python benchmarks/gpu_timing.py                       # CUDA if available, full sizes
    TRITON_INTERPRET=1 python benchmarks/gpu_timing.py --device cpu --quick  # tiny, CPU

Results: ``<out>/gpu_timing.json`` (rewritten after each part); the tables are printed
last. Exit status 0 when every part ran, 2 when one could not (an error, a missing
package, the time budget).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by path
from common import (  # noqa: E402
    ADAM_LR,
    COWCLIP,
    EPS,
    RESULTS,
    Batch,
    PowerLawIds,
    copy_bandwidth,
    criteo_table_rows,
    fbgemm_cowclip_options,
    fbgemm_step,
    floor_bytes,
    format_table,
    make_ours,
    make_tbe,
    ours_step,
    paper_deepfm,
    run_interleaved,
    single_hot_batches,
    sync,
    write_json,
)
from gpu_kernels import kernel_table, run_kernels  # noqa: E402

from torchrec_cowclip import CowClip, CowClipOptions  # noqa: E402
from torchrec_cowclip.optim import row_step  # noqa: E402
from torchrec_cowclip.optim.functional import adam_bias_corrections  # noqa: E402

PARTS = ("kernels", "embedding", "cuda_graph", "deepfm")
EPOCH_GOAL_S = 60.0
GOAL_BATCH = 131_072

ADAM_NAME = "ours adam+cowclip"
ADAGRAD_NAME = "ours rowwise_adagrad+cowclip"
INDUCTOR_NAME = "ours adam+cowclip (inductor row step)"
FBGEMM_NAME = "fbgemm TBE exact_rowwise_adagrad (no clip)"
FBGEMM_COWCLIP_NAME = "fbgemm TBE exact_rowwise_adagrad, its COWCLIP mode"
FBGEMM_ADAM_NAME = "fbgemm TBE adam (no clip)"
ROW_STEP_NAME = "ours adam: row step alone ({path})"


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def environment(device: torch.device) -> Dict[str, Any]:
    info: Dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }
    for name in ("triton", "fbgemm_gpu", "torchrec"):
        try:
            info[name] = getattr(__import__(name), "__version__", "?")
        except Exception as error:  # noqa: BLE001 - a broken binary raises OSError/RuntimeError too
            info[name] = f"not importable ({type(error).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return info


# --- embedding step ----------------------------------------------------------------


def row_step_variant(
    rows: Sequence[int], dim: int, device: torch.device, compiled: bool, batches: Sequence[Batch]
) -> Callable[[Batch], None]:
    """Our row step alone (Adam + CowClip) on the distinct rows each batch touches, on
    one table of all the tables' rows."""
    total = sum(rows)
    table = torch.randn(total, dim, device=device) * 0.01
    state = {
        "exp_avg": torch.zeros(total, dim, device=device),
        "exp_avg_sq": torch.zeros(total, dim, device=device),
    }
    offsets = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    inputs = {}
    for b in batches:
        unique, counts = np.unique(
            np.concatenate([ids + off for ids, off in zip(b.per_table, offsets)]),
            return_counts=True,
        )
        counts_t = torch.from_numpy(counts).to(device)
        bias = adam_bias_corrections(torch.full_like(counts_t, 10), 0.9, 0.999)
        inputs[id(b)] = (
            torch.from_numpy(unique).to(device),
            torch.randn(unique.size, dim, device=device) * 0.01,
            counts_t,
            bias,
        )
    call = row_step.row_step(compiled)

    def step(batch: Batch) -> None:
        unique, grad, counts, bias = inputs[id(batch)]
        call(
            table,
            state,
            unique,
            grad,
            counts,
            optimizer="adam",
            lr=ADAM_LR,
            betas=(0.9, 0.999),
            eps=EPS,
            weight_decay=0.0,
            cowclip=COWCLIP,
            adam_bias=bias,
        )

    return step


def run_embedding(
    device: torch.device, args: argparse.Namespace, deadline: float
) -> Dict[str, Any]:
    rows = criteo_table_rows(args.max_rows)
    dim = args.dim
    result: Dict[str, Any] = {
        "tables": len(rows),
        "rows": sum(rows),
        "max_rows": args.max_rows,
        "dim": dim,
        "zipf": args.zipf,
        "per_batch": [],
        "skipped": [],
    }
    print(
        f"embedding step: {len(rows)} Criteo-Kaggle tables, {sum(rows):,} rows"
        f"{f' (capped at {args.max_rows} per table)' if args.max_rows else ' (full size)'}, dim {dim}",
        flush=True,
    )
    t0 = time.perf_counter()
    ids = PowerLawIds(rows, args.zipf, seed=0)
    result["sampler_setup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    adam = make_ours(rows, dim, "adam", device)
    adagrad = make_ours(rows, dim, "rowwise_adagrad", device)
    initial = [adam.embedding_bags[f"t{t}"].weight.detach() for t in range(len(rows))]
    with torch.no_grad():
        for t in range(len(rows)):
            adagrad.embedding_bags[f"t{t}"].weight.copy_(initial[t])
    previous = row_step.set_compiled_update("inductor")
    try:
        inductor = make_ours(rows, dim, "adam", device)
    finally:
        row_step.set_compiled_update(previous)
    with torch.no_grad():
        for t in range(len(rows)):
            inductor.embedding_bags[f"t{t}"].weight.copy_(initial[t])
    tbes: Dict[str, Any] = {}
    for name, options in (
        (FBGEMM_NAME, {}),
        (FBGEMM_COWCLIP_NAME, "cowclip"),
        (FBGEMM_ADAM_NAME, {"optimizer": "ADAM"}),
    ):
        try:
            kwargs = fbgemm_cowclip_options() if options == "cowclip" else dict(options)
            tbes[name] = make_tbe(rows, dim, device, initial, **kwargs)
        except Exception as error:  # noqa: BLE001 - no fbgemm_gpu, or no kernel for this device
            result["skipped"].append(f"{name}: {type(error).__name__}: {str(error)[:200]}")
    result["our_kernel"] = repr(adam.row_kernel)
    sync(device)
    result["build_s"] = time.perf_counter() - t0
    result["copy_bandwidth_bytes_per_s"] = bandwidth = copy_bandwidth(
        64 if args.quick else 1024, device=device
    )
    path = {"1": "compiled", "0": "eager", "auto": "auto", "triton": "compiled"}[args.compile]
    for bs in args.batch_sizes:
        if time.perf_counter() > deadline:
            result["skipped"].append(f"batch {bs}: time budget spent")
            continue
        t0 = time.perf_counter()
        batches = single_hot_batches(rows, bs, args.zipf, 3, device=device, ids=ids)
        make_s = time.perf_counter() - t0
        grad = torch.randn(bs, len(rows) * dim, device=device)
        variants: Dict[str, Callable[[Batch], None]] = {
            ADAM_NAME: ours_step(adam, grad),
            ADAGRAD_NAME: ours_step(adagrad, grad),
            INDUCTOR_NAME: ours_step(inductor, grad),
        }
        for name, tbe in tbes.items():
            variants[name] = fbgemm_step(tbe, grad)
        variants[ROW_STEP_NAME.format(path=path)] = row_step_variant(
            rows, dim, device, True, batches
        )
        if args.compile != "0":  # the same step uncompiled, for the compiler's gain
            variants[ROW_STEP_NAME.format(path="eager")] = row_step_variant(
                rows, dim, device, False, batches
            )
        unique = [b.unique_rows for b in batches]
        print(
            f"  batch {bs:,}: {statistics.fmean(unique):,.0f} distinct rows per step; {args.warmup} warm-up "
            f"+ up to {args.steps} rounds of {len(variants)} variants ...",
            flush=True,
        )
        limit = min(args.part_time_limit_s, max(deadline - time.perf_counter(), 1.0))
        failed: Dict[str, str] = {}
        try:
            timings = run_interleaved(
                variants, batches, args.steps, args.warmup, limit, device, failures=failed
            )
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: report, go on
            result["skipped"].append(f"batch {bs}: {type(error).__name__}: {error}")
            traceback.print_exc()
            continue
        result["per_batch"].append(
            {
                "batch_size": bs,
                "distinct_rows": unique,
                "make_batches_s": make_s,
                "floor_ms_adam": floor_bytes(bs * len(rows), dim, statistics.fmean(unique))
                / bandwidth
                * 1e3,
                "variants": {
                    n: {
                        "median_ms": t.median,
                        "min_ms": t.minimum,
                        "steps": len(t.samples),
                        "samples_ms": t.samples,
                    }
                    for n, t in timings.items()
                    if t.samples and n not in failed
                },
                # Each failing variant alone (the others' timings stand): its error.
                "failed": failed,
            }
        )
        del batches, variants
        free_memory(device)
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def embedding_table(result: Dict[str, Any]) -> str:
    rows = [
        [
            "batch",
            "variant",
            "median ms",
            "min ms",
            "vs fbgemm adagrad",
            "vs fbgemm adam",
            "samples/s",
        ]
    ]
    for entry in result["per_batch"]:
        v = entry["variants"]
        refs = [v.get(name, {}).get("median_ms") for name in (FBGEMM_NAME, FBGEMM_ADAM_NAME)]
        for name, t in v.items():
            whole = "row step alone" not in name
            rows.append(
                [
                    f"{entry['batch_size']:,}",
                    name,
                    f"{t['median_ms']:.2f}",
                    f"{t['min_ms']:.2f}",
                    *[f"{t['median_ms'] / ref:.2f}" if ref and whole else "-" for ref in refs],
                    f"{entry['batch_size'] / (t['median_ms'] / 1e3):,.0f}" if whole else "",
                ]
            )
        for name, error in entry.get("failed", {}).items():
            rows.append([f"{entry['batch_size']:,}", name, "FAILED", error[:60], "", "", ""])
        rows.append(
            [
                f"{entry['batch_size']:,}",
                "memory-bandwidth floor (ours adam)",
                f"{entry['floor_ms_adam']:.2f}",
                "",
                "",
                "",
                "",
            ]
        )
    return format_table(rows)


# --- a CUDA-graph-captured DeepFM step -------------------------------------------------


def run_cuda_graph(
    device: torch.device, args: argparse.Namespace, deadline: float
) -> Dict[str, Any]:
    """The paper's DeepFM trained one step at a time, eagerly and as one captured CUDA
    graph (forward, backward with the fused update, the dense Adam step) replayed on new
    batches copied into its static inputs; ms per step of both."""
    from torchrec import KeyedJaggedTensor

    from torchrec_cowclip.data.schema import CRITEO_KAGGLE_CARDINALITIES
    from torchrec_cowclip.models import build_model

    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    cardinalities = [
        k if args.max_rows is None else min(k, args.max_rows) for k in CRITEO_KAGGLE_CARDINALITIES
    ]
    names = [f"C{i + 1}" for i in range(len(cardinalities))]
    bs = args.graph_batch
    result: Dict[str, Any] = {"batch_size": bs, "tables": len(names)}
    options = CowClipOptions(lr=1e-4, cowclip=CowClip.from_reference(1.0, 1e-5, 10))

    def model_and_optimizer() -> Any:
        model = build_model(
            "deepfm",
            sparse_names=names,
            cardinalities=cardinalities,
            num_dense=13,
            embedding_dim=10,
            hidden=(400, 400, 400),
            embedding_options=options,
            device=device,
            init_seed=0,
        )
        return model, torch.optim.Adam(model.dense_parameters(), lr=1e-3, capturable=True)

    gen = torch.Generator(device=device).manual_seed(0)
    limits = torch.tensor(cardinalities, device=device).repeat_interleave(bs)

    def batch() -> List[Tensor]:
        values = (torch.rand(len(names) * bs, device=device, generator=gen) * limits).long()
        dense = torch.rand(bs, 13, device=device, generator=gen)
        labels = (torch.rand(bs, device=device, generator=gen) < 0.25).float()
        return [values, dense, labels]

    lengths = torch.ones(len(names) * bs, dtype=torch.int64, device=device)
    # Single-hot: the offsets are known, computed here by torch (TorchRec computes them
    # with fbgemm_gpu's CUDA cumsum, absent from a CPU build of fbgemm_gpu).
    offsets = torch.arange(len(names) * bs + 1, device=device)

    def train_step(model: Any, optimizer: Any, inputs: List[Tensor]) -> Tensor:
        values, dense, labels = inputs
        kjt = KeyedJaggedTensor(keys=names, values=values, lengths=lengths, offsets=offsets)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    batches = [batch() for _ in range(3)]
    eager_model, eager_opt = model_and_optimizer()
    graph_model, graph_opt = model_and_optimizer()
    static = [t.clone() for t in batches[0]]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the graph: caches, optimizer state
            train_step(graph_model, graph_opt, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(graph):
        static_loss = train_step(graph_model, graph_opt, static)
    result["capture_s"] = time.perf_counter() - t0

    def replay(inputs: List[Tensor]) -> None:
        for dst, src in zip(static, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()

    variants: Dict[str, Callable[[Any], None]] = {
        "eager step": lambda inputs: train_step(eager_model, eager_opt, inputs),
        "CUDA graph replay": replay,
    }
    limit = min(args.part_time_limit_s, max(deadline - time.perf_counter(), 1.0))
    failed: Dict[str, str] = {}
    timings = run_interleaved(
        variants, batches, args.steps, args.warmup, limit, device, failures=failed
    )
    result["variants"] = {
        n: t.summary() for n, t in timings.items() if t.samples and n not in failed
    }
    result["failed"] = failed
    result["last_graph_loss"] = float(static_loss)
    result["table_steps"] = {
        name: s.steps for name, s in graph_model.embedding_collection.clip_stats().items()
    }
    return result


def cuda_graph_table(r: Dict[str, Any]) -> str:
    v = r["variants"]
    eager = v.get("eager step", {}).get("median_ms")
    rows = [["variant", "median ms", "min ms", "samples/s", "vs eager"]]
    for name, t in v.items():
        rows.append(
            [
                name,
                f"{t['median_ms']:.2f}",
                f"{t['min_ms']:.2f}",
                f"{r['batch_size'] / (t['median_ms'] / 1e3):,.0f}",
                f"{t['median_ms'] / eager:.2f}" if eager else "-",
            ]
        )
    for name, error in r.get("failed", {}).items():
        rows.append([name, "FAILED", error[:60], "", ""])
    return format_table(rows)


# --- DeepFM samples/s --------------------------------------------------------------


def run_deepfm(device: torch.device, args: argparse.Namespace, deadline: float) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineBase

    from torchrec_cowclip.data import open_dataset
    from torchrec_cowclip.data.pipeline.batches import BatchIterator
    from torchrec_cowclip.data.schema import CRITEO_KAGGLE_CARDINALITIES, CRITEO_KAGGLE_ROWS
    from torchrec_cowclip.models.task import CTRTrainTask

    max_card = args.max_rows if args.max_rows is not None else max(CRITEO_KAGGLE_CARDINALITIES)
    rows = max(args.deepfm_rows, 2 * max(args.deepfm_batches))
    result: Dict[str, Any] = {
        "rows_generated": rows,
        "max_cardinality": max_card,
        "epoch_rows": CRITEO_KAGGLE_ROWS,
        "per_batch": [],
        "skipped": [],
    }
    print(
        f"deepfm: synthetic:{rows:,} (cardinalities capped at {max_card:,}) into {args.cache_dir} ...",
        flush=True,
    )
    cache = Path(args.cache_dir)
    entries_before = set(os.listdir(cache)) if cache.is_dir() else set()
    t0 = time.perf_counter()
    ds = open_dataset(f"synthetic:{rows}", args.cache_dir, max_cardinality=max_card)
    result["cache_s"] = time.perf_counter() - t0
    result["cache_reused"] = ds.path.name in entries_before
    # Linear in rows (generation is chunked); a reused cache says nothing about it.
    result["cache_s_extrapolated_to_epoch"] = (
        None if result["cache_reused"] else result["cache_s"] * CRITEO_KAGGLE_ROWS / rows
    )
    for bs in args.deepfm_batches:
        if time.perf_counter() > deadline:
            result["skipped"].append(f"batch {bs}: time budget spent")
            continue
        # The recipe at this batch (the trainer's scaling rule from batch 1024): the values
        # do not change the cost of a step, only keep the run a realistic one.
        scale = bs / 1024
        training = CowClipOptions(
            lr=1e-4, weight_decay=2 * 1e-5 * scale, cowclip=CowClip.from_reference(1.0, 1e-5, 10)
        )
        model = paper_deepfm(ds.schema, embedding_options=training, device=device)
        optimizer = torch.optim.Adam(model.dense_parameters(), lr=8e-4 * math.sqrt(scale))
        task = CTRTrainTask(model)
        task.train()
        pipeline = TrainPipelineBase(task, optimizer, device)

        def epochs(bs: int = bs) -> Iterator[Any]:
            for epoch in itertools.count():  # the timed steps may need more than one pass
                yield from BatchIterator(
                    ds, None, bs, shuffle=True, seed=0, epoch=epoch, drop_last=True, prefetch=2
                )

        batches = epochs()
        entry: Dict[str, Any] = {"batch_size": bs}
        t0 = time.perf_counter()
        for _ in range(args.deepfm_warmup):
            loss, _, _ = pipeline.progress(batches)
            float(loss)
        sync(device)
        entry["warmup_s"] = time.perf_counter() - t0
        limit = min(args.part_time_limit_s, max(deadline - time.perf_counter(), 1.0))
        losses: List[float] = []
        t0 = time.perf_counter()
        for _ in range(args.deepfm_steps):
            loss, _, _ = pipeline.progress(batches)
            losses.append(float(loss))  # the trainer reads the loss every step
            if time.perf_counter() - t0 > limit:
                break
        sync(device)
        elapsed = time.perf_counter() - t0
        steps = len(losses)
        entry.update(
            {
                "timed_steps": steps,
                "timed_s": elapsed,
                "steps_per_s": steps / elapsed,
                "samples_per_s": steps * bs / elapsed,
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "losses_finite": all(math.isfinite(x) for x in losses),
                "steps_per_epoch": math.ceil(CRITEO_KAGGLE_ROWS / bs),
            }
        )
        entry["epoch_s_extrapolated"] = entry["steps_per_epoch"] / entry["steps_per_s"]
        # Data loading alone: the same iterator, batches copied to the device, no model.
        loader = BatchIterator(
            ds, None, bs, shuffle=True, seed=0, epoch=99, drop_last=True, prefetch=2
        )
        n_load = min(len(loader), max(steps, 2))
        t0 = time.perf_counter()
        for _, b in zip(range(n_load), loader):
            b.to(device, non_blocking=True)
        sync(device)
        entry["loading_only_batches_per_s"] = n_load / (time.perf_counter() - t0)
        result["per_batch"].append(entry)
        del model, optimizer, task, pipeline, batches
        free_memory(device)
    if not result["per_batch"]:
        raise RuntimeError("no batch size ran: " + "; ".join(result["skipped"]))
    # The goal's batch, else the largest that ran: the epoch figure and the goal.
    ran = {e["batch_size"]: e for e in result["per_batch"]}
    result.update(ran.get(GOAL_BATCH, result["per_batch"][-1]))
    result["goal_applies"] = (
        device.type == "cuda"
        and result["batch_size"] == GOAL_BATCH
        and max_card >= max(CRITEO_KAGGLE_CARDINALITIES)
    )
    result["goal_met"] = result["epoch_s_extrapolated"] < EPOCH_GOAL_S
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def deepfm_lines(r: Dict[str, Any]) -> List[str]:
    reused = r["cache_s_extrapolated_to_epoch"] is None
    per_batch = format_table(
        [
            [
                "batch",
                "timed steps",
                "samples/s",
                "loader batches/s",
                "epoch s (EXTRAPOLATED)",
                "loss",
            ]
        ]
        + [
            [
                f"{e['batch_size']:,}",
                f"{e['timed_steps']}",
                f"{e['samples_per_s']:,.0f}",
                f"{e['loading_only_batches_per_s']:.1f}",
                f"{e['epoch_s_extrapolated']:.1f}",
                f"{e['first_loss']:.4f} -> {e['last_loss']:.4f}",
            ]
            for e in r["per_batch"]
        ]
    )
    table = format_table(
        [
            ["what", "value"],
            ["cache rows generated", f"{r['rows_generated']:,}"],
            [
                "cache build s (this run)",
                f"{r['cache_s']:.1f}" + (" (reused)" if r["cache_reused"] else ""),
            ],
            [
                "cache build s, linear extrapolation to the epoch's rows",
                "n/a (reused)" if reused else f"{r['cache_s_extrapolated_to_epoch']:.0f}",
            ],
            [
                f"steps per epoch of {r['epoch_rows']:,} rows at {r['batch_size']:,}",
                f"{r['steps_per_epoch']}",
            ],
        ]
    )
    verdict = "MET" if r["goal_met"] else "NOT MET"
    if not r["goal_applies"]:
        goal = (
            f"goal (< {EPOCH_GOAL_S:.0f} s per epoch, one H200, batch {GOAL_BATCH:,}, full cardinalities): "
            f"not applicable to this run (device/batch/cardinalities differ); at these settings it would "
            f"be {verdict} ({r['epoch_s_extrapolated']:.1f} s)"
        )
    else:
        goal = (
            f"GOAL < {EPOCH_GOAL_S:.0f} s per epoch of {r['epoch_rows']:,} rows at batch {GOAL_BATCH:,}: "
            f"{verdict} ({r['epoch_s_extrapolated']:.1f} s, EXTRAPOLATED from {r['timed_steps']} timed steps "
            f"over a {r['rows_generated']:,}-row cache; data loading from the cache included, cache "
            f"building not)"
        )
    return [per_batch, table, goal]


# --- main --------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes: seconds on CPU")
    p.add_argument(
        "--parts",
        default=None,
        help=f"comma list of {', '.join(PARTS)} (default all; on CPU all but cuda_graph)",
    )
    p.add_argument("--out", default=str(RESULTS / "gpu"), help="folder for gpu_timing.json")
    p.add_argument(
        "--compile",
        choices=("auto", "1", "0", "triton"),
        default=None,
        help="update path: 1 the fused kernels (Triton on CUDA; default there), 0 eager "
        "(default on CPU), triton, auto",
    )
    p.add_argument(
        "--max-rows",
        type=int,
        default=None,
        help="cap on each table's rows (default: none on CUDA, 100000 on CPU, 2000 with --quick)",
    )
    p.add_argument("--dim", type=int, default=16)
    p.add_argument(
        "--batch-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="embedding-step batches (default 16384,131072; --quick 512)",
    )
    p.add_argument(
        "--zipf", type=float, default=1.0, help="power-law exponent of the embedding-step ids"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed rounds per batch size (default 20; --quick 3)",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds first (default 3; --quick 1)"
    )
    p.add_argument(
        "--deepfm-rows",
        type=int,
        default=None,
        help="synthetic rows cached (default 4194304; --quick 4096)",
    )
    p.add_argument(
        "--deepfm-batches",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help=f"DeepFM batch sizes (default 16384,32768,65536,{GOAL_BATCH}; --quick 512)",
    )
    p.add_argument(
        "--graph-batch",
        type=int,
        default=None,
        help="batch of the CUDA-graph-captured DeepFM step (default 16384; --quick 256)",
    )
    p.add_argument(
        "--deepfm-steps", type=int, default=None, help="timed steps (default 30; --quick 3)"
    )
    p.add_argument("--deepfm-warmup", type=int, default=None, help="default 3; --quick 1")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "cowclip_gpu_cache"))
    p.add_argument(
        "--time-budget",
        type=float,
        default=300.0,
        help="seconds for the whole run: a part or batch size not started by then is skipped",
    )
    p.add_argument(
        "--part-time-limit-s",
        type=float,
        default=90.0,
        help="timed seconds per batch size / DeepFM",
    )
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda, q = args.device.startswith("cuda"), args.quick
    defaults = {
        "compile": "1" if on_cuda else "0",
        "max_rows": 2000 if q else (None if on_cuda else 100_000),
        "batch_sizes": [512] if q else [16_384, 131_072],
        "steps": 3 if q else 20,
        "warmup": 1 if q else 3,
        "deepfm_rows": 4096 if q else 4_194_304,
        "deepfm_batches": [512] if q else [16_384, 32_768, 65_536, GOAL_BATCH],
        "graph_batch": 256 if q else 16_384,
        "deepfm_steps": 3 if q else 30,
        "deepfm_warmup": 1 if q else 3,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.parts is None:
        args.parts = ",".join(p for p in PARTS if on_cuda or p != "cuda_graph")
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; expected some of {', '.join(PARTS)}")
    return args


def print_report(report: Dict[str, Any]) -> None:
    env = report["environment"]
    print("\n" + "=" * 100)
    print(
        "gpu_timing: "
        + ", ".join(f"{k} {v}" for k, v in env.items())
        + f"; update mode {report['compile']}"
    )
    k = report.get("kernels")
    if k and k["per_batch"]:
        print(
            f"\nTriton kernels alone (one table batch of {k['tables']} tables, {k['rows']:,} rows, "
            f"dim {k['dim']}): ms per step (lookup + grouping + fused update), median of "
            "interleaved rounds:"
        )
        print(kernel_table(k, format_table))
    for s in (k or {}).get("skipped", []):
        print(f"  kernels skipped: {s}")
    e = report.get("embedding")
    if e and e["per_batch"]:
        print(
            f"\nembedding step (forward + backward + fused update), {e['tables']} tables, {e['rows']:,} rows, "
            f"dim {e['dim']}, single-hot zipf {e['zipf']}; ms per step, median of interleaved rounds:"
        )
        print(embedding_table(e))
    for s in (e or {}).get("skipped", []):
        print(f"  embedding skipped: {s}")
    g = report.get("cuda_graph")
    if g:
        print(
            f"\nDeepFM step, eager and as one captured CUDA graph (batch {g['batch_size']:,}, "
            f"capture {g['capture_s']:.1f} s):"
        )
        print(cuda_graph_table(g))
    d = report.get("deepfm")
    if d:
        print(
            "\nDeepFM (D 10, DNN 400-400-400, Adam + CowClip), synthetic Criteo-like data from the binary cache:"
        )
        print("\n".join(deepfm_lines(d)))
    for name, why in report["part_errors"].items():
        print(f"  {name} not run: {why}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the parts; returns the exit status (0 all ran, 2 some could not)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_timing: --device cuda but torch sees no CUDA device")
        return 2
    deadline = time.perf_counter() + args.time_budget
    report: Dict[str, Any] = {
        "args": vars(args),
        "environment": environment(device),
        "compile": args.compile,
        "part_errors": {},
    }
    out = Path(args.out) / "gpu_timing.json"
    previous = row_step.set_compiled_update(args.compile)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchrec/fbgemm warn about FX and CUDA details
            for part in args.parts:
                if time.perf_counter() > deadline:
                    report["part_errors"][part] = "time budget spent"
                    continue
                t0 = time.perf_counter()
                try:
                    run = {
                        "kernels": run_kernels,
                        "embedding": run_embedding,
                        "cuda_graph": run_cuda_graph,
                        "deepfm": run_deepfm,
                    }[part]
                    report[part] = run(device, args, deadline)
                    report[part]["seconds"] = time.perf_counter() - t0
                except Exception as error:  # noqa: BLE001 - report and go on to the next part
                    traceback.print_exc()
                    report["part_errors"][part] = f"{type(error).__name__}: {error}"
                free_memory(device)
                print(f"[{part} took {time.perf_counter() - t0:.1f} s]", flush=True)
                write_json(out, report)
    finally:
        row_step.set_compiled_update(previous)
    incomplete = bool(report["part_errors"]) or any(
        report.get(part, {}).get("skipped") for part in ("kernels", "embedding", "deepfm")
    )
    write_json(out, report)
    print_report(report)
    print(f"results: {out}")
    return 2 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())

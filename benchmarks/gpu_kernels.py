"""The Triton kernels timed alone, with torch only (no torchrec, no fbgemm_gpu): the part of
``benchmarks/gpu_timing.py`` that runs on a bare GPU machine (torch + Triton).

One table batch of Criteo Kaggle's 26 tables (``criteo_table_rows``, capped by
``--max-rows``), dim ``--dim``, single-hot power-law ids; per step, what a table batch's
lookup and fused update cost on the Triton path (``embedding/device_lookup.py``):

* ``triton adam+cowclip`` / ``triton rowwise_adagrad+cowclip``: the ids mapped and checked
  (:func:`~torchrec_cowclip.embedding.triton_ops.prepare_rows`), the pooled lookup
  (``pool_into``), the fixed-size grouping (``group_rows_padded``) and the fused update
  (``fused_update_padded_``) from a fixed upstream gradient - no value read back to the host;
* ``triton adam+cowclip, CUDA graph``: the same step captured once in a CUDA graph and
  replayed (CUDA only);
* ``inductor adam+cowclip``: the path before the Triton kernels - ``F.embedding_bag``, torch's
  exact grouping, the segment sum and the Inductor-compiled row step
  (``optim/row_step.py``).

Interleaved rounds (``common.run_interleaved``), CUDA events on CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from typing import Any, Callable, Dict, List, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from common import (
    ADAGRAD_LR,
    ADAM_LR,
    COWCLIP,
    EPS,
    PowerLawIds,
    criteo_table_rows,
    run_interleaved,
)
from torch import Tensor

from torchrec_cowclip.embedding import native, triton_ops
from torchrec_cowclip.embedding.row_gradients import group_rows, group_rows_padded
from torchrec_cowclip.optim import row_step
from torchrec_cowclip.optim.functional import adam_bias_corrections

TRITON_ADAM = "triton adam+cowclip"
TRITON_ADAGRAD = "triton rowwise_adagrad+cowclip"
TRITON_GRAPH = "triton adam+cowclip, CUDA graph"
INDUCTOR_ADAM = "inductor adam+cowclip"


class KernelBatch:
    """One step's single-hot ids as rows of the table batch (feature-major) and offsets."""

    def __init__(
        self, ids: PowerLawIds, table_offsets: np.ndarray, batch_size: int, device
    ) -> None:
        per_table = ids.sample(batch_size)
        rows = np.concatenate([t + off for t, off in zip(per_table, table_offsets)])
        self.values = torch.from_numpy(rows.astype(np.int64)).to(device)
        self.offsets = torch.arange(self.values.numel() + 1, device=device)
        self.unique_rows = int(np.unique(rows).size)


class TableBatchState:
    """The tables' weight and one optimizer's state, float32, on ``device``."""

    def __init__(self, rows: Sequence[int], dim: int, optimizer: str, device) -> None:
        total = sum(rows)
        gen = torch.Generator(device=device).manual_seed(0)
        self.weight = torch.randn(total, dim, device=device, generator=gen) * 0.01
        self.state: List[Tensor] = []
        if optimizer == "adam":
            self.state = [torch.zeros(total, dim, device=device) for _ in range(2)]
        elif optimizer == "rowwise_adagrad":
            self.state = [torch.zeros(total, device=device)]
        self.optimizer = optimizer
        # The batch is one table of all rows: one feature per table is one "feature row".
        self.row_offsets = torch.tensor([0, total], device=device)
        self.feature_rows = torch.tensor([[0, total]] * len(rows), device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)


def triton_step(
    tables: TableBatchState, grad: Tensor, batch_size: int
) -> Callable[[KernelBatch], None]:
    """The Triton path's forward and update of one step (no host reads)."""
    dim = tables.weight.shape[1]
    lr = ADAM_LR if tables.optimizer == "adam" else ADAGRAD_LR

    def step(batch: KernelBatch) -> None:
        num_ids = batch.values.numel()
        row_ids, _ = triton_ops.prepare_rows(
            batch.values, batch.offsets, tables.feature_rows, batch_size
        )
        out = torch.empty(batch_size, num_ids // batch_size * dim, device=row_ids.device)
        triton_ops.pool_into(
            out.view(-1, dim), tables.weight, row_ids, batch.offsets, None, False,
            whole=True, batch_size=batch_size,
        )  # fmt: skip
        bag_gradients = grad.view(-1, dim)
        features = num_ids // batch_size
        bag = torch.arange(num_ids, device=row_ids.device)
        bag_of_position = (bag % batch_size) * features + bag // batch_size
        grouping = group_rows_padded(
            row_ids, torch.ones_like(row_ids, dtype=torch.bool), tables.weight.shape[0],
            bag_of_position,
        )  # fmt: skip
        tables.step += 1
        bias = adam_bias_corrections(tables.step, 0.9, 0.999)
        triton_ops.fused_update_padded_(
            *native.update_arguments(
                tables.weight, tables.state, grouping.rows, grouping.counts,
                grad=None, bag_gradients=bag_gradients,
                segment_offsets=grouping.segment_offsets, sorted_bags=grouping.sorted_bags,
                sorted_weights=None, row_offsets=tables.row_offsets, clip_enabled=None,
                adam_bias=bias if tables.optimizer == "adam" else None, row_sums=None,
                rounding=None, optimizer=tables.optimizer, lr=lr, betas=(0.9, 0.999), eps=EPS,
                weight_decay=0.0, clip=(COWCLIP.r, COWCLIP.zeta), count_lr=None,
            ),
            num_valid=grouping.num_valid,
            gate=None,
        )  # fmt: skip

    return step


def inductor_step(
    tables: TableBatchState, grad: Tensor, batch_size: int
) -> Callable[[KernelBatch], None]:
    """The path before the Triton kernels: ATen's lookup and grouping, the compiled row step."""
    dim = tables.weight.shape[1]
    call = row_step.row_step(compiled=True)
    names = {"adam": ["exp_avg", "exp_avg_sq"], "rowwise_adagrad": ["sum"]}[tables.optimizer]

    def step(batch: KernelBatch) -> None:
        num_ids = batch.values.numel()
        F.embedding_bag(
            batch.values, tables.weight, batch.offsets, mode="sum", include_last_offset=True
        )
        features = num_ids // batch_size
        bag = torch.arange(num_ids, device=batch.values.device)
        grouping = group_rows(
            batch.values, (bag % batch_size) * features + bag // batch_size, tables.weight.shape[0]
        )
        row_grad = F.embedding_bag(
            grouping.sorted_bags, grad.view(-1, dim), grouping.segment_offsets, mode="sum",
            include_last_offset=True,
        )  # fmt: skip
        tables.step += 1
        bias = adam_bias_corrections(tables.step.expand(grouping.rows.numel()), 0.9, 0.999)
        call(
            tables.weight, dict(zip(names, tables.state)), grouping.rows, row_grad,
            grouping.counts, optimizer=tables.optimizer, lr=ADAM_LR, betas=(0.9, 0.999),
            eps=EPS, weight_decay=0.0, cowclip=COWCLIP, adam_bias=bias,
        )  # fmt: skip

    return step


def graph_step(
    step: Callable[[KernelBatch], None], first: KernelBatch
) -> Callable[[KernelBatch], None]:
    """``step`` captured in a CUDA graph on static copies of ``first``'s tensors (after
    three warm-up calls on a side stream, as torch's CUDA-graph guide does); each call
    copies the batch in and replays."""
    static = KernelBatch.__new__(KernelBatch)
    static.values, static.offsets = first.values.clone(), first.offsets.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static)

    def replay(batch: KernelBatch) -> None:
        static.values.copy_(batch.values, non_blocking=True)
        graph.replay()

    return replay


def run_kernels(device: torch.device, args: argparse.Namespace, deadline: float) -> Dict[str, Any]:
    """Times the variants of the module docstring; returns the results (JSON-ready)."""
    reason = triton_ops.availability(device)
    if reason is not None:
        raise RuntimeError(reason)
    rows = criteo_table_rows(args.max_rows)
    dim = args.dim
    result: Dict[str, Any] = {
        "tables": len(rows), "rows": sum(rows), "dim": dim, "per_batch": [], "skipped": [],
    }  # fmt: skip
    t0 = time.perf_counter()
    ids = PowerLawIds(rows, args.zipf, seed=1)
    table_offsets = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    tables = {
        TRITON_ADAM: TableBatchState(rows, dim, "adam", device),
        TRITON_ADAGRAD: TableBatchState(rows, dim, "rowwise_adagrad", device),
        INDUCTOR_ADAM: TableBatchState(rows, dim, "adam", device),
    }
    if device.type == "cuda":
        tables[TRITON_GRAPH] = TableBatchState(rows, dim, "adam", device)
    result["build_s"] = time.perf_counter() - t0
    for bs in args.batch_sizes:
        if time.perf_counter() > deadline:
            result["skipped"].append(f"batch {bs}: time budget spent")
            continue
        batches = [KernelBatch(ids, table_offsets, bs, device) for _ in range(3)]
        grad = torch.randn(bs, len(rows) * dim, device=device) * 1e-3
        variants: Dict[str, Callable[[KernelBatch], None]] = {
            TRITON_ADAM: triton_step(tables[TRITON_ADAM], grad, bs),
            TRITON_ADAGRAD: triton_step(tables[TRITON_ADAGRAD], grad, bs),
            INDUCTOR_ADAM: inductor_step(tables[INDUCTOR_ADAM], grad, bs),
        }
        if TRITON_GRAPH in tables:
            try:
                variants[TRITON_GRAPH] = graph_step(
                    triton_step(tables[TRITON_GRAPH], grad, bs), batches[0]
                )
            except Exception as error:  # noqa: BLE001 - report the capture's failure, go on
                traceback.print_exc()
                result["skipped"].append(
                    f"{TRITON_GRAPH} at batch {bs}: {type(error).__name__}: {error}"
                )
        limit = min(args.part_time_limit_s, max(deadline - time.perf_counter(), 1.0))
        print(f"  kernels, batch {bs:,}: {len(variants)} variants ...", flush=True)
        failed: Dict[str, str] = {}
        timings = run_interleaved(
            variants, batches, args.steps, args.warmup, limit, device, failures=failed
        )
        result["per_batch"].append(
            {
                "batch_size": bs,
                "distinct_rows": [b.unique_rows for b in batches],
                "variants": {
                    n: t.summary() for n, t in timings.items() if t.samples and n not in failed
                },
                "failed": failed,
            }
        )
    return result


def kernel_table(result: Dict[str, Any], format_table: Callable[[List[List[str]]], str]) -> str:
    rows = [["batch", "variant", "median ms", "min ms", "vs inductor"]]
    for entry in result["per_batch"]:
        v = entry["variants"]
        ref = v.get(INDUCTOR_ADAM, {}).get("median_ms")
        for name, t in v.items():
            rows.append(
                [
                    f"{entry['batch_size']:,}", name, f"{t['median_ms']:.3f}",
                    f"{t['min_ms']:.3f}", f"{t['median_ms'] / ref:.2f}" if ref else "-",
                ]
            )  # fmt: skip
        for name, error in entry.get("failed", {}).items():
            rows.append([f"{entry['batch_size']:,}", name, "FAILED", error[:60], ""])
        rows.append(
            [f"{entry['batch_size']:,}", "distinct rows per step (mean)",
             f"{statistics.fmean(entry['distinct_rows']):,.0f}", "", ""]
        )  # fmt: skip
    return format_table(rows)

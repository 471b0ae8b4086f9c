"""GPU check: correctness of the fused CowClip update on a device, the embedding-step
table, and DeepFM samples/s on Criteo-Kaggle-sized synthetic data.

Meant for a machine with one NVIDIA GPU, torch and Triton (``benchmarks/gpu.sh`` runs
it); every part also runs on CPU at tiny sizes (``--device cpu --quick``, under a
minute), which is how ``tests/test_gpu_check.py`` keeps it working without a GPU.

Parts (``--parts``, default all three):

1. ``correctness``: (a) the row step (:func:`row_step_`, the compiled path by default on
   CUDA: ``set_compiled_update("1")``, Triton kernels) against the functional math run on
   CPU in float64, for Adam, row-wise Adagrad and SGD, with the CowClip clip binding on
   some rows and not on others, two calls of different row counts and learning rates per
   case (one dynamic-shape graph must serve both); (b) a few steps of a
   ``CowClipEmbeddingBagCollection`` on the device (a shared table, MEAN pooling, mixed
   dims, an unclipped dim-1 table, multi-hot bags with duplicates and empty bags) against a
   dense autograd reference in float64 on CPU (``reference_cowclip_step_`` on the dense
   gradient of ``F.embedding_bag``); (c) an out-of-range id on the device raises
   ``IndexError`` and changes nothing. Any mismatch makes the exit status 1.
2. ``embedding``: forward + backward + fused update per step on the 26 tables of Criteo
   Kaggle (``CRITEO_KAGGLE_CARDINALITIES``, full size unless ``--max-rows``), dim 16,
   batches 16K and 128K, single-hot power-law ids: ours Adam + CowClip, ours row-wise
   Adagrad + CowClip, and FBGEMM's TBE with ``EXACT_ROWWISE_ADAGRAD`` (no clipping) when
   ``fbgemm_gpu`` imports; plus our row step alone (compiled and eager) on the rows one
   batch touches. Interleaved rounds, timed with CUDA events on CUDA.
3. ``deepfm``: DeepFM (D 10, DNN 400-400-400, Adam + CowClip tables, dense Adam) trained
   the way the trainer does it (``BatchIterator`` over the memory-mapped binary cache,
   shuffled, ``prefetch=2``, through TorchRec's ``TrainPipelineBase``, ``float(loss)``
   every step) on ``synthetic:N`` with Criteo Kaggle's full cardinalities. Generating all
   45.8M rows would not fit the time budget, so it builds an N-row cache (timed), measures
   steps/s over the timed steps, and EXTRAPOLATES one epoch of 45,840,617 rows at batch
   131,072; it says so, and whether the issue's goal (< 60 s per epoch on one H200) is met.

Without ``fbgemm_gpu``, ``import torchrec`` fails (``torchrec/__init__`` imports
``torchrec.distributed``, whose ``types.py`` imports ``fbgemm_gpu``), and so does
``import torchrec_cowclip`` (its ``__init__`` imports the collection). This script then
says so and runs what needs neither: the row step checks (1a) and the row-step timing,
loading ``optim/functional.py``, ``optim/reference.py``, ``embedding/row_step.py`` and
``data/schema.py`` on their own (``--core-only`` forces that mode). Exit status: 0 all
checks ran and passed; 1 a mismatch; 2 nothing mismatched but a check or part could not
run (missing packages, an error, the time budget).

Run::

    python benchmarks/gpu_check.py                      # CUDA if available, full sizes
    python benchmarks/gpu_check.py --device cpu --quick # tiny, CPU, under a minute
    python benchmarks/gpu_check.py --parts correctness --out /tmp/gpu

Results: ``<out>/gpu_check.json`` (rewritten after each part); the tables are printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the package need not be installed on the GPU machine
    sys.path.insert(0, str(REPO))
if str(REPO / "benchmarks") not in sys.path:  # also when imported by path (the tests)
    sys.path.insert(0, str(REPO / "benchmarks"))

from text_table import format_table  # noqa: E402

PARTS = ("correctness", "embedding", "deepfm")
CRITEO_ROWS_FALLBACK = 45_840_617
EPOCH_GOAL_S = 60.0
GOAL_BATCH = 131_072

ADAM_LR = 1e-3
ADAGRAD_LR = 1e-2
EPS = 1e-8

ADAM_NAME = "ours adam+cowclip"
ADAGRAD_NAME = "ours rowwise_adagrad+cowclip"
FBGEMM_NAME = "fbgemm TBE exact_rowwise_adagrad (no clip)"
ROW_STEP_NAME = "ours adam: row step alone ({path})"


# --- loading the project -------------------------------------------------------------


@dataclass
class Project:
    """The project's modules this script uses, and what could not be imported.

    ``full`` is False when ``torchrec_cowclip`` (hence torchrec) could not be imported;
    then only ``functional``, ``reference``, ``row_step`` and ``schema`` are set.
    """

    full: bool
    why_not_full: str
    functional: types.ModuleType
    reference: types.ModuleType
    row_step: types.ModuleType
    schema: types.ModuleType
    fbgemm: bool
    why_no_fbgemm: str


def _load_core_modules() -> Tuple[types.ModuleType, ...]:
    """Imports the torch-only modules without running ``torchrec_cowclip/__init__.py``
    (which imports torchrec): empty stand-in packages with the real ``__path__`` let the
    submodules load from their files as usual."""
    for name in [m for m in sys.modules if m == "torchrec_cowclip" or m.startswith("torchrec_cowclip.")]:
        del sys.modules[name]  # drop what a failed package import left half-done
    root = REPO / "torchrec_cowclip"
    for name, folder in (
        ("torchrec_cowclip", root),
        ("torchrec_cowclip.optim", root / "optim"),
        ("torchrec_cowclip.embedding", root / "embedding"),
        ("torchrec_cowclip.data", root / "data"),
    ):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]  # type: ignore[attr-defined]
        sys.modules[name] = package
    return tuple(
        importlib.import_module(f"torchrec_cowclip.{sub}")
        for sub in ("optim.functional", "optim.reference", "embedding.row_step", "data.schema")
    )


def load_project(core_only: bool) -> Project:
    """The project, fully if torchrec imports (unless ``core_only``), else its core."""
    why = "--core-only given"
    if not core_only:
        try:
            import torchrec_cowclip  # noqa: F401
            from torchrec_cowclip.data import schema
            from torchrec_cowclip.embedding import row_step
            from torchrec_cowclip.optim import functional, reference

            fbgemm, why_fb = _fbgemm_available()
            return Project(True, "", functional, reference, row_step, schema, fbgemm, why_fb)
        except ImportError as error:
            why = f"{type(error).__name__}: {error}"
    functional, reference, row_step, schema = _load_core_modules()
    fbgemm, why_fb = _fbgemm_available()
    return Project(False, why, functional, reference, row_step, schema, fbgemm, why_fb)


def _fbgemm_available() -> Tuple[bool, str]:
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as error:  # noqa: BLE001 - a broken .so raises OSError/RuntimeError too
        return False, f"{type(error).__name__}: {error}"
    return True, ""


# --- small utilities -----------------------------------------------------------------


class Deadline:
    """Seconds left of the whole run's budget."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as error:  # noqa: BLE001
        info["triton"] = f"not importable ({type(error).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


# --- correctness -----------------------------------------------------------------------


@dataclass
class Check:
    """One comparison: its name, whether it passed, and the evidence."""

    name: str
    passed: bool
    detail: str
    max_abs_err: float = 0.0
    group: str = ""


def close(got: Tensor, want: Tensor, rtol: float, atol: float) -> Tuple[bool, float]:
    """``|got - want| <= atol + rtol * |want|`` everywhere, in float64 on CPU; and the
    largest absolute error."""
    got64, want64 = got.detach().to("cpu", torch.float64), want.detach().to("cpu", torch.float64)
    if got64.shape != want64.shape:
        return False, float("inf")
    if got64.numel() == 0:
        return True, 0.0
    err = (got64 - want64).abs()
    ok = bool((err <= atol + rtol * want64.abs()).all()) and bool(torch.isfinite(got64).all())
    return ok, float(err.max())


# Float32 on the device against float64 on CPU: a few float32 roundings per value.
RTOL = 1e-5
ATOL_SCALE = 1e-6  # atol = ATOL_SCALE * max|want| of each tensor


def compare(name: str, got: Tensor, want: Tensor) -> Check:
    atol = ATOL_SCALE * float(want.detach().abs().max()) if want.numel() else 0.0
    ok, err = close(got, want, RTOL, atol)
    return Check(name, ok, f"max abs err {err:.3g} (atol {atol:.2g}, rtol {RTOL:g})", err)


def grouped(group: str, checks: List[Check]) -> List[Check]:
    """Tags ``checks`` with the summary row they are counted in."""
    for c in checks:
        c.group = group
    return checks


@dataclass(frozen=True)
class RowCase:
    """A row-step problem: optimizer, dim, clip, coupled L2, per-row clip mask."""

    optimizer: str
    dim: int
    clip: Optional[Tuple[float, float]]  # (r, zeta)
    weight_decay: float
    masked: bool

    @property
    def name(self) -> str:
        clip = "+cowclip" if self.clip else ""
        return f"row step {self.optimizer}{clip} D={self.dim}{' masked' if self.masked else ''}"


ROW_CASES = (
    RowCase("adam", 16, (1.0, 1e-5), 0.01, True),
    RowCase("adam", 1, (1.0, 1e-5), 0.0, True),  # DeepFM's dim-1 tables: a size-1 graph
    RowCase("rowwise_adagrad", 10, (1.0, 1e-5), 0.01, False),
    RowCase("sgd", 16, (0.5, 1e-4), 0.0, False),
)


def row_problem(case: RowCase, num_rows: int, touched: int, seed: int) -> Dict[str, Any]:
    """Float64 CPU tensors of one row-step call. A tenth of the rows are tiny, so the clip
    binds on them (||g|| >> count * zeta) and, by a wide margin, not on the others."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    weight = torch.randn(num_rows, case.dim, generator=gen, dtype=f64) * 0.05
    weight[: max(1, num_rows // 10)] *= 1e-4
    state: Dict[str, Tensor] = {}
    if case.optimizer == "adam":
        state = {"exp_avg": torch.randn(num_rows, case.dim, generator=gen, dtype=f64) * 1e-2,
                 "exp_avg_sq": torch.rand(num_rows, case.dim, generator=gen, dtype=f64) * 1e-3}
    elif case.optimizer == "rowwise_adagrad":
        state = {"sum": torch.rand(num_rows, generator=gen, dtype=f64)}
    rows = torch.sort(torch.randperm(num_rows, generator=gen)[:touched]).values
    rows[0] = 0  # a tiny row is always touched
    return {
        "weight": weight,
        "state": state,
        "rows": rows,
        "grad": torch.randn(touched, case.dim, generator=gen, dtype=f64) * 0.01,
        "counts": torch.randint(1, 4, (touched,), generator=gen),
        "step": torch.randint(1, 9, (touched,), generator=gen),
        "mask": (torch.rand(touched, generator=gen) > 0.3) if case.masked else None,
    }


def expected_row_step(project: Project, case: RowCase, p: Dict[str, Any], lr: float,
                      betas: Tuple[float, float], eps: float) -> Tuple[Tensor, Dict[str, Tensor], Tensor]:
    """The functional math on float64 CPU rows, gathered and scattered by hand."""
    fn = project.functional
    weight = p["weight"].clone()
    state = {k: v.clone() for k, v in p["state"].items()}
    rows = p["rows"]
    w_rows = weight[rows].clone()
    s_rows = {k: v[rows].clone() for k, v in state.items()}
    cowclip = fn.CowClip(*case.clip) if case.clip else None
    clipped = fn.cowclip_row_update_(
        case.optimizer, w_rows, p["grad"], p["counts"], s_rows, p["step"], lr=lr, betas=betas,
        eps=eps, weight_decay=case.weight_decay, cowclip=cowclip, clip_enabled=p["mask"],
    )
    weight[rows] = w_rows
    for k in state:
        state[k][rows] = s_rows[k]
    return weight, state, clipped


def check_row_steps(project: Project, device: torch.device, quick: bool) -> List[Check]:
    """Each case twice (different row counts and lr): the device's row step, float32,
    against the float64 functional math on CPU."""
    fn = project.functional
    betas, eps = (0.8, 0.99), 1e-6
    num_rows, touched = (300, 100) if quick else (20_000, 6_000)
    checks: List[Check] = []
    for case in ROW_CASES:
        first = len(checks)
        any_clipped = any_unclipped = False
        for call, (n_touched, lr, seed) in enumerate(((touched, 0.05, 1), (touched * 2 // 3 + 1, 0.02, 2))):
            label = f"{case.name} call {call + 1} (U={n_touched})"
            p = row_problem(case, num_rows, n_touched, seed)
            want_w, want_s, want_clipped = expected_row_step(project, case, p, lr, betas, eps)
            f32 = torch.float32
            weight = p["weight"].to(device, f32)
            state = {k: v.to(device, f32) for k, v in p["state"].items()}
            step = p["step"].to(device)
            bias = fn.adam_bias_corrections(step, betas[0], betas[1], f32) if case.optimizer == "adam" else None
            mask = p["mask"].to(device) if p["mask"] is not None else None
            try:
                clipped = project.row_step.row_step_(
                    weight, state, p["rows"].to(device), p["grad"].to(device, f32),
                    p["counts"].to(device), step, case.optimizer, lr, betas, eps,
                    case.weight_decay, fn.CowClip(*case.clip) if case.clip else None, mask,
                    None, bias,
                )
                sync(device)
            except Exception as error:  # noqa: BLE001 - a failed build is a failed check
                checks.append(Check(label, False, f"raised {type(error).__name__}: {error}"))
                continue
            checks.append(compare(f"{label}: weights", weight, want_w))
            for key in want_s:
                checks.append(compare(f"{label}: {key}", state[key], want_s[key]))
            same = torch.equal(clipped.cpu(), want_clipped)
            checks.append(Check(f"{label}: clipped rows", same,
                                f"{int(want_clipped.sum())} of {n_touched} clipped in the reference, "
                                f"{int(clipped.sum())} on {device.type}"))
            any_clipped |= bool(want_clipped.any())
            any_unclipped |= bool((~want_clipped).any())
        if case.clip:
            checks.append(Check(f"{case.name}: the clip binds on some rows, not all",
                                any_clipped and any_unclipped, "problem design"))
        grouped(case.name, checks[first:])
    return checks


# The collection check: torchrec-style tables, KJT from bags, float64 dense reference.

COLLECTION_HYPER = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)


def collection_tables() -> List[Any]:
    """A table read by two features, a second dim, MEAN pooling, and a dim-1 table that
    the collection leaves unclipped (``unclipped_tables=("linear",)``)."""
    from torchrec import EmbeddingBagConfig, PoolingType

    # (name, dim, rows, features, pooling)
    spec = [
        ("shared", 8, 40, ["fa", "fb"], PoolingType.SUM),
        ("small", 4, 30, ["fc"], PoolingType.SUM),
        ("mean", 8, 25, ["fd"], PoolingType.MEAN),
        ("linear", 1, 20, ["fe"], PoolingType.SUM),
    ]
    return [
        EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows,
                           feature_names=features, pooling=pooling)
        for name, dim, rows, features, pooling in spec
    ]


def random_bags(tables: Sequence[Any], batch_size: int, gen: torch.Generator) -> Dict[str, List[List[int]]]:
    """Multi-hot bags, empty ones and duplicate ids included, over a small id range so
    that rows repeat within and across bags."""
    bags: Dict[str, List[List[int]]] = {}
    for t in tables:
        for f in t.feature_names:
            lengths = torch.randint(0, 5, (batch_size,), generator=gen).tolist()
            hi = min(t.num_embeddings, 15)
            bags[f] = [torch.randint(0, hi, (n,), generator=gen).tolist() for n in lengths]
    return bags


def kjt_from_bags(bags: Dict[str, List[List[int]]]) -> Any:
    from torchrec import KeyedJaggedTensor

    keys = list(bags)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor([i for k in keys for bag in bags[k] for i in bag], dtype=torch.int64),
        lengths=torch.tensor([len(bag) for k in keys for bag in bags[k]], dtype=torch.int64),
    )
    # Offsets computed here, on CPU, travel with .to(device); computed later on the
    # device they would need fbgemm's CUDA asynchronous_complete_cumsum (as BatchIterator's
    # batches, which carry their offsets, do not).
    kjt.offsets()
    return kjt


def kjt_permute_works(device: torch.device) -> Tuple[bool, str]:
    """Whether ``KeyedJaggedTensor.permute`` runs on ``device``: it calls
    ``torch.ops.fbgemm.permute_2D_sparse_data``, which a CPU-only fbgemm_gpu build lacks
    for CUDA. The collection permutes a KJT whose keys are not in its tables' order."""
    try:
        kjt_from_bags({"a": [[1]], "b": [[2, 3]]}).to(device).permute([1, 0]).values()
        sync(device)
    except Exception as error:  # noqa: BLE001 - NotImplementedError/RuntimeError by build
        return False, f"{type(error).__name__}: {str(error)[:200]}"
    return True, ""


def mixed_scale_weights(rows: int, dim: int, gen: torch.Generator) -> Tensor:
    """Row norms spanning 1e-4..1 (float32), so the clip binds on some rows only."""
    scale = torch.logspace(-4, 0, rows)[torch.randperm(rows, generator=gen)]
    return torch.randn(rows, dim, generator=gen) * scale[:, None]


class Float64Reference:
    """Plain autograd over ``F.embedding_bag`` in float64 on CPU, then the spec's
    reference step (``reference_cowclip_step_``) on each table's dense gradient."""

    def __init__(self, project: Project, tables: Sequence[Any], weights: Dict[str, Tensor],
                 optimizer: str, cowclip: Any, unclipped: Sequence[str]) -> None:
        self.ref = project.reference
        self.tables = list(tables)
        self.weights = {n: w.detach().to(torch.float64).clone() for n, w in weights.items()}
        self.optimizer, self.cowclip, self.unclipped = optimizer, cowclip, set(unclipped)
        self.state = {n: self.ref.init_reference_state(optimizer, w) for n, w in self.weights.items()}
        self.clipped: Dict[str, Tensor] = {}

    def forward(self, bags: Dict[str, List[List[int]]], weights: Dict[str, Tensor]) -> Tensor:
        from torchrec import PoolingType

        outs = []
        for t in self.tables:
            mode = "mean" if t.pooling == PoolingType.MEAN else "sum"
            for f in t.feature_names:
                ids = torch.tensor([i for bag in bags[f] for i in bag], dtype=torch.int64)
                offsets = torch.tensor([0] + list(itertools.accumulate(len(b) for b in bags[f]))[:-1],
                                       dtype=torch.int64)
                outs.append(torch.nn.functional.embedding_bag(ids, weights[t.name], offsets, mode=mode))
        return torch.cat(outs, dim=1)

    def output(self, bags: Dict[str, List[List[int]]]) -> Tensor:
        with torch.no_grad():
            return self.forward(bags, self.weights)

    def step(self, bags: Dict[str, List[List[int]]], upstream: Tensor) -> None:
        leaves = {n: w.clone().requires_grad_(True) for n, w in self.weights.items()}
        (self.forward(bags, leaves) * upstream).sum().backward()
        with torch.no_grad():
            for t in self.tables:
                ids = torch.tensor([i for f in t.feature_names for bag in bags[f] for i in bag],
                                   dtype=torch.int64)
                counts = self.ref.occurrence_counts(ids, t.num_embeddings)
                grad = leaves[t.name].grad
                grad = torch.zeros_like(self.weights[t.name]) if grad is None else grad
                self.clipped[t.name] = self.ref.reference_cowclip_step_(
                    self.weights[t.name], grad, counts, self.state[t.name],
                    optimizer=self.optimizer, cowclip=self.cowclip,
                    clip_table=t.name not in self.unclipped, **COLLECTION_HYPER,
                )


def check_collection(project: Project, device: torch.device, steps: int = 3,
                     reorder_keys: bool = True) -> List[Check]:
    """A few steps of the collection on ``device`` against :class:`Float64Reference`;
    with ``reorder_keys``, every other step's KJT lists its keys in reverse order."""
    from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection

    checks: List[Check] = []
    for optimizer in ("adam", "rowwise_adagrad", "sgd"):
        first = len(checks)
        gen = torch.Generator().manual_seed(7)
        tables = collection_tables()
        cowclip = CowClip(r=1.0, zeta=1e-3)
        label = f"collection {optimizer}+cowclip"
        try:
            ebc = CowClipEmbeddingBagCollection(
                tables, optimizer=optimizer, cowclip=cowclip, unclipped_tables=("linear",),
                device=device, **COLLECTION_HYPER,
            )
            weights = {t.name: mixed_scale_weights(t.num_embeddings, t.embedding_dim, gen) for t in tables}
            with torch.no_grad():
                for name, w in weights.items():
                    ebc.embedding_bags[name].weight.copy_(w.to(device))
            ref = Float64Reference(project, tables, weights, optimizer, cowclip, ("linear",))
            clipped_total = updated_total = 0
            for step in range(steps):
                bags = random_bags(tables, 6, gen)
                if step % 2 and reorder_keys:  # the KJT's key order need not be the tables' order
                    bags = {k: bags[k] for k in reversed(list(bags))}
                kjt = kjt_from_bags(bags).to(device)
                out = ebc(kjt).values()
                checks.append(compare(f"{label} step {step + 1}: forward", out, ref.output(bags)))
                upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
                (out * upstream.to(device, torch.float32)).sum().backward()
                ref.step(bags, upstream)
                opt_state = ebc.fused_optimizer.state_dict()["state"]
                stats = ebc.clip_stats()
                for t in tables:
                    checks.append(compare(f"{label} step {step + 1}: {t.name} weights",
                                          ebc.embedding_bags[t.name].weight, ref.weights[t.name]))
                    ours_state = opt_state[f"embedding_bags.{t.name}.weight"]
                    for key, value in ref.state[t.name].items():
                        if key == "step":
                            same = int(ours_state[key]) == int(value)
                            checks.append(Check(f"{label} step {step + 1}: {t.name} step count", same,
                                                f"{int(ours_state[key])} vs {int(value)}"))
                        else:
                            checks.append(compare(f"{label} step {step + 1}: {t.name} {key}",
                                                  ours_state[key], value))
                    want = ref.clipped[t.name].numel()
                    got = stats[t.name].rows_clipped
                    checks.append(Check(f"{label} step {step + 1}: {t.name} rows clipped", got == want,
                                        f"{got} vs reference {want}"))
                    clipped_total += want
                    updated_total += stats[t.name].rows_updated
            checks.append(Check(f"{label}: the clip binds on some rows, not all",
                                0 < clipped_total < updated_total,
                                f"{clipped_total} clipped of {updated_total} updated"))
        except Exception as error:  # noqa: BLE001 - a crash on the device is a failed check
            checks.append(Check(label, False, f"raised {type(error).__name__}: {error}"))
        grouped(label, checks[first:])
        free_memory(device)
    return checks


def check_out_of_range(device: torch.device) -> List[Check]:
    """An id outside its table raises IndexError on the device and changes nothing."""
    from torchrec_cowclip import CowClipEmbeddingBagCollection

    tables = collection_tables()
    ebc = CowClipEmbeddingBagCollection(tables, optimizer="adam", lr=0.1, device=device)
    before = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
    bags = random_bags(tables, 3, torch.Generator().manual_seed(3))
    bags["fc"][1] = [30]  # table "small" has 30 rows
    try:
        ebc(kjt_from_bags(bags).to(device)).values().sum().backward()
        outcome, ok = "no error", False
    except IndexError as error:
        outcome, ok = f"IndexError: {str(error)[:120]}", True
    except Exception as error:  # noqa: BLE001 - the wrong exception type is the finding
        outcome, ok = f"{type(error).__name__} instead of IndexError: {str(error)[:200]}", False
    unchanged = all(torch.equal(v, before[k]) for k, v in ebc.state_dict().items())
    return grouped("collection out-of-range id", [
        Check("collection: out-of-range id raises IndexError", ok, outcome),
        Check("collection: out-of-range id changes no weight", unchanged, "")])


@contextlib.contextmanager
def injected_error(project: Project) -> Iterator[None]:
    """Self-test of the check: every row step also adds 1e-3 to its first row's weight,
    so a correct comparison must fail."""
    modules = [project.row_step]
    if project.full:
        modules.append(importlib.import_module("torchrec_cowclip.embedding.fused_update"))
    originals = [m.row_step_ for m in modules]
    real = originals[0]

    def wrong(*args: Any, **kwargs: Any) -> Tensor:
        clipped = real(*args, **kwargs)
        weight_table, rows = args[0], args[2]
        if rows.numel():
            with torch.no_grad():
                weight_table[rows[0]] += 1e-3
        return clipped

    for m in modules:
        m.row_step_ = wrong
    try:
        yield
    finally:
        for m, original in zip(modules, originals):
            m.row_step_ = original


def run_correctness(project: Project, device: torch.device, args: argparse.Namespace) -> Dict[str, Any]:
    checks: List[Check] = []
    skipped: List[str] = []
    context = injected_error(project) if args.inject_error else contextlib.nullcontext()
    with context:
        print(f"correctness: row step on {device} (update mode {args.compile}) vs float64 functional math ...",
              flush=True)
        checks += check_row_steps(project, device, args.quick)
        if project.full:
            print(f"correctness: collection on {device} vs float64 dense reference ...", flush=True)
            permute_ok, why = kjt_permute_works(device)
            if not permute_ok:
                skipped.append(f"KJTs whose keys are not in the tables' order (KeyedJaggedTensor.permute "
                               f"needs fbgemm_gpu's {device.type} kernels): {why}")
            checks += check_collection(project, device, reorder_keys=permute_ok)
            checks += check_out_of_range(device)
        else:
            skipped.append(f"collection and out-of-range checks: torchrec_cowclip not importable "
                           f"({project.why_not_full})")
    failed = [c for c in checks if not c.passed]
    for c in failed[:20]:
        print(f"  MISMATCH {c.name}: {c.detail}")
    return {"checks": [asdict(c) for c in checks], "failed": len(failed), "passed": len(checks) - len(failed),
            "skipped": skipped, "injected_error": bool(args.inject_error)}


# --- embedding-step timing -------------------------------------------------------------


@dataclass
class EmbBatch:
    """One step's input: per-table ids (host), and the device tensors built from them."""

    per_table: List[np.ndarray]
    kjt: Any  # torchrec KJT on the device, or None without torchrec
    indices: Optional[Tensor]
    offsets: Optional[Tensor]
    unique_rows: Tensor  # sorted distinct global rows (table offset + id), on the device
    counts: Tensor  # occurrences of each, on the device


def zipf_cdf(rows: int, exponent: float) -> np.ndarray:
    """CDF of ``p(rank k) ~ k**-exponent`` over ranks ``1..rows``."""
    weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


class IdSampler:
    """Single-hot power-law ids per table; ranks map to rows by a fixed random permutation
    per table (as hashing would), so hot rows are spread over the table."""

    def __init__(self, cardinalities: Sequence[int], exponent: float, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.cards = list(cardinalities)
        self.cdfs = [zipf_cdf(k, exponent) for k in self.cards]
        self.rank_to_row = [self.rng.permutation(k) for k in self.cards]

    def sample(self, batch_size: int) -> List[np.ndarray]:
        return [
            perm[np.minimum(np.searchsorted(cdf, self.rng.random(batch_size)), k - 1)]
            for perm, cdf, k in zip(self.rank_to_row, self.cdfs, self.cards)
        ]


def make_emb_batch(per_table: List[np.ndarray], cards: Sequence[int], device: torch.device,
                   with_torchrec: bool) -> EmbBatch:
    offsets = np.concatenate([[0], np.cumsum(cards)[:-1]]).astype(np.int64)
    global_rows = np.concatenate([ids.astype(np.int64) + off for ids, off in zip(per_table, offsets)])
    unique, counts = np.unique(global_rows, return_counts=True)
    kjt = indices = tbe_offsets = None
    if with_torchrec:
        from torchrec import KeyedJaggedTensor

        values = torch.from_numpy(np.concatenate(per_table).astype(np.int64))
        lengths = torch.ones(values.numel(), dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(len(cards))], values=values, lengths=lengths)
        kjt.offsets()  # on CPU, so that the device needs no fbgemm op for them (kjt_from_bags)
        kjt = kjt.to(device)
        indices, tbe_offsets = kjt.values(), kjt.offsets()
    return EmbBatch(per_table, kjt, indices, tbe_offsets, torch.from_numpy(unique).to(device),
                    torch.from_numpy(counts).to(device))


def time_rounds(variants: Dict[str, Callable[[EmbBatch], None]], batches: Sequence[EmbBatch], rounds: int,
                warmup: int, time_limit: float, device: torch.device) -> Dict[str, List[float]]:
    """Each round runs every variant once on the same batch, the order rotated per round;
    ms per call from CUDA events (on CUDA) or the wall clock. On CUDA each call starts on an
    idle device (synchronised first), so its time runs from its first launch to the end of
    its last kernel and no variant hides its host work behind another's kernels. Warm-up
    rounds (the first compile happens there) are not recorded; timed rounds stop after
    ``time_limit`` s."""
    names = list(variants)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    cuda = device.type == "cuda"
    start_time = None
    for r in range(warmup + rounds):
        if r == warmup:
            start_time = time.perf_counter()
        batch = batches[r % len(batches)]
        shift = r % len(names)
        pending: List[Tuple[str, Any, Any]] = []
        for name in names[shift:] + names[:shift]:
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                sync(device)
                begin.record()
                variants[name](batch)
                end.record()
                pending.append((name, begin, end))
            else:
                t0 = time.perf_counter()
                variants[name](batch)
                pending.append((name, t0, time.perf_counter()))
        sync(device)
        if r >= warmup:
            for name, begin, end in pending:
                samples[name].append(begin.elapsed_time(end) if cuda else (end - begin) * 1e3)
            if start_time is not None and time.perf_counter() - start_time > time_limit:
                print(f"  time limit: {r + 1 - warmup} of {rounds} timed rounds", flush=True)
                break
    return samples


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes read + written per second by the best of a few large tensor copies."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def make_tbe(cards: Sequence[int], dim: int, device: torch.device, initial: Sequence[Tensor]) -> Any:
    """FBGEMM's fused TBE with EXACT_ROWWISE_ADAGRAD, on the device (DEVICE/CUDA) or the
    host (HOST/CPU), started from ``initial`` weights."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    on_cuda = device.type == "cuda"
    location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
    compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(k, dim, location, compute) for k in cards],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=ADAGRAD_LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
        device=device,
    )
    with torch.no_grad():
        for dst, src in zip(tbe.split_embedding_weights(), initial):
            dst.copy_(src)
    return tbe


def run_embedding(project: Project, device: torch.device, args: argparse.Namespace,
                  deadline: Deadline) -> Dict[str, Any]:
    fn, rs = project.functional, project.row_step
    cards = [k if args.max_rows is None else min(k, args.max_rows)
             for k in project.schema.CRITEO_KAGGLE_CARDINALITIES]
    dim = args.dim
    cowclip = fn.CowClip(r=1.0, zeta=1e-5)
    result: Dict[str, Any] = {"tables": len(cards), "rows": sum(cards), "max_rows": args.max_rows, "dim": dim,
                              "zipf": args.zipf, "per_batch": [], "skipped": [], "incomplete": []}
    print(f"embedding step: {len(cards)} Criteo-Kaggle tables, {sum(cards):,} rows"
          f"{' (capped at %d per table)' % args.max_rows if args.max_rows else ' (full size)'}, dim {dim}",
          flush=True)
    t0 = time.perf_counter()
    sampler = IdSampler(cards, args.zipf, seed=0)
    result["sampler_setup_s"] = time.perf_counter() - t0

    modules: Dict[str, Any] = {}
    if project.full:
        from torchrec import EmbeddingBagConfig
        from torchrec_cowclip import CowClipEmbeddingBagCollection

        configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=k, feature_names=[f"f{t}"])
                   for t, k in enumerate(cards)]
        t0 = time.perf_counter()
        modules["adam"] = CowClipEmbeddingBagCollection(
            configs, optimizer="adam", lr=ADAM_LR, eps=EPS, cowclip=cowclip, device=device)
        modules["adagrad"] = CowClipEmbeddingBagCollection(
            configs, optimizer="rowwise_adagrad", lr=ADAGRAD_LR, eps=EPS, cowclip=cowclip, device=device)
        initial = [modules["adam"].embedding_bags[f"t{t}"].weight.detach() for t in range(len(cards))]
        with torch.no_grad():
            for t in range(len(cards)):
                modules["adagrad"].embedding_bags[f"t{t}"].weight.copy_(initial[t])
        if project.fbgemm:
            try:
                modules["tbe"] = make_tbe(cards, dim, device, initial)
            except Exception as error:  # noqa: BLE001
                result["skipped"].append(f"{FBGEMM_NAME}: {type(error).__name__}: {error}")
        else:
            result["skipped"].append(f"{FBGEMM_NAME}: fbgemm_gpu not importable ({project.why_no_fbgemm})")
        sync(device)
        result["build_s"] = time.perf_counter() - t0
    else:
        result["skipped"].append(f"collections and FBGEMM: torchrec_cowclip not importable ({project.why_not_full})")

    # The row step alone, on a table batch of its own with Adam state.
    total = sum(cards)
    table = torch.randn(total, dim, device=device) * 0.01
    row_state = {"exp_avg": torch.zeros(total, dim, device=device),
                 "exp_avg_sq": torch.zeros(total, dim, device=device)}
    row_inputs: Dict[int, Tuple[Tensor, Tensor, Tuple[Tensor, Tensor]]] = {}

    def row_step_variant(compiled: bool) -> Callable[[EmbBatch], None]:
        def step(batch: EmbBatch) -> None:
            grad, counts, bias = row_inputs[id(batch)]
            call = rs.row_step_ if compiled else rs.gather_step_scatter_
            call(table, row_state, batch.unique_rows, grad, counts, None, "adam", ADAM_LR, (0.9, 0.999),
                 EPS, 0.0, cowclip, None, None, bias)
        return step

    def ours(ebc: Any, upstream: Dict[int, Tensor]) -> Callable[[EmbBatch], None]:
        def step(batch: EmbBatch) -> None:
            (ebc(batch.kjt).values() * upstream[batch.kjt.values().shape[0]]).sum().backward()
        return step

    def fbgemm(tbe: Any, upstream: Dict[int, Tensor]) -> Callable[[EmbBatch], None]:
        def step(batch: EmbBatch) -> None:
            (tbe(batch.indices, batch.offsets) * upstream[batch.indices.shape[0]]).sum().backward()
        return step

    bandwidth = copy_bandwidth(device, 64 if args.quick else 1024)
    result["copy_bandwidth_bytes_per_s"] = bandwidth
    for bs in args.batch_sizes:
        if deadline.left() < args.part_reserve_s:
            result["incomplete"].append(f"batch {bs}: time budget spent")
            continue
        t0 = time.perf_counter()
        batches = [make_emb_batch(sampler.sample(bs), cards, device, project.full) for _ in range(3)]
        make_s = time.perf_counter() - t0
        unique = [int(b.unique_rows.numel()) for b in batches]
        for b in batches:
            bias = fn.adam_bias_corrections(torch.full_like(b.counts, 10), 0.9, 0.999, torch.float32)
            row_inputs[id(b)] = (torch.randn(b.unique_rows.numel(), dim, device=device) * 0.01, b.counts, bias)
        upstream = {len(cards) * bs: torch.randn(bs, len(cards) * dim, device=device)}
        variants: Dict[str, Callable[[EmbBatch], None]] = {}
        if "adam" in modules:
            variants[ADAM_NAME] = ours(modules["adam"], upstream)
            variants[ADAGRAD_NAME] = ours(modules["adagrad"], upstream)
        if "tbe" in modules:
            variants[FBGEMM_NAME] = fbgemm(modules["tbe"], upstream)
        path = {"1": "compiled", "0": "eager", "auto": "auto"}[args.compile]
        variants[ROW_STEP_NAME.format(path=path)] = row_step_variant(True)
        if args.compile != "0":  # the same step uncompiled, for the compiler's gain
            variants[ROW_STEP_NAME.format(path="eager")] = row_step_variant(False)
        limit = min(args.part_time_limit_s, max(deadline.left() - args.part_reserve_s, 1.0))
        print(f"  batch {bs:,}: {statistics.fmean(unique):,.0f} distinct rows per step; {args.warmup} warm-up "
              f"+ up to {args.steps} rounds of {len(variants)} variants ...", flush=True)
        try:
            samples = time_rounds(variants, batches, args.steps, args.warmup, limit, device)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: report, go on
            result["incomplete"].append(f"batch {bs}: {type(error).__name__}: {error}")
            traceback.print_exc()
            continue
        floor_ms = (bs * len(cards) * dim * 4 + statistics.fmean(unique) * 3 * dim * 4 * 2) / bandwidth * 1e3
        result["per_batch"].append({
            "batch_size": bs, "distinct_rows": unique, "make_batches_s": make_s, "floor_ms_adam": floor_ms,
            "variants": {n: {"median_ms": statistics.median(s), "min_ms": min(s), "steps": len(s),
                             "samples_ms": s} for n, s in samples.items() if s},
        })
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    modules.clear()  # the tables go with this frame; main() frees the memory after the part
    return result


def embedding_table(result: Dict[str, Any]) -> str:
    rows = [["batch", "variant", "median ms", "min ms", "vs fbgemm", "samples/s"]]
    for entry in result["per_batch"]:
        v = entry["variants"]
        ref = v.get(FBGEMM_NAME, {}).get("median_ms")
        for name, t in v.items():
            rows.append([f"{entry['batch_size']:,}", name, f"{t['median_ms']:.2f}", f"{t['min_ms']:.2f}",
                         f"{t['median_ms'] / ref:.2f}" if ref and "row step" not in name else "-",
                         f"{entry['batch_size'] / (t['median_ms'] / 1e3):,.0f}" if "row step" not in name else ""])
        rows.append([f"{entry['batch_size']:,}", "memory-bandwidth floor (ours adam)",
                     f"{entry['floor_ms_adam']:.2f}", "", "", ""])
    return format_table(rows)


# --- DeepFM samples/s ------------------------------------------------------------------


def run_deepfm(project: Project, device: torch.device, args: argparse.Namespace,
               deadline: Deadline) -> Dict[str, Any]:
    from torchrec.distributed.train_pipeline import TrainPipelineBase

    from torchrec_cowclip import CowClip
    from torchrec_cowclip.data import open_dataset
    from torchrec_cowclip.data.batches import BatchIterator
    from torchrec_cowclip.models import build_model
    from torchrec_cowclip.train.task import CTRTrainTask

    schema = project.schema
    epoch_rows = getattr(schema, "CRITEO_KAGGLE_ROWS", CRITEO_ROWS_FALLBACK)
    max_card = args.max_rows if args.max_rows is not None else max(schema.CRITEO_KAGGLE_CARDINALITIES)
    bs = args.deepfm_batch
    rows = max(args.deepfm_rows, 2 * bs)
    result: Dict[str, Any] = {"rows_generated": rows, "batch_size": bs, "max_cardinality": max_card,
                              "epoch_rows": epoch_rows}
    print(f"deepfm: synthetic:{rows:,} (cardinalities capped at {max_card:,}) into {args.cache_dir} ...",
          flush=True)
    cache = Path(args.cache_dir)
    entries_before = set(os.listdir(cache)) if cache.is_dir() else set()
    t0 = time.perf_counter()
    ds = open_dataset(f"synthetic:{rows}", args.cache_dir, max_cardinality=max_card)
    result["cache_s"] = time.perf_counter() - t0
    result["cache_reused"] = ds.path.name in entries_before
    # Linear in rows (generation is chunked); a reused cache says nothing about it.
    result["cache_s_extrapolated_to_epoch"] = (
        None if result["cache_reused"] else result["cache_s"] * epoch_rows / rows)
    cards = list(ds.schema.cardinalities)
    result["table_rows"] = sum(cards)

    # The recipe at this batch (the trainer's scaling rule from batch 1024): the values
    # do not change the cost of a step, only keep the run a realistic one.
    scale = bs / 1024
    model = build_model(
        "deepfm", sparse_names=list(ds.schema.sparse_names), cardinalities=cards,
        num_dense=ds.schema.n_dense, embedding_dim=10, hidden=(400, 400, 400), embedding_lr=1e-4,
        embedding_weight_decay=2 * 1e-5 * scale, cowclip=CowClip.from_reference(1.0, 1e-5, 10), device=device,
    )
    optimizer = torch.optim.Adam(model.dense_parameters(), lr=8e-4 * math.sqrt(scale))
    task = CTRTrainTask(model)
    task.train()
    pipeline = TrainPipelineBase(task, optimizer, device)

    def epochs() -> Iterator[Any]:
        for epoch in itertools.count():  # the timed steps may need more than one pass
            yield from BatchIterator(ds, None, bs, shuffle=True, seed=0, epoch=epoch, drop_last=True,
                                     prefetch=2)

    batches = epochs()
    t0 = time.perf_counter()
    for _ in range(args.deepfm_warmup):  # includes the compile of the row step
        loss, _, _ = pipeline.progress(batches)
        float(loss)
    sync(device)
    result["warmup_s"] = time.perf_counter() - t0
    limit = min(args.part_time_limit_s, max(deadline.left() - 10.0, 1.0))
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
    result.update({"timed_steps": steps, "timed_s": elapsed, "steps_per_s": steps / elapsed,
                   "samples_per_s": steps * bs / elapsed, "first_loss": losses[0], "last_loss": losses[-1],
                   "losses_finite": all(math.isfinite(x) for x in losses)})

    # Data loading alone: the same iterator, batches copied to the device, no model.
    loader = BatchIterator(ds, None, bs, shuffle=True, seed=0, epoch=99, drop_last=True, prefetch=2)
    n_load = min(len(loader), max(steps, 2))
    t0 = time.perf_counter()
    for _, b in zip(range(n_load), loader):
        b.to(device, non_blocking=True)
    sync(device)
    result["loading_only_batches_per_s"] = n_load / (time.perf_counter() - t0)

    steps_per_epoch = math.ceil(epoch_rows / bs)
    result["steps_per_epoch"] = steps_per_epoch
    result["epoch_s_extrapolated"] = steps_per_epoch / result["steps_per_s"]
    result["goal_epoch_s"] = EPOCH_GOAL_S
    result["goal_applies"] = device.type == "cuda" and bs == GOAL_BATCH and max_card >= max(
        schema.CRITEO_KAGGLE_CARDINALITIES)
    result["goal_met"] = result["epoch_s_extrapolated"] < EPOCH_GOAL_S
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del pipeline, task, model, optimizer
    free_memory(device)
    return result


def deepfm_lines(r: Dict[str, Any]) -> List[str]:
    table = format_table([
        ["what", "value"],
        ["batch", f"{r['batch_size']:,}"],
        ["cache rows generated", f"{r['rows_generated']:,}"],
        ["cache build s (this run)", f"{r['cache_s']:.1f}" + (" (reused)" if r["cache_reused"] else "")],
        ["cache build s, linear extrapolation to the epoch's rows",
         "n/a (reused)" if r["cache_s_extrapolated_to_epoch"] is None else f"{r['cache_s_extrapolated_to_epoch']:.0f}"],
        ["timed steps", f"{r['timed_steps']}"],
        ["samples/s (loading + training, measured)", f"{r['samples_per_s']:,.0f}"],
        ["data loading alone, batches/s", f"{r['loading_only_batches_per_s']:.1f}"],
        [f"steps per epoch of {r['epoch_rows']:,} rows", f"{r['steps_per_epoch']}"],
        ["epoch s (EXTRAPOLATED from the timed steps)", f"{r['epoch_s_extrapolated']:.1f}"],
        ["loss first -> last timed step", f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}"],
    ])
    verdict = "MET" if r["goal_met"] else "NOT MET"
    if not r["goal_applies"]:
        goal = (f"goal (< {EPOCH_GOAL_S:.0f} s per epoch, one H200, batch {GOAL_BATCH:,}, full cardinalities): "
                f"not applicable to this run (device/batch/cardinalities differ); at these settings it would "
                f"be {verdict} ({r['epoch_s_extrapolated']:.1f} s)")
    else:
        goal = (f"GOAL < {EPOCH_GOAL_S:.0f} s per epoch of {r['epoch_rows']:,} rows at batch {GOAL_BATCH:,}: "
                f"{verdict} ({r['epoch_s_extrapolated']:.1f} s, EXTRAPOLATED from {r['timed_steps']} timed steps "
                f"over a {r['rows_generated']:,}-row cache; data loading from the cache included, cache "
                f"building not)")
    return [table, goal]


# --- main ------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes: the whole check in under a minute on CPU")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu"), help="folder for gpu_check.json")
    p.add_argument("--compile", choices=("auto", "1", "0"), default=None,
                   help="update path: 1 compiled (default on CUDA), 0 eager (default on CPU: the CPU "
                        "compiled path is tested by tests/test_row_step.py), auto")
    p.add_argument("--core-only", action="store_true",
                   help="do not import torchrec: run only what a machine without fbgemm_gpu can")
    p.add_argument("--max-rows", type=int, default=None,
                   help="cap on each table's rows (default: none on CUDA, 100000 on CPU, 2000 with --quick)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="embedding-step batches (default 16384,131072; --quick 512)")
    p.add_argument("--zipf", type=float, default=1.0, help="power-law exponent of the embedding-step ids")
    p.add_argument("--steps", type=int, default=None, help="timed rounds per batch size (default 20; --quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 3; --quick 1)")
    p.add_argument("--deepfm-rows", type=int, default=None, help="synthetic rows cached (default 4194304; --quick 4096)")
    p.add_argument("--deepfm-batch", type=int, default=None, help="default 131072; --quick 512")
    p.add_argument("--deepfm-steps", type=int, default=None, help="timed steps (default 30; --quick 3)")
    p.add_argument("--deepfm-warmup", type=int, default=None, help="default 3; --quick 1")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "cowclip_gpu_cache"))
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds for the whole run (default 420)")
    p.add_argument("--part-time-limit-s", type=float, default=90.0, help="timed seconds per batch size / DeepFM")
    p.add_argument("--part-reserve-s", type=float, default=30.0,
                   help="skip a timing when less than this is left of the budget")
    p.add_argument("--deepfm-min-s", type=float, default=None,
                   help="skip DeepFM when less than this is left of the budget (cache build, model, "
                        "compile, steps; default 120; --quick 5)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--inject-error", action="store_true",
                   help="self-test: make every row step slightly wrong; the correctness part must fail")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = args.device.startswith("cuda")
    q = args.quick
    defaults = {
        "compile": "1" if on_cuda else "0",
        "max_rows": 2000 if q else (None if on_cuda else 100_000),
        "batch_sizes": [512] if q else [16_384, 131_072],
        "steps": 3 if q else 20,
        "warmup": 1 if q else 3,
        "deepfm_rows": 4096 if q else 4_194_304,
        "deepfm_batch": 512 if q else GOAL_BATCH,
        "deepfm_steps": 3 if q else 30,
        "deepfm_warmup": 1 if q else 3,
        "deepfm_min_s": 5.0 if q else 120.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; expected some of {', '.join(PARTS)}")
    return args


def write_json(out_dir: Path, report: Dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out_dir / "gpu_check.json")


def print_report(report: Dict[str, Any]) -> None:
    """The tables, last: correctness, embedding step, DeepFM, then the verdicts."""
    print("\n" + "=" * 100)
    env = report["environment"]
    print(f"gpu_check: torch {env['torch']} (CUDA {env['torch_cuda']}), triton {env['triton']}, "
          f"device {env['device']}{' ' + env.get('gpu', '') if env.get('gpu') else ''}; "
          f"update mode {report['compile_mode']}; torchrec_cowclip "
          f"{'imported' if report['project_full'] else 'NOT importable: ' + report['why_not_full']}; "
          f"fbgemm_gpu {'imported' if report['fbgemm'] else 'NOT importable: ' + report['why_no_fbgemm']}")
    c = report.get("correctness")
    if c:
        print(f"\ncorrectness ({'WITH AN INJECTED ERROR, must fail' if c['injected_error'] else 'device vs float64 CPU'}):")
        groups: Dict[str, List[Dict[str, Any]]] = {}
        for check in c["checks"]:
            groups.setdefault(check["group"] or check["name"], []).append(check)
        rows = [["check", "comparisons", "failed", "max abs err"]]
        for name, checks in groups.items():
            rows.append([name, str(len(checks)), str(sum(not x["passed"] for x in checks)),
                         f"{max(x['max_abs_err'] for x in checks):.2g}"])
        print(format_table(rows))
        failed = [x for x in c["checks"] if not x["passed"]]
        for x in failed[:10]:
            print(f"  MISMATCH {x['name']}: {x['detail']}")
        if len(failed) > 10:
            print(f"  ... {len(failed) - 10} more in gpu_check.json")
        for s in c["skipped"]:
            print(f"  skipped: {s}")
    e = report.get("embedding")
    if e and e.get("per_batch"):
        print(f"\nembedding step (forward + backward + fused update), {e['tables']} tables, {e['rows']:,} rows, "
              f"dim {e['dim']}, single-hot zipf {e['zipf']}; ms per step, median of interleaved rounds:")
        print(embedding_table(e))
    for s in (e or {}).get("skipped", []) + (e or {}).get("incomplete", []):
        print(f"  embedding skipped: {s}")
    d = report.get("deepfm")
    if d and "epoch_s_extrapolated" in d:
        print("\nDeepFM (D 10, DNN 400-400-400, Adam + CowClip), synthetic Criteo-like data from the binary cache:")
        for line in deepfm_lines(d):
            print(line)
    for name, why in report["part_errors"].items():
        print(f"  {name}: {why}")
    print(f"\nRESULT: {report['verdict']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the parts; returns the exit status (0 ok, 1 mismatch, 2 incomplete)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device")
        return 2
    deadline = Deadline(args.time_budget)
    project = load_project(args.core_only)
    if not project.full:
        print(f"NOTE: torchrec_cowclip cannot be imported ({project.why_not_full}); running only the "
              "row-step checks and timings, which need neither torchrec nor fbgemm_gpu.")
    if not project.fbgemm:
        print(f"NOTE: fbgemm_gpu cannot be imported ({project.why_no_fbgemm}); the FBGEMM TBE baseline is skipped.")
    report: Dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items()}, "environment": environment(device),
        "compile_mode": args.compile, "project_full": project.full, "why_not_full": project.why_not_full,
        "fbgemm": project.fbgemm, "why_no_fbgemm": project.why_no_fbgemm, "part_errors": {},
    }
    out_dir = Path(args.out)
    project.row_step.set_compiled_update(args.compile)
    incomplete = not project.full
    try:
        with warnings.catch_warnings():
            # torchrec/fbgemm warn about FX and CUDA details irrelevant here.
            warnings.simplefilter("ignore")
            for part in args.parts:
                needed = args.deepfm_min_s if part == "deepfm" else args.part_reserve_s
                if part != "correctness" and deadline.left() < needed:
                    report["part_errors"][part] = "time budget spent"
                    incomplete = True
                    continue
                if part == "deepfm" and not project.full:
                    report["part_errors"][part] = "not run: needs torchrec_cowclip (not importable)"
                    continue
                t0 = time.perf_counter()
                try:
                    if part == "correctness":
                        report[part] = run_correctness(project, device, args)
                        incomplete |= bool(report[part]["skipped"])
                    elif part == "embedding":
                        report[part] = run_embedding(project, device, args, deadline)
                        incomplete |= bool(report[part]["incomplete"])
                    else:
                        report[part] = run_deepfm(project, device, args, deadline)
                    report[part]["seconds"] = time.perf_counter() - t0
                except Exception as error:  # noqa: BLE001 - report and go on to the next part
                    traceback.print_exc()
                    report["part_errors"][part] = f"{type(error).__name__}: {error}"
                    incomplete = True
                free_memory(device)
                print(f"[{part} took {time.perf_counter() - t0:.1f} s]", flush=True)
                write_json(out_dir, report)
    finally:
        project.row_step.set_compiled_update(None)
    correctness = report.get("correctness")
    if correctness and correctness["failed"]:
        status, verdict = 1, f"FAIL: {correctness['failed']} correctness comparison(s) mismatched"
    elif incomplete or (correctness is None and "correctness" in args.parts):
        status, verdict = 2, "INCOMPLETE: no mismatch, but some checks or parts could not run (see above)"
    else:
        status, verdict = 0, "PASS" if correctness else "done (correctness not requested)"
    report["verdict"], report["exit_status"] = verdict, status
    write_json(out_dir, report)
    print_report(report)
    print(f"results: {out_dir / 'gpu_check.json'}")
    return status


if __name__ == "__main__":
    sys.exit(main())

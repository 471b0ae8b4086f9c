"""What the benchmarks share: their inputs (power-law ids, Criteo Kaggle's table sizes,
single-hot KJT batches), the modules they time (ours and FBGEMM's TBE), the timing itself
(interleaved rounds, paired ratios, a copy-bandwidth probe), and their output (plain-text
tables, JSON/CSV/PNG files, process memory).

Only numpy and torch are imported here; torchrec, fbgemm_gpu and matplotlib load inside
the functions that need them, so a benchmark imports this on a machine without them.
"""

from __future__ import annotations

import csv
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the benchmarks run from a clone, the package not installed
    sys.path.insert(0, str(REPO))

from torchrec_cowclip import CowClip, CowClipOptions  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ADAM_LR = 1e-3
ADAGRAD_LR = 1e-2
EPS = 1e-8
COWCLIP = CowClip(r=1.0, zeta=1e-5)
SEED = 0
CPU = torch.device("cpu")


# --- inputs ------------------------------------------------------------------------


def zipf_cdf(rows: int, exponent: float) -> np.ndarray:
    """CDF of the truncated power law ``p(rank k) ~ k**-exponent`` over ranks ``1..rows``."""
    weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


class PowerLawIds:
    """Single-hot power-law ids per table; ranks map to rows by a fixed random permutation
    per table (as hashing would), so the hot rows are spread over the table."""

    def __init__(self, rows: Sequence[int], exponent: float, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.rows = list(rows)
        cdfs = {n: zipf_cdf(n, exponent) for n in set(self.rows)}
        self.cdfs = [cdfs[n] for n in self.rows]
        self.rank_to_row = [self.rng.permutation(n) for n in self.rows]

    def sample(self, batch_size: int) -> List[np.ndarray]:
        """One id per sample per table."""
        return [
            perm[np.minimum(np.searchsorted(cdf, self.rng.random(batch_size)), n - 1)]
            for perm, cdf, n in zip(self.rank_to_row, self.cdfs, self.rows)
        ]


def criteo_table_rows(max_rows: Optional[int]) -> List[int]:
    """Criteo Kaggle's 26 table sizes, each capped at ``max_rows`` (None: uncapped)."""
    from torchrec_cowclip.data.schema import CRITEO_KAGGLE_CARDINALITIES

    return [k if max_rows is None else min(k, max_rows) for k in CRITEO_KAGGLE_CARDINALITIES]


@dataclass
class Batch:
    """One step's input, in both forms (the TBE's are the KJT's own tensors)."""

    kjt: Any  # torchrec KeyedJaggedTensor, features f0..f{T-1}, on the benchmark's device
    indices: Tensor  # [T * B] feature-major ids, per table (no table offset)
    offsets: Tensor  # [T * B + 1]
    unique_rows: int  # distinct (table, row) pairs the batch touches
    per_table: List[np.ndarray]  # the ids, on the host


def single_hot_batches(
    rows: Sequence[int],
    batch_size: int,
    exponent: float,
    count: int,
    seed: int = SEED,
    device: torch.device = CPU,
    ids: Optional[PowerLawIds] = None,
) -> List[Batch]:
    """``count`` single-hot batches (one id per feature per sample, as Criteo) of
    :class:`PowerLawIds` (``ids``, or new ones of ``rows``, ``exponent`` and ``seed``), the
    same hot rows in every batch."""
    from torchrec import KeyedJaggedTensor

    ids = ids or PowerLawIds(rows, exponent, seed)
    keys = [f"f{t}" for t in range(len(rows))]
    batches: List[Batch] = []
    for _ in range(count):
        per_table = ids.sample(batch_size)
        values = torch.from_numpy(np.concatenate(per_table).astype(np.int64))
        lengths = torch.ones(len(rows) * batch_size, dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        # Offsets computed here on CPU travel with .to(); computed later on CUDA they
        # would need fbgemm_gpu's CUDA asynchronous_complete_cumsum.
        kjt.offsets()
        kjt = kjt.to(device)
        unique = sum(int(np.unique(t).size) for t in per_table)
        batches.append(Batch(kjt, kjt.values(), kjt.offsets(), unique, per_table))
    return batches


# --- the modules timed -------------------------------------------------------------


def make_ours(
    rows: Sequence[int],
    dim: int,
    optimizer: str,
    device: torch.device = CPU,
    data_type: str = "fp32",
    weight_decay: float = 0.0,
) -> Any:
    """``CowClipEmbeddingBagCollection`` over tables ``t{i}`` of ``rows[i]`` rows (feature
    ``f{i}``) stored in ``data_type`` (fp32, fp16, bf16), CowClip r = 1, zeta = 1e-5;
    Adam and AdamW lr 1e-3, other optimizers lr 1e-2."""
    from torchrec import DataType, EmbeddingBagConfig

    from torchrec_cowclip import CowClipEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=dim,
            num_embeddings=n,
            feature_names=[f"f{t}"],
            data_type=DataType(data_type.upper()),
        )
        for t, n in enumerate(rows)
    ]
    lr = ADAM_LR if optimizer in ("adam", "adamw") else ADAGRAD_LR
    return CowClipEmbeddingBagCollection(
        tables,
        device=device,
        options=CowClipOptions(
            optimizer=optimizer, lr=lr, eps=EPS, cowclip=COWCLIP, weight_decay=weight_decay
        ),
    )


def make_tbe(
    rows: Sequence[int],
    dim: int,
    device: torch.device = CPU,
    initial: Optional[Sequence[Tensor]] = None,
    optimizer: str = "EXACT_ROWWISE_ADAGRAD",
    **options: Any,
) -> Any:
    """FBGEMM's fused TBE (``SplitTableBatchedEmbeddingBagsCodegen``) with ``optimizer``
    (an ``EmbOptimType`` name: ``EXACT_ROWWISE_ADAGRAD`` at lr 1e-2, ``ADAM`` at 1e-3), SUM
    pooling, on the device (``DEVICE``/``CUDA``) or the host (``HOST``/``CPU``); started
    from ``initial`` weights if given. ``options`` go to the TBE (e.g. FBGEMM's own
    CowClip)."""
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
        [(n, dim, location, compute) for n in rows],
        optimizer=EmbOptimType[optimizer],
        learning_rate=ADAM_LR if optimizer == "ADAM" else ADAGRAD_LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
        device=device,
        **options,
    )
    if initial is not None:
        with torch.no_grad():
            for dst, src in zip(tbe.split_embedding_weights(), initial):
                dst.copy_(src)
    return tbe


def fbgemm_cowclip_options() -> Dict[str, Any]:
    """:func:`make_tbe` options for FBGEMM's own ``WeightDecayMode.COWCLIP`` (row-wise
    Adagrad only; it clips with a running row counter, not this batch's count), with this
    module's CowClip ``r`` and ``zeta``."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        CounterWeightDecayMode,
        CowClipDefinition,
        WeightDecayMode,
    )

    return dict(
        weight_decay=0.0,
        weight_decay_mode=WeightDecayMode.COWCLIP,
        cowclip_regularization=CowClipDefinition(
            counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE,
            counter_halflife=-1,
            weight_norm_coefficient=COWCLIP.r,
            lower_bound=COWCLIP.zeta,
        ),
    )


def tbe_storage_bytes(tbe: Any) -> int:
    """Bytes of a TBE's weights and optimizer state tensors (its own buffers)."""
    return sum(
        t.numel() * t.element_size()
        for name, t in list(tbe.named_buffers()) + list(tbe.named_parameters())
        if name.endswith(("_host", "_dev", "_uvm"))
    )


def ours_step(ebc: Any, grad: Tensor) -> Callable[[Batch], None]:
    """Forward + backward (which runs the fused update) of ours on a batch."""

    def step(batch: Batch) -> None:
        (ebc(batch.kjt).values() * grad).sum().backward()

    return step


def fbgemm_step(tbe: Any, grad: Tensor) -> Callable[[Batch], None]:
    """Forward + backward (which runs FBGEMM's fused update) of the TBE on a batch."""

    def step(batch: Batch) -> None:
        (tbe(batch.indices, batch.offsets) * grad).sum().backward()

    return step


# --- timing ------------------------------------------------------------------------


@dataclass
class Timing:
    """Per-step times of one variant, in milliseconds."""

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


def paper_deepfm(schema: Any, **overrides: Any) -> Any:
    """The paper's DeepFM (D 10, DNN 400-400-400, table Adam lr 1e-4, the reference's
    CowClip) over a dataset's ``schema``; ``overrides`` are ``build_model`` arguments."""
    from torchrec_cowclip.models import build_model

    options: Dict[str, Any] = dict(
        sparse_names=list(schema.sparse_names),
        cardinalities=list(schema.cardinalities),
        num_dense=schema.n_dense,
        embedding_dim=10,
        hidden=(400, 400, 400),
        embedding_options=CowClipOptions(lr=1e-4, cowclip=CowClip.from_reference(1.0, 1e-5, 10)),
    )
    return build_model("deepfm", **{**options, **overrides})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_interleaved(
    variants: Mapping[str, Callable[[Any], None]],
    batches: Sequence[Any],
    rounds: int,
    warmup: int,
    time_limit_s: float,
    device: torch.device = CPU,
) -> Dict[str, Timing]:
    """Each round runs every variant once on the same batch, the order rotated by one
    every round; the first ``warmup`` rounds are not recorded. Timed rounds stop early
    once ``time_limit_s`` has passed, so sample ``i`` of every variant is round ``i``.

    On CUDA a call is timed by CUDA events and starts on an idle device (synchronised
    first), so its time runs from its first launch to the end of its last kernel and no
    variant hides its host work behind another's kernels; elsewhere by the wall clock."""
    names = list(variants)
    timings = {name: Timing() for name in names}
    cuda = device.type == "cuda"
    gc.collect()
    gc.disable()
    try:
        deadline = float("inf")
        for r in range(warmup + rounds):
            if r == warmup:
                deadline = time.perf_counter() + time_limit_s
            batch = batches[r % len(batches)]
            shift = r % len(names)
            pending: List[Tuple[str, Callable[[], float]]] = []
            for name in names[shift:] + names[:shift]:
                if cuda:
                    begin, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    sync(device)
                    begin.record()
                    variants[name](batch)
                    end.record()
                    pending.append((name, lambda b=begin, e=end: b.elapsed_time(e)))
                else:
                    start = time.perf_counter()
                    variants[name](batch)
                    elapsed = (time.perf_counter() - start) * 1e3
                    pending.append((name, lambda ms=elapsed: ms))
            sync(device)
            if r >= warmup:
                for name, ms in pending:
                    timings[name].samples.append(ms())
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


def slow_rounds(timings: Mapping[str, Timing], factor: float = 2.0) -> int:
    """Rounds that took over ``factor`` times the fastest round (a throttled machine)."""
    totals = [sum(step) for step in zip(*(t.samples for t in timings.values()))]
    return sum(total > factor * min(totals) for total in totals)


def copy_bandwidth(megabytes: int = 512, repeats: int = 5, device: torch.device = CPU) -> float:
    """Best observed bytes moved (read + write) per second by a large tensor copy."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def floor_bytes(lookups: int, dim: int, unique_rows: float, state_per_row: int = 2) -> float:
    """Bytes ours with Adam must move per step: the pooled lookup reads ``lookups * dim``
    floats; the update reads and writes weight + ``state_per_row`` moments of every
    touched row. (Gradients, ids and outputs are left out: a lower bound.)"""
    return float(lookups * dim * 4 + unique_rows * (1 + state_per_row) * dim * 4 * 2)


def load_average() -> str:
    """``/proc/loadavg``'s 1, 5 and 15 minute load averages (empty where it is absent)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return ""


def digest_files(files: Iterable[Path], update: Callable[[bytes], object]) -> None:
    """Feeds every byte of ``files`` to ``update`` (a checksum's), 8 MiB at a time."""
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                update(chunk)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --- output ------------------------------------------------------------------------


def format_table(rows: List[List[str]]) -> str:
    """Left-aligned first column, right-aligned others, a rule under the header.

    Example::

        >>> print(format_table([["variant", "ms"], ["ours", "1.0"]]))
        variant   ms
        -------  ---
        ours     1.0
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: os.PathLike | str, obj: Any) -> None:
    """``obj`` as indented JSON at ``path`` (folders made), replaced whole: a run cut
    short leaves the previous complete file, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


def write_csv(
    path: os.PathLike | str,
    rows: Sequence[Mapping[str, Any]],
    fieldnames: Optional[Sequence[str]] = None,
    **options: Any,
) -> None:
    """One CSV row per mapping; the columns are ``fieldnames`` or the first row's keys.
    ``options`` go to ``csv.DictWriter`` (``extrasaction``, ``restval``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fieldnames or rows[0]), **options)
        writer.writeheader()
        writer.writerows(rows)


def write_png(path: os.PathLike | str, draw: Callable[[Any], Any], dpi: int = 120) -> bool:
    """Saves the figure ``draw(pyplot)`` returns at ``path``; without matplotlib says so
    and returns False."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {Path(path).name} (the other outputs are written)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True


def grouped_bars(
    results: Sequence[Mapping[str, Any]],
    group: Callable[[Mapping[str, Any]], Any],
    label: Callable[[Any], str],
    value: str,
    ylabel: str,
    title: str = "",
) -> Callable[[Any], Any]:
    """A :func:`write_png` drawing: one bar per variant (``result["variant"]``) in each
    group (``group(result)``, labelled ``label(group)``), ``result[value]`` high, log scale."""

    def draw(plt: Any) -> Any:
        groups = sorted({group(r) for r in results})
        names = list(dict.fromkeys(r["variant"] for r in results))
        fig, ax = plt.subplots(figsize=(max(6, 2 * len(groups)), 4))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = [
                next((r[value] for r in results if r["variant"] == name and group(r) == g), 0)
                for g in groups
            ]
            ax.bar([k + i * width for k in range(len(groups))], ys, width, label=name)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(groups))])
        ax.set_xticklabels([label(g) for g in groups])
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        if title:
            ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    return draw


# --- process memory ----------------------------------------------------------------


def vm_hwm_kib() -> int:
    """Peak resident set size of this process so far, KiB (-1 where /proc lacks it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def self_command(script: str, *words: str, **flags: Any) -> List[str]:
    """The command that reruns ``script`` with this python: ``words`` as given, then each
    of ``flags`` as ``--name value`` (underscores as dashes)."""
    options = [item for k, v in flags.items() for item in (f"--{k.replace('_', '-')}", str(v))]
    return [sys.executable, os.path.abspath(script), *words, *options]


def child_memory(cmd: List[str]) -> Dict[str, Any]:
    """Runs a benchmark's memory child, whose last stdout line is a JSON object with
    ``before_kib`` and ``peak_kib``; adds ``peak_mib`` and ``delta_mib`` (the peak over
    the child's peak before it built the variant), or returns ``{"error": ...}``."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {
            "error": proc.stderr.strip().splitlines()[-1]
            if proc.stderr.strip()
            else f"rc {proc.returncode}"
        }
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["delta_mib"] = (result["peak_kib"] - result["before_kib"]) / 1024
    result["peak_mib"] = result["peak_kib"] / 1024
    return result


def optimizer_state_bytes(optimizer: Any, params: Optional[Iterable[Any]] = None) -> int:
    """Bytes of the tensors in ``optimizer.state`` (of ``params`` only, if given)."""
    keep = None if params is None else {id(p) for p in params}
    total = 0
    for param, state in optimizer.state.items():
        if keep is not None and id(param) not in keep:
            continue
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total

"""What a training run tells its user: the start summary (settings, tables, parameters,
processes, dense inputs, labels), the process's peak memory, and which weights the run
folder keeps. Each epoch's line is its ``epochs.csv`` row's
(:func:`~torchrec_cowclip.run.log.epoch_line`); the run's ETA is
:meth:`~torchrec_cowclip.train.run_state.Progress.eta`'s. The loop tells them through
:class:`~torchrec_cowclip.train.report.RunReport`.

Example::

    >>> sizes = ModelSize(tables=(("emb_C1", 1000, 10), ("lin_C1", 1000, 1)), dense_parameters=2500)
    >>> sizes.describe()
    'tables: 2 (1 of dim 10, 1 of dim 1), 2,000 rows, largest emb_C1 (1,000 x 10) | parameters: 11,000 in tables + 2,500 dense = 13,500'
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from torchrec_cowclip.train.config import TrainSettings
    from torchrec_cowclip.train.data import TrainingData

#: Epoch-row columns that are timings or memory (they differ between two runs of one
#: command, so comparisons of runs leave them out).
TIMING_COLUMNS = ("epoch_s", "train_samples_per_s", "peak_rss_mb")


@dataclass(frozen=True)
class ModelSize:
    """The model's tables as ``(name, rows, dim)`` and its dense parameter count."""

    tables: Tuple[Tuple[str, int, int], ...]
    dense_parameters: int

    @classmethod
    def of(cls, table_configs: Iterable[Any], dense_parameters: int) -> "ModelSize":
        """From TorchRec ``EmbeddingBagConfig`` s (meta-device tables count alike)."""
        return cls(
            tuple((c.name, int(c.num_embeddings), int(c.embedding_dim)) for c in table_configs),
            int(dense_parameters),
        )

    @property
    def table_parameters(self) -> int:
        return sum(rows * dim for _, rows, dim in self.tables)

    def describe(self) -> str:
        if not self.tables:
            return f"tables: none | parameters: {self.dense_parameters:,} dense"
        dims: Dict[int, int] = {}
        for _, _, dim in self.tables:
            dims[dim] = dims.get(dim, 0) + 1
        by_dim = ", ".join(f"{n} of dim {d}" for d, n in sorted(dims.items(), key=lambda x: -x[0]))
        name, rows, dim = max(self.tables, key=lambda t: t[1] * t[2])
        total = self.table_parameters + self.dense_parameters
        return (
            f"tables: {len(self.tables)} ({by_dim}), {sum(t[1] for t in self.tables):,} rows, "
            f"largest {name} ({rows:,} x {dim}) | parameters: {self.table_parameters:,} in "
            f"tables + {self.dense_parameters:,} dense = {total:,}"
        )

    def as_dict(self) -> Dict[str, Any]:
        return {
            "tables": [{"name": n, "rows": r, "dim": d} for n, r, d in self.tables],
            "table_parameters": self.table_parameters,
            "dense_parameters": self.dense_parameters,
        }


def processes_line(world_size: int, sharding: Optional[str], shardings: Mapping[str, str]) -> str:
    """How the run is spread: ``processes: 1 (no sharding)`` or, under torchrun, the
    process count and how many tables each sharding type holds.

    Example::

        >>> processes_line(2, "auto", {"emb_C1": "table_wise", "emb_C2": "row_wise"})
        "processes: 2 | sharding auto (TorchRec's planner): table_wise 1, row_wise 1"
    """
    if world_size <= 1:
        return "processes: 1 (the whole model in this process)"
    from torchrec_cowclip.train.processes import describe_shardings

    how = "TorchRec's planner" if sharding in (None, "auto") else "every table"
    return (
        f"processes: {world_size} | sharding {sharding or 'auto'} ({how}): "
        f"{describe_shardings(dict(shardings)) or 'no tables'}"
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS


#: How far from 1 a calibration (mean prediction / positive rate) is named at the end.
CALIBRATION_TOLERANCE = 0.05


def calibration_line(calibration: Optional[float]) -> Optional[str]:
    """A line when the reported weights' test calibration is more than
    :data:`CALIBRATION_TOLERANCE` from 1 (None otherwise, or without one).

    Example::

        >>> print(calibration_line(1.10))
        calibration: the reported weights predict 10% above the test split's positive rate (mean prediction / rate 1.100); rank-based AUC does not see it, probabilities used as such (bids, expected clicks) do
        >>> calibration_line(0.98) is None
        True
    """
    if calibration is None or not abs(calibration - 1.0) > CALIBRATION_TOLERANCE:
        return None
    way = "above" if calibration > 1 else "below"
    return (
        f"calibration: the reported weights predict {abs(calibration - 1):.0%} {way} the test "
        f"split's positive rate (mean prediction / rate {calibration:.3f}); rank-based AUC "
        "does not see it, probabilities used as such (bids, expected clicks) do"
    )


def without(row: Mapping[str, Any], keys: Sequence[str]) -> Dict[str, Any]:
    """``row`` without ``keys``."""
    return {k: v for k, v in row.items() if k not in keys}


def banner(settings: "TrainSettings", data: "TrainingData", device: Any) -> str:
    """The run's settings in one line: model, data and splits, batch and recipe, the
    learning rates, L2, the clip, Helen and the device."""
    hp, count_lr = settings.hp, settings.hp.count_lr
    embedding = settings.optimizers.embedding
    clip = (
        f"CowClip r={hp.clip_r:g} zeta={hp.clip_zeta:.3g}" if embedding.cowclip else "no clipping"
    )
    return (
        f"model {settings.model.name} | data {settings.data.spec}: {len(data.train_idx):,} train, "
        f"{len(data.val_idx):,} val, {len(data.test_idx):,} test | batch {hp.batch_size} "
        f"(x{hp.scale:g} of {hp.base_batch_size}, recipe {hp.recipe}) | dense lr {hp.dense_lr:.4g} "
        f"(warm-up {hp.warmup_epochs:g} epoch) | embedding {settings.model.embedding_backend}/"
        f"{embedding.optimizer} lr {hp.embedding_lr:.4g}"
        + (f" x min(count, {count_lr.cap:g})^{count_lr.power:g}" if count_lr else "")
        + f" | L2 lambda {hp.l2:.4g} "
        f"(weight_decay {hp.embedding_weight_decay:.4g}) | {clip}"
        + (f" | Helen rho={hp.helen_rho:.3g} bound={hp.helen_bound:g}" if hp.helen_rho else "")
        + f" | device {device}"
    )


def start_lines(
    settings: "TrainSettings",
    data: "TrainingData",
    runtime: Any,
    out: Path,
    total_steps: int,
) -> List[str]:
    """The lines a run starts with: where it writes, the settings, the model's size,
    the processes and sharding, and how the dense columns enter the model."""
    plan, run = data.dense_plan, settings.run
    return [
        f"run {out}: {run.epochs} epoch(s) of {runtime.steps_per_epoch:,} steps"
        + (f", stopping at step {total_steps:,}" if run.max_steps else "")
        + (
            "; best_epoch by validation AUC"
            if len(data.val_idx)
            else "; no validation split (--val-fraction): the final epoch is reported"
        ),
        *([settings.defaults_line] if settings.defaults_line else []),
        banner(settings, data, runtime.device),
        runtime.model_size.describe(),
        processes_line(runtime.world_size, runtime.sharding, runtime.table_shardings()),
        f"dense inputs: {plan.summary()}; statistics of {plan.fitted_on}"
        + (f" (read in {data.plan_seconds:.1f} s)" if data.plan_seconds >= 1 else ""),
        "positive labels: "
        + ", ".join(
            f"{rate:.2%} of {name}"
            + (" (one class: its AUC is undefined)" if rate in (0.0, 1.0) else "")
            for name, rate in data.positive_rates.items()
            if rate is not None
        ),
    ]


def weights_line(
    out: Path, reported: str, kept: Sequence[str], best_epoch: Optional[int], epochs: int
) -> str:
    """Which weights the run folder keeps, and which predict and evaluate use."""
    where = out / "model" / "weights"
    if "best" not in kept:
        return f"weights: {where}/final (the last step's); predict and evaluate use them"
    best = f"best (epoch {best_epoch}, the best validation AUC)"
    final = f"final (the last step's, epoch {epochs})"
    if reported == "best":
        return (
            f"weights: {where}/{best}, which predict and evaluate use by default, and "
            f"{final}: --weights final"
        )
    return (
        f"weights: {where}/{final}, which predict and evaluate use by default, and "
        f"{best}: --weights best"
    )

"""What a training run tells its user, and :class:`RunReport`, the one collaborator the loop
tells it through: the start summary (settings, tables, parameters, processes, dense inputs,
labels), the progress bars, each step's and epoch's rows (the run log), the process's peak
memory, and which weights the run folder keeps. Each epoch's line is its ``epochs.csv``
row's (:func:`~torchrec_cowclip.run.log.epoch_line`); the run's ETA is
:meth:`~torchrec_cowclip.train.run_state.Progress.eta`'s.

Example::

    >>> sizes = ModelSize(tables=(("emb_C1", 1000, 10), ("lin_C1", 1000, 1)), dense_parameters=2500)
    >>> sizes.describe()
    'tables: 2 (1 of dim 10, 1 of dim 1), 2,000 rows, largest emb_C1 (1,000 x 10) | parameters: 11,000 in tables + 2,500 dense = 13,500'
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from torchrec_cowclip.run.log import RunLog, duration, epoch_line
from torchrec_cowclip.run.resume_guard import resumed_message

if TYPE_CHECKING:
    from torchrec_cowclip.train.config import TrainSettings
    from torchrec_cowclip.train.data import TrainingData
    from torchrec_cowclip.train.run_state import Progress

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


class RunReport:
    """Everything the training loop tells, and where: the start summary, a progress bar
    per epoch and per evaluation, each step's row (every ``log_every`` steps) and each
    epoch's (``steps.csv``, ``epochs.csv``, TensorBoard, the epoch's line), early stopping,
    and the finished run's weights and calibration. Only the main process writes
    (``main``); ``bars``: whether the progress bars are drawn.

    Args:
        out: the run directory (its run log).
        lines: the start summary (:func:`start_lines`).
        eta_plan: what the run's ETA counts (:meth:`Progress.eta
            <torchrec_cowclip.train.run_state.Progress.eta>`): its epochs, their steps,
            ``--max-steps`` and the evaluations per epoch.
        log_every: the steps between two rows of ``steps.csv``.
    """

    def __init__(
        self,
        out: Path,
        lines: Sequence[str],
        eta_plan: Tuple[int, int, int, int],
        log_every: int,
        main: bool,
        bars: bool,
    ) -> None:
        self.out, self.lines, self.eta_plan = out, list(lines), eta_plan
        self.epochs, self.steps_per_epoch = eta_plan[0], eta_plan[1]
        self.log_every, self.main, self.bars = log_every, main, bars
        self._log: Optional[RunLog] = None
        self._bar: Any = None
        # Samples and time since steps.csv's last row (its samples/s).
        self._since, self._samples_since = time.perf_counter(), 0

    def say(self, line: str) -> None:
        """One line on stderr (the main process's)."""
        if self.main:
            print(line, file=sys.stderr, flush=True)

    def open(self, resumed: Optional[Tuple["Progress", Path]] = None) -> None:
        """Starts the run log and tells the start summary; a run ``resumed`` at a progress
        from a checkpoint says so and drops the rows logged after it."""
        lines = list(self.lines)
        if resumed is not None:
            p, checkpoint = resumed
            lines.append(
                resumed_message(
                    p.global_step, p.epoch, p.batch_in_epoch, self.steps_per_epoch, checkpoint
                )
            )
        self._log = RunLog(self.out, enabled_progress=self.bars and self.main, enabled=self.main)
        for line in lines:
            self._log.info(line)
        if resumed is not None:
            self._log.rewind(resumed[0].global_step, resumed[0].epoch)

    def info(self, line: str) -> None:
        """A line of the run (in the run log's terminal)."""
        assert self._log is not None, "open() the report first"
        self._log.info(line)

    def epoch_started(self, p: "Progress") -> None:
        """The epoch's progress bar, from where ``p`` is."""
        assert self._log is not None, "open() the report first"
        self._bar = self._log.progress_bar(
            total=self.steps_per_epoch,
            initial=p.batch_in_epoch,
            desc=f"epoch {p.epoch + 1}/{self.epochs}",
        )
        self._since, self._samples_since = time.perf_counter(), 0

    def stepped(
        self,
        p: "Progress",
        loss: float,
        running: float,
        samples: int,
        step_s: float,
        dense_lr: float,
        helen: bool,
    ) -> None:
        """A training step done: its row every ``log_every`` steps, the bar moved on with
        the running loss, the speed, the run's ETA at ``step_s`` a step and, for Helen,
        what its second pass adds."""
        assert self._log is not None, "open() the report first"
        self._samples_since += samples
        if p.global_step % self.log_every == 0:
            now = time.perf_counter()
            rate = self._samples_since / max(now - self._since, 1e-9)
            self._since, self._samples_since = now, 0
            values = {"loss": loss, "running_loss": running, "samples_per_s": rate}
            self._log.step(p.global_step, {**values, "dense_lr": dense_lr})
        self._bar.update(1)
        postfix = {
            "loss": f"{running:.4f}",
            "samples_s": f"{p.train_samples / max(p.train_seconds, 1e-9):,.0f}",
            "run_eta": duration(p.eta(step_s, *self.eta_plan)),
        }
        if helen:
            postfix["helen_extra"] = f"+{p.helen_cost()['extra_fraction']:.0%}"
        self._bar.set_postfix(postfix)

    def epoch_ended(self) -> None:
        """Closes the epoch's progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def evaluation_bar(self, total: int, name: str, rows: int) -> Any:
        """A progress bar over an evaluation's ``total`` batches of ``rows`` rows."""
        assert self._log is not None, "open() the report first"
        return self._log.progress_bar(
            total=total, initial=0, desc=f"evaluating {name} ({rows:,} rows)", unit="batch"
        )

    def epoch(self, row: Dict[str, Any], eta_s: Optional[float]) -> None:
        """An epoch's row (``epochs.csv``, TensorBoard) and line, with the run's ETA."""
        assert self._log is not None, "open() the report first"
        self._log.epoch(row)
        self._log.info(epoch_line({**row, "epochs": self.epochs, "eta_s": eta_s}))

    def close(self) -> None:
        """Closes the run log (the lines after it go straight to stderr)."""
        self.epoch_ended()
        if self._log is not None:
            self._log.close()

"""Where a training run is (:class:`Progress`), and its state in the run's checkpoints
(:class:`RunCheckpoints`): the latest state, saved at every epoch's end (and every
``--checkpoint-every`` steps) with everything an exact ``--resume`` needs, the best
validation epoch's weights, and the restore that checks a checkpoint's run against this
command before any state is loaded (:func:`~torchrec_cowclip.run.resume_guard.check_resume`).

The store itself - manifests, verification, atomic writes, the kept count - is
:class:`~torchrec_cowclip.run.checkpoints.CheckpointStore`'s.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.run.checkpoints import (
    TRAINER_STATE,
    Checkpoint,
    CheckpointStore,
    DamagedCheckpointError,
)
from torchrec_cowclip.run.resume_guard import check_resume, check_sources
from torchrec_cowclip.run.stop import RunStopped
from torchrec_cowclip.train.config import RECORDED_SETTINGS
from torchrec_cowclip.train.runtime import Runtime, set_rng_state


@dataclass
class Progress:
    """Where the run is; saved in checkpoints so that ``--resume`` continues exactly."""

    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0
    train_samples: int = 0
    train_seconds: float = 0.0
    epoch_auc: List[float] = field(default_factory=list)
    epoch_logloss: List[float] = field(default_factory=list)
    epoch_val_auc: List[float] = field(default_factory=list)
    # Mean prediction over the positive rate, per epoch, of the test and validation splits.
    epoch_calibration: List[float] = field(default_factory=list)
    epoch_val_calibration: List[float] = field(default_factory=list)
    best_epoch: int = -1
    best_val_auc: float = -math.inf
    epochs_without_improvement: int = 0
    stopped_early: bool = False
    # Helen runs: seconds of the first passes and of what Helen adds (second passes).
    helen_first_pass_s: float = 0.0
    helen_extra_s: float = 0.0
    # The epoch in progress: its samples, summed loss (sample-weighted), training-step
    # and wall seconds, and the run's row counters when it began (for per-epoch figures).
    epoch_samples: int = 0
    epoch_loss_sum: float = 0.0
    epoch_train_seconds: float = 0.0
    epoch_wall_seconds: float = 0.0
    rows_updated_before_epoch: int = 0
    rows_clipped_before_epoch: int = 0
    # The epoch's running loss (steps.csv, the progress bar): an exponential average,
    # kept here so that a resumed run continues it rather than starting it again.
    running_loss: Optional[float] = None
    # Seconds of every evaluation pass so far, and how many (for the run's ETA).
    eval_seconds: float = 0.0
    evaluations: int = 0

    def step_done(self, seconds: float, samples: int, loss: float, helen: Any = None) -> float:
        """Counts one training step of the global batch: its ``seconds``, ``samples``,
        mean ``loss`` and, for a Helen step, its cost (``HelenCost``); returns the epoch's
        running loss."""
        self.train_seconds += seconds
        self.epoch_train_seconds += seconds
        self.epoch_samples += samples
        self.epoch_loss_sum += loss * samples
        if helen is not None:
            self.helen_first_pass_s += helen.first_pass_s
            self.helen_extra_s += helen.extra_s
        self.train_samples += samples
        if self.running_loss is None:
            self.running_loss = loss
        else:
            self.running_loss = 0.98 * self.running_loss + 0.02 * loss
        self.global_step += 1
        self.batch_in_epoch += 1
        return self.running_loss

    def validated(self, auc: Optional[float], patience: int) -> bool:
        """Counts this epoch's validation AUC; whether it is the best so far (an undefined
        AUC, of a one-class validation split, is no improvement). ``patience`` epochs
        without one stop the run early (0: never)."""
        self.epoch_val_auc.append(auc)  # type: ignore[arg-type]
        if auc is not None and auc > self.best_val_auc:
            self.best_val_auc, self.best_epoch = auc, self.epoch
            self.epochs_without_improvement = 0
            return True
        self.epochs_without_improvement += 1
        if patience and self.epochs_without_improvement >= patience:
            self.stopped_early = True
        return False

    def next_epoch(self, rows_updated: Optional[int], rows_clipped: Optional[int]) -> None:
        """Ends the epoch in progress; the run's row counters so far are ``rows_*``."""
        self.epoch += 1
        self.batch_in_epoch = 0
        self.epoch_samples, self.epoch_loss_sum = 0, 0.0
        self.running_loss = None
        self.epoch_train_seconds, self.epoch_wall_seconds = 0.0, 0.0
        self.rows_updated_before_epoch = rows_updated or 0
        self.rows_clipped_before_epoch = rows_clipped or 0

    def eta(
        self, step_s: float, epochs: int, steps_per_epoch: int, max_steps: int, passes: int
    ) -> float:
        """Seconds left in the run: its steps at ``step_s`` each, and its evaluations
        (``passes`` per epoch: the test split's, and the validation split's) at the mean of
        those so far."""
        total_steps = total_steps_of(epochs, steps_per_epoch, max_steps)
        epochs_left = epochs - self.epoch
        if max_steps:
            epochs_left = min(
                epochs_left, -(-(total_steps - self.global_step) // max(steps_per_epoch, 1))
            )
        eval_s = self.eval_seconds / self.evaluations if self.evaluations else 0.0
        return run_eta(self.global_step, total_steps, step_s, passes * epochs_left, eval_s)

    def helen_cost(self) -> Dict[str, float]:
        """Per step: the first pass, Helen's extra time, and their ratio."""
        steps = max(self.global_step, 1)
        return {
            "first_pass_s_per_step": self.helen_first_pass_s / steps,
            "extra_s_per_step": self.helen_extra_s / steps,
            "extra_fraction": self.helen_extra_s / max(self.helen_first_pass_s, 1e-9),
        }


def run_eta(
    steps_done: int, steps_total: int, step_s: float, evals_left: int, eval_s: float
) -> float:
    """Seconds left in the whole run: the steps left at this process's mean step time,
    plus the evaluations left at the mean evaluation time so far.

    Example::

        >>> run_eta(steps_done=10, steps_total=40, step_s=0.5, evals_left=2, eval_s=3.0)
        21.0
    """
    return max(steps_total - steps_done, 0) * step_s + max(evals_left, 0) * eval_s


def total_steps_of(epochs: int, steps_per_epoch: int, max_steps: int) -> int:
    """The steps a run trains: its epochs', or ``max_steps`` if fewer (0: no limit)."""
    total = epochs * steps_per_epoch
    return min(total, max_steps) if max_steps else total


class RunCheckpoints:
    """The run's checkpoints in ``out/checkpoints`` (see the module docstring).

    Args:
        out: the run directory.
        store: its checkpoint store (``out/checkpoints``, keeping ``--keep-checkpoints``),
            the one the start made and the ``--out`` claim asked.
        runtime: what the checkpoints hold the tensors, counters and RNG states of.
        config: the run's options as its record keeps them (``TrainConfig.as_dict``).
        run_record: the run's settings with its recipe resolved and its data
            (:func:`~torchrec_cowclip.run.resume_guard.run_record`), compared on resume.
        fingerprint: the run's name in the checkpoints' manifests.
        row_clip_stats: whether the per-row clip counters are kept too.
    """

    def __init__(
        self,
        out: Path,
        store: CheckpointStore,
        runtime: Runtime,
        config: Mapping[str, Any],
        run_record: Dict[str, Any],
        fingerprint: str,
        row_clip_stats: bool,
    ) -> None:
        self.out, self.store = out, store
        self.runtime, self.config, self.run_record = runtime, config, run_record
        self.fingerprint, self.row_clip_stats = fingerprint, row_clip_stats
        #: The best validation epoch's checkpoint (its directory's name), once there is one.
        self.best: Optional[str] = None
        #: The step of the last "latest" checkpoint this process saved or resumed from.
        self.saved_step = -1
        self.resumed_from: Optional[Path] = None

    def clean(self, say: Callable[[str], None]) -> None:
        """Removes what a checkpoint write killed last time left (its directory and temp
        files); anything this project did not write is left alone, and named."""
        for stale in self.store.remove_unfinished():
            say(f"removed {stale}, left by an interrupted checkpoint write")
        foreign = self.store.foreign()
        if foreign:
            say(
                f"left {', '.join(str(f) for f in foreign)} alone: not checkpoints of "
                "this project (without a manifest; an older version's cannot be verified)"
            )

    def describe(self) -> str:
        """The newest "latest" checkpoint, as a message names it."""
        return self.store.describe("latest")

    def _trainer_state(self, progress: Progress) -> Dict[str, Any]:
        ebc = self.runtime.model.embedding_collection
        row_counters = None
        if self.row_clip_stats and isinstance(ebc, CowClipEmbeddingBagCollection):
            row_counters = ebc.clip_counters.row_state()
        return {
            "progress": copy.deepcopy(progress.__dict__),
            "config": dict(self.config),
            "run_record": self.run_record,
            "world_size": self.runtime.world_size,
            "rng": self.runtime.all_rng_states(),
            "table_counters": self.runtime.table_counters(),
            "row_clip_counters": row_counters,
            "best_checkpoint": self.best,
        }

    def save(self, progress: Progress) -> None:
        """Checkpoints the run as it is now ("latest"), on every rank."""
        p = progress
        self.store.save(
            "latest",
            f"e{p.epoch}-s{p.global_step}",
            self.runtime.tensors(),
            self._trainer_state(p),
            step=p.global_step,
            fingerprint=self.fingerprint,
            uses=[self.best] if self.best else [],
        )
        self.saved_step = p.global_step

    def save_unless_saved(self, progress: Progress) -> None:
        """:meth:`save`, unless this step's "latest" checkpoint is written already."""
        if self.saved_step != progress.global_step:
            self.save(progress)

    def stop_here(self, progress: Progress, by: Optional[str], steps_per_epoch: int) -> RunStopped:
        """Ends a run that a signal (``by``; None: on another rank) asked to stop: its
        checkpoint written (:meth:`save_unless_saved`), the :class:`RunStopped` to raise,
        naming it."""
        p = progress
        self.save_unless_saved(p)
        return RunStopped(
            f"stopped by {by or 'a signal on another rank'} after step "
            f"{p.global_step} (epoch {p.epoch + 1}, batch {p.batch_in_epoch} of "
            f"{steps_per_epoch}): {self.describe()}"
        )

    def save_best(self, progress: Progress) -> None:
        """The best validation epoch's weights, as their own checkpoint (not kept in
        memory): the run folder's ``weights/best`` (the reported ones under early stopping)."""
        saved = self.store.save(
            "best",
            f"e{progress.epoch}",
            self.runtime.model_tensors(),
            {"epoch": progress.epoch},
            step=progress.global_step,
            fingerprint=self.fingerprint,
        )
        self.best = saved.path.name

    def restore(self, resume: Any, say: Callable[[str], None]) -> Optional[Progress]:
        """Loads the newest intact "latest" checkpoint into the model, optimizers,
        counters and RNG, at this run's world size, and returns its progress. Every file
        is verified against the checkpoint's manifest first; a damaged checkpoint is
        reported and the previous one used.

        Returns:
            None when there is no checkpoint and ``resume`` is ``"auto"`` (start anew).

        Raises:
            FileNotFoundError: ``--resume`` and no checkpoint.
            DamagedCheckpointError: no checkpoint matches its manifest.
            ResumeRefused: the checkpoint's run differs from this command's.
        """
        checkpoint = self.store.intact("latest", say=say)
        if checkpoint is None:
            if resume == "auto":
                return None
            older = [f for f in self.store.foreign() if (f / TRAINER_STATE).exists()]
            raise FileNotFoundError(
                f"--resume: no checkpoint in {self.store.root}"
                + (
                    f" ({older[0]} has no manifest: written by an older version, it cannot "
                    "be verified; start anew with --overwrite)"
                    if older
                    else ""
                )
            )
        saved = self.store.trainer_state(checkpoint)
        assert saved is not None
        # before any state is loaded
        check_resume(saved, self.run_record, self.out, RECORDED_SETTINGS)
        check_sources(saved, self.out)
        runtime = self.runtime
        runtime.prepare_optimizer_state()  # DCP loads in place into existing tensors
        tensors = runtime.tensors()
        state = self.store.load(checkpoint, tensors)
        runtime.load_tensors(tensors)
        progress = Progress(**state["progress"])
        if state.get("table_counters") is not None:
            runtime.load_table_counters(state["table_counters"])
        row_counters = state.get("row_clip_counters")
        if row_counters is not None and self.row_clip_stats:
            runtime.model.embedding_collection.clip_counters.load_row_state(row_counters)
        rng = state["rng"]
        set_rng_state(rng[runtime.rank] if runtime.rank < len(rng) else rng[0])
        self.best = state.get("best_checkpoint")
        self.saved_step = progress.global_step
        self.resumed_from = checkpoint.path
        return progress

    def load_latest_model(self) -> None:
        """Puts the newest "latest" checkpoint's model weights (the last step's: a run
        checkpoints before it finishes) back into the model."""
        tensors = self.runtime.model_tensors()
        self.store.load("latest", tensors)
        self.runtime.train_module.load_state_dict(tensors["model"])

    def load_best(self) -> None:
        """Puts the best epoch's weights into the model (verified first).

        Raises:
            DamagedCheckpointError: its checkpoint is missing or damaged.
        """
        tensors = self.runtime.model_tensors()
        best: Optional[Checkpoint] = next(
            (c for c in self.store.complete("best") if c.path.name == self.best), None
        )
        if best is None:
            raise DamagedCheckpointError(
                f"the best epoch's checkpoint {self.store.root / str(self.best)} "
                "is missing: the final model cannot be restored"
            )
        problems = self.store.verify(best)
        if problems:
            raise DamagedCheckpointError(f"the best epoch's checkpoint is damaged: {problems[0]}")
        self.store.load(best, tensors)
        self.runtime.train_module.load_state_dict(tensors["model"])

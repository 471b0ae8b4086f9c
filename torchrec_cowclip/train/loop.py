"""The training loop (:class:`TrainingLoop`): epochs of TorchRec's train pipeline over the
run's pieces, each epoch evaluated on the test split and the validation split, early
stopping, a checkpoint at every epoch's end (and every ``--checkpoint-every`` steps), the
stop a signal asks for, and an exact ``--resume``. It tells what it does through one
collaborator, its report (:class:`~torchrec_cowclip.train.report.RunReport`), and hands
the trained run to its finish (:class:`~torchrec_cowclip.train.finish.RunFinish`).

The loop holds no settings but its own (:class:`~torchrec_cowclip.train.config.RunSettings`):
the start (:func:`~torchrec_cowclip.train.start.start_run`) resolved the rest into the
pieces it is given.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, Optional

import numpy as np

from torchrec_cowclip.run.out_dir import RunDirLock
from torchrec_cowclip.run.stop import RunStopped, StopRequest
from torchrec_cowclip.train.config import RunSettings
from torchrec_cowclip.train.console import peak_rss_mb
from torchrec_cowclip.train.data import TrainingData
from torchrec_cowclip.train.finish import RunFinish
from torchrec_cowclip.train.helen_pipeline import HelenPipeline
from torchrec_cowclip.train.metrics import TrainResult, clip_counts
from torchrec_cowclip.train.report import RunReport
from torchrec_cowclip.train.run_state import Progress, RunCheckpoints
from torchrec_cowclip.train.runtime import Runtime
from torchrec_cowclip.train.warm_start import WarmStart


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the last good checkpoint is kept."""


class TrainingLoop:
    """One training run's loop over its pieces (see the module docstring):
    ``start_run(settings).run()``.

    The loop is the same for one process and for several: the
    :class:`~torchrec_cowclip.train.runtime.Runtime` owns where the model lives and how
    batches are split.

    Args:
        plan: the run's own settings (epochs, ``--max-steps``, the cadence of its logs and
            checkpoints, early stopping, ``--resume``).
        runtime: the model, its optimizers and its batches, in this process.
        data: the dataset and its splits.
        checkpoints: the run's checkpoints.
        report: what the loop tells, and where.
        finish: what the finished run leaves.
        run_dir: the claim on ``--out``, released when the loop ends.
        warm: ``--init-from``'s run, loaded into a run that does not resume.
    """

    def __init__(
        self,
        plan: RunSettings,
        runtime: Runtime,
        data: TrainingData,
        checkpoints: RunCheckpoints,
        report: RunReport,
        finish: RunFinish,
        run_dir: RunDirLock,
        warm: Optional[WarmStart] = None,
    ) -> None:
        self.plan, self.runtime, self.data = plan, runtime, data
        self.checkpoints, self.report, self.finish = checkpoints, report, finish
        self.run_dir, self.warm = run_dir, warm
        self.progress = Progress()
        self.stop = StopRequest(say=report.say)
        # This process's mean training-step time in its last epoch (the run's ETA).
        self._step_s: Optional[float] = None

    # --- checkpoints -----------------------------------------------------------------

    def save(self) -> None:
        """Checkpoints the run as it is now ("latest"), on every rank."""
        self.checkpoints.save(self.progress)

    def restore(self) -> bool:
        """Loads the newest intact "latest" checkpoint of ``--out`` (see
        :meth:`RunCheckpoints.restore <torchrec_cowclip.train.run_state.RunCheckpoints.restore>`);
        False when there is none and ``--resume auto`` starts anew."""
        progress = self.checkpoints.restore(self.plan.resume, self.report.say)
        if progress is None:
            return False
        self.progress = progress
        return True

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Trains to the end (or ``--max-steps``), checkpointing at every epoch's end,
        writes the run folder ``out/model`` and returns the metrics written to
        ``out/metrics.json`` (with the run directory and the model).

        Raises:
            RunStopped: SIGTERM/SIGINT arrived; the run finished its step, wrote a
                checkpoint and released ``--out``.
        """
        try:
            with self.stop.installed():
                return self._run()
        finally:
            self.run_dir.release()

    def _run(self) -> TrainResult:
        plan, report = self.plan, self.report
        resumed = self.restore() if plan.resume else False
        if resumed:
            assert self.checkpoints.resumed_from is not None  # restore() has just loaded it
            report.open((self.progress, self.checkpoints.resumed_from))
        else:
            report.open()
            if self.warm is not None:
                report.info(self.warm.load_into(self.runtime))
        try:
            while self.progress.epoch < plan.epochs and not self.progress.stopped_early:
                if not self._train_epoch():  # --max-steps reached mid-epoch
                    self.checkpoints.save_unless_saved(self.progress)
                    break
                self._end_of_epoch()
                self.checkpoints.save(self.progress)
                if self.runtime.agree_to_stop(self.stop.requested is not None):
                    raise self._stopped(self.stop.requested)
        finally:
            report.close()
        return self.finish.write(self.progress, self._evaluate)

    def _stopped(self, by: Optional[str]) -> RunStopped:
        return self.checkpoints.stop_here(self.progress, by, self.runtime.steps_per_epoch)

    def _train_epoch(self) -> bool:
        plan, p, runtime = self.plan, self.progress, self.runtime
        pipeline = runtime.pipeline()
        batches = runtime.train_batches(p.epoch, p.batch_in_epoch)
        runtime.train_module.train()
        self.report.epoch_started(p)
        wall_start = time.perf_counter()
        # This process's mean step time, for the run's ETA (a resumed run has no other).
        steps_here, step_seconds_here = 0, 0.0
        # Helen's pipelines report each step's cost (the runtime chose one from the module).
        helen = pipeline if isinstance(pipeline, HelenPipeline) else None
        try:
            while True:
                if plan.max_steps and p.global_step >= plan.max_steps:
                    return False
                t0 = time.perf_counter()
                try:
                    loss, _logits, labels = runtime.step(pipeline, batches, p.global_step + 1)
                except StopIteration:
                    break
                # The global batch's mean loss and size, and whether any rank was asked
                # to stop (one all-reduce when sharded).
                loss_value, n, stop = runtime.step_summary(
                    float(loss), int(labels.numel()), self.stop.requested is not None
                )
                if not math.isfinite(loss_value):
                    raise NonFiniteLossError(
                        f"loss became {loss_value} at step {p.global_step + 1} (epoch "
                        f"{p.epoch + 1}, batch {p.batch_in_epoch + 1}); stopping: "
                        f"{self.checkpoints.describe()}. "
                        f"Lower --lr / --lr-embed or check the data."
                    )
                step_s = time.perf_counter() - t0
                steps_here, step_seconds_here = steps_here + 1, step_seconds_here + step_s
                running = p.step_done(
                    step_s, n, loss_value, None if helen is None else helen.last_helen_cost
                )
                self.report.stepped(
                    p,
                    loss_value,
                    running,
                    n,
                    step_seconds_here / steps_here,
                    runtime.dense_lr,
                    helen is not None,
                )
                if plan.checkpoint_every and p.global_step % plan.checkpoint_every == 0:
                    self.checkpoints.save(p)
                if stop:
                    raise self._stopped(self.stop.requested)
        finally:
            self.report.epoch_ended()
            runtime.end_pipeline(pipeline)
            p.epoch_wall_seconds += time.perf_counter() - wall_start
            if steps_here:
                self._step_s = step_seconds_here / steps_here
        return True

    def _end_of_epoch(self) -> None:
        plan, p, data = self.plan, self.progress, self.data
        wall_start = time.perf_counter()
        # The test split, then the validation split where there is one, in one pass.
        splits = {"test": data.test_idx, "validation": data.val_idx}
        results = {
            name: self._evaluate(indices, name)
            for name, indices in splits.items()
            if name == "test" or len(indices)
        }
        # The run's row counters so far (training steps move them, evaluations do not).
        counts = clip_counts(self.runtime.embedding_module())
        test = results["test"]
        p.epoch_auc.append(test["auc"])
        p.epoch_logloss.append(test["logloss"])
        p.epoch_calibration.append(test["calibration"])
        row: Dict[str, Any] = {
            "epoch": p.epoch + 1,
            "step": p.global_step,
            "train_samples": p.train_samples,
            "test_auc": test["auc"],
            "test_logloss": test["logloss"],
            "test_calibration": test["calibration"],
        }
        if "validation" in results:
            val = results["validation"]
            p.epoch_val_calibration.append(val["calibration"])
            row.update(
                val_auc=val["auc"], val_logloss=val["logloss"], val_calibration=val["calibration"]
            )
            if p.validated(val["auc"], plan.early_stop_patience):
                self.checkpoints.save_best(p)
        updated, clipped = counts["rows_updated"], counts["rows_clipped"]
        p.epoch_wall_seconds += time.perf_counter() - wall_start
        row.update(
            train_loss=p.epoch_loss_sum / max(p.epoch_samples, 1),
            # This epoch's row updates; the run's so far in the *_total columns.
            rows_updated=None if updated is None else updated - p.rows_updated_before_epoch,
            rows_clipped=None if clipped is None else clipped - p.rows_clipped_before_epoch,
            rows_updated_total=updated,
            rows_clipped_total=clipped,
            epoch_s=p.epoch_wall_seconds,
            train_samples_per_s=p.epoch_samples / max(p.epoch_train_seconds, 1e-9),
            peak_rss_mb=peak_rss_mb(),
        )
        p.next_epoch(updated, clipped)
        more = p.epoch < plan.epochs and not p.stopped_early
        step_s = (
            self._step_s if self._step_s is not None else p.train_seconds / max(p.global_step, 1)
        )
        self.report.epoch(row, self.report.eta(p, step_s) if more else None)
        if p.stopped_early and p.epoch < plan.epochs:
            self.report.info(
                f"early stopping after epoch {p.epoch} of {plan.epochs}: no better validation "
                f"AUC for {p.epochs_without_improvement} epoch(s) (--early-stop-patience "
                f"{plan.early_stop_patience}); the best was epoch {p.best_epoch + 1} "
                f"({p.best_val_auc:.5f}), whose weights the run keeps and reports"
            )

    def _evaluate(self, indices: np.ndarray, name: Optional[str] = None) -> Dict[str, float]:
        """Scores the rows ``indices`` (with a progress bar when ``name``d: the run's
        report is open) and counts the pass for the run's ETA."""
        bar = (
            None
            if name is None
            else self.report.evaluation_bar(
                self.runtime.eval_batch_count(indices), name, len(indices)
            )
        )
        started = time.perf_counter()
        try:
            result = self.runtime.evaluate(indices, None if bar is None else lambda: bar.update(1))
        finally:
            if bar is not None:
                bar.close()
        self.progress.eval_seconds += time.perf_counter() - started
        self.progress.evaluations += 1
        return result

"""The training loop: the run's options resolved once, its data, model and optimizers
built, TorchRec's train pipeline stepped, each epoch evaluated, early stopping, atomic
checkpoints with exact resume (:mod:`.run_state`), run logs, the metrics
(:mod:`.metrics`) and the run folder.

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.train import TrainConfig, train
    >>> tmp = tempfile.mkdtemp()
    >>> metrics = train(TrainConfig(model="deepfm", data="synthetic:3000", synthetic_scale=0.01,
    ...                             synthetic_max_cardinality=500, hidden=(8,), batch_size=512,
    ...                             epochs=1, progress=False, out=f"{tmp}/run",
    ...                             cache_dir=f"{tmp}/cache"))
    >>> metrics["steps"], sorted(metrics["epoch_auc"]) == [metrics["auc"]]
    (5, True)
    >>> metrics.run_dir.name, sorted(p.name for p in (metrics.run_dir / "model").iterdir())
    ('run', ['data.json', 'encoders', 'manifest.json', 'model.json', 'weights'])
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from torchrec_cowclip import notices
from torchrec_cowclip.data.pipeline.cache import sources_seen
from torchrec_cowclip.run.checkpoints import CHECKPOINTS_DIR, CheckpointStore
from torchrec_cowclip.run.folder_writer import (
    RunFolderWriter,
    describe_data,
    describe_model,
    encoder_writer,
)
from torchrec_cowclip.run.log import RunLog, duration, epoch_line, write_text_atomically
from torchrec_cowclip.run.out_dir import claim_run_dir, new_run_dir
from torchrec_cowclip.run.resume_guard import resumed_message, run_fingerprint, run_record
from torchrec_cowclip.run.stop import StopRequest
from torchrec_cowclip.train.config import RECORDED_SETTINGS, TrainConfig, TrainSettings
from torchrec_cowclip.train.console import (
    calibration_line,
    peak_rss_mb,
    start_lines,
    weights_line,
)
from torchrec_cowclip.train.data import open_training_data
from torchrec_cowclip.train.helen_pipeline import HelenPipeline
from torchrec_cowclip.train.metrics import (
    TrainResult,
    clip_by_frequency,
    clip_counts,
    run_metrics,
    write_curves,
)
from torchrec_cowclip.train.run_state import Progress, RunCheckpoints, total_steps_of
from torchrec_cowclip.train.runtime import Runtime, make_runtime
from torchrec_cowclip.train.warm_start import WarmStart


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the last good checkpoint is kept."""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """One training run of a :class:`TrainConfig`, resolved once into what each part
    consumes: ``Trainer(config.resolve()).run()``.

    The loop is the same for one process and for several: a
    :class:`~torchrec_cowclip.train.runtime.Runtime` owns where the model lives and
    how batches are split (:func:`~torchrec_cowclip.train.runtime.make_runtime`).
    """

    def __init__(self, settings: TrainSettings) -> None:
        notices.install()
        # Rank 0 (the launcher names it before the process group exists) holds the
        # output directory's lock for the run's life.
        self.is_main = settings.process.is_main
        # --init-from: RUN verified and the command checked against it before --out is
        # created or claimed.
        self.warm = WarmStart.open(settings) if settings.run.init_from else None
        created = None
        if settings.run.out is None:  # a new directory, never one that holds a run
            created = new_run_dir(process=settings.process)
            settings = settings.writing_to(str(created))
        self.settings = settings
        run = settings.run
        self.out = Path(str(run.out))
        # One checkpoint store: the claim asks and cleans it, the run's checkpoints keep it.
        self.store = CheckpointStore(self.out / CHECKPOINTS_DIR, keep=run.keep_checkpoints)
        self.run_dir = claim_run_dir(
            self.out, run.resume, run.overwrite, main=self.is_main, checkpoints=self.store
        )
        try:
            self._build()
        except BaseException:
            self.run_dir.release()
            if created is not None and self.is_main and not any(created.iterdir()):
                created.rmdir()  # the empty directory this failed start made
            raise

    def _build(self) -> None:
        settings, run = self.settings, self.settings.run
        if run.threads:
            torch.set_num_threads(run.threads)
        _seed_everything(run.seed)
        # validate() has checked that the test files are of --data's kind.
        with sources_seen() as sources:
            self.data = open_training_data(
                settings.data,
                run.batch_size,
                settings.model.embedding_dim,
                settings.optimizers.embedding.optimizer,
                warm=self.warm,
                process=settings.process,
            )
        self.dataset = self.data.dataset
        self.train_idx, self.val_idx, self.test_idx = (
            self.data.train_idx,
            self.data.val_idx,
            self.data.test_idx,
        )
        self.hp = settings.hp
        self.cowclip = settings.optimizers.embedding.cowclip
        record = run_record(settings.record_settings(), settings.data.record(self.dataset), sources)
        fingerprint = run_fingerprint(record, RECORDED_SETTINGS)
        self.runtime: Runtime = make_runtime(settings, self.dataset, self.train_idx)
        self.model = self.runtime.model
        self.optimizer = self.runtime.optimizer
        self.steps_per_epoch = self.runtime.steps_per_epoch
        if run.row_clip_stats:
            self.model.embedding_collection.track_row_clips()
        self.checkpoints = RunCheckpoints(
            self.out,
            self.store,
            self.runtime,
            settings.record,
            record,
            fingerprint,
            run.row_clip_stats,
        )
        self.progress = Progress()
        self.total_steps = total_steps_of(run.epochs, self.steps_per_epoch, run.max_steps)
        # What the run's ETA counts (Progress.eta): its epochs, their steps, --max-steps and
        # the evaluations per epoch (the test split's, and the validation split's).
        self.eta_plan = (
            run.epochs,
            self.steps_per_epoch,
            run.max_steps,
            2 if len(self.val_idx) else 1,
        )
        if self.runtime.is_main:
            self.checkpoints.clean(_say)
        self.stop = StopRequest(say=_say if self.runtime.is_main else lambda _: None)
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
        say = _say if self.runtime.is_main else (lambda _: None)
        progress = self.checkpoints.restore(self.settings.run.resume, say)
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
        run = self.settings.run
        resumed = self.restore() if run.resume else False
        main, p = self.runtime.is_main, self.progress
        lines = start_lines(self.settings, self.data, self.runtime, self.out, self.total_steps)
        if resumed:
            assert self.checkpoints.resumed_from is not None  # restore() has just loaded it
            lines.append(
                resumed_message(
                    p.global_step,
                    p.epoch,
                    p.batch_in_epoch,
                    self.steps_per_epoch,
                    self.checkpoints.resumed_from,
                )
            )
        log = RunLog(self.out, enabled_progress=run.progress and main, enabled=main)
        for line in lines:
            log.info(line)
        if resumed:
            log.rewind(p.global_step, p.epoch)
        elif self.warm is not None:
            log.info(self.warm.load_into(self.runtime, run.init_optimizer_state))
        try:
            while self.progress.epoch < run.epochs and not self.progress.stopped_early:
                finished_epoch = self._train_epoch(log)
                if not finished_epoch:  # --max-steps reached mid-epoch
                    self.checkpoints.save_unless_saved(self.progress)
                    break
                self._end_of_epoch(log)
                self.checkpoints.save(self.progress)
                if self.runtime.agree_to_stop(self.stop.requested is not None):
                    raise self.checkpoints.stop_here(p, self.stop.requested, self.steps_per_epoch)
        finally:
            log.close()
        return self._finish()

    def _train_epoch(self, log: RunLog) -> bool:
        cfg, p = self.settings.run, self.progress
        pipeline = self.runtime.pipeline()
        batches = self.runtime.train_batches(p.epoch, p.batch_in_epoch)
        self.runtime.train_module.train()
        bar = log.progress_bar(
            total=self.steps_per_epoch,
            initial=p.batch_in_epoch,
            desc=f"epoch {p.epoch + 1}/{cfg.epochs}",
        )
        t_last, samples_since = time.perf_counter(), 0
        wall_start = time.perf_counter()
        # This process's mean step time, for the run's ETA (a resumed run has no other).
        steps_here, step_seconds_here = 0, 0.0
        # Helen's pipelines report each step's cost (the runtime chose one from the module).
        helen = pipeline if isinstance(pipeline, HelenPipeline) else None
        try:
            while True:
                if cfg.max_steps and p.global_step >= cfg.max_steps:
                    return False
                t0 = time.perf_counter()
                try:
                    loss, _logits, labels = self.runtime.step(pipeline, batches, p.global_step + 1)
                except StopIteration:
                    break
                # The global batch's mean loss and size, and whether any rank was asked
                # to stop (one all-reduce when sharded).
                loss_value, n, stop = self.runtime.step_summary(
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
                samples_since += n
                if p.global_step % cfg.log_every == 0:
                    now = time.perf_counter()
                    rate = samples_since / max(now - t_last, 1e-9)
                    t_last, samples_since = now, 0
                    dense_lr = self.runtime.dense_lr()
                    log.step(
                        p.global_step,
                        {
                            "loss": loss_value,
                            "running_loss": running,
                            "samples_per_s": rate,
                            "dense_lr": dense_lr,
                        },
                    )
                bar.update(1)
                postfix = {
                    "loss": f"{running:.4f}",
                    "samples_s": f"{p.train_samples / max(p.train_seconds, 1e-9):,.0f}",
                    "run_eta": duration(p.eta(step_seconds_here / steps_here, *self.eta_plan)),
                }
                if helen is not None:
                    postfix["helen_extra"] = f"+{p.helen_cost()['extra_fraction']:.0%}"
                bar.set_postfix(postfix)
                if cfg.checkpoint_every and p.global_step % cfg.checkpoint_every == 0:
                    self.checkpoints.save(self.progress)
                if stop:
                    raise self.checkpoints.stop_here(p, self.stop.requested, self.steps_per_epoch)
        finally:
            bar.close()
            self.runtime.end_pipeline(pipeline)
            p.epoch_wall_seconds += time.perf_counter() - wall_start
            if steps_here:
                self._step_s = step_seconds_here / steps_here
        return True

    def _end_of_epoch(self, log: RunLog) -> None:
        cfg, p = self.settings.run, self.progress
        wall_start = time.perf_counter()
        # The test split, then the validation split where there is one, in one pass.
        splits = {"test": self.test_idx, "validation": self.val_idx}
        results = {
            name: self._evaluate(indices, log, name)
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
            if p.validated(val["auc"], cfg.early_stop_patience):
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
        more = p.epoch < cfg.epochs and not p.stopped_early
        step_s = (
            self._step_s if self._step_s is not None else p.train_seconds / max(p.global_step, 1)
        )
        eta_s = p.eta(step_s, *self.eta_plan) if more else None
        log.epoch(row)
        log.info(epoch_line({**row, "epochs": cfg.epochs, "eta_s": eta_s}))
        if p.stopped_early and p.epoch < cfg.epochs:
            log.info(
                f"early stopping after epoch {p.epoch} of {cfg.epochs}: no better validation "
                f"AUC for {p.epochs_without_improvement} epoch(s) (--early-stop-patience "
                f"{cfg.early_stop_patience}); the best was epoch {p.best_epoch + 1} "
                f"({p.best_val_auc:.5f}), whose weights the run keeps and reports"
            )

    def _evaluate(
        self, indices: np.ndarray, log: Optional[RunLog] = None, name: str = "test"
    ) -> Dict[str, float]:
        bar = (
            log.progress_bar(
                total=self.runtime.eval_batch_count(indices),
                initial=0,
                desc=f"evaluating {name} ({len(indices):,} rows)",
                unit="batch",
            )
            if log is not None
            else None
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

    def _finish(self) -> TrainResult:
        run, p = self.settings.run, self.progress
        # The run folder (run/model_folder.py): the last step's weights, then the best epoch's.
        folder = RunFolderWriter(self.out, main=self.runtime.is_main)
        folder.save_weights("final", self.runtime.model_tensors()["model"], prefix="model.")
        reported = "final"
        if self.checkpoints.best is not None:
            # A validation split: the best epoch's weights too. Under early stopping they
            # are the run's model; otherwise the last step's are, and stay in the model.
            self.checkpoints.load_best()
            folder.save_weights("best", self.runtime.model_tensors()["model"], prefix="model.")
            if run.early_stop_patience:
                reported = "best"
            else:
                self.checkpoints.load_latest_model()
        final_epoch = (
            p.best_epoch
            if (run.early_stop_patience and p.best_epoch >= 0)
            else len(p.epoch_auc) - 1
        )
        # The best epoch is the validation split's choice: without one there is none.
        best_epoch = p.best_epoch + 1 if len(self.val_idx) and p.best_epoch >= 0 else None
        if p.epoch_auc:
            test = {"auc": p.epoch_auc[final_epoch], "logloss": p.epoch_logloss[final_epoch]}
            if len(p.epoch_calibration) == len(p.epoch_auc):  # not a run resumed from older
                test["calibration"] = p.epoch_calibration[final_epoch]
        else:  # --max-steps ended the run before the first epoch finished
            test = self._evaluate(self.test_idx)
        metrics = run_metrics(
            self.settings, p, self.data, self.runtime, test, final_epoch, best_epoch
        )
        metrics["weights"] = {
            "default": reported,
            "kept": list(folder.weights),
            "best_epoch": best_epoch if "best" in folder.weights else None,
        }
        if run.row_clip_stats:
            metrics["clip_by_frequency"] = clip_by_frequency(self.model, self.data)
        if self.runtime.is_main:
            write_text_atomically(
                self.out / "metrics.json", json.dumps(metrics, indent=2, default=str)
            )
            write_curves(self.out, self.settings, best_epoch, p.stopped_early, _say)
        folder.complete(
            describe_model(
                self.settings.model,
                self.settings.record,
                self.dataset,
                metrics,
                folder.weights,
                reported,
            ),
            lambda encoders: describe_data(
                self.settings.data, self.dataset, encoder_writer(self.dataset)(encoders)
            ),
        )
        if self.runtime.is_main:
            _say(weights_line(self.out, reported, folder.weights, best_epoch, len(p.epoch_auc)))
            said = calibration_line(test.get("calibration"))
            if said is not None:
                _say(said)
        self.model.eval()
        return TrainResult(metrics, self.out if self.runtime.is_main else None, self.model)


def train(config: TrainConfig) -> TrainResult:
    """Runs training as configured; returns the metrics written to ``out/metrics.json``
    (a dict) carrying ``run_dir`` (whose ``model/`` ``torchrec_cowclip.load_model``
    scores with) and ``model`` (the trained module)."""
    return Trainer(config.resolve()).run()

"""The training loop: data, model, scaled optimizers, TorchRec train pipeline, per-epoch
evaluation, early stopping, atomic checkpoints with exact resume, and run logs.

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

import copy
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.embedding.row_clip_stats import clip_rates_by_frequency
from torchrec_cowclip.embedding.table_batch import TableClipStats
from torchrec_cowclip.models.embeddings import embedding_table_name
from torchrec_cowclip.optim.options import CowClip
from torchrec_cowclip.plots import CURVES_PNG, write_run_curves
from torchrec_cowclip.train import notices
from torchrec_cowclip.train.checkpoint import (
    CHECKPOINTS_DIR,
    TRAINER_STATE,
    CheckpointStore,
    DamagedCheckpointError,
)
from torchrec_cowclip.train.config import ConfigError, TrainConfig
from torchrec_cowclip.train.helen_pipeline import HelenPipeline
from torchrec_cowclip.train.report import (
    duration,
    epoch_line,
    peak_rss_mb,
    processes_line,
    run_eta,
)
from torchrec_cowclip.train.result import TrainResult
from torchrec_cowclip.train.resume_guard import (
    check_resume,
    resumed_message,
    run_fingerprint,
    run_record,
)
from torchrec_cowclip.train.run_dir import claim_run_dir, new_run_dir
from torchrec_cowclip.train.run_folder import (
    RunFolderWriter,
    describe_data,
    describe_model,
    encoder_writer,
)
from torchrec_cowclip.train.run_log import RunLog, write_text_atomically
from torchrec_cowclip.train.runtime import Runtime, make_runtime, set_rng_state
from torchrec_cowclip.train.scaling import ScaledHyperparameters
from torchrec_cowclip.train.stop import RunStopped, StopRequest
from torchrec_cowclip.train.table_memory import check_tables_fit
from torchrec_cowclip.train.warm_start import WarmStart


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the last good checkpoint is kept."""


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
    # Seconds of every evaluation pass so far, and how many (for the run's ETA).
    eval_seconds: float = 0.0
    evaluations: int = 0

    def helen_cost(self) -> Dict[str, float]:
        """Per step: the first pass, Helen's extra time, and their ratio."""
        steps = max(self.global_step, 1)
        return {
            "first_pass_s_per_step": self.helen_first_pass_s / steps,
            "extra_s_per_step": self.helen_extra_s / steps,
            "extra_fraction": self.helen_extra_s / max(self.helen_first_pass_s, 1e-9),
        }


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def clip_counts(embedding_collection: torch.nn.Module) -> Dict[str, Any]:
    """Totals and per-table counts of row updates, clipped rows and skipped rows
    (over all ranks when sharded: then a collective)."""
    if not hasattr(embedding_collection, "clip_stats"):
        return {"rows_updated": None, "rows_clipped": None, "rows_nonfinite": None, "per_table": {}}
    # Looked up by name: nn.Module types the attributes it does not declare as tensors.
    method = (
        "global_clip_stats" if hasattr(embedding_collection, "global_clip_stats") else "clip_stats"
    )
    stats: Dict[str, TableClipStats] = getattr(embedding_collection, method)()
    return {
        "rows_updated": sum(s.total_rows_updated for s in stats.values()),
        "rows_clipped": sum(s.total_rows_clipped for s in stats.values()),
        "rows_nonfinite": sum(s.total_rows_nonfinite for s in stats.values()),
        "per_table": {
            name: {"rows_updated": s.total_rows_updated, "rows_clipped": s.total_rows_clipped}
            for name, s in stats.items()
        },
    }


def positive_rates(labels: Any, splits: Dict[str, np.ndarray]) -> Dict[str, Optional[float]]:
    """The share of positive labels in each split (None for an empty one).

    Example::

        >>> positive_rates(np.array([1, 0, 0, 1.0]), {"train": np.array([0, 1, 2]),
        ...                                            "test": np.array([], dtype=np.int64)})
        {'train': 0.3333333333333333, 'test': None}
    """
    rates: Dict[str, Optional[float]] = {}
    for name, rows in splits.items():
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        rates[name] = (
            float(np.asarray(labels[rows], dtype=np.float64).mean()) if len(rows) else None
        )
    return rates


def check_training_labels(config: TrainConfig, rate: Optional[float], rows: int) -> None:
    """Refuses a training split whose labels are all 0 or all 1: the model would learn a
    constant and every AUC would be undefined."""
    if rate is not None and rate in (0.0, 1.0):
        raise ConfigError(
            f"every one of the {rows:,} training labels of {config.data} is {int(rate)} (the "
            f"--label column has one class): a CTR model needs clicks and non-clicks"
        )


def check_split_sizes(
    config: TrainConfig, n_train: int, n_val: int, n_test: int, world_size: int
) -> None:
    """Refuses, before any model is built, splits that would train no step or evaluate
    nothing: a ``--batch-size`` larger than the training split (the last incomplete
    batch of an epoch is dropped on any number of processes, so no full batch means no
    step), an empty test or validation split, or one with fewer rows than processes."""
    if n_train == 0:
        raise ConfigError(f"no training rows in {config.data} after the split")
    if n_train < config.batch_size:
        raise ConfigError(
            f"--batch-size {config.batch_size} is larger than the {n_train:,} training rows "
            f"of {config.data}: no full batch, so no step would train; lower --batch-size"
        )
    splits = [("test", n_test, "--test-fraction / --test-data")]
    if config.val_fraction > 0:
        splits.append(("validation", n_val, "--val-fraction"))
    for name, rows, flag in splits:
        if rows == 0:
            raise ConfigError(f"the {name} split of {config.data} is empty: raise {flag}")
        if rows < world_size:
            raise ConfigError(
                f"the {name} split of {config.data} has {rows} rows, fewer than the "
                f"{world_size} processes that evaluate it: raise {flag}"
            )


class Trainer:
    """One training run as configured by :class:`TrainConfig`.

    The loop is the same for one process and for several: a
    :class:`~torchrec_cowclip.train.runtime.Runtime` owns where the model lives and
    how batches are split (:func:`~torchrec_cowclip.train.runtime.make_runtime`).
    """

    def __init__(self, config: TrainConfig) -> None:
        notices.install()
        config.validate()
        # Rank 0 (the environment names it before the process group exists) holds the
        # output directory's lock for the run's life.
        self.is_main = int(os.environ.get("RANK", "0")) == 0
        # --init-from: RUN verified and the command checked against it before --out is
        # created or claimed.
        self.warm = WarmStart.open(config) if config.init_from else None
        created = None
        if config.out is None:  # a new directory, never one that holds a run
            created = new_run_dir()
            config = replace(config, out=str(created))
        self.config = config
        self.out = Path(str(config.out))
        self.run_dir = claim_run_dir(self.out, config.resume, config.overwrite, main=self.is_main)
        try:
            self._build()
        except BaseException:
            self.run_dir.release()
            if created is not None and self.is_main and not any(created.iterdir()):
                created.rmdir()  # the empty directory this failed start made
            raise

    def _build(self) -> None:
        config = self.config
        if config.threads:
            torch.set_num_threads(config.threads)
        _seed_everything(config.seed)

        data_options = config.data_options()
        # validate() has checked that the test files are of --data's kind.
        self.dataset = config.open_dataset(None if self.warm is None else self.warm.encoders)
        if self.warm is not None:
            self.warm.check_dataset(self.dataset)
        self.train_idx, self.val_idx, self.test_idx = self.dataset.split(
            config.test_fraction, config.val_fraction, config.seed
        )
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.positive_rates = positive_rates(
            self.dataset.labels,
            {"train": self.train_idx, "validation": self.val_idx, "test": self.test_idx},
        )
        check_training_labels(config, self.positive_rates["train"], len(self.train_idx))
        check_split_sizes(
            config, len(self.train_idx), len(self.val_idx), len(self.test_idx), world_size
        )
        started = time.perf_counter()
        plan = (
            self.dataset.fit_dense_plan(self.train_idx)  # the training split's statistics
            if self.warm is None
            else self.warm.keep_dense_plan(self.dataset)  # RUN's: its model's inputs
        )
        self._plan_seconds = time.perf_counter() - started
        schema = self.dataset.schema
        check_tables_fit(
            schema.sparse_names,
            schema.cardinalities,
            config.embedding_dim,
            config.embedding_optimizer,
            fix="--hash-size"
            if "hash_size" in {f.name for f in fields(config.source_kind().options)}
            else "--synthetic-max-cardinality",
        )

        self.hp: ScaledHyperparameters = config.hyperparameters()
        self.run_record = run_record(config, self.hp, self.dataset, data_options)
        self.fingerprint = run_fingerprint(self.run_record)
        clipped = config.cowclip and self.hp.cowclip
        self.cowclip = CowClip(r=self.hp.clip_r, zeta=self.hp.clip_zeta) if clipped else None
        self.runtime: Runtime = make_runtime(
            config, self.dataset, self.train_idx, self.hp, self.cowclip
        )
        self.device = self.runtime.device
        self.model = self.runtime.model
        self.optimizer = self.runtime.optimizer
        self.steps_per_epoch = self.runtime.steps_per_epoch
        self.dense_plan = plan
        if config.row_clip_stats:
            self.model.embedding_collection.track_row_clips()
        self.checkpoints = CheckpointStore(self.out / CHECKPOINTS_DIR, keep=config.keep_checkpoints)
        if self.runtime.is_main:
            # A checkpoint write killed last time: its directory and temp files go;
            # anything this project did not write is left alone, and named.
            for stale in self.checkpoints.remove_unfinished():
                _say(f"removed {stale}, left by an interrupted checkpoint write")
            foreign = self.checkpoints.foreign()
            if foreign:
                _say(
                    f"left {', '.join(str(f) for f in foreign)} alone: not checkpoints of "
                    "this project (without a manifest; an older version's cannot be verified)"
                )
        self.progress = Progress()
        self.stop = StopRequest(say=_say if self.runtime.is_main else lambda _: None)
        self._saved_step = -1
        # This process's mean training-step time in its last epoch (the run's ETA).
        self._step_s: Optional[float] = None
        self._best_checkpoint: Optional[str] = None
        self._resumed_from: Optional[Path] = None

    # --- checkpoints -----------------------------------------------------------------

    def _trainer_state(self) -> Dict[str, Any]:
        ebc = self.model.embedding_collection
        row_counters = None
        if self.config.row_clip_stats and isinstance(ebc, CowClipEmbeddingBagCollection):
            row_counters = ebc.clip_counters.row_state()
        return {
            "progress": copy.deepcopy(self.progress.__dict__),
            "config": self.config.as_dict(),
            "run_record": self.run_record,
            "world_size": self.runtime.world_size,
            "rng": self.runtime.all_rng_states(),
            "table_counters": self.runtime.table_counters(),
            "row_clip_counters": row_counters,
            "best_checkpoint": self._best_checkpoint,
        }

    def save(self) -> None:
        """Checkpoints the run as it is now ("latest"), on every rank."""
        p = self.progress
        self.checkpoints.save(
            "latest",
            f"e{p.epoch}-s{p.global_step}",
            self.runtime.tensors(),
            self._trainer_state(),
            step=p.global_step,
            fingerprint=self.fingerprint,
            uses=[self._best_checkpoint] if self._best_checkpoint else [],
        )
        self._saved_step = p.global_step

    def _save_best(self) -> None:
        """The best validation epoch's weights, as their own checkpoint (not kept in
        memory): the run folder's ``weights/best`` (the reported ones under early stopping)."""
        saved = self.checkpoints.save(
            "best",
            f"e{self.progress.epoch}",
            self.runtime.model_tensors(),
            {"epoch": self.progress.epoch},
            step=self.progress.global_step,
            fingerprint=self.fingerprint,
        )
        self._best_checkpoint = saved.path.name

    def restore(self) -> bool:
        """Loads the newest intact "latest" checkpoint of ``--out`` into the model,
        optimizers, counters, progress and RNG, at this run's world size. Every file is
        verified against the checkpoint's manifest first; a damaged checkpoint is
        reported and the previous one used.

        Returns:
            False when there is no checkpoint and ``--resume auto`` starts anew.

        Raises:
            FileNotFoundError: ``--resume`` and no checkpoint.
            DamagedCheckpointError: no checkpoint matches its manifest.
            ResumeRefused: the checkpoint's run differs from this command's.
        """
        say = _say if self.runtime.is_main else (lambda _: None)
        checkpoint = self.checkpoints.intact("latest", say=say)
        if checkpoint is None:
            if self.config.resume == "auto":
                return False
            older = [f for f in self.checkpoints.foreign() if (f / TRAINER_STATE).exists()]
            raise FileNotFoundError(
                f"--resume: no checkpoint in {self.checkpoints.root}"
                + (
                    f" ({older[0]} has no manifest: written by an older version, it cannot "
                    "be verified; start anew with --overwrite)"
                    if older
                    else ""
                )
            )
        saved = self.checkpoints.trainer_state(checkpoint)
        assert saved is not None
        check_resume(saved, self.run_record, self.out)  # before any state is loaded
        self.runtime.prepare_optimizer_state()  # DCP loads in place into existing tensors
        tensors = self.runtime.tensors()
        state = self.checkpoints.load(checkpoint, tensors)
        self.runtime.load_tensors(tensors)
        self.progress = Progress(**state["progress"])
        if state.get("table_counters") is not None:
            self.runtime.load_table_counters(state["table_counters"])
        row_counters = state.get("row_clip_counters")
        if row_counters is not None and self.config.row_clip_stats:
            self.model.embedding_collection.clip_counters.load_row_state(row_counters)
        rng = state["rng"]
        set_rng_state(rng[self.runtime.rank] if self.runtime.rank < len(rng) else rng[0])
        self._best_checkpoint = state.get("best_checkpoint")
        self._saved_step = self.progress.global_step
        self._resumed_from = checkpoint.path
        return True

    def _load_latest_model(self) -> None:
        """Puts the newest "latest" checkpoint's model weights (the last step's: a run
        checkpoints before it finishes) back into the model."""
        tensors = self.runtime.model_tensors()
        self.checkpoints.load("latest", tensors)
        self.runtime.train_module.load_state_dict(tensors["model"])

    def _load_best(self) -> None:
        tensors = self.runtime.model_tensors()
        best = next(
            (c for c in self.checkpoints.complete("best") if c.path.name == self._best_checkpoint),
            None,
        )
        if best is None:
            raise DamagedCheckpointError(
                f"the best epoch's checkpoint {self.checkpoints.root / str(self._best_checkpoint)} "
                "is missing: the final model cannot be restored"
            )
        problems = self.checkpoints.verify(best)
        if problems:
            raise DamagedCheckpointError(f"the best epoch's checkpoint is damaged: {problems[0]}")
        self.checkpoints.load(best, tensors)
        self.runtime.train_module.load_state_dict(tensors["model"])

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
        cfg = self.config
        resumed = self.restore() if cfg.resume else False
        main = self.runtime.is_main
        log = RunLog(self.out, enabled_progress=cfg.progress and main, enabled=main)
        for line in self._start_summary():
            log.info(line)
        if resumed:
            p = self.progress
            assert self._resumed_from is not None  # restore() has just loaded it
            log.info(
                resumed_message(
                    p.global_step,
                    p.epoch,
                    p.batch_in_epoch,
                    self.steps_per_epoch,
                    self._resumed_from,
                )
            )
            log.rewind(p.global_step, p.epoch)
        elif self.warm is not None:
            log.info(self.warm.load_into(self.runtime, cfg.init_optimizer_state))
        try:
            while self.progress.epoch < cfg.epochs and not self.progress.stopped_early:
                finished_epoch = self._train_epoch(log)
                if not finished_epoch:  # --max-steps reached mid-epoch
                    if self._saved_step != self.progress.global_step:
                        self.save()
                    break
                self._end_of_epoch(log)
                self.save()
                if self.runtime.agree_to_stop(self.stop.requested is not None):
                    self._stopped()
        finally:
            log.close()
        return self._finish()

    def _stopped(self) -> None:
        """Ends a run that a signal asked to stop, once its checkpoint is written."""
        p = self.progress
        if self._saved_step != p.global_step:
            self.save()
        raise RunStopped(
            f"stopped by {self.stop.requested or 'a signal on another rank'} after step "
            f"{p.global_step} (epoch {p.epoch + 1}, batch {p.batch_in_epoch} of "
            f"{self.steps_per_epoch}): {self.checkpoints.describe('latest')}"
        )

    def _train_epoch(self, log: RunLog) -> bool:
        cfg, p = self.config, self.progress
        pipeline = self.runtime.pipeline()
        batches = self.runtime.train_batches(p.epoch, p.batch_in_epoch)
        self.runtime.train_module.train()
        bar = log.progress_bar(
            total=self.steps_per_epoch,
            initial=p.batch_in_epoch,
            desc=f"epoch {p.epoch + 1}/{cfg.epochs}",
        )
        running = None
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
                        f"{self.checkpoints.describe('latest')}. "
                        f"Lower --lr / --lr-embed or check the data."
                    )
                step_s = time.perf_counter() - t0
                p.train_seconds += step_s
                p.epoch_train_seconds += step_s
                steps_here, step_seconds_here = steps_here + 1, step_seconds_here + step_s
                p.epoch_samples += n
                p.epoch_loss_sum += loss_value * n
                if helen is not None and helen.last_helen_cost is not None:
                    p.helen_first_pass_s += helen.last_helen_cost.first_pass_s
                    p.helen_extra_s += helen.last_helen_cost.extra_s
                p.train_samples += n
                p.global_step += 1
                p.batch_in_epoch += 1
                samples_since += n
                running = loss_value if running is None else 0.98 * running + 0.02 * loss_value
                if p.global_step % cfg.log_every == 0:
                    now = time.perf_counter()
                    rate = samples_since / max(now - t_last, 1e-9)
                    t_last, samples_since = now, 0
                    log.step(
                        p.global_step,
                        {
                            "loss": loss_value,
                            "running_loss": running,
                            "samples_per_s": rate,
                            "dense_lr": self._dense_lr(),
                        },
                    )
                bar.update(1)
                postfix = {
                    "loss": f"{running:.4f}",
                    "samples_s": f"{p.train_samples / max(p.train_seconds, 1e-9):,.0f}",
                    "run_eta": duration(self._eta(step_seconds_here / steps_here)),
                }
                if helen is not None:
                    postfix["helen_extra"] = f"+{p.helen_cost()['extra_fraction']:.0%}"
                bar.set_postfix(postfix)
                if cfg.checkpoint_every and p.global_step % cfg.checkpoint_every == 0:
                    self.save()
                if stop:
                    self._stopped()
        finally:
            bar.close()
            self.runtime.end_pipeline(pipeline)
            p.epoch_wall_seconds += time.perf_counter() - wall_start
            if steps_here:
                self._step_s = step_seconds_here / steps_here
        return True

    def _total_steps(self) -> int:
        total = self.config.epochs * self.steps_per_epoch
        return min(total, self.config.max_steps) if self.config.max_steps else total

    def _eta(self, step_s: float) -> float:
        """Seconds left in the run: its steps at ``step_s`` each, and its evaluations at
        the mean of those so far (one test pass, and one validation pass, per epoch)."""
        p = self.progress
        passes = 2 if len(self.val_idx) else 1
        epochs_left = self.config.epochs - p.epoch
        if self.config.max_steps:
            epochs_left = min(
                epochs_left,
                -(-(self._total_steps() - p.global_step) // max(self.steps_per_epoch, 1)),
            )
        eval_s = p.eval_seconds / p.evaluations if p.evaluations else 0.0
        return run_eta(p.global_step, self._total_steps(), step_s, passes * epochs_left, eval_s)

    def _end_of_epoch(self, log: RunLog) -> None:
        cfg, p = self.config, self.progress
        wall_start = time.perf_counter()
        test = self._evaluate(self.test_idx, log, "test")
        p.epoch_auc.append(test["auc"])
        p.epoch_logloss.append(test["logloss"])
        row: Dict[str, Any] = {
            "epoch": p.epoch + 1,
            "step": p.global_step,
            "train_samples": p.train_samples,
            "test_auc": test["auc"],
            "test_logloss": test["logloss"],
        }
        if len(self.val_idx):
            val = self._evaluate(self.val_idx, log, "validation")
            p.epoch_val_auc.append(val["auc"])
            row.update(val_auc=val["auc"], val_logloss=val["logloss"])
            # An undefined AUC (a one-class validation split) is no improvement.
            if val["auc"] is not None and val["auc"] > p.best_val_auc:
                p.best_val_auc, p.best_epoch = val["auc"], p.epoch
                p.epochs_without_improvement = 0
                self._save_best()
            else:
                p.epochs_without_improvement += 1
                if (
                    cfg.early_stop_patience
                    and p.epochs_without_improvement >= cfg.early_stop_patience
                ):
                    p.stopped_early = True
        counts = clip_counts(self.runtime.embedding_module())
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
        p.epoch += 1
        p.batch_in_epoch = 0
        p.epoch_samples, p.epoch_loss_sum = 0, 0.0
        p.epoch_train_seconds, p.epoch_wall_seconds = 0.0, 0.0
        p.rows_updated_before_epoch, p.rows_clipped_before_epoch = updated or 0, clipped or 0
        log.epoch(row)
        more = p.epoch < cfg.epochs and not p.stopped_early
        step_s = (
            self._step_s if self._step_s is not None else p.train_seconds / max(p.global_step, 1)
        )
        log.info(
            epoch_line({**row, "epochs": cfg.epochs, "eta_s": self._eta(step_s) if more else None})
        )
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

    def _dense_lr(self) -> float:
        for name, opt in self.optimizer.optimizers:
            if name == "dense":
                return float(opt.param_groups[0]["lr"])
        return float("nan")

    def _finish(self) -> TrainResult:
        cfg, p = self.config, self.progress
        # The run folder (run_folder.py): the last step's weights, then the best epoch's.
        folder = RunFolderWriter(self.out, main=self.runtime.is_main)
        folder.save_weights("final", self.runtime.model_tensors()["model"], prefix="model.")
        reported = "final"
        if self._best_checkpoint is not None:
            # A validation split: the best epoch's weights too. Under early stopping they
            # are the run's model; otherwise the last step's are, and stay in the model.
            self._load_best()
            folder.save_weights("best", self.runtime.model_tensors()["model"], prefix="model.")
            if cfg.early_stop_patience:
                reported = "best"
            else:
                self._load_latest_model()
        final_epoch = (
            p.best_epoch
            if (cfg.early_stop_patience and p.best_epoch >= 0)
            else len(p.epoch_auc) - 1
        )
        # The best epoch is the validation split's choice: without one there is none.
        best_epoch = p.best_epoch + 1 if len(self.val_idx) and p.best_epoch >= 0 else None
        if p.epoch_auc:
            auc, logloss = p.epoch_auc[final_epoch], p.epoch_logloss[final_epoch]
        else:  # --max-steps ended the run before the first epoch finished
            test = self._evaluate(self.test_idx)
            auc, logloss = test["auc"], test["logloss"]
        counts = clip_counts(self.runtime.embedding_module())
        metrics: Dict[str, Any] = {
            "auc": auc,
            **(
                {"auc_note": "AUC is undefined: the test split's labels hold one class"}
                if auc is None
                else {}
            ),
            "logloss": logloss,
            "epoch_auc": p.epoch_auc,
            "epoch_logloss": p.epoch_logloss,
            "epoch_val_auc": p.epoch_val_auc,
            "best_epoch": best_epoch,
            "final_epoch": final_epoch + 1 if final_epoch >= 0 else None,
            "stopped_early": p.stopped_early,
            "epochs": len(p.epoch_auc),
            "steps": p.global_step,
            "batch_size": cfg.batch_size,
            "train_samples": p.train_samples,
            "train_samples_per_s": p.train_samples / max(p.train_seconds, 1e-9),
            "rows_updated": counts["rows_updated"],
            "rows_clipped": counts["rows_clipped"],
            "rows_nonfinite": counts["rows_nonfinite"],
            "clipped_per_table": counts["per_table"],
            "hyperparameters": {
                **cfg.as_dict(),
                **self.hp.as_dict(),
                "cowclip": None if self.cowclip is None else vars(self.cowclip),
            },
            "helen": None
            if self.hp.helen_rho is None
            else {
                "rho": self.hp.helen_rho,
                "bound": self.hp.helen_bound,
                "perturb_dense": cfg.helen_perturb_dense,
                **p.helen_cost(),
            },
            "world_size": self.runtime.world_size,
            "sharding": self.runtime.sharding,
            "dataset": {
                "source": str(getattr(self.dataset, "source", cfg.data)),
                "cache_entry": str(self.dataset.path),
                "rows": len(self.dataset),
                "train": len(self.train_idx),
                "val": len(self.val_idx),
                "test": len(self.test_idx),
                "positive_rate": self.positive_rates,
                "bad_rows_skipped": self.dataset.bad_rows,
                "dense_clipped": self.dataset.dense_clipped,
                "dense_negative_under_log": self.dataset.dense_negative_under_log,
                # The dense transforms and their training-split statistics, as JSON: what
                # scoring new rows needs (torchrec_cowclip.data.DensePlan.from_json).
                "dense_plan": self.dense_plan.to_json(),
            },
            "model_size": self.runtime.model_size.as_dict(),
            "peak_rss_mb": peak_rss_mb(),
        }
        metrics["weights"] = {
            "default": reported,
            "kept": list(folder.weights),
            "best_epoch": best_epoch if "best" in folder.weights else None,
        }
        if cfg.row_clip_stats:
            metrics["clip_by_frequency"] = self._clip_by_frequency()
        if self.runtime.is_main:
            write_text_atomically(
                self.out / "metrics.json", json.dumps(metrics, indent=2, default=str)
            )
            self._plot(best_epoch, p.stopped_early)
        folder.complete(
            describe_model(cfg, self.dataset, metrics, folder.weights, reported),
            lambda encoders: describe_data(
                cfg, self.dataset, encoder_writer(self.dataset)(encoders)
            ),
        )
        if self.runtime.is_main:
            _say(self._weights_line(reported, folder.weights, best_epoch, len(p.epoch_auc)))
        self.model.eval()
        return TrainResult(metrics, self.out if self.runtime.is_main else None, self.model)

    def _weights_line(
        self, reported: str, kept: List[str], best_epoch: Optional[int], epochs: int
    ) -> str:
        """Which weights the run folder keeps, and which predict and evaluate use."""
        where = self.out / "model" / "weights"
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

    def _plot(self, best_epoch: Optional[int] = None, stopped_early: bool = False) -> None:
        """``curves.png``: loss and AUC of the run. A figure that cannot be drawn costs a
        warning, not the finished run (its metrics and checkpoints are written)."""
        hp = self.hp
        title = (
            f"{self.config.model} on {self.config.data}: batch {hp.batch_size} "
            f"(x{hp.scale:g}), recipe {hp.recipe}, seed {self.config.seed}"
        )
        try:
            write_run_curves(self.out, title, best_epoch, stopped_early)
        except Exception as e:  # noqa: BLE001 - any plotting failure, reported in one line
            _say(f"warning: no {CURVES_PNG} in {self.out}: {type(e).__name__}: {e}")

    def _clip_by_frequency(self) -> List[Dict[str, float]]:
        """Clip rate of the clipped tables' row updates, by each id's number of occurrences
        in the training split (over the whole run: the per-row counts are checkpointed, so a
        ``--resume`` continues them)."""
        schema = self.dataset.schema
        counts = self.model.embedding_collection.row_clip_counts()
        # The D-dim tables; not the first-order ones.
        fields = [
            (i, embedding_table_name(name), int(card))
            for i, (name, card) in enumerate(zip(schema.sparse_names, schema.cardinalities))
            if embedding_table_name(name) in counts
        ]
        occurrences = {table: np.zeros(card, dtype=np.int64) for _, table, card in fields}
        # One pass over the memory-mapped training rows, in bounded blocks, for all fields.
        train_rows = np.sort(np.asarray(self.train_idx))
        for start in range(0, len(train_rows), 1 << 20):
            block = np.asarray(self.dataset.sparse[train_rows[start : start + (1 << 20)]])
            for i, table, card in fields:
                occurrences[table] += np.bincount(block[:, i].astype(np.int64), minlength=card)
        frequency = {table: torch.from_numpy(n) for table, n in occurrences.items()}
        return [b.as_dict() for b in clip_rates_by_frequency(counts, frequency)]

    def _banner(self) -> str:
        hp, count_lr = self.hp, self.hp.count_lr
        clip = f"CowClip r={hp.clip_r:g} zeta={hp.clip_zeta:.3g}" if self.cowclip else "no clipping"
        return (
            f"model {self.config.model} | data {self.config.data}: {len(self.train_idx):,} train, "
            f"{len(self.val_idx):,} val, {len(self.test_idx):,} test | batch {hp.batch_size} "
            f"(x{hp.scale:g} of {hp.base_batch_size}, recipe {hp.recipe}) | dense lr {hp.dense_lr:.4g} "
            f"(warm-up {hp.warmup_epochs:g} epoch) | embedding {self.config.embedding_backend}/"
            f"{self.config.embedding_optimizer} lr {hp.embedding_lr:.4g}"
            + (f" x min(count, {count_lr.cap:g})^{count_lr.power:g}" if count_lr else "")
            + f" | L2 lambda {hp.l2:.4g} "
            f"(weight_decay {hp.embedding_weight_decay:.4g}) | {clip}"
            + (f" | Helen rho={hp.helen_rho:.3g} bound={hp.helen_bound:g}" if hp.helen_rho else "")
            + f" | device {self.device}"
        )

    def _start_summary(self) -> List[str]:
        """The lines a run starts with: where it writes, the settings, the model's size,
        the processes and sharding, and how the dense columns enter the model."""
        plan = self.dense_plan
        steps = self._total_steps()
        return [
            f"run {self.out}: {self.config.epochs} epoch(s) of {self.steps_per_epoch:,} steps"
            + (f", stopping at step {steps:,}" if self.config.max_steps else "")
            + (
                "; best_epoch by validation AUC"
                if len(self.val_idx)
                else "; no validation split (--val-fraction): the final epoch is reported"
            ),
            self._banner(),
            self.runtime.model_size.describe(),
            processes_line(
                self.runtime.world_size, self.runtime.sharding, self.runtime.table_shardings()
            ),
            f"dense inputs: {plan.summary()}; statistics of {plan.fitted_on}"
            + (f" (read in {self._plan_seconds:.1f} s)" if self._plan_seconds >= 1 else ""),
            "positive labels: "
            + ", ".join(
                f"{rate:.2%} of {name}"
                + (" (one class: its AUC is undefined)" if rate in (0.0, 1.0) else "")
                for name, rate in self.positive_rates.items()
                if rate is not None
            ),
        ]


def train(config: TrainConfig) -> TrainResult:
    """Runs training as configured; returns the metrics written to ``out/metrics.json``
    (a dict) carrying ``run_dir`` (whose ``model/`` ``torchrec_cowclip.load_model``
    scores with) and ``model`` (the trained module)."""
    return Trainer(config).run()

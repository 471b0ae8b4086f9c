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
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from torchrec_cowclip.data import open_dataset, parse_spec
from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.embedding.row_clip_stats import clip_rates_by_frequency
from torchrec_cowclip.embedding.table_batch import TableClipStats
from torchrec_cowclip.models.embeddings import embedding_table_name
from torchrec_cowclip.optim.options import CowClip
from torchrec_cowclip.train.checkpoint import (
    CHECKPOINTS_DIR,
    TRAINER_STATE,
    CheckpointStore,
    DamagedCheckpointError,
)
from torchrec_cowclip.train.config import ConfigError, TrainConfig
from torchrec_cowclip.train.helen_pipeline import HelenPipeline
from torchrec_cowclip.train.resume_guard import (
    check_resume,
    resumed_message,
    run_fingerprint,
    run_record,
)
from torchrec_cowclip.train.run_dir import claim_run_dir
from torchrec_cowclip.train.run_log import RunLog, write_text_atomically
from torchrec_cowclip.train.runtime import Runtime, make_runtime, set_rng_state
from torchrec_cowclip.train.scaling import ScaledHyperparameters, scale_hyperparameters
from torchrec_cowclip.train.stop import RunStopped, StopRequest
from torchrec_cowclip.train.table_memory import check_tables_fit


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
        config.validate()
        self.config = config
        self.out = Path(config.out)
        # Rank 0 (the environment names it before the process group exists) holds the
        # output directory's lock for the run's life.
        self.is_main = int(os.environ.get("RANK", "0")) == 0
        self.run_dir = claim_run_dir(self.out, config.resume, config.overwrite, main=self.is_main)
        try:
            self._build()
        except BaseException:
            self.run_dir.release()
            raise

    def _build(self) -> None:
        config = self.config
        if config.threads:
            torch.set_num_threads(config.threads)
        _seed_everything(config.seed)

        data_options = config.data_options()
        # validate() has checked that the test files are of --data's kind.
        test_paths = parse_spec(config.test_data)[1] if config.test_data else None
        # Explicit test files are converted with the training files' vocabulary and
        # scaling, as the last rows of one cache entry.
        self.dataset = open_dataset(
            config.data, config.cache_dir, test_paths=test_paths, **data_options
        )
        self.train_idx, self.val_idx, self.test_idx = self.dataset.split(
            config.test_fraction, config.val_fraction, config.seed
        )
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        check_split_sizes(
            config, len(self.train_idx), len(self.val_idx), len(self.test_idx), world_size
        )
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

        self.hp: ScaledHyperparameters = scale_hyperparameters(
            config.batch_size,
            dataset="avazu" if config.data.startswith("avazu:") else "criteo",
            base_batch_size=config.base_batch_size,
            embedding_dim=config.embedding_dim,
            dense_lr=config.lr,
            embedding_lr=config.lr_embed,
            l2=config.l2,
            clip_r=config.clip_r,
            clip_zeta=config.clip_zeta,
            warmup_epochs=config.warmup_epochs,
            recipe=config.recipe,
            count_lr_power=config.count_lr_power,
            helen_rho=config.helen_rho,
            helen_bound=config.helen_bound,
        )
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
        """Early stopping's best weights, as their own checkpoint (not kept in memory)."""
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

    def run(self) -> Dict[str, Any]:
        """Trains to the end (or ``--max-steps``), checkpointing at every epoch's end,
        and returns the metrics written to ``out/metrics.json``.

        Raises:
            RunStopped: SIGTERM/SIGINT arrived; the run finished its step, wrote a
                checkpoint and released ``--out``.
        """
        try:
            with self.stop.installed():
                return self._run()
        finally:
            self.run_dir.release()

    def _run(self) -> Dict[str, Any]:
        cfg = self.config
        resumed = self.restore() if cfg.resume else False
        main = self.runtime.is_main
        log = RunLog(self.out, enabled_progress=cfg.progress and main, enabled=main)
        log.info(self._banner())
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
                p.train_seconds += time.perf_counter() - t0
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
        return True

    def _end_of_epoch(self, log: RunLog) -> None:
        cfg, p = self.config, self.progress
        test = self._evaluate(self.test_idx)
        p.epoch_auc.append(test["auc"])
        p.epoch_logloss.append(test["logloss"])
        row: Dict[str, Any] = {
            "epoch": p.epoch + 1,
            "test_auc": test["auc"],
            "test_logloss": test["logloss"],
        }
        if len(self.val_idx):
            val = self._evaluate(self.val_idx)
            p.epoch_val_auc.append(val["auc"])
            row.update(val_auc=val["auc"], val_logloss=val["logloss"])
            if val["auc"] > p.best_val_auc:
                p.best_val_auc, p.best_epoch = val["auc"], p.epoch
                p.epochs_without_improvement = 0
                if cfg.early_stop_patience:
                    self._save_best()
            else:
                p.epochs_without_improvement += 1
                if (
                    cfg.early_stop_patience
                    and p.epochs_without_improvement >= cfg.early_stop_patience
                ):
                    p.stopped_early = True
        else:
            p.best_epoch = p.epoch
        counts = clip_counts(self.runtime.embedding_module())
        row.update(rows_updated=counts["rows_updated"], rows_clipped=counts["rows_clipped"])
        log.epoch(row)
        p.epoch += 1
        p.batch_in_epoch = 0

    def _evaluate(self, indices: np.ndarray) -> Dict[str, float]:
        return self.runtime.evaluate(indices)

    def _dense_lr(self) -> float:
        for name, opt in self.optimizer.optimizers:
            if name == "dense":
                return float(opt.param_groups[0]["lr"])
        return float("nan")

    def _finish(self) -> Dict[str, Any]:
        cfg, p = self.config, self.progress
        if cfg.early_stop_patience and self._best_checkpoint is not None:
            # Early stopping: the final model is the best validation epoch's.
            self._load_best()
        final_epoch = (
            p.best_epoch
            if (cfg.early_stop_patience and p.best_epoch >= 0)
            else len(p.epoch_auc) - 1
        )
        if p.epoch_auc:
            auc, logloss = p.epoch_auc[final_epoch], p.epoch_logloss[final_epoch]
        else:  # --max-steps ended the run before the first epoch finished
            test = self._evaluate(self.test_idx)
            auc, logloss = test["auc"], test["logloss"]
        counts = clip_counts(self.runtime.embedding_module())
        metrics: Dict[str, Any] = {
            "auc": auc,
            "logloss": logloss,
            "epoch_auc": p.epoch_auc,
            "epoch_logloss": p.epoch_logloss,
            "epoch_val_auc": p.epoch_val_auc,
            "best_epoch": final_epoch + 1 if final_epoch >= 0 else None,
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
                "rows": len(self.dataset),
                "train": len(self.train_idx),
                "val": len(self.val_idx),
                "test": len(self.test_idx),
                "bad_rows_skipped": self.dataset.bad_rows,
            },
        }
        if cfg.row_clip_stats:
            metrics["clip_by_frequency"] = self._clip_by_frequency()
        if self.runtime.is_main:
            write_text_atomically(
                self.out / "metrics.json", json.dumps(metrics, indent=2, default=str)
            )
        return metrics

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


def train(config: TrainConfig) -> Dict[str, Any]:
    """Runs training as configured and returns the metrics written to ``out/metrics.json``."""
    return Trainer(config).run()

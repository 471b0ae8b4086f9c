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
    (6, True)
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

from torchrec_cowclip.data import BatchIterator, epoch_order, open_dataset, parse_spec
from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.embedding.row_clip_stats import clip_rates_by_frequency
from torchrec_cowclip.models import build_model
from torchrec_cowclip.models.embeddings import embedding_table_name
from torchrec_cowclip.optim.functional import CowClip
from torchrec_cowclip.train.checkpoint import load_checkpoint, save_checkpoint
from torchrec_cowclip.train.config import ConfigError, TrainConfig
from torchrec_cowclip.train.evaluate import evaluate
from torchrec_cowclip.train.run_log import RunLog
from torchrec_cowclip.train.scaling import ScaledHyperparameters, scale_hyperparameters
from torchrec_cowclip.train.distributed import (
    DistContext,
    init_distributed,
    load_full_tensors,
    rank_rows_for_eval,
    rank_rows_of_epoch,
    shard_model,
)
from torchrec_cowclip.train.optimizers import build_optimizer
from torchrec_cowclip.train.task import CTRTrainTask

CHECKPOINT_NAME = "checkpoint.pt"
SHARDED_CHECKPOINT_DIR = "checkpoint_sharded"


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


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def clip_counts(embedding_collection: torch.nn.Module, ctx: Optional[DistContext]) -> Dict[str, Any]:
    """Totals and per-table counts of row updates, clipped rows and skipped rows
    (over all ranks when sharded)."""
    if not hasattr(embedding_collection, "clip_stats"):
        return {"rows_updated": None, "rows_clipped": None, "rows_nonfinite": None, "per_table": {}}
    if ctx is not None:
        stats = embedding_collection.global_clip_stats()  # collective: every rank calls it
    else:
        stats = embedding_collection.clip_stats()
    return {
        "rows_updated": sum(s.total_rows_updated for s in stats.values()),
        "rows_clipped": sum(s.total_rows_clipped for s in stats.values()),
        "rows_nonfinite": sum(s.total_rows_nonfinite for s in stats.values()),
        "per_table": {
            name: {"rows_updated": s.total_rows_updated, "rows_clipped": s.total_rows_clipped}
            for name, s in stats.items()
        },
    }


class Trainer:
    """One training run as configured by :class:`TrainConfig`."""

    def __init__(self, config: TrainConfig) -> None:
        config.validate()
        self.config = config
        self.out = Path(config.out)
        self.ctx = init_distributed(config.device, config.dist_timeout_s)
        self.device = self.ctx.device if self.ctx else _device(config.device)
        if self.ctx and config.embedding_backend != "cowclip":
            raise ConfigError("multi-process runs shard the CowClip tables: use --embedding-backend cowclip")
        if config.threads:
            torch.set_num_threads(config.threads)
        _seed_everything(config.seed)

        data_options: Dict[str, Any] = dict(
            on_bad_row=config.on_bad_row, min_count=config.min_count,
            hash_size=config.hash_size, dense_transform=config.dense_transform,
            seed=config.seed,
        )
        if config.data.startswith(("table:", "avazu:")):
            # Column choices exist for these kinds only; others have a fixed layout.
            data_options.update(label=config.label, dense=config.dense or None,
                                sparse=config.sparse or None)
        if config.data.startswith("synthetic:"):
            data_options.update(cardinality_scale=config.synthetic_scale,
                                max_cardinality=config.synthetic_max_cardinality)
        test_paths = None
        if config.test_data:
            kind, test_paths = parse_spec(config.test_data)
            if kind != parse_spec(config.data)[0]:
                raise ConfigError(
                    f"--test-data must be of the same kind as --data ({config.data.split(':')[0]}:), "
                    f"got {config.test_data!r}"
                )
        # Explicit test files are converted with the training files' vocabulary and
        # scaling, as the last rows of one cache entry.
        self.dataset = open_dataset(config.data, config.cache_dir, test_paths=test_paths, **data_options)
        self.train_idx, self.val_idx, self.test_idx = self.dataset.split(
            config.test_fraction, config.val_fraction, config.seed
        )
        if len(self.train_idx) == 0:
            raise ValueError(f"no training rows in {config.data} after the split")

        schema = self.dataset.schema
        self.hp: ScaledHyperparameters = scale_hyperparameters(
            config.batch_size,
            dataset="avazu" if config.data.startswith("avazu:") else "criteo",
            base_batch_size=config.base_batch_size,
            embedding_dim=config.embedding_dim,
            dense_lr=config.lr, embedding_lr=config.lr_embed, l2=config.l2,
            clip_r=config.clip_r, clip_zeta=config.clip_zeta,
            warmup_epochs=config.warmup_epochs, recipe=config.recipe,
            count_lr_power=config.count_lr_power,
        )
        self.cowclip = CowClip(r=self.hp.clip_r, zeta=self.hp.clip_zeta) if config.cowclip else None
        self.model = build_model(
            config.model,
            num_dense=len(schema.dense_names),
            sparse_names=list(schema.sparse_names),
            cardinalities=list(schema.cardinalities),
            embedding_dim=config.embedding_dim,
            hidden=tuple(config.hidden),
            cross_layers=config.cross_layers,
            init_std=config.init_std,
            embedding_backend=config.embedding_backend,
            embedding_optimizer=config.embedding_optimizer,
            embedding_lr=self.hp.embedding_lr,
            embedding_weight_decay=self.hp.embedding_weight_decay,
            cowclip=self.cowclip,
            device=self.device,
            embedding_count_lr=self.hp.count_lr if config.embedding_backend == "cowclip" else None,
        )
        self.task = CTRTrainTask(self.model)
        if config.row_clip_stats:
            if self.ctx is not None:
                raise ConfigError("--row-clip-stats counts rows of unsharded tables: run one process")
            self.model.embedding_collection.track_row_clips()
        if self.ctx is None:
            self.train_module: torch.nn.Module = self.task
            self.steps_per_epoch = math.ceil(len(self.train_idx) / config.batch_size)
            self.optimizer = build_optimizer(
                self.model, self.model.embedding_collection, self.hp, self.steps_per_epoch
            )
        else:
            from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder

            ebc = self.model.embedding_collection
            initial_tables = {k: v.detach().clone() for k, v in self.task.state_dict().items()
                              if ".embedding_bags." in k}
            sharder = CowClipEmbeddingBagCollectionSharder(module_type=type(ebc))
            self.train_module = shard_model(
                self.task, [t.name for t in ebc.embedding_bag_configs()], [sharder],
                config.sharding, self.ctx, config.batch_size,
            )
            load_full_tensors(self.train_module, initial_tables)
            self.steps_per_epoch = len(self.train_idx) // config.batch_size
            self.optimizer = build_optimizer(
                self.train_module, None, self.hp, self.steps_per_epoch,
                fused=self.train_module.fused_optimizer,
            )
        self.progress = Progress()
        self.best_state: Optional[Dict[str, Any]] = None

    # --- data ------------------------------------------------------------------------

    def _train_batches(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        # Order from (seed, epoch) alone, so a resumed run sees the same batches.
        if self.ctx is None:
            return iter(BatchIterator(
                self.dataset, self.train_idx, self.config.batch_size, shuffle=True,
                seed=self.config.seed, epoch=epoch, start_batch=start_batch, prefetch=2,
            ))
        order = epoch_order(self.train_idx, True, self.config.seed, epoch)
        rows = rank_rows_of_epoch(order, self.config.batch_size, self.ctx)
        return iter(BatchIterator(
            self.dataset, rows, self.config.batch_size // self.ctx.world_size,
            start_batch=start_batch, prefetch=2,
        ))

    def _eval_batches(self, indices: np.ndarray) -> Iterator[Batch]:
        size = self.config.eval_batch_size
        if self.ctx is not None:
            indices = rank_rows_for_eval(indices, self.ctx)
            size = max(size // self.ctx.world_size, 1)
        return iter(BatchIterator(self.dataset, indices, size, prefetch=2))

    # --- checkpoints -----------------------------------------------------------------

    def _checkpoint_payload(self) -> Dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "progress": copy.deepcopy(self.progress.__dict__),
            "best_state": self.best_state,
            "clip_counters": self._clip_counters(),
            "row_clip_counters": self._row_clip_counters(),
            "rng": _rng_state(),
            "config": self.config.as_dict(),
        }

    def _clip_counters(self) -> Optional[List[torch.Tensor]]:
        ebc = self.model.embedding_collection
        if isinstance(ebc, CowClipEmbeddingBagCollection):
            return ebc.clip_counters_state()
        return None

    def _row_clip_counters(self) -> Optional[List[torch.Tensor]]:
        ebc = self.model.embedding_collection
        if self.config.row_clip_stats and isinstance(ebc, CowClipEmbeddingBagCollection):
            return ebc.row_clip_counters_state()
        return None

    def save(self) -> None:
        if self.ctx is None:
            save_checkpoint(self._checkpoint_payload(), self.out / CHECKPOINT_NAME)
        else:
            self._save_sharded()

    def _sharded_state(self) -> Dict[str, Any]:
        return {"model": self.train_module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _save_sharded(self) -> None:
        """``torch.distributed.checkpoint`` of the sharded model and optimizers into a
        temporary directory, renamed into place by rank 0 once every rank has written:
        a crash mid-write leaves the previous checkpoint directory intact."""
        import shutil

        import torch.distributed.checkpoint as dcp

        assert self.ctx is not None
        final, tmp = self.out / SHARDED_CHECKPOINT_DIR, self.out / (SHARDED_CHECKPOINT_DIR + ".tmp")
        if self.ctx.is_main and tmp.exists():
            shutil.rmtree(tmp)
        torch.distributed.barrier()
        dcp.save(self._sharded_state(), checkpoint_id=str(tmp))
        if self.ctx.is_main:
            torch.save({"progress": copy.deepcopy(self.progress.__dict__),
                        "config": self.config.as_dict()}, tmp / "trainer_state.pt")
        torch.distributed.barrier()
        if self.ctx.is_main:
            old = self.out / (SHARDED_CHECKPOINT_DIR + ".old")
            if final.exists():
                os.replace(final, old)
            os.replace(tmp, final)
            if old.exists():
                shutil.rmtree(old)
        torch.distributed.barrier()

    def _restore_sharded(self) -> None:
        import torch.distributed.checkpoint as dcp

        final = self.out / SHARDED_CHECKPOINT_DIR
        if not final.is_dir():
            raise FileNotFoundError(f"no sharded checkpoint at {final}")
        self.optimizer.init_state()  # dcp loads in place into existing state tensors
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(final))
        self.train_module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        extra = torch.load(final / "trainer_state.pt", weights_only=False)
        self.progress = Progress(**extra["progress"])

    def restore(self) -> None:
        if self.ctx is not None:
            self._restore_sharded()
            return
        ckpt = load_checkpoint(self.out / CHECKPOINT_NAME)
        self.model.load_state_dict(ckpt["model"])
        # KeyedOptimizer loads in place into initialised state only.
        self.optimizer.init_state()
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.progress = Progress(**ckpt["progress"])
        self.best_state = ckpt["best_state"]
        counters = ckpt.get("clip_counters")
        ebc = self.model.embedding_collection
        if counters is not None and isinstance(ebc, CowClipEmbeddingBagCollection):
            ebc.load_clip_counters_state(counters)
        row_counters = ckpt.get("row_clip_counters")
        if row_counters is not None and self.config.row_clip_stats:
            ebc.load_row_clip_counters_state(row_counters)
        _set_rng_state(ckpt["rng"])

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> Dict[str, Any]:
        cfg = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg.resume:
            self.restore()
        main = self.ctx is None or self.ctx.is_main
        log = RunLog(self.out, enabled_progress=cfg.progress and main, enabled=main)
        log.info(self._banner())
        try:
            while self.progress.epoch < cfg.epochs and not self.progress.stopped_early:
                finished_epoch = self._train_epoch(log)
                if not finished_epoch:  # --max-steps reached mid-epoch
                    self.save()
                    break
                self._end_of_epoch(log)
                self.save()
        finally:
            log.close()
        return self._finish()

    def _train_epoch(self, log: RunLog) -> bool:
        cfg, p = self.config, self.progress
        if self.ctx is None:
            pipeline = TrainPipelineBase(self.train_module, self.optimizer, self.device)
        else:
            pipeline = TrainPipelineSparseDist(self.train_module, self.optimizer, self.device)
        batches = self._train_batches(p.epoch, p.batch_in_epoch)
        self.train_module.train()
        bar = log.progress_bar(total=self.steps_per_epoch, initial=p.batch_in_epoch,
                               desc=f"epoch {p.epoch + 1}/{cfg.epochs}")
        running = None
        t_last, samples_since = time.perf_counter(), 0
        try:
            while True:
                if cfg.max_steps and p.global_step >= cfg.max_steps:
                    return False
                t0 = time.perf_counter()
                try:
                    loss, _logits, labels = pipeline.progress(batches)
                except StopIteration:
                    break
                loss_value = float(loss)
                if not math.isfinite(loss_value):
                    raise NonFiniteLossError(
                        f"loss became {loss_value} at step {p.global_step + 1} (epoch "
                        f"{p.epoch + 1}, batch {p.batch_in_epoch + 1}); stopping. The last good "
                        f"checkpoint, if any, is {self.out / CHECKPOINT_NAME}. Lower --lr / "
                        f"--lr-embed or check the data."
                    )
                n = int(labels.numel())
                p.train_seconds += time.perf_counter() - t0
                p.train_samples += n
                p.global_step += 1
                p.batch_in_epoch += 1
                samples_since += n
                running = loss_value if running is None else 0.98 * running + 0.02 * loss_value
                if p.global_step % cfg.log_every == 0:
                    now = time.perf_counter()
                    rate = samples_since / max(now - t_last, 1e-9)
                    t_last, samples_since = now, 0
                    log.step(p.global_step, {"loss": loss_value, "running_loss": running,
                                             "samples_per_s": rate,
                                             "dense_lr": self._dense_lr()})
                bar.update(1)
                bar.set_postfix(loss=f"{running:.4f}",
                                samples_s=f"{p.train_samples / max(p.train_seconds, 1e-9):,.0f}")
                if cfg.checkpoint_every and p.global_step % cfg.checkpoint_every == 0:
                    self.save()
        finally:
            bar.close()
            if isinstance(pipeline, TrainPipelineSparseDist):
                # Restore the sharded modules' own forwards for evaluation and the next
                # epoch's pipeline.
                pipeline.detach()
        return True

    def _end_of_epoch(self, log: RunLog) -> None:
        cfg, p = self.config, self.progress
        test = evaluate(self.train_module, self._eval_batches(self.test_idx), self.device)
        p.epoch_auc.append(test["auc"])
        p.epoch_logloss.append(test["logloss"])
        row: Dict[str, Any] = {"epoch": p.epoch + 1, "test_auc": test["auc"],
                               "test_logloss": test["logloss"]}
        if len(self.val_idx):
            val = evaluate(self.train_module, self._eval_batches(self.val_idx), self.device)
            p.epoch_val_auc.append(val["auc"])
            row.update(val_auc=val["auc"], val_logloss=val["logloss"])
            if val["auc"] > p.best_val_auc:
                p.best_val_auc, p.best_epoch = val["auc"], p.epoch
                p.epochs_without_improvement = 0
                if cfg.early_stop_patience:
                    self.best_state = copy.deepcopy(self.model.state_dict())
            else:
                p.epochs_without_improvement += 1
                if cfg.early_stop_patience and p.epochs_without_improvement >= cfg.early_stop_patience:
                    p.stopped_early = True
        else:
            p.best_epoch = p.epoch
        counts = clip_counts(self._embedding_module(), self.ctx)
        row.update(rows_updated=counts["rows_updated"], rows_clipped=counts["rows_clipped"])
        log.epoch(row)
        p.epoch += 1
        p.batch_in_epoch = 0

    def _embedding_module(self) -> torch.nn.Module:
        """The (possibly sharded) embedding collection of the model."""
        if self.ctx is None:
            return self.model.embedding_collection
        from torchrec_cowclip.distributed import ShardedCowClipEmbeddingBagCollection

        return next(m for m in self.train_module.modules()
                    if isinstance(m, ShardedCowClipEmbeddingBagCollection))

    def _dense_lr(self) -> float:
        for name, opt in self.optimizer.optimizers:
            if name == "dense":
                return float(opt.param_groups[0]["lr"])
        return float("nan")

    def _finish(self) -> Dict[str, Any]:
        cfg, p = self.config, self.progress
        if p.stopped_early or (cfg.early_stop_patience and self.best_state is not None):
            # Early stopping: the final model is the best validation epoch's.
            if self.best_state is not None:
                self.model.load_state_dict(self.best_state)
        final_epoch = p.best_epoch if (cfg.early_stop_patience and p.best_epoch >= 0) else len(p.epoch_auc) - 1
        if p.epoch_auc:
            auc, logloss = p.epoch_auc[final_epoch], p.epoch_logloss[final_epoch]
        else:  # --max-steps ended the run before the first epoch finished
            test = evaluate(self.train_module, self._eval_batches(self.test_idx), self.device)
            auc, logloss = test["auc"], test["logloss"]
        counts = clip_counts(self._embedding_module(), self.ctx)
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
            "hyperparameters": {**cfg.as_dict(), **self.hp.as_dict(),
                                "cowclip": None if self.cowclip is None else vars(self.cowclip)},
            "world_size": 1 if self.ctx is None else self.ctx.world_size,
            "sharding": None if self.ctx is None else cfg.sharding,
            "dataset": {"source": str(getattr(self.dataset, "source", cfg.data)),
                        "rows": len(self.dataset), "train": len(self.train_idx),
                        "val": len(self.val_idx), "test": len(self.test_idx)},
        }
        if cfg.row_clip_stats:
            metrics["clip_by_frequency"] = self._clip_by_frequency()
        if self.ctx is None or self.ctx.is_main:
            tmp = self.out / "metrics.json.tmp"
            tmp.write_text(json.dumps(metrics, indent=2, default=str))
            os.replace(tmp, self.out / "metrics.json")
        return metrics

    def _clip_by_frequency(self) -> List[Dict[str, float]]:
        """Clip rate of the clipped tables' row updates, by each id's number of occurrences
        in the training split (over the whole run: the per-row counts are checkpointed, so a
        ``--resume`` continues them)."""
        schema = self.dataset.schema
        counts = self.model.embedding_collection.row_clip_counts()
        # The D-dim tables; not the first-order ones.
        fields = [(i, embedding_table_name(name), int(card))
                  for i, (name, card) in enumerate(zip(schema.sparse_names, schema.cardinalities))
                  if embedding_table_name(name) in counts]
        occurrences = {table: np.zeros(card, dtype=np.int64) for _, table, card in fields}
        # One pass over the memory-mapped training rows, in bounded blocks, for all fields.
        train_rows = np.sort(np.asarray(self.train_idx))
        for start in range(0, len(train_rows), 1 << 20):
            block = np.asarray(self.dataset.sparse[train_rows[start:start + (1 << 20)]])
            for i, table, card in fields:
                occurrences[table] += np.bincount(block[:, i].astype(np.int64), minlength=card)
        frequency = {table: torch.from_numpy(n) for table, n in occurrences.items()}
        return [b.as_dict() for b in clip_rates_by_frequency(counts, frequency)]

    def _banner(self) -> str:
        hp, count_lr = self.hp, self.hp.count_lr
        clip = (f"CowClip r={hp.clip_r:g} zeta={hp.clip_zeta:.3g}" if self.cowclip
                else "no clipping")
        return (
            f"model {self.config.model} | data {self.config.data}: {len(self.train_idx):,} train, "
            f"{len(self.val_idx):,} val, {len(self.test_idx):,} test | batch {hp.batch_size} "
            f"(x{hp.scale:g} of {hp.base_batch_size}, recipe {hp.recipe}) | dense lr {hp.dense_lr:.4g} "
            f"(warm-up {hp.warmup_epochs:g} epoch) | embedding {self.config.embedding_backend}/"
            f"{self.config.embedding_optimizer} lr {hp.embedding_lr:.4g}"
            + (f" x min(count, {count_lr.cap:g})^{count_lr.power:g}" if count_lr else "")
            + f" | L2 lambda {hp.l2:.4g} "
            f"(weight_decay {hp.embedding_weight_decay:.4g}) | {clip} | device {self.device}"
        )


def train(config: TrainConfig) -> Dict[str, Any]:
    """Runs training as configured and returns the metrics written to ``out/metrics.json``."""
    return Trainer(config).run()

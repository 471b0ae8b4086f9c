"""What a finished run reports: ``metrics.json`` (:func:`run_metrics`, with the row
updates' counters of :func:`clip_counts` and, with ``--row-clip-stats``, the clip rate by
id frequency of :func:`clip_by_frequency`), its curves (:func:`write_curves`), and what
:func:`~torchrec_cowclip.train.train` returns: the metrics, and where the model is.

A :class:`TrainResult` is the metrics dict that ``out/metrics.json`` holds (so
``result["auc"]`` reads as it always has) with the run directory and the trained model
attached: ``result.run_dir`` is what ``torchrec_cowclip.load_model`` scores with, and
``result.model`` the trained ``nn.Module`` itself (this process's part of it when the run
was sharded).

Example::

    >>> result = TrainResult({"auc": 0.75}, run_dir="runs/x", model=None)
    >>> result["auc"], result.metrics == {"auc": 0.75}, str(result.run_dir)
    (0.75, True, 'runs/x')
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import numpy as np
import torch
from torch import nn

from torchrec_cowclip.embedding.row_clip_stats import clip_rates_by_frequency
from torchrec_cowclip.embedding.table_batch import TableClipStats
from torchrec_cowclip.models.base import CTRModel
from torchrec_cowclip.models.embeddings import embedding_table_name
from torchrec_cowclip.run.curves import CURVES_PNG, write_run_curves
from torchrec_cowclip.train.config import TrainSettings
from torchrec_cowclip.train.console import peak_rss_mb
from torchrec_cowclip.train.data import TrainingData
from torchrec_cowclip.train.run_state import Progress
from torchrec_cowclip.train.runtime import Runtime


class TrainResult(Dict[str, Any]):
    """The run's metrics (a dict, as ``metrics.json``) plus ``run_dir`` and ``model``.

    Attributes:
        run_dir: the run's ``--out``; its ``model/`` is the self-contained run folder
            (None if the run wrote none: another rank's result).
        model: the trained model (the reported weights: the best epoch's under early
            stopping), on the training device, in eval mode.
    """

    def __init__(
        self,
        metrics: Mapping[str, Any],
        run_dir: Optional[Union[str, Path]],
        model: Optional[nn.Module],
    ) -> None:
        super().__init__(metrics)
        self.run_dir: Optional[Path] = None if run_dir is None else Path(run_dir)
        self.model = model

    @property
    def metrics(self) -> Dict[str, Any]:
        """The metrics alone, as a plain dict."""
        return dict(self)


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


def run_metrics(
    settings: TrainSettings,
    progress: Progress,
    data: TrainingData,
    runtime: Runtime,
    test: Mapping[str, Any],
    final_epoch: int,
    best_epoch: Optional[int],
) -> Dict[str, Any]:
    """``metrics.json`` (but its ``weights`` and ``clip_by_frequency``): the reported
    epoch's ``test`` AUC and log-loss, every epoch's, the run's size, speed and row
    counters, its options and resolved hyperparameters, Helen's cost and the data."""
    p, hp, dataset = progress, settings.hp, data.dataset
    counts = clip_counts(runtime.embedding_module())
    embedding = settings.optimizers.embedding
    auc = test["auc"]
    return {
        "auc": auc,
        **(
            {"auc_note": "AUC is undefined: the test split's labels hold one class"}
            if auc is None
            else {}
        ),
        "logloss": test["logloss"],
        # Mean prediction over the positive rate (1: calibrated), as evaluate reports it.
        "calibration": test.get("calibration"),
        "epoch_auc": p.epoch_auc,
        "epoch_logloss": p.epoch_logloss,
        "epoch_calibration": p.epoch_calibration,
        "epoch_val_auc": p.epoch_val_auc,
        "epoch_val_calibration": p.epoch_val_calibration,
        "best_epoch": best_epoch,
        "final_epoch": final_epoch + 1 if final_epoch >= 0 else None,
        "stopped_early": p.stopped_early,
        "epochs": len(p.epoch_auc),
        "steps": p.global_step,
        # The machine's load when the run ended (1, 5, 15 minutes): timings on a shared
        # machine are read against it (the sweep's time figure says it).
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "batch_size": settings.run.batch_size,
        "train_samples": p.train_samples,
        "train_samples_per_s": p.train_samples / max(p.train_seconds, 1e-9),
        "rows_updated": counts["rows_updated"],
        "rows_clipped": counts["rows_clipped"],
        "rows_nonfinite": counts["rows_nonfinite"],
        "clipped_per_table": counts["per_table"],
        "hyperparameters": {
            **settings.record,
            **hp.as_dict(),
            "cowclip": None if embedding.cowclip is None else vars(embedding.cowclip),
        },
        "helen": None
        if embedding.helen is None
        else {
            "rho": hp.helen_rho,
            "bound": hp.helen_bound,
            "perturb_dense": embedding.helen.perturb_dense,
            **p.helen_cost(),
        },
        "world_size": runtime.world_size,
        "sharding": runtime.sharding,
        "dataset": {
            "source": str(getattr(dataset, "source", settings.data.spec)),
            "cache_entry": str(dataset.path),
            "rows": len(dataset),
            "train": len(data.train_idx),
            "val": len(data.val_idx),
            "test": len(data.test_idx),
            "positive_rate": data.positive_rates,
            "bad_rows_skipped": dataset.bad_rows,
            "dense_clipped": dataset.dense_clipped,
            "dense_negative_under_log": dataset.dense_negative_under_log,
            # The dense transforms and their training-split statistics, as JSON: what
            # scoring new rows needs (torchrec_cowclip.data.DensePlan.from_json).
            "dense_plan": data.dense_plan.to_json(),
        },
        "model_size": runtime.model_size.as_dict(),
        "peak_rss_mb": peak_rss_mb(),
    }


def clip_by_frequency(model: CTRModel, data: TrainingData) -> List[Dict[str, float]]:
    """Clip rate of the clipped tables' row updates, by each id's number of occurrences
    in the training split (over the whole run: the per-row counts are checkpointed, so a
    ``--resume`` continues them)."""
    dataset = data.dataset
    schema = dataset.schema
    collection: Any = model.embedding_collection
    counts = collection.row_clip_counts()
    # The D-dim tables; not the first-order ones.
    tables = [
        (i, embedding_table_name(name), int(card))
        for i, (name, card) in enumerate(zip(schema.sparse_names, schema.cardinalities))
        if embedding_table_name(name) in counts
    ]
    occurrences = {table: np.zeros(card, dtype=np.int64) for _, table, card in tables}
    # One pass over the memory-mapped training rows, in bounded blocks, for all fields.
    train_rows = np.sort(np.asarray(data.train_idx))
    for start in range(0, len(train_rows), 1 << 20):
        block = np.asarray(dataset.sparse[train_rows[start : start + (1 << 20)]])
        for i, table, card in tables:
            occurrences[table] += np.bincount(block[:, i].astype(np.int64), minlength=card)
    frequency = {table: torch.from_numpy(n) for table, n in occurrences.items()}
    return [b.as_dict() for b in clip_rates_by_frequency(counts, frequency)]


def write_curves(
    out: Path,
    settings: TrainSettings,
    best_epoch: Optional[int],
    stopped_early: bool,
    say: Callable[[str], None],
) -> None:
    """``curves.png``: loss and AUC of the run. A figure that cannot be drawn costs a
    warning, not the finished run (its metrics and checkpoints are written)."""
    hp = settings.hp
    title = (
        f"{settings.model.name} on {settings.data.spec}: batch {hp.batch_size} "
        f"(x{hp.scale:g}), recipe {hp.recipe}, seed {settings.run.seed}"
    )
    try:
        write_run_curves(out, title, best_epoch, stopped_early)
    except Exception as e:  # noqa: BLE001 - any plotting failure, reported in one line
        say(f"warning: no {CURVES_PNG} in {out}: {type(e).__name__}: {e}")

"""The end of a training run (:class:`RunFinish`): which weights it reports (the last
step's, or the best validation epoch's under early stopping), the run folder ``out/model``
with them, ``metrics.json`` and the curves (:mod:`.metrics`), and the lines that say which
weights predict and evaluate use. The start (:func:`~torchrec_cowclip.train.start.start_run`)
makes it with the settings the records describe; the loop hands it the trained run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict

import numpy as np

from torchrec_cowclip.run.folder_writer import (
    RunFolderWriter,
    describe_data,
    describe_model,
    encoder_writer,
)
from torchrec_cowclip.run.log import write_text_atomically
from torchrec_cowclip.train.config import TrainSettings
from torchrec_cowclip.train.console import calibration_line, weights_line
from torchrec_cowclip.train.data import TrainingData
from torchrec_cowclip.train.metrics import (
    TrainResult,
    clip_by_frequency,
    run_metrics,
    write_curves,
)
from torchrec_cowclip.train.report import RunReport
from torchrec_cowclip.train.run_state import Progress, RunCheckpoints
from torchrec_cowclip.train.runtime import Runtime

#: An evaluation of a split's rows (their indices): its AUC, log-loss and calibration.
Evaluate = Callable[[np.ndarray], Dict[str, Any]]


class RunFinish:
    """Writes what a finished run leaves (see the module docstring).

    Args:
        settings: the run's, as its records (``metrics.json``, ``model.json``,
            ``data.json``) and its curves' title describe them.
        out: the run directory.
        data, runtime, checkpoints, report: the run's pieces, as the loop holds them.
    """

    def __init__(
        self,
        settings: TrainSettings,
        out: Path,
        data: TrainingData,
        runtime: Runtime,
        checkpoints: RunCheckpoints,
        report: RunReport,
    ) -> None:
        self.settings, self.out, self.data = settings, out, data
        self.runtime, self.checkpoints, self.report = runtime, checkpoints, report

    def _weights(self, folder: RunFolderWriter) -> str:
        """Writes the last step's weights and, with a validation split, the best epoch's
        (the model after it holds the reported ones); which are reported."""
        runtime, checkpoints = self.runtime, self.checkpoints
        folder.save_weights("final", runtime.model_tensors()["model"], prefix="model.")
        if checkpoints.best is None:
            return "final"
        # Under early stopping the best epoch's are the run's model; otherwise the last
        # step's are, and go back into the model.
        checkpoints.load_best()
        folder.save_weights("best", runtime.model_tensors()["model"], prefix="model.")
        if self.settings.run.early_stop_patience:
            return "best"
        checkpoints.load_latest_model()
        return "final"

    def write(self, p: Progress, evaluate: Evaluate) -> TrainResult:
        """The run folder, ``metrics.json`` and the curves of the run at ``p``; the
        metrics returned with the run directory and the model. ``evaluate`` scores the
        test split when no epoch finished (``--max-steps`` before the first's end)."""
        settings, runtime, data = self.settings, self.runtime, self.data
        patience = settings.run.early_stop_patience
        folder = RunFolderWriter(self.out, main=runtime.is_main)
        reported = self._weights(folder)
        final_epoch = p.best_epoch if (patience and p.best_epoch >= 0) else len(p.epoch_auc) - 1
        # The best epoch is the validation split's choice: without one there is none.
        best_epoch = p.best_epoch + 1 if len(data.val_idx) and p.best_epoch >= 0 else None
        if p.epoch_auc:
            test = {"auc": p.epoch_auc[final_epoch], "logloss": p.epoch_logloss[final_epoch]}
            if len(p.epoch_calibration) == len(p.epoch_auc):  # not a run resumed from older
                test["calibration"] = p.epoch_calibration[final_epoch]
        else:
            test = evaluate(data.test_idx)
        metrics = run_metrics(settings, p, data, runtime, test, final_epoch, best_epoch)
        metrics["weights"] = {
            "default": reported,
            "kept": list(folder.weights),
            "best_epoch": best_epoch if "best" in folder.weights else None,
        }
        if settings.run.row_clip_stats:
            metrics["clip_by_frequency"] = clip_by_frequency(runtime.model, data)
        if runtime.is_main:
            write_text_atomically(
                self.out / "metrics.json", json.dumps(metrics, indent=2, default=str)
            )
            write_curves(self.out, settings, best_epoch, p.stopped_early, self.report.say)
        dataset = data.dataset
        folder.complete(
            describe_model(
                settings.model, settings.record, dataset, metrics, folder.weights, reported
            ),
            lambda encoders: describe_data(
                settings.data, dataset, encoder_writer(dataset)(encoders)
            ),
        )
        self.report.say(
            weights_line(self.out, reported, folder.weights, best_epoch, len(p.epoch_auc))
        )
        said = calibration_line(test.get("calibration"))
        if said is not None:
            self.report.say(said)
        runtime.model.eval()
        return TrainResult(metrics, self.out if runtime.is_main else None, runtime.model)

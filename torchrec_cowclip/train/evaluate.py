"""Test-set metrics: AUC and log-loss, with torchmetrics (exact AUC, no binning), and the
calibration (mean prediction over the observed click rate) with the row counts.

AUC ranks the positives against the negatives: rows of one class have none to rank it
against, and it is undefined there (torchmetrics would answer 0.0 with a warning). It is
then reported as None (``null`` in JSON) with ``auc_note`` saying why
(:func:`auc_or_none`, the one AUC of the trainer, ``evaluate`` and the sweep).

Under ``torch.distributed`` every rank evaluates its share of the rows and torchmetrics
gathers the states across ranks in ``compute()``, so every rank gets the global figures.

Example::

    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> from torchrec.datasets.utils import Batch
    >>> from torchrec_cowclip.models import build_model
    >>> from torchrec_cowclip.models.task import CTRTrainTask
    >>> task = CTRTrainTask(build_model("dcn", num_dense=1, sparse_names=["C1"],
    ...                                 cardinalities=[10], hidden=(4,)))   # or its DMP wrap
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(keys=["C1"], values=torch.tensor([1, 2]),
    ...                                           lengths=torch.tensor([1, 1]))
    >>> test_batches = [Batch(torch.rand(2, 1), kjt, torch.tensor([0.0, 1.0]))]
    >>> metrics = evaluate(task, test_batches, torch.device("cpu"))
    >>> sorted(metrics)
    ['auc', 'calibration', 'ctr', 'logloss', 'mean_prediction', 'positives', 'rows']
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torchmetrics.aggregation import MeanMetric, SumMetric
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch


def auc_or_none(
    auc: BinaryAUROC, rows: int, positives: int
) -> Tuple[Optional[float], Optional[str]]:
    """``(AUC, None)`` of what ``auc`` was updated with, or ``(None, why)`` when the
    ``rows`` labels (``positives`` of them 1) hold one class, or none: AUC is undefined
    there. Under ``torch.distributed`` the counts are the global ones, so every rank
    skips ``compute()`` (a collective) alike.

    Example::

        >>> metric = BinaryAUROC(thresholds=None)
        >>> metric.update(torch.tensor([0.2, 0.9]), torch.tensor([1, 1]))
        >>> auc_or_none(metric, rows=2, positives=2)
        (None, 'AUC is undefined: all 2 labels are 1 (it needs both classes)')
    """
    if rows and 0 < positives < rows:
        return float(auc.compute()), None
    if not rows:
        return None, "AUC is undefined: no rows"
    label = 1 if positives else 0
    return None, f"AUC is undefined: all {rows:,} labels are {label} (it needs both classes)"


@torch.no_grad()
def evaluate(
    task: torch.nn.Module,
    batches: Iterable[Batch],
    device: torch.device,
    on_batch: Optional[Callable[[], None]] = None,
) -> Dict[str, Any]:
    """AUC and mean binary log-loss of a ``CTRTrainTask`` (``task(batch) -> (loss,
    (loss, logits, labels))``) over ``batches``; also ``rows``, ``positives``, the
    ``mean_prediction``, the observed ``ctr`` and their ratio, ``calibration`` (1 for a
    calibrated model; NaN without positives). ``on_batch`` is called after each batch
    (a progress bar). The AUC is None, with ``auc_note`` saying why, where the labels
    hold one class (:func:`auc_or_none`).

    The task is put in eval mode for the pass and restored afterwards. Forward under
    ``no_grad`` leaves fused CowClip tables untouched.
    """
    was_training = task.training
    task.eval()
    auc = BinaryAUROC(thresholds=None).to(device)
    logloss = MeanMetric().to(device)
    # float64 sums: exact counts and a mean prediction free of float32 rounding.
    rows, positives, predicted = (SumMetric().to(device).double() for _ in range(3))
    try:
        for batch in batches:
            _, (_, logits, labels) = task(batch.to(device))
            probabilities = torch.sigmoid(logits)
            auc.update(probabilities, labels.long())
            logloss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))
            rows.update(float(labels.numel()))
            positives.update(labels.double().sum())
            predicted.update(probabilities.double().sum())
            if on_batch is not None:
                on_batch()
    finally:
        task.train(was_training)
    if logloss.update_count == 0 and not torch.distributed.is_initialized():
        raise ValueError("evaluation set is empty")
    n, clicks, mean = float(rows.compute()), float(positives.compute()), float(predicted.compute())
    ctr = clicks / n if n else float("nan")
    value, why = auc_or_none(auc, int(n), int(clicks))
    return {
        "auc": value,
        **({"auc_note": why} if why is not None else {}),
        "logloss": float(logloss.compute()),
        "rows": int(n),
        "positives": int(clicks),
        "mean_prediction": mean / n if n else float("nan"),
        "ctr": ctr,
        "calibration": (mean / n) / ctr if clicks else float("nan"),
    }

"""Test-set metrics: AUC and log-loss, with torchmetrics (exact AUC, no binning).

Example::

    >>> metrics = evaluate(model, batches)   # iterable of torchrec Batch
    >>> metrics["auc"], metrics["logloss"]
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch
import torch.nn.functional as F
from torchmetrics.aggregation import MeanMetric
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device) -> Dict[str, float]:
    """AUC and mean binary log-loss of ``model(dense, sparse) -> logits`` over ``batches``.

    The model is put in eval mode for the pass and restored afterwards. Forward under
    ``no_grad`` leaves fused CowClip tables untouched.
    """
    was_training = model.training
    model.eval()
    auc = BinaryAUROC(thresholds=None).to(device)
    logloss = MeanMetric().to(device)
    seen = 0
    try:
        for batch in batches:
            batch = batch.to(device)
            logits = model(batch.dense_features, batch.sparse_features)
            labels = batch.labels.float()
            auc.update(torch.sigmoid(logits), labels.long())
            logloss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))
            seen += labels.numel()
    finally:
        model.train(was_training)
    if seen == 0:
        raise ValueError("evaluation set is empty")
    return {"auc": float(auc.compute()), "logloss": float(logloss.compute()), "samples": seen}

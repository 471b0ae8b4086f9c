"""Test-set metrics: AUC and log-loss, with torchmetrics (exact AUC, no binning).

Under ``torch.distributed`` every rank evaluates its share of the rows and torchmetrics
gathers the states across ranks in ``compute()``, so every rank gets the global figures.

Example::

    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> from torchrec.datasets.utils import Batch
    >>> from torchrec_cowclip.models import build_model
    >>> from torchrec_cowclip.train.task import CTRTrainTask
    >>> task = CTRTrainTask(build_model("dcn", num_dense=1, sparse_names=["C1"],
    ...                                 cardinalities=[10], hidden=(4,)))   # or its DMP wrap
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(keys=["C1"], values=torch.tensor([1, 2]),
    ...                                           lengths=torch.tensor([1, 1]))
    >>> test_batches = [Batch(torch.rand(2, 1), kjt, torch.tensor([0.0, 1.0]))]
    >>> metrics = evaluate(task, test_batches, torch.device("cpu"))
    >>> sorted(metrics)
    ['auc', 'logloss']
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional

import torch
import torch.nn.functional as F
from torchmetrics.aggregation import MeanMetric
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch


@torch.no_grad()
def evaluate(
    task: torch.nn.Module,
    batches: Iterable[Batch],
    device: torch.device,
    on_batch: Optional[Callable[[], None]] = None,
) -> Dict[str, float]:
    """AUC and mean binary log-loss of a ``CTRTrainTask`` (``task(batch) -> (loss,
    (loss, logits, labels))``) over ``batches``; ``on_batch`` is called after each batch
    (a progress bar).

    The task is put in eval mode for the pass and restored afterwards. Forward under
    ``no_grad`` leaves fused CowClip tables untouched.
    """
    was_training = task.training
    task.eval()
    auc = BinaryAUROC(thresholds=None).to(device)
    logloss = MeanMetric().to(device)
    try:
        for batch in batches:
            _, (_, logits, labels) = task(batch.to(device))
            auc.update(torch.sigmoid(logits), labels.long())
            logloss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))
            if on_batch is not None:
                on_batch()
    finally:
        task.train(was_training)
    if logloss.update_count == 0 and not torch.distributed.is_initialized():
        raise ValueError("evaluation set is empty")
    return {"auc": float(auc.compute()), "logloss": float(logloss.compute())}

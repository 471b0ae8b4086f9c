"""The training task: a CTR model plus its loss, in the shape TorchRec's train pipelines
expect (``model(batch) -> (loss, output)``)."""

from __future__ import annotations

from typing import Tuple

import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.datasets.utils import Batch


class CTRTrainTask(nn.Module):
    """Wraps ``model(dense, sparse) -> logits`` with the mean binary cross-entropy.

    Returns ``(loss, (loss.detach(), logits.detach(), labels))`` so a
    ``TrainPipelineBase``/``TrainPipelineSparseDist`` can drive it.

    Example::

        >>> task = CTRTrainTask(build_model("deepfm", ...))
        >>> loss, (_, logits, labels) = task(batch)
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> Tuple[Tensor, Tuple[Tensor, Tensor, Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features)
        labels = batch.labels.float()
        # The spec's loss: the MEAN over the batch (CowClip's thresholds assume it).
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        return loss, (loss.detach(), logits.detach(), labels)

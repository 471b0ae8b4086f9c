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

        >>> import torch
        >>> from torchrec import KeyedJaggedTensor
        >>> from torchrec.datasets.utils import Batch
        >>> from torchrec_cowclip.models import build_model
        >>> model = build_model("wdl", num_dense=2, sparse_names=["C1"], cardinalities=[100],
        ...                     hidden=(8,))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["C1"], values=torch.arange(4), lengths=torch.ones(4, dtype=torch.int64))
        >>> batch = Batch(dense_features=torch.rand(4, 2), sparse_features=kjt,
        ...               labels=torch.tensor([0.0, 1.0, 0.0, 1.0]))
        >>> task = CTRTrainTask(model)
        >>> loss, (_, logits, labels) = task(batch)
        >>> mean_bce = F.binary_cross_entropy_with_logits(logits, labels)
        >>> logits.shape, bool(torch.isclose(loss, mean_bce))
        (torch.Size([4]), True)
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> Tuple[Tensor, Tuple[Tensor, Tensor, Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features)
        labels = batch.labels.float()
        # docs/algorithm.md's loss: the MEAN over the batch (CowClip's thresholds assume it).
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        return loss, (loss.detach(), logits.detach(), labels)

"""The training step of a run whose tables train with Helen.

TorchRec's train pipelines run one forward and one backward per batch; Helen needs the
forward twice (:meth:`~torchrec_cowclip.CowClipEmbeddingBagCollection.helen_step`). This
pipeline keeps the rest of ``TrainPipelineBase``'s step - next batch, move it to the
device, ``zero_grad``, step the optimizers, return the model's output - and has the
embedding module run the two passes.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Iterator, List, Optional

import torch
from torch import Tensor, nn

from torchrec_cowclip.optim.functional import Helen


class HelenTrainPipeline:
    """``progress(batches)`` as TorchRec's ``TrainPipelineBase``, with Helen's step.

    Args:
        model: returns ``(loss, output)`` for a batch (TorchRec's train-task convention).
        optimizer: the dense + fused optimizers; stepped after the two passes.
        device: where batches go.
        embedding_module: the (possibly sharded) collection built with ``helen=``; its
            ``helen`` says whether the dense parameters are perturbed too.
        dense_params: the dense parameters (perturbed with ``Helen(perturb_dense=True)``).
        data_parallel: the ``DistributedDataParallel`` around the dense part, if any; the
            second pass, which does not reach the dense gradients, then runs under
            ``no_sync()`` so that DDP expects no gradient reduction from it.

    The embedding module's ``last_helen_cost`` has each step's cost.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        embedding_module: Any,
        dense_params: List[Tensor],
        data_parallel: Optional[Any] = None,
    ) -> None:
        self._model, self._optimizer, self._device = model, optimizer, device
        helen: Helen = embedding_module.helen
        self._embedding, self._helen = embedding_module, helen
        self._dense_params, self._ddp = dense_params, data_parallel

    def progress(self, batches: Iterator[Any]) -> Any:
        """One step on the next batch; raises StopIteration when there is none."""
        batch = next(batches).to(self._device, non_blocking=True)
        self._optimizer.zero_grad()
        outputs: List[Any] = []

        def closure() -> Tensor:
            ddp = self._ddp
            skip_sync = bool(outputs) and not self._helen.perturb_dense
            with ddp.no_sync() if skip_sync and ddp is not None else nullcontext():
                losses, output = self._model(batch)
            outputs.append(output)
            return torch.sum(losses, dim=0)

        self._embedding.helen_step(
            closure, dense_params=self._dense_params if self._helen.perturb_dense else None
        )
        self._optimizer.step()
        return outputs[0]

    def detach(self) -> None:
        """Nothing to restore (TorchRec's sparse-dist pipeline rewires forwards; this
        one does not)."""

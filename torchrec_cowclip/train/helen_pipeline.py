"""TorchRec's train pipelines with Helen's two-pass step in place of their backward.

Helen needs the forward twice per batch
(:meth:`~torchrec_cowclip.CowClipEmbeddingBagCollection.helen_step`). These pipelines are
TorchRec's own with one method replaced, ``_backward(losses)``: the pipeline's forward is
Helen's first pass, and the backward runs the second forward of the same batch and both
backwards, then the pipeline steps the optimizer as usual.

* :class:`HelenTrainPipelineSparseDist` (``DistributedModelParallel``): TorchRec's
  ``TrainPipelineSparseDist``, so the next batch's input distribution (its all-to-alls)
  still overlaps the current step. Its sharded modules' pipelined forward keeps the
  current batch's distributed input, so the second forward computes from it again
  instead of asking for a second input distribution.
* :class:`HelenTrainPipelineBase` (one process): TorchRec's ``TrainPipelineBase``.

The second forward does not reach the dense gradients (unless the dense parameters are
perturbed, ``Helen(perturb_dense=True)``), so under DDP it runs in ``no_sync()``. A
pipeline's ``last_helen_cost`` has its last step's cost.

Example (what the trainer does under ``torchrun``)::

    pipeline = HelenTrainPipelineSparseDist(dmp, optimizer, device)
    output = pipeline.progress(batches)   # forward, Helen's two backwards, optimizer step
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.types import NoWait
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_cowclip.compat import (
    dmp_data_parallel,
    pipelined_forward_target,
    use_pipelined_forward,
)
from torchrec_cowclip.embedding.row_updates import HelenCost

__all__ = [
    "HelenPipeline",
    "HelenTrainPipelineBase",
    "HelenTrainPipelineSparseDist",
    "helen_module",
]


def helen_module(model: nn.Module) -> Any:
    """The (sharded or unsharded) CowClip collection in ``model`` built with ``helen=``.

    Raises:
        ValueError: there is none, or more than one.
    """
    found = [m for m in model.modules() if getattr(m, "helen", None) is not None]
    if len(found) != 1:
        raise ValueError(
            f"a Helen train pipeline needs exactly one embedding collection built with "
            f"helen=Helen(...) in the model; it has {len(found)}"
        )
    return found[0]


class HelenPipeline:
    """The backward of a TorchRec pipeline replaced by Helen's two passes (the base of
    both pipelines here). :attr:`last_helen_cost` is the last step's cost."""

    #: The last step's cost (None before the first).
    last_helen_cost: Optional[HelenCost] = None
    #: The pipeline's own context type, if it needs one.
    _context_type: ClassVar[Optional[type]] = None
    #: Whether the pipeline runs ``custom_model_fwd`` (``TrainPipelineBase`` takes it unused).
    _runs_custom_forward: ClassVar[bool] = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        embedding_module: Optional[Any] = None,
        **kwargs: Any,
    ) -> None:
        if self._context_type is not None:
            kwargs["context_type"] = self._context_type
        # The TorchRec pipeline this mixin precedes in the bases takes these.
        super().__init__(model, optimizer, device, **kwargs)  # type: ignore[call-arg]
        forward = kwargs.get("custom_model_fwd") if self._runs_custom_forward else None
        self._init_helen(model, embedding_module, forward)

    def _init_helen(
        self,
        model: nn.Module,
        embedding_module: Optional[Any],
        forward: Optional[Callable[[Any], Tuple[Tensor, Any]]],
    ) -> None:
        self._helen_module = (
            embedding_module if embedding_module is not None else helen_module(model)
        )
        self._helen = self._helen_module.helen
        if self._helen is None:
            raise ValueError("the embedding module was not built with helen=Helen(...)")
        # The pipeline's own forward of a batch: the model, or its custom_model_fwd.
        self._helen_forward = forward if forward is not None else model
        self._dense_params: List[Tensor] = [
            p for _, p in in_backward_optimizer_filter(model.named_parameters()) if p.requires_grad
        ]
        self._data_parallel = dmp_data_parallel(model)

    def _current_batch(self) -> Any:
        raise NotImplementedError

    def _backward(self, losses: Tensor) -> None:
        batch = self._current_batch()
        first_pass = [torch.sum(losses, dim=0)]

        def closure() -> Tensor:
            if first_pass:  # the pipeline's own forward is the first pass
                return first_pass.pop()
            ddp: Any = self._data_parallel
            skip_sync = ddp is not None and not self._helen.perturb_dense
            with ddp.no_sync() if skip_sync else nullcontext():
                second, _ = self._helen_forward(batch)
            return torch.sum(second, dim=0)

        step = self._helen_module.row_updates.helen_step(
            closure, dense_params=self._dense_params if self._helen.perturb_dense else None
        )
        self.last_helen_cost = step.cost


@dataclass
class _HelenPipelineContext(TrainPipelineContext):
    """A batch's pipeline context that also keeps, per sharded module, its module context
    and its distributed input once waited for, for Helen's second forward."""

    distributed_inputs: Dict[str, Tuple[Any, Any]] = field(default_factory=dict)


class _ReplayingPipelinedForward(PipelinedForward):
    """TorchRec's pipelined forward of a sharded module, callable twice per batch: the
    first call waits for the batch's input distribution, as TorchRec's does; the second
    computes from the same distributed input."""

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        context = self.get_context()
        assert isinstance(context, _HelenPipelineContext)  # the Helen pipeline's contexts
        kept = context.distributed_inputs
        module, stream, device = pipelined_forward_target(self)
        if self.name in kept:  # the second forward of this batch
            module_context, data = kept[self.name]
            return module.compute_and_output_dist(module_context, data)
        request = context.input_dist_tensors_requests.get(self.name)
        if request is None:  # TorchRec's forward says what is missing
            return super().__call__(*input, **kwargs)
        with nullcontext() if stream is None else torch.get_device_module(device).stream(stream):
            data = request.wait()
        context.input_dist_tensors_requests[self.name] = NoWait(data)
        kept[self.name] = (context.module_contexts[self.name], data)
        return super().__call__(*input, **kwargs)


class HelenTrainPipelineSparseDist(HelenPipeline, TrainPipelineSparseDist):
    """TorchRec's ``TrainPipelineSparseDist`` with Helen's step (see the module docstring).

    Args:
        model: the ``DistributedModelParallel`` model; returns ``(losses, output)``.
        optimizer: dense + fused optimizers, stepped after the two passes.
        device: where batches go.
        embedding_module: the sharded collection built with ``helen=`` (default: found
            in ``model``).
        **kwargs: ``TrainPipelineSparseDist``'s other arguments.
    """

    _context_type = _HelenPipelineContext

    def _current_batch(self) -> Any:
        return self.batches[0]


use_pipelined_forward(HelenTrainPipelineSparseDist, _ReplayingPipelinedForward)


class HelenTrainPipelineBase(HelenPipeline, TrainPipelineBase):
    """TorchRec's ``TrainPipelineBase`` with Helen's step, for a model in one process
    (arguments as :class:`HelenTrainPipelineSparseDist`'s)."""

    _runs_custom_forward = False
    #: The batch of the step in progress (see :meth:`_wait_for_batch`).
    _batch_in_step: Any = None

    def _wait_for_batch(self, cur_batch: Any) -> None:
        # TrainPipelineBase moves on to the next batch before its backward: keep this one.
        self._batch_in_step = cur_batch
        super()._wait_for_batch(cur_batch)

    def _current_batch(self) -> Any:
        return self._batch_in_step

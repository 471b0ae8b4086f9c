"""The trainer's optimizer: TorchRec's ``CombinedOptimizer`` of the dense Adam (with the
scaling rule's linear warm-up, TorchRec's ``WarmupOptimizer``) and the embeddings'.

With CowClip the embedding part is the collection's fused optimizer (its update already
ran in backward; ``step()`` is a no-op). With the stock ``torchrec`` backend it is a
plain ``torch.optim.Adam`` over the embedding weights with coupled L2 on every row, as
the TF reference does - the baseline CowClip is measured against.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.optim.fused import model_fused_optimizer
from torchrec_cowclip.train.config import OptimizerSettings


def build_optimizer(
    model: nn.Module,
    embedding_collection: Optional[nn.Module],
    settings: OptimizerSettings,
    steps_per_epoch: int,
    fused: Optional[KeyedOptimizer] = None,
) -> CombinedOptimizer:
    """Dense Adam (lr ``settings.dense_lr``, warm-up over ``settings.warmup_epochs``) plus
    the embeddings' optimizer, as one ``CombinedOptimizer`` whose ``state_dict`` holds both:
    a CowClip collection's fused optimizer (built from ``settings.embedding`` with the
    collection), or, for stock tables, Adam with its lr and coupled weight decay.

    ``fused`` is the in-backward optimizer of a sharded model
    (``DistributedModelParallel.fused_optimizer``); its tables are then left out of the
    dense part by TorchRec's ``in_backward_optimizer_filter``.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> from torchrec import KeyedJaggedTensor
        >>> from torchrec_cowclip.models import build_model
        >>> from torchrec_cowclip.train.config import TrainConfig
        >>> model = build_model("deepfm", num_dense=1, sparse_names=["C1"], cardinalities=[10],
        ...                     hidden=(4,))
        >>> settings = TrainConfig(batch_size=4096).resolve().optimizers   # dense lr 1.6e-3
        >>> opt = build_optimizer(model, model.embedding_collection, settings, steps_per_epoch=100)
        >>> sparse = KeyedJaggedTensor.from_lengths_sync(keys=["C1"], values=torch.tensor([1, 2]),
        ...                                              lengths=torch.tensor([1, 1]))
        >>> logits = model(torch.rand(2, 1), sparse)
        >>> F.binary_cross_entropy_with_logits(logits, torch.tensor([0.0, 1.0])).backward()
        >>> opt.step(); opt.zero_grad()
    """
    embedding_ids = (
        {id(p) for p in embedding_collection.parameters()}
        if embedding_collection is not None
        else set()
    )
    dense_params: Dict[str, nn.Parameter] = {}
    embedding_params: Dict[str, nn.Parameter] = {}
    for name, param in in_backward_optimizer_filter(model.named_parameters()):
        if not param.requires_grad:
            continue
        (embedding_params if id(param) in embedding_ids else dense_params)[name] = param

    dense: KeyedOptimizer = KeyedOptimizerWrapper(
        dense_params, lambda params: torch.optim.Adam(params, lr=settings.dense_lr)
    )
    warmup_steps = int(round(settings.warmup_epochs * steps_per_epoch))
    if warmup_steps > 0:
        dense = WarmupOptimizer(
            dense,
            stages=[
                WarmupStage(
                    policy=WarmupPolicy.LINEAR, max_iters=warmup_steps, value=1.0 / warmup_steps
                )
            ],
            lr=settings.dense_lr,
        )
    parts: List[Tuple[str, KeyedOptimizer]] = [("dense", dense)]
    if fused is not None:
        parts.append(("embedding", fused))
    elif isinstance(embedding_collection, CowClipEmbeddingBagCollection):
        # Keyed as DistributedModelParallel keys its fused optimizer: one checkpoint
        # layout for one process and for N.
        parts.append(("embedding", model_fused_optimizer(model)))
    elif embedding_params:
        parts.append(
            (
                "embedding",
                KeyedOptimizerWrapper(
                    embedding_params,
                    lambda params: torch.optim.Adam(
                        params,
                        lr=settings.embedding.lr,
                        weight_decay=settings.embedding.weight_decay,
                    ),
                ),
            )
        )
    return CombinedOptimizer(parts)

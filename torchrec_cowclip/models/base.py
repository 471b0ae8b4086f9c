"""What every CTR model here shares: the parameter split and the first-order part.

The split matters because a CowClip collection trains its tables inside backward: a
dense optimizer that also got those tables would see no gradient for them (harmless)
or, worse, apply weight decay to them a second time. :meth:`CTRModel.dense_parameters`
is the one place that decides what a dense optimizer trains.

Example::

    >>> from torchrec_cowclip.models import build_model
    >>> model = build_model("wdl", num_dense=13, sparse_names=["C1", "C2"], cardinalities=[100, 50])
    >>> tables = {id(p) for p in model.embedding_collection.parameters()}
    >>> len(tables), any(id(p) in tables for p in model.dense_parameters())
    (4, False)
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.modules.mlp import MLP
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.compat import is_fx_symbolic_tracing
from torchrec_cowclip.models.embeddings import DeviceLike, EmbeddingOptions, FieldEmbeddings


def dense_parameters_of(module: nn.Module) -> List[nn.Parameter]:
    """Trainable parameters of ``module`` except those of fused (in-backward) modules.

    A ``FusedOptimizerModule`` (such as :class:`CowClipEmbeddingBagCollection`) updates
    its own parameters during backward, so they are left out; the weights of a stock
    ``torchrec.EmbeddingBagCollection`` are ordinary parameters and are kept.
    """
    fused = {
        id(p)
        for m in module.modules()
        if isinstance(m, FusedOptimizerModule)
        for p in m.parameters()
    }
    return [p for p in module.parameters() if p.requires_grad and id(p) not in fused]


def device_scope(device: DeviceLike) -> ContextManager[object]:
    """Creates dense layers directly on ``device`` (TorchRec's CrossNet takes no device)."""
    return torch.device(device) if device is not None else contextlib.nullcontext()


class CTRModel(nn.Module):
    """Base of the models: ``forward(dense [B, n_dense], sparse KJT) -> logits [B]``.

    Subclasses set ``embedding_collection`` and ``sparse_feature_names`` and implement
    ``forward``; this class supplies :meth:`dense_parameters`.
    """

    num_dense: int
    sparse_feature_names: List[str]

    @property
    def embedding_collection(self) -> EmbeddingBagCollectionInterface:
        """The model's ``EmbeddingBagCollectionInterface`` (CowClip-fused or stock)."""
        raise NotImplementedError

    def dense_parameters(self) -> List[nn.Parameter]:
        """What a dense optimizer must train: everything but fused CowClip tables.

        With the torchrec backend this includes the embedding weights; give them their
        own param group (``model.embedding_collection.parameters()``) for a separate lr.
        """
        return dense_parameters_of(self)

    def _check_inputs(self, dense: Tensor) -> None:
        # TorchRec's TrainPipelineSparseDist FX-traces the model to find its sparse
        # modules; shapes are proxies then, and the check belongs to real runs only.
        if is_fx_symbolic_tracing():
            return
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be [B, {self.num_dense}], got {tuple(dense.shape)}")


class FirstOrderLogit(nn.Module):
    """The reference's linear part: sum of the dim-1 sparse weights, ``w . dense``, bias.

    The bias is the model's single global bias (DeepCTR's prediction layer); the
    deep/cross heads end in bias-free projections, as in the reference.

    Example::

        >>> linear = FirstOrderLogit(num_dense=13)
        >>> linear(torch.rand(4, 2), torch.rand(4, 13)).shape   # [B, F], [B, 13] -> [B]
        torch.Size([4])
    """

    def __init__(self, num_dense: int) -> None:
        super().__init__()
        self.dense: Optional[nn.Linear] = (
            nn.Linear(num_dense, 1, bias=False) if num_dense > 0 else None
        )
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, first_order: Tensor, dense: Tensor) -> Tensor:
        logit = first_order.sum(dim=1) + self.bias
        if self.dense is not None:
            logit = logit + self.dense(dense).squeeze(1)
        return logit


class FieldCTRModel(CTRModel):
    """Shared trunk of DeepFM, Wide&Deep, DCN and DCNv2, on a CowClip (or stock TorchRec)
    embedding collection.

    Owns the field embeddings (dim-``D`` tables clipped by CowClip, dim-1 first-order
    tables not clipped, one collection) and the first-order logit; a model builds its
    heads in :meth:`build_heads` (called inside ``device_scope(device)``, after the
    trunk) and calls :meth:`embed` in its forward.

    Args:
        sparse_names: sparse feature names (the KJT's keys, in any order).
        cardinalities: rows per feature.
        num_dense: dense features (0 for Avazu).
        embedding_dim: D of the clipped tables (paper: 10).
        hidden: DNN layer sizes, ReLU (paper: 400-400-400).
        embedding: backend, in-backward optimizer, CowClip and init of the tables.
        device: where tables and layers live.
    """

    def __init__(
        self,
        sparse_names: Sequence[str],
        cardinalities: Sequence[int],
        num_dense: int,
        embedding_dim: int = 10,
        hidden: Sequence[int] = (400, 400, 400),
        embedding: EmbeddingOptions = EmbeddingOptions(),
        device: DeviceLike = None,
    ) -> None:
        super().__init__()
        if num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {num_dense}")
        self.num_dense = num_dense
        self.embedding_dim = embedding_dim
        self.fields = FieldEmbeddings(
            sparse_names,
            cardinalities,
            embedding_dim,
            embedding,
            with_first_order=True,
            device=device,
        )
        self.sparse_feature_names = list(sparse_names)
        with device_scope(device):
            self.linear = FirstOrderLogit(num_dense)
        with device_scope(device):
            self.build_heads(list(hidden))

    def build_heads(self, hidden: List[int]) -> None:
        """Builds the model's layers over :meth:`embed`'s outputs (``hidden``: the DNN's
        layer sizes); called once, by the constructor."""
        raise NotImplementedError

    @property
    def embedding_collection(self) -> EmbeddingBagCollectionInterface:
        return self.fields.collection

    @property
    def flat_input_size(self) -> int:
        """Width of the DNN / cross input: all field embeddings and the dense values."""
        return len(self.sparse_feature_names) * self.embedding_dim + self.num_dense

    def dnn_tower(self, hidden: Sequence[int]) -> nn.Sequential:
        """The deep part of DeepFM and Wide&Deep: TorchRec's ``MLP`` (ReLU) over the flat
        input, then a bias-free projection to one logit. Build it inside ``device_scope``."""
        hidden = list(hidden)
        return nn.Sequential(
            MLP(self.flat_input_size, hidden, activation="relu"),
            nn.Linear(hidden[-1] if hidden else self.flat_input_size, 1, bias=False),
        )

    def embed(self, dense: Tensor, sparse: KeyedJaggedTensor) -> tuple[Tensor, Tensor]:
        """One collection call: ``(embeddings [B, F, D], first-order logit [B])``."""
        self._check_inputs(dense)
        embeddings, first_order = self.fields(sparse)
        assert first_order is not None
        return embeddings, self.linear(first_order, dense)

    @staticmethod
    def flat_input(embeddings: Tensor, dense: Tensor) -> Tensor:
        """DeepCTR's ``combined_dnn_input``: flattened embeddings then dense values."""
        return torch.cat([embeddings.flatten(1), dense.to(embeddings.dtype)], dim=1)

"""Deep & Cross Network (DCN) and DCNv2 (the reference's DCN-Mix), on TorchRec cross nets.

Both follow the reference (DeepCTR's DCN / DCNMix as LargeBatchCTR's ``train.py``
builds them with ``cross_num=3``):

    x0     = [flattened field embeddings, dense values]
    logit  = first-order (dim-1 sparse weights + ``w . dense`` + bias)
           + bias-free projection of [cross_net(x0), DNN(x0)]

Example::

    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> from torchrec_cowclip.models import DCN, DCNv2
    >>> dcn = DCN(["C1", "C2"], [100, 50], num_dense=13)             # 3 cross layers
    >>> dcn_mix = DCNv2(["C1", "C2"], [100, 50], num_dense=13)       # 3 MoE layers
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id per field
    ...     keys=["C1", "C2"], values=torch.tensor([5, 99, 7, 49]),
    ...     lengths=torch.ones(4, dtype=torch.int64))
    >>> dense = torch.rand(2, 13)
    >>> dcn(dense, kjt).shape, dcn_mix(dense, kjt).shape             # logits [B]
    (torch.Size([2]), torch.Size([2]))
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor, nn
from torchrec.modules.crossnet import CrossNet, LowRankMixtureCrossNet, VectorCrossNet
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.models.base import FieldCTRModel, device_scope
from torchrec_cowclip.models.embeddings import DeviceLike, EmbeddingOptions

CrossParameterization = Literal["vector", "matrix"]


class _DeepAndCross(FieldCTRModel):
    """DCN-style trunk: a cross net and a DNN side by side on the same input."""

    def __init__(
        self,
        sparse_names: Sequence[str],
        cardinalities: Sequence[int],
        num_dense: int,
        embedding_dim: int,
        hidden: Sequence[int],
        embedding: EmbeddingOptions,
        device: DeviceLike,
    ) -> None:
        super().__init__(sparse_names, cardinalities, num_dense, embedding_dim, embedding, device)
        self._hidden = list(hidden)

    def _build_heads(self, cross: nn.Module, device: DeviceLike) -> None:
        self.cross = cross
        with device_scope(device):
            self.deep = MLP(self.flat_input_size, self._hidden, activation="relu")
            stacked = self.flat_input_size + (self._hidden[-1] if self._hidden else 0)
            self.projection = nn.Linear(stacked, 1, bias=False)

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        """``dense [B, num_dense]``, ``sparse`` KJT of :attr:`sparse_feature_names` -> logits ``[B]``."""
        embeddings, linear = self.embed(dense, sparse)
        x0 = self.flat_input(embeddings, dense)
        # Empty `hidden` means cross-only, as in the reference (no identity "DNN" branch).
        parts = [self.cross(x0)] + ([self.deep(x0)] if self._hidden else [])
        cross_deep: Tensor = self.projection(torch.cat(parts, dim=1)).squeeze(1)
        return linear + cross_deep


class DCN(_DeepAndCross):
    """DCN (Wang et al., 2017) on a CowClip (or stock TorchRec) embedding collection.

    Args:
        sparse_names: sparse feature names (the KJT's keys, in any order).
        cardinalities: rows per feature.
        num_dense: dense features (0 for Avazu).
        embedding_dim: D of the clipped tables (paper: 10).
        hidden: DNN layer sizes, ReLU (paper: 400-400-400); empty for cross-only.
        cross_layers: cross layers (paper: 3).
        cross_parameterization: ``"vector"`` - ``x_{l+1} = x0 (x_l . w_l) + b_l + x_l``,
            TorchRec's ``VectorCrossNet``, the original DCN and the default of the
            reference's DeepCTR ``DCN`` (its ``train.py`` does not change it); or
            ``"matrix"`` - ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``, TorchRec's
            ``CrossNet`` (full N x N kernels: 3 x 273^2 = 224k weights on Criteo).
        embedding: backend, in-backward optimizer, CowClip and init of the tables.
        device: where tables and layers live.

    Example::

        >>> model = DCN(["C1"], [100], num_dense=0, hidden=(16,), cross_layers=3,
        ...             cross_parameterization="matrix")
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id each
        ...     keys=["C1"], values=torch.tensor([5, 99]), lengths=torch.ones(2, dtype=torch.int64))
        >>> model(torch.zeros(2, 0), kjt).shape
        torch.Size([2])
    """

    def __init__(
        self,
        sparse_names: Sequence[str],
        cardinalities: Sequence[int],
        num_dense: int,
        embedding_dim: int = 10,
        hidden: Sequence[int] = (400, 400, 400),
        cross_layers: int = 3,
        cross_parameterization: CrossParameterization = "vector",
        embedding: EmbeddingOptions = EmbeddingOptions(),
        device: DeviceLike = None,
    ) -> None:
        if cross_layers < 1:
            raise ValueError(f"cross_layers must be >= 1, got {cross_layers}")
        if cross_parameterization not in ("vector", "matrix"):
            raise ValueError(
                "cross_parameterization must be 'vector' or 'matrix', "
                f"got {cross_parameterization!r}"
            )
        super().__init__(
            sparse_names, cardinalities, num_dense, embedding_dim, hidden, embedding, device
        )
        net = VectorCrossNet if cross_parameterization == "vector" else CrossNet
        with device_scope(device):
            cross = net(in_features=self.flat_input_size, num_layers=cross_layers)
        self._build_heads(cross, device)


class DCNv2(_DeepAndCross):
    """DCNv2 / DCN-Mix (Wang et al., 2021): low-rank mixture-of-experts cross layers.

    The cross net is TorchRec's ``LowRankMixtureCrossNet`` with ``tanh`` in the low-rank
    space, which is what the reference's ``CrossNetMix`` uses (TorchRec defaults to
    ReLU); the gates, the ``U (N x r)``, ``C (r x r)``, ``V (r x N)`` kernels per expert
    and the softmax over experts match it term for term.

    Args:
        sparse_names: sparse feature names (the KJT's keys, in any order).
        cardinalities: rows per feature.
        num_dense: dense features (0 for Avazu).
        embedding_dim: D of the clipped tables (paper: 10).
        hidden: DNN layer sizes, ReLU (paper: 400-400-400); empty for cross-only.
        cross_layers: mixture cross layers (paper: 3).
        low_rank: r of each expert (reference default 32).
        num_experts: experts per layer (reference default 4).
        embedding: backend, in-backward optimizer, CowClip and init of the tables.
        device: where tables and layers live.

    Example::

        >>> model = DCNv2(["C1"], [100], num_dense=2, hidden=(16,), low_rank=4)
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id each
        ...     keys=["C1"], values=torch.tensor([5, 99]), lengths=torch.ones(2, dtype=torch.int64))
        >>> model(torch.rand(2, 2), kjt).shape
        torch.Size([2])
    """

    def __init__(
        self,
        sparse_names: Sequence[str],
        cardinalities: Sequence[int],
        num_dense: int,
        embedding_dim: int = 10,
        hidden: Sequence[int] = (400, 400, 400),
        cross_layers: int = 3,
        low_rank: int = 32,
        num_experts: int = 4,
        embedding: EmbeddingOptions = EmbeddingOptions(),
        device: DeviceLike = None,
    ) -> None:
        if cross_layers < 1 or low_rank < 1 or num_experts < 1:
            raise ValueError(
                "cross_layers, low_rank and num_experts must be >= 1, got "
                f"{cross_layers}, {low_rank}, {num_experts}"
            )
        super().__init__(
            sparse_names, cardinalities, num_dense, embedding_dim, hidden, embedding, device
        )
        with device_scope(device):
            cross = LowRankMixtureCrossNet(
                in_features=self.flat_input_size,
                num_layers=cross_layers,
                num_experts=num_experts,
                low_rank=low_rank,
                activation=torch.tanh,
            )
        self._build_heads(cross, device)

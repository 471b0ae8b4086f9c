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

from typing import Any, List, Literal

import torch
from torch import Tensor, nn
from torchrec.modules.crossnet import CrossNet, LowRankMixtureCrossNet, VectorCrossNet
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.models.base import FieldCTRModel

CrossParameterization = Literal["vector", "matrix"]


class _DeepAndCross(FieldCTRModel):
    """DCN-style trunk: a cross net (:meth:`cross_net`) and a DNN side by side on the same
    input; empty ``hidden`` means cross-only, as in the reference (no identity "DNN"
    branch). The models' own arguments are set before the trunk builds the heads."""

    def cross_net(self) -> nn.Module:
        raise NotImplementedError

    def build_heads(self, hidden: List[int]) -> None:
        self._hidden = hidden
        self.cross = self.cross_net()
        self.deep = MLP(self.flat_input_size, hidden, activation="relu")
        stacked = self.flat_input_size + (hidden[-1] if hidden else 0)
        self.projection = nn.Linear(stacked, 1, bias=False)

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        """``dense [B, num_dense]``, ``sparse`` KJT of :attr:`sparse_feature_names` -> logits ``[B]``."""
        embeddings, linear = self.embed(dense, sparse)
        x0 = self.flat_input(embeddings, dense)
        parts = [self.cross(x0)] + ([self.deep(x0)] if self._hidden else [])
        cross_deep: Tensor = self.projection(torch.cat(parts, dim=1)).squeeze(1)
        return linear + cross_deep


class DCN(_DeepAndCross):
    """DCN (Wang et al., 2017) on a CowClip (or stock TorchRec) embedding collection.

    Arguments as :class:`~torchrec_cowclip.models.base.FieldCTRModel`'s (``hidden`` empty
    for cross-only), and:

    Args:
        cross_layers: cross layers (paper: 3).
        cross_parameterization: ``"vector"`` - ``x_{l+1} = x0 (x_l . w_l) + b_l + x_l``,
            TorchRec's ``VectorCrossNet``, the original DCN and the default of the
            reference's DeepCTR ``DCN`` (its ``train.py`` does not change it); or
            ``"matrix"`` - ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``, TorchRec's
            ``CrossNet`` (full N x N kernels: 3 x 273^2 = 224k weights on Criteo).

    Example::

        >>> model = DCN(["C1"], [100], num_dense=0, hidden=(16,), cross_layers=3,
        ...             cross_parameterization="matrix")
        >>> sum(p.numel() for p in model.cross.parameters())  # 3 x (10^2 + 10), N = 10
        330
    """

    def __init__(
        self,
        *args: Any,
        cross_layers: int = 3,
        cross_parameterization: CrossParameterization = "vector",
        **kwargs: Any,
    ) -> None:
        if cross_layers < 1:
            raise ValueError(f"cross_layers must be >= 1, got {cross_layers}")
        if cross_parameterization not in ("vector", "matrix"):
            raise ValueError(
                "cross_parameterization must be 'vector' or 'matrix', "
                f"got {cross_parameterization!r}"
            )
        self._cross = (cross_layers, cross_parameterization)
        super().__init__(*args, **kwargs)

    def cross_net(self) -> nn.Module:
        layers, parameterization = self._cross
        net = VectorCrossNet if parameterization == "vector" else CrossNet
        return net(in_features=self.flat_input_size, num_layers=layers)


class DCNv2(_DeepAndCross):
    """DCNv2 / DCN-Mix (Wang et al., 2021): low-rank mixture-of-experts cross layers.

    The cross net is TorchRec's ``LowRankMixtureCrossNet`` with ``tanh`` in the low-rank
    space, which is what the reference's ``CrossNetMix`` uses (TorchRec defaults to
    ReLU); the gates, the ``U (N x r)``, ``C (r x r)``, ``V (r x N)`` kernels per expert
    and the softmax over experts match it term for term.

    Arguments as :class:`~torchrec_cowclip.models.base.FieldCTRModel`'s (``hidden`` empty
    for cross-only), and:

    Args:
        cross_layers: mixture cross layers (paper: 3).
        low_rank: r of each expert (reference default 32).
        num_experts: experts per layer (reference default 4).

    Example::

        >>> model = DCNv2(["C1"], [100], num_dense=2, hidden=(16,), low_rank=4)
        >>> type(model.cross).__name__, model.flat_input_size   # 10 embedding + 2 dense
        ('LowRankMixtureCrossNet', 12)
    """

    def __init__(
        self,
        *args: Any,
        cross_layers: int = 3,
        low_rank: int = 32,
        num_experts: int = 4,
        **kwargs: Any,
    ) -> None:
        if cross_layers < 1 or low_rank < 1 or num_experts < 1:
            raise ValueError(
                "cross_layers, low_rank and num_experts must be >= 1, got "
                f"{cross_layers}, {low_rank}, {num_experts}"
            )
        self._mixture = (cross_layers, low_rank, num_experts)
        super().__init__(*args, **kwargs)

    def cross_net(self) -> nn.Module:
        layers, low_rank, num_experts = self._mixture
        return LowRankMixtureCrossNet(
            in_features=self.flat_input_size,
            num_layers=layers,
            num_experts=num_experts,
            low_rank=low_rank,
            activation=torch.tanh,
        )

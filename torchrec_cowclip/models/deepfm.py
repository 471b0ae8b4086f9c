"""DeepFM (Guo et al., 2017) as the CowClip reference trains it.

logit = first-order (dim-1 sparse weights + ``w . dense`` + bias)
      + FM second-order term over the field embeddings
      + DNN over [flattened field embeddings, dense values] -> bias-free projection.

Example::

    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> from torchrec_cowclip import CowClipOptions
    >>> from torchrec_cowclip.models import DeepFM, EmbeddingOptions
    >>> model = DeepFM(sparse_names=["C1", "C2"], cardinalities=[100, 50], num_dense=13,
    ...                embedding=EmbeddingOptions(training=CowClipOptions(lr=1e-4)))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id per field
    ...     keys=["C1", "C2"], values=torch.tensor([5, 99, 7, 49]),
    ...     lengths=torch.ones(4, dtype=torch.int64))
    >>> model(torch.rand(2, 13), kjt).shape     # logits [B]
    torch.Size([2])
"""

from __future__ import annotations

from typing import List

from torch import Tensor
from torchrec.modules.deepfm import DeepFM as TorchRecDeepFM
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.models.base import FieldCTRModel


def fm_second_order(embeddings: Tensor) -> Tensor:
    """FM pairwise term ``sum_{i<j} <v_i, v_j>`` of ``[B, F, D]`` field embeddings -> ``[B]``.

    Computed as ``0.5 * sum_d ((sum_i v_id)^2 - sum_i v_id^2)``, linear in F.

    ``torchrec.modules.deepfm.FactorizationMachine`` is not used: it flattens its input
    to ``[B, F * D]`` and applies the identity to the flat vector, i.e. it treats every
    scalar as its own one-dim factor and also multiplies different dims (and dims of the
    same field) together. That equals the paper's ``<v_i, v_j>`` only when D == 1.

    Example::

        >>> import torch
        >>> v = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])   # <v_0, v_1> = 11
        >>> fm_second_order(v)
        tensor([11.])
    """
    square_of_sum = embeddings.sum(dim=1).pow(2)
    sum_of_squares = embeddings.pow(2).sum(dim=1)
    return 0.5 * (square_of_sum - sum_of_squares).sum(dim=1)


class DeepFM(FieldCTRModel):
    """DeepFM on a CowClip (or stock TorchRec) embedding collection.

    Arguments as :class:`~torchrec_cowclip.models.base.FieldCTRModel`'s.

    Example::

        >>> import torch
        >>> from torchrec import KeyedJaggedTensor
        >>> model = DeepFM(["C1", "C2"], [100, 50], num_dense=0, hidden=(32, 32))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id per field
        ...     keys=["C1", "C2"], values=torch.tensor([5, 99, 7, 49]),
        ...     lengths=torch.ones(4, dtype=torch.int64))
        >>> model(torch.zeros(2, 0), kjt).shape
        torch.Size([2])
    """

    def build_heads(self, hidden: List[int]) -> None:
        # TorchRec's DeepFM module is exactly the reference's deep component: flatten and
        # concatenate the [B, n, d] inputs, then the dense module.
        self.deep = TorchRecDeepFM(dense_module=self.dnn_tower(hidden))

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        """``dense [B, num_dense]``, ``sparse`` KJT of :attr:`sparse_feature_names` -> logits ``[B]``."""
        embeddings, logit = self.embed(dense, sparse)
        deep: Tensor = self.deep([embeddings, dense.to(embeddings.dtype).unsqueeze(2)]).squeeze(1)
        return logit + fm_second_order(embeddings) + deep

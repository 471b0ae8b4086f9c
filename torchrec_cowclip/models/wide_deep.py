"""Wide & Deep (Cheng et al., 2016) as the CowClip reference ("WD", DeepCTR's WDL) trains it.

logit = wide part (dim-1 sparse weights + ``w . dense`` + bias)
      + DNN over [flattened field embeddings, dense values] -> bias-free projection.

Example::

    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> from torchrec_cowclip.models import WideAndDeep
    >>> model = WideAndDeep(["C1", "C2"], [100, 50], num_dense=13)
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id per field
    ...     keys=["C1", "C2"], values=torch.tensor([5, 99, 7, 49]),
    ...     lengths=torch.ones(4, dtype=torch.int64))
    >>> model(torch.rand(2, 13), kjt).shape     # logits [B]
    torch.Size([2])
"""

from __future__ import annotations

from typing import List

from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.models.base import FieldCTRModel


class WideAndDeep(FieldCTRModel):
    """Wide & Deep on a CowClip (or stock TorchRec) embedding collection.

    The wide part is the first-order (dim-1, unclipped) tables plus a linear term on
    the dense features, as in the reference, which feeds the same raw features to both
    parts and uses no hand-made cross features.

    Arguments as :class:`~torchrec_cowclip.models.base.FieldCTRModel`'s.

    Example::

        >>> import torch
        >>> from torchrec import KeyedJaggedTensor
        >>> model = WideAndDeep(["C1"], [100], num_dense=2, hidden=(16,))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id each
        ...     keys=["C1"], values=torch.tensor([5, 99]), lengths=torch.ones(2, dtype=torch.int64))
        >>> model(torch.rand(2, 2), kjt).shape
        torch.Size([2])
    """

    def build_heads(self, hidden: List[int]) -> None:
        self.deep = self.dnn_tower(hidden)

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        """``dense [B, num_dense]``, ``sparse`` KJT of :attr:`sparse_feature_names` -> logits ``[B]``."""
        embeddings, wide = self.embed(dense, sparse)
        deep: Tensor = self.deep(self.flat_input(embeddings, dense)).squeeze(1)
        return wide + deep

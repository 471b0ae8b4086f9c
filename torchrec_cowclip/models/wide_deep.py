"""Wide & Deep (Cheng et al., 2016) as the CowClip reference ("WD", DeepCTR's WDL) trains it.

logit = wide part (dim-1 sparse weights + ``w . dense`` + bias)
      + DNN over [flattened field embeddings, dense values] -> bias-free projection.

Example::

    >>> from torchrec_cowclip.models import WideAndDeep
    >>> model = WideAndDeep(["C1", "C2"], [100, 50], num_dense=13)
    >>> logits = model(dense, kjt)              # [B]
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.models.base import FieldCTRModel, device_scope
from torchrec_cowclip.models.embeddings import DeviceLike, EmbeddingOptions


class WideAndDeep(FieldCTRModel):
    """Wide & Deep on a CowClip (or stock TorchRec) embedding collection.

    The wide part is the first-order (dim-1, unclipped) tables plus a linear term on
    the dense features, as in the reference, which feeds the same raw features to both
    parts and uses no hand-made cross features.

    Args:
        sparse_names: sparse feature names (the KJT's keys, in any order).
        cardinalities: rows per feature.
        num_dense: dense features (0 for Avazu).
        embedding_dim: D of the clipped tables (spec: 10).
        hidden: DNN layer sizes, ReLU (spec: 400-400-400).
        embedding: backend, in-backward optimizer, CowClip and init of the tables.
        device: where tables and layers live.

    Example::

        >>> model = WideAndDeep(["C1"], [100], num_dense=2, hidden=(16,))
        >>> model(torch.rand(4, 2), kjt).shape
        torch.Size([4])
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
        super().__init__(sparse_names, cardinalities, num_dense, embedding_dim, embedding, device)
        with device_scope(device):
            self.deep = self.dnn_tower(hidden)

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        """``dense [B, num_dense]``, ``sparse`` KJT of :attr:`sparse_feature_names` -> logits ``[B]``."""
        embeddings, wide = self.embed(dense, sparse)
        deep = self.deep(self.flat_input(embeddings, dense)).squeeze(1)
        return wide + deep

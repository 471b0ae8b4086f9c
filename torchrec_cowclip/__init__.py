"""torchrec_cowclip: CowClip (Zheng et al., AAAI 2023) for TorchRec embeddings.

Example::

    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection
    >>> ebc = CowClipEmbeddingBagCollection(
    ...     tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000,
    ...                                feature_names=["f0"])],
    ...     optimizer="adam", lr=1e-4, cowclip=CowClip(r=1.0, zeta=1e-5))
"""

from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.embedding.table_batch import TableClipStats
from torchrec_cowclip.optim.functional import CountLR, CowClip
from torchrec_cowclip.optim.fused import CowClipFusedOptimizer

__all__ = [
    "CountLR",
    "CowClip",
    "CowClipEmbeddingBagCollection",
    "CowClipFusedOptimizer",
    "TableClipStats",
]
__version__ = "0.1.0"

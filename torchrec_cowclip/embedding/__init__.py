"""Table-batched embedding storage, lookup and the fused in-backward CowClip update."""

from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.embedding.table_batch import TableClipStats

__all__ = ["CowClipEmbeddingBagCollection", "TableClipStats"]

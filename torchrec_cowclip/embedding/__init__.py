"""Table-batched embedding storage, lookup and the fused in-backward CowClip update.

The collection and its statistics (built on torchrec types) load on first use, so
its torch-only modules (``embedding.native``) import without torchrec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrec_cowclip._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
    from torchrec_cowclip.embedding.table_batch import TableClipStats

_LAZY = {
    "CowClipEmbeddingBagCollection": "torchrec_cowclip.embedding.collection",
    "TableClipStats": "torchrec_cowclip.embedding.table_batch",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__all__ = ["CowClipEmbeddingBagCollection", "TableClipStats"]

"""torchrec_cowclip: CowClip (Zheng et al., AAAI 2023) for TorchRec embeddings.

Example::

    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection, CowClipOptions
    >>> options = CowClipOptions(optimizer="adam", lr=1e-4, cowclip=CowClip(r=1.0, zeta=1e-5))
    >>> ebc = CowClipEmbeddingBagCollection(
    ...     tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000,
    ...                                feature_names=["f0"])],
    ...     options=options)
    >>> ebc.options == options
    True

The names built on TorchRec types load on first use (module ``__getattr__``), so the
torch-only core (``torchrec_cowclip.optim.functional``, ``optim.reference``,
``optim.row_step``) imports on a machine without torchrec or fbgemm_gpu.
"""

from __future__ import annotations

__all__ = [
    "CountLR",
    "CowClip",
    "CowClipEmbeddingBagCollection",
    "CowClipFusedOptimizer",
    "CowClipOptions",
    "Helen",
    "Predictor",
    "TableClipStats",
    "load_model",
    "quantization_mapping",
    "quantize_embeddings",
]

from typing import TYPE_CHECKING

from torchrec_cowclip._lazy import lazy_exports
from torchrec_cowclip._version import __version__ as __version__
from torchrec_cowclip.optim.options import CountLR, CowClip, CowClipOptions, Helen

if TYPE_CHECKING:
    from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
    from torchrec_cowclip.embedding.quantization import quantization_mapping, quantize_embeddings
    from torchrec_cowclip.embedding.table_batch import TableClipStats
    from torchrec_cowclip.optim.fused import CowClipFusedOptimizer
    from torchrec_cowclip.serve.predictor import Predictor, load_model

# Public name -> the module that defines it; each needs torchrec.
_LAZY = {
    "CowClipEmbeddingBagCollection": "torchrec_cowclip.embedding.collection",
    "CowClipFusedOptimizer": "torchrec_cowclip.optim.fused",
    "TableClipStats": "torchrec_cowclip.embedding.table_batch",
    "load_model": "torchrec_cowclip.serve.predictor",
    "quantization_mapping": "torchrec_cowclip.embedding.quantization",
    "quantize_embeddings": "torchrec_cowclip.embedding.quantization",
    "Predictor": "torchrec_cowclip.serve.predictor",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

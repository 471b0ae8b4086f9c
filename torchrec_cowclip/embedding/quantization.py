"""TorchRec's quantization of a CowClip collection: the qconfig guard that refuses to let
``torchrec.inference.modules.quantize_embeddings`` pass the collection over in float32,
and the mapping and call that quantize it as a stock ``EmbeddingBagCollection``.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec_cowclip import CowClipEmbeddingBagCollection
    >>> ebc = CowClipEmbeddingBagCollection(tables=[EmbeddingBagConfig(
    ...     name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"])])
    >>> model = quantize_embeddings(nn.Sequential(ebc), torch.qint8)
    >>> type(model[0]).__module__, model[0].embedding_bag_configs()[0].data_type.name
    ('torchrec.quant.embedding_modules', 'INT8')
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_cowclip.compat import qconfig_propagation

__all__ = ["QconfigGuard", "quantization_mapping", "quantize_embeddings"]

_MISSING = object()
#: The collection classes that hold a :class:`QconfigGuard` (their quantized form is
#: TorchRec's quantized ``EmbeddingBagCollection``).
_GUARDED: List[type] = []


class QconfigGuard:
    """A collection's ``qconfig``: the one torch's quantization gave it, while it has one.

    TorchRec's ``quantize_embeddings`` swaps the modules whose exact type its mapping
    names; without :func:`quantization_mapping` among its ``additional_mapping`` the
    collection would stay float32 without a word, so reading ``qconfig`` during that
    propagation refuses then, in one line (see :func:`quantize_embeddings`).
    """

    def __set_name__(self, owner: type, name: str) -> None:
        _GUARDED.append(owner)

    def __get__(self, module: Optional[nn.Module], owner: type) -> Any:
        if module is None:
            return self
        if "_qconfig" in module.__dict__:
            return module.__dict__["_qconfig"]
        running = qconfig_propagation()
        if running is not None:
            spec, name = running
            if type(module) not in spec and EmbeddingBagCollection in spec:
                raise TypeError(
                    f"quantize_embeddings would leave {type(module).__name__} "
                    f"'{name or 'the model'}' in float32 (TorchRec quantizes the types its "
                    "mapping names): call torchrec_cowclip.quantize_embeddings(model, dtype, "
                    "inplace=True), or pass additional_qconfig_spec_keys="
                    "[CowClipEmbeddingBagCollection] and additional_mapping="
                    "torchrec_cowclip.quantization_mapping()"
                )
        raise AttributeError("qconfig")

    def __set__(self, module: nn.Module, value: Any) -> None:
        module.__dict__["_qconfig"] = value

    def __delete__(self, module: nn.Module) -> None:
        if module.__dict__.pop("_qconfig", _MISSING) is _MISSING:
            raise AttributeError("qconfig")


def quantization_mapping() -> dict[type, type]:
    """TorchRec's quantization mapping for this collection: its quantized
    ``torchrec.quant.EmbeddingBagCollection``, which ``from_float`` builds from the
    collection's table configs and ``state_dict`` as from a stock EBC's (the same keys).
    Pass it as ``additional_mapping`` (and its keys as ``additional_qconfig_spec_keys``) of
    ``torchrec.inference.modules.quantize_embeddings``."""
    from torchrec.quant.embedding_modules import (
        EmbeddingBagCollection as QuantEmbeddingBagCollection,
    )

    return {collection: QuantEmbeddingBagCollection for collection in _GUARDED}


def quantize_embeddings(
    module: nn.Module,
    dtype: torch.dtype,
    inplace: bool = True,
    **options: Any,
) -> nn.Module:
    """``torchrec.inference.modules.quantize_embeddings`` with this package's collection
    quantized as a stock ``EmbeddingBagCollection`` is (``options``: TorchRec's
    ``output_dtype``, ``per_table_weight_dtype``, ``additional_qconfig_spec_keys``,
    ``additional_mapping``)."""
    from torchrec.inference.modules import quantize_embeddings as torchrec_quantize

    mapping = {**quantization_mapping(), **options.pop("additional_mapping", {})}
    keys = [*options.pop("additional_qconfig_spec_keys", []), *quantization_mapping()]
    quantized: nn.Module = torchrec_quantize(
        module,
        dtype=dtype,
        inplace=inplace,
        additional_qconfig_spec_keys=keys,
        additional_mapping=mapping,
        **options,
    )
    return quantized

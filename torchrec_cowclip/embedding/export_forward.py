"""The forward ``torch.export`` traces of a CowClip collection: each table's pooled lookup
read from its own parameter (``embedding_bags.<table>.weight``) with aten's
``embedding_bag``, as a stock ``EmbeddingBagCollection`` computes it, so the program
holds the tables as its state and runs without this package or the live module (the
training forward's op reaches the tables through a handle to the module: it is for
training only). Half tables pool in float32, as the training forward does.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_cowclip.embedding.local_tables import LocalTables

__all__ = ["exported_pooling"]


def exported_pooling(
    tables: LocalTables,
    weight_of: Callable[[str], Tensor],
    features: KeyedJaggedTensor,
    is_weighted: bool,
) -> KeyedTensor:
    """The pooled embeddings of ``features`` from ``tables`` (``weight_of``: a table's
    weight by name), under the tables' embedding names."""
    by_feature = features.to_dict()
    pooled: list[Tensor] = []
    for table in tables.configs:
        weight = weight_of(table.name)
        for feature in table.feature_names:
            bags = by_feature[feature]
            offsets = bags.offsets()
            sample_weights = bags.weights_or_none() if is_weighted else None
            mean = table.pooling == PoolingType.MEAN
            out = torch.nn.functional.embedding_bag(
                bags.values(),
                weight,
                offsets,
                mode="mean" if mean and sample_weights is None else "sum",
                per_sample_weights=None
                if sample_weights is None
                else sample_weights.to(weight.dtype),
                include_last_offset=True,
            ).to(torch.float32)
            if mean and sample_weights is not None:
                # Weighted MEAN pools sum(w * x) / len, as FBGEMM's TBE does.
                lengths = (offsets[1:] - offsets[:-1]).clamp_min(1)
                out = out / lengths.unsqueeze(1).to(out.dtype)
            pooled.append(out)
    return tables.keyed(torch.cat(pooled, dim=1))

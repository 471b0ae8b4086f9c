"""Sharded CowClip training on TorchRec: a sharder for ``DistributedModelParallel``.

Example::

    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec_cowclip import CowClip
    from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder

    sharder = CowClipEmbeddingBagCollectionSharder(
        optimizer="adam", lr=1e-4, weight_decay=2e-5, cowclip=CowClip(r=1.0, zeta=3.2e-5))
    dmp = DistributedModelParallel(model, sharders=[sharder], plan=plan,
                                   env=ShardingEnv.from_process_group(pg), device=device)
    loss = dmp(batch).mean()       # each rank: the mean loss of its local batch
    loss.backward()                # embedding tables updated here (global-batch CowClip)
    dense_optimizer.step()

Supported sharding types: table_wise, column_wise, table_column_wise, row_wise,
table_row_wise, data_parallel.
"""

from torchrec_cowclip.distributed.comm import CollectiveError
from torchrec_cowclip.distributed.options import CowClipOptions
from torchrec_cowclip.distributed.sharded_collection import (
    SUPPORTED_SHARDING_TYPES,
    ShardedCowClipEmbeddingBagCollection,
)
from torchrec_cowclip.distributed.sharder import CowClipEmbeddingBagCollectionSharder

__all__ = [
    "CollectiveError",
    "CowClipEmbeddingBagCollectionSharder",
    "CowClipOptions",
    "SUPPORTED_SHARDING_TYPES",
    "ShardedCowClipEmbeddingBagCollection",
]

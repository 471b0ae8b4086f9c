"""Sharded CowClip training on TorchRec: sharders for ``DistributedModelParallel``.

Example::

    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
    from torchrec.distributed import DistributedModelParallel
    from torchrec_cowclip import CowClip
    from torchrec_cowclip.distributed import get_default_sharders

    sharders = get_default_sharders(fused_params={
        "optimizer": EmbOptimType.ADAM, "learning_rate": 1e-4,
        "weight_decay": 2e-5, "weight_decay_mode": WeightDecayMode.L2,
        "cowclip": CowClip(r=1.0, zeta=3.2e-5)})
    dmp = DistributedModelParallel(model, sharders=sharders, device=device)
    loss = dmp(batch).mean()       # each rank: the mean loss of its local batch
    loss.backward()                # embedding tables updated here (global-batch CowClip)
    dense_optimizer.step()

Supported sharding types: table_wise, column_wise, table_column_wise, row_wise,
table_row_wise, data_parallel.
"""

from torchrec_cowclip import compat
from torchrec_cowclip.distributed.comm import CollectiveError
from torchrec_cowclip.distributed.sharded_collection import (
    SUPPORTED_SHARDING_TYPES,
    ShardedCowClipEmbeddingBagCollection,
)
from torchrec_cowclip.distributed.sharder import (
    CowClipEmbeddingBagCollectionSharder,
    get_default_sharders,
)

# Before any process group exists (this package is imported at the top of a script that
# shards): torch modules first imported after init_process_group would keep the default
# group, and its gloo threads, alive past destroy_process_group (compat's accessor says
# why that aborts a process at exit).
compat.import_modules_holding_the_default_group()

__all__ = [
    "CollectiveError",
    "CowClipEmbeddingBagCollectionSharder",
    "SUPPORTED_SHARDING_TYPES",
    "ShardedCowClipEmbeddingBagCollection",
    "get_default_sharders",
]

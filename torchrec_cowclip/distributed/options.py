"""The CowClip training options a sharded collection is built with.

One frozen :class:`~torchrec_cowclip.optim.options.CowClipOptions` travels from the sharder
to every sharded kernel, so that all shards of all tables of a module step with the same
rule. For a :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection` the options are read
from the module itself (:meth:`CowClipOptions.from_module`): sharding it keeps its
optimizer, hyperparameters and unclipped tables. This module adds what TorchRec's planner
needs to size the optimizer state.
"""

from __future__ import annotations

from typing import Dict, Type

import torch
import torchrec.optim as torchrec_optim

from torchrec_cowclip.optim.options import CowClipOptions

__all__ = ["PLANNER_OPTIMIZER_CLASS", "CowClipOptions"]

#: The torch/TorchRec optimizer class whose state size TorchRec's planner knows for each
#: update rule: Adam keeps two values per weight, row-wise Adagrad one per row, SGD none.
PLANNER_OPTIMIZER_CLASS: Dict[str, Type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "rowwise_adagrad": torchrec_optim.RowWiseAdagrad,
    "sgd": torch.optim.SGD,
}

"""The CowClip training options a sharded collection is built with.

One frozen :class:`~torchrec_cowclip.optim.options.CowClipOptions` travels from the sharder
to every sharded kernel, so that all shards of all tables of a module step with the same
rule. The sharder merges them from every place that says how the tables train
(:mod:`torchrec_cowclip.optim.torchrec_config`); a
:class:`~torchrec_cowclip.CowClipEmbeddingBagCollection` brings its own
(:attr:`~torchrec_cowclip.CowClipEmbeddingBagCollection.options`). This module adds what
TorchRec's planner needs to size the optimizer state.
"""

from __future__ import annotations

import importlib
from typing import Mapping, Type

import torch

from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.rules import RuleView

__all__ = ["PLANNER_OPTIMIZER_CLASS", "CowClipOptions"]


def _optimizer_class(path: str) -> Type[torch.optim.Optimizer]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


#: The torch/TorchRec optimizer class whose state size TorchRec's planner knows for each
#: registered update rule (``UpdateRule.planner_optimizer``, a live view): Adam keeps two
#: values per weight, row-wise Adagrad one per row, SGD none.
PLANNER_OPTIMIZER_CLASS: Mapping[str, Type[torch.optim.Optimizer]] = RuleView(
    lambda rule: _optimizer_class(rule.planner_optimizer)
)

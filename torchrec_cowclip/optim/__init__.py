"""The CowClip math (functional core), its dense reference, and the fused optimizer handle.

``CowClipFusedOptimizer`` (a torchrec ``FusedOptimizer``) loads on first use, so the
functional core imports without torchrec.
"""

from __future__ import annotations

__all__ = [
    "OPTIMIZERS",
    "CountLR",
    "CowClip",
    "CowClipAdam",
    "CowClipFusedOptimizer",
    "CowClipOptions",
    "CowClipRowWiseAdagrad",
    "CowClipSGD",
    "Helen",
    "UpdateRule",
    "cowclip_clip",
    "cowclip_row_update_",
    "register_update_rule",
]

from typing import TYPE_CHECKING

from torchrec_cowclip._lazy import lazy_exports
from torchrec_cowclip.optim.functional import cowclip_clip, cowclip_row_update_
from torchrec_cowclip.optim.in_backward import CowClipAdam, CowClipRowWiseAdagrad, CowClipSGD
from torchrec_cowclip.optim.options import CountLR, CowClip, CowClipOptions, Helen
from torchrec_cowclip.optim.rules import OPTIMIZERS, UpdateRule, register_update_rule

if TYPE_CHECKING:
    from torchrec_cowclip.optim.fused import CowClipFusedOptimizer

_LAZY = {"CowClipFusedOptimizer": "torchrec_cowclip.optim.fused"}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

"""The CowClip math (functional core), its dense reference, and the fused optimizer handle."""

from torchrec_cowclip.optim.functional import (
    OPTIMIZERS,
    CountLR,
    CowClip,
    UpdateRule,
    cowclip_clip,
    cowclip_row_update_,
    register_update_rule,
)
from torchrec_cowclip.optim.fused import CowClipFusedOptimizer

__all__ = [
    "OPTIMIZERS",
    "CountLR",
    "CowClip",
    "CowClipFusedOptimizer",
    "UpdateRule",
    "cowclip_clip",
    "cowclip_row_update_",
    "register_update_rule",
]

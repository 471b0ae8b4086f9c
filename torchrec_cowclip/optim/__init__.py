"""The CowClip math (functional core), its dense reference, and the fused optimizer handle."""

from torchrec_cowclip.optim.functional import (
    OPTIMIZERS,
    CountLR,
    CowClip,
    cowclip_clip,
    cowclip_row_update_,
)
from torchrec_cowclip.optim.fused import CowClipFusedOptimizer

__all__ = ["OPTIMIZERS", "CountLR", "CowClip", "cowclip_clip", "cowclip_row_update_", "CowClipFusedOptimizer"]

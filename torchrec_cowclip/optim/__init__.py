"""The CowClip math (functional core), its dense reference, and the fused optimizer handle."""

from torchrec_cowclip.optim.functional import OPTIMIZERS, CowClip, cowclip_clip, cowclip_row_update_
from torchrec_cowclip.optim.fused import CowClipFusedOptimizer

__all__ = ["OPTIMIZERS", "CowClip", "cowclip_clip", "cowclip_row_update_", "CowClipFusedOptimizer"]

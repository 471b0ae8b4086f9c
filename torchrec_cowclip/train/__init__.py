"""Training: the config resolved once, the scaling rule, the optimizers, the loop and its
evaluation, the metrics; the ``train`` command's flags. What a run leaves on disk is
:mod:`torchrec_cowclip.run`'s.

``train(config)`` (:func:`torchrec_cowclip.train.start.train`) and ``TrainResult`` load on
first use: importing the config alone does not build the loop."""

__all__ = [
    "ConfigError",
    "TrainConfig",
    "TrainResult",
    "ScaledHyperparameters",
    "scale_hyperparameters",
    "train",
]

from typing import TYPE_CHECKING

from torchrec_cowclip._lazy import lazy_exports
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.train.config import TrainConfig
from torchrec_cowclip.train.scaling import ScaledHyperparameters, scale_hyperparameters

if TYPE_CHECKING:
    from torchrec_cowclip.train.metrics import TrainResult
    from torchrec_cowclip.train.start import train

_LAZY = {"TrainResult": "torchrec_cowclip.train.metrics", "train": "torchrec_cowclip.train.start"}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

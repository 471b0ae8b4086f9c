"""Training: the scaling rule, optimizers, the loop, checkpoints, metrics and the CLI."""

from typing import Any, Dict

from torchrec_cowclip.train.config import ConfigError, TrainConfig
from torchrec_cowclip.train.scaling import ScaledHyperparameters, scale_hyperparameters


def train(config: TrainConfig) -> Dict[str, Any]:
    """Runs a training run; see :func:`torchrec_cowclip.train.trainer.train`."""
    from torchrec_cowclip.train.trainer import train as _train

    return _train(config)


__all__ = ["ConfigError", "TrainConfig", "ScaledHyperparameters", "scale_hyperparameters", "train"]

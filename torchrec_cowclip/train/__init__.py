"""Training: the scaling rule, optimizers, the loop, checkpoints, metrics and the CLI."""

from torchrec_cowclip.train.config import ConfigError, TrainConfig
from torchrec_cowclip.train.result import TrainResult
from torchrec_cowclip.train.scaling import ScaledHyperparameters, scale_hyperparameters


def train(config: TrainConfig) -> TrainResult:
    """Runs a training run; see :func:`torchrec_cowclip.train.trainer.train`."""
    from torchrec_cowclip.train.trainer import train as _train

    return _train(config)


__all__ = [
    "ConfigError",
    "TrainConfig",
    "TrainResult",
    "ScaledHyperparameters",
    "scale_hyperparameters",
    "train",
]

"""What :func:`~torchrec_cowclip.train.train` returns: the metrics, and where the model is.

A :class:`TrainResult` is the metrics dict that ``out/metrics.json`` holds (so
``result["auc"]`` reads as it always has) with the run directory and the trained model
attached: ``result.run_dir`` is what ``torchrec_cowclip.load_model`` scores with, and
``result.model`` the trained ``nn.Module`` itself (this process's part of it when the run
was sharded).

Example::

    >>> result = TrainResult({"auc": 0.75}, run_dir="runs/x", model=None)
    >>> result["auc"], result.metrics == {"auc": 0.75}, str(result.run_dir)
    (0.75, True, 'runs/x')
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from torch import nn


class TrainResult(Dict[str, Any]):
    """The run's metrics (a dict, as ``metrics.json``) plus ``run_dir`` and ``model``.

    Attributes:
        run_dir: the run's ``--out``; its ``model/`` is the self-contained run folder
            (None if the run wrote none: another rank's result).
        model: the trained model (the reported weights: the best epoch's under early
            stopping), on the training device, in eval mode.
    """

    def __init__(
        self,
        metrics: Mapping[str, Any],
        run_dir: Optional[Union[str, Path]],
        model: Optional[nn.Module],
    ) -> None:
        super().__init__(metrics)
        self.run_dir: Optional[Path] = None if run_dir is None else Path(run_dir)
        self.model = model

    @property
    def metrics(self) -> Dict[str, Any]:
        """The metrics alone, as a plain dict."""
        return dict(self)

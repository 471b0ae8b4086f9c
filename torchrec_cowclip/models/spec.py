"""The model a run trains, as its options give it: the factory's name and every argument
that does not come from the data (which gives the features and the table sizes).

The trainer builds its model from a :class:`ModelSpec` and a schema, and a run folder keeps
:meth:`ModelSpec.arguments` to build the same model again, with no training option.

Example::

    >>> from torchrec_cowclip.data import Schema
    >>> spec = ModelSpec("deepfm", embedding_dim=4, hidden=(8,), init_seed=0)
    >>> schema = Schema(dense_names=["I1"], sparse_names=["C1"], cardinalities=[10])
    >>> spec.arguments(schema, num_dense=1)["cardinalities"]
    [10]
    >>> type(spec.build(schema, num_dense=1)).__name__
    'DeepFM'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from torchrec_cowclip.models.base import CTRModel
from torchrec_cowclip.models.embeddings import DeviceLike
from torchrec_cowclip.optim.options import CowClipOptions


@dataclass(frozen=True)
class ModelSpec:
    """``build_model(name, **arguments)`` but for the data's part (see the module docstring).

    Attributes:
        init_seed: the tables' counter-based initial weights (the run's ``--seed``).
    """

    name: str = "deepfm"
    embedding_dim: int = 10
    hidden: Tuple[int, ...] = (400, 400, 400)
    cross_layers: int = 3
    init_std: float = 1e-2
    embedding_backend: str = "cowclip"
    embedding_dtype: str = "fp32"
    init_seed: Optional[int] = None

    def arguments(self, schema: Any, num_dense: int) -> Dict[str, Any]:
        """The factory's arguments for ``schema``, the training-only ones aside (what a run
        folder rebuilds the model from); ``num_dense`` counts the dense plan's inputs (the
        columns and any missing-value indicators)."""
        return {
            "num_dense": int(num_dense),
            "sparse_names": list(schema.sparse_names),
            "cardinalities": list(schema.cardinalities),
            "embedding_dim": self.embedding_dim,
            "hidden": list(self.hidden),
            "cross_layers": self.cross_layers,
            "init_std": self.init_std,
            "embedding_backend": self.embedding_backend,
            "embedding_dtype": self.embedding_dtype,
            "init_seed": self.init_seed,
        }

    def build(
        self,
        schema: Any,
        num_dense: int,
        embedding_options: Optional[CowClipOptions] = None,
        device: DeviceLike = None,
        table_device: DeviceLike = None,
    ) -> CTRModel:
        """The model for ``schema``, its tables trained by ``embedding_options``."""
        from torchrec_cowclip.models import build_model

        return build_model(
            self.name,
            **self.arguments(schema, num_dense),
            embedding_options=embedding_options,
            device=device,
            table_device=table_device,
        )

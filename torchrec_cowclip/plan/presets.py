"""The table sets ``torchrec-cowclip plan --tables`` knows by name: the public per-feature
cardinalities of the two Criteo click logs (cited where they are defined,
:mod:`torchrec_cowclip.data.schema`).

Example::

    >>> kaggle = PRESETS["criteo-kaggle"]
    >>> kaggle.schema.n_sparse, f"{sum(kaggle.schema.cardinalities):,}", kaggle.schema.n_dense
    (26, '33,762,577', 13)
    >>> f"{sum(PRESETS['criteo-1tb'].schema.cardinalities):,}"
    '177,944,275'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from torchrec_cowclip.data.schema import (
    CRITEO_1TB_CARDINALITIES,
    CRITEO_DENSE_NAMES,
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_SPARSE_NAMES,
    Schema,
)

__all__ = ["PRESETS", "TablePreset"]


@dataclass(frozen=True)
class TablePreset:
    """A named table set: the dataset's features and table sizes, where the sizes come
    from, and the ``--data`` a training job on that dataset reads (for the launch
    command a plan prints; the path is the user's to replace).

    Attributes:
        name: the ``--tables`` value.
        schema: dense names, sparse names and their cardinalities.
        source: where the cardinalities are published.
        data: the ``train --data`` of the dataset, with a placeholder path.
    """

    name: str
    schema: Schema
    source: str
    data: str


PRESETS: Dict[str, TablePreset] = {
    p.name: p
    for p in (
        TablePreset(
            "criteo-kaggle",
            Schema(CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, CRITEO_KAGGLE_CARDINALITIES),
            "Criteo Kaggle train.txt (45.8M rows): the distinct values of C1..C26, as "
            "published with DLRM's Kaggle benchmark",
            "criteo:train.txt",
        ),
        TablePreset(
            "criteo-1tb",
            Schema(CRITEO_DENSE_NAMES, CRITEO_SPARSE_NAMES, CRITEO_1TB_CARDINALITIES),
            "Criteo 1TB click logs (24 days, 4.4B rows): the distinct values of C1..C26 "
            "as TorchRec's DLRM example publishes them (facebookresearch/dlrm, "
            "torchrec_dlrm/README.MD)",
            "criteo-npy:criteo_1tb_contiguous",
        ),
    )
}

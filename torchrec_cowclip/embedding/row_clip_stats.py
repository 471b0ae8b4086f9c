"""How often the clip bound, by how frequent an id is.

CowClip's threshold is ``c_j * max(r * ||W[j]||, zeta)``: whether it binds depends on a
row's norm and on how often its id occurs, so the paper's argument is about rare ids
versus frequent ones. :func:`clip_rates_by_frequency` groups the per-row counts of
:meth:`CowClipEmbeddingBagCollection.row_clip_counts` by each id's frequency in the data
(its number of occurrences, which the caller counts, e.g. over the training split).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Sequence, Tuple

import torch
from torch import Tensor

#: Lower edges of the default buckets: ids seen once, 2-10, 11-100, 101-1000, >1000 times.
DEFAULT_EDGES: Tuple[int, ...] = (1, 2, 11, 101, 1001)


@dataclass
class FrequencyBucket:
    """Clip counts of the ids whose frequency lies in ``[low, high]`` (``high`` -1: no bound).

    ``ids`` counts the ids of the bucket, ``rows_updated`` the (row, step) updates of those
    ids, ``rows_clipped`` the updates that clipped; ``clip_rate`` their ratio (0 if none).
    """

    low: int
    high: int
    ids: int
    rows_updated: int
    rows_clipped: int

    @property
    def clip_rate(self) -> float:
        return self.rows_clipped / self.rows_updated if self.rows_updated else 0.0

    def as_dict(self) -> Dict[str, float]:
        return {**asdict(self), "clip_rate": self.clip_rate}


def clip_rates_by_frequency(
    row_counts: Mapping[str, Tuple[Tensor, Tensor]],
    id_frequency: Mapping[str, Tensor],
    edges: Sequence[int] = DEFAULT_EDGES,
) -> List[FrequencyBucket]:
    """Sums updated and clipped counts over the tables in ``id_frequency``, per bucket.

    Args:
        row_counts: per table, ``(updated, clipped)`` per row (``row_clip_counts()``).
        id_frequency: per table to include, each row's number of occurrences in the data,
            ``[num_embeddings]``. Tables not listed (e.g. unclipped first-order tables)
            are left out.
        edges: increasing lower edges of the buckets; ids below ``edges[0]`` (never seen)
            are left out.

    Example::

        >>> counts = {"t": (torch.tensor([3, 1, 0]), torch.tensor([0, 1, 0]))}
        >>> freq = {"t": torch.tensor([50, 1, 0])}
        >>> [(b.low, b.rows_updated, b.rows_clipped) for b in clip_rates_by_frequency(counts, freq, (1, 2))]
        [(1, 1, 1), (2, 3, 0)]
    """
    if list(edges) != sorted(set(edges)) or not edges:
        raise ValueError(f"edges must be a non-empty increasing sequence, got {list(edges)}")
    buckets = [FrequencyBucket(low, -1, 0, 0, 0) for low in edges]
    for i in range(len(edges) - 1):
        buckets[i].high = edges[i + 1] - 1
    boundaries = torch.tensor(list(edges), dtype=torch.int64)
    for table, frequency in id_frequency.items():
        if table not in row_counts:
            raise KeyError(f"no row clip counts for table {table!r}; have {sorted(row_counts)}")
        updated, clipped = (t.detach().to("cpu", torch.int64) for t in row_counts[table])
        frequency = torch.as_tensor(frequency, dtype=torch.int64)
        if frequency.shape != updated.shape:
            raise ValueError(
                f"table {table!r}: {frequency.numel()} id frequencies for {updated.numel()} rows"
            )
        bucket = torch.bucketize(frequency, boundaries, right=True) - 1  # -1: below edges[0]
        seen = bucket >= 0
        n = len(edges)
        ids = torch.bincount(bucket[seen], minlength=n)
        upd = torch.bincount(bucket[seen], weights=updated[seen].double(), minlength=n)
        clp = torch.bincount(bucket[seen], weights=clipped[seen].double(), minlength=n)
        for k in range(n):
            buckets[k].ids += int(ids[k])
            buckets[k].rows_updated += int(upd[k])
            buckets[k].rows_clipped += int(clp[k])
    return buckets

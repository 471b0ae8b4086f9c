"""What the fused update did: per table (rows updated, clipped, skipped as non-finite; the
last step and in total) and, on request, per row (steps that updated and that clipped it).

The counts live in the table batches (``TableBatch.counters``, ``row_counters``), written
by the update inside backward; :class:`ClipCounters` is their one reader and writer for a
collection: statistics, the checkpoint forms (loads check everything before changing
anything) and the reset.

Example::

    >>> import torch
    >>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    >>> from torchrec_cowclip import CowClipEmbeddingBagCollection, CowClipOptions
    >>> ebc = CowClipEmbeddingBagCollection(
    ...     [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
    ...     CowClipOptions(cowclip=None))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["f"], values=torch.tensor([1, 2, 2]), lengths=torch.tensor([2, 1]))
    >>> ebc(kjt).values().sum().backward()
    >>> counters = ebc.clip_counters
    >>> counters.stats()["t"].total_rows_updated, counters.table_counters()["t"].tolist()
    (2, [2, 0, 0, 2, 0, 0])
    >>> counters.reset(); counters.stats()["t"].total_rows_updated
    0
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.embedding.table_batch import TableBatch, TableClipStats
from torchrec_cowclip.optim.load_check import check_loadable

__all__ = ["ClipCounters"]


class ClipCounters:
    """The clip counters of a collection's table batches.

    Args:
        batches: the collection's table batches.
        table_names: its tables, in the collection's order (the order results come in).
    """

    def __init__(self, batches: Sequence[TableBatch], table_names: Sequence[str]) -> None:
        self._batches = list(batches)
        self._tables = list(table_names)

    def stats(self) -> Dict[str, TableClipStats]:
        """Per table: rows updated, clipped and skipped as non-finite, for the last
        step and cumulatively. Reading them synchronises with the device."""
        stats: Dict[str, TableClipStats] = {}
        for batch in self._batches:
            stats.update(batch.stats())
        return {name: stats[name] for name in self._tables}

    def table_counters(self) -> Dict[str, Tensor]:
        """Per table, its ``[6]`` int64 counters (``COUNTER_NAMES`` order): the layout
        checkpoints keep for unsharded and sharded modules alike."""
        return {
            name: batch.counters[:, i].clone()
            for batch in self._batches
            for i, name in enumerate(batch.table_names)
        }

    def load_table_counters(self, counters: Mapping[str, Tensor]) -> None:
        """Restores :meth:`table_counters` (a sharded module's too); everything is
        checked before any counter is copied."""
        if set(counters) != set(self._tables):
            raise ValueError(
                f"clip counters are for tables {sorted(counters)}, this module has "
                f"{sorted(self._tables)}"
            )
        check_loadable(dict(counters), self.table_counters(), "clip counters")
        for batch in self._batches:
            for i, name in enumerate(batch.table_names):
                batch.counters[:, i] = counters[name].to(batch.counters.device)

    def state(self) -> List[Tensor]:
        """Every table batch's counters as they are stored (a copy)."""
        return [batch.counters.clone() for batch in self._batches]

    def load_state(self, counters: List[Tensor]) -> None:
        """Restores :meth:`state` (all checked first)."""
        check_loadable(list(counters), [b.counters for b in self._batches], "clip counters")
        for batch, saved in zip(self._batches, counters):
            batch.counters.copy_(saved)

    def track_rows(self, enabled: bool = True) -> None:
        """Starts (or stops) counting, for every row of every table, how many steps
        updated it and how many of those clipped its gradient (:meth:`row_counts`).

        It costs two int64 counters per row and two ``index_add_`` per step; the counts
        start at zero, and :meth:`row_state` saves them (the trainer's checkpoints do, so
        ``--resume`` keeps them). Use it to see *which* rows the clip binds on, e.g. by id
        frequency (:func:`~torchrec_cowclip.embedding.row_clip_stats.clip_rates_by_frequency`).
        """
        for batch in self._batches:
            if not enabled:
                batch.row_counters = None
            elif batch.row_counters is None:
                batch.row_counters = torch.zeros(
                    2, batch.weight.shape[0], dtype=torch.int64, device=batch.weight.device
                )

    def row_counts(self) -> Dict[str, Tuple[Tensor, Tensor]]:
        """Per table, ``(updated, clipped)``: ``[num_embeddings]`` int64 counts of the
        steps that updated each row and of those that clipped it, since
        :meth:`track_rows` (or the last :meth:`reset`).

        Raises:
            RuntimeError: :meth:`track_rows` was not called.
        """
        counts: Dict[str, Tuple[Tensor, Tensor]] = {}
        for batch in self._batches:
            if batch.row_counters is None:
                raise RuntimeError(
                    "row clip counts are off: call track_row_clips() before training"
                )
            for i, name in enumerate(batch.table_names):
                lo, hi = batch.row_offsets_list[i], batch.row_offsets_list[i + 1]
                counts[name] = (batch.row_counters[0, lo:hi], batch.row_counters[1, lo:hi])
        return {name: counts[name] for name in self._tables}

    def row_state(self) -> Optional[List[Tensor]]:
        """The per-row counters of :meth:`track_rows`, for checkpoints; None when off."""
        counters = [batch.row_counters for batch in self._batches]
        if any(c is None for c in counters):
            return None
        return [c.clone() for c in counters if c is not None]

    def load_row_state(self, counters: List[Tensor]) -> None:
        """Turns per-row counting on and restores :meth:`row_state`."""
        shapes = [(2, batch.weight.shape[0]) for batch in self._batches]
        got = [tuple(c.shape) for c in counters]
        if got != shapes:
            raise ValueError(f"row clip counters: expected shapes {shapes}, got {got}")
        self.track_rows()
        for batch, saved in zip(self._batches, counters):
            assert batch.row_counters is not None  # track_rows() allocated them
            batch.row_counters.copy_(saved)

    def reset(self) -> None:
        """Zeroes all counters (the step counts, which are optimizer state, stay)."""
        for batch in self._batches:
            batch.reset_stats()
            if batch.row_counters is not None:
                batch.row_counters.zero_()

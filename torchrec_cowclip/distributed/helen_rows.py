"""Helen's two-pass step on a sharded collection: what the driver
(:mod:`torchrec_cowclip.embedding.helen`) needs of its lookups.

Each lookup's step is held (:class:`~.deferred_update.HeldStep`) instead of applied, in
both passes. After the first pass the held steps yield the gradients the rows are
perturbed along (a data-parallel replica's: the union of all replicas', so replicas stay
identical); each table's ``||G||_F**2`` and largest count are summed and maxed over every
rank (row shards hold disjoint rows, column shards disjoint columns of the same rows, and
one replica stands for all), so every shard is perturbed as the unsharded table would be
on the global batch. After the second pass the held steps are applied as a plain
backward would have applied them, in lookup order, the same on every rank.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from torchrec_cowclip.distributed.deferred_update import DeferredUpdates, HeldStep
from torchrec_cowclip.embedding.helen import HeldRows, HelenPass, HelenTarget, TablePositions


class ShardedHelenRows(HelenTarget):
    """:class:`~torchrec_cowclip.embedding.helen.HelenTarget` of a sharded collection.

    Args:
        updates: returns the deferred updates of the module's lookups, in lookup order
            (the same list on every rank).
        table_names: every table of the module, in one order on every rank.
        pg: the process group of the whole module (every rank holding a shard).
        device: where this rank's shards live.
    """

    def __init__(
        self,
        updates: Callable[[], List[DeferredUpdates]],
        table_names: Sequence[str],
        pg: Optional[dist.ProcessGroup],
        device: torch.device,
    ) -> None:
        self._updates = updates
        self._positions = TablePositions(table_names)
        self._pg = pg
        self._device = device
        self._phase: Optional[HelenPass] = None
        self._descent_steps: List[HeldStep] = []

    def hold(self, phase: Optional[HelenPass]) -> None:
        self._phase = phase
        for updates in self._updates():
            updates.held = [] if phase is not None else None

    def held(self) -> List[HeldRows]:
        rows: List[HeldRows] = []
        self._descent_steps = []
        for lookup_index, updates in enumerate(self._updates()):
            for step_index, step in enumerate(updates.held or []):
                if self._phase is HelenPass.ASCENT:
                    along = step.sync.perturbation_rows(step.submissions)
                else:
                    along = [(sub.row_grads, True) for sub in step.submissions]
                    self._descent_steps.append(step)
                for sub, (row_grads, counted) in zip(step.submissions, along):
                    rows.append(
                        HeldRows(
                            key=(lookup_index, step_index, *sub.key),
                            batch=sub.batch,
                            row_grads=row_grads,
                            table_index=self._positions.of_batch(sub.batch),
                            counts_in_norm=counted,
                            local_rows=sub.row_grads.rows,
                        )
                    )
        return rows

    def backward_inputs(self) -> List[Tensor]:
        return [updates.leaf for updates in self._updates()]

    def num_tables(self) -> int:
        return len(self._positions)

    def device(self) -> torch.device:
        return self._device

    def reduce_table_statistics(self, sq_norm: Tensor, max_count: Tensor) -> None:
        dist.all_reduce(sq_norm, op=dist.ReduceOp.SUM, group=self._pg)
        dist.all_reduce(max_count, op=dist.ReduceOp.MAX, group=self._pg)

    def apply_updates(self, descent: List[HeldRows]) -> None:
        steps, self._descent_steps = self._descent_steps, []
        for step in steps:
            step.sync.apply(step.submissions)

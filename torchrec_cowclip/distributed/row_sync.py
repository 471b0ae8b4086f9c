"""How a sharded lookup's submissions become row updates, per sharding type: the
strategies (:class:`~torchrec_cowclip.embedding.row_updates.RowSync`) of the row-update
coordinator (:mod:`torchrec_cowclip.embedding.row_updates`) that talk to other ranks.

A TorchRec lookup runs several kernels (one per group of tables of the same pooling);
each kernel's backward yields the row gradients of its table batches. Column-sharded
and data-parallel tables must then talk to other ranks (:mod:`.comm`), and a rank's
kernels differ from its peers' (they hold different tables), so if each kernel talked
from its own backward, two ranks could enter their collectives in different orders.
Instead the kernels only submit their row gradients to the lookup's step, which the
coordinator takes once all are in (one autograd node per lookup forward runs after
them) and hands to the lookup's strategy, in one order on every rank.

Rules per sharding type:

* table-wise, row-wise (:class:`~torchrec_cowclip.embedding.row_updates.LocalRows`): the
  owning rank has the whole rows and, after TorchRec's input all-to-all, every occurrence
  in the global batch: the unsharded update as is;
* column-wise (:class:`ColumnShardRows`): the same update, with the finiteness, the
  clip norms and row-wise Adagrad's ``mean(g**2)`` taken over the whole rows, summed
  across the shards;
* data-parallel (:class:`ReplicatedRows`): every replica applies the update of the union
  of all replicas' rows, counts summed and gradients averaged (summed when TorchRec's
  gradient division is off) - the convention TorchRec applies to sharded tables and DDP
  to dense parameters, so a model whose ranks each minimise their local mean loss
  trains on the gradient of the global mean loss.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torchrec.distributed.comm_ops import get_gradient_division

from torchrec_cowclip.distributed.comm import ColumnShardGroups, all_gather_row_gradients
from torchrec_cowclip.embedding.row_gradients import RowGradients, aggregate_row_gradients
from torchrec_cowclip.embedding.row_updates import RowSync, Submission
from torchrec_cowclip.embedding.table_batch import TableBatch
from torchrec_cowclip.optim.functional import RowSums, partial_row_sums


class ColumnShardRows(RowSync):
    """Column-wise tables: whole-row sums across the shards, then the update per shard.

    Every shard of a table sees the same ids (TorchRec's input dist sends a table's
    features to each of its column shards), so its distinct rows are identical, in the
    same (ascending) order, on every shard; the shards' per-row partial sums add up.
    """

    def __init__(self, groups: ColumnShardGroups) -> None:
        self._groups = groups

    def apply(self, submissions: List[Submission]) -> None:
        partials: Dict[str, Tensor] = {}
        for sub in submissions:
            rows, grad = sub.row_grads.rows, sub.row_grads.grad
            # In the update's float32, also for half tables.
            weight = sub.batch.weight.index_select(0, rows).to(grad.dtype)
            part = partial_row_sums(grad, weight)
            for name, segment in zip(sub.batch.table_names, _table_segments(sub.batch, rows, part)):
                if name not in partials:
                    partials[name] = segment
                elif partials[name].shape != segment.shape:
                    raise RuntimeError(
                        f"two column shards of table '{name}' on this rank saw different "
                        f"rows ({partials[name].shape[0]} vs {segment.shape[0]})"
                    )
                else:
                    # Several shards of one table on this rank: add them up before the
                    # ranks do.
                    partials[name] = partials[name] + segment
        totals = self._groups.all_reduce_by_table(partials)
        for sub in submissions:
            rows = sub.row_grads.rows
            # Tables are ascending row ranges of the batch, so their totals in table
            # order line up with the rows (a table's shards each get the table's total).
            sums = torch.cat([totals[name] for name in sub.batch.table_names])
            assert sub.whole_dims is not None  # the kernels of column shards submit them
            dims = sub.whole_dims[sub.batch.table_of_rows(rows)]
            sub.batch.kernel.update_(
                sub.batch, sub.row_grads, sub.options, RowSums.from_sums(sums, dims)
            )


def _table_segments(batch: TableBatch, rows: Tensor, per_row: Tensor) -> List[Tensor]:
    """``per_row`` split into the batch's tables (rows are ascending, tables are ranges)."""
    bounds = torch.searchsorted(rows, batch.row_offsets).tolist()
    return [per_row[bounds[i] : bounds[i + 1]] for i in range(batch.num_tables)]


class ReplicatedRows(RowSync):
    """Data-parallel tables: every replica applies the update of all replicas' union."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self._pg = pg

    def apply(self, submissions: List[Submission]) -> None:
        if not submissions:
            return
        gathered = all_gather_row_gradients([s.row_grads for s in submissions], self._pg)
        world = dist.get_world_size(self._pg)
        scale = 1.0 / world if get_gradient_division() else 1.0
        for sub, per_rank in zip(submissions, gathered):
            sub.batch.kernel.update_(sub.batch, union_row_gradients(per_rank, scale), sub.options)

    def perturbation_rows(self, submissions: List[Submission]) -> List[Tuple[RowGradients, bool]]:
        """The union of all replicas' rows (as the update uses), so that every replica
        perturbs alike; rank 0 alone counts it towards the table's norm."""
        if not submissions:
            return []
        gathered = all_gather_row_gradients([s.row_grads for s in submissions], self._pg)
        scale = 1.0 / dist.get_world_size(self._pg) if get_gradient_division() else 1.0
        first = dist.get_rank(self._pg) == 0
        return [(union_row_gradients(per_rank, scale), first) for per_rank in gathered]


def union_row_gradients(per_rank: List[RowGradients], scale: float = 1.0) -> RowGradients:
    """One :class:`RowGradients` for the rows of all ranks: counts summed, gradients
    summed times ``scale``.

    The sum runs in rank order through the same sorted segment sum as the unsharded
    backward, so every replica computes bit-identical updates and the replicas never
    drift apart.
    """
    rows = torch.cat([p.rows for p in per_rank])
    grad = torch.cat([p.grad for p in per_rank])
    counts = torch.cat([p.counts for p in per_rank])
    position = torch.arange(rows.numel(), device=rows.device)
    union = aggregate_row_gradients(rows, grad.contiguous(), position)
    union_counts = torch.zeros_like(union.rows).index_add_(
        0, torch.searchsorted(union.rows, rows), counts
    )
    if scale != 1.0:
        union.grad.mul_(scale)
    return RowGradients(rows=union.rows, counts=union_counts, grad=union.grad)

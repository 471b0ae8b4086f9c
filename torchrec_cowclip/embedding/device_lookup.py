"""A lookup's forward and backward that read no value back to the host: the Triton path.

:class:`~.batched_lookup.BatchedLookup` slices a KJT per table batch and checks its ids
with a few host reads - free on a CPU, a synchronisation each on a GPU, and impossible
inside a CUDA graph. With a row kernel that is ``sync_free`` (the Triton kernels) and no
Helen step, it runs this path instead, which works on the whole KJT with positions as
they are (absolute):

* forward: one launch maps every id to its table batch's row and checks it against its
  feature (:func:`~.triton_ops.prepare_rows`), then one launch per table batch pools its
  features' bags straight into the batch-major ``[B, F * D]`` output
  (:func:`~.triton_ops.pool_into`);
* backward: per slot, a grouping of fixed size (:func:`~.row_gradients.group_rows_padded`:
  the positions of other slots sort last and form no row) and, per table batch, the fused
  update over it (:func:`~.triton_ops.fused_update_padded_`).

The flags of the checks are read once per forward and once per update - never while a
CUDA graph is being captured: there the kernels still write nothing a bad input would
corrupt, and the errors surface at the next uncaptured call. The errors are the sliced
path's, word for word (an error re-runs its checks to name the feature, table and sample).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import PoolingType

from torchrec_cowclip.embedding import triton_ops
from torchrec_cowclip.embedding.row_gradients import RowGrouping, group_rows_padded
from torchrec_cowclip.embedding.table_batch import TableBatch

__all__ = ["DeviceLookup"]


class DeviceLookup:
    """The device-side layout of one lookup: per feature of its KJT (in the lookup's
    order) the first row and row count in its table batch, and per slot and batch size
    the gradient row of each bag (cached).

    Args:
        slot_batches: the first table batch of each slot.
        feature_starts: ``[slots + 1]`` index of each slot's first feature.
    """

    def __init__(self, slot_batches: Sequence[TableBatch], feature_starts: Sequence[int]) -> None:
        self._slot_batches = list(slot_batches)
        self._starts = list(feature_starts)
        self._rows_list = [
            (row, rows)
            for batch in self._slot_batches
            for row, rows in zip(batch.feature_row_offset_list, batch.feature_num_rows_list)
        ]
        self._cache: Dict[Tuple[str, int, int], Tensor] = {}
        self.feature_rows = torch.zeros(0)
        self.to(slot_batches[0].weight.device)

    def to(self, device: torch.device) -> None:
        """Rebuilds the device tensors on ``device``."""
        self.feature_rows = torch.tensor(self._rows_list, dtype=torch.int64, device=device).view(
            -1, 2
        )
        self._cache = {}

    @property
    def num_features(self) -> int:
        return self._starts[-1]

    def batch_size(self, offsets: Tensor) -> int:
        return (offsets.numel() - 1) // max(self.num_features, 1)

    def bags(self, slot: int, batch_size: int) -> Tuple[int, int]:
        """The slot's bags, ``[first, end)``, in the KJT's (feature-major) bag order."""
        return self._starts[slot] * batch_size, self._starts[slot + 1] * batch_size

    def bag_rows(self, slot: int, batch_size: int) -> Tensor:
        """``[F * B]``: the row of each bag of the slot in the ``[B * F_s, D]`` view of
        its pooled output's gradient (0 for the other slots' bags); device ops only."""
        key = ("bag_rows", slot, batch_size)
        if key not in self._cache:
            first, end = self.bags(slot, batch_size)
            width = self._starts[slot + 1] - self._starts[slot]
            device = self.feature_rows.device
            rows = torch.zeros(self.num_features * batch_size, dtype=torch.int64, device=device)
            bag = torch.arange(end - first, device=device)
            rows[first:end] = (bag % batch_size) * width + bag // batch_size
            self._cache[key] = rows
        return self._cache[key]

    # --- forward -------------------------------------------------------------------------

    def prepare(self, values: Tensor, offsets: Tensor) -> Tuple[Tensor, Tensor]:
        """``(row_ids [L], flags)``: :func:`~.triton_ops.prepare_rows` of the KJT."""
        return triton_ops.prepare_rows(values, offsets, self.feature_rows, self.batch_size(offsets))

    def pool(
        self,
        batch: TableBatch,
        slot: int,
        row_ids: Tensor,
        offsets: Tensor,
        weights: Optional[Tensor],
    ) -> Tensor:
        """``[B, F_s * D]`` pooled embeddings of one table batch of slot ``slot``."""
        b = self.batch_size(offsets)
        first, end = self.bags(slot, b)
        out = torch.empty(b, batch.num_features * batch.dim, device=row_ids.device)
        triton_ops.pool_into(
            out.view(-1, batch.dim),
            batch.weight,
            row_ids,
            offsets[first : end + 1],
            weights,
            batch.pooling == PoolingType.MEAN,
            whole=False,
            batch_size=b,
        )
        return out

    def in_slot(self, slot: int, offsets: Tensor, num_ids: int) -> Tensor:
        """``[L]`` bool: the positions of the slot's features."""
        first, end = self.bags(slot, self.batch_size(offsets))
        positions = torch.arange(num_ids, device=offsets.device)
        return (positions >= offsets[first]) & (positions < offsets[end])

    # --- backward ------------------------------------------------------------------------

    def group(self, slot: int, row_ids: Tensor, offsets: Tensor, consumed: Tensor) -> RowGrouping:
        """The slot's positions grouped by row, at a fixed size (no host read)."""
        b = self.batch_size(offsets)
        lengths = offsets[1:] - offsets[:-1]
        bag_of_position = torch.repeat_interleave(
            self.bag_rows(slot, b), lengths, output_size=row_ids.numel()
        )
        grouping = group_rows_padded(
            row_ids,
            self.in_slot(slot, offsets, row_ids.numel()),
            self._slot_batches[slot].weight.shape[0],
            bag_of_position,
        )
        grouping.consumed = consumed
        return grouping

    def bag_of_positions(self, slot: int, offsets: Tensor, num_ids: int) -> Tensor:
        """``[L]``: each position's row in the slot's bag gradients."""
        lengths = offsets[1:] - offsets[:-1]
        return torch.repeat_interleave(
            self.bag_rows(slot, self.batch_size(offsets)), lengths, output_size=num_ids
        )


def inverse_lengths(offsets: Tensor, num_ids: int) -> Tensor:
    """``[L]``: ``1 / len`` of each position's bag (MEAN pooling's factor)."""
    lengths = offsets[1:] - offsets[:-1]
    inv_len = 1.0 / lengths.clamp_min(1).to(torch.float32)
    return torch.repeat_interleave(inv_len, lengths, output_size=num_ids)


def looked_up_rows(batch: TableBatch, row_ids: Tensor, in_slot: Tensor) -> Tensor:
    """``[L, D]``: the row each position of the slot read (zero at the others)."""
    safe = torch.where(in_slot, row_ids, torch.zeros_like(row_ids))
    rows = batch.weight.index_select(0, safe).to(batch.compute_dtype)
    return rows * in_slot.unsqueeze(1).to(rows.dtype)

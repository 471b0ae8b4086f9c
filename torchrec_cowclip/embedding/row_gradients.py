"""From the pooled-output gradient to one summed gradient per distinct row.

The backward of a sum-pooled lookup is itself a sum-pooled lookup over the transposed
incidence: after sorting the looked-up row ids, each distinct row is a "bag" whose
members are the output rows (bag gradients) of the positions that looked it up. So the
per-row gradient ``g_j`` (step 2 of ``docs/algorithm.md``) is one ``embedding_bag`` call
over the bag gradients - the same FBGEMM-backed CPU kernel that serves the forward - and no dense
``[N, D]`` gradient is ever formed: memory is proportional to the rows the batch touches.

A stable sort plus this segment sum is cheaper than ``index_select`` + ``index_add_`` of the
same gradients (measured: docs/performance.md, "Measured reasons behind code choices").

Which grouping and when the sum runs is the table batch's row kernel's
(:mod:`.row_kernels`): the native CPU kernel groups by radix sorts (the same result as the
stable sort) and leaves the segment sum to its update, which sums each row's bag gradients
in the same pass that updates the row: a :class:`RowGradients` then holds its
:class:`RowSegments` and forms ``grad`` only when something reads it (Helen, the
column-sharded and replicated updates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class RowGradients:
    """Gradients of the distinct rows a batch looked up.

    Attributes:
        rows: ``[U]`` distinct row ids, ascending.
        counts: ``[U]`` occurrences ``c_j`` of each row (duplicates in a bag count).
        grad: ``[U, D]`` summed gradient ``g_j`` of each row; formed on first read when the
            rows were built from ``segments``.
        segments: where ``grad`` is summed from, while it has not been formed (None
            once it has, or when ``grad`` was given).
    """

    def __init__(
        self,
        rows: Tensor,
        counts: Tensor,
        grad: Optional[Tensor] = None,
        segments: Optional["RowSegments"] = None,
    ) -> None:
        if (grad is None) == (segments is None):
            raise ValueError("RowGradients takes grad or segments, exactly one")
        self.rows = rows
        self.counts = counts
        self._grad = grad
        self.segments = segments

    @property
    def grad(self) -> Tensor:
        if self._grad is None:
            assert self.segments is not None
            self._grad = self.segments.sum()
            self.segments = None
        return self._grad

    def __repr__(self) -> str:
        return f"RowGradients(rows={self.rows!r}, counts={self.counts!r}, grad={self.grad!r})"


@dataclass
class RowGrouping:
    """How the positions of one lookup group into distinct rows: the sort, done once
    and reusable by every table batch that looks up the same row ids (DeepFM's dim-10
    and dim-1 tables of the same features share it).

    Attributes:
        rows: ``[U]`` distinct row ids, ascending (int64).
        counts: ``[U]`` occurrences of each row.
        segment_offsets: ``[U + 1]`` row ``u``'s positions are
            ``order[segment_offsets[u]:segment_offsets[u + 1]]``.
        order: ``[L]`` positions, stably sorted by row id.
        sorted_bags: ``[L]`` the bag of each position of ``order``.
        num_valid: a grouping of fixed size (no value read back to the host: the Triton
            path, :func:`group_rows_padded`) has ``[L]`` rows and counts and ``[L + 1]``
            segment offsets, of which the first ``num_valid`` (a one-element device
            tensor) are real; None for an exact grouping.
        consumed: with ``num_valid``: one-element int32 device flag, set when the
            forward these positions belong to has had its backward (the update refuses).
    """

    rows: Tensor
    counts: Tensor
    segment_offsets: Tensor
    order: Tensor
    sorted_bags: Tensor
    num_valid: Optional[Tensor] = None
    consumed: Optional[Tensor] = None


def group_rows(
    row_ids: Tensor, bag_of_position: Tensor, num_rows: Optional[int] = None
) -> RowGrouping:
    """Sorts the looked-up row ids (stably) and finds each distinct row's positions.

    Args:
        row_ids: ``[L]`` int64 row id looked up at each position.
        bag_of_position: ``[L]`` int64 index of each position's bag (output row).
        num_rows: an upper bound on the row ids (the table batch's rows), if known.
            Below 2**31 the ids are sorted as int32, twice as fast as int64.
    """
    # Stable, so that each row sums its positions in input order: bit-for-bit
    # reproducible steps, which resume-from-checkpoint equality relies on.
    keys = row_ids
    if num_rows is not None and num_rows <= torch.iinfo(torch.int32).max:
        keys = row_ids.to(
            torch.int32
        )  # int32 keys sort faster (docs/performance.md, "Measured reasons behind code choices")
    sorted_ids, order = torch.sort(keys, stable=True)
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    segment_offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, dim=0, out=segment_offsets[1:])
    return RowGrouping(
        rows=rows.to(torch.int64),
        counts=counts,
        segment_offsets=segment_offsets,
        order=order,
        sorted_bags=bag_of_position[order],
    )


def group_rows_padded(
    row_ids: Tensor, in_lookup: Tensor, num_rows: int, bag_of_position: Tensor
) -> RowGrouping:
    """:func:`group_rows` of the positions where ``in_lookup`` is True, with every output of
    a size known before the values are (``[L]`` rows and counts, ``[L + 1]`` segment
    offsets, the count of real rows a device tensor): no value is read back to the host,
    so the grouping can be captured in a CUDA graph. The other positions sort last, under
    the key ``num_rows``, and form no real row.

    Example::

        >>> g = group_rows_padded(torch.tensor([5, 2, 9, 5]), torch.tensor([True, True, False, True]),
        ...                       num_rows=8, bag_of_position=torch.tensor([0, 0, 1, 1]))
        >>> int(g.num_valid), g.rows[:2].tolist(), g.counts[:2].tolist(), g.order.tolist()
        (2, [2, 5], [1, 2], [1, 0, 3, 2])
    """
    n = row_ids.numel()
    device = row_ids.device
    keys = torch.where(in_lookup, row_ids, torch.full_like(row_ids, num_rows))
    if num_rows < torch.iinfo(torch.int32).max:
        keys = keys.to(torch.int32)  # int32 keys sort faster (see group_rows)
    sorted_keys, order = torch.sort(keys, stable=True)
    head = torch.ones(n, dtype=torch.bool, device=device)
    head[1:] = sorted_keys[1:] != sorted_keys[:-1]
    run = torch.cumsum(head, 0) - 1
    positions = torch.arange(n, device=device)
    # Each run starts at its smallest position; the entries past the last run stay n.
    segment_offsets = torch.full((n + 1,), n, dtype=torch.int64, device=device)
    segment_offsets.scatter_reduce_(0, run, positions, reduce="amin", include_self=True)
    rows = torch.full((n,), num_rows, dtype=torch.int64, device=device)
    rows.scatter_(0, run, sorted_keys.to(torch.int64))
    num_valid = (head & (sorted_keys < num_rows)).sum().view(1)
    return RowGrouping(
        rows=rows,
        counts=segment_offsets[1:] - segment_offsets[:-1],
        segment_offsets=segment_offsets,
        order=order,
        sorted_bags=bag_of_position[order],
        num_valid=num_valid,
    )


@dataclass
class RowSegments:
    """The bag gradients a :class:`RowGrouping`'s rows sum, not summed yet.

    Attributes:
        grouping: the rows and their positions.
        bag_gradients: ``[M, D]`` gradient of each pooled output row (contiguous).
        sorted_weights: ``[L]`` factor of each position in ``grouping.order`` (per-sample
            weight, and ``1 / bag length`` under MEAN pooling), or None.
    """

    grouping: RowGrouping
    bag_gradients: Tensor
    sorted_weights: Optional[Tensor]

    def sum(self) -> Tensor:
        """``[U, D]``: each row's gradient, its positions summed in input order."""
        g = self.grouping
        return F.embedding_bag(
            g.sorted_bags,
            self.bag_gradients,
            g.segment_offsets,
            mode="sum",
            per_sample_weights=self.sorted_weights,
            include_last_offset=True,
        )


def row_segments(
    grouping: RowGrouping, bag_gradients: Tensor, position_weights: Optional[Tensor] = None
) -> RowSegments:
    """What each distinct row of ``grouping`` sums, in grouped order.

    Args:
        bag_gradients: ``[M, D]`` gradient of each pooled output row (contiguous).
        position_weights: optional ``[L]`` factor per position (per-sample weight, and
            ``1 / bag length`` under MEAN pooling), as the forward applied it.
    """
    weights = position_weights[grouping.order] if position_weights is not None else None
    return RowSegments(grouping, bag_gradients, weights)


def aggregate_row_gradients(
    row_ids: Tensor,
    bag_gradients: Tensor,
    bag_of_position: Tensor,
    position_weights: Optional[Tensor] = None,
    num_rows: Optional[int] = None,
) -> RowGradients:
    """Sums, for every distinct row id, the gradients of the bags that looked it up:
    :func:`group_rows`, then the segment sum of :func:`row_segments`.

    Args:
        row_ids: ``[L]`` int64 row id looked up at each position.
        bag_gradients: ``[M, D]`` gradient of each pooled output row (contiguous).
        bag_of_position: ``[L]`` int64 index into ``bag_gradients`` of each position.
        position_weights: optional ``[L]`` factor per position.
        num_rows: an upper bound on the row ids, if known.

    Example::

        >>> bags = torch.tensor([[1.0], [10.0]])
        >>> r = aggregate_row_gradients(torch.tensor([5, 2, 5]), bags, torch.tensor([0, 0, 1]))
        >>> r.rows.tolist(), r.counts.tolist(), r.grad.flatten().tolist()
        ([2, 5], [1, 2], [1.0, 11.0])
    """
    grouping = group_rows(row_ids, bag_of_position, num_rows)
    segments = row_segments(grouping, bag_gradients, position_weights)
    return RowGradients(rows=grouping.rows, counts=grouping.counts, grad=segments.sum())

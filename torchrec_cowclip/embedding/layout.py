"""The lookup layout shared by the unsharded collection and the sharded kernel.

Both receive a ``KeyedJaggedTensor`` whose features are in table-batch order (each
batch's features, batch after batch) and return the pooled embeddings in TorchRec's
column order. In between, the same layout work:

* :func:`feature_starts` and :func:`value_bounds`: where each table batch's features
  and values start, so that a batch's ids and offsets are contiguous slices;
* :func:`prepare_lookup` / :func:`prepare_lookups`: the ids checked against their
  tables and mapped to rows of the batch's weight;
* :func:`output_permutation`, :func:`as_index` and :func:`pooled_in_order`: the batch
  outputs, concatenated, put back in TorchRec's column order.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from torchrec_cowclip.embedding.row_lookup import BatchLookup
from torchrec_cowclip.embedding.table_batch import TableBatch


def feature_starts(batches: Sequence[TableBatch]) -> List[int]:
    """``[len(batches) + 1]`` index of each batch's first feature in table-batch order
    (the last entry: the number of features)."""
    starts = [0]
    for batch in batches:
        starts.append(starts[-1] + batch.num_features)
    return starts


def value_bounds(
    offsets: Tensor, starts: Sequence[int], batch_size: int, num_values: int
) -> List[int]:
    """Where each table batch's values start in the KJT's ``values`` (and the end): the
    offsets of its first bag; one device sync, none for a single batch.

    Example::

        >>> value_bounds(torch.tensor([0, 1, 3, 4, 6]), [0, 1, 2], batch_size=2, num_values=6)
        [0, 3, 6]
    """
    if len(starts) == 2:
        return [0, num_values]
    return offsets[torch.tensor(starts, device=offsets.device) * batch_size].tolist()


def prepare_lookups(
    batches: Sequence[TableBatch],
    values: Tensor,
    offsets: Tensor,
    batch_size: int,
    starts: Sequence[int],
    bounds: Sequence[int],
    weights: Optional[Tensor] = None,
) -> List[BatchLookup]:
    """:func:`prepare_lookup` of every table batch, on its slices of ``values``,
    ``offsets`` (rebased to 0) and ``weights`` (cast to the batch's dtype)."""
    b = batch_size
    lookups = []
    for i, batch in enumerate(batches):
        lo, hi = bounds[i], bounds[i + 1]
        lookups.append(
            prepare_lookup(
                batch,
                values[lo:hi],
                bag_offsets(offsets, starts, i, b, lo),
                None if weights is None else weights[lo:hi].to(batch.compute_dtype),
                b,
            )
        )
    return lookups


def bag_offsets(
    offsets: Tensor, starts: Sequence[int], batch: int, batch_size: int, first_value: int
) -> Tensor:
    """Table batch ``batch``'s slice of a KJT's ``offsets`` (its features' bags), rebased
    to its first value ``first_value``, as int64: a view where nothing changes (one table
    batch, the common case; no copy of ``F * B`` offsets per step)."""
    sliced = offsets[starts[batch] * batch_size : starts[batch + 1] * batch_size + 1]
    sliced = sliced.to(torch.int64)
    return sliced - first_value if first_value else sliced


def output_permutation(
    batches: Sequence[TableBatch], embedding_names: Sequence[str]
) -> Optional[List[int]]:
    """Columns of the concatenated batch outputs in the order of ``embedding_names``
    (TorchRec's table order), or None for the identity.

    ``embedding_names`` name the same embeddings as the batches' ``embedding_names``.
    """
    column_ranges: Dict[str, range] = {}
    col = 0
    for batch in batches:
        for name in batch.embedding_names:
            column_ranges[name] = range(col, col + batch.dim)
            col += batch.dim
    permutation = [c for name in embedding_names for c in column_ranges[name]]
    return None if permutation == list(range(col)) else permutation


def as_index(columns: Optional[List[int]], device: torch.device) -> Optional[Tensor]:
    """:func:`output_permutation`'s columns as an int64 index on ``device`` (None stays None)."""
    return None if columns is None else torch.tensor(columns, dtype=torch.int64, device=device)


def pooled_in_order(outs: Sequence[Tensor], permutation: Optional[Tensor]) -> Tensor:
    """The ``[B, *]`` batch outputs side by side, columns reordered by ``permutation``
    (:func:`as_index`)."""
    pooled = outs[0] if len(outs) == 1 else torch.cat(list(outs), dim=1)
    return pooled if permutation is None else pooled.index_select(1, permutation)


def prepare_lookup(
    batch: TableBatch,
    ids: Tensor,
    bag_offsets: Tensor,
    weights: Optional[Tensor],
    batch_size: int,
) -> BatchLookup:
    """One table batch's :class:`~.row_lookup.BatchLookup`: checks ``ids`` against their
    tables and maps them to rows of the batch.

    Args:
        batch: the table batch.
        ids: ``[L]`` ids of the batch's features, feature-major (as in a KJT).
        bag_offsets: ``[F * B + 1]`` offsets of the bags into ``ids`` (from 0).
        weights: ``[L]`` per-sample weights, or None.
        batch_size: ``B``.

    Raises:
        ValueError: a bag's length is negative (its offsets do not ascend).
        IndexError: an id is outside ``[0, num_embeddings)`` of its table, naming the
            feature, table, id and sample (raised in forward, before any update).
    """
    ids = ids.to(torch.int64)
    bag_offsets = bag_offsets.to(torch.int64)
    if not batch_size:
        return BatchLookup(ids, bag_offsets, weights, batch_size)
    # One device sync for the bags' shortest and longest length and each feature's first
    # position, one for the ids' check.
    shortest, longest = torch.aminmax(torch.diff(bag_offsets))
    synced: List[int] = torch.cat(
        [torch.stack([shortest, longest]), bag_offsets[::batch_size]]
    ).tolist()
    if synced[0] < 0:
        raise ValueError("KeyedJaggedTensor has negative lengths")
    if ids.numel() == 0:
        return BatchLookup(ids, bag_offsets, weights, batch_size)
    # Feature by feature on contiguous slices of the ids: one min/max pass and one add
    # per id, instead of materialising a per-position feature index and gathering
    # bounds and offsets through it (docs/performance.md).
    starts = synced[2:]
    row_ids = torch.empty_like(ids)
    lows: List[Tensor] = []
    highs: List[Tensor] = []
    limits: List[int] = []
    for f in range(batch.num_features):
        lo, hi = starts[f], starts[f + 1]
        if hi == lo:
            continue
        segment = ids[lo:hi]
        low, high = torch.aminmax(segment)
        lows.append(low)
        highs.append(high)
        limits.append(batch.feature_num_rows_list[f])
        torch.add(segment, batch.feature_row_offset_list[f], out=row_ids[lo:hi])
    # One id per bag: every bag's length is 1.
    single_hot = synced[0] == 1 and synced[1] == 1
    if lows:
        limit = torch.tensor(limits, dtype=torch.int64, device=ids.device)
        if bool(((torch.stack(lows) < 0) | (torch.stack(highs) >= limit)).any()):
            feature_of_position = torch.repeat_interleave(
                torch.arange(batch.num_features, device=ids.device),
                torch.diff(bag_offsets[::batch_size]),
                output_size=ids.numel(),
            )
            bad = (ids < 0) | (ids >= batch.feature_num_rows[feature_of_position])
            _raise_out_of_range(batch, ids, bad, feature_of_position, bag_offsets, batch_size)
    return BatchLookup(row_ids, bag_offsets, weights, batch_size, single_hot)


def _raise_out_of_range(
    batch: TableBatch,
    ids: Tensor,
    bad: Tensor,
    feature_of_position: Tensor,
    bag_offsets: Tensor,
    batch_size: int,
) -> None:
    position = int(torch.nonzero(bad)[0])
    f = int(feature_of_position[position])
    table = batch.tables[batch.feature_table_list[f]]
    position_t = torch.tensor(position, device=bag_offsets.device)
    bag = int(torch.searchsorted(bag_offsets, position_t, right=True)) - 1
    raise IndexError(
        f"feature '{batch.feature_names[f]}' (table '{table.name}', "
        f"num_embeddings={table.num_embeddings}) has id {int(ids[position])} in sample "
        f"{bag - f * batch_size}; ids must be in [0, {table.num_embeddings}). "
        f"{int(bad.sum())} id(s) of this batch are out of range; no weight was changed."
    )

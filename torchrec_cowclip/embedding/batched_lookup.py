"""One lookup of a collection's table batches: the forward and backward that the lookup ops
run (:mod:`.lookup_op`).

A :class:`BatchedLookup` takes a KJT's values, offsets and weights in its table batches'
feature order and returns the pooled embeddings in TorchRec's column order; its backward
turns the pooled output's gradient into each table batch's row gradients and hands them
to the collection's row-update coordinator (:mod:`.row_updates`) as one step, applied or
held for Helen there. Table batches with the same features and row layout (DeepFM's dim-D
and dim-1 tables) look up the same row ids: they share one *slot*, whose ids are checked,
mapped and (in backward) grouped once for all of them.

Everything that depends on the ids' values runs here, on real tensors, inside the ops:
``torch.compile`` traces a model holding the collection without a data-dependent break.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import PoolingType

from torchrec_cowclip.embedding import layout, lookup_op, triton_ops
from torchrec_cowclip.embedding.device_lookup import DeviceLookup, inverse_lengths, looked_up_rows
from torchrec_cowclip.embedding.lookup_op import SavedLookup
from torchrec_cowclip.embedding.row_gradients import RowGradients, RowGrouping, row_segments
from torchrec_cowclip.embedding.row_lookup import (
    BatchLookup,
    lookup_row_gradients,
    per_sample_weight_gradients,
    pooled_lookup,
)
from torchrec_cowclip.embedding.row_updates import LookupStep, RowSync, RowUpdates, Submission
from torchrec_cowclip.embedding.table_batch import TableBatch
from torchrec_cowclip.optim.options import CowClipOptions

__all__ = ["BatchedLookup"]

#: The token of a forward whose backward has run (a second backward is refused).
_CONSUMED = -1


class BatchedLookup:
    """The table batches of one lookup and its way into the row-update coordinator.

    Args:
        batches: the table batches, in the collection's order.
        embedding_names: the pooled output's keys, in TorchRec's order.
        row_updates: the collection's coordinator; the lookup opens a channel on it.
        sync: how the lookup's rows are applied (:class:`~.row_updates.LocalRows` for
            whole local tables).
        row_options: the hyperparameters a backward steps with, as they are then (the
            fused optimizer's :meth:`~torchrec_cowclip.optim.fused.CowClipFusedOptimizer.row_options`).
        device: where the tables live.
    """

    def __init__(
        self,
        batches: Sequence[TableBatch],
        embedding_names: Sequence[str],
        row_updates: RowUpdates,
        sync: RowSync,
        row_options: Callable[[], CowClipOptions],
        device: torch.device,
    ) -> None:
        self.batches = list(batches)
        self._row_options = row_options
        slot_of_layout: Dict[Tuple[Any, ...], int] = {}
        #: The slot of each table batch.
        self.slot_of_batch: List[int] = [
            slot_of_layout.setdefault(batch.lookup_layout, len(slot_of_layout))
            for batch in self.batches
        ]
        self.slot_batches: List[TableBatch] = []  # the first batch of each slot
        for batch, slot in zip(self.batches, self.slot_of_batch):
            if slot == len(self.slot_batches):
                self.slot_batches.append(batch)
        self._feature_starts: List[int] = layout.feature_starts(self.slot_batches)
        #: The KJT keys the lookup reads, in order (a feature of several tables repeats).
        self.feature_order: List[str] = [
            f for batch in self.slot_batches for f in batch.feature_names
        ]
        self._output_columns = layout.output_permutation(self.batches, embedding_names)
        self._output_permutation = layout.as_index(self._output_columns, device)
        self._inverse_columns = _inverse(self._output_columns)
        self._inverse_permutation = layout.as_index(self._inverse_columns, device)
        self._width = sum(batch.num_features * batch.dim for batch in self.batches)
        self.channel = row_updates.channel(sync)
        self._row_updates = row_updates
        self._serials = itertools.count(1)
        self._device = DeviceLookup(self.slot_batches, self._feature_starts)
        self._device_serial = torch.zeros(1, dtype=torch.int64, device=device)
        self.handle = lookup_op.register(self)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # A copy (deepcopy, unpickling) is another lookup: a handle of its own.
        self.__dict__.update(state)
        self._serials = itertools.count(1)
        self.handle = lookup_op.register(self)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_serials")
        return state

    def to(self, device: torch.device) -> None:
        """Moves the index tensors and the channel (the owner moved the batches)."""
        self._output_permutation = layout.as_index(self._output_columns, device)
        self._inverse_permutation = layout.as_index(self._inverse_columns, device)
        self._device.to(device)
        self._device_serial = torch.zeros(1, dtype=torch.int64, device=device)

    def sync_free(self) -> bool:
        """Whether a step reads no value back to the host (:mod:`.device_lookup`): the
        batches' row kernel is sync-free (Triton) and no Helen step holds the rows."""
        return self.batches[0].kernel.sync_free and self._row_updates.helen is None

    def __call__(self, values: Tensor, offsets: Tensor, weights: Optional[Tensor]) -> Tensor:
        """``[B, sum of dims]`` pooled embeddings of a KJT in :attr:`feature_order`; the
        backward updates the rows (:func:`.lookup_op.lookup`)."""
        return lookup_op.lookup(self.handle, self.channel.leaf, values, offsets, weights)

    def _submission(self, index: int, row_grads: RowGradients) -> Submission:
        """Table batch ``index``'s row gradients as the step takes them: with the
        hyperparameters as they are at this backward."""
        return Submission((index,), self.batches[index], row_grads, self._row_options())

    # --- the forward op ----------------------------------------------------------------

    def _slot_lookups(
        self, values: Tensor, offsets: Tensor, row_ids: Optional[Tensor], single_hot: Sequence[bool]
    ) -> Tuple[List[BatchLookup], List[int]]:
        """Each slot's :class:`~.lookup.BatchLookup` (its ids checked and mapped, or the
        mapped ``row_ids`` of the forward), and the slots' value bounds."""
        batch_size = (offsets.numel() - 1) // max(len(self.feature_order), 1)
        starts = self._feature_starts
        bounds = layout.value_bounds(offsets, starts, batch_size, values.numel())
        if row_ids is None:
            return (
                layout.prepare_lookups(
                    self.slot_batches, values, offsets, batch_size, starts, bounds
                ),
                bounds,
            )
        lookups = []
        for s in range(len(self.slot_batches)):
            lo, hi = bounds[s], bounds[s + 1]
            lookups.append(
                BatchLookup(
                    row_ids[lo:hi],
                    layout.bag_offsets(offsets, starts, s, batch_size, lo),
                    None,
                    batch_size,
                    single_hot[s],
                )
            )
        return lookups, bounds

    def forward_impl(
        self, values: Tensor, offsets: Tensor, weights: Optional[Tensor], keep_rows: bool
    ) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
        """The lookup op: ``(pooled [B, sum of dims] float32, row_ids [L] int64 (the ids
        as rows of their table batches), token [1 + slots] int64 (a serial, then each
        slot's single-hot flag), looked_up)``: with ``keep_rows``, per table batch the
        ``[L, D]`` rows each position read (zero outside the batch's slot), which the
        per-sample weights' gradient needs.

        Raises:
            ValueError: negative lengths, lengths that do not add up to the values, or
                weights of another count than the values.
            IndexError: an id outside its table (naming the feature, table, id and
                sample); nothing has changed.
        """
        if self.sync_free():
            return self._forward_on_device(values, offsets, weights, keep_rows)
        # The lengths' signs are checked with each slot's bags (layout.prepare_lookup).
        _check_lengths(values, offsets, weights, signs=False)
        slot_lookups, bounds = self._slot_lookups(values, offsets, None, ())
        # One slot (every table batch of one layout: the common case) needs no copy.
        row_ids = (
            slot_lookups[0].row_ids
            if len(slot_lookups) == 1
            else torch.cat([lk.row_ids for lk in slot_lookups])
        )
        if row_ids.untyped_storage().data_ptr() == values.untyped_storage().data_ptr():
            row_ids = row_ids.clone()  # an op's output may not alias its input (no ids)
        outs: List[Tensor] = []
        looked_up: List[Tensor] = []
        for batch, s in zip(self.batches, self.slot_of_batch):
            batch_weights = None
            if weights is not None:
                batch_weights = weights[bounds[s] : bounds[s + 1]].to(batch.compute_dtype)
            lookup = slot_lookups[s].sharing_ids_with(batch_weights)
            outs.append(pooled_lookup(batch, lookup))
            if keep_rows:
                rows = torch.zeros(
                    values.numel(), batch.dim, dtype=batch.compute_dtype, device=values.device
                )
                rows[bounds[s] : bounds[s + 1]] = batch.weight.index_select(0, lookup.row_ids).to(
                    batch.compute_dtype
                )
                looked_up.append(rows)
        token = torch.tensor(
            [next(self._serials), *[int(lk.single_hot) for lk in slot_lookups]],
            dtype=torch.int64,
            device=values.device,
        )
        pooled = layout.pooled_in_order(outs, self._output_permutation)
        return pooled, row_ids.to(torch.int64), token, looked_up

    def forward_shapes(
        self, values: Tensor, offsets: Tensor, weights: Optional[Tensor], keep_rows: bool
    ) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
        """Empty tensors of :meth:`forward_impl`'s output shapes (the op's fake kernel)."""
        batch_size = (offsets.shape[0] - 1) // max(len(self.feature_order), 1)
        pooled = values.new_empty((batch_size, self._width), dtype=torch.float32)
        row_ids = values.new_empty(values.shape, dtype=torch.int64)
        token = values.new_empty((1 + len(self.slot_batches),), dtype=torch.int64)
        looked_up = (
            [
                values.new_empty((values.shape[0], batch.dim), dtype=batch.compute_dtype)
                for batch in self.batches
            ]
            if keep_rows
            else []
        )
        return pooled, row_ids, token, looked_up

    # --- the backward op ---------------------------------------------------------------

    def backward_impl(
        self, grad: Tensor, saved: SavedLookup, weights_need_grad: bool
    ) -> Optional[Tensor]:
        """The backward op: each table batch's row gradients from the pooled output's
        ``grad``, submitted as one step of the lookup's channel and taken by the
        coordinator (applied, or held for Helen); returns the per-sample weights' gradient
        when ``weights_need_grad``.

        Raises:
            RuntimeError: the forward's backward already ran (``retain_graph=True``): the
                fused update applies exactly once per forward.
        """
        if self.sync_free():
            return self._backward_on_device(grad, saved, weights_need_grad)
        values, offsets, weights, row_ids, token, looked_up = saved
        flags = token.tolist()
        if flags[0] == _CONSUMED:
            raise RuntimeError(
                "a second backward reached the same CowClip lookup (retain_graph=True?); "
                "the fused update applies exactly once per forward"
            )
        _mark_consumed(token)
        slot_lookups, bounds = self._slot_lookups(
            values, offsets, row_ids, [bool(f) for f in flags[1:]]
        )
        for s, lookup in enumerate(slot_lookups):
            lookup.grouping.users = self.slot_of_batch.count(s)
        weights_grad = _zeros_if(weights_need_grad, values)
        step = LookupStep(self.channel)
        for index, batch, s, bag_gradients in self._bag_gradients(grad):
            lo, hi = bounds[s], bounds[s + 1]
            batch_weights = None
            if weights is not None:
                batch_weights = weights[lo:hi].to(batch.compute_dtype)
            lookup = slot_lookups[s].sharing_ids_with(batch_weights)
            if weights_grad is not None:
                weights_grad[lo:hi] += per_sample_weight_gradients(
                    batch, lookup, bag_gradients, looked_up[index][lo:hi]
                )
            step.submit(self._submission(index, lookup_row_gradients(batch, lookup, bag_gradients)))
        self._row_updates.take(step)
        return weights_grad

    def _bag_gradients(self, grad: Tensor) -> Iterator[Tuple[int, TableBatch, int, Tensor]]:
        """``(index, batch, slot, bag gradients)`` of each table batch, from the pooled
        output's ``grad``: row ``b * F + f`` of a batch's is the gradient of its bag
        ``(f, b)``."""
        if self._inverse_permutation is not None:
            grad = grad.index_select(1, self._inverse_permutation)
        column = 0
        for index, (batch, s) in enumerate(zip(self.batches, self.slot_of_batch)):
            width = batch.num_features * batch.dim
            yield index, batch, s, grad[:, column : column + width].contiguous().view(-1, batch.dim)
            column += width

    # --- the sync-free path (device_lookup.py) ------------------------------------------

    def _forward_on_device(
        self, values: Tensor, offsets: Tensor, weights: Optional[Tensor], keep_rows: bool
    ) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
        """:meth:`forward_impl` with no value read back to the host but the checks' flags
        (none while a CUDA graph is captured)."""
        if weights is not None and weights.numel() != values.numel():
            _check_lengths(values, offsets, weights)
        offsets = offsets.to(torch.int64)
        row_ids, flags = self._device.prepare(values, offsets)
        if not triton_ops.capturing(values.device):
            self._raise_forward_errors(flags, values, offsets, weights)
        weights = None if weights is None else weights.to(torch.float32)
        outs: List[Tensor] = []
        looked_up: List[Tensor] = []
        for batch, s in zip(self.batches, self.slot_of_batch):
            outs.append(self._device.pool(batch, s, row_ids, offsets, weights))
            if keep_rows:
                in_slot = self._device.in_slot(s, offsets, values.numel())
                looked_up.append(looked_up_rows(batch, row_ids, in_slot))
        self._device_serial.add_(1)
        token = torch.cat(
            [self._device_serial, self._device_serial.new_zeros(len(self.slot_batches))]
        )
        pooled = layout.pooled_in_order(outs, self._output_permutation)
        return pooled, row_ids, token, looked_up

    def _raise_forward_errors(
        self, flags: Tensor, values: Tensor, offsets: Tensor, weights: Optional[Tensor]
    ) -> None:
        """The sliced path's error for what the prepare kernel flagged (its checks rerun
        on the host to name the feature, table and sample)."""
        bad_bags, first_outside = flags.tolist()
        if bad_bags:
            _check_lengths(values, offsets, weights)
            raise ValueError("KeyedJaggedTensor offsets must start at 0 and ascend")
        if first_outside < values.numel():
            self._slot_lookups(values, offsets, None, ())
            raise IndexError(f"id {int(values[first_outside])} outside its table")

    def _backward_on_device(
        self, grad: Tensor, saved: SavedLookup, weights_need_grad: bool
    ) -> Optional[Tensor]:
        """:meth:`backward_impl` with no value read back to the host but the updates'
        check flags (a second backward of one forward is refused through them)."""
        values, offsets, weights, row_ids, token, looked_up = saved
        num_ids = values.numel()
        offsets = offsets.to(torch.int64)
        consumed = (token[:1] == _CONSUMED).to(torch.int32)
        weights = None if weights is None else weights.to(torch.float32)
        inv_len = None
        if any(batch.pooling == PoolingType.MEAN for batch in self.batches):
            inv_len = inverse_lengths(offsets, num_ids)
        weights_grad = _zeros_if(weights_need_grad, values)
        groupings: Dict[int, RowGrouping] = {}
        step = LookupStep(self.channel)
        for index, batch, s, bag_gradients in self._bag_gradients(grad):
            if s not in groupings:
                groupings[s] = self._device.group(s, row_ids, offsets, consumed)
            mean = batch.pooling == PoolingType.MEAN
            position_weights = weights
            if mean:
                assert inv_len is not None
                position_weights = inv_len if weights is None else weights * inv_len
            if weights_grad is not None:
                bag_of_position = self._device.bag_of_positions(s, offsets, num_ids)
                dot = (bag_gradients.index_select(0, bag_of_position) * looked_up[index]).sum(1)
                weights_grad += dot * inv_len if mean and inv_len is not None else dot
            segments = row_segments(groupings[s], bag_gradients, position_weights)
            step.submit(self._submission(index, batch.kernel.row_gradients(segments)))
        self._row_updates.take(step)
        _mark_consumed(token)
        return weights_grad


def _zeros_if(needed: bool, values: Tensor) -> Optional[Tensor]:
    """The per-sample weights' gradient to accumulate into, if ``needed``: ``[N]`` float32
    zeros on the ids' device."""
    return (
        torch.zeros(values.numel(), dtype=torch.float32, device=values.device) if needed else None
    )


def _mark_consumed(token: Tensor) -> None:
    """Marks a forward's token as consumed by its backward, through another tensor on its
    storage: autograd's saved-tensor version check stays quiet, so a second backward
    reaches the lookup's own error, not autograd's."""
    torch.empty(0, dtype=token.dtype, device=token.device).set_(
        token.untyped_storage(), token.storage_offset(), (1,), (1,)
    ).fill_(_CONSUMED)


def _check_lengths(
    values: Tensor, offsets: Tensor, weights: Optional[Tensor], signs: bool = True
) -> None:
    """What a KJT's structure must be that only its values show (``signs``: the lengths'
    too, a pass over the offsets)."""
    if signs and offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("KeyedJaggedTensor has negative lengths")
    total = int(offsets[-1]) if offsets.numel() else 0
    if total != values.numel():
        raise ValueError(
            f"KeyedJaggedTensor lengths add up to {total} but it has {values.numel()} values"
        )
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(
            f"KeyedJaggedTensor has {weights.numel()} weights for {values.numel()} values"
        )


def _inverse(columns: Optional[List[int]]) -> Optional[List[int]]:
    """The inverse of a column permutation (None: the identity)."""
    if columns is None:
        return None
    inverse = [0] * len(columns)
    for position, column in enumerate(columns):
        inverse[column] = position
    return inverse

"""Table-batched pooled lookup whose backward is the fused CowClip update.

Forward: one ``embedding_bag`` call over all features of a table batch (on CPU,
ATen dispatches sum pooling to FBGEMM's EmbeddingSpMDM kernel), output laid out as
TorchRec's ``KeyedTensor`` values ``[B, F * D]``.
Backward: per-row gradients (:mod:`.row_gradients`, grouped and summed by the table
batch's row kernel, :mod:`.row_kernels`), submitted to the lookup's step of the row-update
coordinator (:mod:`.row_updates`), which applies the in-place update or holds them for
Helen; the table weights get no gradient, so they never hold a ``.grad``. Per-sample
weights that require grad get theirs, exactly as ``torchrec.EmbeddingBagCollection``
gives it: ``d loss / d w_p = <bag gradient, looked-up row>`` at each position (times
``1 / bag length`` under MEAN pooling), from the rows the forward read.

Float16 / bfloat16 tables pool in float32 (the native kernel reads the half rows and
accumulates and returns float32; without it, ATen's ``embedding_bag`` pools in the
table's type and the result is widened), so the model above sees float32 either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import PoolingType

from torchrec_cowclip.embedding.row_gradients import RowGradients, RowGrouping, row_segments
from torchrec_cowclip.embedding.row_kernels import RowLayout
from torchrec_cowclip.embedding.table_batch import TableBatch


class SharedRowGrouping:
    """The :class:`RowGrouping` of one lookup's row ids, computed by the first backward
    that needs it and kept until every table batch sharing the lookup has used it."""

    def __init__(self) -> None:
        self.grouping: Optional[RowGrouping] = None
        self.users = 0

    def get(self, compute: Callable[[], RowGrouping]) -> RowGrouping:
        grouping = self.grouping if self.grouping is not None else compute()
        self.users -= 1
        # The last user frees it; with one user it is never stored.
        self.grouping = grouping if self.users > 0 else None
        return grouping


@dataclass
class BatchLookup:
    """One forward's input to a table batch, already validated.

    Attributes:
        row_ids: ``[L]`` int64 ids into the batch's ``weight`` (table offset added).
        bag_offsets: ``[F * B + 1]`` int64 offsets, feature-major as in a KJT.
        weights: ``[L]`` per-sample weights, or None.
        batch_size: ``B``.
        single_hot: every bag holds exactly one id (Criteo's and Avazu's fields).
        grouping: shared by the lookups of table batches with the same features and
            row layout, so that their backward sorts the ids once.
    """

    row_ids: Tensor
    bag_offsets: Tensor
    weights: Optional[Tensor]
    batch_size: int
    single_hot: bool = False
    grouping: SharedRowGrouping = field(default_factory=SharedRowGrouping)

    def sharing_ids_with(self, weights: Optional[Tensor]) -> "BatchLookup":
        """A lookup of the same ids (and grouping) with its own per-sample weights."""
        return BatchLookup(
            self.row_ids, self.bag_offsets, weights, self.batch_size, self.single_hot, self.grouping
        )


def _inverse_lengths(lookup: BatchLookup) -> Tensor:
    """``[L]``: ``1 / len`` of each position's bag (MEAN pooling's factor)."""
    lengths = lookup.bag_offsets[1:] - lookup.bag_offsets[:-1]
    inv_len = 1.0 / lengths.clamp_min(1).to(torch.float32)
    return torch.repeat_interleave(inv_len, lengths, output_size=lookup.row_ids.numel())


def _position_weights(lookup: BatchLookup, pooling: PoolingType) -> Optional[Tensor]:
    """Factor each position contributes with: per-sample weight, and 1/len for MEAN."""
    weights = lookup.weights
    if pooling == PoolingType.MEAN:
        per_pos = _inverse_lengths(lookup)
        weights = per_pos if weights is None else weights * per_pos
    return weights


def pooled_lookup(batch: TableBatch, lookup: BatchLookup) -> Tensor:
    """``[B, F * D]`` pooled embeddings of a table batch (no autograd)."""
    num_features, b = batch.num_features, lookup.batch_size
    if lookup.single_hot:
        # Look the ids up in sample-major order, so that the output already is
        # [B, F * D]: transposing the [F, B] ids (8 bytes each) instead of the
        # [F, B, D] output (4 * D bytes each) saves a 27 MB copy per forward at
        # 26 features x 16,384 x dim 16. Each bag is one id: pooling is the row itself
        # (times its weight when weighted).
        ids = lookup.row_ids.view(num_features, b).t().reshape(-1)
        weights = None
        if lookup.weights is not None:
            weights = lookup.weights.view(num_features, b).t().reshape(-1)
        pooled = batch.kernel.pool(
            batch.weight, ids, batch.unit_offsets(ids.numel()), "sum", weights
        )
        return pooled.view(b, num_features * batch.dim)
    if batch.pooling == PoolingType.MEAN and lookup.weights is None:
        mode, weights = "mean", None
    else:
        # Weighted MEAN pools sum(w * x) / len, as FBGEMM's TBE does.
        mode, weights = "sum", _position_weights(lookup, batch.pooling)
    pooled = batch.kernel.pool(batch.weight, lookup.row_ids, lookup.bag_offsets, mode, weights)
    return (
        pooled.view(num_features, b, batch.dim).transpose(0, 1).reshape(b, num_features * batch.dim)
    )


def bag_of_positions(batch: TableBatch, lookup: BatchLookup) -> Tensor:
    """``[L]``: for each position of the lookup (KJT order), its bag's row in the
    ``[B * F, D]`` view of the gradient of the batch's ``[B, F * D]`` pooled output."""
    bag_of_position = batch.bag_gradient_rows(lookup.batch_size)
    if not lookup.single_hot:
        lengths = lookup.bag_offsets[1:] - lookup.bag_offsets[:-1]
        bag_of_position = torch.repeat_interleave(
            bag_of_position, lengths, output_size=lookup.row_ids.numel()
        )
    return bag_of_position


def lookup_row_gradients(
    batch: TableBatch, lookup: BatchLookup, bag_gradients: Tensor
) -> RowGradients:
    """Per distinct row, the gradient ``g_j`` and count ``c_j`` of one forward's lookup,
    from the ``[B * F, D]`` gradient of its pooled output (:func:`bag_of_positions`)."""

    def compute() -> RowGrouping:
        starts = lookup.bag_offsets[batch.feature_bag_starts(lookup.batch_size)]
        rows = RowLayout(batch.weight.shape[0], starts, batch.feature_rows)
        return batch.kernel.group_rows(lookup.row_ids, bag_of_positions(batch, lookup), rows)

    grouping = lookup.grouping.get(compute)
    segments = row_segments(grouping, bag_gradients, _position_weights(lookup, batch.pooling))
    return batch.kernel.row_gradients(segments)


def per_sample_weight_gradients(
    batch: TableBatch, lookup: BatchLookup, bag_gradients: Tensor, looked_up: Tensor
) -> Tensor:
    """``[L]`` ``d loss / d w_p``: the dot product of each position's bag gradient with
    the row it looked up (``looked_up``, ``[L, D]`` as the forward read it), divided by
    the bag's length under MEAN pooling (the forward pooled ``sum(w * x) / len``)."""
    grad = (bag_gradients.index_select(0, bag_of_positions(batch, lookup)) * looked_up).sum(1)
    if batch.pooling == PoolingType.MEAN:
        grad = grad * _inverse_lengths(lookup)
    return grad


#: Builds a table batch's :class:`~torchrec_cowclip.embedding.row_updates.Submission`
#: from its row gradients at backward time (the caller binds the key, the fused optimizer's
#: hyperparameters and, for column shards, the whole tables' dims).
MakeSubmission = Callable[[RowGradients], Any]


class RowLookup(torch.autograd.Function):
    """Autograd node of one table batch's lookup: pooled lookup forward; backward hands
    the batch's row gradients to its lookup's step, and returns the per-sample weights'
    gradient when they require one.

    ``anchor`` is the step's zero-size tensor (:class:`~torchrec_cowclip.embedding.row_updates.LookupChannel`):
    taking it as input records the node (the table weights are not autograd inputs, so
    they never hold a ``.grad``) and makes the step's own node run after this backward.
    ``weights`` is ``lookup.weights`` (or None), an input so that autograd reaches it;
    when it requires grad, the forward keeps the rows it read (``[L, D]``: the update of
    this or another step may change them before this backward), else nothing more.
    """

    @staticmethod
    def forward(
        ctx: Any,
        anchor: Tensor,
        weights: Optional[Tensor],
        batch: TableBatch,
        lookup: BatchLookup,
        step: Any,
        make_submission: MakeSubmission,
    ) -> Tensor:
        ctx.batch, ctx.lookup, ctx.step, ctx.make_submission = batch, lookup, step, make_submission
        lookup.grouping.users += 1
        ctx.looked_up = None
        if ctx.needs_input_grad[1]:
            ctx.looked_up = batch.weight.index_select(0, lookup.row_ids).to(batch.compute_dtype)
        return pooled_lookup(batch, lookup)

    @staticmethod
    def backward(
        ctx: Any, grad_output: Tensor
    ) -> Tuple[None, Optional[Tensor], None, None, None, None]:
        if ctx.batch is None:
            raise RuntimeError(
                "a second backward reached the same CowClip lookup (retain_graph=True?); "
                "the fused update applies exactly once per forward"
            )
        if ctx.step is None:
            raise RuntimeError(
                "a CowClip table batch was looked up outside its lookup's forward (a "
                "sharded kernel called directly?); call the collection"
            )
        batch, lookup = ctx.batch, ctx.lookup
        # Row b * F + f of this view is the gradient of bag (f, b).
        bag_gradients = grad_output.contiguous().view(-1, batch.dim)
        weight_grad = None
        if ctx.looked_up is not None:
            weight_grad = per_sample_weight_gradients(batch, lookup, bag_gradients, ctx.looked_up)
        row_grads = lookup_row_gradients(batch, lookup, bag_gradients)
        step, make_submission = ctx.step, ctx.make_submission
        # Once per forward.
        ctx.batch = ctx.lookup = ctx.step = ctx.make_submission = ctx.looked_up = None
        step.submit(make_submission(row_grads))
        return None, weight_grad, None, None, None, None

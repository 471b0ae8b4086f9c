"""Table-batched pooled lookup whose backward is the fused CowClip update.

Forward: one ``embedding_bag`` call over all features of a table batch (on CPU,
ATen dispatches sum pooling to FBGEMM's EmbeddingSpMDM kernel), output laid out as
TorchRec's ``KeyedTensor`` values ``[B, F * D]``.
Backward: per-row gradients (:mod:`.row_gradients`), submitted to the lookup's step of
the row-update coordinator (:mod:`.row_updates`), which applies the in-place update
(:mod:`.fused_update`) or holds them for Helen; it returns no gradient, so the weights
never hold a ``.grad``.

Float16 / bfloat16 tables pool in float32 (the native kernel reads the half rows and
accumulates and returns float32; without it, ATen's ``embedding_bag`` pools in the
table's type and the result is widened), so the model above sees float32 either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torchrec.modules.embedding_configs import PoolingType

from torchrec_cowclip.embedding import native
from torchrec_cowclip.embedding.native import use_native_update
from torchrec_cowclip.embedding.row_gradients import (
    RowGradients,
    RowGrouping,
    group_rows,
    sum_row_gradients,
)
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


def _position_weights(lookup: BatchLookup, pooling: PoolingType) -> Optional[Tensor]:
    """Factor each position contributes with: per-sample weight, and 1/len for MEAN."""
    weights = lookup.weights
    if pooling == PoolingType.MEAN:
        lengths = lookup.bag_offsets[1:] - lookup.bag_offsets[:-1]
        inv_len = 1.0 / lengths.clamp_min(1).to(torch.float32)
        per_pos = torch.repeat_interleave(inv_len, lengths, output_size=lookup.row_ids.numel())
        weights = per_pos if weights is None else weights * per_pos
    return weights


def _embedding_bag(
    weight: Tensor, ids: Tensor, offsets: Tensor, mode: str, weights: Optional[Tensor]
) -> Tensor:
    """``[bags, D]`` pooled rows in the compute type: ATen's ``embedding_bag`` (FBGEMM's
    kernel on CPU), or for half tables on CPU the native float32-accumulating lookup."""
    if weight.dtype in (torch.float16, torch.bfloat16):
        if use_native_update(weight.device):
            return native.pooled_lookup(weight, ids, offsets, weights, mode == "mean")
        pooled = F.embedding_bag(
            ids,
            weight,
            offsets,
            mode=mode,
            per_sample_weights=None if weights is None else weights.to(weight.dtype),
            include_last_offset=True,
        )
        return pooled.to(torch.float32)
    return F.embedding_bag(
        ids, weight, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True
    )


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
        pooled = _embedding_bag(batch.weight, ids, batch.unit_offsets(ids.numel()), "sum", weights)
        return pooled.view(b, num_features * batch.dim)
    if batch.pooling == PoolingType.MEAN and lookup.weights is None:
        mode, weights = "mean", None
    else:
        # Weighted MEAN pools sum(w * x) / len, as FBGEMM's TBE does.
        mode, weights = "sum", _position_weights(lookup, batch.pooling)
    pooled = _embedding_bag(batch.weight, lookup.row_ids, lookup.bag_offsets, mode, weights)
    return pooled.view(num_features, b, batch.dim).transpose(0, 1).reshape(b, -1)


def lookup_row_gradients(
    batch: TableBatch, lookup: BatchLookup, grad_output: Tensor
) -> RowGradients:
    """Per distinct row, the gradient ``g_j`` and count ``c_j`` of one forward's lookup,
    from the gradient of its ``[B, F * D]`` pooled output."""
    b, num_features = lookup.batch_size, batch.num_features
    # Row b * F + f of this view is the gradient of bag (f, b).
    bag_gradients = grad_output.contiguous().view(b * num_features, batch.dim)

    def compute() -> RowGrouping:
        bag_of_position = batch.bag_gradient_rows(b)
        if not lookup.single_hot:
            lengths = lookup.bag_offsets[1:] - lookup.bag_offsets[:-1]
            bag_of_position = torch.repeat_interleave(
                bag_of_position, lengths, output_size=lookup.row_ids.numel()
            )
        starts = lookup.bag_offsets[batch.feature_bag_starts(b)]
        return group_rows(
            lookup.row_ids,
            bag_of_position,
            num_rows=batch.weight.shape[0],
            feature_layout=(starts, batch.feature_rows),
        )

    grouping = lookup.grouping.get(compute)
    # The native update sums each row's bag gradients in its own pass over the rows.
    return sum_row_gradients(
        grouping,
        bag_gradients,
        _position_weights(lookup, batch.pooling),
        deferred=use_native_update(grad_output.device),
    )


#: Builds a table batch's :class:`~torchrec_cowclip.embedding.row_updates.Submission`
#: from its row gradients at backward time (the caller binds the key, the fused optimizer's
#: hyperparameters and, for column shards, the whole tables' dims).
MakeSubmission = Callable[[RowGradients], Any]


class RowLookup(torch.autograd.Function):
    """Autograd node of one table batch's lookup: pooled lookup forward; backward hands
    the batch's row gradients to its lookup's step.

    ``anchor`` is the step's zero-size tensor (:class:`~torchrec_cowclip.embedding.row_updates.LookupChannel`):
    taking it as input records the node (the table weights are not autograd inputs, so
    they never hold a ``.grad``) and makes the step's own node run after this backward.
    """

    @staticmethod
    def forward(
        ctx: Any,
        anchor: Tensor,
        batch: TableBatch,
        lookup: BatchLookup,
        step: Any,
        make_submission: MakeSubmission,
    ) -> Tensor:
        ctx.batch, ctx.lookup, ctx.step, ctx.make_submission = batch, lookup, step, make_submission
        lookup.grouping.users += 1
        return pooled_lookup(batch, lookup)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[None, None, None, None, None]:
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
        row_grads = lookup_row_gradients(ctx.batch, ctx.lookup, grad_output)
        step, make_submission = ctx.step, ctx.make_submission
        ctx.batch = ctx.lookup = ctx.step = ctx.make_submission = None  # once per forward
        step.submit(make_submission(row_grads))
        return None, None, None, None, None

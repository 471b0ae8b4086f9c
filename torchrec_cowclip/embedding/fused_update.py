"""The fused CowClip update of a table batch: gather the touched rows, run the
functional step (:mod:`torchrec_cowclip.optim.functional`), scatter them back - one
compiled kernel where it can be built (:mod:`torchrec_cowclip.optim.row_step`).

Every tensor op here is over the ``U`` distinct rows of the batch, for all tables of the
batch at once; the per-table bookkeeping (step counts, clip masks, counters) is done
with ``bucketize``/``bincount`` over those rows, never with a loop over tables.

On CPU (:func:`~.native.use_native_update`) the whole update - the rows' gradient sums
when they were deferred, finiteness, the step and the per-table counts - is one native
kernel call (:func:`.native.fused_update_`) instead.

Tables stored in float16 or bfloat16 are updated in float32 and rounded back
stochastically (:func:`~torchrec_cowclip.optim.functional.stochastic_round`, keyed by
table, step, global row and column: :meth:`.table_batch.TableBatch.rounding_keys`).
"""

from __future__ import annotations

from typing import Optional

import torch

from torchrec_cowclip.embedding import native
from torchrec_cowclip.embedding.native import use_native_update
from torchrec_cowclip.embedding.row_gradients import RowGradients
from torchrec_cowclip.embedding.table_batch import TableBatch
from torchrec_cowclip.optim.functional import RowSums, adam_bias_corrections
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.row_step import row_step_
from torchrec_cowclip.optim.rules import UPDATE_RULES, UpdateRule

#: The update rules the native kernel implements, as registered by the functional core.
_NATIVE_RULES = {name: UPDATE_RULES[name] for name in native.OPTIMIZER_CODES}


@torch.no_grad()
def apply_fused_update_(
    batch: TableBatch,
    row_grads: RowGradients,
    options: CowClipOptions,
    row_sums: Optional[RowSums] = None,
) -> None:
    """Applies one optimizer step to the rows in ``row_grads``, in place on ``batch``.

    ``options`` are the hyperparameters of the batch's fused optimizer as its param group
    holds them now, parsed and validated once while the group is unchanged
    (:meth:`~torchrec_cowclip.optim.fused.CowClipFusedOptimizer.row_options`): a
    schedule's new ``lr`` takes effect, and a bad value raises before any row changes.

    Rows whose gradient is not finite keep their weight and state and are counted in
    ``rows_nonfinite``; the step count of every table in the batch advances by one.

    ``row_sums`` (aligned with ``row_grads.rows``) are the sums over the WHOLE rows when
    the batch's tables are column shards of larger tables: finiteness, the clip norms and
    row-wise Adagrad's row mean are then those of the whole rows, identical on every shard.
    """
    rule = options.rule
    if _NATIVE_RULES.get(rule.name) is rule and use_native_update(batch.weight.device):
        batch.step += 1
        _native_update_(batch, row_grads, options, rule, row_sums)
        return
    rows, counts = row_grads.rows, row_grads.counts
    grad = row_grads.grad
    num_tables = batch.num_tables
    table_of_row = batch.table_of_rows(rows)
    batch.step += 1

    # A NaN or inf anywhere in a row makes its sum non-finite: one reduction instead of
    # an element-wise isfinite pass (docs/performance.md, "Measured reasons behind code choices").
    # A finite row whose sum overflows float32 is skipped too (its norm overflows as well).
    finite = torch.isfinite(grad.sum(dim=1)) if row_sums is None else row_sums.finite
    if bool(finite.all()):
        nonfinite_per_table = torch.zeros(num_tables, dtype=torch.int64, device=rows.device)
    else:
        nonfinite_per_table = torch.bincount(table_of_row[~finite], minlength=num_tables)
        rows, counts, grad, table_of_row = (
            rows[finite],
            counts[finite],
            grad[finite],
            table_of_row[finite],
        )
        if row_sums is not None:
            row_sums = row_sums.select(finite)

    if rows.numel() > 0:
        adam_bias = None
        if rule.adam_bias_corrections:
            # Per table, then gathered per row: no float64 pow per row in the kernel.
            beta1, beta2 = options.betas
            corrections = adam_bias_corrections(batch.step, beta1, beta2, grad.dtype)
            per_row = torch.stack(corrections, dim=1)[table_of_row]  # one gather for both
            adam_bias = (per_row[:, 0], per_row[:, 1])
        rounding = None
        if batch.weight.dtype != torch.float32:
            keys = batch.rounding_keys()[table_of_row]
            rounding = (batch.row_rounding_keys(rows, table_of_row), keys[:, 3])
        clipped = row_step_(
            batch.weight,
            batch.state,
            rows,
            grad,
            counts,
            optimizer=rule,
            **options.hyperparameters(),
            clip_enabled=None if batch.all_clipped else batch.clip_enabled[table_of_row],
            row_sums=row_sums,
            adam_bias=adam_bias,
            rounding=rounding,
        )
    else:
        clipped = torch.zeros(0, dtype=torch.bool, device=rows.device)

    if batch.row_counters is not None:
        batch.row_counters[0].index_add_(0, rows, torch.ones_like(rows))
        clipped_rows = rows[clipped]
        batch.row_counters[1].index_add_(0, clipped_rows, torch.ones_like(clipped_rows))

    # One pass for both counts: bin 2t holds table t's unclipped rows, 2t + 1 its clipped.
    per_table_and_clip = torch.bincount(
        table_of_row * 2 + clipped.to(table_of_row.dtype), minlength=2 * num_tables
    ).view(num_tables, 2)
    last = torch.stack(
        [per_table_and_clip.sum(dim=1), per_table_and_clip[:, 1], nonfinite_per_table]
    )
    batch.counters[:3] = last
    batch.counters[3:] += last


def _native_update_(
    batch: TableBatch,
    row_grads: RowGradients,
    options: CowClipOptions,
    rule: UpdateRule,
    row_sums: Optional[RowSums],
) -> None:
    """:func:`apply_fused_update_` as one native kernel call (the step count already
    advanced)."""
    rows, counts = row_grads.rows, row_grads.counts
    adam_bias = None
    if rule.adam_bias_corrections:
        beta1, beta2 = options.betas
        adam_bias = adam_bias_corrections(batch.step, beta1, beta2, torch.float32)
    packed_sums = None
    if row_sums is not None:
        packed_sums = torch.stack(
            [
                row_sums.nonfinite,
                row_sums.grad_sq,
                row_sums.weight_sq,
                row_sums.grad_dot_weight,
                row_sums.dim.to(row_sums.grad_sq.dtype).expand(rows.shape[0]),
            ],
            dim=1,
        ).to(torch.float32)
    segments = row_grads.segments
    grad = None if segments is not None else row_grads.grad
    cowclip, count_lr = options.cowclip, options.count_lr
    status, per_table = native.fused_update_(
        batch.weight,
        list(batch.state.values()),
        rows,
        counts.to(torch.int64),
        grad=None if grad is None else grad.to(torch.float32),
        bag_gradients=None if segments is None else segments.bag_gradients,
        segment_offsets=None if segments is None else segments.grouping.segment_offsets,
        sorted_bags=None if segments is None else segments.grouping.sorted_bags,
        sorted_weights=None if segments is None else segments.sorted_weights,
        row_offsets=batch.row_offsets,
        clip_enabled=None if batch.all_clipped else batch.clip_enabled,
        adam_bias=adam_bias,
        row_sums=packed_sums,
        rounding=batch.rounding_keys() if batch.weight.dtype != torch.float32 else None,
        optimizer=rule.name,
        lr=options.lr,
        betas=options.betas,
        eps=options.eps,
        weight_decay=options.weight_decay,
        clip=None if cowclip is None else (cowclip.r, cowclip.zeta),
        count_lr=None
        if count_lr is None or count_lr.power == 0.0
        else (count_lr.power, count_lr.cap),
    )
    if batch.row_counters is not None:
        updated = rows[status != native.SKIPPED]
        clipped_rows = rows[status == native.CLIPPED]
        batch.row_counters[0].index_add_(0, updated, torch.ones_like(updated))
        batch.row_counters[1].index_add_(0, clipped_rows, torch.ones_like(clipped_rows))
    batch.counters[:3] = per_table
    batch.counters[3:] += per_table

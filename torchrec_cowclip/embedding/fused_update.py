"""The fused CowClip update of a table batch: gather the touched rows, run the
functional step (:mod:`torchrec_cowclip.optim.functional`), scatter them back - one
compiled kernel where it can be built (:mod:`.row_step`).

Every tensor op here is over the ``U`` distinct rows of the batch, for all tables of the
batch at once; the per-table bookkeeping (step counts, clip masks, counters) is done
with ``bucketize``/``bincount`` over those rows, never with a loop over tables.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from torchrec_cowclip.embedding.row_gradients import RowGradients
from torchrec_cowclip.embedding.row_step import row_step_
from torchrec_cowclip.embedding.table_batch import TableBatch
from torchrec_cowclip.optim.functional import RowSums, adam_bias_corrections, update_rule
from torchrec_cowclip.optim.options import CowClipOptions


@torch.no_grad()
def apply_fused_update_(
    batch: TableBatch,
    row_grads: RowGradients,
    hyper: Mapping[str, Any],
    row_sums: Optional[RowSums] = None,
) -> None:
    """Applies one optimizer step to the rows in ``row_grads``, in place on ``batch``.

    ``hyper`` is the fused optimizer's param group (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``cowclip``, ``count_lr``), read and validated at every step
    (:meth:`CowClipOptions.from_param_group`), so that schedules which edit
    ``param_groups[0]`` take effect and a bad value raises before any row changes.

    Rows whose gradient is not finite keep their weight and state and are counted in
    ``rows_nonfinite``; the step count of every table in the batch advances by one.

    ``row_sums`` (aligned with ``row_grads.rows``) are the sums over the WHOLE rows when
    the batch's tables are column shards of larger tables: finiteness, the clip norms and
    row-wise Adagrad's row mean are then those of the whole rows, identical on every shard.
    """
    options = CowClipOptions.from_param_group(hyper, batch.optimizer)
    rows, counts, grad = row_grads.rows, row_grads.counts, row_grads.grad
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
        if update_rule(batch.optimizer).adam_bias_corrections:
            # Per table, then gathered per row: no float64 pow per row in the kernel.
            beta1, beta2 = options.betas
            corrections = adam_bias_corrections(batch.step, beta1, beta2, grad.dtype)
            per_row = torch.stack(corrections, dim=1)[table_of_row]  # one gather for both
            adam_bias = (per_row[:, 0], per_row[:, 1])
        clipped = row_step_(
            batch.weight,
            batch.state,
            rows,
            grad,
            counts,
            optimizer=batch.optimizer,
            **options.hyperparameters(),
            clip_enabled=None if batch.all_clipped else batch.clip_enabled[table_of_row],
            row_sums=row_sums,
            adam_bias=adam_bias,
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

"""The row kernels: how one table batch groups, sums and updates the rows a batch touched.

A :class:`RowKernel` is chosen once per table batch - when the batch is built or moved to
another device, never per step - by :func:`select_kernel`, from the device, the update rule
and the kernel mode its module was built with (an explicit value, else
``TORCHREC_COWCLIP_COMPILE``: :func:`~torchrec_cowclip.optim.row_step.kernel_mode`):

* :class:`NativeCpuKernel` (kind ``native_cpu``): the native CPU kernels
  (:mod:`.native`): a radix grouping per table, and the update as one pass per table batch
  that sums each row's bag gradients, checks finiteness, clips, steps and counts; half
  tables pooled in float32. The library is built (first use on a machine, with its
  progress line) or loaded when the kernel is made, before any training step;
* :class:`TritonKernel` (kind ``triton``): the same work as Triton kernels
  (:mod:`.triton_ops`) on CUDA - the pooled lookup in one launch per table batch, the
  grouping by torch's radix sort, the fused update in one launch - or on CPU tensors under
  Triton's interpreter (the tests);
* :class:`TorchKernel` (kinds ``inductor`` and ``eager``): torch ops - a stable sort, a
  segment ``embedding_bag`` - and the row step of :mod:`torchrec_cowclip.optim.row_step`,
  compiled by TorchInductor or eager.

Every kernel computes the same update, the functional core's (the tests hold each to it),
but the fused and the torch paths sum in different orders and agree to about 1e-6, not
bit for bit: the sharded collection makes all its ranks use one kind
(``distributed.sharded_collection``), so replicated tables stay identical.

:meth:`RowKernel.update_` is the update of a table batch, the same for every kernel: the
step count, Adam's bias corrections (once per table) and the clip counters around the
kernel's own row loop (:meth:`RowKernel._update_rows_`).
"""

from __future__ import annotations

import abc
import warnings
from typing import Any, Dict, NamedTuple, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from torchrec_cowclip.embedding import native, triton_ops
from torchrec_cowclip.embedding.native import CLIPPED, SKIPPED, UPDATED
from torchrec_cowclip.embedding.row_gradients import (
    RowGradients,
    RowGrouping,
    RowSegments,
    group_rows,
)
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.optim.functional import RowSums, adam_bias_corrections
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.row_step import COMPILE_ENV, row_step, toolchain_available
from torchrec_cowclip.optim.rules import BUILT_IN_RULES, UpdateRule

__all__ = [
    "KINDS",
    "BatchTensors",
    "FusedKernel",
    "NativeCpuKernel",
    "RowKernel",
    "TorchKernel",
    "TritonKernel",
    "kernel_of_kind",
    "select_kernel",
]

#: The kinds of kernel, from the fused ones (native on CPU, Triton on CUDA) to the one every
#: machine can run.
KINDS = ("native_cpu", "triton", "inductor", "eager")

#: The rules the native kernels implement (their ``OPTIMIZER`` codes), as the registry has
#: them; and those the Triton kernels implement (the same codes).
_FUSED_RULES = tuple(rule for rule in BUILT_IN_RULES if rule.name in native.OPTIMIZER_CODES)
_TRITON_RULES = tuple(rule for rule in _FUSED_RULES if rule.name in triton_ops.OPTIMIZERS)

#: Float types whose tables pool in float32 (their rows are widened as they are summed).
_HALF = (torch.float16, torch.bfloat16)


class BatchTensors(Protocol):
    """What a kernel reads and writes of a table batch
    (:class:`~torchrec_cowclip.embedding.table_batch.TableBatch` is one)."""

    weight: Tensor
    step: Tensor
    counters: Tensor
    row_counters: Optional[Tensor]
    row_offsets: Tensor
    clip_enabled: Tensor
    all_clipped: bool
    stochastic_rounding: bool

    @property
    def state(self) -> Dict[str, Tensor]: ...

    @property
    def num_tables(self) -> int: ...

    def table_of_rows(self, rows: Tensor) -> Tensor: ...

    def rounding_keys(self) -> Tensor: ...

    def row_rounding_keys(self, rows: Tensor, table_of_row: Tensor) -> Tensor: ...


class RowLayout(NamedTuple):
    """A table batch's rows as a grouping sees them: how many, and per feature of a lookup
    its first position (``[F + 1]``) and its first row and row count (``[F, 2]``)."""

    num_rows: int
    feature_starts: Tensor
    feature_rows: Tensor


class StepInputs(NamedTuple):
    """What a kernel's row loop steps with, besides the batch (:meth:`RowKernel.update_`'s
    arguments and the Adam bias corrections, ``[T]`` per table)."""

    row_grads: RowGradients
    options: CowClipOptions
    adam_bias: Optional[Tuple[Tensor, Tensor]]
    row_sums: Optional[RowSums]


class RowKernel(abc.ABC):
    """How one table batch's touched rows are grouped, summed and updated (see the module
    docstring).

    Attributes:
        kind: one of :data:`KINDS`.
        sync_free: its lookup, grouping and update read no value back to the host
            (fixed-size groupings, :func:`~.row_gradients.group_rows_padded`): a step
            can be captured in a CUDA graph.
    """

    kind: str
    sync_free: bool = False

    def group_rows(self, row_ids: Tensor, bag_of_position: Tensor, rows: RowLayout) -> RowGrouping:
        """:func:`~.row_gradients.group_rows` of one lookup's row ids (torch's stable radix
        sort: CUB's on CUDA); ``rows.feature_starts`` and ``rows.feature_rows`` let a
        kernel sort table by table."""
        return group_rows(row_ids, bag_of_position, rows.num_rows)

    @abc.abstractmethod
    def row_gradients(self, segments: RowSegments) -> RowGradients:
        """The rows' gradients from their bag gradients: summed now, or left for the
        update to sum in its own pass over the rows (the native kernel)."""

    def pool(
        self, weight: Tensor, ids: Tensor, offsets: Tensor, mode: str, weights: Optional[Tensor]
    ) -> Tensor:
        """``[bags, D]`` pooled rows in the compute type (float32 for half tables):
        ATen's ``embedding_bag`` (FBGEMM's kernel on CPU); half tables pool in their own
        type and are widened."""
        if weight.dtype in _HALF:
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

    @torch.no_grad()
    def update_(
        self,
        batch: BatchTensors,
        row_grads: RowGradients,
        options: CowClipOptions,
        row_sums: Optional[RowSums] = None,
    ) -> None:
        """Applies one optimizer step to the rows in ``row_grads``, in place on ``batch``.

        ``options`` are the hyperparameters of the batch's fused optimizer as its param
        group holds them now, parsed and validated once while the group is unchanged
        (:meth:`~torchrec_cowclip.optim.fused.CowClipFusedOptimizer.row_options`): a
        schedule's new ``lr`` takes effect, and a bad value raises before any row changes.

        Rows whose gradient is not finite keep their weight and state and are counted in
        ``rows_nonfinite``; the step count of every table in the batch advances by one.

        ``row_sums`` (aligned with ``row_grads.rows``) are the sums over the WHOLE rows
        when the batch's tables are column shards of larger tables: finiteness, the clip
        norms and row-wise Adagrad's row mean are then those of the whole rows, identical
        on every shard.
        """
        batch.step += 1
        adam_bias = None
        if options.rule.adam_bias_corrections:
            # Per table, in float64 then float32: no pow per row in the row loop.
            adam_bias = adam_bias_corrections(batch.step, *options.betas)
        status, per_table = self._update_rows_(
            batch, StepInputs(row_grads, options, adam_bias, row_sums)
        )
        if batch.row_counters is not None:
            # Increments of 0 or 1 at every row (padding rows, past the weight, add 0 at
            # its last row): no value read back to the host.
            rows = row_grads.rows.clamp(max=batch.weight.shape[0] - 1)
            updated = ((status == UPDATED) | (status == CLIPPED)).to(torch.int64)
            batch.row_counters[0].index_add_(0, rows, updated)
            batch.row_counters[1].index_add_(0, rows, (status == CLIPPED).to(torch.int64))
        batch.counters[:3] = per_table
        batch.counters[3:] += per_table

    @abc.abstractmethod
    def _update_rows_(self, batch: BatchTensors, step: StepInputs) -> Tuple[Tensor, Tensor]:
        """The step of every row (the batch's step count already advanced; ``step.adam_bias``:
        ``[T]`` per table); returns ``(status [U] int8, per_table [3, T] int64)``: per row
        :data:`~.native.UPDATED`, :data:`~.native.CLIPPED` or :data:`~.native.SKIPPED`
        (non-finite), and per table the rows updated, clipped and skipped."""


class TorchKernel(RowKernel):
    """Torch ops: the stable sort and segment ``embedding_bag`` of :mod:`.row_gradients`,
    then the row step of :mod:`torchrec_cowclip.optim.row_step`, compiled by TorchInductor
    (``compiled=True``, kind ``inductor``) or eager (kind ``eager``). Every device.

    Every tensor op of the update is over the ``U`` distinct rows, for all tables of the
    batch at once; the per-table bookkeeping (bias corrections, clip masks, counters) is
    gathered per row or counted with ``bincount``, never a loop over tables.
    """

    def __init__(self, compiled: bool) -> None:
        self.compiled = compiled
        self.kind = "inductor" if compiled else "eager"
        self._step = row_step(compiled)

    def __repr__(self) -> str:
        return f"TorchKernel(compiled={self.compiled})"

    def row_gradients(self, segments: RowSegments) -> RowGradients:
        g = segments.grouping
        return RowGradients(rows=g.rows, counts=g.counts, grad=segments.sum())

    def _update_rows_(self, batch: BatchTensors, step: StepInputs) -> Tuple[Tensor, Tensor]:
        row_grads, options, adam_bias, row_sums = step
        rows, counts, grad = row_grads.rows, row_grads.counts, row_grads.grad
        table_of_row = batch.table_of_rows(rows)
        # A NaN or inf anywhere in a row makes its sum non-finite: one reduction instead
        # of an element-wise isfinite pass (docs/performance.md, "Measured reasons behind
        # code choices"). A finite row whose sum overflows float32 is skipped too (its
        # norm overflows as well).
        finite = torch.isfinite(grad.sum(dim=1)) if row_sums is None else row_sums.finite
        keep: Optional[Tensor] = None if bool(finite.all()) else finite
        step_rows, step_counts, step_grad, step_tables = rows, counts, grad, table_of_row
        if keep is not None:
            step_rows, step_counts, step_grad, step_tables = (
                rows[keep],
                counts[keep],
                grad[keep],
                table_of_row[keep],
            )
            row_sums = None if row_sums is None else row_sums.select(keep)
        if step_rows.numel() > 0:
            per_row_bias = None
            if adam_bias is not None:
                per_row = torch.stack(adam_bias, dim=1).to(grad.dtype)[step_tables]  # one gather
                per_row_bias = (per_row[:, 0], per_row[:, 1])
            rounding = None
            if batch.weight.dtype != torch.float32 and batch.stochastic_rounding:
                keys = batch.rounding_keys()[step_tables]
                rounding = (batch.row_rounding_keys(step_rows, step_tables), keys[:, 3])
            clipped = self._step(
                batch.weight,
                batch.state,
                step_rows,
                step_grad,
                step_counts,
                optimizer=options.rule,
                **options.hyperparameters(),
                clip_enabled=None if batch.all_clipped else batch.clip_enabled[step_tables],
                row_sums=row_sums,
                adam_bias=per_row_bias,
                rounding=rounding,
            )
        else:
            clipped = torch.zeros(0, dtype=torch.bool, device=rows.device)
        if keep is None:
            status = clipped.to(torch.int8)
        else:
            status = torch.full(rows.shape, SKIPPED, dtype=torch.int8, device=rows.device)
            status[keep] = clipped.to(torch.int8)
        # One pass for the three counts: bin 3t + s holds table t's rows of status s.
        num_tables = batch.num_tables
        by_status = torch.bincount(
            table_of_row * 3 + status.to(table_of_row.dtype), minlength=3 * num_tables
        ).view(num_tables, 3)
        per_table = torch.stack(
            [by_status[:, 0] + by_status[:, 1], by_status[:, 1], by_status[:, 2]]
        )
        return status, per_table


class FusedKernel(RowKernel):
    """Kernels whose update is one fused op over the touched rows (:class:`NativeCpuKernel`,
    :class:`TritonKernel`): the op sums each row's bag gradients in its own pass over the
    rows, so the row gradients stay segments until something else reads them. The op's
    arguments are :func:`.native.update_arguments`'s, for both libraries."""

    #: The module of the op (:mod:`.native` or :mod:`.triton_ops`), looked up per call.
    library: Any

    def row_gradients(self, segments: RowSegments) -> RowGradients:
        return RowGradients(
            rows=segments.grouping.rows, counts=segments.grouping.counts, segments=segments
        )

    def _update_rows_(self, batch: BatchTensors, step: StepInputs) -> Tuple[Tensor, Tensor]:
        row_grads, options, adam_bias, row_sums = step
        rows, counts = row_grads.rows, row_grads.counts
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
        arguments = native.update_arguments(
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
            rounding=batch.rounding_keys()
            if batch.weight.dtype != torch.float32 and batch.stochastic_rounding
            else None,
            optimizer=options.rule.name,
            lr=options.lr,
            betas=options.betas,
            eps=options.eps,
            weight_decay=options.weight_decay,
            clip=None if cowclip is None else (cowclip.r, cowclip.zeta),
            count_lr=None
            if count_lr is None or count_lr.power == 0.0
            else (count_lr.power, count_lr.cap),
        )
        grouping = None if segments is None else segments.grouping
        if grouping is not None and grouping.num_valid is not None:
            padded: Tuple[Tensor, Tensor] = triton_ops.fused_update_padded_(
                *arguments, num_valid=grouping.num_valid, gate=grouping.consumed
            )
            return padded
        result: Tuple[Tensor, Tensor] = self.library.fused_update_(*arguments)
        return result


class NativeCpuKernel(FusedKernel):
    """The native CPU kernels (:mod:`.native`) for the built-in rules; building it builds
    (first use on the machine) or loads the library.

    Raises:
        RuntimeError: the library could not be built or loaded (one line, with why).
    """

    library = native

    def __init__(self) -> None:
        built = native.build()
        if not built.ok:
            raise RuntimeError(
                f"torchrec_cowclip: the native CPU update could not be built: {built.error}"
            )
        self.kind = "native_cpu"

    def __repr__(self) -> str:
        return "NativeCpuKernel()"

    def group_rows(self, row_ids: Tensor, bag_of_position: Tensor, rows: RowLayout) -> RowGrouping:
        largest = torch.iinfo(torch.int32).max
        if rows.num_rows > largest or row_ids.numel() > largest:
            return group_rows(row_ids, bag_of_position, rows.num_rows)  # beyond its int32 keys
        distinct, counts, segment_offsets, order, sorted_bags = native.group_rows(
            row_ids, bag_of_position, rows.num_rows, rows.feature_starts, rows.feature_rows
        )
        return RowGrouping(distinct, counts, segment_offsets, order, sorted_bags)

    def pool(
        self, weight: Tensor, ids: Tensor, offsets: Tensor, mode: str, weights: Optional[Tensor]
    ) -> Tensor:
        if weight.dtype in _HALF:
            return native.pooled_lookup(weight, ids, offsets, weights, mode == "mean")
        return super().pool(weight, ids, offsets, mode, weights)


class TritonKernel(FusedKernel):
    """The Triton kernels (:mod:`.triton_ops`) for the built-in rules, on CUDA (or on CPU
    tensors under Triton's interpreter, ``TRITON_INTERPRET=1``): the pooled lookup of a
    table batch in one launch, the grouping by torch's radix sort (as FBGEMM's backward
    groups with CUB's), then the fused update in one launch after its index checks. Design
    notes: ``docs/triton.md``.

    Args:
        device: where its table batches live (refused in one line where Triton cannot run).
    """

    library = triton_ops
    sync_free = True

    def __init__(self, device: torch.device) -> None:
        reason = triton_ops.availability(device)
        if reason is not None:
            raise RuntimeError(f"torchrec_cowclip: the Triton row kernel cannot run: {reason}")
        self.kind = "triton"

    def __repr__(self) -> str:
        return "TritonKernel()"

    def pool(
        self, weight: Tensor, ids: Tensor, offsets: Tensor, mode: str, weights: Optional[Tensor]
    ) -> Tensor:
        return triton_ops.pooled_lookup(weight, ids, offsets, weights, mode == "mean")


def kernel_of_kind(kind: str, device: torch.device) -> RowKernel:
    """A kernel of ``kind`` (:data:`KINDS`) for ``device``; ``native_cpu`` builds or loads
    the library, ``triton`` needs Triton where it can run (RuntimeError if either cannot)."""
    if kind == "native_cpu":
        return NativeCpuKernel()
    if kind == "triton":
        return TritonKernel(device)
    if kind in ("inductor", "eager"):
        return TorchKernel(compiled=kind == "inductor")
    raise ValueError(f"unknown row kernel kind {kind!r}; expected one of {KINDS}")


def select_kernel(device: torch.device, rule: UpdateRule, mode: str) -> RowKernel:
    """The row kernel of a table batch on ``device`` trained by ``rule``, as the kernel
    ``mode`` says (:func:`~torchrec_cowclip.optim.row_step.kernel_mode`: resolved once,
    when the module was built):

    * ``auto``: for a built-in rule, on CPU the native kernels, on CUDA the Triton kernels;
      if the native ones cannot be built, a warning naming the error and the Inductor row
      step (eager without a C++ compiler); without Triton on CUDA, the eager row step; a
      rule of one's own, Inductor where it can build, else eager;
    * ``1``: the same, but a failed native build or a missing Triton raises;
    * ``triton``: the Triton kernels on every device - on a CPU only under Triton's
      interpreter (``TRITON_INTERPRET=1``), else a one-line refusal;
    * ``inductor``: the Inductor row step; ``0``: eager.

    A table batch on the meta device gets the eager kernel (it never runs there; the move
    off it chooses again).

    Example::

        >>> from torchrec_cowclip.optim.rules import update_rule
        >>> select_kernel(torch.device("cpu"), update_rule("adam"), "0")
        TorchKernel(compiled=False)
    """
    if device.type == "meta" or mode == "0":
        return TorchKernel(compiled=False)
    if mode == "inductor":
        return TorchKernel(compiled=True)
    built_in = rule in _FUSED_RULES
    if mode == "triton":
        if rule not in _TRITON_RULES:
            raise ConfigError(
                f"the environment variable {COMPILE_ENV}=triton: the Triton kernels implement the "
                f"built-in rules ({', '.join(r.name for r in _TRITON_RULES)}), not {rule.name!r}; use "
                f"{COMPILE_ENV}=inductor or 0 for it"
            )
        reason = triton_ops.availability(device)
        if reason is not None:
            raise ConfigError(f"the environment variable {COMPILE_ENV}=triton: {reason}")
        return TritonKernel(device)
    if device.type == "cpu" and built_in:
        built = native.build()
        if built.ok:
            return NativeCpuKernel()
        if mode == "1":
            raise RuntimeError(
                f"torchrec_cowclip: the native CPU update is required ({COMPILE_ENV}=1) "
                f"but could not be built: {built.error}"
            )
        compiled = toolchain_available("cpu")
        warnings.warn(
            f"torchrec_cowclip: building the native CPU update failed ({built.error}); the "
            f"CPU update uses the {'Inductor-compiled' if compiled else 'eager'} row step "
            f"(same math, slower). {COMPILE_ENV}=0 skips the attempt.",
            RuntimeWarning,
            stacklevel=2,
        )
        return TorchKernel(compiled=compiled)
    if device.type == "cuda" and rule in _TRITON_RULES:
        reason = triton_ops.availability(device)
        if reason is None:
            return TritonKernel(device)
        if mode == "1":
            raise RuntimeError(
                f"torchrec_cowclip: the Triton update is required ({COMPILE_ENV}=1) but "
                f"cannot run: {reason}"
            )
        return TorchKernel(compiled=False)
    return TorchKernel(compiled=mode == "1" or toolchain_available(device.type))

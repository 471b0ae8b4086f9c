"""Helen's two-pass step on fused, table-batched embeddings (one driver for the unsharded
and the sharded collection).

Per step (``docs/algorithm.md``, "Helen"):

1. the closure's forward and a backward into everything: every dense parameter's
   ``.grad`` receives this first gradient as in a plain step; the table batches hand in
   their per-row gradients and counts, which are *held*, not applied;
2. per table batch, one fused perturbation of the touched rows,
   ``W[j] += e_j`` (:func:`~torchrec_cowclip.optim.functional.helen_perturbation`), with
   each table's ``||G||_F`` and ``max_k n_k`` combined over every block of it (row and
   column shards, via :meth:`HelenTarget.reduce_table_statistics`); the touched rows'
   weights are kept, not recomputed, so restoring them is exact;
3. the closure's forward again and a backward into the tables only (``inputs=``), so the
   dense ``.grad`` keep the first pass's gradient (with ``Helen(perturb_dense=True)`` the
   dense parameters are perturbed too, SAM-style, and take the second gradient);
4. the touched rows are restored and take their update (Adam / row-wise Adagrad / SGD,
   CowClip optional) with the second gradient, through the same fused update as a plain
   step.

Nothing is updated until the second backward has finished: an error in either pass
restores the weights and leaves the optimizer state as it was.
"""

from __future__ import annotations

import abc
import enum
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.embedding.row_gradients import RowGradients
from torchrec_cowclip.embedding.table_batch import TableBatch
from torchrec_cowclip.optim.config import Helen
from torchrec_cowclip.optim.functional import (
    helen_perturbation,
    helen_table_statistics,
    sam_perturbations,
)


class HelenPass(enum.Enum):
    """Which pass of a Helen step a backward belongs to."""

    ASCENT = "ascent"  # at W: gradients are held to build the perturbation
    DESCENT = "descent"  # at W + e: gradients are held for the update


@dataclass
class HeldRows:
    """One table batch's row gradients of one pass.

    Attributes:
        key: identifies the lookup and batch, the same in both passes.
        batch: the table batch the rows belong to.
        row_grads: the rows, their counts and gradients.
        table_index: ``[T]`` int64 position of each of the batch's tables in the
            module's table list (all tables, on every rank).
        counts_in_norm: whether this block's squared gradients count towards its table's
            norm (False for a data-parallel replica on all ranks but one, whose union
            gradient another rank already counts).
        local_rows: the rows this rank's backward handed in (``row_grads.rows`` unless
            those are the union of all replicas' rows); both passes must hand in the same.
    """

    key: Tuple[int, ...]
    batch: TableBatch
    row_grads: RowGradients
    table_index: Tensor
    counts_in_norm: bool = True
    local_rows: Optional[Tensor] = None

    def handed_in_rows(self) -> Tensor:
        return self.row_grads.rows if self.local_rows is None else self.local_rows


@dataclass
class HelenCost:
    """Seconds of one Helen step: the first pass (closure + backward) and what Helen adds
    (perturbation, second pass, restore) - the update itself is in neither."""

    first_pass_s: float
    extra_s: float


class TablePositions:
    """Each table's position in a module's table list (the same list on every rank), and
    per table batch the ``[T]`` int64 positions of its tables (:attr:`HeldRows.table_index`),
    built once per batch and device. A shard's table-batch name is its table's name, so
    column shards of one table share its position."""

    def __init__(self, table_names: Sequence[str]) -> None:
        self._position = {name: i for i, name in enumerate(table_names)}
        self._of_batch: Dict[Tuple[int, torch.device], Tensor] = {}

    def __len__(self) -> int:
        return len(self._position)

    def of_batch(self, batch: TableBatch) -> Tensor:
        key = (id(batch), batch.weight.device)
        index = self._of_batch.get(key)
        if index is None:
            index = torch.tensor(
                [self._position[name] for name in batch.table_names],
                dtype=torch.int64,
                device=batch.weight.device,
            )
            self._of_batch[key] = index
        return index


class HelenTarget(abc.ABC):
    """What :func:`helen_step` needs of an embedding module."""

    @abc.abstractmethod
    def hold(self, phase: Optional[HelenPass]) -> None:
        """From now on, backward hands its row gradients to :meth:`held` (None: stop)."""

    @abc.abstractmethod
    def held(self) -> List[HeldRows]:
        """The row gradients handed in since :meth:`hold`, in the same order on every
        rank (a sharded module communicates here if its sharding type needs to)."""

    @abc.abstractmethod
    def backward_inputs(self) -> List[Tensor]:
        """The tensors a backward into the tables only must name as ``inputs``."""

    @abc.abstractmethod
    def num_tables(self) -> int:
        """Length of the module's table list (:attr:`HeldRows.table_index`)."""

    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the tables (and their statistics) live."""

    def reduce_table_statistics(self, sq_norm: Tensor, max_count: Tensor) -> None:
        """Combines the per-table statistics of all blocks in place (sum, max); the
        unsharded module has every block already."""

    @abc.abstractmethod
    def apply_updates(self, descent: List[HeldRows]) -> None:
        """Applies the update of the second pass's held row gradients."""


def perturb_rows_(
    target: HelenTarget,
    ascent: Sequence[HeldRows],
    helen: Helen,
    saved: List[Tuple[TableBatch, Tensor, Tensor]],
) -> None:
    """Adds Helen's perturbation to every held block's rows, appending to ``saved``, per
    block and before it is changed, the ``(batch, rows, weights before)`` that
    :func:`restore_rows_` puts back. Every rank calls
    :meth:`HelenTarget.reduce_table_statistics`, with or without rows of its own."""
    device = target.device()
    # FP32 tables only (the collection refuses others).
    sq_norm = torch.zeros(target.num_tables(), dtype=torch.float32, device=device)
    max_count = torch.zeros(target.num_tables(), dtype=torch.int64, device=device)
    row_tables: List[Tensor] = []
    for held in ascent:
        rg = held.row_grads
        tables = held.table_index[held.batch.table_of_rows(rg.rows)]
        row_tables.append(tables)
        sq, most = helen_table_statistics(
            rg.grad, rg.counts.to(torch.int64), tables, target.num_tables()
        )
        if held.counts_in_norm:
            sq_norm += sq
        torch.maximum(max_count, most, out=max_count)
    target.reduce_table_statistics(sq_norm, max_count)
    with torch.no_grad():
        for held, tables in zip(ascent, row_tables):
            rg = held.row_grads
            weight = held.batch.weight
            saved.append((held.batch, rg.rows, weight.index_select(0, rg.rows)))
            perturbation = helen_perturbation(
                rg.grad,
                rg.counts,
                sq_norm[tables],
                max_count[tables],
                rho=helen.rho,
                bound=helen.bound,
            )
            weight.index_add_(0, rg.rows, perturbation.to(weight.dtype))


def restore_rows_(saved: Sequence[Tuple[TableBatch, Tensor, Tensor]]) -> None:
    """Puts back the weights :func:`perturb_rows_` kept (exactly, not ``W + e - e``)."""
    with torch.no_grad():
        for batch, rows, before in saved:
            batch.weight.index_copy_(0, rows, before)


@contextmanager
def holding(target: HelenTarget, phase: HelenPass) -> Iterator[None]:
    """Backward passes inside the block hold their row gradients for ``phase``."""
    target.hold(phase)
    try:
        yield
    finally:
        target.hold(None)


def _scalar_loss(value: object, which: str) -> Tensor:
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise TypeError(
            f"helen_step: the closure must return the scalar loss tensor (without calling "
            f"backward); its {which} call returned {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, Tensor) else "")
        )
    if not value.requires_grad:
        raise RuntimeError(
            f"helen_step: the loss of the closure's {which} call does not require grad "
            "(called under torch.no_grad()?)"
        )
    return value


def _dense_parameters(helen: Helen, dense_params: Optional[Sequence[Tensor]]) -> List[Tensor]:
    if helen.perturb_dense and dense_params is None:
        raise ValueError(
            "Helen(perturb_dense=True) perturbs the dense parameters: pass them, "
            "helen_step(closure, dense_params=model.dense_parameters())"
        )
    if not helen.perturb_dense and dense_params is not None:
        raise ValueError(
            "helen_step(dense_params=...) is for Helen(perturb_dense=True); with "
            "perturb_dense=False the dense parameters keep the first pass's gradient"
        )
    params = [p for p in (dense_params or ()) if p.requires_grad]
    return params


def _check_same_rows(ascent: Sequence[HeldRows], descent: Sequence[HeldRows]) -> None:
    first = {h.key: h.handed_in_rows() for h in ascent}
    for held in descent:
        rows = first.get(held.key)
        if rows is None or not torch.equal(rows, held.handed_in_rows()):
            raise RuntimeError(
                f"helen_step: the closure's second call looked up other rows than its "
                f"first (table batch {held.key}, tables {held.batch.table_names}); it must "
                "evaluate the same batch both times"
            )


def helen_step(
    target: HelenTarget,
    helen: Optional[Helen],
    closure: Callable[[], Tensor],
    dense_params: Optional[Iterable[Tensor]] = None,
) -> Tuple[Tensor, HelenCost]:
    """One Helen step of ``target`` (see the module docstring); returns the first pass's
    loss, detached, and the step's :class:`HelenCost`.

    Raises:
        RuntimeError: ``helen`` is None (the module trains with one pass).
    """
    if helen is None:
        raise RuntimeError(
            "helen_step needs a collection built with helen=Helen(...); this one "
            "trains with one pass: call loss.backward()"
        )
    params = _dense_parameters(helen, None if dense_params is None else list(dense_params))
    t0 = time.perf_counter()
    with holding(target, HelenPass.ASCENT):
        loss = _scalar_loss(closure(), "first")
        torch.autograd.backward(loss)
        ascent = target.held()
    t1 = time.perf_counter()
    saved: List[Tuple[TableBatch, Tensor, Tensor]] = []
    dense_saved: List[Tuple[Tensor, Tensor]] = []
    first_grads = [p.grad for p in params]
    try:
        perturb_rows_(target, ascent, helen, saved)
        if params:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            with torch.no_grad():
                for p, e in zip(params, sam_perturbations(grads, helen.rho)):
                    dense_saved.append((p, p.detach().clone()))
                    p.add_(e)
                    p.grad = None  # the second pass's gradient replaces the first
        with holding(target, HelenPass.DESCENT):
            second = _scalar_loss(closure(), "second")
            torch.autograd.backward(second, inputs=target.backward_inputs() + params)
            descent = target.held()
    except BaseException:
        for p, grad in zip(params, first_grads):
            p.grad = grad  # a failed step leaves the first pass's gradients
        raise
    finally:
        restore_rows_(saved)
        with torch.no_grad():
            for p, before in dense_saved:
                p.copy_(before)
    _check_same_rows(ascent, descent)
    t2 = time.perf_counter()
    target.apply_updates(descent)
    return loss.detach(), HelenCost(first_pass_s=t1 - t0, extra_s=t2 - t1)

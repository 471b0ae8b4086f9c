"""The pieces of Helen's two-pass step that act on held rows: the perturbation between
the passes and its exact undoing (the step itself is a mode of the row-update coordinator,
:meth:`~torchrec_cowclip.embedding.row_updates.RowUpdates.helen_step`).

Per table batch, the touched rows are perturbed by ``W[j] += e_j``
(:func:`~torchrec_cowclip.optim.functional.helen_perturbation`), with each table's
``||G||_F`` and ``max_k n_k`` combined over every block of it (row and column shards,
replicas); the rows' weights before are kept, not recomputed, so restoring them is exact.
With ``Helen(perturb_dense=True)`` the dense parameters are perturbed too, SAM-style
(:func:`~torchrec_cowclip.optim.functional.sam_perturbations`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.embedding.row_gradients import RowGradients
from torchrec_cowclip.embedding.table_batch import TableBatch
from torchrec_cowclip.optim.functional import (
    helen_perturbation,
    helen_table_statistics,
    sam_perturbations,
)
from torchrec_cowclip.optim.options import Helen


@dataclass
class HeldRows:
    """One table batch's row gradients of one pass.

    Attributes:
        key: identifies the lookup and batch, the same in both passes.
        batch: the table batch the rows belong to.
        row_grads: the rows, their counts and the gradients they are perturbed along.
        table_index: ``[T]`` int64 position of each of the batch's tables in the
            collection's table list (all tables, on every rank).
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


class TablePositions:
    """Each table's position in a collection's table list (the same list on every rank),
    and per table batch the ``[T]`` int64 positions of its tables (:attr:`HeldRows.table_index`),
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


def perturb_rows_(
    ascent: Sequence[HeldRows],
    helen: Helen,
    positions: TablePositions,
    device: torch.device,
    reduce: Optional[Callable[[Tensor, Tensor], None]],
    saved: List[Tuple[TableBatch, Tensor, Tensor]],
) -> None:
    """Adds Helen's perturbation to every held block's rows, appending to ``saved``, per
    block and before it is changed, the ``(batch, rows, weights before)`` that
    :func:`restore_rows_` puts back. ``reduce`` (a sharded collection's) runs on every
    rank, with or without rows of its own."""
    # Float32, as the row gradients are (FP16/BF16 tables step in float32 too).
    sq_norm = torch.zeros(len(positions), dtype=torch.float32, device=device)
    max_count = torch.zeros(len(positions), dtype=torch.int64, device=device)
    row_tables: List[Tensor] = []
    for held in ascent:
        rg = held.row_grads
        tables = held.table_index[held.batch.table_of_rows(rg.rows)]
        row_tables.append(tables)
        sq, most = helen_table_statistics(
            rg.grad, rg.counts.to(torch.int64), tables, len(positions)
        )
        if held.counts_in_norm:
            sq_norm += sq
        torch.maximum(max_count, most, out=max_count)
    if reduce is not None:
        reduce(sq_norm, max_count)
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
def perturbed(
    ascent: Sequence[HeldRows],
    helen: Helen,
    dense_params: List[Tensor],
    positions: TablePositions,
    device: torch.device,
    reduce: Optional[Callable[[Tensor, Tensor], None]],
) -> Iterator[None]:
    """Inside the block the held rows (and, with ``Helen(perturb_dense=True)``, the dense
    parameters, whose ``.grad`` is then cleared for the second pass) are perturbed; after
    it they are restored exactly, and on an error the dense parameters get their first
    pass's gradients back."""
    saved: List[Tuple[TableBatch, Tensor, Tensor]] = []
    dense_saved: List[Tuple[Tensor, Tensor]] = []
    first_grads = [p.grad for p in dense_params]
    try:
        perturb_rows_(ascent, helen, positions, device, reduce, saved)
        if dense_params:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense_params]
            with torch.no_grad():
                for p, e in zip(dense_params, sam_perturbations(grads, helen.rho)):
                    dense_saved.append((p, p.detach().clone()))
                    p.add_(e)
                    p.grad = None  # the second pass's gradient replaces the first
        yield
    except BaseException:
        for p, grad in zip(dense_params, first_grads):
            p.grad = grad  # a failed step leaves the first pass's gradients
        raise
    finally:
        restore_rows_(saved)
        with torch.no_grad():
            for p, before in dense_saved:
                p.copy_(before)


def scalar_loss(value: object, which: str) -> Tensor:
    """``value`` if it is the scalar loss tensor a closure must return, else TypeError."""
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


def dense_parameters(helen: Helen, dense_params: Optional[Sequence[Tensor]]) -> List[Tensor]:
    """The dense parameters Helen perturbs (those that require grad), or ValueError when
    they are given without ``Helen(perturb_dense=True)`` or missing with it."""
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
    return [p for p in (dense_params or ()) if p.requires_grad]


def check_same_rows(ascent: Sequence[HeldRows], descent: Sequence[HeldRows]) -> None:
    """RuntimeError unless the second pass handed in the first pass's rows."""
    first = {h.key: h.handed_in_rows() for h in ascent}
    for held in descent:
        rows = first.get(held.key)
        if rows is None or not torch.equal(rows, held.handed_in_rows()):
            raise RuntimeError(
                f"helen_step: the closure's second call looked up other rows than its "
                f"first (table batch {held.key}, tables {held.batch.table_names}); it must "
                "evaluate the same batch both times"
            )

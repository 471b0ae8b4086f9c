"""When and how a sharded lookup applies its fused CowClip updates.

A TorchRec lookup runs several kernels (one per group of tables of the same pooling);
each kernel's backward yields the row gradients of its table batches. Column-sharded
and data-parallel tables must then talk to other ranks (:mod:`.comm`), and a rank's
kernels differ from its peers' (they hold different tables), so if each kernel talked
from its own backward, two ranks could enter their collectives in different orders.
Instead the kernels only hand in their row gradients, and one autograd node per
lookup forward - whose output every kernel of the lookup takes as input, so autograd
runs it after all of them - applies the updates of the whole lookup at once, with the
communication in a fixed order (:class:`RowSync`).

Rules per sharding type:

* table-wise (:class:`LocalRows`): the owning rank has the whole rows and, after
  TorchRec's input all-to-all, every occurrence in the global batch: the unsharded
  update (:func:`~torchrec_cowclip.embedding.fused_update.apply_fused_update_`) as is;
* column-wise (:class:`ColumnShardRows`): the same update, with the finiteness, the
  clip norms and row-wise Adagrad's ``mean(g**2)`` taken over the whole rows, summed
  across the shards;
* data-parallel (:class:`ReplicatedRows`): every replica applies the update of the union
  of all replicas' rows, counts summed and gradients averaged (summed when TorchRec's
  gradient division is off) - the convention TorchRec applies to sharded tables and DDP
  to dense parameters, so a model whose ranks each minimise their local mean loss
  trains on the gradient of the global mean loss.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torchrec.distributed.comm_ops import get_gradient_division

from torchrec_cowclip.distributed.comm import ColumnShardGroups, all_gather_row_gradients
from torchrec_cowclip.embedding.fused_update import apply_fused_update_
from torchrec_cowclip.embedding.row_gradients import RowGradients, aggregate_row_gradients
from torchrec_cowclip.embedding.table_batch import TableBatch
from torchrec_cowclip.optim.config import Helen
from torchrec_cowclip.optim.functional import RowSums, partial_row_sums


@dataclass
class Submission:
    """One table batch's row gradients from one kernel backward.

    Attributes:
        key: ``(kernel index in the lookup, batch index in the kernel)``; submissions
            are applied in this order, the same on every rank.
        batch: the table batch to update.
        row_grads: its rows' gradients and counts for this step.
        hyperparameters: the kernel's fused optimizer param group (``lr``, ...).
        whole_dims: ``[T]`` embedding dim of the whole table of each of the batch's
            tables (larger than the batch's dim for column shards).
    """

    key: Tuple[int, int]
    batch: TableBatch
    row_grads: RowGradients
    hyperparameters: Mapping[str, Any]
    whole_dims: Tensor


class RowSync(abc.ABC):
    """Applies one lookup step's submissions, communicating as its sharding type needs."""

    @abc.abstractmethod
    def apply(self, submissions: List[Submission]) -> None:
        """Updates every submitted batch; ``submissions`` are in canonical order."""

    def perturbation_rows(self, submissions: List[Submission]) -> List[Tuple[RowGradients, bool]]:
        """Per submission, the row gradients Helen perturbs its rows along, and whether
        their squares count towards the table's norm on this rank: the local ones, for
        shards whose rows or columns no other rank holds."""
        return [(sub.row_grads, True) for sub in submissions]


class LocalRows(RowSync):
    """Table-wise tables: the owning rank has whole rows and global counts."""

    def apply(self, submissions: List[Submission]) -> None:
        for sub in submissions:
            apply_fused_update_(sub.batch, sub.row_grads, sub.hyperparameters)


class ColumnShardRows(RowSync):
    """Column-wise tables: whole-row sums across the shards, then the update per shard.

    Every shard of a table sees the same ids (TorchRec's input dist sends a table's
    features to each of its column shards), so its distinct rows are identical, in the
    same (ascending) order, on every shard; the shards' per-row partial sums add up.
    """

    def __init__(self, groups: ColumnShardGroups) -> None:
        self._groups = groups

    def apply(self, submissions: List[Submission]) -> None:
        partials: Dict[str, Tensor] = {}
        for sub in submissions:
            rows, grad = sub.row_grads.rows, sub.row_grads.grad
            # In the update's float32, also for half tables.
            weight = sub.batch.weight.index_select(0, rows).to(grad.dtype)
            part = partial_row_sums(grad, weight)
            for name, segment in zip(sub.batch.table_names, _table_segments(sub.batch, rows, part)):
                if name not in partials:
                    partials[name] = segment
                elif partials[name].shape != segment.shape:
                    raise RuntimeError(
                        f"two column shards of table '{name}' on this rank saw different "
                        f"rows ({partials[name].shape[0]} vs {segment.shape[0]})"
                    )
                else:
                    # Several shards of one table on this rank: add them up before the
                    # ranks do.
                    partials[name] = partials[name] + segment
        totals = self._groups.all_reduce_by_table(partials)
        for sub in submissions:
            rows = sub.row_grads.rows
            # Tables are ascending row ranges of the batch, so their totals in table
            # order line up with the rows (a table's shards each get the table's total).
            sums = torch.cat([totals[name] for name in sub.batch.table_names])
            dims = sub.whole_dims[sub.batch.table_of_rows(rows)]
            apply_fused_update_(
                sub.batch, sub.row_grads, sub.hyperparameters, RowSums.from_sums(sums, dims)
            )


def _table_segments(batch: TableBatch, rows: Tensor, per_row: Tensor) -> List[Tensor]:
    """``per_row`` split into the batch's tables (rows are ascending, tables are ranges)."""
    bounds = torch.searchsorted(rows, batch.row_offsets).tolist()
    return [per_row[bounds[i] : bounds[i + 1]] for i in range(batch.num_tables)]


class ReplicatedRows(RowSync):
    """Data-parallel tables: every replica applies the update of all replicas' union."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self._pg = pg

    def apply(self, submissions: List[Submission]) -> None:
        if not submissions:
            return
        gathered = all_gather_row_gradients([s.row_grads for s in submissions], self._pg)
        world = dist.get_world_size(self._pg)
        scale = 1.0 / world if get_gradient_division() else 1.0
        for sub, per_rank in zip(submissions, gathered):
            apply_fused_update_(
                sub.batch, union_row_gradients(per_rank, scale), sub.hyperparameters
            )

    def perturbation_rows(self, submissions: List[Submission]) -> List[Tuple[RowGradients, bool]]:
        """The union of all replicas' rows (as the update uses), so that every replica
        perturbs alike; rank 0 alone counts it towards the table's norm."""
        if not submissions:
            return []
        gathered = all_gather_row_gradients([s.row_grads for s in submissions], self._pg)
        scale = 1.0 / dist.get_world_size(self._pg) if get_gradient_division() else 1.0
        first = dist.get_rank(self._pg) == 0
        return [(union_row_gradients(per_rank, scale), first) for per_rank in gathered]


def union_row_gradients(per_rank: List[RowGradients], scale: float = 1.0) -> RowGradients:
    """One :class:`RowGradients` for the rows of all ranks: counts summed, gradients
    summed times ``scale``.

    The sum runs in rank order through the same sorted segment sum as the unsharded
    backward, so every replica computes bit-identical updates and the replicas never
    drift apart.
    """
    rows = torch.cat([p.rows for p in per_rank])
    grad = torch.cat([p.grad for p in per_rank])
    counts = torch.cat([p.counts for p in per_rank])
    position = torch.arange(rows.numel(), device=rows.device)
    union = aggregate_row_gradients(rows, grad.contiguous(), position)
    union_counts = torch.zeros_like(union.rows).index_add_(
        0, torch.searchsorted(union.rows, rows), counts
    )
    if scale != 1.0:
        union.grad.mul_(scale)
    return RowGradients(rows=union.rows, counts=union_counts, grad=union.grad)


@dataclass
class HeldStep:
    """A lookup step's submissions, held for Helen instead of applied."""

    sync: RowSync
    submissions: List[Submission]


class PendingStep:
    """The submissions of one forward of a lookup, applied once, when all are in (or,
    inside a Helen step, handed to its owner's ``held`` list)."""

    def __init__(self, sync: RowSync, owner: "DeferredUpdates") -> None:
        self._sync = sync
        self._owner = owner
        self._submissions: List[Submission] = []
        self._applied = False

    def submit(self, submission: Submission) -> None:
        if self._applied:
            raise RuntimeError(
                "a sharded CowClip kernel ran backward after its lookup's update was "
                "applied (retain_graph=True, or a kernel called outside its lookup?); "
                "the fused update applies exactly once per forward"
            )
        self._submissions.append(submission)

    def apply(self) -> None:
        if self._applied:
            raise RuntimeError(
                "a second backward reached the same sharded CowClip lookup "
                "(retain_graph=True?); the fused update applies exactly once per forward"
            )
        self._applied = True
        submissions = sorted(self._submissions, key=lambda s: s.key)
        self._submissions = []
        owner = self._owner
        if owner.held is not None:
            owner.held.append(HeldStep(self._sync, submissions))
        elif owner.helen is not None:
            raise RuntimeError(
                f"this sharded CowClip collection is trained by Helen ({owner.helen}): call "
                "loss = sharded_ebc.helen_step(closure) instead of loss.backward() (nothing "
                "was updated)"
            )
        else:
            self._sync.apply(submissions)


class _ApplyPendingStep(torch.autograd.Function):
    """Autograd node whose backward applies a lookup step's updates.

    Its zero-size output is an input of every kernel lookup of that forward, so autograd
    runs this backward only after every kernel's backward has submitted.
    """

    @staticmethod
    def forward(ctx: Any, leaf: Tensor, step: PendingStep) -> Tensor:
        ctx.step = step
        return leaf.detach().clone()

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> Tuple[None, None]:
        ctx.step.apply()
        return None, None


class DeferredUpdates:
    """Per lookup: the step its kernels submit to, renewed at every forward.

    Example (what :class:`~torchrec_cowclip.distributed.lookup.CowClipPooledEmbeddingsLookup`
    and its kernels do)::

        updates = DeferredUpdates(LocalRows(), device)
        updates.begin_forward()                  # in the lookup's forward
        anchor, step = updates.current()         # in each kernel's forward
        ...                                      # kernel backward: step.submit(...)
    """

    def __init__(self, sync: RowSync, device: torch.device, helen: Optional[Helen] = None) -> None:
        self.sync = sync
        self.leaf = torch.zeros(0, device=device, requires_grad=True)
        self._anchor: Tensor = self.leaf
        self._step: Optional[PendingStep] = None
        #: Helen's settings when the tables train by ``helen_step`` (a plain backward
        #: then raises); and, during one of its passes, where the steps are held.
        self.helen = helen
        self.held: Optional[List[HeldStep]] = None

    def begin_forward(self) -> None:
        """Starts the step of a new forward (none when autograd is off: no update)."""
        if torch.is_grad_enabled():
            self._step = PendingStep(self.sync, self)
            self._anchor = _ApplyPendingStep.apply(self.leaf, self._step)
        else:
            self._step, self._anchor = None, self.leaf

    def current(self) -> Tuple[Tensor, Optional[PendingStep]]:
        """The anchor kernel lookups must take as autograd input, and the step."""
        return self._anchor, self._step

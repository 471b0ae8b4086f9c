"""Every touched-row update of a CowClip collection, sharded or not, goes through here.

A collection owns one :class:`RowUpdates`. Each of its lookups - the unsharded
collection has one, a sharded collection one per sharding type - owns a
:class:`LookupChannel` with the :class:`RowSync` strategy of its tables: whole rows on this
rank (:class:`LocalRows`), column shards whose norms add up over ranks, or data-parallel
replicas that apply the union of all ranks' rows (``distributed.row_sync``). A plain step
and a Helen step both run:

1. ``channel.begin_forward()`` at the start of the lookup's forward: a new
   :class:`LookupStep`, and the zero-size *anchor* every table batch's lookup of that
   forward takes as autograd input (:class:`~torchrec_cowclip.embedding.row_lookup.RowLookup`);
2. each table batch's backward submits its row gradients (a :class:`Submission`) to the step;
3. autograd runs the step's own node after all of them (every lookup took its anchor),
   which hands the step to :meth:`RowUpdates.take`; it takes the submissions, in key order
   (the same on every rank), and does what the mode says:

   * ``APPLY`` (a plain ``loss.backward()``): the channel's strategy applies them
     (one call of each table batch's row kernel, :meth:`RowKernel.update_
     <torchrec_cowclip.embedding.row_kernels.RowKernel.update_>`);
   * ``HOLD_ASCENT`` / ``HOLD_DESCENT`` (the two passes of :meth:`RowUpdates.helen_step`):
     they are held; between the passes the held rows are perturbed
     (:mod:`.helen`), after the second the rows are restored and the held descent steps
     applied exactly as ``APPLY`` would have applied them.

A module trained by Helen refuses ``APPLY`` (a plain backward updates nothing and raises).

Example::

    >>> import torch
    >>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    >>> from torchrec_cowclip import CowClipEmbeddingBagCollection, CowClipOptions, Helen
    >>> ebc = CowClipEmbeddingBagCollection(
    ...     [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
    ...                         feature_names=["f"])], CowClipOptions(helen=Helen()))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    >>> step = ebc.row_updates.helen_step(lambda: ebc(kjt).values().square().sum())
    >>> float(step.loss) > 0, step.cost.extra_s > 0
    (True, True)
"""

from __future__ import annotations

import abc
import enum
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.embedding import helen as helen_pass
from torchrec_cowclip.embedding.row_gradients import RowGradients
from torchrec_cowclip.embedding.table_batch import TableBatch
from torchrec_cowclip.optim.options import CowClipOptions, Helen

__all__ = [
    "HelenCost",
    "HelenStep",
    "HelenSteps",
    "LocalRows",
    "LookupChannel",
    "LookupStep",
    "RowSync",
    "RowUpdates",
    "Submission",
    "UpdateMode",
]


class UpdateMode(enum.Enum):
    """What :meth:`RowUpdates.take` does with a lookup step's submissions."""

    APPLY = "apply"  # a plain backward: update the rows now
    HOLD_ASCENT = "ascent"  # Helen's first pass: keep them to build the perturbation
    HOLD_DESCENT = "descent"  # Helen's second pass: keep them until the rows are restored


@dataclass
class Submission:
    """One table batch's row gradients from one backward.

    Attributes:
        key: orders a step's submissions (``(batch,)`` unsharded, ``(kernel, batch)``
            sharded), the same on every rank.
        batch: the table batch to update.
        row_grads: its rows' gradients and counts for this step.
        options: the hyperparameters to step with (its fused optimizer's, parsed once
            while its param group is unchanged: ``CowClipFusedOptimizer.row_options``).
        whole_dims: column shards only: ``[T]`` embedding dim of the whole table of each
            of the batch's tables.
    """

    key: Tuple[int, ...]
    batch: TableBatch
    row_grads: RowGradients
    options: CowClipOptions
    whole_dims: Optional[Tensor] = None


class RowSync(abc.ABC):
    """How the submissions of one lookup step become row updates (a lookup's strategy)."""

    @abc.abstractmethod
    def apply(self, submissions: List[Submission]) -> None:
        """Updates every submitted batch; ``submissions`` are in key order."""

    def perturbation_rows(self, submissions: List[Submission]) -> List[Tuple[RowGradients, bool]]:
        """Per submission, the row gradients Helen perturbs its rows along, and whether
        their squares count towards the table's norm on this rank: the local ones, for
        rows and columns no other rank holds."""
        return [(sub.row_grads, True) for sub in submissions]


class LocalRows(RowSync):
    """Whole rows, and every occurrence of them, on this rank: the unsharded collection,
    and table-wise and row-wise shards (TorchRec's input dist brings each id's
    occurrences to its row's rank)."""

    def apply(self, submissions: List[Submission]) -> None:
        for sub in submissions:
            sub.batch.kernel.update_(sub.batch, sub.row_grads, sub.options)


class LookupStep:
    """The submissions of one forward of one lookup, taken once all of them are in."""

    def __init__(self, channel: "LookupChannel") -> None:
        self.channel = channel
        self._submissions: List[Submission] = []
        self._closed = False

    def submit(self, submission: Submission) -> None:
        if self._closed:
            raise RuntimeError(
                "a CowClip lookup ran backward after its step was taken (retain_graph=True, "
                "or a kernel called outside its lookup?); the fused update applies exactly "
                "once per forward"
            )
        self._submissions.append(submission)

    def close(self) -> List[Submission]:
        """Ends the step: its submissions in key order (the same on every rank)."""
        if self._closed:
            raise RuntimeError(
                "a second backward reached the same CowClip lookup (retain_graph=True?); "
                "the fused update applies exactly once per forward"
            )
        self._closed = True
        submissions = sorted(self._submissions, key=lambda s: s.key)
        self._submissions = []
        return submissions


class _TakeStep(torch.autograd.Function):
    """Autograd node whose backward hands a lookup step to its coordinator. Its
    zero-size output is an input of every table batch's lookup of that forward, so
    autograd runs this backward after all of theirs."""

    @staticmethod
    def forward(ctx: Any, leaf: Tensor, step: LookupStep) -> Tensor:
        ctx.step = step
        return leaf.detach().clone()

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> Tuple[None, None]:
        step: LookupStep = ctx.step
        step.channel.owner.take(step)
        return None, None


class LookupChannel:
    """One lookup's way into :class:`RowUpdates`: its strategy and, per forward, the
    step its table batches submit to."""

    def __init__(
        self, owner: "RowUpdates", index: int, sync: RowSync, device: torch.device
    ) -> None:
        self.owner, self.index, self.sync = owner, index, sync
        #: The tensor a backward into the tables only names as ``inputs`` (Helen's
        #: second pass): every step's node hangs from it. One element: its gradient is
        #: what keeps a compiled backward's update op alive (``embedding/lookup_op.py``).
        self.leaf = torch.zeros(1, device=device, requires_grad=True)
        self._anchor: Tensor = self.leaf
        self._step: Optional[LookupStep] = None

    def begin_forward(self) -> None:
        """Starts the step of a new forward (none when autograd is off: no update)."""
        if torch.is_grad_enabled():
            self._step = LookupStep(self)
            # torch.autograd.Function.apply carries no annotations.
            self._anchor = _TakeStep.apply(self.leaf, self._step)  # type: ignore[no-untyped-call]
        else:
            self._step, self._anchor = None, self.leaf

    def current(self) -> Tuple[Tensor, Optional[LookupStep]]:
        """The anchor this forward's table-batch lookups take as input, and the step."""
        return self._anchor, self._step

    def to(self, device: torch.device) -> None:
        """Moves the channel's leaf (the owning module moved)."""
        self.leaf = torch.zeros(1, device=device, requires_grad=True)
        self._anchor, self._step = self.leaf, None


@dataclass
class HelenCost:
    """Seconds of one Helen step: the first pass (closure + backward) and what Helen adds
    (perturbation, second pass, restore) - the update itself is in neither."""

    first_pass_s: float
    extra_s: float


@dataclass
class HelenStep:
    """What :meth:`RowUpdates.helen_step` returns: the first pass's loss (detached) and
    the step's cost."""

    loss: Tensor
    cost: HelenCost


@dataclass
class _HeldStep:
    channel: LookupChannel
    submissions: List[Submission]


#: Combines per-table statistics over the ranks in place: ``(sq_norm, max_count)``,
#: summed and maxed (a sharded collection's collectives; None for an unsharded one).
ReduceTableStatistics = Callable[[Tensor, Tensor], None]


class RowUpdates:
    """The coordinator of one collection's touched-row updates (see the module docstring).

    Args:
        table_names: every table of the collection, in one order on every rank.
        helen: Helen's settings when the tables train by :meth:`helen_step`; a plain
            backward is then refused. None: one pass per step.
        device: where the tables live.
        reduce_table_statistics: how a sharded collection combines each table's Helen
            statistics over the ranks (None: this rank has every table whole).
        name: how error messages name the collection and its Helen step.
    """

    def __init__(
        self,
        table_names: Sequence[str],
        helen: Optional[Helen],
        device: torch.device,
        reduce_table_statistics: Optional[ReduceTableStatistics] = None,
        name: str = "CowClipEmbeddingBagCollection",
    ) -> None:
        self.helen = helen
        self.device = device
        self._positions = helen_pass.TablePositions(table_names)
        self._reduce = reduce_table_statistics
        self._name = name
        self.channels: List[LookupChannel] = []
        self.mode = UpdateMode.APPLY
        self._held: List[_HeldStep] = []

    def channel(self, sync: RowSync) -> LookupChannel:
        """A new lookup's channel (lookups are created in one order on every rank)."""
        channel = LookupChannel(self, len(self.channels), sync, self.device)
        self.channels.append(channel)
        return channel

    def to(self, device: torch.device) -> None:
        self.device = device
        for channel in self.channels:
            channel.to(device)

    def take(self, step: LookupStep) -> None:
        """A finished lookup step: its submissions applied, or held for Helen."""
        channel, submissions = step.channel, step.close()
        if self.mode is UpdateMode.APPLY:
            if self.helen is not None:
                raise RuntimeError(
                    f"this {self._name} is trained by Helen ({self.helen}): call "
                    "loss = module.helen_step(closure) instead of loss.backward() (nothing "
                    "was updated)"
                )
            channel.sync.apply(submissions)
            return
        if any(held.channel is channel for held in self._held):
            raise RuntimeError(
                f"helen_step: the closure looked up the same {self._name} twice in one call; "
                "Helen needs one lookup of each table batch per pass"
            )
        self._held.append(_HeldStep(channel, submissions))

    @contextmanager
    def _holding(self, mode: UpdateMode) -> Iterator[List[_HeldStep]]:
        self.mode, self._held = mode, []
        held = self._held
        try:
            yield held
        finally:
            self.mode, self._held = UpdateMode.APPLY, []

    def helen_step(
        self, closure: Callable[[], Tensor], dense_params: Optional[Iterable[Tensor]] = None
    ) -> HelenStep:
        """One Helen step (``docs/algorithm.md``, "Helen"): ``closure()`` runs the forward
        and returns the scalar loss WITHOUT calling backward.

        1. the closure and a backward into everything: every dense ``.grad`` gets the
           first pass's gradient; the lookups' steps are held;
        2. per table batch, one fused perturbation of the touched rows, each table's
           ``||G||_F`` and largest count combined over all its blocks (and ranks);
        3. the closure again and a backward into the tables only (and, with
           ``Helen(perturb_dense=True)``, ``dense_params``, perturbed SAM-style);
        4. the rows are restored exactly and the second pass's steps applied as a plain
           backward would apply them.

        Nothing is updated before the second backward has finished: an error in either
        pass restores the weights and leaves the optimizer state as it was.

        Raises:
            RuntimeError: the collection was built without ``helen=``.
        """
        helen = self.helen
        if helen is None:
            raise RuntimeError(
                "helen_step needs a collection built with helen=Helen(...); this one "
                "trains with one pass: call loss.backward()"
            )
        params = helen_pass.dense_parameters(
            helen, None if dense_params is None else list(dense_params)
        )
        t0 = time.perf_counter()
        with self._holding(UpdateMode.HOLD_ASCENT) as held:
            loss = helen_pass.scalar_loss(closure(), "first")
            torch.autograd.backward(loss)
            ascent = self._rows(held, along_perturbation=True)
        t1 = time.perf_counter()
        with helen_pass.perturbed(
            ascent, helen, params, self._positions, self.device, self._reduce
        ):
            with self._holding(UpdateMode.HOLD_DESCENT) as held:
                second = helen_pass.scalar_loss(closure(), "second")
                inputs = [channel.leaf for channel in self.channels] + params
                torch.autograd.backward(second, inputs=inputs)
                descent_steps = list(held)
        helen_pass.check_same_rows(ascent, self._rows(descent_steps, along_perturbation=False))
        t2 = time.perf_counter()
        for step in descent_steps:
            step.channel.sync.apply(step.submissions)
        return HelenStep(loss.detach(), HelenCost(first_pass_s=t1 - t0, extra_s=t2 - t1))

    def _rows(self, held: List[_HeldStep], along_perturbation: bool) -> List[helen_pass.HeldRows]:
        """The held steps' rows for Helen, in channel order (the same on every rank): the
        gradients the rows are perturbed along (the strategy's: a replica's are all
        replicas'), or those handed in."""
        rows: List[helen_pass.HeldRows] = []
        for step in sorted(held, key=lambda h: h.channel.index):
            subs = step.submissions
            along = step.channel.sync.perturbation_rows(subs) if along_perturbation else None
            for i, sub in enumerate(subs):
                row_grads, counted = along[i] if along is not None else (sub.row_grads, True)
                rows.append(
                    helen_pass.HeldRows(
                        key=(step.channel.index, *sub.key),
                        batch=sub.batch,
                        row_grads=row_grads,
                        table_index=self._positions.of_batch(sub.batch),
                        counts_in_norm=counted,
                        local_rows=sub.row_grads.rows,
                    )
                )
        return rows


class HelenSteps:
    """What a collection that owns a :class:`RowUpdates` (``_row_updates``) offers of
    Helen: its settings and its step, the unsharded collection's and the sharded one's
    alike."""

    _row_updates: RowUpdates

    @property
    def helen(self) -> Optional[Helen]:
        """Helen's settings when the tables are trained by :meth:`helen_step`, else None."""
        return self._row_updates.helen

    def helen_step(
        self, closure: Callable[[], Tensor], dense_params: Optional[Iterable[Tensor]] = None
    ) -> Tensor:
        """One Helen step (:meth:`RowUpdates.helen_step`, which also returns its cost):
        ``closure()`` runs the forward pass and returns the scalar loss WITHOUT calling
        backward.

        The first backward reaches everything: every dense parameter's ``.grad`` gets the
        first pass's gradient, as a plain ``loss.backward()`` would give it, ready for the
        dense optimizer. The tables are perturbed on the rows the batch touched, the
        closure runs again, and its backward reaches only the tables (and, with
        ``Helen(perturb_dense=True)``, ``dense_params``, which were perturbed SAM-style and
        then hold the second gradient); then the rows are restored and updated with the
        second gradient. Returns the first pass's loss (detached).

        On a sharded collection, every rank takes the step (a collective): each table's
        gradient norm and largest count are combined over its row and column shards, so
        the step equals the unsharded one on the global batch (the strategies'
        ``perturbation_rows`` and an all-reduce of the table statistics).

        Example::

            >>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
            >>> from torchrec_cowclip import CowClipEmbeddingBagCollection, CowClipOptions
            >>> ebc = CowClipEmbeddingBagCollection(
            ...     [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
            ...                         feature_names=["f"])],
            ...     CowClipOptions(lr=1e-2, helen=Helen()))
            >>> kjt = KeyedJaggedTensor.from_lengths_sync(
            ...     keys=["f"], values=torch.tensor([1, 2, 2]), lengths=torch.tensor([1, 2]))
            >>> head = torch.nn.Linear(4, 1)
            >>> loss = ebc.helen_step(lambda: head(ebc(kjt).values()).square().mean())
            >>> state = ebc.fused_optimizer.state_dict()["state"]["embedding_bags.t.weight"]
            >>> head.weight.grad is not None, int(state["step"]), int((state["exp_avg"] != 0).any(1).sum())
            (True, 1, 2)
        """
        return self._row_updates.helen_step(closure, dense_params).loss

"""A collection's lookup as two torch custom ops, so that a model holding it compiles whole.

``torch.compile`` sees the pooled lookup of all of a collection's table batches as one op,
``torchrec_cowclip::lookup``, and its backward - the fused update - as another,
``torchrec_cowclip::lookup_backward``, in the place FBGEMM's TBE ops take in a model
holding TorchRec's own collection: everything that depends on the ids' values (the
structure and index checks, the value bounds of each table batch, whether a lookup is
single-hot, the grouping of the rows) runs inside them, on real tensors, so Dynamo
traces the model in one graph with no data-dependent break, and compiled autograd traces
the backward through the update. Their fake kernels give the output shapes from the
inputs' alone.

Both ops act on a :class:`LookupImpl` (the table batches of one lookup: their weights,
optimizer state and row-update coordinator, :class:`~.batched_lookup.BatchedLookup`)
named by an integer handle from :func:`register`: the weights and optimizer state are
mutated by the update, inside backward, as FBGEMM's fused TBE mutates its own; they are
not inputs of the graph, so the compiler neither reads nor writes them. Neither op may be
dropped or merged with another call: the forward op is declared to have ordered side
effects (:func:`~torchrec_cowclip.compat.register_ordered_effect`), and the backward op's
first output is the gradient of the lookup channel's leaf (one element: a zero-size
result could be elided), which autograd accumulates, so every compiled backward - compiled
autograd's too, which cannot trace effect tokens - calls it.

Run eagerly, the same two implementations are called by an ``autograd.Function`` without
the dispatcher (:class:`_EagerLookup`: a custom op's round trips cost about 0.2 ms a step):
one lookup path, compiled or not, with the op as the compiler's boundary.

The handle names a live module, so the ops are for training: under ``torch.export`` the
collection takes neither (``CowClipEmbeddingBagCollection._exported_forward`` reads its
tables as parameters), and the program holds its tables and outlives the module.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.compat import register_ordered_effect

__all__ = ["LookupImpl", "SavedLookup", "lookup", "register"]


class SavedLookup(NamedTuple):
    """What a forward keeps for its backward: its inputs but the leaf, and the forward
    op's outputs but the pooled embeddings (:meth:`LookupImpl.forward_impl`)."""

    values: Tensor
    offsets: Tensor
    weights: Optional[Tensor]
    row_ids: Tensor
    token: Tensor
    looked_up: Sequence[Tensor]


class LookupImpl(Protocol):
    """What the ops call (:class:`~.batched_lookup.BatchedLookup` is one)."""

    def forward_impl(
        self, values: Tensor, offsets: Tensor, weights: Optional[Tensor], keep_rows: bool
    ) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
        """``(pooled, row_ids, token, looked_up)`` of one forward (see :func:`lookup`)."""

    def forward_shapes(
        self, values: Tensor, offsets: Tensor, weights: Optional[Tensor], keep_rows: bool
    ) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
        """Empty tensors of :meth:`forward_impl`'s outputs' shapes (the fake kernel)."""

    def backward_impl(
        self, grad: Tensor, saved: SavedLookup, weights_need_grad: bool
    ) -> Optional[Tensor]:
        """Updates the rows from the pooled output's gradient ``grad``; returns the
        per-sample weights' gradient when ``weights_need_grad``."""


_IMPLS: Dict[int, "weakref.ReferenceType[Any]"] = {}
_HANDLES = itertools.count(1)


def register(impl: LookupImpl) -> int:
    """A new handle (never reused) naming ``impl`` to the ops; held weakly."""
    handle = next(_HANDLES)
    _IMPLS[handle] = weakref.ref(impl, lambda _: _IMPLS.pop(handle, None))
    return handle


def _impl(handle: int) -> LookupImpl:
    ref = _IMPLS.get(handle)
    impl = None if ref is None else ref()
    if impl is None:
        raise RuntimeError(
            f"torchrec_cowclip: lookup handle {handle} names no live collection (a compiled "
            "graph of a module that was freed?); compile the module you call"
        )
    result: LookupImpl = impl
    return result


# --- the ops -------------------------------------------------------------------------------


@torch.library.custom_op("torchrec_cowclip::lookup", mutates_args=())
def _lookup_op(
    leaf: Tensor,
    values: Tensor,
    offsets: Tensor,
    weights: Optional[Tensor],
    handle: int,
    keep_rows: bool,
) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
    return _impl(handle).forward_impl(values, offsets, weights, keep_rows)


# The fakes take the ops' inputs as the dispatcher passes them: positionally, in the
# order of the ops' signatures above.


@_lookup_op.register_fake
def _lookup_fake(*inputs: Any) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
    _, values, offsets, weights, handle, keep_rows = inputs
    return _impl(handle).forward_shapes(values, offsets, weights, keep_rows)


@torch.library.custom_op("torchrec_cowclip::lookup_backward", mutates_args=())
def _lookup_backward_op(
    grad: Tensor,
    leaf: Tensor,
    values: Tensor,
    offsets: Tensor,
    weights: Optional[Tensor],
    row_ids: Tensor,
    token: Tensor,
    looked_up: List[Tensor],
    handle: int,
    weights_need_grad: bool,
) -> Tuple[Tensor, Tensor]:
    saved = SavedLookup(values, offsets, weights, row_ids, token, looked_up)
    weights_grad = _impl(handle).backward_impl(grad, saved, weights_need_grad)
    if weights_grad is None:
        weights_grad = values.new_zeros((0,), dtype=torch.float32)
    # The leaf's gradient: zero-size, it only orders this node in autograd.
    return torch.zeros_like(leaf), weights_grad


@_lookup_backward_op.register_fake
def _lookup_backward_fake(*inputs: Any) -> Tuple[Tensor, Tensor]:
    leaf, values, weights_need_grad = inputs[1], inputs[2], inputs[-1]
    size = values.shape[0] if weights_need_grad else 0
    return torch.empty_like(leaf), values.new_empty((size,), dtype=torch.float32)


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Any, ...]) -> None:
    leaf, values, offsets, weights, handle, _ = inputs
    _, row_ids, token, looked_up = output
    ctx.handle = handle
    ctx.weighted = weights is not None
    ctx.num_kept = len(looked_up)
    saved = [leaf, values, offsets, row_ids, token, *looked_up]
    if weights is not None:
        saved.append(weights)
    ctx.save_for_backward(*saved)


def _saved(ctx: Any) -> Tuple[Tensor, SavedLookup]:
    """What :func:`_setup_context` saved: the leaf, and the rest for the backward."""
    saved = list(ctx.saved_tensors)
    leaf, values, offsets, row_ids, token = saved[:5]
    looked_up = saved[5 : 5 + ctx.num_kept]
    weights = saved[5 + ctx.num_kept] if ctx.weighted else None
    return leaf, SavedLookup(values, offsets, weights, row_ids, token, looked_up)


def _backward(
    ctx: Any, grad: Tensor, *_: Any
) -> Tuple[Optional[Tensor], None, None, Optional[Tensor], None, None]:
    leaf, saved = _saved(ctx)
    weights_need_grad = bool(ctx.weighted and ctx.needs_input_grad[3])
    leaf_grad, weights_grad = _lookup_backward_op(
        grad.contiguous(), leaf, *saved, ctx.handle, weights_need_grad
    )
    return leaf_grad, None, None, weights_grad if weights_need_grad else None, None, None


_lookup_op.register_autograd(_backward, setup_context=_setup_context)
register_ordered_effect(torch.ops.torchrec_cowclip.lookup.default)


class _EagerLookup(torch.autograd.Function):
    """The ops' eager twin: the same :meth:`LookupImpl.forward_impl` and
    :meth:`LookupImpl.backward_impl`, called without the dispatcher's round trips (a custom
    op's Python dispatch and argument flattening cost about 0.2 ms a step, measured in
    docs/performance.md); the ops serve ``torch.compile``."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> Tensor:
        # The forward op's inputs, in its order.
        _, values, offsets, weights, handle, keep_rows = inputs
        output = _impl(handle).forward_impl(values, offsets, weights, keep_rows)
        _setup_context(ctx, inputs, output)
        return output[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[None, None, None, Optional[Tensor], None, None]:
        _, saved = _saved(ctx)
        weights_need_grad = bool(ctx.weighted and ctx.needs_input_grad[3])
        weights_grad = _impl(ctx.handle).backward_impl(grad.contiguous(), saved, weights_need_grad)
        return None, None, None, weights_grad, None, None


def lookup(
    handle: int, leaf: Tensor, values: Tensor, offsets: Tensor, weights: Optional[Tensor]
) -> Tensor:
    """The pooled embeddings ``[B, sum of dims]`` of one forward of the lookup ``handle``
    (:func:`register`), ``values`` / ``offsets`` / ``weights`` those of a KJT in its table
    batches' feature order. ``leaf`` (a one-element tensor that requires grad: the lookup
    channel's) makes the lookup an autograd node even when no input requires grad; its
    backward is the fused update. Per-sample weights that require grad get their gradient.
    Traced by ``torch.compile``, the lookup is the op ``torchrec_cowclip::lookup``; run
    eagerly, the same implementation without the dispatcher (:class:`_EagerLookup`)."""
    keep_rows = weights is not None and weights.requires_grad
    if torch.compiler.is_compiling():
        pooled, _, _, _ = torch.ops.torchrec_cowclip.lookup(
            leaf, values, offsets, weights, handle, keep_rows
        )
        result: Tensor = pooled
        return result
    # torch.autograd.Function.apply carries no annotations.
    eager: Tensor = _EagerLookup.apply(leaf, values, offsets, weights, handle, keep_rows)  # type: ignore[no-untyped-call]
    return eager

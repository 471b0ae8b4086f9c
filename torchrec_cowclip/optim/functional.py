"""The CowClip update as a functional core: the one place where the math lives.

Everything here acts on a block of embedding rows that a batch touched, one row per
distinct id (``docs/algorithm.md``, "One step, for each table"; the step numbers below
are that section's):

1. :func:`cowclip_clip` - step 3, the per-row adaptive clip
   ``g_j <- g_j * min(1, c_j * max(r * ||W[j]||, zeta) / ||g_j||)``;
2. :func:`couple_weight_decay` - step 4, ``g_j <- g_j + weight_decay * W[j]``
   after clipping (the TF reference adds 2*lambda*W *before* clipping and to every row;
   this project's ``weight_decay`` equals that ``2 * lambda``, applied only to rows the
   batch touched);
3. :func:`adam_rows_`, :func:`rowwise_adagrad_rows_`, :func:`sgd_rows_` - step 5,
   with an optional per-row learning rate from the row's count
   (:func:`count_lr_multiplier`, not in the paper; off by default); and two rules
   TorchRec users set that the paper does not use: per-element Adagrad
   (:func:`adagrad_rows_`, FBGEMM's ``EXACT_ADAGRAD``) and AdamW (:func:`adamw_step`:
   Adam with *decoupled* weight decay, which replaces step 4: ``W <- W * (1 - lr *
   weight_decay)`` before Adam's step, as ``torch.optim.AdamW`` and FBGEMM's
   ``WeightDecayMode.DECOUPLE`` do). The clip of step 3 comes before every rule.

:func:`cowclip_row_update_` composes the three, with the settings of
:mod:`.options` (``CowClip``, ``CountLR``, ``Helen``, read through the protocols
:class:`ClipSettings` and :class:`CountScaling`: this module imports nothing of the
package). Helen (``docs/algorithm.md``, "Helen") adds one rule before them:
:func:`helen_table_statistics` and :func:`helen_perturbation` give the frequency-scaled
perturbation of the touched rows at which the second gradient is taken
(:func:`sam_perturbations` for dense parameters). The optimizers of step 5 are row steps
(:data:`OptimizerStep`): :func:`adam_step`, :func:`rowwise_adagrad_step` and :func:`sgd_step`,
which the registry of :mod:`.rules` builds its built-in rules from. A row split into column
shards (TorchRec column-wise sharding) is handled by the same functions: each shard computes
its :func:`partial_row_sums`, the shards add them up, and :class:`RowSums` of the whole row
supplies the norms of step 3 and row-wise Adagrad's ``mean(g_j**2)``. Tables stored in
float16 / bfloat16 are updated in float32 and rounded back by :func:`stochastic_round`. The
dense reference (:mod:`torchrec_cowclip.optim.reference`) and every fast path (the native
and compiled CPU updates, a GPU kernel, sharded tables) call it or are tested against it,
so the algorithm is written down exactly once.

Example::

    >>> import torch
    >>> w = torch.tensor([[3.0, 4.0]])            # ||W[j]|| = 5
    >>> g = torch.tensor([[30.0, 40.0]])          # ||g_j|| = 50
    >>> clipped_g, was_clipped = cowclip_clip(g, w, torch.tensor([2]), r=1.0, zeta=1e-5)
    >>> clipped_g                                  # tau = 2 * 5 = 10
    tensor([[6., 8.]])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple, Union

import torch
from torch import Tensor

#: Added to the gradient norm in the denominator of Helen's and SAM's perturbation.
HELEN_NORM_EPS = 1e-12

#: A row step (step 5): ``step(weight, grad, state, *, lr, step, betas, eps, weight_decay,
#: scale, row_sums, adam_bias)`` updates ``weight`` and ``state`` in place from the clipped,
#: decayed ``grad`` (the keywords are :func:`cowclip_row_update_`'s; ``scale`` is the clip
#: factor of step 3). A step takes the keywords it needs and ``**_`` for the rest. The
#: built-in ones are :func:`adam_step`, :func:`rowwise_adagrad_step` and :func:`sgd_step`;
#: the registry of :mod:`.rules` names them.
OptimizerStep = Callable[..., None]


class ClipSettings(Protocol):
    """What step 3 reads of its settings
    (:class:`~torchrec_cowclip.optim.options.CowClip` is one)."""

    @property
    def r(self) -> float: ...

    @property
    def zeta(self) -> float: ...


class CountScaling(Protocol):
    """What the per-id-frequency learning rate reads of its settings
    (:class:`~torchrec_cowclip.optim.options.CountLR` is one)."""

    @property
    def power(self) -> float: ...

    @property
    def cap(self) -> float: ...


def count_lr_multiplier(
    counts: Tensor, power: float, cap: float, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``[U]`` ``min(c_j, cap) ** power`` for the rows' counts ``c_j``: the factor of the
    per-id-frequency learning rate ``lr_j = lr * min(c_j, cap) ** power``.

    Example::

        >>> count_lr_multiplier(torch.tensor([1, 4, 100]), power=0.5, cap=16).tolist()
        [1.0, 2.0, 4.0]
    """
    return counts.to(dtype).clamp(max=float(cap)).pow(float(power))


def helen_table_statistics(
    grad: Tensor, counts: Tensor, table_index: Tensor, num_tables: int
) -> Tuple[Tensor, Tensor]:
    """Per table, what Helen's perturbation needs of the whole table: ``[num_tables]``
    sums of squared gradient entries (``||G||_F**2`` over the touched rows) and
    ``[num_tables]`` largest row counts ``max_k n_k``.

    Both combine across blocks of one table by a sum and a max respectively (the row and
    column shards of a sharded table: see ``distributed``). Rows whose gradient is not
    finite are left out (the update skips them too).

    Args:
        grad: ``[U, D]`` gradient of each touched row.
        counts: ``[U]`` count of each row in the batch.
        table_index: ``[U]`` int64 table of each row, in ``[0, num_tables)``.

    Example::

        >>> g = torch.tensor([[3.0, 0.0], [0.0, 4.0], [1.0, 0.0]])
        >>> sq, most = helen_table_statistics(g, torch.tensor([1, 5, 2]),
        ...                                   torch.tensor([0, 0, 1]), 2)
        >>> sq.tolist(), most.tolist()
        ([25.0, 1.0], [5, 2])
    """
    finite = torch.isfinite(grad.sum(dim=1))
    row_sq = torch.where(finite, grad.square().sum(dim=1), torch.zeros((), dtype=grad.dtype))
    sq = torch.zeros(num_tables, dtype=grad.dtype, device=grad.device)
    sq.index_add_(0, table_index, row_sq)
    most = torch.zeros(num_tables, dtype=counts.dtype, device=counts.device)
    most.scatter_reduce_(0, table_index, counts, reduce="amax", include_self=True)
    return sq, most


def helen_perturbation(
    grad: Tensor,
    counts: Tensor,
    table_sq_norm: Tensor,
    table_max_count: Tensor,
    *,
    rho: float,
    bound: float,
) -> Tensor:
    """``[U, D]`` Helen's perturbation ``e_j = rho * max(n_j / max_k n_k, bound) * g_j /
    (||G||_F + 1e-12)`` of each touched row; rows with a non-finite gradient get 0.

    Args:
        grad: ``[U, D]`` gradient ``g_j`` of each row.
        counts: ``[U]`` count ``n_j`` of each row in the batch.
        table_sq_norm: ``[U]`` ``||G||_F**2`` of each row's table
            (:func:`helen_table_statistics`, gathered per row).
        table_max_count: ``[U]`` ``max_k n_k`` of each row's table.

    Example::

        >>> e = helen_perturbation(torch.tensor([[3.0, 4.0]]), torch.tensor([1]),
        ...                        torch.tensor([25.0]), torch.tensor([4]), rho=0.5, bound=0.3)
        >>> e                       # 0.5 * max(1/4, 0.3) * g / 5
        tensor([[0.0900, 0.1200]])
    """
    share = counts.to(grad.dtype) / table_max_count.clamp_min(1).to(grad.dtype)
    scale = rho * share.clamp_min(bound) / (table_sq_norm.sqrt() + HELEN_NORM_EPS)
    perturbation = grad * scale.unsqueeze(1)
    finite = torch.isfinite(perturbation.sum(dim=1, keepdim=True))
    return torch.where(finite, perturbation, torch.zeros((), dtype=grad.dtype))


def sam_perturbations(grads: Sequence[Tensor], rho: float) -> list[Tensor]:
    """SAM's perturbation ``rho * g / (||g||_2 + 1e-12)`` of a set of parameters, with
    the norm over all of their gradients together (the global norm).

    Example::

        >>> [e.tolist() for e in sam_perturbations([torch.tensor([3.0]), torch.tensor([4.0])], 1.0)]
        [[0.6000000238418579], [0.800000011920929]]
    """
    if not grads:
        return []
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    scale = rho / (norm + HELEN_NORM_EPS)
    return [g * scale for g in grads]


#: Columns of :func:`partial_row_sums`.
ROW_SUM_COLUMNS: Tuple[str, ...] = ("nonfinite", "grad_sq", "weight_sq", "grad_dot_weight")


def partial_row_sums(grad: Tensor, weight: Tensor) -> Tensor:
    """This block's part of the per-row sums the update needs over a WHOLE row.

    When a row is split into column shards, each shard calls this on its columns; the
    element-wise sum of the shards' results is the whole row's (:class:`RowSums`).

    Returns:
        ``[U, 4]`` float: per row, the number of non-finite gradient entries,
        ``sum(g**2)``, ``sum(W**2)`` and ``sum(g * W)`` (columns :data:`ROW_SUM_COLUMNS`).
    """
    nonfinite = (~torch.isfinite(grad)).sum(dim=1).to(grad.dtype)
    return torch.stack(
        [
            nonfinite,
            grad.square().sum(dim=1),
            weight.square().sum(dim=1),
            (grad * weight).sum(dim=1),
        ],
        dim=1,
    )


@dataclass(frozen=True)
class RowSums:
    """Sums over whole rows whose columns are split across shards.

    Built from the shards' :func:`partial_row_sums` added together, it gives every
    shard the same whole-row quantities, so each shard clips and steps exactly as the
    unsplit row would.

    Attributes:
        nonfinite: ``[U]`` number of non-finite gradient entries in the whole row.
        grad_sq: ``[U]`` ``||g_j||**2``.
        weight_sq: ``[U]`` ``||W[j]||**2`` before the step.
        grad_dot_weight: ``[U]`` ``g_j . W[j]``.
        dim: ``[U]`` (or scalar) number of columns ``D`` of the whole row.

    Example::

        >>> g, w = torch.tensor([[3.0, 0.0, 0.0, 4.0]]), torch.ones(1, 4)
        >>> halves = partial_row_sums(g[:, :2], w[:, :2]) + partial_row_sums(g[:, 2:], w[:, 2:])
        >>> RowSums.from_sums(halves, dim=4).grad_sq
        tensor([25.])
    """

    nonfinite: Tensor
    grad_sq: Tensor
    weight_sq: Tensor
    grad_dot_weight: Tensor
    dim: Tensor

    @classmethod
    def from_sums(cls, sums: Tensor, dim: Union[Tensor, int]) -> "RowSums":
        """From the ``[U, 4]`` sum of the shards' :func:`partial_row_sums`."""
        nonfinite, grad_sq, weight_sq, grad_dot_weight = sums.unbind(dim=1)
        dims = torch.as_tensor(dim, dtype=sums.dtype, device=sums.device)
        return cls(nonfinite, grad_sq, weight_sq, grad_dot_weight, dims)

    @property
    def finite(self) -> Tensor:
        """``[U]`` bool: rows whose whole gradient is finite."""
        return self.nonfinite == 0

    def norms(self) -> Tuple[Tensor, Tensor]:
        """``(||g_j||, ||W[j]||)`` of the whole rows."""
        return self.grad_sq.sqrt(), self.weight_sq.sqrt()

    def select(self, mask: Tensor) -> "RowSums":
        """The rows where ``mask`` is True."""
        dim = self.dim[mask] if self.dim.dim() == 1 else self.dim
        return RowSums(
            self.nonfinite[mask],
            self.grad_sq[mask],
            self.weight_sq[mask],
            self.grad_dot_weight[mask],
            dim,
        )

    def mean_square_after(self, scale: Tensor, weight_decay: float) -> Tensor:
        """``mean(g'_j**2)`` over the whole row of ``g'_j = scale_j * g_j + weight_decay * W[j]``
        (the clipped gradient with coupled L2, steps 3-4), expanded as
        ``scale**2 ||g||**2 + 2 scale wd (g . W) + wd**2 ||W||**2``, divided by ``D``."""
        total = (
            scale.square() * self.grad_sq
            + (2.0 * weight_decay) * scale * self.grad_dot_weight
            + (weight_decay * weight_decay) * self.weight_sq
        )
        # The expansion of a sum of squares can round a hair below zero.
        return total.clamp_min(0.0) / self.dim


def cowclip_clip(
    grad: Tensor,
    weight: Tensor,
    counts: Tensor,
    r: float,
    zeta: float,
    clip_enabled: Optional[Tensor] = None,
    norms: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """Step 3: clips each row's gradient against its own norm and count.

    Args:
        grad: ``[U, D]`` summed gradient ``g_j`` of each distinct row.
        weight: ``[U, D]`` the rows ``W[j]`` *before* this step's update.
        counts: ``[U]`` occurrences ``c_j`` of each row in the batch.
        r, zeta: see :class:`CowClip`.
        clip_enabled: optional ``[U]`` bool; rows with False are never clipped
            (tables that opt out, e.g. DeepFM's first-order tables).
        norms: optional ``(||g_j||, ||W[j]||)``, each ``[U]``, of the WHOLE rows when
            ``grad``/``weight`` hold only some of their columns (a column shard; see
            :class:`RowSums`). Default: the norms of ``grad`` and ``weight``.

    Returns:
        ``(clipped_grad, was_clipped)``; ``was_clipped[j]`` is True where the clip bound
        (``||g_j|| > tau_j``). A zero gradient stays zero, never NaN.
    """
    scale, was_clipped = cowclip_scale(grad, weight, counts, r, zeta, clip_enabled, norms)
    return grad * scale.unsqueeze(1), was_clipped


def cowclip_scale(
    grad: Tensor,
    weight: Tensor,
    counts: Tensor,
    r: float,
    zeta: float,
    clip_enabled: Optional[Tensor] = None,
    norms: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """The factor :func:`cowclip_clip` multiplies each row's gradient by: ``[U]``
    ``min(1, tau_j / ||g_j||)`` where the clip binds, 1 elsewhere; and ``was_clipped``."""
    if norms is None:
        grad_norm = torch.linalg.vector_norm(grad, dim=1)
        weight_norm = torch.linalg.vector_norm(weight, dim=1)
    else:
        grad_norm, weight_norm = norms
    threshold = counts.to(grad.dtype) * torch.clamp(r * weight_norm, min=zeta)
    was_clipped = grad_norm > threshold
    if clip_enabled is not None:
        was_clipped &= clip_enabled
    # grad_norm > threshold >= 0 wherever the scale is used, so the division is safe;
    # clamp only keeps the unused lanes free of inf.
    scale = torch.where(
        was_clipped,
        threshold / grad_norm.clamp_min(torch.finfo(grad.dtype).tiny),
        torch.ones_like(grad_norm),
    )
    return scale, was_clipped


LearningRate = Union[float, Tensor]


def _per_row(lr: LearningRate) -> LearningRate:
    """A ``[U]`` per-row rate as a ``[U, 1]`` column; a scalar as is."""
    return lr.unsqueeze(1) if isinstance(lr, Tensor) and lr.dim() == 1 else lr


def couple_weight_decay(grad: Tensor, weight: Tensor, weight_decay: float) -> Tensor:
    """Step 4: coupled L2 after clipping, ``g_j + weight_decay * W[j]``."""
    if weight_decay == 0.0:
        return grad
    return grad + weight_decay * weight


def adam_bias_corrections(
    step: Tensor, beta1: float, beta2: float, dtype: torch.dtype = torch.float32
) -> Tuple[Tensor, Tensor]:
    """Adam's bias corrections ``(1 - beta1**t, 1 - beta2**t)`` for step counts ``t``
    (any shape), in ``dtype``.

    Computed in float64: ``beta2**t`` for ``t`` in the millions loses float32 precision
    well before it reaches zero. Callers with one step count per table compute this per
    table and gather it per row, rather than once per row (two float64 ``pow`` per row
    were a third of the compiled update's time at 167K rows).

    Example::

        >>> b1, b2 = adam_bias_corrections(torch.tensor([1, 2]), 0.9, 0.999)
        >>> [round(x, 4) for x in b1.tolist()], [round(x, 6) for x in b2.tolist()]
        ([0.1, 0.19], [0.001, 0.001999])
    """
    t = step.to(torch.float64)
    return (1.0 - torch.pow(beta1, t)).to(dtype), (1.0 - torch.pow(beta2, t)).to(dtype)


def adam_rows_(
    weight: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Optional[Tensor],
    lr: LearningRate,
    beta1: float,
    beta2: float,
    eps: float,
    bias_corrections: Optional[Tuple[Tensor, Tensor]] = None,
) -> None:
    """Step 5, Adam on the touched rows, in place on the row blocks.

    ``step`` is ``[U]`` (or a scalar): the optimizer's global step count *including*
    this step, for the bias corrections ``1 - beta**t``. ``bias_corrections``, if given,
    are those corrections already computed (:func:`adam_bias_corrections`, ``[U]`` or
    scalars) and ``step`` is not read. ``lr`` is a scalar or ``[U]`` (one per row).
    """
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    if bias_corrections is None:
        if step is None:
            raise ValueError("adam_rows_ needs the step count or its bias corrections")
        bias_corrections = adam_bias_corrections(step, beta1, beta2, weight.dtype)
    bias1, bias2 = bias_corrections
    if bias1.dim() == 1:
        bias1, bias2 = bias1.unsqueeze(1), bias2.unsqueeze(1)
    denom = (exp_avg_sq / bias2).sqrt_().add_(eps)
    weight.sub_(_per_row(lr) * (exp_avg / bias1) / denom)


def rowwise_adagrad_rows_(
    weight: Tensor,
    grad: Tensor,
    sum_sq: Tensor,
    lr: LearningRate,
    eps: float,
    grad_sq_mean: Optional[Tensor] = None,
) -> None:
    """Step 5, row-wise Adagrad: ``s_j += mean(g_j**2)``; ``W -= lr*g/(sqrt(s)+eps)``.

    ``grad_sq_mean`` is ``mean(g_j**2)`` over the WHOLE row when ``grad`` holds only some
    of its columns (a column shard); default: the mean over ``grad``'s columns.
    """
    sum_sq.add_(grad.square().mean(dim=1) if grad_sq_mean is None else grad_sq_mean)
    weight.sub_(_per_row(lr) * grad / (sum_sq.sqrt() + eps).unsqueeze(1))


def adagrad_rows_(
    weight: Tensor, grad: Tensor, sum_sq: Tensor, lr: LearningRate, eps: float
) -> None:
    """Step 5, per-element Adagrad (FBGEMM's ``EXACT_ADAGRAD``; ``torch.optim.Adagrad``
    without lr decay): ``s_jd += g_jd**2``; ``W -= lr * g / (sqrt(s) + eps)``, ``sum_sq``
    ``[U, D]``.

    Example::

        >>> w, s = torch.zeros(1, 2), torch.zeros(1, 2)
        >>> adagrad_rows_(w, torch.tensor([[3.0, -4.0]]), s, lr=1.0, eps=0.0)
        >>> w, s
        (tensor([[-1.,  1.]]), tensor([[ 9., 16.]]))
    """
    sum_sq.addcmul_(grad, grad)
    weight.sub_(_per_row(lr) * grad / (sum_sq.sqrt() + eps))


def decay_weight_(weight: Tensor, lr: LearningRate, weight_decay: float) -> None:
    """Decoupled weight decay, ``W <- W * (1 - lr * weight_decay)`` (``torch.optim.AdamW``'s
    first move; FBGEMM's ``WeightDecayMode.DECOUPLE``), in place, before the rule's step."""
    if weight_decay != 0.0:
        weight.mul_(1.0 - _per_row(lr) * weight_decay)


def sgd_rows_(weight: Tensor, grad: Tensor, lr: LearningRate) -> None:
    """Step 5, SGD: ``W -= lr * g`` (``lr`` a scalar or ``[U]``)."""
    weight.sub_(_per_row(lr) * grad)


def adam_step(
    weight: Tensor,
    grad: Tensor,
    state: Dict[str, Tensor],
    *,
    lr: LearningRate,
    step: Optional[Tensor],
    betas: Tuple[float, float],
    eps: float,
    adam_bias: Optional[Tuple[Tensor, Tensor]],
    **_: Any,
) -> None:
    """Adam as a :data:`OptimizerStep` (state ``exp_avg``, ``exp_avg_sq``): :func:`adam_rows_`."""
    adam_rows_(
        weight,
        grad,
        state["exp_avg"],
        state["exp_avg_sq"],
        step,
        lr,
        betas[0],
        betas[1],
        eps,
        bias_corrections=adam_bias,
    )


def adamw_step(
    weight: Tensor,
    grad: Tensor,
    state: Dict[str, Tensor],
    *,
    lr: LearningRate,
    weight_decay: float,
    **adam: Any,
) -> None:
    """AdamW as a :data:`OptimizerStep` (Adam's state and keywords): :func:`decay_weight_`,
    then :func:`adam_step` on the clipped gradient, which carries no L2 (the rule is
    registered with ``decoupled_weight_decay``, so :func:`cowclip_row_update_` adds none)."""
    decay_weight_(weight, lr, weight_decay)
    adam_step(weight, grad, state, lr=lr, **adam)


def adagrad_step(
    weight: Tensor,
    grad: Tensor,
    state: Dict[str, Tensor],
    *,
    lr: LearningRate,
    eps: float,
    **_: Any,
) -> None:
    """Per-element Adagrad as a :data:`OptimizerStep` (state ``sum``, ``[U, D]``):
    :func:`adagrad_rows_`."""
    adagrad_rows_(weight, grad, state["sum"], lr, eps)


def rowwise_adagrad_step(
    weight: Tensor,
    grad: Tensor,
    state: Dict[str, Tensor],
    *,
    lr: LearningRate,
    eps: float,
    weight_decay: float,
    scale: Tensor,
    row_sums: Optional[RowSums],
    **_: Any,
) -> None:
    """Row-wise Adagrad as a :data:`OptimizerStep` (state ``sum``): :func:`rowwise_adagrad_rows_`,
    with a column shard's ``mean(g_j**2)`` over the whole row from ``row_sums``."""
    grad_sq_mean = None if row_sums is None else row_sums.mean_square_after(scale, weight_decay)
    rowwise_adagrad_rows_(weight, grad, state["sum"], lr, eps, grad_sq_mean)


def sgd_step(
    weight: Tensor, grad: Tensor, state: Dict[str, Tensor], *, lr: LearningRate, **_: Any
) -> None:
    """SGD as a :data:`OptimizerStep` (no state): :func:`sgd_rows_`."""
    sgd_rows_(weight, grad, lr)


#: Float types a table may be stored in; the update computes in float32 and rounds back.
STORAGE_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

_MASK32 = 0xFFFFFFFF
_ROW_SALT = 0x9E3779B9
_COLUMN_SALT = 0x85EBCA6B


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values in
    ``[0, 2**32)``, elementwise. Both multipliers are below ``2**31``, so every product
    fits in int64 and the result equals the uint32 arithmetic of the native kernel.

    Example::

        >>> mix32(torch.tensor([0, 1])).tolist()
        [0, 1198589870]
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def rounding_row_keys(seed: Tensor, step: Tensor, global_row: Tensor) -> Tensor:
    """``[U]`` int64 key in ``[0, 2**32)`` of the random bits that round row ``global_row``
    of a table (``seed``: the table's, from its name) at step ``step``: counter-based, so
    the rounding of a row depends on nothing but these three (not on threads, table
    batching, sharding or a resume), and every replica of a row draws the same bits.

    Example::

        >>> k = rounding_row_keys(torch.tensor([7]), torch.tensor([1]), torch.tensor([3]))
        >>> 0 <= int(k) < 2**32
        True
    """
    row = global_row.to(torch.int64)
    h = mix32(((row >> 32) + _ROW_SALT) & _MASK32)
    h = mix32((row & _MASK32) ^ h)
    h = mix32((step.to(torch.int64) & _MASK32) ^ h)
    return mix32((seed.to(torch.int64) & _MASK32) ^ h)


def stochastic_round(
    values: Tensor, dtype: torch.dtype, row_keys: Tensor, column_base: Tensor
) -> Tensor:
    """``[U, D]`` float32 ``values`` rounded stochastically to ``dtype`` (float16 or
    bfloat16): up with probability equal to the distance from the value below, so the
    rounding is unbiased and updates smaller than half a unit in the last place still
    move a row on average (FBGEMM's stochastic rounding of half-precision tables does the
    same with a per-thread generator; here the bits come from :func:`rounding_row_keys`
    and the global column ``column_base[u] + d``).

    bfloat16: 16 random bits are added below the kept bits, which are then truncated.
    float16: the two float16 neighbours of ``|x|`` and a 24-bit uniform draw against the
    distance. Infinities stay; a NaN stays a NaN; a value beyond the largest
    float16 rounds down to it. ``values`` of float32 are returned as they are.

    Example::

        >>> x = torch.full((1, 4000), 1.0 + 2.0**-9)   # a quarter of the way to the next bf16
        >>> keys, cols = torch.tensor([12345]), torch.tensor([0])
        >>> up = (stochastic_round(x, torch.bfloat16, keys, cols).float() > 1.0).float().mean()
        >>> 0.2 < float(up) < 0.3
        True
    """
    if dtype == torch.float32:
        return values
    u, d = values.shape
    columns = column_base.to(torch.int64).unsqueeze(1) + torch.arange(d, device=values.device)
    column_hash = mix32((columns + _COLUMN_SALT) & _MASK32)
    bits = mix32(row_keys.to(torch.int64).unsqueeze(1) ^ column_hash)
    x = values.to(torch.float32)
    if dtype == torch.bfloat16:
        raised = (x.view(torch.int32) + (bits >> 16).to(torch.int32)) & -65536
        rounded = raised.view(torch.float32).to(torch.bfloat16)
        nan = ((x.view(torch.int32) >> 16) | 0x40).to(torch.int16).view(torch.bfloat16)
        return torch.where(torch.isnan(x), nan, rounded)
    if dtype != torch.float16:
        raise ValueError(f"stochastic_round: dtype must be float16 or bfloat16, got {dtype}")
    ax = x.abs()
    nearest = ax.to(torch.float16)
    h = nearest.view(torch.int16).to(torch.int32)
    h = h - (nearest.to(torch.float32) > ax).to(torch.int32)
    lo = h.to(torch.int16).view(torch.float16).to(torch.float32)
    hi = (h + 1).to(torch.int16).view(torch.float16).to(torch.float32)
    p = (ax - lo) / (hi - lo)
    uniform = (bits >> 8).to(torch.float32) * (1.0 / 16777216.0)
    h = h + (uniform < p).to(torch.int32)
    magnitude = h.to(torch.int16).view(torch.float16)
    rounded = torch.where(torch.signbit(x), -magnitude, magnitude)
    return torch.where(torch.isfinite(x), rounded, x.to(torch.float16))


def cowclip_row_update_(
    rule: OptimizerStep,
    weight: Tensor,
    grad: Tensor,
    counts: Tensor,
    state: Dict[str, Tensor],
    step: Optional[Tensor],
    *,
    lr: float,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    cowclip: Optional[ClipSettings] = None,
    clip_enabled: Optional[Tensor] = None,
    row_sums: Optional[RowSums] = None,
    adam_bias: Optional[Tuple[Tensor, Tensor]] = None,
    count_lr: Optional[CountScaling] = None,
    decoupled_weight_decay: bool = False,
) -> Tensor:
    """One full CowClip step (steps 3-5) on a block of distinct rows, in place.

    Args:
        rule: the optimizer's row step (:data:`OptimizerStep`): :func:`adam_step`,
            :func:`rowwise_adagrad_step`, :func:`sgd_step`, or a registered rule's ``step``
            (:func:`~.rules.update_rule`).
        weight: ``[U, D]`` rows before the step; updated in place.
        grad: ``[U, D]`` summed gradients of the rows (not modified).
        counts: ``[U]`` occurrences of each row in the batch.
        state: the rows' optimizer state blocks, named as in :data:`~.rules.STATE_LAYOUT`
            (``exp_avg``/``exp_avg_sq`` ``[U, D]``; ``sum`` ``[U]``); updated in place.
        step: ``[U]`` or scalar step count including this step (Adam only; None when
            ``adam_bias`` is given or the rule is not Adam).
        adam_bias: Adam's bias corrections for ``step``, precomputed
            (:func:`adam_bias_corrections`); ``step`` is then not read.
        cowclip: the clip parameters (:class:`~torchrec_cowclip.optim.options.CowClip`),
            or None for no clipping.
        clip_enabled: optional ``[U]`` bool mask of rows that may be clipped.
        row_sums: sums over the WHOLE rows when ``weight``/``grad`` are one column shard
            of them (:class:`RowSums`): the clip then uses the whole rows' norms and
            row-wise Adagrad the whole rows' ``mean(g_j**2)``, so every shard takes the
            step the unsplit row would. Default: the rows are whole.
        count_lr: optional per-row learning rate ``lr * min(c_j, cap) ** power``
            (:class:`~torchrec_cowclip.optim.options.CountLR`); default one ``lr`` for every
            row, as in the paper.
        decoupled_weight_decay: the rule applies ``weight_decay`` itself, to the weight
            (AdamW: :func:`adamw_step`); step 4 then adds no L2 to the gradient.

    Returns:
        ``[U]`` bool, True for rows whose gradient was clipped.

    Example::

        >>> w = torch.zeros(1, 2); g = torch.ones(1, 2)
        >>> _ = cowclip_row_update_(sgd_step, w, g, torch.tensor([1]), {}, torch.tensor(1), lr=0.5)
        >>> w
        tensor([[-0.5000, -0.5000]])
    """
    norms = None if row_sums is None else row_sums.norms()
    if cowclip is not None:
        scale, was_clipped = cowclip_scale(
            grad, weight, counts, cowclip.r, cowclip.zeta, clip_enabled, norms
        )
        grad = grad * scale.unsqueeze(1)
    else:
        scale = torch.ones(grad.shape[0], dtype=grad.dtype, device=grad.device)
        was_clipped = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
    if not decoupled_weight_decay:
        grad = couple_weight_decay(grad, weight, weight_decay)
    row_lr: LearningRate = lr
    if count_lr is not None and count_lr.power != 0.0:
        row_lr = lr * count_lr_multiplier(counts, count_lr.power, count_lr.cap, grad.dtype)
    rule(
        weight,
        grad,
        state,
        lr=row_lr,
        step=step,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        scale=scale,
        row_sums=row_sums,
        adam_bias=adam_bias,
    )
    return was_clipped

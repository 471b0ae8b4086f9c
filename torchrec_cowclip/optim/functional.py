"""The CowClip update as a functional core: the one place where the math lives.

Everything here acts on a block of embedding rows that a batch touched, one row per
distinct id (``../shared/docs/cowclip-spec.md``, "The update, per embedding table, per
step"):

1. :func:`cowclip_clip` - spec step 3, the per-row adaptive clip
   ``g_j <- g_j * min(1, c_j * max(r * ||W[j]||, zeta) / ||g_j||)``;
2. :func:`couple_weight_decay` - spec step 4, ``g_j <- g_j + weight_decay * W[j]``
   after clipping (the TF reference adds 2*lambda*W *before* clipping and to every row;
   this project's ``weight_decay`` equals that ``2 * lambda``, applied only to rows the
   batch touched);
3. :func:`adam_rows_`, :func:`rowwise_adagrad_rows_`, :func:`sgd_rows_` - spec step 5.

:func:`cowclip_row_update_` composes the three. The dense reference
(:mod:`torchrec_cowclip.optim.reference`) and every fast path (the fused CPU update,
a GPU kernel, sharded tables) call it or are tested against it, so the algorithm is
written down exactly once.

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
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

OPTIMIZERS: Tuple[str, ...] = ("adam", "rowwise_adagrad", "sgd")

#: Optimizer state tensors per optimizer; each entry is (name, per-row shape suffix)
#: where "D" means one value per column and "1" one value per row.
STATE_LAYOUT: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "adam": (("exp_avg", "D"), ("exp_avg_sq", "D")),
    "rowwise_adagrad": (("sum", "1"),),
    "sgd": (),
}


@dataclass(frozen=True)
class CowClip:
    """Parameters of the CowClip clip: ``tau_j = c_j * max(r * ||W[j]||, zeta)``.

    Args:
        r: clip ratio against the row's own weight norm (paper default 1.0).
        zeta: lower bound on the per-occurrence threshold, so rows with a tiny norm can
            still move. The TF reference's ``--bound`` maps to
            ``zeta = r**2 * sqrt(D) * bound`` (see :meth:`from_reference`).

    Example::

        >>> CowClip(r=1.0, zeta=1e-5)
        CowClip(r=1.0, zeta=1e-05)
        >>> round(CowClip.from_reference(r=1.0, bound=1e-5, embedding_dim=10).zeta, 10)
        3.16e-05
    """

    r: float = 1.0
    zeta: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("r", "zeta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value != value or value in (
                float("inf"),
                float("-inf"),
            ):
                raise ValueError(f"CowClip.{name} must be a finite number, got {value!r}")
        if self.r <= 0:
            raise ValueError(f"CowClip.r must be > 0, got {self.r}")
        if self.zeta < 0:
            raise ValueError(f"CowClip.zeta must be >= 0, got {self.zeta}")

    @classmethod
    def from_reference(cls, r: float, bound: float, embedding_dim: int) -> "CowClip":
        """Maps the TF reference's flags to the paper's ``zeta``.

        The reference computes ``clip = r * cnt * max(||w||, r * sqrt(D) * bound)``,
        i.e. ``cnt * max(r * ||w||, r**2 * sqrt(D) * bound)``.
        """
        return cls(r=r, zeta=r * r * (embedding_dim**0.5) * bound)


def cowclip_clip(
    grad: Tensor,
    weight: Tensor,
    counts: Tensor,
    r: float,
    zeta: float,
    clip_enabled: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Spec step 3: clips each row's gradient against its own norm and count.

    Args:
        grad: ``[U, D]`` summed gradient ``g_j`` of each distinct row.
        weight: ``[U, D]`` the rows ``W[j]`` *before* this step's update.
        counts: ``[U]`` occurrences ``c_j`` of each row in the batch.
        r, zeta: see :class:`CowClip`.
        clip_enabled: optional ``[U]`` bool; rows with False are never clipped
            (tables that opt out, e.g. DeepFM's first-order tables).

    Returns:
        ``(clipped_grad, was_clipped)``; ``was_clipped[j]`` is True where the clip bound
        (``||g_j|| > tau_j``). A zero gradient stays zero, never NaN.
    """
    grad_norm = torch.linalg.vector_norm(grad, dim=1)
    weight_norm = torch.linalg.vector_norm(weight, dim=1)
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
    return grad * scale.unsqueeze(1), was_clipped


def couple_weight_decay(grad: Tensor, weight: Tensor, weight_decay: float) -> Tensor:
    """Spec step 4: coupled L2 after clipping, ``g_j + weight_decay * W[j]``."""
    if weight_decay == 0.0:
        return grad
    return grad + weight_decay * weight


def adam_rows_(
    weight: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """Spec step 5, Adam on the touched rows, in place on the row blocks.

    ``step`` is ``[U]`` (or a scalar): the optimizer's global step count *including*
    this step, for the bias corrections ``1 - beta**t``.
    """
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    # Bias corrections in float64: beta2**t for t in the millions underflows float32
    # precision well before it reaches zero.
    t = step.to(torch.float64)
    bias1 = (1.0 - torch.pow(beta1, t)).to(weight.dtype)
    bias2 = (1.0 - torch.pow(beta2, t)).to(weight.dtype)
    if bias1.dim() == 1:
        bias1, bias2 = bias1.unsqueeze(1), bias2.unsqueeze(1)
    denom = (exp_avg_sq / bias2).sqrt_().add_(eps)
    weight.sub_(lr * (exp_avg / bias1) / denom)


def rowwise_adagrad_rows_(
    weight: Tensor, grad: Tensor, sum_sq: Tensor, lr: float, eps: float
) -> None:
    """Spec step 5, row-wise Adagrad: ``s_j += mean(g_j**2)``; ``W -= lr*g/(sqrt(s)+eps)``."""
    sum_sq.add_(grad.square().mean(dim=1))
    weight.sub_(lr * grad / (sum_sq.sqrt() + eps).unsqueeze(1))


def sgd_rows_(weight: Tensor, grad: Tensor, lr: float) -> None:
    """Spec step 5, SGD: ``W -= lr * g``."""
    weight.sub_(lr * grad)


def cowclip_row_update_(
    optimizer: str,
    weight: Tensor,
    grad: Tensor,
    counts: Tensor,
    state: Dict[str, Tensor],
    step: Tensor,
    *,
    lr: float,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    cowclip: Optional[CowClip] = None,
    clip_enabled: Optional[Tensor] = None,
) -> Tensor:
    """One full CowClip step (spec steps 3-5) on a block of distinct rows, in place.

    Args:
        optimizer: ``"adam"``, ``"rowwise_adagrad"`` or ``"sgd"``.
        weight: ``[U, D]`` rows before the step; updated in place.
        grad: ``[U, D]`` summed gradients of the rows (not modified).
        counts: ``[U]`` occurrences of each row in the batch.
        state: the rows' optimizer state blocks, named as in :data:`STATE_LAYOUT`
            (``exp_avg``/``exp_avg_sq`` ``[U, D]``; ``sum`` ``[U]``); updated in place.
        step: ``[U]`` or scalar step count including this step (Adam only).
        cowclip: the clip parameters, or None for no clipping.
        clip_enabled: optional ``[U]`` bool mask of rows that may be clipped.

    Returns:
        ``[U]`` bool, True for rows whose gradient was clipped.

    Example::

        >>> w = torch.zeros(1, 2); g = torch.ones(1, 2)
        >>> _ = cowclip_row_update_("sgd", w, g, torch.tensor([1]), {}, torch.tensor(1), lr=0.5)
        >>> w
        tensor([[-0.5000, -0.5000]])
    """
    if cowclip is not None:
        grad, was_clipped = cowclip_clip(
            grad, weight, counts, cowclip.r, cowclip.zeta, clip_enabled
        )
    else:
        was_clipped = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
    grad = couple_weight_decay(grad, weight, weight_decay)
    if optimizer == "adam":
        adam_rows_(
            weight, grad, state["exp_avg"], state["exp_avg_sq"], step, lr,
            betas[0], betas[1], eps,
        )
    elif optimizer == "rowwise_adagrad":
        rowwise_adagrad_rows_(weight, grad, state["sum"], lr, eps)
    elif optimizer == "sgd":
        sgd_rows_(weight, grad, lr)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    return was_clipped

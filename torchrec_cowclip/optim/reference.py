"""Readable reference of the CowClip step on one whole table, from a dense gradient.

This is the update of ``docs/algorithm.md`` written as plainly as possible:
it takes the table's dense gradient ``dL/dW`` (as plain autograd produces it on an
ordinary ``torch.nn.EmbeddingBag``) and the count of each row in the batch, and updates
exactly the rows that occur. It is slow on purpose - it materialises a dense gradient -
and exists so that every fast path (the fused table-batched update, a GPU kernel, the
sharded update) can be tested against it.

Example::

    >>> import torch
    >>> from torchrec_cowclip.optim.options import CowClip
    >>> weight = torch.ones(4, 2)
    >>> grad = torch.zeros(4, 2); grad[1] = 10.0
    >>> counts = occurrence_counts(torch.tensor([1, 1, 3]), num_rows=4)
    >>> state = init_reference_state("sgd", weight)
    >>> clipped = reference_cowclip_step_(weight, grad, counts, state, optimizer="sgd",
    ...                                   lr=0.1, cowclip=CowClip(r=1.0, zeta=0.0))
    >>> clipped.tolist()                       # row 1: ||g|| = 14.1 > tau = 2 * 1.41
    [1]
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.optim.functional import cowclip_row_update_
from torchrec_cowclip.optim.options import CountLR, CowClip
from torchrec_cowclip.optim.rules import STATE_LAYOUT, update_rule


def occurrence_counts(ids: Tensor, num_rows: int) -> Tensor:
    """Spec steps 1-2: ``c_j``, how often each row id occurs in the batch's lookups
    (every position of every bag of every feature mapped to the table)."""
    return torch.bincount(ids.reshape(-1), minlength=num_rows)


def init_reference_state(optimizer: str, weight: Tensor) -> Dict[str, Tensor]:
    """Zero optimizer state for a whole table, plus the step counter."""
    state: Dict[str, Tensor] = {}
    for name, per_row in STATE_LAYOUT[optimizer]:
        shape = weight.shape if per_row == "D" else weight.shape[:1]
        state[name] = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
    state["step"] = torch.zeros((), dtype=torch.int64)
    return state


def reference_cowclip_step_(
    weight: Tensor,
    dense_grad: Tensor,
    counts: Tensor,
    state: Dict[str, Tensor],
    *,
    optimizer: str,
    lr: float,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    cowclip: Optional[CowClip] = None,
    clip_table: bool = True,
    count_lr: Optional[CountLR] = None,
) -> Tensor:
    """One CowClip step on a table, in place on ``weight`` and ``state``.

    Args:
        weight: ``[N, D]`` the table.
        dense_grad: ``[N, D]`` ``dL/dW`` of the mean batch loss.
        counts: ``[N]`` occurrences of each row in the batch (:func:`occurrence_counts`).
        state: from :func:`init_reference_state`; its ``step`` advances by one.
        clip_table: False for tables that opt out of clipping.
        count_lr: optional per-row rate from the row's count (:class:`CountLR`).

    Returns:
        the ids of the rows whose gradient was clipped.
    """
    state["step"] += 1
    rows = torch.nonzero(counts, as_tuple=True)[0]  # step 5: only rows in I move
    row_weight = weight[rows].clone()
    row_state = {name: state[name][rows].clone() for name, _ in STATE_LAYOUT[optimizer]}
    rule = update_rule(optimizer)
    clipped = cowclip_row_update_(
        rule.step,
        row_weight,
        dense_grad[rows],
        counts[rows],
        row_state,
        state["step"],
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        cowclip=cowclip if clip_table else None,
        count_lr=count_lr,
        decoupled_weight_decay=rule.decoupled_weight_decay,
    )
    weight[rows] = row_weight
    for name, _ in STATE_LAYOUT[optimizer]:
        state[name][rows] = row_state[name]
    return rows[clipped]

"""The fused optimizer's state in TorchRec/FBGEMM's layout, and back, sharing storage.

TorchRec keys a fused table's optimizer state by FBGEMM's names, prefixed with the
table: ``{"ebc.embedding_bags.t0.weight": {"t0.momentum1": ...}}`` - the first state is
``momentum1`` whatever the optimizer (row-wise Adagrad's accumulator, Adam's first
moment), the others FBGEMM's own names (Adam's ``exp_avg_sq``). This project keys it as
``torch.optim`` does - ``{"exp_avg", "exp_avg_sq", "sum", "step"}`` - for the unsharded and
the sharded collection alike (``UpdateRule.fbgemm_states`` pairs the names).

:func:`fbgemm_state_dict` renames a state dict of ours to FBGEMM's layout with the SAME
tensors (views of the live state), so that
``torch.distributed.checkpoint.load({"optim": fbgemm_state_dict(opt.state_dict())}, ...)``
resumes a stock TorchRec checkpoint in place, and ``dcp.save`` of it writes one that stock
TorchRec loads; :func:`cowclip_state_dict` is the inverse for a state dict held in memory.

A ``CombinedOptimizer``'s state dict holds other optimizers' parameters beside the
tables (``dense.top.bias``): every key that is not a table weight's
(``...embedding_bags.<table>.weight``) passes through both ways unchanged.

What does not convert: FBGEMM keeps no per-table step (Adam's bias correction counts in
the TBE's own ``iter``), so ``step`` is left out one way and kept from ``like`` the other;
under column-wise sharding FBGEMM keeps row-wise Adagrad's accumulator per column shard
(``k x rows`` entries, each over its shard's columns), where CowClip keeps one per whole
row: loading one into the other fails on the size; and the counters of FBGEMM's
``WeightDecayMode.COWCLIP`` (``prev_iter``, ``row_counter``: the last step a row appeared
in and how many steps it appeared in) have no counterpart, since CowClip counts a row's
occurrences in each batch anew: :func:`cowclip_state_dict` warns naming each one it
drops (docs/torchrec.md, "FBGEMM's COWCLIP").

Example::

    >>> import torch
    >>> ours = {"state": {"ebc.embedding_bags.t0.weight": {"sum": torch.ones(3),
    ...                                                     "step": torch.tensor(5)}}}
    >>> stock = fbgemm_state_dict(ours)
    >>> stock
    {'state': {'ebc.embedding_bags.t0.weight': {'t0.momentum1': tensor([1., 1., 1.])}}}
    >>> stock["state"]["ebc.embedding_bags.t0.weight"]["t0.momentum1"] is ours["state"][
    ...     "ebc.embedding_bags.t0.weight"]["sum"]
    True
    >>> back = cowclip_state_dict(stock, like=ours)
    >>> sorted(back["state"]["ebc.embedding_bags.t0.weight"])
    ['step', 'sum']
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Mapping

from torchrec_cowclip.optim.rules import UPDATE_RULES, UpdateRule

__all__ = ["cowclip_state_dict", "fbgemm_state_dict", "is_table_key", "table_of_key"]


def is_table_key(key: str) -> bool:
    """Whether ``key`` is a table weight's (``<...>embedding_bags.<table>.weight``), not
    another optimizer's parameter in a ``CombinedOptimizer`` (``dense.top.bias``).

    Example::

        >>> is_table_key("sparse.ebc.embedding_bags.t0.weight"), is_table_key("dense.top.weight")
        (True, False)
    """
    parts = key.split(".")
    return len(parts) >= 3 and parts[-1] == "weight" and parts[-3] == "embedding_bags"


def table_of_key(key: str) -> str:
    """The table of a fused parameter key (``"ebc.embedding_bags.t0.weight"`` -> ``"t0"``)."""
    parts = key.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        raise ValueError(f"{key!r} is not a table weight's key (<...>.<table>.weight)")
    return parts[-2]


def _rule_of(key: str, state_names: Any) -> UpdateRule:
    names = set(state_names) - {"step"}
    for rule in UPDATE_RULES.values():
        if names == {name for name, _ in rule.state_layout}:
            return rule
    raise ValueError(
        f"{key}: optimizer state {sorted(state_names)} is not a CowClip update rule's "
        f"({', '.join(f'{r.name}: {[n for n, _ in r.state_layout]}' for r in UPDATE_RULES.values())})"
    )


def fbgemm_state_dict(state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """``state_dict`` (a CowClip fused optimizer's, or a ``CombinedOptimizer``'s holding
    one) with every table's state under TorchRec/FBGEMM's names; the tensors are the same
    objects (``step`` is left out: FBGEMM keeps none per table). The state of keys that
    are not tables' (:func:`is_table_key`: the dense optimizer's) is passed through.

    Raises:
        ValueError: a table's state is not one of the update rules', or a rule's state
            has no FBGEMM counterpart.
    """
    state: Dict[str, Dict[str, Any]] = {}
    for key, table_state in state_dict["state"].items():
        if not is_table_key(key):
            state[key] = table_state
            continue
        rule = _rule_of(key, table_state)
        table = table_of_key(key)
        renamed = dict(rule.fbgemm_states)
        missing = [n for n, _ in rule.state_layout if n not in renamed]
        if missing:
            raise ValueError(f"{key}: {rule.name}'s state {missing} has no FBGEMM counterpart")
        state[key] = {f"{table}.{renamed[name]}": table_state[name] for name in renamed}
    return {**{k: v for k, v in state_dict.items() if k != "state"}, "state": state}


def cowclip_state_dict(fbgemm_state: Mapping[str, Any], like: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`fbgemm_state_dict`: a stock TorchRec/FBGEMM fused optimizer
    state dict under this project's names, for the tables of ``like`` (the state dict of
    the optimizer it is for, which supplies each table's rule and its ``step``).

    Keys that are not tables' pass through from ``fbgemm_state``. State FBGEMM keeps that
    CowClip has no use for (``WeightDecayMode.COWCLIP``'s ``prev_iter`` and
    ``row_counter``) is dropped with a warning naming it.

    Raises:
        ValueError: the two hold different tables, or a table's FBGEMM state lacks a
            tensor (named), before anything is built.
    """
    stock, ours = fbgemm_state["state"], like["state"]
    if set(stock) != set(ours):
        raise ValueError(
            f"the FBGEMM state holds tables {sorted(stock)}, this optimizer {sorted(ours)}"
        )
    state: Dict[str, Dict[str, Any]] = {}
    dropped = []
    for key, table_state in ours.items():
        if not is_table_key(key):
            state[key] = stock[key]
            continue
        rule = _rule_of(key, table_state)
        table = table_of_key(key)
        converted = {}
        for name, fbgemm_name in rule.fbgemm_states:
            entry = f"{table}.{fbgemm_name}"
            if entry not in stock[key]:
                raise ValueError(f"{key}: the FBGEMM state has no {entry!r} ({sorted(stock[key])})")
            converted[name] = stock[key][entry]
        used = {f"{table}.{fbgemm_name}" for _, fbgemm_name in rule.fbgemm_states}
        dropped += [entry for entry in stock[key] if entry not in used]
        if "step" in table_state:
            converted["step"] = table_state["step"]
        state[key] = converted
    if dropped:
        warnings.warn(
            f"cowclip_state_dict: FBGEMM state {sorted(dropped)} dropped: CowClip keeps no "
            "such state (FBGEMM's WeightDecayMode.COWCLIP counts the steps a row appeared "
            "in across steps; CowClip counts its occurrences in each batch anew)",
            stacklevel=2,
        )
    return {**{k: v for k, v in like.items() if k != "state"}, "state": state}

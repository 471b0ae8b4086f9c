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

What does not convert: FBGEMM keeps no per-table step (Adam's bias correction counts in
the TBE's own ``iter``), so ``step`` is left out one way and kept from ``like`` the other;
and under column-wise sharding FBGEMM keeps row-wise Adagrad's accumulator per column shard
(``k x rows`` entries, each over its shard's columns), where CowClip keeps one per whole
row: loading one into the other fails on the size.

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

from typing import Any, Dict, Mapping

from torchrec_cowclip.optim.rules import UPDATE_RULES, UpdateRule

__all__ = ["cowclip_state_dict", "fbgemm_state_dict", "table_of_key"]


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
    objects (``step`` is left out: FBGEMM keeps none per table).

    Raises:
        ValueError: a table's state is not one of the update rules', or a rule's state
            has no FBGEMM counterpart.
    """
    state: Dict[str, Dict[str, Any]] = {}
    for key, table_state in state_dict["state"].items():
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
    for key, table_state in ours.items():
        rule = _rule_of(key, table_state)
        table = table_of_key(key)
        converted = {}
        for name, fbgemm_name in rule.fbgemm_states:
            entry = f"{table}.{fbgemm_name}"
            if entry not in stock[key]:
                raise ValueError(f"{key}: the FBGEMM state has no {entry!r} ({sorted(stock[key])})")
            converted[name] = stock[key][entry]
        if "step" in table_state:
            converted["step"] = table_state["step"]
        state[key] = converted
    return {**{k: v for k, v in like.items() if k != "state"}, "state": state}

"""The optimizer registry: a rule registered in one place is what the collection, the
options, the planner view and the CLI's choices offer (and removed, no longer)."""

from __future__ import annotations

import pytest
import torch
from tiny import bag_config
from torchrec import KeyedJaggedTensor

from torchrec_cowclip import CowClipEmbeddingBagCollection
from torchrec_cowclip.distributed.sharder import PLANNER_OPTIMIZER_CLASS
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.rules import (
    OPTIMIZERS,
    STATE_LAYOUT,
    UPDATE_RULES,
    UpdateRule,
    register_update_rule,
    unregister_update_rule,
)
from torchrec_cowclip.train.config import EMBEDDING_OPTIMIZERS

MOMENTUM = 0.5


def _heavy_ball(weight, grad, state, *, lr, **_):
    """Toy rule: ``v = m * v + g``; ``W -= lr * v`` (one value per column)."""
    state["velocity"].mul_(MOMENTUM).add_(grad)
    weight.sub_(lr * state["velocity"])


TOY = UpdateRule("toy_heavy_ball", _heavy_ball, (("velocity", "D"),), "torch.optim.Adagrad")


@pytest.fixture
def toy_rule(monkeypatch):
    register_update_rule(TOY)
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "0")  # the registry, not Inductor
    try:
        yield TOY
    finally:
        unregister_update_rule(TOY.name)


def test_the_built_in_views_are_the_registry():
    assert (
        OPTIMIZERS == ("adam", "rowwise_adagrad", "sgd", "adagrad", "adamw") == tuple(UPDATE_RULES)
    )
    assert STATE_LAYOUT["rowwise_adagrad"] == (("sum", "1"),)
    assert PLANNER_OPTIMIZER_CLASS["adam"] is torch.optim.Adam
    assert PLANNER_OPTIMIZER_CLASS["adamw"] is torch.optim.AdamW
    assert STATE_LAYOUT["adagrad"] == (("sum", "D"),)


def test_a_registered_rule_trains_a_collection_end_to_end(toy_rule):
    assert toy_rule.name in OPTIMIZERS and toy_rule.name in EMBEDDING_OPTIMIZERS
    assert STATE_LAYOUT[toy_rule.name] == (("velocity", "D"),)
    assert PLANNER_OPTIMIZER_CLASS[toy_rule.name] is torch.optim.Adagrad

    ebc = CowClipEmbeddingBagCollection(
        [bag_config("t", 3, 5)],
        options=CowClipOptions(optimizer=toy_rule.name, lr=0.1, cowclip=None),
    )
    start = ebc.embedding_bags["t"].weight.detach().clone()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([1, 1, 4]), lengths=torch.tensor([2, 1])
    )
    for _ in range(2):
        ebc(kjt).values().sum().backward()
    # Row 1 is seen twice per step (g = 2), row 4 once (g = 1): v1 = g, v2 = m * g + g.
    expected = start.clone()
    for row, g in ((1, 2.0), (4, 1.0)):
        expected[row] -= 0.1 * (g + (MOMENTUM * g + g))
    torch.testing.assert_close(ebc.embedding_bags["t"].weight.detach(), expected)
    state = ebc.fused_optimizer.state_dict()["state"]["embedding_bags.t.weight"]
    torch.testing.assert_close(state["velocity"][1], torch.full((3,), MOMENTUM * 2.0 + 2.0))


def test_a_removed_rule_is_refused_and_names_are_unique(toy_rule):
    with pytest.raises(ValueError, match="already registered"):
        register_update_rule(toy_rule)
    unregister_update_rule(toy_rule.name)
    try:
        assert toy_rule.name not in OPTIMIZERS and toy_rule.name not in STATE_LAYOUT
        with pytest.raises(ValueError, match="optimizer must be one of"):
            CowClipOptions(optimizer=toy_rule.name)
    finally:
        register_update_rule(toy_rule)  # the fixture removes it


def test_a_state_layout_entry_must_be_per_column_or_per_row():
    with pytest.raises(ValueError, match=r"state layout entries must be \(name, 'D' or '1'\)"):
        UpdateRule("bad", _heavy_ball, (("velocity", "2"),), "torch.optim.SGD")

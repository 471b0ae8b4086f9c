"""All-or-nothing loads (issue 21, failure 6): ``fused_optimizer.load_state_dict`` with one
wrong-shaped tensor raised after overwriting the state tensors before it, naming no key.
Every load of this package now checks everything first and changes nothing on refusal.
(The sharded kernels' fused optimizer: ``tests/test_elastic.py``, on two processes.)"""

from __future__ import annotations

import math

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection
from torchrec_cowclip.optim.load_check import StateDictMismatch, check_loadable
from torchrec_cowclip.optim.options import CowClipOptions


def _ebc() -> CowClipEmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=4, num_embeddings=20 + i, feature_names=[f"f{i}"]
        )
        for i in range(3)
    ]
    ebc = CowClipEmbeddingBagCollection(
        tables, options=CowClipOptions(optimizer="adam", lr=1e-2, cowclip=CowClip())
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"],
        values=torch.tensor([1, 2, 3, 4, 5, 6]),
        lengths=torch.ones(6, dtype=torch.int64),
    )
    ebc(kjt).values().square().sum().backward()  # the state is no longer all zeros
    return ebc


def _state(ebc):
    return {
        (key, name): value.clone()
        for key, per_param in ebc.fused_optimizer.state_dict()["state"].items()
        for name, value in per_param.items()
    }


def _shifted(ebc):
    """A loadable state dict: every state tensor of ``ebc`` plus one."""
    return {
        "state": {
            key: {name: value + 1 for name, value in per_param.items()}
            for key, per_param in ebc.fused_optimizer.state_dict()["state"].items()
        }
    }


def _unchanged(before, after):
    return before.keys() == after.keys() and all(
        torch.equal(after[k], v) for k, v in before.items()
    )


def test_a_good_state_dict_loads():
    ebc = _ebc()
    incoming = _shifted(ebc)
    ebc.fused_optimizer.load_state_dict(incoming)
    for (key, name), value in _state(ebc).items():
        assert torch.equal(value, incoming["state"][key][name])


@pytest.mark.parametrize("fault", ["shape", "dtype", "nan", "missing", "unexpected"])
def test_a_bad_state_dict_is_refused_whole_naming_the_key(fault):
    ebc = _ebc()
    before = _state(ebc)
    assert len(before) == 9  # 3 tables x (exp_avg, exp_avg_sq, step)
    incoming = _shifted(ebc)
    last = "embedding_bags.t2.weight"  # the last table: every other tensor comes first
    if fault == "shape":
        incoming["state"][last]["exp_avg_sq"] = torch.zeros(21, 4)
        expected = rf"\['{last}'\]\['exp_avg_sq'\] is \[21, 4\] float32 in the state dict, \[22, 4\] float32 here"
    elif fault == "dtype":
        incoming["state"][last]["exp_avg_sq"] = torch.zeros(22, 4, dtype=torch.float64)
        expected = r"\[22, 4\] float64 in the state dict, \[22, 4\] float32 here"
    elif fault == "nan":
        incoming["state"][last]["exp_avg"][3, 1] = math.nan
        expected = rf"\['{last}'\]\['exp_avg'\] holds NaN or inf values"
    elif fault == "missing":
        del incoming["state"][last]["exp_avg"]
        expected = rf"\['{last}'\]\['exp_avg'\] is missing from the state dict"
    else:
        incoming["state"][last]["momentum"] = torch.zeros(22, 4)
        expected = rf"\['{last}'\]\['momentum'\] is not expected in the state dict"
    with pytest.raises(
        StateDictMismatch, match=rf"^fused optimizer: .*{expected}.*nothing was loaded"
    ):
        ebc.fused_optimizer.load_state_dict(incoming)
    assert _unchanged(before, _state(ebc)), "a refused load changed the optimizer state"


def test_bad_hyperparameters_in_the_param_groups_are_refused_before_the_state_changes():
    ebc = _ebc()
    optimizer = ebc.fused_optimizer
    optimizer.save_param_groups(True)
    before = _state(ebc)
    incoming = _shifted(ebc)
    incoming["param_groups"] = optimizer.state_dict()["param_groups"]
    incoming["param_groups"][0]["lr"] = math.nan
    with pytest.raises(
        StateDictMismatch, match=r"param_groups\[0\]: lr must be >= 0 and finite, got nan"
    ):
        optimizer.load_state_dict(incoming)
    assert _unchanged(before, _state(ebc)) and optimizer.param_groups[0]["lr"] == 1e-2


def test_the_collection_refuses_a_misshapen_weight_and_keeps_every_weight():
    ebc = _ebc()
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    incoming = {k: v + 1 for k, v in before.items()}
    incoming["embedding_bags.t2.weight"] = torch.zeros(5, 4)
    with pytest.raises(StateDictMismatch, match=r"embedding_bags.t2.weight'\] is \[5, 4\]"):
        ebc.load_state_dict(incoming)
    assert _unchanged(before, {k: v.clone() for k, v in ebc.state_dict().items()})
    ebc.load_state_dict({k: v + 1 for k, v in before.items()})  # a fitting one loads
    assert torch.equal(
        ebc.state_dict()["embedding_bags.t0.weight"], before["embedding_bags.t0.weight"] + 1
    )


def test_clip_counters_are_checked_before_any_is_restored():
    ebc = _ebc()
    before = {k: v.clone() for k, v in ebc.table_counters().items()}
    incoming = {k: v + 7 for k, v in before.items()}
    incoming["t2"] = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(StateDictMismatch, match=r"clip counters: \['t2'\] is \[5\] int64"):
        ebc.load_table_counters(incoming)
    assert {k: v.tolist() for k, v in ebc.table_counters().items()} == {
        k: v.tolist() for k, v in before.items()
    }
    saved = ebc.clip_counters.state()
    with pytest.raises(StateDictMismatch, match=r"clip counters: \[0\] is \[1\] int64"):
        ebc.clip_counters.load_state([torch.zeros(1, dtype=torch.int64)] + saved[1:])
    assert all(torch.equal(a, b) for a, b in zip(ebc.clip_counters.state(), saved))


def test_check_loadable_compares_by_whatever_keys_there_are():
    live = {"a": [torch.zeros(2), {"b": torch.ones(3)}], "meta": "x"}
    check_loadable({"a": [torch.ones(2), {"b": torch.zeros(3)}], "meta": "y"}, live)
    with pytest.raises(StateDictMismatch, match=r"\['a'\]\[1\]\['b'\] is \[4\]"):
        check_loadable({"a": [torch.ones(2), {"b": torch.zeros(4)}], "meta": "y"}, live)
    with pytest.raises(StateDictMismatch, match=r"\['a'\] has 1 items in the state dict, 2 here"):
        check_loadable({"a": [torch.ones(2)], "meta": "y"}, live)

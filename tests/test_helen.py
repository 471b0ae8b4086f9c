"""Helen's fused two-pass step on CowClipEmbeddingBagCollection against a dense float64
re-derivation, and its failure modes (nothing changes when a step is refused)."""

import copy
import io
from dataclasses import replace

import pytest
import torch
from cowclip_testing import (
    HelenDenseReference,
    assert_close_to_reference,
    curved_loss,
    default_cowclip,
    random_kjt,
    to_device,
)
from tiny import HELEN_ORDER, HYPER, load_mixed_scale_weights, mixed_tables

from torchrec_cowclip import CowClipEmbeddingBagCollection, Helen
from torchrec_cowclip.embedding import row_updates
from torchrec_cowclip.optim.options import CowClipOptions


def _build(optimizer, cowclip, helen, gen, device=None, **hyper):
    tables = mixed_tables(dim=6, small_dim=3, order=HELEN_ORDER)
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables],
        device=device,
        options=CowClipOptions(
            optimizer=optimizer,
            cowclip=cowclip,
            unclipped_tables=("linear",),
            helen=helen,
            **{**HYPER, **hyper},
        ),
    )
    weights = load_mixed_scale_weights(ebc, tables, gen)
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    head = torch.nn.Linear(width, 1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen))
        head.bias.fill_(0.1)
    ref = HelenDenseReference(
        tables,
        weights,
        optimizer,
        unclipped_tables=("linear",),
        cowclip=cowclip,
        helen=helen,
        head=head,
        **{**HYPER, **hyper},
    )
    return ebc, head.to(ebc.device), ref, tables


def _batch(tables, gen, batch_size=8):
    kjt = random_kjt(tables, batch_size=batch_size, generator=gen)
    labels = (torch.rand(batch_size, generator=gen) < 0.4).float()
    return kjt, labels


def _assert_tables_match(ebc, ref, tables):
    state = ebc.fused_optimizer.state_dict()["state"]
    for t in tables:
        assert_close_to_reference(
            ebc.embedding_bags[t.name].weight.detach(),
            ref.weight(t.name),
            msg=lambda m: f"table {t.name}: {m}",
        )
        for key, value in ref.state[t.name].items():
            assert_close_to_reference(
                state[f"embedding_bags.{t.name}.weight"][key],
                value,
                msg=lambda m: f"{t.name}.{key}: {m}",
            )


def _helen_steps(ebc, head, ref, tables, gen, steps, perturb_dense=False):
    for _ in range(steps):
        kjt, labels = _batch(tables, gen)
        on_device = to_device(kjt, ebc.device), labels.to(ebc.device)
        head.zero_grad(set_to_none=True)

        def closure():
            return curved_loss(ebc(on_device[0]).values(), head, on_device[1])

        loss = ebc.helen_step(closure, dense_params=head.parameters() if perturb_dense else None)
        ref_loss = ref.helen_step(kjt, labels)
        assert_close_to_reference(loss, ref_loss)
        _assert_tables_match(ebc, ref, tables)
        for p, g in zip(head.parameters(), ref.dense_grads):
            assert_close_to_reference(p.grad, g, msg=lambda m: f"dense grad: {m}")


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("clip", [True, False], ids=["cowclip", "noclip"])
def test_helen_steps_match_dense_two_pass_reference(optimizer, clip, device):
    """Three Helen steps (shared table, MEAN pooling, multi-hot bags with duplicates) on
    ``device`` equal the float64 dense re-derivation on CPU: weights, optimizer state,
    returned loss, and the dense parameters' first-pass gradient."""
    gen = torch.Generator().manual_seed(3)
    cowclip = default_cowclip() if clip else None
    ebc, head, ref, tables = _build(optimizer, cowclip, Helen(rho=0.5, bound=0.3), gen, device)
    _helen_steps(ebc, head, ref, tables, gen, steps=3)
    if clip:
        assert sum(s.total_rows_clipped for s in ebc.clip_stats().values()) > 0


def test_helen_with_perturbed_dense_parameters_matches_reference():
    """``Helen(perturb_dense=True)``: the head is perturbed SAM-style with its global
    gradient norm, restored, and holds the second pass's gradient."""
    gen = torch.Generator().manual_seed(4)
    helen = Helen(rho=0.5, bound=0.3, perturb_dense=True)
    ebc, head, ref, tables = _build("adam", default_cowclip(), helen, gen)
    before = [p.detach().clone() for p in head.parameters()]
    _helen_steps(ebc, head, ref, tables, gen, steps=2, perturb_dense=True)
    for p, b in zip(head.parameters(), before):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)  # restored exactly


def test_the_perturbation_changes_the_update():
    """The comparison can fail: the same steps without the perturbation (rho=0 in our
    module only) do not match the reference."""
    gen = torch.Generator().manual_seed(3)
    ebc, head, ref, tables = _build("adam", default_cowclip(), Helen(rho=0.5), gen)
    ebc.row_updates.helen = Helen(rho=0.0)
    with pytest.raises(AssertionError, match="not close"):
        _helen_steps(ebc, head, ref, tables, gen, steps=1)


def test_rho_zero_equals_a_plain_step():
    """``Helen(rho=0)`` evaluates the second pass at W: bit-identical to one backward."""
    gen = torch.Generator().manual_seed(5)
    helen_ebc, head, _, tables = _build("adam", default_cowclip(), Helen(rho=0.0), gen)
    plain = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables],
        options=CowClipOptions(
            optimizer="adam", cowclip=default_cowclip(), unclipped_tables=("linear",), **HYPER
        ),
    )
    plain.load_state_dict(helen_ebc.state_dict())
    for _ in range(2):
        kjt, labels = _batch(tables, gen)
        helen_ebc.helen_step(lambda: curved_loss(helen_ebc(kjt).values(), head, labels))
        curved_loss(plain(kjt).values(), head, labels).backward()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(helen_ebc.state_dict()[key], value, rtol=0, atol=0)


def test_plain_backward_on_a_helen_module_raises_and_changes_nothing():
    gen = torch.Generator().manual_seed(6)
    ebc, head, _, tables = _build("adam", default_cowclip(), Helen(), gen)
    before = copy.deepcopy(ebc.state_dict())
    kjt, labels = _batch(tables, gen)
    with pytest.raises(RuntimeError, match=r"trained by Helen .*helen_step\(closure\)"):
        curved_loss(ebc(kjt).values(), head, labels).backward()
    for key, value in before.items():
        torch.testing.assert_close(ebc.state_dict()[key], value, rtol=0, atol=0)
    assert all(s.steps == 0 for s in ebc.clip_stats().values())


def _state(ebc):
    return copy.deepcopy((ebc.state_dict(), ebc.fused_optimizer.state_dict()))


def _assert_unchanged(ebc, before):
    weights, optim = _state(ebc)
    for key, value in before[0].items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0)
    for key, value in before[1]["state"].items():
        for name, tensor in value.items():
            torch.testing.assert_close(optim["state"][key][name], tensor, rtol=0, atol=0)


def _failing_second_pass(ebc, head, kjt, labels, why):
    """A Helen closure whose second call (the second pass) raises ``ValueError(why)``."""
    calls = []

    def closure():
        calls.append(1)
        if len(calls) == 2:
            raise ValueError(why)
        return curved_loss(ebc(kjt).values(), head, labels)

    return closure


def test_a_failing_second_pass_restores_the_weights():
    gen = torch.Generator().manual_seed(8)
    ebc, head, _, tables = _build("adam", default_cowclip(), Helen(rho=1.0), gen)
    kjt, labels = _batch(tables, gen)
    before = _state(ebc)
    with pytest.raises(ValueError, match="data went away"):
        ebc.helen_step(_failing_second_pass(ebc, head, kjt, labels, "data went away"))
    _assert_unchanged(ebc, before)
    # The module trains on afterwards.
    ebc.helen_step(lambda: curved_loss(ebc(kjt).values(), head, labels))
    assert ebc.clip_stats()["shared"].steps == 1


def test_a_closure_that_changes_its_batch_is_refused_before_any_update():
    gen = torch.Generator().manual_seed(9)
    ebc, head, _, tables = _build("adam", default_cowclip(), Helen(), gen)
    batches = [_batch(tables, gen), _batch(tables, gen)]
    before = _state(ebc)

    def closure():
        kjt, labels = batches.pop(0)
        return curved_loss(ebc(kjt).values(), head, labels)

    with pytest.raises(RuntimeError, match="looked up other rows than its first"):
        ebc.helen_step(closure)
    _assert_unchanged(ebc, before)


@pytest.mark.parametrize(
    "closure_result, error, match",
    [
        (lambda out: out.sum(dim=1), TypeError, "scalar loss tensor"),
        (lambda out: 1.0, TypeError, "returned float"),
    ],
)
def test_a_closure_that_does_not_return_the_loss_is_refused(closure_result, error, match):
    gen = torch.Generator().manual_seed(10)
    ebc, _, _, tables = _build("adam", None, Helen(), gen)
    kjt, _ = _batch(tables, gen)
    before = _state(ebc)
    with pytest.raises(error, match=match):
        ebc.helen_step(lambda: closure_result(ebc(kjt).values()))
    _assert_unchanged(ebc, before)


def test_dense_params_must_agree_with_perturb_dense():
    gen = torch.Generator().manual_seed(11)
    ebc, head, _, tables = _build("adam", None, Helen(), gen)
    with pytest.raises(ValueError, match="dense_params=.*perturb_dense=True"):
        ebc.helen_step(lambda: torch.zeros(()), dense_params=head.parameters())
    ebc_dense, _, _, _ = _build("adam", None, Helen(perturb_dense=True), gen)
    with pytest.raises(ValueError, match=r"pass them, helen_step\(closure, dense_params="):
        ebc_dense.helen_step(lambda: torch.zeros(()))


def test_helen_step_needs_a_helen_module():
    gen = torch.Generator().manual_seed(12)
    ebc, head, _, tables = _build("adam", None, None, gen)
    with pytest.raises(RuntimeError, match=r"built with helen=Helen"):
        ebc.helen_step(lambda: torch.zeros((), requires_grad=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rho=float("nan")), "rho must be >= 0 and finite"),
        (dict(rho=-0.1), "rho must be >= 0 and finite"),
        (dict(bound=1.5), r"bound must be in \[0, 1\]"),
        (dict(perturb_dense=1), "perturb_dense must be a bool"),
    ],
)
def test_bad_helen_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Helen(**kwargs)


def test_state_dict_round_trip_resumes_exactly():
    """Two Helen steps, save, load into a fresh module, two more steps: identical to four
    uninterrupted steps."""
    gen = torch.Generator().manual_seed(13)
    ebc, head, _, tables = _build("adam", default_cowclip(), Helen(rho=0.5), gen)
    batches = [_batch(tables, gen) for _ in range(4)]

    def step(module, kjt, labels):
        module.helen_step(lambda: curved_loss(module(kjt).values(), head, labels))

    fresh = copy.deepcopy(ebc)
    for kjt, labels in batches[:2]:
        step(ebc, kjt, labels)
    buffer = io.BytesIO()
    torch.save((ebc.state_dict(), ebc.fused_optimizer.state_dict()), buffer)
    buffer.seek(0)
    weights, optim = torch.load(buffer, weights_only=True)
    fresh.load_state_dict(weights)
    fresh.fused_optimizer.load_state_dict(optim)
    for kjt, labels in batches[2:]:
        step(ebc, kjt, labels)
        step(fresh, kjt, labels)
    for key, value in ebc.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)
    for key, value in ebc.fused_optimizer.state_dict()["state"].items():
        for name, tensor in value.items():
            torch.testing.assert_close(
                fresh.fused_optimizer.state_dict()["state"][key][name], tensor, rtol=0, atol=0
            )


def test_cost_of_a_step_is_recorded(monkeypatch):
    gen = torch.Generator().manual_seed(14)
    ebc, head, _, tables = _build("sgd", None, Helen(), gen)
    kjt, labels = _batch(tables, gen)
    step = ebc.row_updates.helen_step(lambda: curved_loss(ebc(kjt).values(), head, labels))
    cost = step.cost
    assert cost is not None and cost.first_pass_s > 0 and cost.extra_s > 0
    assert row_updates.HelenCost is type(cost)


def test_a_failing_second_pass_restores_perturbed_dense_parameters_and_gradients():
    gen = torch.Generator().manual_seed(15)
    ebc, head, _, tables = _build("adam", None, Helen(rho=1.0, perturb_dense=True), gen)
    kjt, labels = _batch(tables, gen)
    curved_loss(ebc(kjt).values().detach(), head, labels).backward()
    first = [p.grad.clone() for p in head.parameters()]
    head.zero_grad(set_to_none=True)
    weights = [p.detach().clone() for p in head.parameters()]
    before = _state(ebc)
    closure = _failing_second_pass(ebc, head, kjt, labels, "second pass failed")
    with pytest.raises(ValueError, match="second pass failed"):
        ebc.helen_step(closure, dense_params=head.parameters())
    _assert_unchanged(ebc, before)
    for p, w, g in zip(head.parameters(), weights, first):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=0)
        torch.testing.assert_close(p.grad, g)

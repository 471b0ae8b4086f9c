"""The CowClip math (optim/functional.py) against hand computations of docs/algorithm.md."""

import math

import pytest
import torch

from torchrec_cowclip.optim.functional import (
    adam_rows_,
    couple_weight_decay,
    cowclip_clip,
    cowclip_row_update_,
    rowwise_adagrad_rows_,
    sgd_rows_,
    sgd_step,
)
from torchrec_cowclip.optim.options import CountLR, CowClip
from torchrec_cowclip.optim.rules import update_rule


def _scalar_clip(g, w, c, r, zeta):
    """Step 3 of docs/algorithm.md for one row, with Python floats."""
    gn = math.sqrt(sum(x * x for x in g))
    wn = math.sqrt(sum(x * x for x in w))
    tau = c * max(r * wn, zeta)
    scale = 1.0 if gn == 0 else min(1.0, tau / gn)
    return [x * scale for x in g], gn > tau


def test_clip_matches_hand_computation_row_by_row():
    torch.manual_seed(0)
    g = (
        torch.randn(50, 6, dtype=torch.float64)
        * torch.logspace(-3, 1, 50, dtype=torch.float64)[:, None]
    )
    w = torch.randn(50, 6, dtype=torch.float64) * 0.1
    c = torch.randint(1, 9, (50,))
    r, zeta = 0.7, 1e-3
    clipped, was_clipped = cowclip_clip(g, w, c, r, zeta)
    for j in range(50):
        expect, bound = _scalar_clip(g[j].tolist(), w[j].tolist(), int(c[j]), r, zeta)
        assert clipped[j].tolist() == pytest.approx(expect, rel=1e-12, abs=1e-15)
        assert bool(was_clipped[j]) == bound
    assert 0 < int(was_clipped.sum()) < 50, "the case must have rows on both sides of tau"


def test_clip_worked_example():
    # ||W|| = 5, c = 2 -> tau = 10; ||g|| = 50 -> scaled to norm 10.
    g, was = cowclip_clip(
        torch.tensor([[30.0, 40.0]]), torch.tensor([[3.0, 4.0]]), torch.tensor([2]), 1.0, 1e-5
    )
    assert g.tolist() == [[6.0, 8.0]] and was.tolist() == [True]


def test_clip_zeta_floor_applies_to_zero_rows():
    # W = 0: tau = c * zeta = 3 * 0.5 = 1.5; ||g|| = 5 -> scale 0.3.
    g, was = cowclip_clip(
        torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2), torch.tensor([3]), 1.0, 0.5
    )
    assert g.flatten().tolist() == pytest.approx([0.9, 1.2]) and was.tolist() == [True]


def test_zero_gradient_stays_zero_and_never_nan():
    g, was = cowclip_clip(torch.zeros(3, 4), torch.zeros(3, 4), torch.tensor([1, 2, 3]), 1.0, 0.0)
    assert torch.equal(g, torch.zeros(3, 4)) and not was.any()


def test_clip_enabled_mask_exempts_rows():
    g = torch.full((2, 2), 100.0)
    w = torch.ones(2, 2)
    out, was = cowclip_clip(
        g, w, torch.tensor([1, 1]), 1.0, 0.0, clip_enabled=torch.tensor([True, False])
    )
    assert was.tolist() == [True, False]
    assert torch.equal(out[1], g[1]) and torch.linalg.vector_norm(out[0]) == pytest.approx(2**0.5)


def test_weight_decay_is_coupled_after_clip():
    w = torch.tensor([[1.0, 2.0]])
    assert couple_weight_decay(torch.zeros(1, 2), w, 0.1).flatten().tolist() == pytest.approx(
        [0.1, 0.2]
    )
    # In the full step: the clipped gradient (norm tau) plus wd * W, not clip(g + wd * W).
    weight = torch.tensor([[3.0, 4.0]])
    grad = torch.tensor([[300.0, 400.0]])
    cowclip_row_update_(
        sgd_step,
        weight,
        grad,
        torch.tensor([1]),
        {},
        torch.tensor(1),
        lr=1.0,
        weight_decay=0.5,
        cowclip=CowClip(1.0, 0.0),
    )
    # clipped g = (3, 4) (norm 5 = tau), + 0.5 * (3, 4) -> (4.5, 6); W - g = (-1.5, -2).
    assert weight.flatten().tolist() == pytest.approx([-1.5, -2.0])


def test_adam_rows_matches_spec_formula_with_per_row_steps():
    torch.manual_seed(1)
    w = torch.randn(4, 3, dtype=torch.float64)
    m = torch.randn(4, 3, dtype=torch.float64) * 0.1
    v = torch.rand(4, 3, dtype=torch.float64) * 0.1
    g = torch.randn(4, 3, dtype=torch.float64)
    steps = torch.tensor([1, 2, 7, 1000])
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    expect_w = w.clone()
    for j in range(4):
        t = int(steps[j])
        for k in range(3):
            mk = b1 * m[j, k].item() + (1 - b1) * g[j, k].item()
            vk = b2 * v[j, k].item() + (1 - b2) * g[j, k].item() ** 2
            expect_w[j, k] -= lr * (mk / (1 - b1**t)) / (math.sqrt(vk / (1 - b2**t)) + eps)
    adam_rows_(w, g, m, v, steps, lr, b1, b2, eps)
    assert torch.allclose(w, expect_w, rtol=0, atol=1e-12)


def test_adam_rows_equals_torch_adam_on_fully_touched_table():
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(5, 4))
    opt = torch.optim.Adam([p], lr=1e-2, betas=(0.8, 0.99), eps=1e-6)
    w = p.detach().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t in range(1, 6):
        g = torch.randn(5, 4)
        p.grad = g.clone()
        opt.step()
        adam_rows_(w, g, m, v, torch.tensor(t), 1e-2, 0.8, 0.99, 1e-6)
    assert torch.allclose(w, p.detach(), rtol=1e-5, atol=1e-6)


def test_rowwise_adagrad_and_sgd_rows():
    w = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    s = torch.tensor([0.0, 3.0])
    g = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    rowwise_adagrad_rows_(w, g, s, lr=0.5, eps=0.0)
    # row 0: s = mean(4, 0) = 2; row 1: s = 3 + 1 = 4.
    assert s.tolist() == [2.0, 4.0]
    assert w.flatten().tolist() == pytest.approx([1 - 0.5 * 2 / 2**0.5, 1.0, -0.25, -0.25])
    w2 = torch.ones(1, 2)
    sgd_rows_(w2, torch.tensor([[1.0, -1.0]]), lr=0.1)
    assert w2.flatten().tolist() == pytest.approx([0.9, 1.1])


@pytest.mark.parametrize(
    "name, torch_class, kwargs",
    [
        ("adagrad", torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-6}),
        (
            "adamw",
            torch.optim.AdamW,
            {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.5},
        ),
    ],
)
def test_the_new_rules_equal_torchs_optimizer_on_a_fully_touched_table_without_a_clip(
    name, torch_class, kwargs
):
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.randn(5, 4))
    opt = torch_class([p], **kwargs)
    rule = update_rule(name)
    w = p.detach().clone()
    state = {n: torch.zeros_like(w) for n, _ in rule.state_layout}
    hyper = {"lr": kwargs["lr"], "eps": kwargs["eps"], "betas": kwargs.get("betas", (0.9, 0.999))}
    for t in range(1, 6):
        g = torch.randn(5, 4)
        p.grad = g.clone()
        opt.step()
        cowclip_row_update_(
            rule.step,
            w,
            g,
            torch.ones(5),
            state,
            torch.tensor(t),
            weight_decay=kwargs.get("weight_decay", 0.0),
            decoupled_weight_decay=rule.decoupled_weight_decay,
            **hyper,
        )
    torch.testing.assert_close(w, p.detach(), rtol=1e-5, atol=1e-6)


def test_the_clip_comes_before_adagrad_and_adamw_and_adamw_decays_the_weight_not_the_gradient():
    w0 = torch.tensor([[3.0, 4.0]])  # ||W|| = 5, tau = 1 * 5 at count 1, r 1
    g = torch.tensor([[30.0, 40.0]])  # clipped to [3, 4]
    w, state = w0.clone(), {"sum": torch.zeros(1, 2)}
    clipped = cowclip_row_update_(
        update_rule("adagrad").step,
        w,
        g,
        torch.tensor([1]),
        state,
        None,
        lr=1.0,
        eps=0.0,
        cowclip=CowClip(r=1.0, zeta=0.0),
    )
    assert clipped.tolist() == [True]
    assert state["sum"].tolist() == [[9.0, 16.0]]  # the clipped gradient's squares
    torch.testing.assert_close(w, w0 - 1.0)  # lr * g / sqrt(g**2) = 1 per element
    rule = update_rule("adamw")
    w, state = w0.clone(), {"exp_avg": torch.zeros(1, 2), "exp_avg_sq": torch.zeros(1, 2)}
    cowclip_row_update_(
        rule.step,
        w,
        g,
        torch.tensor([1]),
        state,
        torch.tensor(1),
        lr=0.1,
        eps=0.0,
        weight_decay=0.5,
        cowclip=CowClip(r=1.0, zeta=0.0),
        decoupled_weight_decay=rule.decoupled_weight_decay,
    )
    # The moments saw the clipped gradient only (no L2 in it); the weight decayed by
    # lr * wd, then took Adam's first step of lr * sign(g).
    torch.testing.assert_close(state["exp_avg"], 0.1 * torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(w, w0 * (1 - 0.1 * 0.5) - 0.1)


def test_cowclip_validation_and_reference_mapping():
    with pytest.raises(ValueError, match="r must be > 0"):
        CowClip(r=0.0)
    with pytest.raises(ValueError, match="zeta must be >= 0"):
        CowClip(zeta=-1.0)
    with pytest.raises(ValueError, match="finite"):
        CowClip(r=float("nan"))
    # Reference: clip = r * cnt * max(||w||, r * sqrt(D) * bound) -> zeta = r^2 sqrt(D) bound.
    cc = CowClip.from_reference(r=2.0, bound=1e-4, embedding_dim=16)
    assert cc.r == 2.0 and cc.zeta == pytest.approx(4 * 4 * 1e-4)


def test_unknown_optimizer_is_rejected():
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        update_rule("lamb")


def test_count_lr_multiplier_and_validation():
    rule = CountLR(power=0.5, cap=16)
    assert rule.multiplier(torch.tensor([1, 4, 9, 16, 1000])).tolist() == [1.0, 2.0, 3.0, 4.0, 4.0]
    assert CountLR(power=1.0, cap=8).multiplier(torch.tensor([3, 20])).tolist() == [3.0, 8.0]
    assert CountLR(power=0.0, cap=8).multiplier(torch.tensor([3, 20])).tolist() == [1.0, 1.0]
    assert CountLR(power=-1.0, cap=4).multiplier(torch.tensor([2, 9])).tolist() == [0.5, 0.25]
    for bad in (dict(cap=0.5), dict(power=float("nan")), dict(cap=float("inf"))):
        with pytest.raises(ValueError, match="CountLR"):
            CountLR(**bad)


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
def test_count_lr_equals_one_row_at_a_time_with_the_row_lr(optimizer):
    """A per-row rate from the count is the same as stepping each row alone at
    ``lr * min(c, cap) ** power``; the clip still uses the count as before."""
    gen = torch.Generator().manual_seed(4)
    n, d = 9, 5
    weight = torch.randn(n, d, generator=gen, dtype=torch.float64) * 0.1
    weight[:2] *= 1e-3  # the clip binds here
    grad = torch.randn(n, d, generator=gen, dtype=torch.float64) * 0.05
    counts = torch.tensor([1, 7, 1, 2, 3, 5, 8, 13, 40])
    rule = CountLR(power=0.5, cap=8.0)

    def fresh_state():
        if optimizer == "adam":
            return {
                "exp_avg": torch.full((n, d), 0.01, dtype=torch.float64),
                "exp_avg_sq": torch.full((n, d), 0.002, dtype=torch.float64),
            }
        if optimizer == "rowwise_adagrad":
            return {"sum": torch.full((n,), 0.3, dtype=torch.float64)}
        return {}

    kw = dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.02, cowclip=CowClip(r=1.0, zeta=1e-5))
    w_all, s_all = weight.clone(), fresh_state()
    clipped = cowclip_row_update_(
        update_rule(optimizer).step,
        w_all,
        grad,
        counts,
        s_all,
        torch.tensor(3),
        lr=0.1,
        count_lr=rule,
        **kw,
    )
    assert bool(clipped.any()) and not bool(clipped.all())
    for j in range(n):
        w_j, s_full = weight[j : j + 1].clone(), fresh_state()
        s_j = {k: v[j : j + 1].clone() for k, v in s_full.items()}
        lr_j = 0.1 * min(float(counts[j]), 8.0) ** 0.5
        clipped_j = cowclip_row_update_(
            update_rule(optimizer).step,
            w_j,
            grad[j : j + 1],
            counts[j : j + 1],
            s_j,
            torch.tensor(3),
            lr=lr_j,
            **kw,
        )
        torch.testing.assert_close(w_all[j : j + 1], w_j, rtol=1e-12, atol=1e-15)
        for k in s_j:
            torch.testing.assert_close(s_all[k][j : j + 1], s_j[k], rtol=1e-12, atol=1e-15)
        assert bool(clipped_j[0]) == bool(clipped[j])
    # cap 1 (the base batch) is the plain update to the bit.
    w_one, s_one = weight.clone(), fresh_state()
    w_plain, s_plain = weight.clone(), fresh_state()
    cowclip_row_update_(
        update_rule(optimizer).step,
        w_one,
        grad,
        counts,
        s_one,
        torch.tensor(3),
        lr=0.1,
        count_lr=CountLR(power=1.0, cap=1.0),
        **kw,
    )
    cowclip_row_update_(
        update_rule(optimizer).step, w_plain, grad, counts, s_plain, torch.tensor(3), lr=0.1, **kw
    )
    assert torch.equal(w_one, w_plain)

"""The compiled row update (TorchInductor) against the eager one and the functional math,
the mode that chooses between them (environment variable), and a failed compile (an
error in one line, never a silent fallback)."""

import os
import shutil

import pytest
import torch

from torchrec_cowclip.optim import row_step
from torchrec_cowclip.optim.functional import (
    RowSums,
    adam_bias_corrections,
    cowclip_row_update_,
    partial_row_sums,
)
from torchrec_cowclip.optim.options import CountLR, CowClip
from torchrec_cowclip.optim.row_step import (
    compiled_update_mode,
    gather_step_scatter_,
    set_compiled_update,
)
from torchrec_cowclip.optim.rules import update_rule

HAVE_COMPILER = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for Inductor")


#: The row step's hyperparameters for a plain SGD step at lr 0.1.
SGD_0_1 = dict(
    optimizer="sgd", lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, cowclip=None
)


def _problem(optimizer, num_rows=50, dim=6, touched=17, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, dim, generator=gen) * 0.05
    # A few rows tiny, so that the clip binds on them and not on the others.
    weight[:5] *= 1e-4
    state = {}
    if optimizer == "adam":
        state = {
            "exp_avg": torch.randn(num_rows, dim, generator=gen) * 1e-2,
            "exp_avg_sq": torch.rand(num_rows, dim, generator=gen) * 1e-3,
        }
    elif optimizer == "rowwise_adagrad":
        state = {"sum": torch.rand(num_rows, generator=gen)}
    rows = torch.sort(torch.randperm(num_rows, generator=gen)[:touched]).values
    rows[0] = 0  # a tiny row is touched
    grad = torch.randn(touched, dim, generator=gen) * 0.01
    counts = torch.randint(1, 4, (touched,), generator=gen)
    step = torch.randint(1, 9, (touched,), generator=gen)
    mask = torch.rand(touched, generator=gen) > 0.3
    return weight, state, rows, grad, counts, step, mask


def _expected(optimizer, weight, state, rows, grad, counts, step, **kw):
    """The functional math in float64 on CPU applied to the gathered rows, scattered by
    hand (the reference of every device and path)."""
    f64 = {k: v.detach().to("cpu", torch.float64) for k, v in state.items()}
    w = weight.detach().to("cpu", torch.float64)
    rows, counts, step = rows.cpu(), counts.cpu(), step.cpu()
    w_rows = w[rows].clone()
    s_rows = {k: v[rows].clone() for k, v in f64.items()}
    clipped = cowclip_row_update_(
        update_rule(optimizer).step,
        w_rows,
        grad.to("cpu", torch.float64),
        counts,
        s_rows,
        step,
        **kw,
    )
    w[rows] = w_rows
    for k in f64:
        f64[k][rows] = s_rows[k]
    return w, f64, clipped


def assert_close_to_reference(actual, expected, rtol=1e-5, atol=1e-7):
    """float32 on any device against the float64 CPU reference."""
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, check_dtype=False, check_device=False
    )


# (optimizer, dim, cowclip, coupled L2, per-row clip mask); dim 1 is DeepFM's first-order
# tables, a graph of its own.
CASES = [
    ("adam", 6, CowClip(r=1.0, zeta=1e-5), 0.01, True),
    ("adam", 1, CowClip(r=1.0, zeta=1e-5), 0.0, True),
    ("adam", 6, None, 0.0, False),
    ("rowwise_adagrad", 6, CowClip(r=1.0, zeta=1e-5), 0.01, True),
    ("sgd", 6, CowClip(r=0.5, zeta=1e-4), 0.0, False),
]
# (rows, touched) of the two calls per case: on CUDA, thousands of rows (many thread
# blocks and a ragged last one); on CPU, tens.
SIZES = {"cpu": ((50, 17), (50, 9)), "cuda": ((20_000, 6_000), (20_000, 4_001))}


@pytest.mark.parametrize(
    "mode", [pytest.param("1", marks=needs_compiler), "0"], ids=["compiled", "eager"]
)
@pytest.mark.parametrize("optimizer,dim,cowclip,weight_decay,masked", CASES)
def test_row_step_matches_the_functional_math(
    device, mode, optimizer, dim, cowclip, weight_decay, masked
):
    """The row step in float32 on ``device`` (Inductor's Triton kernels on CUDA when
    compiled) against the float64 functional math on CPU. Two calls with different lr and
    row counts: one graph serves both (dynamic shapes, lr not baked in), and both are right."""
    step_rows = row_step.row_step(compiled=mode == "1")
    any_clipped = any_unclipped = False
    for seed, ((num_rows, touched), lr) in enumerate(zip(SIZES[device.type], (0.05, 0.02))):
        weight, state, rows, grad, counts, step, mask = _problem(
            optimizer, num_rows, dim, touched, seed
        )
        kw = dict(
            lr=lr,
            betas=(0.8, 0.99),
            eps=1e-6,
            weight_decay=weight_decay,
            cowclip=cowclip,
            clip_enabled=mask if masked else None,
        )
        want_w, want_s, want_clipped = _expected(
            optimizer, weight, state, rows, grad, counts, step, **kw
        )
        weight, rows, grad, counts, step = (
            t.to(device) for t in (weight, rows, grad, counts, step)
        )
        state = {k: v.to(device) for k, v in state.items()}
        bias = adam_bias_corrections(step, 0.8, 0.99) if optimizer == "adam" else None
        clip_enabled = mask.to(device) if masked else None
        clipped = step_rows(
            weight,
            state,
            rows,
            grad,
            counts,
            optimizer=optimizer,
            lr=lr,
            betas=kw["betas"],
            eps=kw["eps"],
            weight_decay=weight_decay,
            cowclip=cowclip,
            clip_enabled=clip_enabled,
            adam_bias=bias,
        )
        assert_close_to_reference(weight, want_w)
        for key in state:
            assert_close_to_reference(state[key], want_s[key])
        assert torch.equal(clipped.cpu(), want_clipped)
        any_clipped |= bool(want_clipped.any())
        any_unclipped |= bool((~want_clipped).any())
    if cowclip is not None:  # the problem exercises both sides of the clip
        assert any_clipped and any_unclipped


def test_a_wrong_row_step_fails_the_check(device, wrong_row_step, monkeypatch):
    """The comparison above can fail: a row step that is off by 1e-3 on one row is caught."""
    with pytest.raises(AssertionError, match="not close"):
        test_row_step_matches_the_functional_math(device, "0", *CASES[-1])


@needs_compiler
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad"])
def test_compiled_column_shard_step_uses_whole_row_sums(optimizer):
    """With RowSums (a column shard), the compiled step equals the eager one."""
    weight, state, rows, grad, counts, step, _ = _problem(optimizer, dim=8)
    cols = slice(0, 3)
    shard_w = weight[:, cols].contiguous()
    shard_state = {
        k: (v[:, cols].contiguous() if v.dim() == 2 else v.clone()) for k, v in state.items()
    }
    sums = RowSums.from_sums(partial_row_sums(grad, weight[rows]), 8)
    results = []
    for compiled in (False, True):
        w, s = shard_w.clone(), {k: v.clone() for k, v in shard_state.items()}
        clipped = row_step.row_step(compiled)(
            w,
            s,
            rows,
            grad[:, cols].contiguous(),
            counts,
            adam_bias=adam_bias_corrections(step, 0.8, 0.99) if optimizer == "adam" else None,
            optimizer=optimizer,
            lr=0.05,
            betas=(0.8, 0.99),
            eps=1e-6,
            weight_decay=0.01,
            cowclip=CowClip(r=1.0, zeta=1e-5),
            row_sums=sums,
        )
        results.append((w, s, clipped))
    (w0, s0, c0), (w1, s1, c1) = results
    torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-7)
    for key in s0:
        torch.testing.assert_close(s1[key], s0[key], rtol=1e-5, atol=1e-7)
    assert torch.equal(c0, c1) and bool(c0.any())


def test_mode_comes_from_the_environment_and_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "0")
    assert compiled_update_mode() == "0"
    set_compiled_update("inductor")  # the environment, for this process and its children
    assert compiled_update_mode() == "inductor" == os.environ["TORCHREC_COWCLIP_COMPILE"]
    set_compiled_update(None)
    assert compiled_update_mode() == "auto"
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="TORCHREC_COWCLIP_COMPILE='sometimes'"):
        compiled_update_mode()
    with pytest.raises(ValueError, match="expected one of"):
        set_compiled_update("yes")


def test_a_failed_compile_raises_in_one_line_and_never_falls_back(monkeypatch):
    """A compiled step whose compile fails raises (naming the error and the eager switch)
    every time, and changes no row: a process never switches path on its own, so the
    ranks of a job never run different paths."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no compiler here\nand a second line")

    monkeypatch.setattr(row_step, "_compiled_gather_step_scatter", lambda: broken)
    weight, state, rows, grad, counts, step, _ = _problem("sgd")
    before = weight.clone()
    for _ in range(2):
        with pytest.raises(RuntimeError) as raised:
            row_step.row_step(compiled=True)(weight, {}, rows, grad, counts, **SGD_0_1)
        message = str(raised.value)
        assert "\n" not in message and "no compiler here" in message
        assert "TORCHREC_COWCLIP_COMPILE=0" in message
    assert len(calls) == 2 and torch.equal(weight, before)


def test_gather_step_scatter_touches_only_the_given_rows():
    weight, state, rows, grad, counts, step, _ = _problem("adam")
    before_w, before_s = weight.clone(), {k: v.clone() for k, v in state.items()}
    gather_step_scatter_(
        weight,
        state,
        rows,
        grad,
        counts,
        adam_bias=adam_bias_corrections(step, 0.8, 0.99),
        optimizer="adam",
        lr=0.05,
        betas=(0.8, 0.99),
        eps=1e-6,
        weight_decay=0.01,
        cowclip=CowClip(1.0, 1e-5),
    )
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(weight[untouched], before_w[untouched])
    assert not torch.equal(weight[rows], before_w[rows])
    for key in state:
        assert torch.equal(state[key][untouched], before_s[key][untouched])


@pytest.mark.parametrize(
    "mode", [pytest.param("1", marks=needs_compiler), "0"], ids=["compiled", "eager"]
)
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad"])
def test_row_step_with_count_lr_matches_the_functional_math(mode, optimizer):
    weight, state, rows, grad, counts, step, mask = _problem(optimizer)
    counts = counts * 3  # counts 3..9 against cap 4: both sides of the cap
    kw = dict(
        lr=0.05,
        betas=(0.8, 0.99),
        eps=1e-6,
        weight_decay=0.01,
        cowclip=CowClip(r=1.0, zeta=1e-5),
        clip_enabled=mask,
        count_lr=CountLR(power=1.0, cap=4.0),
    )
    want_w, want_s, want_clipped = _expected(
        optimizer, weight, state, rows, grad, counts, step, **kw
    )
    plain_w, _, _ = _expected(
        optimizer, weight, state, rows, grad, counts, step, **{**kw, "count_lr": None}
    )
    bias = adam_bias_corrections(step, 0.8, 0.99) if optimizer == "adam" else None
    clipped = row_step.row_step(compiled=mode == "1")(
        weight,
        state,
        rows,
        grad,
        counts,
        optimizer=optimizer,
        lr=kw["lr"],
        betas=kw["betas"],
        eps=kw["eps"],
        weight_decay=0.01,
        cowclip=kw["cowclip"],
        clip_enabled=mask,
        adam_bias=bias,
        count_lr=kw["count_lr"],
    )
    assert_close_to_reference(weight, want_w)
    for key in state:
        assert_close_to_reference(state[key], want_s[key])
    assert torch.equal(clipped, want_clipped)
    assert not torch.allclose(want_w, plain_w)  # the rule changed the step

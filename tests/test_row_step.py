"""The compiled row update (TorchInductor) against the eager one and the functional math,
and the choice between them (environment variable, fallback on a failed build)."""

import shutil

import pytest
import torch

from torchrec_cowclip.embedding import row_step
from torchrec_cowclip.embedding.row_step import (
    compiled_update_mode,
    gather_step_scatter_,
    row_step_,
    set_compiled_update,
    use_compiled_update,
)
from torchrec_cowclip.optim.functional import (
    CountLR,
    CowClip,
    RowSums,
    adam_bias_corrections,
    cowclip_row_update_,
    partial_row_sums,
)

HAVE_COMPILER = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for Inductor")


#: The row step's hyperparameters for a plain SGD step at lr 0.1.
SGD_0_1 = dict(optimizer="sgd", lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, cowclip=None)


@pytest.fixture(autouse=True)
def _reset_mode():
    yield
    set_compiled_update(None)


def _problem(optimizer, num_rows=50, dim=6, touched=17, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, dim, generator=gen) * 0.05
    # A few rows tiny, so that the clip binds on them and not on the others.
    weight[:5] *= 1e-4
    state = {}
    if optimizer == "adam":
        state = {"exp_avg": torch.randn(num_rows, dim, generator=gen) * 1e-2,
                 "exp_avg_sq": torch.rand(num_rows, dim, generator=gen) * 1e-3}
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
    """The functional math applied to the gathered rows, scattered by hand."""
    w = weight.clone()
    s = {k: v.clone() for k, v in state.items()}
    w_rows = w[rows].clone()
    s_rows = {k: v[rows].clone() for k, v in s.items()}
    clipped = cowclip_row_update_(optimizer, w_rows, grad, counts, s_rows, step, **kw)
    w[rows] = w_rows
    for k in s:
        s[k][rows] = s_rows[k]
    return w, s, clipped


CASES = [
    ("adam", CowClip(r=1.0, zeta=1e-5), 0.01, True),
    ("adam", None, 0.0, False),
    ("rowwise_adagrad", CowClip(r=1.0, zeta=1e-5), 0.01, True),
    ("sgd", CowClip(r=0.5, zeta=1e-4), 0.0, False),
]


@pytest.mark.parametrize("mode", [pytest.param("1", marks=needs_compiler), "0"],
                         ids=["compiled", "eager"])
@pytest.mark.parametrize("optimizer,cowclip,weight_decay,masked", CASES)
def test_row_step_matches_the_functional_math(mode, optimizer, cowclip, weight_decay, masked):
    set_compiled_update(mode)
    weight, state, rows, grad, counts, step, mask = _problem(optimizer)
    kw = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay,
              cowclip=cowclip, clip_enabled=mask if masked else None)
    want_w, want_s, want_clipped = _expected(optimizer, weight, state, rows, grad, counts,
                                             step, **kw)
    bias = adam_bias_corrections(step, 0.8, 0.99) if optimizer == "adam" else None
    # Two calls with different lr and row counts: one graph serves both (dynamic shapes,
    # lr not baked in), and both are right.
    for touched, lr in ((17, 0.05), (9, 0.02)):
        if touched != 17:
            weight, state, rows, grad, counts, step, mask = _problem(optimizer, touched=touched, seed=1)
            kw.update(lr=lr, clip_enabled=mask if masked else None)
            want_w, want_s, want_clipped = _expected(optimizer, weight, state, rows, grad,
                                                     counts, step, **kw)
            bias = adam_bias_corrections(step, 0.8, 0.99) if optimizer == "adam" else None
        clipped = row_step_(weight, state, rows, grad, counts, step=step, optimizer=optimizer,
                            lr=kw["lr"], betas=kw["betas"], eps=kw["eps"],
                            weight_decay=weight_decay, cowclip=cowclip,
                            clip_enabled=kw["clip_enabled"], adam_bias=bias)
        torch.testing.assert_close(weight, want_w, rtol=1e-5, atol=1e-7)
        for key in state:
            torch.testing.assert_close(state[key], want_s[key], rtol=1e-5, atol=1e-7)
        assert torch.equal(clipped, want_clipped)
    if cowclip is not None:
        assert bool(want_clipped.any()) and not bool(want_clipped.all())


@needs_compiler
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad"])
def test_compiled_column_shard_step_uses_whole_row_sums(optimizer):
    """With RowSums (a column shard), the compiled step equals the eager one."""
    weight, state, rows, grad, counts, step, _ = _problem(optimizer, dim=8)
    cols = slice(0, 3)
    shard_w = weight[:, cols].contiguous()
    shard_state = {k: (v[:, cols].contiguous() if v.dim() == 2 else v.clone()) for k, v in state.items()}
    sums = RowSums.from_sums(partial_row_sums(grad, weight[rows]), 8)
    results = []
    for mode in ("0", "1"):
        set_compiled_update(mode)
        w, s = shard_w.clone(), {k: v.clone() for k, v in shard_state.items()}
        clipped = row_step_(w, s, rows, grad[:, cols].contiguous(), counts, step=step,
                            optimizer=optimizer, lr=0.05, betas=(0.8, 0.99), eps=1e-6,
                            weight_decay=0.01, cowclip=CowClip(r=1.0, zeta=1e-5), row_sums=sums)
        results.append((w, s, clipped))
    (w0, s0, c0), (w1, s1, c1) = results
    torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-7)
    for key in s0:
        torch.testing.assert_close(s1[key], s0[key], rtol=1e-5, atol=1e-7)
    assert torch.equal(c0, c1) and bool(c0.any())


def test_mode_comes_from_the_environment_and_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "0")
    assert compiled_update_mode() == "0"
    assert not use_compiled_update(torch.device("cpu"))
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="TORCHREC_COWCLIP_COMPILE='sometimes'"):
        compiled_update_mode()
    with pytest.raises(ValueError, match="expected one of"):
        set_compiled_update("yes")


def test_a_failed_build_falls_back_to_eager_once_with_a_warning(monkeypatch):
    set_compiled_update("auto")
    monkeypatch.setattr(row_step, "_can_compile", lambda device: True)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(row_step, "_compiled_fn", lambda: broken)
    weight, state, rows, grad, counts, step, _ = _problem("sgd")
    want_w, _, _ = _expected("sgd", weight, state, rows, grad, counts, step, lr=0.1)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        row_step_(weight, {}, rows, grad, counts, step=step, **SGD_0_1)
    torch.testing.assert_close(weight, want_w)
    assert not use_compiled_update(torch.device("cpu"))
    row_step_(weight, {}, rows, grad, counts, step=step, **SGD_0_1)
    assert len(calls) == 1  # not retried

    # Forced compilation surfaces the error instead.
    set_compiled_update("1")
    with pytest.raises(RuntimeError, match="no compiler here"):
        row_step_(weight, {}, rows, grad, counts, step=step, **SGD_0_1)


def test_gather_step_scatter_touches_only_the_given_rows():
    weight, state, rows, grad, counts, step, _ = _problem("adam")
    before_w, before_s = weight.clone(), {k: v.clone() for k, v in state.items()}
    gather_step_scatter_(weight, state, rows, grad, counts, step=step, optimizer="adam", lr=0.05,
                         betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, cowclip=CowClip(1.0, 1e-5))
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(weight[untouched], before_w[untouched])
    assert not torch.equal(weight[rows], before_w[rows])
    for key in state:
        assert torch.equal(state[key][untouched], before_s[key][untouched])


@pytest.mark.parametrize("mode", [pytest.param("1", marks=needs_compiler), "0"],
                         ids=["compiled", "eager"])
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad"])
def test_row_step_with_count_lr_matches_the_functional_math(mode, optimizer):
    set_compiled_update(mode)
    weight, state, rows, grad, counts, step, mask = _problem(optimizer)
    counts = counts * 3  # counts 3..9 against cap 4: both sides of the cap
    kw = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01,
              cowclip=CowClip(r=1.0, zeta=1e-5), clip_enabled=mask,
              count_lr=CountLR(power=1.0, cap=4.0))
    want_w, want_s, want_clipped = _expected(optimizer, weight, state, rows, grad, counts, step, **kw)
    plain_w, _, _ = _expected(optimizer, weight, state, rows, grad, counts, step,
                              **{**kw, "count_lr": None})
    bias = adam_bias_corrections(step, 0.8, 0.99) if optimizer == "adam" else None
    clipped = row_step_(weight, state, rows, grad, counts, step=step, optimizer=optimizer,
                        lr=kw["lr"], betas=kw["betas"], eps=kw["eps"], weight_decay=0.01,
                        cowclip=kw["cowclip"], clip_enabled=mask, adam_bias=bias,
                        count_lr=kw["count_lr"])
    torch.testing.assert_close(weight, want_w, rtol=1e-5, atol=1e-7)
    for key in state:
        torch.testing.assert_close(state[key], want_s[key], rtol=1e-5, atol=1e-7)
    assert torch.equal(clipped, want_clipped)
    assert not torch.allclose(want_w, plain_w)  # the rule changed the step

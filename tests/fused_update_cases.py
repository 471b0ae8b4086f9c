"""The fused update's parity suite, for every library of the op (torch only).

The native CPU kernels (``embedding.native``, tests/test_native.py) and the Triton kernels
(``embedding.triton_ops``, tests/test_triton_kernels.py) take the same arguments
(:func:`~torchrec_cowclip.embedding.native.update_arguments`) and must give the functional
core's update; these checks are written once and run on both.
"""

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from torchrec_cowclip.embedding import native
from torchrec_cowclip.embedding.row_gradients import group_rows
from torchrec_cowclip.optim.functional import (
    RowSums,
    adam_bias_corrections,
    cowclip_row_update_,
    partial_row_sums,
    rounding_row_keys,
    stochastic_round,
)
from torchrec_cowclip.optim.options import CountLR, CowClip
from torchrec_cowclip.optim.rules import update_rule

#: The update's keywords for a plain call; tests override what they exercise.
PLAIN = dict(
    grad=None,
    bag_gradients=None,
    segment_offsets=None,
    sorted_bags=None,
    sorted_weights=None,
    clip_enabled=None,
    adam_bias=None,
    row_sums=None,
    rounding=None,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    clip=None,
    count_lr=None,
)

STATE_NAMES = {
    "adam": ["exp_avg", "exp_avg_sq"],
    "rowwise_adagrad": ["sum"],
    "sgd": [],
    "adagrad": ["sum"],
    "adamw": ["exp_avg", "exp_avg_sq"],
}


def adam_bias_of(optimizer: str, bias):
    """Adam's bias corrections for the rules that take them (Adam, AdamW), else None."""
    return bias if update_rule(optimizer).adam_bias_corrections else None


#: Bad index inputs of a 2-row SGD update from 3 bag gradients (:func:`segment_call`), and
#: the one-line error each must raise before any change.
BAD_UPDATE_INDICES = [
    (dict(row_offsets=torch.tensor([1, 4, 10])), "row_offsets must start at 0, ascend"),
    (dict(row_offsets=torch.tensor([0, 7, 5, 10])), "row_offsets must start at 0, ascend"),
    (dict(row_offsets=torch.tensor([0, 4, 9])), "end at the weight's 10 rows"),
    (dict(segment_offsets=torch.tensor([1, 2, 3])), "segment_offsets must start at 0"),
    (dict(segment_offsets=torch.tensor([0, 2, 1])), "segment_offsets must start at 0"),
    (dict(segment_offsets=torch.tensor([0, 1, 2])), "end at the 3 positions"),
    (dict(sorted_bags=torch.tensor([0, 3, 2])), "sorted_bags must index the 3 rows"),
    (dict(sorted_bags=torch.tensor([0, -1, 2])), "sorted_bags must index the 3 rows"),
]


def fused(library, weight, state, rows, counts, **overrides):
    """One call of ``library``'s fused update (``native`` or ``triton_ops``)."""
    return library.fused_update_(
        *native.update_arguments(weight, state, rows, counts, **{**PLAIN, **overrides})
    )


def segment_call(library, weight, **overrides):
    """A 2-row SGD update of a ``[10, 4]`` weight from 3 bag gradients, with ``overrides``
    for its index inputs."""
    device = weight.device
    given = dict(
        bag_gradients=torch.ones(3, 4, device=device),
        segment_offsets=torch.tensor([0, 1, 3]),
        sorted_bags=torch.tensor([0, 1, 2]),
        row_offsets=torch.tensor([0, 4, 10]),
    )
    given.update(overrides)
    given = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in given.items()}
    return fused(
        library,
        weight,
        [],
        torch.tensor([1, 6], device=device),
        torch.tensor([1, 2], device=device),
        optimizer="sgd",
        lr=1.0,
        **given,
    )


def check_bad_indices_refused(library, overrides, message, device=None):
    """The :func:`segment_call` with ``overrides`` (one of :data:`BAD_UPDATE_INDICES`)
    raises ``message`` in one line and changes nothing; the unchanged call is fine."""
    w = torch.zeros(10, 4, device=device)
    segment_call(library, w.clone())
    with pytest.raises(RuntimeError, match=message) as raised:
        segment_call(library, w, **overrides)
    assert "\n" not in str(raised.value).strip()
    assert not w.any()


def check_rounding_matches_functional(library, dtype, device=None):
    """``library``'s stochastic rounding and row keys equal the functional core's bit for
    bit (NaN, infinities, beyond the largest float16, -0.0, tiny values included)."""
    device = device or torch.device("cpu")
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(300, 16, generator=gen) * 10.0 ** torch.randint(
        -9, 5, (300, 1), generator=gen
    )
    values[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 7e4, -0.0, 1e-8])
    keys = torch.randint(0, 2**32, (300,), generator=gen)
    columns = torch.randint(0, 1000, (300,), generator=gen)
    expected = stochastic_round(values, dtype, keys, columns)
    got = library.stochastic_round(values.to(device), dtype, keys.to(device), columns.to(device))
    assert torch.equal(got.cpu().view(torch.int16), expected.view(torch.int16))
    seeds, steps = torch.randint(0, 2**32, (50,), generator=gen), torch.randint(0, 10**7, (50,))
    rows = torch.randint(0, 2**40, (50,), generator=gen)
    assert torch.equal(
        library.rounding_row_keys(seeds.to(device), steps.to(device), rows.to(device)).cpu(),
        rounding_row_keys(seeds, steps, rows),
    )


def problem(optimizer, dim=6, num_rows=60, num_positions=90, seed=0):
    """Three tables of ``num_rows`` rows in all (a few tiny rows the clip binds on),
    ``num_positions`` positions with duplicates over them, and their optimizer state."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, dim, generator=gen) * 0.05
    weight[:6] *= 1e-4  # tiny rows: the clip binds on them
    state = []
    if optimizer in ("adam", "adamw"):
        state = [
            torch.randn(num_rows, dim, generator=gen) * 1e-2,
            torch.rand(num_rows, dim, generator=gen) * 1e-3,
        ]
    elif optimizer == "rowwise_adagrad":
        state = [torch.rand(num_rows, generator=gen)]
    elif optimizer == "adagrad":
        state = [torch.rand(num_rows, dim, generator=gen) * 1e-3]
    row_offsets = torch.tensor([0, num_rows // 3, (3 * num_rows) // 4, num_rows])
    # Positions (with duplicates) over rows of every table.
    positions = torch.randint(0, num_rows, (num_positions,), generator=gen)
    positions[:8] = torch.arange(8)  # the tiny rows are touched
    bags = max(num_positions * 4 // 9, 2)
    bag_grads = torch.randn(bags, dim, generator=gen) * 0.01
    bag_of_position = torch.randint(0, bags, (num_positions,), generator=gen)
    return weight, state, row_offsets, positions, bag_of_position, bag_grads, gen


def segment_sums(grouping, bag_grads, sorted_weights=None):
    """ATen's segment sums of each row's bag gradients (the reference's ``g_j``)."""
    return F.embedding_bag(
        grouping.sorted_bags,
        bag_grads,
        grouping.segment_offsets,
        mode="sum",
        per_sample_weights=sorted_weights,
        include_last_offset=True,
    )


def reference(optimizer, weight, state, rows, grad, counts, step, **kw):
    """The functional core on the gathered rows (``dtype`` of the inputs), scattered back."""
    w = weight.clone()
    st = [s.clone() for s in state]
    w_rows = w[rows].clone()
    s_rows = {name: s[rows].clone() for name, s in zip(STATE_NAMES[optimizer], st)}
    rule = update_rule(optimizer)
    clipped = cowclip_row_update_(
        rule.step,
        w_rows,
        grad,
        counts,
        s_rows,
        step,
        decoupled_weight_decay=rule.decoupled_weight_decay,
        **kw,
    )
    w[rows] = w_rows
    for name, s in zip(STATE_NAMES[optimizer], st):
        s[rows] = s_rows[name]
    return w, st, clipped


def ulp(dtype: torch.dtype) -> float:
    """The relative spacing of ``dtype`` near 1 (0 for float32: compared by tolerance)."""
    return {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}.get(dtype, 0.0)


def check_update_matches_functional(
    library,
    optimizer: str,
    clip: bool,
    weighted: bool,
    dim: int,
    dtype: torch.dtype = torch.float32,
    num_rows: int = 60,
    num_positions: int = 90,
    device: Optional[torch.device] = None,
    rtol: float = 1e-6,
    stochastic: bool = True,
) -> None:
    """``library``'s update against the functional core, fed the rows' gradients whole
    and as segments of bag gradients: the weights and state (to ``rtol``; half tables
    within one unit in the last place of their type, rounded with the same keys), each
    row's status, a non-finite row skipped and counted, the per-table counts, and - with
    ``clip`` - rows on both sides of the clip's threshold. ``stochastic=False``: half
    tables without rounding keys, rounded to nearest."""
    device = device or torch.device("cpu")
    weight, state, row_offsets, positions, bags, bag_grads, gen = problem(
        optimizer, dim, num_rows, num_positions
    )
    position_weights = torch.rand(num_positions, generator=gen) + 0.5 if weighted else None
    grouping = group_rows(positions, bags, weight.shape[0])
    sorted_weights = position_weights[grouping.order] if weighted else None
    rows, counts = grouping.rows, grouping.counts
    # One non-finite row: skipped, its weight and state unchanged, counted.
    bad = int(rows.numel() // 2)
    bag_grads = bag_grads.clone()
    bag_grads[grouping.sorted_bags[grouping.segment_offsets[bad]]] = float("nan")
    finite_grad = segment_sums(grouping, bag_grads, sorted_weights)
    finite = torch.isfinite(finite_grad.sum(1))
    assert not bool(finite.all())
    table_of_row = torch.bucketize(rows, row_offsets[1:], right=True)
    step = torch.tensor([3, 5, 7])
    clip_enabled = torch.tensor([True, False, True])
    betas, lr, eps, wd = (0.8, 0.99), 0.05, 1e-6, 0.01
    count_lr = CountLR(power=0.5, cap=2.0)
    bias = adam_bias_corrections(step, *betas)
    cowclip = CowClip(r=1.0, zeta=1e-3) if clip else None
    # Per table: rounding seed, step, global row and column of its first element.
    rounding = torch.tensor([[11, 3, 0, 0], [12, 5, 7, 0], [13, 7, 100, 4]])
    weight = weight.to(dtype)

    keep = finite
    ref_w, ref_s, ref_clipped = reference(
        optimizer,
        weight.float(),
        state,
        rows[keep],
        finite_grad[keep],
        counts[keep],
        None,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=wd,
        cowclip=cowclip,
        clip_enabled=clip_enabled[table_of_row[keep]],
        adam_bias=(bias[0][table_of_row[keep]], bias[1][table_of_row[keep]]),
        count_lr=count_lr,
    )
    if dtype != torch.float32 and not stochastic:
        rounded = weight.clone()
        rounded[rows[keep]] = ref_w[rows[keep]].to(dtype)
        ref_w = rounded
    elif dtype != torch.float32:
        t = table_of_row[keep]
        keys = rounding_row_keys(
            rounding[t, 0], rounding[t, 1], rows[keep] - row_offsets[t] + rounding[t, 2]
        )
        rounded = weight.clone()
        rounded[rows[keep]] = stochastic_round(ref_w[rows[keep]], dtype, keys, rounding[t, 3])
        ref_w = rounded

    def on(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    for source in ("segments", "grad"):
        w, st = on(weight.clone()), [on(s.clone()) for s in state]
        if source == "grad":
            given = dict(grad=on(finite_grad))
        else:
            given = dict(
                bag_gradients=on(bag_grads),
                segment_offsets=on(grouping.segment_offsets),
                sorted_bags=on(grouping.sorted_bags),
                sorted_weights=on(sorted_weights),
            )
        status, per_table = fused(
            library,
            w,
            st,
            on(rows),
            on(counts),
            **given,
            row_offsets=on(row_offsets),
            clip_enabled=on(clip_enabled),
            adam_bias=adam_bias_of(optimizer, tuple(on(b) for b in bias)),
            rounding=None if dtype == torch.float32 or not stochastic else on(rounding),
            optimizer=optimizer,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=wd,
            clip=None if cowclip is None else (cowclip.r, cowclip.zeta),
            count_lr=(count_lr.power, count_lr.cap),
        )
        w, st, status, per_table = w.cpu(), [s.cpu() for s in st], status.cpu(), per_table.cpu()
        if dtype == torch.float32:
            torch.testing.assert_close(w, ref_w, rtol=rtol, atol=rtol / 10)
        else:
            torch.testing.assert_close(
                w.float(), ref_w.float(), rtol=ulp(dtype), atol=ulp(dtype) * 1e-3
            )
        for a, b in zip(st, ref_s):
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * 1e-3)
        assert torch.equal(status == native.SKIPPED, ~finite)
        assert torch.equal(status[keep] == native.CLIPPED, ref_clipped)
        expected_counts = torch.stack(
            [
                torch.bincount(table_of_row[keep], minlength=3),
                torch.bincount(table_of_row[keep][ref_clipped], minlength=3),
                torch.bincount(table_of_row[~keep], minlength=3),
            ]
        )
        assert torch.equal(per_table, expected_counts)
        assert torch.equal(w[rows[bad]], weight[rows[bad]])  # the skipped row
    if clip:
        assert 0 < int(ref_clipped.sum()) < int(keep.sum())


def check_column_shard_row_sums(library, optimizer: str, device=None, rtol: float = 1e-6) -> None:
    """A column shard's update with the whole rows' sums (column-wise sharding) against
    the functional core."""
    device = device or torch.device("cpu")
    weight, state, row_offsets, positions, bags, bag_grads, gen = problem(optimizer, dim=4)
    g = group_rows(positions, bags, weight.shape[0])
    grad = segment_sums(g, bag_grads)
    rows, counts = g.rows, g.counts
    other = torch.randn(rows.numel(), 4, generator=gen) * 0.01  # the other shard's half
    other_w = torch.randn(rows.numel(), 4, generator=gen) * 0.05
    sums = RowSums.from_sums(
        partial_row_sums(grad, weight[rows]) + partial_row_sums(other, other_w), dim=8
    )
    table_of_row = torch.bucketize(rows, row_offsets[1:], right=True)
    step = torch.tensor([2, 2, 2])
    kw = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
    bias = adam_bias_corrections(step, *kw["betas"])
    ref_w, ref_s, ref_clipped = reference(
        optimizer,
        weight,
        state,
        rows,
        grad,
        counts,
        None,
        cowclip=CowClip(1.0, 1e-3),
        row_sums=sums,
        adam_bias=(bias[0][table_of_row], bias[1][table_of_row]),
        **kw,
    )
    packed = torch.stack(
        [
            sums.nonfinite,
            sums.grad_sq,
            sums.weight_sq,
            sums.grad_dot_weight,
            sums.dim.expand(rows.numel()),
        ],
        1,
    )
    w, st = weight.clone().to(device), [s.clone().to(device) for s in state]
    status, _ = fused(
        library,
        w,
        st,
        rows.to(device),
        counts.to(device),
        grad=grad.to(device),
        row_offsets=row_offsets.to(device),
        adam_bias=adam_bias_of(optimizer, tuple(b.to(device) for b in bias)),
        row_sums=packed.to(device),
        optimizer=optimizer,
        clip=(1.0, 1e-3),
        **kw,
    )
    torch.testing.assert_close(w.cpu(), ref_w, rtol=rtol, atol=rtol / 10)
    for a, b in zip(st, ref_s):
        torch.testing.assert_close(a.cpu(), b, rtol=rtol, atol=rtol * 1e-3)
    assert torch.equal(status.cpu() == native.CLIPPED, ref_clipped)

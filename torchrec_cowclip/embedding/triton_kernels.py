"""The ``@triton.jit`` kernels of :mod:`.triton_ops` (which documents them and launches
them). Imported on first use, not with the package: Triton reads ``TRITON_INTERPRET`` when
a kernel is defined, and a CPU machine without Triton imports the package all the same.

Names follow the native kernels (``torchrec_cowclip/csrc/cowclip_cpu.cpp``) and the
functional core (``optim/functional.py``) whose math they restate.
"""

import triton
import triton.language as tl


@triton.jit
def mix32(x):
    # optim/functional.py's mix32, in uint32 arithmetic.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    return x ^ (x >> 16)


@triton.jit
def row_key(seed, step, global_row):
    # optim/functional.py's rounding_row_keys: int64 inputs, uint32 key.
    h = mix32((global_row >> 32).to(tl.uint32) + 0x9E3779B9)
    h = mix32(global_row.to(tl.uint32) ^ h)
    h = mix32(step.to(tl.uint32) ^ h)
    return mix32(seed.to(tl.uint32) ^ h)


@triton.jit
def round_to(x, key, columns, IS_BF16: tl.constexpr):
    # optim/functional.py's stochastic_round of float32 x ([U, D]) with row keys
    # key ([U, 1] uint32) at global columns ([U, D] int64).
    bits = mix32(key ^ mix32(columns.to(tl.uint32) + 0x85EBCA6B))
    xb = x.to(tl.uint32, bitcast=True)
    if IS_BF16:
        raised = (xb + (bits >> 16)) & 0xFFFF0000
        rounded = (raised >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        quiet = ((xb >> 16) | 0x40).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        result = tl.where(x != x, quiet, rounded)
    else:
        ax = tl.abs(x)
        nearest = ax.to(tl.float16)
        h = nearest.to(tl.uint16, bitcast=True).to(tl.int32)
        h = h - (nearest.to(tl.float32) > ax).to(tl.int32)
        lo = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (h + 1).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        p = (ax - lo) / (hi - lo)
        uniform = (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)
        h = h + (uniform < p).to(tl.int32)
        signed = h | ((xb >> 31) << 15).to(tl.int32)
        magnitude = signed.to(tl.uint16).to(tl.float16, bitcast=True)
        finite = (ax == ax) & (ax < float("inf"))
        result = tl.where(finite, magnitude, x.to(tl.float16))
    return result


@triton.jit
def bag_bounds(offsets_ptr, bags, in_range, num_bags, num_ids, flags_ptr, WHOLE: tl.constexpr):
    # Each bag's [start, end) of the ids, checked: a bag whose offsets do not ascend inside
    # the ids (WHOLE: or do not start at 0 and end at the last id) sets flag 0 and is read
    # as empty.
    start = tl.load(offsets_ptr + bags, mask=in_range, other=0)
    end = tl.load(offsets_ptr + bags + 1, mask=in_range, other=0)
    bad_bag = in_range & ((start < 0) | (end < start) | (end > num_ids))
    if WHOLE:
        bad_bag = bad_bag | ((bags == 0) & (start != 0))
        bad_bag = bad_bag | ((bags == num_bags - 1) & (end != num_ids))
    tl.atomic_max(flags_ptr, tl.max(bad_bag.to(tl.int64)))
    return start, tl.where(bad_bag, start, end)


@triton.jit
def checked_ids(ids_ptr, positions, end, num_rows, num_ids, flags_ptr):
    # The ids at ``positions`` before ``end`` (``at``) as int64, and which lie outside
    # [0, num_rows); the first such position goes to flag 1 (num_ids: none).
    at = positions < end
    ids = tl.load(ids_ptr + positions, mask=at, other=0).to(tl.int64)
    outside = at & ((ids < 0) | (ids >= num_rows))
    tl.atomic_min(flags_ptr + 1, tl.min(tl.where(outside, positions, num_ids)).to(tl.int64))
    return at, ids, outside


@triton.jit
def prepare(
    values_ptr,
    offsets_ptr,
    feature_rows_ptr,
    row_ids_ptr,
    flags_ptr,
    num_bags,
    num_ids,
    batch_size,
    BLOCK_B: tl.constexpr,
):
    # BLOCK_B bags of a KJT (feature-major) per program, their positions walked together:
    # each id checked against its feature's rows and written as a row of the feature's
    # table batch. Flags: 0 a bag whose offsets do not ascend or span the ids; 1 the first
    # position whose id is outside its feature (num_ids: none).
    bags = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    in_range = bags < num_bags
    start, end = bag_bounds(offsets_ptr, bags, in_range, num_bags, num_ids, flags_ptr, True)
    feature = bags // batch_size
    first_row = tl.load(feature_rows_ptr + 2 * feature, mask=in_range, other=0)
    num_rows = tl.load(feature_rows_ptr + 2 * feature + 1, mask=in_range, other=0)
    longest = tl.max(end - start)
    j = 0
    while j < longest:
        positions = start + j
        at, ids, outside = checked_ids(values_ptr, positions, end, num_rows, num_ids, flags_ptr)
        tl.store(row_ids_ptr + positions, ids + first_row, mask=at)
        j += 1


@triton.jit
def pool(
    weight_ptr,
    ids_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    flags_ptr,
    num_bags,
    num_ids,
    num_rows,
    dim,
    batch_size,
    HAS_PSW: tl.constexpr,
    MEAN: tl.constexpr,
    WHOLE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # BLOCK_B bags x BLOCK_D columns per program, each bag's positions summed in order (a
    # single-hot lookup is one step). WHOLE: the offsets span all the ids (checked); else
    # they are a slice of a KJT's (absolute positions). batch_size > 0: the output is
    # batch-major, bag f * B + b at row b * F + f.
    bags = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    in_range = bags < num_bags
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    start, end = bag_bounds(offsets_ptr, bags, in_range, num_bags, num_ids, flags_ptr, WHOLE)
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    longest = tl.max(end - start)
    j = 0
    while j < longest:
        positions = start + j
        at, ids, outside = checked_ids(ids_ptr, positions, end, num_rows, num_ids, flags_ptr)
        ok = at & ~outside
        rows = tl.load(
            weight_ptr + ids[:, None] * dim + cols[None, :],
            mask=ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_PSW:
            w = tl.load(psw_ptr + positions, mask=ok, other=0.0).to(tl.float32)
            rows = w[:, None] * rows
        acc += rows
        j += 1
    if MEAN:
        n = (end - start).to(tl.float32)
        acc = tl.where(n[:, None] > 0, acc * (1.0 / tl.maximum(n, 1.0))[:, None], acc)
    out_row = bags.to(tl.int64)
    if batch_size > 0:
        out_row = (bags % batch_size) * (num_bags // batch_size) + bags // batch_size
    tl.store(
        out_ptr + out_row[:, None] * dim + cols[None, :],
        acc,
        mask=in_range[:, None] & col_ok[None, :],
    )


@triton.jit
def check_update(
    rows_ptr,
    seg_ptr,
    bags_ptr,
    row_offsets_ptr,
    flags_ptr,
    num_valid_ptr,
    gate_ptr,
    num_touched,
    num_positions,
    num_bag_rows,
    num_weight_rows,
    num_tables,
    HAS_SEGMENTS: tl.constexpr,
    PADDED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Flags: 0 row_offsets, 1 rows, 2 segment offsets, 3 bags, 4 the gate (set: refuse).
    # PADDED: the rows past *num_valid_ptr are padding (a grouping of fixed size).
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    limit = num_touched
    if PADDED:
        limit = tl.load(num_valid_ptr).to(tl.int32)
    in_rows = idx < limit
    rows = tl.load(rows_ptr + idx, mask=in_rows, other=0)
    prev = tl.load(rows_ptr + idx - 1, mask=in_rows & (idx > 0), other=-1)
    bad_rows = in_rows & ((rows < 0) | (rows >= num_weight_rows) | (rows <= prev))
    tl.atomic_max(flags_ptr + 1, tl.max(bad_rows.to(tl.int32)))
    in_rows = idx < num_touched
    if HAS_SEGMENTS:
        seg = tl.load(seg_ptr + idx, mask=in_rows, other=0)
        seg_next = tl.load(seg_ptr + idx + 1, mask=in_rows, other=0)
        bad_seg = in_rows & (seg_next < seg)
        tl.atomic_max(flags_ptr + 2, tl.max(bad_seg.to(tl.int32)))
        in_positions = idx < num_positions
        bags = tl.load(bags_ptr + idx, mask=in_positions, other=0)
        bad_bags = in_positions & ((bags < 0) | (bags >= num_bag_rows))
        tl.atomic_max(flags_ptr + 3, tl.max(bad_bags.to(tl.int32)))
    if pid == 0:
        if PADDED:
            tl.atomic_max(flags_ptr + 4, tl.load(gate_ptr))
        t = 0
        bad_offsets = tl.load(row_offsets_ptr) != 0
        while t < num_tables:
            lo = tl.load(row_offsets_ptr + t)
            hi = tl.load(row_offsets_ptr + t + 1)
            bad_offsets = bad_offsets | (hi < lo)
            t += 1
        bad_offsets = bad_offsets | (tl.load(row_offsets_ptr + num_tables) != num_weight_rows)
        tl.atomic_max(flags_ptr, bad_offsets.to(tl.int32))
        if HAS_SEGMENTS:
            first = tl.load(seg_ptr)
            last = tl.load(seg_ptr + num_touched)
            bad_ends = (first != 0) | (last != num_positions)
            tl.atomic_max(flags_ptr + 2, bad_ends.to(tl.int32))


@triton.jit
def update(
    weight_ptr,
    state0_ptr,
    state1_ptr,
    rows_ptr,
    counts_ptr,
    grad_ptr,
    seg_ptr,
    bags_ptr,
    sorted_w_ptr,
    row_offsets_ptr,
    clip_enabled_ptr,
    bias1_ptr,
    bias2_ptr,
    row_sums_ptr,
    rounding_ptr,
    flags_ptr,
    num_valid_ptr,
    status_ptr,
    per_table_ptr,
    num_touched,
    num_tables,
    dim,
    lr,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    r,
    zeta,
    count_lr_power,
    count_lr_cap,
    OPTIMIZER: tl.constexpr,
    SEGMENTS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    CLIP: tl.constexpr,
    CLIP_MASK: tl.constexpr,
    ROW_SUMS: tl.constexpr,
    COUNT_LR: tl.constexpr,
    PADDED: tl.constexpr,
    STORE: tl.constexpr,
    LOG_TABLES: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # BLOCK_U distinct rows per program, each whole (BLOCK_D >= dim). STORE: 0 float32,
    # 1 float16, 2 bfloat16. OPTIMIZER: native.OPTIMIZER_CODES. PADDED: the rows past
    # *num_valid_ptr are padding (status 3, nothing else written).
    us = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    checks_failed = (
        tl.load(flags_ptr)
        + tl.load(flags_ptr + 1)
        + tl.load(flags_ptr + 2)
        + tl.load(flags_ptr + 3)
        + tl.load(flags_ptr + 4)
    )
    limit = num_touched
    if PADDED:
        limit = tl.load(num_valid_ptr).to(tl.int32)
    live = (us < limit) & (checks_failed == 0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    mask = live[:, None] & col_ok[None, :]
    rows = tl.load(rows_ptr + us, mask=live, other=0)
    count = tl.load(counts_ptr + us, mask=live, other=1).to(tl.float32)
    # Each row's table: the last table whose first row is at or below it (a binary
    # search of the ascending row offsets; tables may be empty).
    lo = tl.zeros([BLOCK_U], dtype=tl.int32)
    hi = tl.zeros([BLOCK_U], dtype=tl.int32) + (num_tables - 1)
    for _ in tl.static_range(LOG_TABLES):
        mid = (lo + hi + 1) // 2
        up = tl.load(row_offsets_ptr + mid, mask=live, other=0) <= rows
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    table = lo

    # Step 2: the row's gradient, its positions summed in input order.
    if SEGMENTS:
        first = tl.load(seg_ptr + us, mask=live, other=0)
        n = tl.load(seg_ptr + us + 1, mask=live, other=0) - first
        g = tl.zeros([BLOCK_U, BLOCK_D], dtype=tl.float32)
        longest = tl.max(n)
        j = 0
        while j < longest:
            at = live & (j < n)
            bag = tl.load(bags_ptr + first + j, mask=at, other=0)
            term = tl.load(
                grad_ptr + bag[:, None] * dim + cols[None, :],
                mask=at[:, None] & col_ok[None, :],
                other=0.0,
            )
            if WEIGHTED:
                pw = tl.load(sorted_w_ptr + first + j, mask=at, other=0.0)
                term = pw[:, None] * term
            g += term
            j += 1
    else:
        g = tl.load(grad_ptr + us[:, None].to(tl.int64) * dim + cols[None, :], mask=mask, other=0.0)
    if ROW_SUMS:
        sums = row_sums_ptr + us * 5
        finite = tl.load(sums, mask=live, other=0.0) == 0.0
        grad_sq = tl.load(sums + 1, mask=live, other=0.0)
        weight_sq = tl.load(sums + 2, mask=live, other=0.0)
        grad_dot_weight = tl.load(sums + 3, mask=live, other=0.0)
        whole_dim = tl.load(sums + 4, mask=live, other=1.0)
    else:
        total = tl.sum(g, axis=1)
        finite = (total == total) & (tl.abs(total) < float("inf"))
    step_rows = live & finite
    step_mask = step_rows[:, None] & col_ok[None, :]
    w_ptrs = weight_ptr + rows[:, None] * dim + cols[None, :]
    w = tl.load(w_ptrs, mask=step_mask, other=0.0).to(tl.float32)

    # Step 3: the CowClip clip.
    scale = tl.full([BLOCK_U], 1.0, dtype=tl.float32)
    clipped = tl.zeros([BLOCK_U], dtype=tl.int1)
    if CLIP:
        if ROW_SUMS:
            grad_norm = tl.sqrt(grad_sq)
            weight_norm = tl.sqrt(weight_sq)
        else:
            grad_norm = tl.sqrt(tl.sum(g * g, axis=1))
            weight_norm = tl.sqrt(tl.sum(w * w, axis=1))
        threshold = count * tl.maximum(r * weight_norm, zeta)
        clipped = step_rows & (grad_norm > threshold)
        if CLIP_MASK:
            enabled = tl.load(clip_enabled_ptr + table, mask=live, other=0).to(tl.int1)
            clipped = clipped & enabled
        scale = tl.where(clipped, threshold / tl.maximum(grad_norm, 1.1754943508222875e-38), 1.0)
        g = tl.where(clipped[:, None], g * scale[:, None], g)
    # Step 4: coupled L2.
    g = g + weight_decay * w
    row_lr = tl.zeros([BLOCK_U], dtype=tl.float32) + lr
    if COUNT_LR:
        capped = tl.minimum(count, count_lr_cap)
        # ATen's pow special-cases these exponents; exp2(p * log2(c)) otherwise (c >= 1).
        factor = tl.exp2(count_lr_power * tl.log2(capped))
        factor = tl.where(count_lr_power == 0.5, tl.sqrt(capped), factor)
        factor = tl.where(count_lr_power == 1.0, capped, factor)
        factor = tl.where(count_lr_power == 2.0, capped * capped, factor)
        row_lr = lr * factor

    # Step 5: the optimizer.
    if OPTIMIZER == 0:
        s_ptrs = rows[:, None] * dim + cols[None, :]
        m = tl.load(state0_ptr + s_ptrs, mask=step_mask, other=0.0)
        v = tl.load(state1_ptr + s_ptrs, mask=step_mask, other=0.0)
        b1 = tl.load(bias1_ptr + table, mask=step_rows, other=1.0)
        b2 = tl.load(bias2_ptr + table, mask=step_rows, other=1.0)
        m = m * beta1 + one_minus_beta1 * g
        v = v * beta2 + one_minus_beta2 * g * g
        tl.store(state0_ptr + s_ptrs, m, mask=step_mask)
        tl.store(state1_ptr + s_ptrs, v, mask=step_mask)
        denom = tl.sqrt(v / b2[:, None]) + eps
        w = w - row_lr[:, None] * (m / b1[:, None]) / denom
    elif OPTIMIZER == 1:
        if ROW_SUMS:
            total_sq = (
                scale * scale * grad_sq
                + (2.0 * weight_decay) * scale * grad_dot_weight
                + (weight_decay * weight_decay) * weight_sq
            )
            mean_square = tl.maximum(total_sq, 0.0) / whole_dim
        else:
            mean_square = tl.sum(g * g, axis=1) / dim
        s = tl.load(state0_ptr + rows, mask=step_rows, other=0.0) + mean_square
        tl.store(state0_ptr + rows, s, mask=step_rows)
        w = w - row_lr[:, None] * g / (tl.sqrt(s) + eps)[:, None]
    else:
        w = w - row_lr[:, None] * g

    if STORE == 0:
        tl.store(w_ptrs, w, mask=step_mask)
    else:
        keys = rounding_ptr + table * 4
        seed = tl.load(keys, mask=step_rows, other=0)
        step = tl.load(keys + 1, mask=step_rows, other=0)
        first_row = tl.load(keys + 2, mask=step_rows, other=0)
        first_column = tl.load(keys + 3, mask=step_rows, other=0)
        table_start = tl.load(row_offsets_ptr + table, mask=step_rows, other=0)
        key = row_key(seed, step, rows - table_start + first_row)
        columns = first_column[:, None] + cols[None, :]
        tl.store(w_ptrs, round_to(w, key[:, None], columns, STORE == 2), mask=step_mask)

    # Status 0 updated, 1 clipped, 2 skipped (non-finite); per table, counted.
    status = tl.where(finite, clipped.to(tl.int32), 2)
    status = tl.where(us < limit, status, 3)
    tl.store(status_ptr + us, status.to(tl.int8), mask=(us < num_touched) & (checks_failed == 0))
    tl.atomic_add(per_table_ptr + table, 1, mask=step_rows)
    tl.atomic_add(per_table_ptr + num_tables + table, 1, mask=clipped)
    tl.atomic_add(per_table_ptr + 2 * num_tables + table, 1, mask=live & ~finite)


@triton.jit
def round_rows(
    values_ptr,
    keys_ptr,
    column_base_ptr,
    out_ptr,
    dim,
    IS_BF16: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    u = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < dim
    x = tl.load(values_ptr + u * dim + cols, mask=ok, other=0.0)
    key = tl.load(keys_ptr + u).to(tl.uint32)
    columns = tl.load(column_base_ptr + u) + cols
    tl.store(out_ptr + u * dim + cols, round_to(x, key, columns, IS_BF16), mask=ok)


@triton.jit
def row_keys(seed_ptr, step_ptr, row_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    key = row_key(
        tl.load(seed_ptr + i, mask=ok, other=0),
        tl.load(step_ptr + i, mask=ok, other=0),
        tl.load(row_ptr + i, mask=ok, other=0),
    )
    tl.store(out_ptr + i, key.to(tl.int64), mask=ok)

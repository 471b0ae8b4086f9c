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
def raise_flag(flags_ptr, bad, value):
    # Writes the flag only where something is wrong (``bad``, a scalar): a program with
    # nothing to report issues no atomic. ``value``: the flag's new bound.
    if bad:
        tl.atomic_max(flags_ptr, value, sem="relaxed")


@triton.jit
def any_of(bad):
    return tl.max(bad.to(tl.int32)) != 0


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
    raise_flag(flags_ptr, any_of(bad_bag), tl.full([], 1, tl.int64))
    return start, tl.where(bad_bag, start, end)


@triton.jit
def checked_ids(ids_ptr, positions, end, num_rows, num_ids, flags_ptr):
    # The ids at ``positions`` before ``end`` (``at``) as int64, and which lie outside
    # [0, num_rows); the first such position goes to flag 1 (num_ids: none).
    at = positions < end
    ids = tl.load(ids_ptr + positions, mask=at, other=0).to(tl.int64)
    outside = at & ((ids < 0) | (ids >= num_rows))
    if any_of(outside):
        first = tl.min(tl.where(outside, positions, num_ids)).to(tl.int64)
        tl.atomic_min(flags_ptr + 1, first, sem="relaxed")
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
    batch_size,
    DIM: tl.constexpr,
    HAS_PSW: tl.constexpr,
    MEAN: tl.constexpr,
    WHOLE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # BLOCK_B bags x BLOCK_D columns per program, each bag's positions summed in order (a
    # single-hot lookup is one step). WHOLE: the offsets span all the ids (checked); else
    # they are a slice of a KJT's (absolute positions). batch_size > 0: the output is
    # batch-major, bag f * B + b at row b * F + f. DIM is a constant so that the compiler
    # knows each row's alignment (vector loads where DIM allows them).
    bags = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    in_range = bags < num_bags
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < DIM
    start, end = bag_bounds(offsets_ptr, bags, in_range, num_bags, num_ids, flags_ptr, WHOLE)
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    longest = tl.max(end - start)
    j = 0
    while j < longest:
        positions = start + j
        at, ids, outside = checked_ids(ids_ptr, positions, end, num_rows, num_ids, flags_ptr)
        ok = at & ~outside
        rows = tl.load(
            weight_ptr + ids[:, None] * DIM + cols[None, :],
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
    # Batch-major or in bag order, in int64 (bags * DIM passes 2**31 at large batches).
    batches = tl.maximum(batch_size, 1)
    batch_major = (bags % batches) * (num_bags // batches) + bags // batches
    out_row = tl.where(batch_size > 0, batch_major, bags).to(tl.int64)
    tl.store(
        out_ptr + out_row[:, None] * DIM + cols[None, :],
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
    one = tl.full([], 1, tl.int32)
    limit = num_touched
    if PADDED:
        limit = tl.load(num_valid_ptr).to(tl.int32)
    in_rows = idx < limit
    rows = tl.load(rows_ptr + idx, mask=in_rows, other=0)
    prev = tl.load(rows_ptr + idx - 1, mask=in_rows & (idx > 0), other=-1)
    bad_rows = in_rows & ((rows < 0) | (rows >= num_weight_rows) | (rows <= prev))
    raise_flag(flags_ptr + 1, any_of(bad_rows), one)
    in_rows = idx < num_touched
    if HAS_SEGMENTS:
        seg = tl.load(seg_ptr + idx, mask=in_rows, other=0)
        seg_next = tl.load(seg_ptr + idx + 1, mask=in_rows, other=0)
        raise_flag(flags_ptr + 2, any_of(in_rows & (seg_next < seg)), one)
        in_positions = idx < num_positions
        bags = tl.load(bags_ptr + idx, mask=in_positions, other=0)
        bad_bags = in_positions & ((bags < 0) | (bags >= num_bag_rows))
        raise_flag(flags_ptr + 3, any_of(bad_bags), one)
    if pid == 0:
        if PADDED:
            gate = tl.load(gate_ptr)
            raise_flag(flags_ptr + 4, gate != 0, gate)
        t = 0
        bad_offsets = tl.load(row_offsets_ptr) != 0
        while t < num_tables:
            lo = tl.load(row_offsets_ptr + t)
            hi = tl.load(row_offsets_ptr + t + 1)
            bad_offsets = bad_offsets | (hi < lo)
            t += 1
        bad_offsets = bad_offsets | (tl.load(row_offsets_ptr + num_tables) != num_weight_rows)
        raise_flag(flags_ptr, bad_offsets, one)
        if HAS_SEGMENTS:
            first = tl.load(seg_ptr)
            last = tl.load(seg_ptr + num_touched)
            raise_flag(flags_ptr + 2, (first != 0) | (last != num_positions), one)


# --- the fused update: its steps, each a helper ---------------------------------------------
#
# ``update`` below is the functional core's row step (optim/functional.py) over BLOCK_U
# rows: the rows and their tables (``block_rows``), each row's gradient (``row_gradient``,
# hot rows from ``segment_partials``), the CowClip clip (``cowclip``), coupled L2 and the
# per-row learning rate (``row_lr``), the rule's step (``rule_step``: one helper per rule,
# chosen by OPTIMIZER; AdamW's decoupled decay replaces the coupled L2), the store
# (``store_rows``: stochastic or nearest rounding of half rows) and the counts (``count_rows``). The
# scalar hyperparameters come as one value (``hyper``: triton_ops.UpdateHyperparameters,
# read by field name). A new rule is a new ``*_step`` helper, one branch of ``rule_step``
# and its fields in UpdateHyperparameters.


@triton.jit
def checks_failed(flags_ptr):
    # The five flags of check_update: any set refuses the whole update.
    return (
        tl.load(flags_ptr)
        + tl.load(flags_ptr + 1)
        + tl.load(flags_ptr + 2)
        + tl.load(flags_ptr + 3)
        + tl.load(flags_ptr + 4)
    )


@triton.jit
def row_at(seg_ptr, num_touched, position):
    # The row whose segment holds ``position``: the last row whose segment starts at or
    # before it (a binary search of the ascending segment offsets; segments may be empty).
    hi = num_touched.to(tl.int64) - 1
    lo = hi * 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        up = tl.load(seg_ptr + mid) <= position
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    return lo


@triton.jit
def segment_partials(
    grad_ptr,
    seg_ptr,
    bags_ptr,
    sorted_w_ptr,
    partials_ptr,
    flags_ptr,
    num_valid_ptr,
    num_touched,
    num_positions,
    WEIGHTED: tl.constexpr,
    PADDED: tl.constexpr,
    DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # The hot rows' gradients, split across programs: a row with more than CHUNK positions
    # is summed CHUNK positions per program (a fixed tree per chunk, so the same bits every
    # run), and ``update`` adds its chunks' sums in order. A chunk meets at most two hot
    # rows (a hot row is longer than a chunk, so none lies inside one): slot 0 of chunk c
    # is the row holding its first position, slot 1 the other hot row holding its last.
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < DIM
    limit = num_touched
    if PADDED:
        limit = tl.load(num_valid_ptr).to(tl.int32)
    start = chunk.to(tl.int64) * CHUNK
    last = tl.minimum(start + CHUNK, num_positions) - 1
    row0 = row_at(seg_ptr, num_touched, start)
    row1 = row_at(seg_ptr, num_touched, last)
    first0 = tl.load(seg_ptr + row0)
    end0 = tl.load(seg_ptr + row0 + 1)
    first1 = tl.load(seg_ptr + row1)
    end1 = tl.load(seg_ptr + row1 + 1)
    hot0 = (end0 - first0 > CHUNK) & (row0 < limit)
    hot1 = (end1 - first1 > CHUNK) & (row1 < limit) & (row1 != row0)
    if (checks_failed(flags_ptr) == 0) & (hot0 | hot1):
        positions = start + tl.arange(0, CHUNK)
        in0 = (positions < end0) & hot0
        in1 = (positions >= first1) & (positions <= last) & hot1
        take = in0 | in1
        bags = tl.load(bags_ptr + positions, mask=take, other=0)
        terms = tl.load(
            grad_ptr + bags[:, None] * DIM + cols[None, :],
            mask=take[:, None] & col_ok[None, :],
            other=0.0,
        )
        if WEIGHTED:
            weights = tl.load(sorted_w_ptr + positions, mask=take, other=0.0)
            terms = weights[:, None] * terms
        slot = partials_ptr + chunk.to(tl.int64) * (2 * DIM) + cols
        tl.store(slot, tl.sum(tl.where(in0[:, None], terms, 0.0), axis=0), mask=col_ok & hot0)
        tl.store(slot + DIM, tl.sum(tl.where(in1[:, None], terms, 0.0), axis=0), mask=col_ok & hot1)


@triton.jit
def block_rows(
    rows_ptr, counts_ptr, row_offsets_ptr, us, live, num_tables, LOG_TABLES: tl.constexpr
):
    # The block's rows, their counts, and each row's table: the last table whose first row
    # is at or below it (a binary search of the ascending row offsets; tables may be empty).
    rows = tl.load(rows_ptr + us, mask=live, other=0)
    count = tl.load(counts_ptr + us, mask=live, other=1).to(tl.float32)
    lo = tl.zeros_like(us)
    hi = lo + (num_tables - 1)
    for _ in tl.static_range(LOG_TABLES):
        mid = (lo + hi + 1) // 2
        up = tl.load(row_offsets_ptr + mid, mask=live, other=0) <= rows
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    return rows, count, lo


@triton.jit
def row_gradient(
    grad_ptr,
    seg_ptr,
    bags_ptr,
    sorted_w_ptr,
    partials_ptr,
    us,
    live,
    cols,
    col_ok,
    WEIGHTED: tl.constexpr,
    DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Each row's gradient: a row of at most CHUNK positions sums them in input order; a
    # hot row adds its chunks' sums from segment_partials, in order.
    first = tl.load(seg_ptr + us, mask=live, other=0)
    n = tl.load(seg_ptr + us + 1, mask=live, other=0) - first
    hot = n > CHUNK
    short = tl.where(hot, 0, n)
    g = tl.zeros([BLOCK_U, BLOCK_D], dtype=tl.float32)
    longest = tl.max(short)
    j = 0
    while j < longest:
        # [BLOCK_U, 1] rather than [BLOCK_U]: with the 1-D load, Triton 3.6 fails to
        # compile this loop at BLOCK_D 32-64 (TritonGPURemoveLayoutConversions gives the
        # load a mask of another layout than its pointers).
        at = (j < short)[:, None]
        bag = tl.load(bags_ptr + first[:, None] + j, mask=at, other=0)
        term = tl.load(
            grad_ptr + bag * DIM + cols[None, :],
            mask=at & col_ok[None, :],
            other=0.0,
        )
        if WEIGHTED:
            pw = tl.load(sorted_w_ptr + first[:, None] + j, mask=at, other=0.0)
            term = pw * term
        g += term
        j += 1
    first_chunk = first // CHUNK
    chunks = tl.where(hot, (first + n - 1) // CHUNK - first_chunk + 1, 0)
    most = tl.max(chunks)
    c = 0
    while c < most:
        at = c < chunks
        chunk = first_chunk + c
        slot = chunk * 2 + (first > chunk * CHUNK).to(tl.int64)
        g += tl.load(
            partials_ptr + slot[:, None] * DIM + cols[None, :],
            mask=at[:, None] & col_ok[None, :],
            other=0.0,
        )
        c += 1
    return g


@triton.jit
def cowclip(
    g,
    w,
    count,
    table,
    step_rows,
    clip_enabled_ptr,
    live,
    grad_sq,
    weight_sq,
    hyper,
    CLIP_MASK: tl.constexpr,
    ROW_SUMS: tl.constexpr,
):
    # Step 3: the CowClip clip of each row's gradient to count * max(r * ||w||, zeta);
    # returns the gradient, the scale applied and which rows it clipped.
    if ROW_SUMS:
        grad_norm = tl.sqrt(grad_sq)
        weight_norm = tl.sqrt(weight_sq)
    else:
        grad_norm = tl.sqrt(tl.sum(g * g, axis=1))
        weight_norm = tl.sqrt(tl.sum(w * w, axis=1))
    threshold = count * tl.maximum(hyper.r * weight_norm, hyper.zeta)
    clipped = step_rows & (grad_norm > threshold)
    if CLIP_MASK:
        enabled = tl.load(clip_enabled_ptr + table, mask=live, other=0).to(tl.int1)
        clipped = clipped & enabled
    scale = tl.where(clipped, threshold / tl.maximum(grad_norm, 1.1754943508222875e-38), 1.0)
    return tl.where(clipped[:, None], g * scale[:, None], g), scale, clipped


@triton.jit
def row_lr(count, hyper, COUNT_LR: tl.constexpr):
    # The per-row learning rate: lr * min(count, cap) ** power (CountLR), else lr.
    rate = tl.zeros_like(count) + hyper.lr
    if COUNT_LR:
        capped = tl.minimum(count, hyper.count_lr_cap)
        power = hyper.count_lr_power
        # ATen's pow special-cases these exponents; exp2(p * log2(c)) otherwise (c >= 1).
        factor = tl.exp2(power * tl.log2(capped))
        factor = tl.where(power == 0.5, tl.sqrt(capped), factor)
        factor = tl.where(power == 1.0, capped, factor)
        factor = tl.where(power == 2.0, capped * capped, factor)
        rate = hyper.lr * factor
    return rate


@triton.jit
def adam_step(
    w,
    g,
    lr,
    state0_ptr,
    state1_ptr,
    bias1_ptr,
    bias2_ptr,
    rows,
    cols,
    table,
    step_rows,
    step_mask,
    hyper,
    DIM: tl.constexpr,
):
    # functional.adam_rule: the moments, bias-corrected by the table's step.
    s_ptrs = rows[:, None] * DIM + cols[None, :]
    m = tl.load(state0_ptr + s_ptrs, mask=step_mask, other=0.0)
    v = tl.load(state1_ptr + s_ptrs, mask=step_mask, other=0.0)
    b1 = tl.load(bias1_ptr + table, mask=step_rows, other=1.0)
    b2 = tl.load(bias2_ptr + table, mask=step_rows, other=1.0)
    m = m * hyper.beta1 + hyper.one_minus_beta1 * g
    v = v * hyper.beta2 + hyper.one_minus_beta2 * g * g
    tl.store(state0_ptr + s_ptrs, m, mask=step_mask)
    tl.store(state1_ptr + s_ptrs, v, mask=step_mask)
    denom = tl.sqrt(v / b2[:, None]) + hyper.eps
    return w - lr[:, None] * (m / b1[:, None]) / denom


@triton.jit
def decay_weight(w, lr, hyper):
    # functional.decay_weight_: AdamW's decoupled weight decay, before Adam's step.
    return w * (1.0 - lr[:, None] * hyper.weight_decay)


@triton.jit
def adagrad_step(w, g, lr, state0_ptr, rows, cols, step_mask, hyper, DIM: tl.constexpr):
    # functional.adagrad_rows_: per-element Adagrad (FBGEMM's EXACT_ADAGRAD).
    s_ptrs = rows[:, None] * DIM + cols[None, :]
    s = tl.load(state0_ptr + s_ptrs, mask=step_mask, other=0.0) + g * g
    tl.store(state0_ptr + s_ptrs, s, mask=step_mask)
    return w - lr[:, None] * g / (tl.sqrt(s) + hyper.eps)


@triton.jit
def rowwise_adagrad_step(
    w,
    g,
    lr,
    state0_ptr,
    rows,
    step_rows,
    scale,
    grad_sq,
    weight_sq,
    grad_dot_weight,
    whole_dim,
    hyper,
    ROW_SUMS: tl.constexpr,
    DIM: tl.constexpr,
):
    # functional.rowwise_adagrad_rule: one sum of mean squares per row (over the whole
    # row: a column shard's from its row sums).
    if ROW_SUMS:
        decay = hyper.weight_decay
        total_sq = (
            scale * scale * grad_sq
            + (2.0 * decay) * scale * grad_dot_weight
            + (decay * decay) * weight_sq
        )
        mean_square = tl.maximum(total_sq, 0.0) / whole_dim
    else:
        mean_square = tl.sum(g * g, axis=1) / DIM
    s = tl.load(state0_ptr + rows, mask=step_rows, other=0.0) + mean_square
    tl.store(state0_ptr + rows, s, mask=step_rows)
    return w - lr[:, None] * g / (tl.sqrt(s) + hyper.eps)[:, None]


@triton.jit
def rule_step(
    w,
    g,
    lr,
    state0_ptr,
    state1_ptr,
    bias1_ptr,
    bias2_ptr,
    rows,
    cols,
    table,
    step_rows,
    step_mask,
    scale,
    grad_sq,
    weight_sq,
    grad_dot_weight,
    whole_dim,
    hyper,
    OPTIMIZER: tl.constexpr,
    ROW_SUMS: tl.constexpr,
    DIM: tl.constexpr,
):
    # Step 5: the rule (OPTIMIZER: native.OPTIMIZER_CODES), returning the new rows; the
    # rule's state is written here. AdamW (4) is Adam after the decoupled decay.
    if OPTIMIZER == 0 or OPTIMIZER == 4:
        if OPTIMIZER == 4:
            w = decay_weight(w, lr, hyper)
        w = adam_step(
            w,
            g,
            lr,
            state0_ptr,
            state1_ptr,
            bias1_ptr,
            bias2_ptr,
            rows,
            cols,
            table,
            step_rows,
            step_mask,
            hyper,
            DIM,
        )
    elif OPTIMIZER == 1:
        w = rowwise_adagrad_step(
            w,
            g,
            lr,
            state0_ptr,
            rows,
            step_rows,
            scale,
            grad_sq,
            weight_sq,
            grad_dot_weight,
            whole_dim,
            hyper,
            ROW_SUMS,
            DIM,
        )
    elif OPTIMIZER == 3:
        w = adagrad_step(w, g, lr, state0_ptr, rows, cols, step_mask, hyper, DIM)
    else:
        w = w - lr[:, None] * g
    return w


@triton.jit
def store_rows(
    w_ptrs,
    w,
    rounding_ptr,
    row_offsets_ptr,
    rows,
    cols,
    table,
    step_rows,
    step_mask,
    STORE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    # The new rows, float32 as they are, float16 / bfloat16 rounded stochastically with
    # the table's keys, or (not STOCHASTIC: stochastic_rounding=False) to nearest even
    # (STORE: 0 float32, 1 float16, 2 bfloat16).
    if STORE == 0:
        tl.store(w_ptrs, w, mask=step_mask)
    elif not STOCHASTIC:
        tl.store(w_ptrs, w.to(w_ptrs.dtype.element_ty), mask=step_mask)
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


@triton.jit
def count_rows(
    status_ptr,
    per_table_ptr,
    us,
    limit,
    num_touched,
    num_tables,
    table,
    live,
    finite,
    clipped,
    refused,
):
    # Status 0 updated, 1 clipped, 2 skipped (non-finite), 3 padding; per table, counted
    # (relaxed: the counts are read after the kernel).
    status = tl.where(finite, clipped.to(tl.int32), 2)
    status = tl.where(us < limit, status, 3)
    tl.store(status_ptr + us, status.to(tl.int8), mask=(us < num_touched) & (refused == 0))
    step_rows = live & finite
    tl.atomic_add(per_table_ptr + table, 1, mask=step_rows, sem="relaxed")
    tl.atomic_add(per_table_ptr + num_tables + table, 1, mask=clipped, sem="relaxed")
    tl.atomic_add(per_table_ptr + 2 * num_tables + table, 1, mask=live & ~finite, sem="relaxed")


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
    partials_ptr,
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
    hyper,
    OPTIMIZER: tl.constexpr,
    SEGMENTS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    CLIP: tl.constexpr,
    CLIP_MASK: tl.constexpr,
    ROW_SUMS: tl.constexpr,
    COUNT_LR: tl.constexpr,
    PADDED: tl.constexpr,
    STORE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    LOG_TABLES: tl.constexpr,
    DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # BLOCK_U distinct rows per program, each whole (BLOCK_D >= DIM). PADDED: the rows past
    # *num_valid_ptr are padding (status 3, nothing else written).
    us = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    refused = checks_failed(flags_ptr)
    limit = num_touched
    if PADDED:
        limit = tl.load(num_valid_ptr).to(tl.int32)
    live = (us < limit) & (refused == 0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < DIM
    mask = live[:, None] & col_ok[None, :]
    rows, count, table = block_rows(
        rows_ptr, counts_ptr, row_offsets_ptr, us, live, num_tables, LOG_TABLES
    )

    # Step 2: the row's gradient.
    if SEGMENTS:
        g = row_gradient(
            grad_ptr,
            seg_ptr,
            bags_ptr,
            sorted_w_ptr,
            partials_ptr,
            us,
            live,
            cols,
            col_ok,
            WEIGHTED,
            DIM,
            CHUNK,
            BLOCK_U,
            BLOCK_D,
        )
    else:
        g = tl.load(grad_ptr + us[:, None].to(tl.int64) * DIM + cols[None, :], mask=mask, other=0.0)
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
        grad_sq = total
        weight_sq = total
        grad_dot_weight = total
        whole_dim = total
    step_rows = live & finite
    step_mask = step_rows[:, None] & col_ok[None, :]
    w_ptrs = weight_ptr + rows[:, None] * DIM + cols[None, :]
    w = tl.load(w_ptrs, mask=step_mask, other=0.0).to(tl.float32)

    # Step 3: the CowClip clip.
    scale = tl.full([BLOCK_U], 1.0, dtype=tl.float32)
    clipped = tl.zeros([BLOCK_U], dtype=tl.int1)
    if CLIP:
        g, scale, clipped = cowclip(
            g,
            w,
            count,
            table,
            step_rows,
            clip_enabled_ptr,
            live,
            grad_sq,
            weight_sq,
            hyper,
            CLIP_MASK,
            ROW_SUMS,
        )
    # Step 4: coupled L2 (not AdamW's: it decays the weight in its step) and the row's
    # learning rate; step 5: the rule.
    if OPTIMIZER != 4:
        g = g + hyper.weight_decay * w
    lr = row_lr(count, hyper, COUNT_LR)
    w = rule_step(
        w,
        g,
        lr,
        state0_ptr,
        state1_ptr,
        bias1_ptr,
        bias2_ptr,
        rows,
        cols,
        table,
        step_rows,
        step_mask,
        scale,
        grad_sq,
        weight_sq,
        grad_dot_weight,
        whole_dim,
        hyper,
        OPTIMIZER,
        ROW_SUMS,
        DIM,
    )
    store_rows(
        w_ptrs,
        w,
        rounding_ptr,
        row_offsets_ptr,
        rows,
        cols,
        table,
        step_rows,
        step_mask,
        STORE,
        STOCHASTIC,
    )
    count_rows(
        status_ptr,
        per_table_ptr,
        us,
        limit,
        num_touched,
        num_tables,
        table,
        live,
        finite,
        clipped,
        refused,
    )


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

"""The Triton kernels of the fused update and the pooled lookup: build, check, launch.

The GPU counterpart of :mod:`.native` (the C++ CPU kernels), with the same calls and the
same results: :func:`pooled_lookup` is the forward of a table batch - every feature and
table of the batch in one launch, SUM or MEAN, per-sample weights, float32 / float16 /
bfloat16 rows accumulated in float32 - and :func:`fused_update_` its backward's update -
per distinct row: the segment sum of its bag gradients (in input order; a hot row, one of
more than :data:`HOT_CHUNK` positions, in chunks that several programs sum first, in a
fixed order: the same bits every run), the finiteness check, the CowClip clip
``count * max(r * ||W[j]||, zeta)``, coupled L2, the Adam / row-wise Adagrad / SGD step,
the per-row learning rate from the count, the write back of the row and its state
(float16 / bfloat16 rows rounded stochastically with
:func:`~torchrec_cowclip.optim.functional.stochastic_round`'s counter-based bits) and the
per-table counts of rows updated, clipped and skipped. The grouping of the looked-up rows
before it is torch's radix sort (:func:`~.row_gradients.group_rows`), as FBGEMM's
backward groups with CUB's. The math is :mod:`torchrec_cowclip.optim.functional`'s; the
tests hold these kernels to it (``tests/test_triton_kernels.py``), and
:mod:`.triton_build` compiles every specialization for sm_90a and sm_80
(``tests/test_triton_compile.py``). Design notes, and how the kernels map onto FBGEMM's
TBE: ``docs/triton.md``.

Every index a kernel reads or writes through is checked on the device first: the lookup
masks an id outside its table (it reads nothing there) and records it, the update runs a
check kernel over its rows, segment offsets and bags whose flags gate the update kernel
(a bad input changes nothing). The host then reads the flags - one synchronisation per
call, skipped while a CUDA graph is being captured (the gate still holds) - and raises
the native kernels' one-line errors.

Triton runs on CUDA devices; on a CPU only under its interpreter
(``TRITON_INTERPRET=1``, set before the first kernel is built: the kernels are defined on
first use, when that variable is read), which runs the same kernels on CPU tensors -
correct, not fast: that is how ``make test`` proves them without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.embedding.native import OPTIMIZER_CODES

#: The rules the Triton update implements (their codes are :data:`OPTIMIZER_CODES`').
OPTIMIZERS = ("adam", "rowwise_adagrad", "sgd", "adagrad", "adamw")

__all__ = [
    "INTERPRET_ENV",
    "PADDING",
    "UpdateHyperparameters",
    "availability",
    "capturing",
    "fused_update_",
    "fused_update_padded_",
    "pool_into",
    "pooled_lookup",
    "prepare_rows",
    "raise_pool_errors",
    "stochastic_round",
]

INTERPRET_ENV = "TRITON_INTERPRET"

#: Largest embedding dim of one row block: a row is updated in one block of the next power
#: of two of its dim (its norms need the whole row before the step).
MAX_DIM = 4096

#: Elements of one update block (rows x padded dim): several short rows per program, at
#: most :data:`_UPDATE_ROWS` of them (more rows than threads costs registers, not speed).
_UPDATE_BLOCK = 2048
_UPDATE_ROWS = 128

#: Positions of one chunk of a hot row (a row with more positions): summed by one program
#: of ``segment_partials``, so that a row's gradient takes a few steps per chunk, not one
#: per position.
HOT_CHUNK = 64

#: Columns of one program of ``segment_partials`` (CHUNK x columns elements).
_PARTIAL_COLUMNS = 32

#: Elements of one lookup block (bags x column block): several bags per program.
_POOL_BLOCK = 1024

#: Bags of one program of the ids' check and mapping.
_PREPARE_BAGS = 256

#: The value of a per-row status that is padding (a grouping of fixed size), after
#: native's UPDATED, CLIPPED, SKIPPED.
PADDING = 3


class UpdateHyperparameters(NamedTuple):
    """The update kernel's scalar hyperparameters, handed to it as one value (the kernel
    reads them by name: ``hyper.lr``); a rule's new hyperparameter is a new field here."""

    lr: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    r: float
    zeta: float
    count_lr_power: float
    count_lr_cap: float


#: A launch seen by :func:`recording_launches`: kernel name, grid, positional arguments
#: and compile-time constants.
Launch = Tuple[str, Tuple[int, ...], Tuple[Any, ...], Dict[str, Any]]

_recorders: List[Callable[[str, Tuple[int, ...], Tuple[Any, ...], Dict[str, Any]], bool]] = []


@contextlib.contextmanager
def recording_launches(execute: bool = True) -> Iterator[List[Launch]]:
    """Records every kernel launch made inside the block (what
    :mod:`.triton_build` compiles ahead of time); ``execute=False`` records without
    running the kernels (their outputs are then left unwritten: for recording only)."""
    seen: List[Launch] = []

    def record(
        name: str, grid: Tuple[int, ...], args: Tuple[Any, ...], consts: Dict[str, Any]
    ) -> bool:
        seen.append((name, grid, args, dict(consts)))
        return execute

    _recorders.append(record)
    try:
        yield seen
    finally:
        _recorders.remove(record)


def _launch(name: str, grid: Tuple[int, ...], *args: Any, **consts: Any) -> None:
    """Launches kernel ``name`` of :mod:`.triton_kernels` (the one place every launch
    passes, so that a recording sees them all)."""
    run = True
    for record in _recorders:
        run = record(name, grid, args, consts) and run
    if run:
        getattr(_kernels(), name)[grid](*args, **consts)


def availability(device: torch.device) -> Optional[str]:
    """None when the Triton kernels can run on ``device`` here; else why not, in one line."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if _interpreting():
            language = sys.modules.get("triton.language")
            if language is not None and type(language.max).__name__ != "InterpretedFunction":
                return (
                    f"Triton was imported before {INTERPRET_ENV}=1 was set, so it compiles "
                    f"for a GPU: set {INTERPRET_ENV}=1 before anything imports triton (at "
                    "the start of the process)"
                )
            return None
        return (
            f"Triton kernels run on CUDA devices, and on CPU tensors only under Triton's "
            f"interpreter: set {INTERPRET_ENV}=1 before the first table batch is built"
        )
    return f"Triton kernels run on CUDA (or CPU under {INTERPRET_ENV}=1), not on {device.type}"


def _interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream: no host reads then."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def _kernels() -> Any:
    """The kernels module (:mod:`.triton_kernels`), imported on first use (Triton reads
    ``TRITON_INTERPRET`` when a kernel is defined)."""
    from torchrec_cowclip.embedding import triton_kernels

    return triton_kernels


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# --- pooled lookup -------------------------------------------------------------------------


def pooled_lookup(
    weight: Tensor, ids: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor], mean: bool
) -> Tensor:
    """``[bags, D]`` float32 sum (or mean) pooled rows of ``weight`` (float32, float16 or
    bfloat16; ``weight[ids[offsets[b]:offsets[b + 1]]]`` for bag ``b``), accumulated in
    float32, in one launch: :func:`.native.pooled_lookup`'s call and checks."""
    _check(not (mean and per_sample_weights is not None), "mean pooling takes no weights")
    _check(
        offsets.dtype == torch.int64 and offsets.is_contiguous() and offsets.numel() >= 1,
        "offsets: [bags + 1] int64",
    )
    out = torch.empty(
        offsets.numel() - 1, weight.shape[1], dtype=torch.float32, device=weight.device
    )
    flags = pool_into(out, weight, ids, offsets, per_sample_weights, mean, whole=True)
    if out.shape[0] > 0:
        raise_pool_errors(flags, ids, weight.shape[0])
    return out


def pool_into(
    out: Tensor,
    weight: Tensor,
    ids: Tensor,
    offsets: Tensor,
    per_sample_weights: Optional[Tensor],
    mean: bool,
    whole: bool,
    batch_size: int = 0,
) -> Tensor:
    """Pools bag ``b`` of ``offsets`` (``[bags + 1]``; ``whole``: spanning ``ids`` from 0,
    else a slice of a KJT's offsets, absolute positions into ``ids``) into ``out`` (float32
    ``[bags, D]``; with ``batch_size``, batch-major: bag ``f * B + b`` to row ``b * F + f``);
    weighted by ``per_sample_weights`` and/or divided by its length (``mean``). Returns
    the device flags for :func:`raise_pool_errors` (nothing is read back here)."""
    _check(weight.dim() == 2 and weight.is_contiguous(), "weight: contiguous [R, D]")
    _check(ids.dtype == torch.int64 and ids.is_contiguous(), "ids: [L] int64")
    num_rows, dim = weight.shape
    bags = offsets.numel() - 1
    psw = _optional_float(per_sample_weights, ids.numel(), "per_sample_weights")
    # 0: a bad bag; 1: the first id outside the table (num_ids: none).
    flags = torch.full((2,), ids.numel(), dtype=torch.int64, device=weight.device)
    flags[0] = 0
    if bags > 0:
        block_d = min(_pow2(dim), 128)
        block_b = max(1, _POOL_BLOCK // block_d)
        _launch(
            "pool",
            (math.ceil(bags / block_b), math.ceil(dim / block_d)),
            weight,
            ids,
            offsets,
            psw if psw is not None else out,
            out,
            flags,
            bags,
            ids.numel(),
            num_rows,
            batch_size,
            DIM=dim,
            HAS_PSW=psw is not None,
            MEAN=mean,
            WHOLE=whole,
            BLOCK_B=block_b,
            BLOCK_D=block_d,
        )
    return flags


def raise_pool_errors(flags: Tensor, ids: Tensor, num_rows: int) -> None:
    """Reads :func:`pool_into`'s flags (one synchronisation; none while a CUDA graph is
    being captured) and raises the native lookup's one-line errors."""
    if capturing(flags.device):
        return
    bad_bag, first_outside = flags.tolist()
    _check(
        bad_bag == 0,
        f"pooled_lookup: offsets must start at 0, ascend and end at the {ids.numel()} ids",
    )
    if first_outside < ids.numel():
        raise RuntimeError(f"pooled_lookup: id {int(ids[first_outside])} outside [0, {num_rows})")


def prepare_rows(
    values: Tensor, offsets: Tensor, feature_rows: Tensor, batch_size: int
) -> Tuple[Tensor, Tensor]:
    """The row ids of a KJT's values (``offsets``: ``[F * B + 1]``, feature-major): the
    id of each position plus its feature's first row (``feature_rows``: ``[F, 2]`` first
    row and row count), in one launch that also checks the offsets and each id against its
    feature's rows. Returns ``(row_ids [L] int64, flags [2] int64)``: flag 0 set for offsets
    that do not start at 0, ascend and end at the values; flag 1 the first position whose id
    is outside its feature (``L``: none). Nothing is read back here."""
    num_ids = values.numel()
    row_ids = torch.empty(num_ids, dtype=torch.int64, device=values.device)
    flags = torch.full((2,), num_ids, dtype=torch.int64, device=values.device)
    flags[0] = 0
    bags = offsets.numel() - 1
    if bags > 0 and batch_size > 0:
        _launch(
            "prepare",
            (math.ceil(bags / _PREPARE_BAGS),),
            values.contiguous(),
            offsets.contiguous(),
            feature_rows,
            row_ids,
            flags,
            bags,
            num_ids,
            batch_size,
            BLOCK_B=_PREPARE_BAGS,
        )
    return row_ids, flags


# --- the fused update ----------------------------------------------------------------------

_UPDATE_FLAG_MESSAGES = (
    "fused_update_: row_offsets must start at 0, ascend and end at the weight's {R} rows",
    "rows must be distinct, ascending and inside the weight",
    "fused_update_: segment_offsets must start at 0, ascend and end at the {L} positions of "
    "sorted_bags",
    "fused_update_: sorted_bags must index the {M} rows of the bag gradients",
    "a second backward reached the same CowClip lookup (retain_graph=True?); the fused "
    "update applies exactly once per forward",
)


def fused_update_(*arguments: Any) -> Tuple[Tensor, Tensor]:
    """The fused update, in place: the native op's arguments (``torchrec_cowclip::fused_update_``,
    laid out by :func:`.native.update_arguments`) and result ``(status [U] int8,
    per_table [3, T] int64)``, in two launches (the index checks, then the update)."""
    return fused_update_padded_(*arguments, num_valid=None, gate=None)


def fused_update_padded_(
    weight: Tensor,
    state0: Optional[Tensor],
    state1: Optional[Tensor],
    rows: Tensor,
    counts: Tensor,
    grad: Tensor,
    segment_offsets: Optional[Tensor],
    sorted_bags: Optional[Tensor],
    sorted_weights: Optional[Tensor],
    row_offsets: Tensor,
    clip_enabled: Optional[Tensor],
    bias1: Optional[Tensor],
    bias2: Optional[Tensor],
    row_sums: Optional[Tensor],
    rounding: Optional[Tensor],
    optimizer: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    clip: bool,
    r: float,
    zeta: float,
    count_lr_power: float,
    count_lr_cap: float,
    *,
    num_valid: Optional[Tensor],
    gate: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """:func:`fused_update_` over a grouping of fixed size: the rows past ``num_valid``
    (a one-element int64 device tensor; None: every row is real) are padding, their status
    :data:`PADDING`; a set ``gate`` (one-element int32 device tensor) refuses the update
    on the device - nothing is written - with the error of a second backward of one
    forward. No value is read back to the host while a CUDA graph is being captured."""
    _check(weight.dim() == 2 and weight.is_contiguous(), "weight: contiguous [R, D]")
    num_weight_rows, dim = weight.shape
    _check(dim <= MAX_DIM, f"Triton update: embedding dim {dim} above {MAX_DIM}")
    num_touched = rows.numel()
    num_tables = row_offsets.numel() - 1
    _check(
        num_tables >= 1 and row_offsets.dtype == torch.int64 and row_offsets.is_contiguous(),
        "row_offsets: [T + 1] int64",
    )
    _check(rows.dtype == torch.int64 and rows.is_contiguous(), "rows: [U] int64")
    _check(
        counts.dtype == torch.int64 and counts.is_contiguous() and counts.numel() == num_touched,
        "counts: [U] int64",
    )
    _check(
        grad.dtype == torch.float32
        and grad.is_contiguous()
        and grad.dim() == 2
        and grad.shape[1] == dim,
        "grad: contiguous float32 [*, D]",
    )
    segments = segment_offsets is not None
    _check(segments == (sorted_bags is not None), "segment_offsets and sorted_bags come together")
    num_positions = 0
    if segments:
        assert segment_offsets is not None and sorted_bags is not None
        _check(
            segment_offsets.dtype == torch.int64
            and segment_offsets.is_contiguous()
            and segment_offsets.numel() == num_touched + 1,
            "segment_offsets: [U + 1] int64",
        )
        _check(
            sorted_bags.dtype == torch.int64 and sorted_bags.is_contiguous(),
            "sorted_bags: [L] int64",
        )
        num_positions = sorted_bags.numel()
    else:
        _check(grad.shape[0] == num_touched, "grad: one row per touched row without segments")
        _check(sorted_weights is None, "sorted_weights need segments")
    _optional_float(sorted_weights, num_positions, "sorted_weights")
    adam = optimizer in (OPTIMIZER_CODES["adam"], OPTIMIZER_CODES["adamw"])
    _check(
        not adam
        or (state0 is not None and state1 is not None and bias1 is not None and bias2 is not None),
        "Adam needs both moments and both bias corrections",
    )
    _check(
        optimizer not in (OPTIMIZER_CODES["rowwise_adagrad"], OPTIMIZER_CODES["adagrad"])
        or state0 is not None,
        "Adagrad needs its sum",
    )
    if clip_enabled is not None:
        _check(
            clip_enabled.dtype == torch.bool and clip_enabled.numel() == num_tables,
            "clip_enabled: [T] bool",
        )
    _optional_float(bias1, num_tables, "bias1")
    _optional_float(bias2, num_tables, "bias2")
    _optional_float(row_sums, num_touched * 5, "row_sums")
    store = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}.get(weight.dtype)
    _check(store is not None, f"weight must be float32, float16 or bfloat16, got {weight.dtype}")
    if store == 0:
        _check(rounding is None, "float32 tables take no rounding keys")
    elif rounding is not None:  # without keys: round to nearest (stochastic_rounding=False)
        _check(
            rounding.dtype == torch.int64 and rounding.numel() == 4 * num_tables,
            "rounding: [T, 4] int64",
        )
    per_column = adam or optimizer == OPTIMIZER_CODES["adagrad"]
    state_numel = num_weight_rows * dim if per_column else num_weight_rows
    for name, state in (("state0", state0), ("state1", state1)):
        if state is not None and optimizer != OPTIMIZER_CODES["sgd"]:
            _check(
                state.dtype == torch.float32
                and state.is_contiguous()
                and state.numel() == state_numel,
                f"{name}: contiguous float32 over every row",
            )
    device = weight.device
    status = torch.empty(num_touched, dtype=torch.int8, device=device)
    per_table = torch.zeros(3, num_tables, dtype=torch.int64, device=device)
    if num_touched == 0:
        return status, per_table
    flags = torch.zeros(len(_UPDATE_FLAG_MESSAGES), dtype=torch.int32, device=device)
    padded = num_valid is not None
    check_block = 1024
    _launch(
        "check_update",
        (math.ceil(max(num_touched, num_positions) / check_block),),
        rows,
        segment_offsets if segments else rows,
        sorted_bags if segments else rows,
        row_offsets,
        flags,
        num_valid if num_valid is not None else flags,
        gate if gate is not None else flags,
        num_touched,
        num_positions,
        grad.shape[0],
        num_weight_rows,
        num_tables,
        HAS_SEGMENTS=segments,
        PADDED=padded,
        BLOCK=check_block,
    )
    unused = grad  # a placeholder pointer for the inputs a variant does not read
    partials = unused
    if segments and num_positions > HOT_CHUNK:
        # Two slots of [D] per chunk; only the hot rows' slots are written and read.
        chunks = math.ceil(num_positions / HOT_CHUNK)
        partials = torch.empty(chunks * 2, dim, dtype=torch.float32, device=device)
        block_p = min(_pow2(dim), _PARTIAL_COLUMNS)
        _launch(
            "segment_partials",
            (chunks, math.ceil(dim / block_p)),
            grad,
            segment_offsets,
            sorted_bags,
            sorted_weights if sorted_weights is not None else unused,
            partials,
            flags,
            num_valid if num_valid is not None else flags,
            num_touched,
            num_positions,
            WEIGHTED=sorted_weights is not None,
            PADDED=padded,
            DIM=dim,
            CHUNK=HOT_CHUNK,
            BLOCK_D=block_p,
        )
    block_d = _pow2(dim)
    block_u = max(1, min(_UPDATE_ROWS, _UPDATE_BLOCK // block_d))
    hyper = UpdateHyperparameters(
        lr=float(lr),
        beta1=float(beta1),
        one_minus_beta1=float(1.0 - beta1),
        beta2=float(beta2),
        one_minus_beta2=float(1.0 - beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        r=float(r),
        zeta=float(zeta),
        count_lr_power=float(count_lr_power),
        count_lr_cap=float(count_lr_cap),
    )
    _launch(
        "update",
        (math.ceil(num_touched / block_u),),
        weight,
        state0 if state0 is not None else unused,
        state1 if state1 is not None else unused,
        rows,
        counts,
        grad,
        segment_offsets if segments else rows,
        sorted_bags if segments else rows,
        sorted_weights if sorted_weights is not None else unused,
        partials,
        row_offsets,
        clip_enabled if clip_enabled is not None else rows,
        bias1 if bias1 is not None else unused,
        bias2 if bias2 is not None else unused,
        row_sums if row_sums is not None else unused,
        rounding if rounding is not None else rows,
        flags,
        num_valid if num_valid is not None else flags,
        status,
        per_table,
        num_touched,
        num_tables,
        hyper,
        OPTIMIZER=int(optimizer),
        SEGMENTS=segments,
        WEIGHTED=sorted_weights is not None,
        CLIP=bool(clip),
        CLIP_MASK=clip_enabled is not None,
        ROW_SUMS=row_sums is not None,
        COUNT_LR=count_lr_power != 0.0,
        PADDED=padded,
        STORE=store,
        STOCHASTIC=rounding is not None,
        LOG_TABLES=max(1, math.ceil(math.log2(num_tables))),
        DIM=dim,
        CHUNK=HOT_CHUNK,
        BLOCK_U=block_u,
        BLOCK_D=block_d,
        num_warps=_update_warps(block_u * block_d),
    )
    if not capturing(device):
        failed = flags.tolist()
        for flag, message in zip(failed, _UPDATE_FLAG_MESSAGES):
            if flag:
                raise RuntimeError(
                    message.format(R=num_weight_rows, L=num_positions, M=grad.shape[0])
                )
    return status, per_table


# --- the rounding, exposed for the tests -----------------------------------------------------


def _update_warps(elements: int) -> int:
    """Warps of an update program: 8 elements of each row block per thread (more cost
    registers past 128 per thread - ``docs/triton.md``'s compile table), 4 to 16 warps."""
    return max(4, min(16, elements // 256))


def rounding_row_keys(seed: Tensor, step: Tensor, global_row: Tensor) -> Tensor:
    """The kernels' :func:`~torchrec_cowclip.optim.functional.rounding_row_keys`."""
    n = global_row.numel()
    out = torch.empty(n, dtype=torch.int64, device=global_row.device)
    if n:
        block = 256
        _launch(
            "row_keys",
            (math.ceil(n / block),),
            seed.to(torch.int64).contiguous(),
            step.to(torch.int64).contiguous(),
            global_row.to(torch.int64).contiguous(),
            out,
            n,
            BLOCK=block,
        )
    return out.view(global_row.shape)


def stochastic_round(
    values: Tensor, dtype: torch.dtype, row_keys: Tensor, column_base: Tensor
) -> Tensor:
    """The kernels' :func:`~torchrec_cowclip.optim.functional.stochastic_round` of ``[U, D]``
    float32 ``values`` into float16 or bfloat16."""
    _check(dtype in (torch.float16, torch.bfloat16), "stochastic_round: float16 or bfloat16")
    values = values.to(torch.float32).contiguous()
    u, d = values.shape
    out = torch.empty(u, d, dtype=dtype, device=values.device)
    if u and d:
        _launch(
            "round_rows",
            (u,),
            values,
            row_keys.to(torch.int64).contiguous(),
            column_base.to(torch.int64).contiguous(),
            out,
            d,
            IS_BF16=dtype == torch.bfloat16,
            BLOCK_D=_pow2(d),
        )
    return out


# --- helpers -------------------------------------------------------------------------------


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _optional_float(tensor: Optional[Tensor], numel: int, name: str) -> Optional[Tensor]:
    if tensor is None:
        return None
    _check(
        tensor.dtype == torch.float32 and tensor.is_contiguous() and tensor.numel() == numel,
        f"{name}: contiguous float32 with {numel} elements",
    )
    return tensor


def launch_arguments(kernel: Any) -> List[str]:
    """The argument names of one of the kernels (``"update"``, ``"pool"``, ...), for the
    design notes' table and its test."""
    fn = getattr(_kernels(), kernel)
    return list(getattr(fn, "arg_names", None) or fn.fn.arg_names)

"""Gather the touched rows, take the CowClip step, scatter them back: eagerly or as one
TorchInductor-compiled kernel.

:func:`gather_step_scatter_` is the whole per-row update of a table batch written once,
over :func:`~torchrec_cowclip.optim.functional.cowclip_row_update_` (docs/algorithm.md's math).
The *compiled* path is that same function through ``torch.compile``: Inductor fuses the
row gathers, the clip, coupled L2, the optimizer rule and the scatters into one loop
over the touched rows (C++/OpenMP on CPU, Triton on CUDA), so the weights and both Adam
moments are read and written once per row instead of once per elementwise op.

The compiled step is several times faster than the eager one (measured: docs/performance.md, "Measured reasons behind code choices").

Row counts are dynamic, the embedding dim is not: a process compiles one graph per
(optimizer, dim, clip on/off, clip mask or not, column shard or not) it meets.

Which path runs (:func:`compiled_update_mode`):

- ``TORCHREC_COWCLIP_COMPILE=auto`` (default): compiled where it can build. On CPU the
  table batches' update is the native kernels of :mod:`torchrec_cowclip.embedding.native`
  (built on first use; a
  C++ compiler on ``PATH``), and this row step, where it still runs (a registered update
  rule of one's own, or the native build failed), is Inductor's; on CUDA, Inductor's
  Triton kernels. Eager otherwise;
- ``=1``: compiled, and a failure to build is an error;
- ``=inductor``: this row step compiled by Inductor on every device and no native kernels
  (the CPU path before the native kernels, kept for comparison);
- ``=0``: always eager.

If a compile fails in ``auto`` mode, a warning names the error and that device type
falls back (native -> Inductor -> eager) from then on; every path computes the same
update (tests compare them with the functional core and the dense reference).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import warnings
from typing import Any, Callable, Dict, Optional, Set, Tuple, Union

import torch
from torch import Tensor

from torchrec_cowclip.compat import mark_static_dim, recompile_limit_at_least
from torchrec_cowclip.optim.functional import RowSums, cowclip_row_update_, stochastic_round
from torchrec_cowclip.optim.options import CountLR, CowClip
from torchrec_cowclip.optim.rules import UpdateRule, update_rule

logger = logging.getLogger(__name__)

COMPILE_ENV = "TORCHREC_COWCLIP_COMPILE"
_MODES = ("auto", "1", "0", "inductor")

# Each (optimizer, clip on/off, mask or not, sharded sums or not, size-1 dims) is its
# own graph; a run uses a few, a test process many. Raised only around our own calls.
_RECOMPILE_LIMIT = 64

_override: Optional[str] = None
_failed_devices: Set[str] = set()


def compiled_update_mode() -> str:
    """``"auto"``, ``"1"`` or ``"0"``: :func:`set_compiled_update`'s value, else the
    ``TORCHREC_COWCLIP_COMPILE`` environment variable, else ``"auto"``."""
    mode = _override if _override is not None else os.environ.get(COMPILE_ENV, "auto")
    mode = mode.strip().lower()
    if mode not in _MODES:
        raise ValueError(f"{COMPILE_ENV}={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def set_compiled_update(mode: Optional[str]) -> None:
    """Chooses the update path for this process: ``"auto"``, ``"1"`` (compiled),
    ``"inductor"`` (Inductor only, no native kernels), ``"0"`` (eager), or None to go back
    to the environment variable.

    Example::

        >>> set_compiled_update("0")   # e.g. to compare against the compiled path
        >>> compiled_update_mode()
        '0'
        >>> set_compiled_update(None)
    """
    global _override
    if mode is not None and mode not in _MODES:
        raise ValueError(f"compiled update mode {mode!r}: expected one of {', '.join(_MODES)}")
    _override = mode
    _failed_devices.clear()


def _can_compile(device: torch.device) -> bool:
    return _toolchain_available(device.type)


@functools.lru_cache(maxsize=None)
def _toolchain_available(device_type: str) -> bool:
    # Cached: asked on every update, and a PATH search per step is wasted work.
    if device_type == "cpu":
        compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
        return any(name and shutil.which(name) for name in compilers)
    if device_type == "cuda":
        try:
            import triton  # type: ignore[import-not-found]  # noqa: F401  (absent on CPU-only machines)
        except ImportError:
            return False
        return True
    return False


def use_compiled_update(device: torch.device) -> bool:
    """Whether :func:`row_step_` on ``device`` takes the Inductor-compiled path now."""
    mode = compiled_update_mode()
    if mode == "0":
        return False
    if mode in ("1", "inductor"):
        return True
    return device.type not in _failed_devices and _can_compile(device)


def gather_step_scatter_(
    weight_table: Tensor,
    state_tables: Dict[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    counts: Tensor,
    *,
    optimizer: Union[str, UpdateRule],
    lr: float,
    betas: Tuple[float, float],
    eps: float,
    weight_decay: float,
    cowclip: Optional[CowClip],
    count_lr: Optional[CountLR] = None,
    clip_enabled: Optional[Tensor] = None,
    row_sums: Optional[RowSums] = None,
    adam_bias: Optional[Tuple[Tensor, Tensor]] = None,
    rounding: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tensor:
    """One CowClip step on rows ``rows`` of ``weight_table`` and its ``state_tables``
    (``[N, D]`` / ``[N]``), in place; returns the ``[U]`` clipped mask.

    The keyword arguments are :func:`cowclip_row_update_`'s, for the ``U`` rows (the
    hyperparameters are :meth:`CowClipOptions.hyperparameters
    <torchrec_cowclip.optim.options.CowClipOptions.hyperparameters>`). ``rows`` must be
    distinct: each row is read once and written once. A float16 / bfloat16
    ``weight_table`` is stepped in float32 and rounded back by :func:`stochastic_round`
    with ``rounding`` = (``[U]`` row keys, ``[U]`` column base).
    """
    weight = weight_table.index_select(0, rows).to(grad.dtype)
    state = {name: table.index_select(0, rows) for name, table in state_tables.items()}
    rule = optimizer if isinstance(optimizer, UpdateRule) else update_rule(optimizer)
    clipped = cowclip_row_update_(
        rule.step,
        weight,
        grad,
        counts,
        state,
        None,  # Adam's step count enters as adam_bias, computed once per table
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        cowclip=cowclip,
        clip_enabled=clip_enabled,
        row_sums=row_sums,
        adam_bias=adam_bias,
        count_lr=count_lr,
    )
    if weight_table.dtype != weight.dtype:
        if rounding is None:
            raise ValueError(
                f"a {weight_table.dtype} table needs rounding keys for its stochastic rounding"
            )
        weight = stochastic_round(weight, weight_table.dtype, *rounding)
    weight_table.index_copy_(0, rows, weight)
    for name, table in state_tables.items():
        table.index_copy_(0, rows, state[name])
    return clipped


_compiled: Optional[Callable[..., Tensor]] = None


def _compiled_fn() -> Callable[..., Tensor]:
    global _compiled
    if _compiled is None:
        # Dynamic: the touched-row count changes every step, tables differ in size, and
        # lr changes every step of a warm-up; none of them may cost a recompile. The
        # embedding dim is then marked static per call (_mark_embedding_dim_static).
        _compiled = torch.compile(gather_step_scatter_, dynamic=True)
    return _compiled


def _mark_embedding_dim_static(args: Tuple[Any, ...]) -> None:
    """Marks dim 1 (the embedding dim) of every 2-d tensor argument static, so that the
    kernel's inner loop is a fixed-width vector op (faster than a symbolic dim:
    docs/performance.md, "Measured reasons behind code choices"); a process compiles one graph per dim it meets."""
    for arg in args:
        if isinstance(arg, Tensor):
            tensors: Tuple[Any, ...] = (arg,)
        elif isinstance(arg, dict):
            tensors = tuple(arg.values())
        elif isinstance(arg, tuple):
            tensors = arg
        elif isinstance(arg, RowSums):
            tensors = (arg.nonfinite, arg.grad_sq, arg.weight_sq, arg.grad_dot_weight, arg.dim)
        else:
            continue
        for tensor in tensors:
            if isinstance(tensor, Tensor) and tensor.dim() == 2:
                mark_static_dim(tensor, 1)


def row_step_(*args: Any, **kwargs: Any) -> Tensor:
    """:func:`gather_step_scatter_`, compiled where :func:`use_compiled_update` says so.

    Example::

        >>> w = torch.zeros(4, 2); rows = torch.tensor([1, 3])
        >>> _ = row_step_(w, {}, rows, torch.ones(2, 2), torch.ones(2), optimizer="sgd",
        ...               lr=0.5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, cowclip=None)
        >>> w[:, 0].tolist()
        [0.0, -0.5, 0.0, -0.5]
    """
    weight_table: Tensor = args[0]
    device = weight_table.device
    if not use_compiled_update(device):
        return gather_step_scatter_(*args, **kwargs)
    try:
        with recompile_limit_at_least(_RECOMPILE_LIMIT):
            _mark_embedding_dim_static((*args, *kwargs.values()))
            return _compiled_fn()(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any build failure falls back in auto mode
        if compiled_update_mode() == "1":
            raise
        _failed_devices.add(device.type)
        warnings.warn(
            f"torchrec_cowclip: compiling the fused CowClip update for {device.type} "
            f"failed ({type(error).__name__}: {error}); updating eagerly from now on "
            f"(same math, slower). Set {COMPILE_ENV}=0 to skip the attempt.",
            RuntimeWarning,
            stacklevel=2,
        )
        logger.debug("compiled update failed", exc_info=True)
        return gather_step_scatter_(*args, **kwargs)

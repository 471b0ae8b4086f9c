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

:func:`row_step` is the step with the choice made: :class:`CompiledRowStep`, or
:func:`gather_step_scatter_` itself, fixed when it is chosen. Which one a table batch gets - or
the native CPU kernels instead - is the row kernel's choice
(:mod:`torchrec_cowclip.embedding.row_kernels`), made when the batch is built or moved,
from the *kernel mode* its module was built with: an explicit value
(``CowClipEmbeddingBagCollection(..., kernel_mode=...)``), else the
``TORCHREC_COWCLIP_COMPILE`` environment variable (which :func:`set_compiled_update` sets),
read by :func:`compiled_update_mode` alone, once per module (:func:`kernel_mode`). One of

- ``auto`` (default): on CPU the native kernels (built on first use; a C++ compiler on
  ``PATH``), falling back - with a warning naming the error, once, when the kernel is
  chosen - to this row step compiled by Inductor, or eager without a compiler; on CUDA,
  the project's Triton kernels (eager without Triton);
- ``1``: the fused kernels (native on CPU, Triton on CUDA); a failed build is an error;
- ``triton``: the Triton kernels on every device (on CPU tensors only under Triton's
  interpreter, ``TRITON_INTERPRET=1``: the tests' way to run them without a GPU);
- ``inductor``: this row step compiled by Inductor on every device and no fused kernels
  (the path before them, kept for comparison and for rules of one's own);
- ``0``: always eager.

A compiled step that fails to compile raises, naming the error and
``TORCHREC_COWCLIP_COMPILE=0``; it never falls back on its own, so that two processes of
one job never run different paths (they agree to about 1e-6, not bit for bit).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from torchrec_cowclip.compat import mark_static_dim, recompile_limit_at_least
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.optim.functional import RowSums, cowclip_row_update_, stochastic_round
from torchrec_cowclip.optim.options import CountLR, CowClip
from torchrec_cowclip.optim.rules import UpdateRule, update_rule

logger = logging.getLogger(__name__)

COMPILE_ENV = "TORCHREC_COWCLIP_COMPILE"
MODES = ("auto", "1", "0", "triton", "inductor")

# Each (optimizer, clip on/off, mask or not, sharded sums or not, size-1 dims) is its
# own graph; a run uses a few, a test process many. Raised only around our own calls.
_RECOMPILE_LIMIT = 64


def compiled_update_mode() -> str:
    """``"auto"``, ``"1"``, ``"triton"``, ``"inductor"`` or ``"0"``: the ``TORCHREC_COWCLIP_COMPILE``
    environment variable (:func:`set_compiled_update` sets it), else ``"auto"``. The one
    place the variable is read: when a module resolves its kernel mode
    (:func:`kernel_mode`), never per step."""
    mode = os.environ.get(COMPILE_ENV, "auto").strip().lower()
    if mode not in MODES:
        raise ConfigError(
            f"the environment variable {COMPILE_ENV}={mode!r}: expected one of "
            f"{', '.join(MODES)} (unset it for auto)"
        )
    return mode


def kernel_mode(mode: Optional[str] = None) -> str:
    """The kernel mode a module is built with, resolved once: ``mode`` if given (one of
    :data:`MODES`), else :func:`compiled_update_mode`.

    Example::

        >>> kernel_mode("inductor")
        'inductor'
        >>> kernel_mode("fast")
        Traceback (most recent call last):
        ...
        ValueError: kernel mode 'fast': expected one of auto, 1, 0, triton, inductor
    """
    if mode is None:
        return compiled_update_mode()
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r}: expected one of {', '.join(MODES)}")
    return mode


def set_compiled_update(mode: Optional[str]) -> Optional[str]:
    """Chooses the update path of the modules built from now on (their table batches keep
    it, moved or not):
    ``"auto"``, ``"1"`` (the fused kernels), ``"triton"`` (the Triton kernels everywhere),
    ``"inductor"`` (Inductor only, no fused kernels), ``"0"`` (eager), or None for the default (``auto``). It sets (or unsets)
    ``TORCHREC_COWCLIP_COMPILE``, so the processes this one starts - the ranks of a job -
    choose alike; returns the variable's previous value (None: unset), to restore it.

    Example::

        >>> previous = set_compiled_update("0")   # e.g. to compare against the compiled path
        >>> compiled_update_mode()
        '0'
        >>> _ = set_compiled_update(previous)
    """
    previous = os.environ.get(COMPILE_ENV)
    if mode is None:
        os.environ.pop(COMPILE_ENV, None)
        return previous
    if mode not in MODES:
        raise ValueError(f"compiled update mode {mode!r}: expected one of {', '.join(MODES)}")
    os.environ[COMPILE_ENV] = mode
    return previous


@functools.lru_cache(maxsize=None)
def toolchain_available(device_type: str) -> bool:
    """Whether Inductor can build kernels for ``device_type`` here: a C++ compiler on
    ``PATH`` for CPU, Triton for CUDA (looked up once per process)."""
    if device_type == "cpu":
        compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
        return any(name and shutil.which(name) for name in compilers)
    if device_type == "cuda":
        try:
            import triton  # noqa: F401  (absent on CPU-only machines)
        except ImportError:
            return False
        return True
    return False


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
    with ``rounding`` = (``[U]`` row keys, ``[U]`` column base), or to nearest without
    ``rounding`` (``stochastic_rounding=False``).
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
        decoupled_weight_decay=rule.decoupled_weight_decay,
    )
    if weight_table.dtype != weight.dtype:
        if rounding is None:
            weight = weight.to(weight_table.dtype)  # round to nearest even
        else:
            weight = stochastic_round(weight, weight_table.dtype, *rounding)
    weight_table.index_copy_(0, rows, weight)
    for name, table in state_tables.items():
        table.index_copy_(0, rows, state[name])
    return clipped


@functools.lru_cache(maxsize=None)
def _compiled_gather_step_scatter() -> Callable[..., Tensor]:
    """:func:`gather_step_scatter_` through ``torch.compile``, one wrapper per process (its
    graphs are cached per signature, so every :class:`CompiledRowStep` shares them)."""
    # Dynamic: the touched-row count changes every step, tables differ in size, and
    # lr changes every step of a warm-up; none of them may cost a recompile. The
    # embedding dim is then marked static per call (_mark_embedding_dim_static).
    compiled: Callable[..., Tensor] = torch.compile(gather_step_scatter_, dynamic=True)
    return compiled


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


class CompiledRowStep:
    """:func:`gather_step_scatter_` compiled by TorchInductor (``torch.compile``); a
    failed compile raises, naming the error and ``TORCHREC_COWCLIP_COMPILE=0``."""

    def __repr__(self) -> str:
        return "CompiledRowStep()"

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        try:
            with recompile_limit_at_least(_RECOMPILE_LIMIT):
                _mark_embedding_dim_static((*args, *kwargs.values()))
                return _compiled_gather_step_scatter()(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - named in one line, never a silent fallback
            device = args[0].device.type if args and isinstance(args[0], Tensor) else "?"
            logger.debug("compiled row step failed", exc_info=True)
            raise RuntimeError(
                f"torchrec_cowclip: compiling the row step for {device} with TorchInductor "
                f"failed ({type(error).__name__}: {_first_line(error)}); set "
                f"{COMPILE_ENV}=0 for the eager update (same math, slower)"
            ) from error


def row_step(compiled: bool) -> Callable[..., Tensor]:
    """The row step with the choice made: :class:`CompiledRowStep` or, eager,
    :func:`gather_step_scatter_` itself (no frame in between).

    Example::

        >>> w = torch.zeros(4, 2); rows = torch.tensor([1, 3])
        >>> step = row_step(compiled=False)
        >>> _ = step(w, {}, rows, torch.ones(2, 2), torch.ones(2), optimizer="sgd",
        ...          lr=0.5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, cowclip=None)
        >>> w[:, 0].tolist()
        [0.0, -0.5, 0.0, -0.5]
    """
    return CompiledRowStep() if compiled else gather_step_scatter_


def _first_line(error: BaseException) -> str:
    """The first non-empty line of an error's message (compilers write pages)."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")

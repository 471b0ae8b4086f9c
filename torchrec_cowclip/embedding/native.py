"""The native CPU kernels of the fused update: build, load, call.

``torchrec_cowclip/csrc/cowclip_cpu.cpp`` holds torch custom ops (``torch.library``,
namespace ``torchrec_cowclip``): the stable radix grouping of looked-up rows, one fused
pass per table batch over the rows a batch touched (segment sum of their bag gradients,
finiteness, CowClip clip, coupled L2, Adam / row-wise Adagrad / SGD, write back, with the
next rows prefetched), a pooled lookup with float32 output for float16 / bfloat16 tables,
and the stochastic rounding of those tables. The math is :mod:`torchrec_cowclip.optim.functional`'s;
the tests hold the kernels to it (``tests/test_native.py``).

The kernels are built on first use with torch's own extension tooling
(``torch.utils.cpp_extension.load``: the C++ compiler TorchInductor needs at run time, and
ninja) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), under a name that includes the torch version and a hash of
this CPU's instruction-set flags (the build uses ``-march=native``), so every later process
on the machine loads the cached library in milliseconds. A build prints one line to stderr
before it starts and one when it ends (times: docs/performance.md).

Whether they run is :func:`~torchrec_cowclip.optim.row_step.compiled_update_mode`'s
choice (``TORCHREC_COWCLIP_COMPILE``): ``auto`` and ``1`` use them on CPU, ``0`` (eager) and
``inductor`` do not. In ``auto`` a failed build warns once, naming the error, and the CPU
update falls back to the Inductor-compiled (or eager) row step; in ``1`` it raises.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.optim.row_step import compiled_update_mode

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cowclip_cpu.cpp"

#: Compiler flags of the build: ``-ffp-contract=off`` keeps every product and sum rounded
#: as the functional core's separate torch ops round them (no fused multiply-adds the
#: reference does not have); ``-fno-math-errno`` lets ``sqrt`` vectorise.
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]

#: A build lock older than this is a killed build's, not a running one's.
STALE_LOCK_S = 600.0

#: Codes of the optimizers in the kernel (``Optimizer`` in the C++ source).
OPTIMIZER_CODES = {"adam": 0, "rowwise_adagrad": 1, "sgd": 2}

#: ``fused_update_``'s per-row status values.
UPDATED, CLIPPED, SKIPPED = 0, 1, 2

_lock = threading.Lock()
_loaded = False
_failure: Optional[str] = None


def _isa_tag() -> str:
    """Hash of what the built library depends on: torch's version, the compiler flags
    and this CPU's instruction-set flags (``-march=native``)."""
    flags = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    text = "|".join([torch.version.__version__, " ".join(CFLAGS), flags])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def extension_name() -> str:
    """The name of the library in torch's extension cache."""
    return f"torchrec_cowclip_cpu_{_isa_tag()}"


def build_directory() -> Path:
    """Where the library is built and cached (torch's extension cache)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / extension_name()


def _is_cached(directory: Path) -> bool:
    libraries = list(directory.glob("*.so"))
    return bool(libraries) and all(
        lib.stat().st_mtime >= SOURCE.stat().st_mtime for lib in libraries
    )


def _remove_stale_lock(directory: Path) -> None:
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        warnings.warn(
            f"torchrec_cowclip: removing a {age:.0f} s old build lock {lock} (a killed "
            "build's; torch's extension loader would wait on it forever)",
            RuntimeWarning,
            stacklevel=3,
        )
        lock.unlink(missing_ok=True)


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(directory)
    cached = _is_cached(directory)
    if not cached:
        print(
            f"torchrec_cowclip: building the native CPU update (first use with this torch "
            f"and CPU; cached in {directory}) ...",
            file=sys.stderr,
            flush=True,
        )
    start = time.perf_counter()
    path = os.environ.get("PATH", "")
    # ninja from the environment's own bin directory (the pip package), found without
    # an activated venv.
    extra = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found, import-untyped, unused-ignore]

        extra.append(str(ninja.BIN_DIR))
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join([*extra, path])
    try:
        cpp_extension.load(
            name=extension_name(),
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    finally:
        os.environ["PATH"] = path
    elapsed = time.perf_counter() - start
    if not cached:
        print(
            f"torchrec_cowclip: native CPU update built in {elapsed:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    logger.info("native CPU update loaded from %s in %.2f s", directory, elapsed)


def load(required: bool) -> bool:
    """Builds (first use) and loads the kernels; True when they are usable.

    A failure is remembered for the process: with ``required`` it raises RuntimeError,
    otherwise it warns once and returns False.
    """
    global _loaded, _failure
    if _loaded:
        return True
    with _lock:
        if not _loaded and _failure is None:
            try:
                _build_and_load()
                _loaded = True
            except Exception as error:  # noqa: BLE001 - any build or load failure
                _failure = f"{type(error).__name__}: {str(error).strip().splitlines()[-1:]}"
                logger.debug("native CPU update failed to build", exc_info=True)
                if not required:
                    warnings.warn(
                        f"torchrec_cowclip: building the native CPU update failed "
                        f"({_failure}); the CPU update falls back to the compiled or eager "
                        "row step (same math, slower). TORCHREC_COWCLIP_COMPILE=0 skips "
                        "the attempt.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
    if not _loaded and required:
        raise RuntimeError(
            f"torchrec_cowclip: the native CPU update is required "
            f"(TORCHREC_COWCLIP_COMPILE=1) but could not be built: {_failure}"
        )
    return _loaded


def reset_failure() -> None:
    """Forgets a failed build, so the next :func:`load` tries again (tests)."""
    global _failure
    _failure = None


def _ops() -> Any:
    return torch.ops.torchrec_cowclip


# --- wrappers ----------------------------------------------------------------------------


def group_rows(
    row_ids: Tensor,
    bag_of_position: Tensor,
    num_rows: int,
    feature_starts: Optional[Tensor] = None,
    feature_rows: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(rows, counts, segment_offsets, order, sorted_bags)`` of ``row_ids`` (all int64):
    what a stable sort plus ``unique_consecutive`` give, from radix sorts.

    ``feature_starts`` (``[F + 1]``: where each feature's positions start) and
    ``feature_rows`` (``[F, 2]``: its first row and row count) let the features of each
    table sort on their own; an id outside its feature's rows raises."""
    result: Tuple[Tensor, Tensor, Tensor, Tensor, Tensor] = _ops().group_rows(
        row_ids.to(torch.int64),
        bag_of_position.to(torch.int64),
        int(num_rows),
        feature_starts,
        feature_rows,
    )
    return result


def fused_update_(
    weight: Tensor,
    state: List[Tensor],
    rows: Tensor,
    counts: Tensor,
    *,
    grad: Optional[Tensor],
    bag_gradients: Optional[Tensor],
    segment_offsets: Optional[Tensor],
    sorted_bags: Optional[Tensor],
    sorted_weights: Optional[Tensor],
    row_offsets: Tensor,
    clip_enabled: Optional[Tensor],
    adam_bias: Optional[Tuple[Tensor, Tensor]],
    row_sums: Optional[Tensor],
    rounding: Optional[Tensor],
    optimizer: str,
    lr: float,
    betas: Tuple[float, float],
    eps: float,
    weight_decay: float,
    clip: Optional[Tuple[float, float]],
    count_lr: Optional[Tuple[float, float]],
) -> Tuple[Tensor, Tensor]:
    """One fused step in place on ``weight`` and ``state``; returns ``(status [U] int8,
    per_table [3, T] int64)`` (updated, clipped, skipped as non-finite).

    The rows' gradients are ``grad`` (``[U, D]``), or the segment sums of
    ``bag_gradients`` rows ``sorted_bags[segment_offsets[u]:segment_offsets[u + 1]]``
    (times ``sorted_weights``), in input order; ``row_sums`` is the
    ``[U, 5]`` whole-row sums of column shards (nonfinite, grad_sq, weight_sq,
    grad_dot_weight, dim); ``rounding`` the ``[T, 4]`` int64 (seed, step, row base,
    column base) of each table for float16 / bfloat16 weights."""
    if bag_gradients is not None:
        source = bag_gradients
        seg: Tuple[Optional[Tensor], ...] = (segment_offsets, sorted_bags, sorted_weights)
    else:
        assert grad is not None
        source, seg = grad, (None, None, None)
    state0 = state[0] if len(state) > 0 else None
    state1 = state[1] if len(state) > 1 else None
    bias1, bias2 = adam_bias if adam_bias is not None else (None, None)
    r, zeta = clip if clip is not None else (1.0, 0.0)
    power, cap = count_lr if count_lr is not None else (0.0, 1.0)
    result: Tuple[Tensor, Tensor] = _ops().fused_update_(
        weight,
        state0,
        state1,
        rows,
        counts,
        source.contiguous(),
        *seg,
        row_offsets,
        clip_enabled,
        bias1,
        bias2,
        row_sums,
        rounding,
        OPTIMIZER_CODES[optimizer],
        float(lr),
        float(betas[0]),
        float(betas[1]),
        float(eps),
        float(weight_decay),
        clip is not None,
        float(r),
        float(zeta),
        float(power),
        float(cap),
    )
    return result


def pooled_lookup(
    weight: Tensor, ids: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor], mean: bool
) -> Tensor:
    """``[bags, D]`` float32 sum (or mean) pooled rows of ``weight`` (float32, float16 or
    bfloat16), accumulated in float32."""
    out: Tensor = _ops().pooled_lookup(weight, ids, offsets, per_sample_weights, mean)
    return out


def rounding_row_keys(seed: Tensor, step: Tensor, global_row: Tensor) -> Tensor:
    """The kernel's :func:`~torchrec_cowclip.optim.functional.rounding_row_keys`."""
    out: Tensor = _ops().rounding_row_keys(seed, step, global_row)
    return out


def stochastic_round(
    values: Tensor, dtype: torch.dtype, row_keys: Tensor, column_base: Tensor
) -> Tensor:
    """The kernel's :func:`~torchrec_cowclip.optim.functional.stochastic_round`."""
    out: Tensor = _ops().stochastic_round(values, row_keys, column_base, dtype)
    return out


def use_native_update(device: torch.device) -> bool:
    """Whether table batches on ``device`` are grouped and updated by the native CPU
    kernels (built on first use): on CPU in modes ``auto`` and ``1``."""
    if device.type != "cpu":
        return False
    mode = compiled_update_mode()
    if mode not in ("auto", "1"):
        return False
    return load(required=mode == "1")

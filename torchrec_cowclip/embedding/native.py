"""The native CPU kernels of the fused update: build, load, call.

``torchrec_cowclip/csrc/cowclip_cpu.cpp`` holds torch custom ops (``torch.library``,
namespace ``torchrec_cowclip``): the stable radix grouping of looked-up rows, one fused
pass per table batch over the rows a batch touched (segment sum of their bag gradients,
finiteness, CowClip clip, coupled L2, Adam / row-wise Adagrad / SGD, write back, with the
next rows prefetched), a pooled lookup with float32 output for float16 / bfloat16 tables,
and the stochastic rounding of those tables. The math is :mod:`torchrec_cowclip.optim.functional`'s;
the tests hold the kernels to it (``tests/test_native.py``). Every op checks its indices
before it reads or writes through them (one ``TORCH_CHECK`` each, linear in the offsets
and rows), and has a fake (meta) kernel registered here, so ``torch.compile`` and
compiled autograd can trace calls to it.

The kernels are built with torch's own extension tooling (``torch.utils.cpp_extension.load``:
the C++ compiler TorchInductor needs at run time, and ninja) into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), under a name that
includes a hash of the C++ source, the torch version, the compiler flags and this CPU's
instruction-set flags (the build uses ``-march=native``): an edited source never shares
a library with another, every checkout of the same source shares one (it is compiled from
a copy in its own directory, so each checkout's build reads as up to date), and every later
process on the machine loads the cached one in milliseconds. :func:`build` runs once per process, when the first table batch that uses
the kernels is built (:class:`~torchrec_cowclip.embedding.row_kernels.NativeCpuKernel`), never
inside a backward; a build prints one line to stderr before it starts and one when it ends
(times: docs/performance.md).

Whether they run is the row kernel's choice (:mod:`torchrec_cowclip.embedding.row_kernels`,
``TORCHREC_COWCLIP_COMPILE``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from torchrec_cowclip import compat

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cowclip_cpu.cpp"

#: Compiler flags of the build: ``-ffp-contract=off`` keeps every product and sum rounded
#: as the functional core's separate torch ops round them (no fused multiply-adds the
#: reference does not have); ``-fno-math-errno`` lets ``sqrt`` vectorise.
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]

#: A build lock older than this is a killed build's, not a running one's.
STALE_LOCK_S = 600.0

#: Codes of the optimizers in the kernel (``Optimizer`` in the C++ source).
OPTIMIZER_CODES = {"adam": 0, "rowwise_adagrad": 1, "sgd": 2, "adagrad": 3, "adamw": 4}

#: ``fused_update_``'s per-row status values.
UPDATED, CLIPPED, SKIPPED = 0, 1, 2


def build_flags() -> List[str]:
    """:data:`CFLAGS` and the optional dependencies found in this torch: FBGEMM's
    ``radix_sort_parallel`` from libtorch_cpu
    (:func:`~torchrec_cowclip.compat.fbgemm_radix_sort_available`), used for a large
    grouping of one row range when present, else the kernels' own radix sort."""
    radix = 1 if compat.fbgemm_radix_sort_available() else 0
    return [*CFLAGS, f"-DCOWCLIP_FBGEMM_RADIX_SORT={radix}"]


def _isa_tag() -> str:
    """Hash of what the built library depends on: its C++ source, torch's version, the
    compiler flags and this CPU's instruction-set flags (``-march=native``)."""
    flags = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    source = hashlib.sha1(SOURCE.read_bytes()).hexdigest()
    text = "|".join([source, torch.version.__version__, " ".join(build_flags()), flags])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def extension_name() -> str:
    """The name of the library in torch's extension cache (see the module docstring)."""
    return f"torchrec_cowclip_cpu_{_isa_tag()}"


def build_directory() -> Path:
    """Where the library is built and cached (torch's extension cache)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / extension_name()


def _source_copy(directory: Path) -> Path:
    """The C++ source the build compiles: a copy in the library's own directory.

    torch's loader writes the source's path into the directory's ``build.ninja`` and ninja
    rebuilds when that text changes; compiled from the package itself, two checkouts of the
    same source (a clone and a ``git worktree``, a sweep run from another checkout) would
    rebuild the shared library for each other's path on every alternation, and a process
    could replace it while another one loads it. The directory's name hashes the source, so
    the copy is written once, atomically, and never changes afterwards.
    """
    copy = directory / SOURCE.name
    text = SOURCE.read_bytes()
    if not copy.is_file() or copy.read_bytes() != text:
        part = copy.with_name(f"{copy.name}.{os.getpid()}.part")
        part.write_bytes(text)
        os.replace(part, copy)
    return copy


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
    # The name hashes the source, so a library in its directory is this source's.
    cached = any(directory.glob("*.so"))
    if not cached:
        print(
            f"torchrec_cowclip: building the native CPU update (first use with this source, "
            f"torch and CPU; cached in {directory}) ...",
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
            sources=[str(_source_copy(directory))],
            extra_cflags=build_flags(),
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


@dataclass(frozen=True)
class NativeBuild:
    """What building and loading the kernels gave in this process.

    Attributes:
        error: None when the ops are loaded; else why not, in one line.
    """

    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None


def one_line(error: BaseException) -> str:
    """``Type: message`` of a build or load failure in one line: the first line that
    names an error (a compiler's ``error:``), else the last non-empty one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "error" in line.lower()]
    text = (named[0] if named else lines[-1]) if lines else ""
    return f"{type(error).__name__}: {text[:400]}"


@functools.lru_cache(maxsize=None)
def build() -> NativeBuild:
    """Builds (first use on this machine) and loads the kernels, once per process; a
    failure is kept, not retried (the kernels' owner decides what it means)."""
    try:
        _build_and_load()
        _register_fake_kernels()
    except Exception as error:  # noqa: BLE001 - any build or load failure
        logger.debug("native CPU update failed to build", exc_info=True)
        return NativeBuild(one_line(error))
    return NativeBuild()


def _ops() -> Any:
    return torch.ops.torchrec_cowclip


def _register_fake_kernels() -> None:
    """Fake (meta) kernels of the ops: output shapes and types without running them, for
    ``torch.compile``, compiled autograd and ``torch.library.opcheck``."""
    from torch.library import get_ctx, register_fake

    def fake_group_rows(row_ids: Tensor, *_: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        unique = get_ctx().new_dynamic_size()
        positions = row_ids.shape[0]

        def longs(n: Any) -> Tensor:
            return row_ids.new_empty((n,), dtype=torch.int64)

        return longs(unique), longs(unique), longs(unique + 1), longs(positions), longs(positions)

    def fake_fused_update(*arguments: Any) -> Tuple[Tensor, Tensor]:
        # The schema's order (update_arguments): rows 4th, row_offsets 10th.
        rows, row_offsets = arguments[3], arguments[9]
        status = rows.new_empty(rows.shape, dtype=torch.int8)
        per_table = rows.new_empty((3, row_offsets.shape[0] - 1), dtype=torch.int64)
        return status, per_table

    def fake_pooled_lookup(
        weight: Tensor,
        ids: Tensor,
        offsets: Tensor,
        per_sample_weights: Optional[Tensor],
        mean: bool,
    ) -> Tensor:
        return weight.new_empty((offsets.shape[0] - 1, weight.shape[1]), dtype=torch.float32)

    def fake_rounding_row_keys(seed: Tensor, step: Tensor, global_row: Tensor) -> Tensor:
        return torch.empty_like(global_row)

    def fake_stochastic_round(
        values: Tensor, row_keys: Tensor, column_base: Tensor, dtype: torch.dtype
    ) -> Tensor:
        return values.new_empty(values.shape, dtype=dtype)

    for name, fake in (
        ("group_rows", fake_group_rows),
        ("fused_update_", fake_fused_update),
        ("pooled_lookup", fake_pooled_lookup),
        ("rounding_row_keys", fake_rounding_row_keys),
        ("stochastic_round", fake_stochastic_round),
    ):
        register_fake(f"torchrec_cowclip::{name}", fake)


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


def fused_update_(*arguments: Any) -> Tuple[Tensor, Tensor]:
    """One fused step in place (the op ``torchrec_cowclip::fused_update_``, arguments as
    :func:`update_arguments` lays them out); returns ``(status [U] int8, per_table [3, T]
    int64)``: per row updated, clipped or skipped as non-finite, and their counts per table."""
    result: Tuple[Tensor, Tensor] = _ops().fused_update_(*arguments)
    return result


def update_arguments(
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
) -> Tuple[Any, ...]:
    """The arguments of :func:`fused_update_` (the op's schema), which the Triton kernels take
    too (:func:`.triton_ops.fused_update_`), from one step's inputs by name.

    The rows' gradients are ``grad`` (``[U, D]``), or the segment sums of
    ``bag_gradients`` rows ``sorted_bags[segment_offsets[u]:segment_offsets[u + 1]]``
    (times ``sorted_weights``), in input order; ``row_sums`` is the ``[U, 5]`` whole-row
    sums of column shards (nonfinite, grad_sq, weight_sq, grad_dot_weight, dim);
    ``rounding`` the ``[T, 4]`` int64 (seed, step, row base, column base) of each table for
    float16 / bfloat16 weights; ``clip`` ``(r, zeta)`` or None; ``count_lr``
    ``(power, cap)`` or None."""
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
    return (
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

"""The Triton kernels compiled ahead of time for a GPU that is not here, with ``ptxas``'s
resource report: registers, spilled bytes and shared memory of every specialization the
project launches, on sm_90a (H100/H200) and sm_80 (A100).

Triton's interpreter (how ``make test`` runs the kernels without a GPU) accepts code that
Triton's compiler rejects, and says nothing about registers. Triton compiles for a named
target without a device: :func:`compile_launches` replaces the active driver by one that
names the target, compiles each specialization down to PTX and a cubin (the wheel ships
``ptxas``) and runs ``ptxas -v`` on the PTX. The specializations come from the host code
itself: :func:`record_launches` runs :mod:`.triton_ops`' calls over a matrix of dims,
dtypes, rules and options with :func:`.triton_ops.recording_launches` (the kernels are
not run), so what is compiled is what a GPU would be asked to compile.

The compile runs in a child process (this module's ``__main__``): the kernels of a
process are interpreted or compiled for good once defined, and the tests' process
interprets them. Triton caches what it compiles under its cache key (the kernels' source,
the target and the options), so an unchanged kernel is not compiled twice, and a change
is. ``benchmarks/triton_compile.py`` prints the table; ``tests/test_triton_compile.py``
holds the bounds (:data:`MAX_REGISTERS`, no spills, no failure).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from torchrec_cowclip.embedding import triton_ops
from torchrec_cowclip.embedding.native import OPTIMIZER_CODES
from torchrec_cowclip.optim.rules import update_rule

__all__ = [
    "ARCHES",
    "MAX_REGISTERS",
    "Build",
    "Specialization",
    "compile_launches",
    "record_launches",
    "specializations",
]

#: The targets compiled for: name, compute capability, shared memory per SM (bytes).
ARCHES = {"sm_90a": (90, 233472), "sm_80": (80, 167936)}

#: Registers per thread at most: 4 blocks of 4 warps per SM (25% occupancy), what a
#: memory-bound kernel needs to keep enough loads in flight.
MAX_REGISTERS = 128

_REGISTERS_PER_SM = 65536
_WARPS_PER_SM = 64
_BLOCKS_PER_SM = 32

#: Ints as Triton specializes them: 1, a multiple of 16, another value (i32 or i64).
_INT_CLASSES = (1, 16, 17, 2**31 + 16, 2**31 + 17)


def _int_class(value: int) -> int:
    if value == 1:
        return 1
    wide = not -(2**31) <= value < 2**31
    return (2**31 if wide else 0) + (16 if value % 16 == 0 else 17)


@dataclasses.dataclass(frozen=True)
class Specialization:
    """One compiled variant of a kernel: its name, each argument as Triton specializes it
    (``("*", dtype, aligned)`` a pointer, ``("i", class)`` an int, ``("f",)`` a float,
    ``("hyper",)`` the update's hyperparameters) and its compile-time constants."""

    kernel: str
    args: Tuple[Tuple[Any, ...], ...]
    constants: Tuple[Tuple[str, Any], ...]

    @staticmethod
    def of(kernel: str, args: Sequence[Any], constants: Dict[str, Any]) -> "Specialization":
        described: List[Tuple[Any, ...]] = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                aligned = arg.data_ptr() % 16 == 0
                described.append(("*", str(arg.dtype).replace("torch.", ""), aligned))
            elif isinstance(arg, bool):
                described.append(("i", int(arg)))
            elif isinstance(arg, int):
                described.append(("i", _int_class(arg)))
            elif isinstance(arg, float):
                described.append(("f",))
            elif isinstance(arg, triton_ops.UpdateHyperparameters):
                described.append(("hyper",))
            else:
                raise TypeError(f"{kernel}: cannot describe argument {arg!r}")
        return Specialization(kernel, tuple(described), tuple(sorted(constants.items())))

    @property
    def label(self) -> str:
        """The kernel and its constants, as the table prints them."""
        shown = ", ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constants)
        return f"{self.kernel}({shown})"


@dataclasses.dataclass(frozen=True)
class Build:
    """One specialization compiled for one target: ``error`` (its first line) when it did
    not compile, else ptxas's registers per thread and spilled bytes, Triton's shared
    memory and warps, and the blocks that fit on one SM."""

    specialization: Specialization
    arch: str
    error: Optional[str] = None
    registers: int = 0
    spill_bytes: int = 0
    shared: int = 0
    num_warps: int = 0

    @property
    def blocks_per_sm(self) -> int:
        if self.error is not None:
            return 0
        regs_per_warp = -(-max(self.registers, 1) * 32 // 256) * 256
        by_registers = (_REGISTERS_PER_SM // regs_per_warp) // self.num_warps
        by_shared = ARCHES[self.arch][1] // self.shared if self.shared else _BLOCKS_PER_SM
        return min(by_registers, _WARPS_PER_SM // self.num_warps, _BLOCKS_PER_SM, by_shared)

    def problems(self, max_registers: int = MAX_REGISTERS) -> List[str]:
        """What breaks the bounds, one line each (empty: none)."""
        where = f"{self.specialization.label} on {self.arch}"
        if self.error is not None:
            return [f"{where}: does not compile: {self.error}"]
        found = []
        if self.spill_bytes:
            found.append(f"{where}: {self.spill_bytes} bytes spilled")
        if self.registers > max_registers:
            found.append(f"{where}: {self.registers} registers (bound {max_registers})")
        return found


# --- recording ------------------------------------------------------------------------------


def specializations(launches: Iterable[triton_ops.Launch]) -> List[Specialization]:
    """The distinct specializations of recorded launches, in first-seen order."""
    seen: Dict[Specialization, None] = {}
    for kernel, _grid, args, constants in launches:
        seen.setdefault(Specialization.of(kernel, args, constants))
    return list(seen)


def record_launches(
    dims: Sequence[int],
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16),
    rules: Sequence[str] = triton_ops.OPTIMIZERS,
    options: bool = True,
) -> List[Specialization]:
    """Every specialization :mod:`.triton_ops` launches over ``dims`` x ``dtypes`` x
    ``rules``: the pooled lookup (SUM, MEAN, per-sample weights, whole or a KJT's slice,
    batch-major), the ids' mapping (int32 and int64 ids), the fused update (segments with a
    row of many positions, weighted, or one gradient per row; the clip on all tables or
    some, without the clip; CountLR; a column shard's row sums; a padded grouping; a half
    table rounded to nearest, ``stochastic_rounding=False``) and the rounding. The options are recorded on float32 tables (a half table's kernels differ
    in the store alone); ``options=False``: the plain variants only (SUM lookups; the
    update over segments with the clip). Nothing runs on a device: the launches are recorded, not
    executed."""
    with triton_ops.recording_launches(execute=False) as launches:
        for ids_dtype in (torch.int32, torch.int64):
            triton_ops.prepare_rows(
                torch.zeros(8, dtype=ids_dtype),
                torch.arange(9, dtype=torch.int64),
                torch.tensor([[0, 4], [4, 4]], dtype=torch.int64),
                batch_size=4,
            )
        for dim in dims:
            for dtype in dtypes:
                wide = options and dtype == torch.float32
                _record_pool(dim, dtype, wide)
                for rule in rules:
                    _record_update(dim, dtype, rule, wide)
            triton_ops.rounding_row_keys(torch.zeros(3), torch.zeros(3), torch.arange(3))
    return specializations(launches)


def _record_pool(dim: int, dtype: torch.dtype, options: bool) -> None:
    weight = torch.zeros(16, dim, dtype=dtype)
    ids = torch.zeros(12, dtype=torch.int64)
    offsets = torch.tensor([0, 3, 6, 9, 12])
    psw = torch.ones(12)
    for per_sample, mean in ((None, False), (psw, False), (None, True))[: 3 if options else 1]:
        triton_ops.pooled_lookup(weight, ids, offsets, per_sample, mean)
        out = torch.empty(2, dim)
        triton_ops.pool_into(out, weight, ids, offsets[2:], per_sample, mean, False, 2)


def _record_update(dim: int, dtype: torch.dtype, rule: str, options: bool) -> None:
    code = OPTIMIZER_CODES[rule]
    rows = torch.arange(4, dtype=torch.int64)
    layout = update_rule(rule).state_layout
    state = [torch.zeros(8 * dim if per == "D" else 8) for _, per in layout]
    state0 = state[0] if state else None
    state1 = state[1] if len(state) > 1 else None
    bias = torch.ones(2) if update_rule(rule).adam_bias_corrections else None
    rounding = None if dtype == torch.float32 else torch.zeros(8, dtype=torch.int64)
    hot = triton_ops.HOT_CHUNK * 3
    counts = torch.tensor([1, hot, 1, 1])
    segment_offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), counts]), 0)
    bags = torch.zeros(int(counts.sum()), dtype=torch.int64)
    grad = torch.zeros(4, dim)

    def run(**changes: Any) -> None:
        call: Dict[str, Any] = dict(
            weight=torch.zeros(8, dim, dtype=dtype),
            state0=state0,
            state1=state1,
            rows=rows,
            counts=counts,
            grad=grad,
            segment_offsets=segment_offsets,
            sorted_bags=bags,
            sorted_weights=None,
            row_offsets=torch.tensor([0, 4, 8]),
            clip_enabled=None,
            bias1=bias,
            bias2=bias,
            row_sums=None,
            rounding=rounding,
            optimizer=code,
            lr=0.1,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            clip=True,
            r=1.0,
            zeta=1e-3,
            count_lr_power=0.0,
            count_lr_cap=1.0,
            num_valid=None,
            gate=None,
        )
        call.update(changes)
        triton_ops.fused_update_padded_(**call)

    run()
    if dtype != torch.float32:
        run(rounding=None)  # stochastic_rounding=False: round to nearest
    if not options:
        return
    run(sorted_weights=torch.ones(bags.numel()))
    run(clip=False)
    run(clip_enabled=torch.tensor([True, False]), count_lr_power=0.5, count_lr_cap=4.0)
    run(num_valid=torch.tensor([3]), gate=torch.zeros(1, dtype=torch.int32))
    run(segment_offsets=None, sorted_bags=None, row_sums=torch.zeros(20))
    run(segment_offsets=None, sorted_bags=None)
    if dtype != torch.float32:
        values = torch.zeros(2, dim)
        triton_ops.stochastic_round(values, dtype, torch.zeros(2), torch.zeros(2))


# --- compiling ------------------------------------------------------------------------------


#: The module whose ``@triton.jit`` kernels the specializations name.
KERNELS = "torchrec_cowclip.embedding.triton_kernels"


def compile_launches(
    specs: Sequence[Specialization],
    arches: Sequence[str] = tuple(ARCHES),
    jobs: int = 1,
    module: str = KERNELS,
) -> List[Build]:
    """Compiles each specialization (a kernel of ``module``) for each target in ``jobs``
    child processes (without ``TRITON_INTERPRET``); one :class:`Build` per pair, in order
    (specializations outer)."""
    work = [(spec, arch) for spec in specs for arch in arches]
    if not work:
        return []
    env = {k: v for k, v in os.environ.items() if k != triton_ops.INTERPRET_ENV}
    shares = [work[i::jobs] for i in range(max(1, jobs))]
    children = []
    for share in shares:
        if not share:
            continue
        payload = json.dumps([[dataclasses.asdict(spec), arch] for spec, arch in share])
        child = subprocess.Popen(
            [sys.executable, "-m", __name__, module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdin is not None
        child.stdin.write(payload)
        child.stdin.close()
        children.append((share, child))
    results: Dict[Tuple[Specialization, str], Build] = {}
    for share, child in children:
        assert child.stdout is not None and child.stderr is not None
        out = child.stdout.read()
        err = child.stderr.read()
        if child.wait() != 0:
            raise RuntimeError(f"triton_build: the compiling process failed: {err.strip()[-2000:]}")
        for (spec, arch), built in zip(share, json.loads(out)):
            results[(spec, arch)] = Build(spec, arch, **built)
    return [results[pair] for pair in work]


class _Pointer:
    """A pointer argument for a compile without a device: its dtype and alignment."""

    def __init__(self, dtype: torch.dtype, aligned: bool) -> None:
        self.dtype = dtype
        self._address = 0 if aligned else 4

    def data_ptr(self) -> int:
        return self._address


def _argument(described: Sequence[Any]) -> Any:
    kind = described[0]
    if kind == "*":
        return _Pointer(getattr(torch, described[1]), bool(described[2]))
    if kind == "i":
        return int(described[1])
    if kind == "f":
        return 0.5
    if kind == "hyper":
        fields = triton_ops.UpdateHyperparameters._fields
        return triton_ops.UpdateHyperparameters(*([0.5] * len(fields)))
    raise ValueError(f"unknown argument {described!r}")


class _TargetDriver:
    """Stands in for the CUDA driver: names the target, owns no device."""

    def __init__(self, capability: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return int(self.target.arch)

    def get_current_stream(self, device: Optional[int] = None) -> int:
        return 0


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _first_line(error: BaseException) -> str:
    """The innermost message of a compile failure, in one line (Triton's
    CompilationError repeats the source; its cause says what failed)."""
    while error.__cause__ is not None:
        error = error.__cause__
    message = getattr(error, "error_message", None) or str(error)
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


def _compile_one(kernels: Any, spec: Specialization, arch: str, ptxas: str) -> Dict[str, Any]:
    from triton.runtime import driver

    driver.set_active(_TargetDriver(ARCHES[arch][0]))
    args = [_argument(a) for a in spec.args]
    try:
        compiled = getattr(kernels, spec.kernel).run(
            *args, grid=(1,), warmup=True, **dict(spec.constants)
        )
    except Exception as error:  # noqa: BLE001 - every failure is a row of the table
        return {"error": _first_line(error)}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as source:
        source.write(compiled.asm["ptx"])
    try:
        report = subprocess.run(
            [ptxas, "-v", f"--gpu-name={arch}", source.name, "-o", os.devnull],
            capture_output=True,
            text=True,
        )
    finally:
        os.unlink(source.name)
    if report.returncode != 0:
        return {"error": f"ptxas: {report.stderr.strip().splitlines()[-1:]}"}
    registers = _PTXAS_REGISTERS.search(report.stderr)
    spills = _PTXAS_SPILLS.findall(report.stderr)
    return {
        "registers": int(registers.group(1)) if registers else 0,
        "spill_bytes": sum(int(stores) + int(loads) for stores, loads in spills),
        "shared": int(compiled.metadata.shared),
        "num_warps": int(compiled.metadata.num_warps),
    }


def _main() -> None:
    """The child of :func:`compile_launches`: work as JSON on stdin, results on stdout."""
    import importlib

    import triton

    kernels = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else KERNELS)

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    work = json.load(sys.stdin)
    results = []
    for described, arch in work:
        spec = Specialization(
            described["kernel"],
            tuple(tuple(a) for a in described["args"]),
            tuple(tuple(c) for c in described["constants"]),
        )
        results.append(_compile_one(kernels, spec, arch, ptxas))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    _main()

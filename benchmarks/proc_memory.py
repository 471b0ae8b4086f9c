"""Memory figures the benchmarks report besides their timings: a process's peak RSS
(``VmHWM``, measured in a child process per variant) and optimizer-state bytes."""

from __future__ import annotations

import json
import subprocess
from typing import Any, Dict, Iterable, List, Optional


def vm_hwm_kib() -> int:
    """Peak resident set size of this process so far, KiB (-1 where /proc lacks it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def child_memory(cmd: List[str]) -> Dict[str, Any]:
    """Runs a benchmark's memory child, whose last stdout line is a JSON object with
    ``before_kib`` and ``peak_kib``; adds ``peak_mib`` and ``delta_mib`` (the peak over
    the child's peak before it built the variant), or returns ``{"error": ...}``."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["delta_mib"] = (result["peak_kib"] - result["before_kib"]) / 1024
    result["peak_mib"] = result["peak_kib"] / 1024
    return result


def optimizer_state_bytes(optimizer: Any, params: Optional[Iterable[Any]] = None) -> int:
    """Bytes of the tensors in ``optimizer.state`` (of ``params`` only, if given)."""
    import torch

    keep = None if params is None else {id(p) for p in params}
    total = 0
    for param, state in optimizer.state.items():
        if keep is not None and id(param) not in keep:
            continue
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total

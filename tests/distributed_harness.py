"""Runs a function on N local CPU ranks (gloo on 127.0.0.1) with bounded time.

Every rank joins a process group whose collectives time out after ``pg_timeout_s``, and
a job is killed after ``timeout_s``: a failing, dying or stuck rank can never hang the
test suite. A rank that raises writes its traceback to a file and exits with code 1,
so the test can tell which rank failed and why.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

#: Default bound on any one collective of a test job.
PG_TIMEOUT_S = 30.0


class JobFailed(RuntimeError):
    """A rank failed or the job ran out of time; the message has the rank's traceback."""


@dataclass
class RankResult:
    rank: int
    exitcode: Optional[int]  # None: still running when the job was stopped
    error: str  # traceback text of a rank that raised, else ""
    seconds: float  # from the job's start to this rank's exit


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world_size: int,
    port: int,
    pg_timeout_s: float,
    error_file: str,
    fn: Callable[..., None],
    args: Sequence[Any],
) -> None:
    import torch
    import torch.distributed as dist

    from torchrec_cowclip import compat

    # Two cores for all ranks: one intra-op thread each keeps them from fighting.
    torch.set_num_threads(1)
    # Before the group exists, so that destroy_process_group ends its threads (a thread
    # alive when the interpreter finalizes can abort the rank's exit).
    compat.import_modules_holding_the_default_group()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything, then die without cleanup
        with open(error_file, "w") as f:
            f.write(traceback.format_exc())
        # Peers may be gone: skip the process group's teardown, which could wait on them.
        os._exit(1)


def start_ranks(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    pg_timeout_s: float = PG_TIMEOUT_S,
) -> "Job":
    """Starts ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    error_dir = tempfile.mkdtemp(prefix="cowclip-dist-")
    processes = [
        ctx.Process(
            target=_entry,
            args=(
                rank,
                world_size,
                port,
                pg_timeout_s,
                os.path.join(error_dir, f"rank{rank}.txt"),
                fn,
                args,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    return Job(processes, error_dir, time.monotonic())


class Job:
    """Running ranks; :meth:`wait` collects how each one ended."""

    def __init__(self, processes: List[Any], error_dir: str, started: float) -> None:
        self.processes = processes
        self.error_dir = error_dir
        self.started = started

    def wait(self, timeout_s: float, ranks: Optional[Sequence[int]] = None) -> List[RankResult]:
        """Waits up to ``timeout_s`` for ``ranks`` (default all) to exit, then kills every
        rank still alive. Returns every rank's result."""
        watched = list(range(len(self.processes))) if ranks is None else list(ranks)
        deadline = self.started + timeout_s
        ended: dict = {}
        while time.monotonic() < deadline and any(r not in ended for r in watched):
            for r, p in enumerate(self.processes):
                if r not in ended and not p.is_alive():
                    ended[r] = time.monotonic() - self.started
            time.sleep(0.05)
        for r, p in enumerate(self.processes):
            if r not in ended and not p.is_alive():
                ended[r] = time.monotonic() - self.started
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(10)
        results = []
        for r, p in enumerate(self.processes):
            path = os.path.join(self.error_dir, f"rank{r}.txt")
            error = open(path).read() if os.path.exists(path) else ""
            exitcode = p.exitcode if r in ended else None
            results.append(RankResult(r, exitcode, error, ended.get(r, float("inf"))))
        return results


def run_ranks(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = PG_TIMEOUT_S,
) -> None:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks; raises
    :class:`JobFailed` with the failing rank's traceback if any rank fails or the job
    exceeds ``timeout_s`` (a rank failing stops the job at once)."""
    job = start_ranks(fn, world_size, *args, pg_timeout_s=pg_timeout_s)
    deadline = job.started + timeout_s
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in job.processes]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.05)
    results = job.wait(timeout_s=0.0)
    failed = [r for r in results if r.exitcode not in (0,)]
    if failed:
        first = next((r for r in failed if r.error), failed[0])
        what = "timed out" if first.exitcode is None else f"exited with code {first.exitcode}"
        raise JobFailed(f"rank {first.rank} {what} (job limit {timeout_s:.0f} s):\n{first.error}")


def plain(value: Any) -> Any:
    """``value`` as what ``torch.load(weights_only=True)`` reads: dataclasses (the
    project's options, e.g. ``CowClipOptions``) become dicts of their fields, sets
    sorted lists; containers recursively; tensors, numbers, strings and dtypes as they are."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value


def save_result(value: Any, path: str) -> None:
    """Saves a rank's result, :func:`plain`, for :func:`load_result`."""
    import torch

    torch.save(plain(value), path)


def load_result(path: str) -> Any:
    """What :func:`save_result` saved, read with ``weights_only=True``: a result file
    can never run code when read."""
    import torch

    return torch.load(path, weights_only=True)

"""A process that shards exits cleanly: ``destroy_process_group`` ends every gloo thread.

The exit crash (``terminate called without an active exception``, SIGABRT after a run of
``examples/dlrm_criteo.py``, once in four suites on a 2-core VM) was a gloo worker thread
alive during the interpreter's finalization: freeing a finished collective's tensors it
took the GIL of a finalizing interpreter, which ends the thread with a forced unwind
through a ``noexcept`` destructor (backtrace in docs/update_paths.md). The worker was alive
because the default process group outlived ``destroy_process_group``: TorchRec's
``apply_optimizer_in_backward`` first imports ``torch.distributed.optim`` after
``init_process_group``, and one of its functions takes ``group=dist.group.WORLD`` as a
default argument, which then holds the group for the life of the process
(:func:`torchrec_cowclip.compat.import_modules_holding_the_default_group`).

The crash is a race (a few exits in a hundred), so no repeat count the suite can afford
bounds it; these tests check the state that makes it impossible instead, deterministically:
after the teardown the example, the trainer and the test ranks run, no gloo thread is left.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="threads are read from /proc (Linux)"
)

#: The example's teardown, in one process: what it imports first, a process group, what
#: TorchRec does after init (``apply_optimizer_in_backward``, ``import torchrec``), a
#: collective, the destroy; then the threads left.
TEARDOWN = textwrap.dedent("""
    import gc, os, sys
    import torch
    if sys.argv[1] == "package":
        import torchrec_cowclip.distributed  # what examples/dlrm_criteo.py imports first
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if sys.argv[1] == "package":
        import torchrec
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec_cowclip.optim import CowClipAdam

        weight = torch.nn.Parameter(torch.zeros(4, 2))
        apply_optimizer_in_backward(CowClipAdam, [weight], {"lr": 0.1})
    else:  # what apply_optimizer_in_backward imports, alone
        import torch.distributed.optim
    dist.all_reduce(torch.ones(8))
    dist.destroy_process_group()
    gc.collect()
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print(",".join(sorted(n for n in names if "gloo" in n)) or "none")
""")


def _gloo_threads_after_teardown(first: str) -> str:
    run = subprocess.run(
        [sys.executable, "-c", TEARDOWN, first],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run.stdout.strip().splitlines()[-1]


def test_destroy_process_group_ends_every_gloo_thread():
    """The example's order (and the trainer's and the test ranks': the same early imports
    of :func:`~torchrec_cowclip.compat.import_modules_holding_the_default_group`)."""
    assert _gloo_threads_after_teardown("package") == "none"


def test_without_the_early_imports_the_group_outlives_its_destroy():
    """The check above can fail: torch alone first, and the gloo threads survive."""
    assert "pt_gloo_runloop" in _gloo_threads_after_teardown("torch")

"""``python -m torchrec_cowclip.sweep.cell ARGS``: one sweep cell's process, that is
``torchrec-cowclip train ARGS`` that dies with the sweep.

Before training it asks the kernel for a SIGTERM when its parent (the sweep) dies
(``PR_SET_PDEATHSIG``, Linux), on which ``train`` finishes its step, checkpoints and
stops, so that a killed sweep leaves no orphan training on and holding the cell's folder.
It is set here, in the new process, rather than between fork and exec, where only
async-signal-safe work is safe in a process that runs threads (numpy's, torch's).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import List, Optional

from torchrec_cowclip.sweep.runner import PARENT_PID
from torchrec_cowclip.train.cli import main


def die_with_parent(parent: Optional[int]) -> None:
    """SIGTERM to this process when its parent dies; if ``parent`` is already gone (the
    sweep died before this line), SIGTERM now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def run(argv: List[str]) -> int:
    parent = os.environ.get(PARENT_PID)
    die_with_parent(int(parent) if parent else None)
    return main(["train", *argv])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

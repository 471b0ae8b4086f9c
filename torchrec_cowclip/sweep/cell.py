"""``python -m torchrec_cowclip.sweep.cell CELL_DIR``: one sweep cell's process, that is
``train(config)`` with the config stored in ``CELL_DIR/cell.json`` by the sweep, run as
``torchrec-cowclip train`` runs it (:func:`~torchrec_cowclip.train.command.run_train`:
the same lines, summary and exit statuses), in a process that dies with the sweep.

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
from pathlib import Path
from typing import Optional

from torchrec_cowclip.process_context import ProcessContext
from torchrec_cowclip.stderr_log import package_log_shown
from torchrec_cowclip.sweep.runner import CELL_RECORD, PARENT_PID, read_json
from torchrec_cowclip.train.command import exiting_on_failure, run_train
from torchrec_cowclip.train.config import TrainConfig


def die_with_parent(parent: Optional[int]) -> None:
    """SIGTERM to this process when its parent dies; if ``parent`` is already gone (the
    sweep died before this line), SIGTERM now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def run(cell: Path) -> int:
    """Trains the cell in ``cell`` from its ``cell.json`` (the attempt's config)."""
    parent = os.environ.get(PARENT_PID)
    die_with_parent(int(parent) if parent else None)
    with exiting_on_failure("train"):  # a launcher's variable that is no number: one line
        process = ProcessContext.from_environment()
    with package_log_shown(process.rank):
        with exiting_on_failure("train"):
            record = read_json(cell / CELL_RECORD) or {}
            settings = TrainConfig.from_dict(record["config"]).resolve(process)
        return run_train(settings)


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))

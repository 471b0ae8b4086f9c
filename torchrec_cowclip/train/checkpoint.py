"""Atomic checkpoints: a crash while writing leaves the previous checkpoint intact.

The file is written next to its destination and moved into place with ``os.replace``,
which is atomic on POSIX file systems; a reader sees either the old or the new file.

Example::

    >>> path = Path(tempfile.mkdtemp()) / "run" / "checkpoint.pt"
    >>> save_checkpoint({"step": 3}, path)
    >>> load_checkpoint(path)["step"]
    3
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Union

import torch


def save_checkpoint(payload: Dict[str, Any], path: Union[str, Path]) -> None:
    """Writes ``payload`` with ``torch.save`` to a temporary file, fsyncs, then renames."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: Union[str, Path]) -> Dict[str, Any]:
    """Loads a checkpoint written by :func:`save_checkpoint`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    # Our own files: they hold optimizer configs (CowClip dataclasses), not only tensors.
    return torch.load(path, map_location="cpu", weights_only=False)

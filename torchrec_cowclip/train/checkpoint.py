"""Atomic checkpoints: a crash while writing leaves the previous checkpoint intact.

The file is written next to its destination and moved into place with ``os.replace``,
which is atomic on POSIX file systems; a reader sees either the old or the new file.

Example::

    >>> save_checkpoint({"step": 3}, "runs/x/checkpoint.pt")
    >>> load_checkpoint("runs/x/checkpoint.pt")["step"]
    3
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch


class NonFiniteStateError(RuntimeError):
    """A checkpoint would hold NaN/inf tensors; it is not written (the previous one stays)."""


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


def nonfinite_tensors(state: Any, prefix: str = "") -> List[str]:
    """Dotted keys of the floating-point tensors in a nested state (dicts, lists,
    tuples) that hold a NaN or an inf.

    One reduction per tensor: the sum of a finite tensor is finite unless it overflows,
    so only a tensor whose sum is not finite is checked element-wise (which also clears
    a finite tensor whose sum overflowed).

    Example::

        >>> nonfinite_tensors({"model": {"w": torch.ones(2), "b": torch.tensor([float("nan")])}})
        ['model.b']
    """
    if isinstance(state, torch.Tensor):
        # Sharded tensors (ShardedTensor, DTensor): only this process's pieces are here.
        if hasattr(state, "local_shards"):
            pieces = [shard.tensor for shard in state.local_shards()]
        else:
            pieces = [state.to_local() if hasattr(state, "to_local") else state]
        for t in pieces:
            if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
                continue
            if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
                return [prefix or "<tensor>"]
        return []
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return []
    found: List[str] = []
    for key, value in items:
        found += nonfinite_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    return found


def require_finite(payload: Dict[str, Any], path: Union[str, Path], previous: str) -> None:
    """Raises :class:`NonFiniteStateError` before writing ``payload`` to ``path`` if any
    of its tensors is not finite; ``previous`` says which checkpoint is kept."""
    bad = nonfinite_tensors(payload)
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise NonFiniteStateError(
            f"refusing to write {path}: non-finite values in {shown}; {previous}. Lower --lr "
            "/ --lr-embed or check the data."
        )


def describe_last_checkpoint(path: Union[str, Path], step: Optional[int]) -> str:
    """How a stop message names the checkpoint this run can be resumed from: ``step`` is
    the global step of the last checkpoint this run wrote or resumed from (None: none)."""
    if step is None:
        return "this run wrote no checkpoint (none to resume from)"
    return f"the last good checkpoint is {path} (step {step}; --resume continues from it)"

"""The trainer's checkpoints: one ``torch.distributed.checkpoint`` format for one process
and for N, written atomically.

A checkpoint is a directory under ``<out>/checkpoints/``: the tensors (model, fused and
dense optimizer states) as a DCP checkpoint, each rank writing its own shards, plus
``trainer_state.pt`` (progress, configuration, RNG states, clip counters) from rank 0. A
small pointer file names the current one and is replaced with ``os.replace`` only after
every rank has finished writing, so a kill at any moment leaves the previous checkpoint
named and loadable; directories no pointer names are removed at the next save. Sharded
tensors are saved with their global layout, so a checkpoint written by N processes loads
on M under any plan (DCP re-shards on load).

Example::

    >>> import tempfile, torch
    >>> from torchrec_cowclip.train.checkpoint import CheckpointStore
    >>> store = CheckpointStore(tempfile.mkdtemp())
    >>> weights = {"w": torch.arange(4.0)}
    >>> store.save("latest", "s3", {"model": weights}, {"step": 3}).name
    'latest-s3'
    >>> restored = {"model": {"w": torch.zeros(4)}}
    >>> store.load("latest", restored)["step"], restored["model"]["w"].tolist()
    (3, [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist

# From their defining modules: the package's __init__ re-exports these names without
# __all__, which mypy reads as private. save and load are looked up on their modules at
# call time, so a test can replace state_dict_saver.save (a write killed half-way).
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.filesystem import FileSystemReader

from torchrec_cowclip.compat import ShardedTensor

TRAINER_STATE = "trainer_state.pt"
CHECKPOINTS_DIR = "checkpoints"


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into."""


class NonFiniteStateError(RuntimeError):
    """A checkpoint would hold NaN/inf tensors; it is not written (the previous one stays)."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _flat_tensors(state: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"a.b.c": tensor}`` for every tensor in nested dicts, keyed as DCP keys them."""
    flat: Dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat_tensors(value, name + "."))
        elif isinstance(value, (torch.Tensor, ShardedTensor)):
            flat[name] = value
    return flat


def _size(value: Any) -> Tuple[int, ...]:
    return tuple(value.size())


class CheckpointStore:
    """Named, atomically replaced checkpoints in one directory.

    Args:
        root: the directory (``<out>/checkpoints`` for the trainer).

    Each name (``"latest"``, ``"best"``) is a pointer file holding the directory of the
    checkpoint it names; :meth:`save` writes a new directory and then moves the pointer.
    Every rank of a multi-process run calls every method (they are collective).
    """

    def __init__(self, root: Union[str, Path]) -> None:
        self.root = Path(root)

    def path_of(self, name: str) -> Optional[Path]:
        """The checkpoint directory ``name`` points at, or None."""
        pointer = self.root / name
        if not pointer.is_file():
            return None
        target = self.root / pointer.read_text().strip()
        return target if (target / TRAINER_STATE).is_file() else None

    def save(
        self, name: str, tag: str, tensors: Dict[str, Any], trainer_state: Dict[str, Any]
    ) -> Path:
        """Writes ``tensors`` (nested dicts of tensors / ShardedTensors and plain values)
        and ``trainer_state`` (rank 0's) as checkpoint ``name``, in directory ``tag``.

        Raises:
            NonFiniteStateError: a tensor holds a NaN or inf (on any rank); nothing is
                written and ``name`` still points at its previous checkpoint.
        """
        target = self.root / f"{name}-{tag}"
        require_finite(tensors, target, lambda: self.describe(name))
        if _is_main():
            self.root.mkdir(parents=True, exist_ok=True)
            if target.exists():  # a write of this very checkpoint that was killed
                shutil.rmtree(target)
        _barrier()
        state_dict_saver.save(tensors, checkpoint_id=str(target))
        if _is_main():
            _atomic_write(target / TRAINER_STATE, lambda f: torch.save(trainer_state, f))
        _barrier()
        if _is_main():
            _atomic_write(self.root / name, lambda f: f.write(target.name.encode()))
            self.remove_unnamed()
        _barrier()
        return target

    def load(self, name: str, tensors: Dict[str, Any]) -> Dict[str, Any]:
        """Loads checkpoint ``name`` in place into ``tensors`` and returns its trainer
        state.

        Raises:
            FileNotFoundError: no such checkpoint.
            CheckpointMismatchError: a tensor of ``tensors`` is missing from the
                checkpoint or has another shape there (nothing is loaded then).
        """
        path = self.path_of(name)
        if path is None:
            raise FileNotFoundError(f"no '{name}' checkpoint in {self.root}")
        self.check_fits(path, tensors)
        state_dict_loader.load(tensors, checkpoint_id=str(path))
        state: Dict[str, Any] = torch.load(
            path / TRAINER_STATE, map_location="cpu", weights_only=False
        )
        return state

    def describe(self, name: str) -> str:
        """How a stop message names checkpoint ``name`` of this directory."""
        path = self.path_of(name)
        if path is None:
            return "this run wrote no checkpoint (none to resume from)"
        state = self.trainer_state(name) or {}
        step = state.get("progress", {}).get("global_step", "?")
        return f"the last good checkpoint is {path} (step {step}; --resume continues from it)"

    def trainer_state(self, name: str) -> Optional[Dict[str, Any]]:
        """The trainer state of checkpoint ``name`` (None if there is none), without
        loading its tensors."""
        path = self.path_of(name)
        if path is None:
            return None
        state: Dict[str, Any] = torch.load(
            path / TRAINER_STATE, map_location="cpu", weights_only=False
        )
        return state

    @staticmethod
    def check_fits(path: Path, tensors: Mapping[str, Any]) -> None:
        """Raises :class:`CheckpointMismatchError` naming the first tensor that the
        checkpoint at ``path`` lacks or holds with another shape."""
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        wanted = _flat_tensors(tensors)
        missing: List[str] = []
        for key, value in wanted.items():
            meta = saved.get(key)
            if meta is None:
                missing.append(key)
                continue
            size = getattr(meta, "size", None)
            if size is not None and tuple(size) != _size(value):
                raise CheckpointMismatchError(
                    f"checkpoint {path} does not fit: '{key}' is {list(size)} there and "
                    f"{list(_size(value))} here"
                )
        # Under sharding a rank holds some tables only: compare against every rank's keys.
        everyone = set(wanted)
        if _distributed():
            gathered: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sorted(wanted))
            everyone = {k for keys in gathered for k in keys}
        groups = {k.split(".")[0] for k in everyone}
        extra = sorted(
            k
            for k, m in saved.items()
            if hasattr(m, "size") and k not in everyone and k.split(".")[0] in groups
        )
        if missing or extra:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not fit: {len(missing)} tensor(s) of this run are "
                f"not in it (first: {missing[:3]}), {len(extra)} of its tensors are not in "
                f"this run (first: {extra[:3]})"
            )

    def remove_unnamed(self) -> List[Path]:
        """Removes checkpoint directories and temporary files no pointer names (left by
        a killed write, or superseded); returns what it removed. Rank 0 only."""
        named = {
            self.root / (self.root / n).read_text().strip()
            for n in ("latest", "best")
            if (self.root / n).is_file()
        }
        removed: List[Path] = []
        if not self.root.is_dir():
            return removed
        for entry in self.root.iterdir():
            if entry.is_dir() and entry not in named:
                shutil.rmtree(entry)
                removed.append(entry)
            elif entry.is_file() and entry.name.endswith(".tmp"):
                entry.unlink()
                removed.append(entry)
        return removed


def _atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
    """Writes a file through a temporary sibling, fsynced, then ``os.replace``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise


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
    items: Iterable[Tuple[Any, Any]]
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


def require_finite(
    tensors: Dict[str, Any], path: Union[str, Path], previous: Callable[[], str]
) -> None:
    """Raises :class:`NonFiniteStateError` on every rank, before anything is written to
    ``path``, if any rank's tensors are not all finite; ``previous()`` says which
    checkpoint is kept (called only then: it reads that checkpoint's trainer state). One
    reduction per tensor, one collective."""
    bad = nonfinite_tensors(tensors)
    count = len(bad)
    if _distributed():
        flag = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(flag)
        count = int(flag)
    if count:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise NonFiniteStateError(
            f"refusing to write {path}: non-finite values in {shown or 'another rank'}; "
            f"{previous()}. Lower --lr / --lr-embed or check the data."
        )

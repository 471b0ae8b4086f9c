"""The trainer's checkpoints: one ``torch.distributed.checkpoint`` format for one process
and for N, each checkpoint a verified unit.

A checkpoint is a directory ``<out>/checkpoints/<name>-<tag>/``: the tensors (model,
fused and dense optimizer states) as a DCP checkpoint, each rank writing its own shards,
``trainer_state.pt`` (progress, configuration, RNG states, clip counters; tensors and
plain values only) from rank 0, and, written last, ``manifest.json``: every file's name,
size and CRC-32, the checkpoint's name, tag, step and sequence number, and the run's
fingerprint. A directory is

* *complete* when it has a manifest of this format naming that directory (a copy under
  another name is foreign); only complete checkpoints are ever
  loaded, newest (highest sequence) first, and each is verified against its manifest
  (sizes and checksums of every file, read by the ranks in turn) before anything of it is
  read. A damaged one is reported in one line and the previous complete one is used;
* *unfinished* when it has this project's writing marker (created before anything else)
  and no manifest: a write that was killed. Only these are removed at the next start;
* *foreign* otherwise (another tool's directory, a user's copy): never touched.

A pointer file per name (``latest``, ``best``) names the newest checkpoint for people and
tools, replaced with ``os.replace``; it is a convenience, not the record (the manifests
are). The last ``keep`` complete checkpoints of each name are kept, and those a kept one
lists in its manifest's ``uses`` (the best epoch's weights a ``latest`` checkpoint needs);
older ones are removed after a new one is complete. Sharded tensors are saved with their
global layout, so a checkpoint written by N processes loads on M under any plan.

Every file is read back without running code from it (:mod:`.safe_load`).

Example::

    >>> import tempfile, torch
    >>> from torchrec_cowclip.run.checkpoints import CheckpointStore
    >>> store = CheckpointStore(tempfile.mkdtemp())
    >>> weights = {"w": torch.arange(4.0)}
    >>> store.save("latest", "s3", {"model": weights}, {"step": 3}, step=3).path.name
    'latest-s3'
    >>> restored = {"model": {"w": torch.zeros(4)}}
    >>> store.load("latest", restored)["step"], restored["model"]["w"].tolist()
    (3, [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

# From their defining modules: the package's __init__ re-exports these names without
# __all__, which mypy reads as private. save and load are looked up on their modules at
# call time, so a test can replace state_dict_saver.save (a write killed half-way).
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException

from torchrec_cowclip.compat import ShardedTensor
from torchrec_cowclip.distributed.comm import CollectiveError, run_collective
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.notices import single_process_checkpoint
from torchrec_cowclip.readback import check_file, file_record, read_json
from torchrec_cowclip.run.no_space import no_space
from torchrec_cowclip.run.safe_load import (
    METADATA_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeFileError,
    load_plain,
)

TRAINER_STATE = "trainer_state.pt"
MANIFEST = "manifest.json"
#: Created first in every checkpoint directory this project writes, removed once the
#: manifest is in place: a directory with it and without a manifest is a killed write.
WRITING_MARKER = ".torchrec_cowclip-writing"
CHECKPOINTS_DIR = "checkpoints"
POINTERS = ("latest", "best")
#: A pointer's temporary form while it is replaced (:func:`_atomic_write`).
_POINTER_TEMPS = tuple(f"{p}.tmp" for p in POINTERS)
MANIFEST_FORMAT = "torchrec_cowclip checkpoint"
MANIFEST_VERSION = 1
DEFAULT_KEEP = 2

__all__ = [
    "CHECKPOINTS_DIR",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointStore",
    "CheckpointWriteError",
    "DamagedCheckpointError",
    "NonFiniteStateError",
    "TRAINER_STATE",
    "UnsafeFileError",
    "nonfinite_tensors",
    "require_finite",
]


class CheckpointError(ConfigError):
    """A checkpoint cannot be used as it is; the message names the file or tensor."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the model or optimizer it is loaded into."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest (and no older one does either)."""


class CheckpointWriteError(RuntimeError):
    """The environment refused a checkpoint write (a full disk, a read-only directory);
    the previous checkpoint stays, and the unfinished directory is removed."""


class NonFiniteStateError(RuntimeError):
    """A checkpoint would hold NaN/inf tensors; it is not written (the previous one stays)."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> Tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _is_main() -> bool:
    return _rank_and_world()[0] == 0


def _barrier(what: str) -> None:
    if _distributed():
        run_collective(what, None, dist.barrier)


def _from_main(value: Any, what: str) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not _distributed():
        return value
    box = [value]
    run_collective(what, None, lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def _gathered(value: Any, what: str) -> List[Any]:
    """Every rank's ``value``, in rank order."""
    if not _distributed():
        return [value]
    everyone: List[Any] = [None] * dist.get_world_size()
    run_collective(what, None, lambda: dist.all_gather_object(everyone, value))
    return everyone


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


def _read_manifest(directory: Path) -> Optional[Dict[str, Any]]:
    """The manifest of ``directory`` if it is one of this format (JSON: nothing runs)."""
    try:
        manifest = read_json(directory / MANIFEST)
    except (OSError, ValueError):
        return None
    if manifest.get("format") != MANIFEST_FORMAT:
        return None
    return manifest


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint directory and its manifest."""

    path: Path
    manifest: Dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.manifest["name"])

    @property
    def sequence(self) -> int:
        return int(self.manifest["sequence"])

    @property
    def step(self) -> Optional[int]:
        step = self.manifest.get("step")
        return None if step is None else int(step)

    @property
    def uses(self) -> List[str]:
        return [str(u) for u in self.manifest.get("uses", [])]


def _share(names: Sequence[str]) -> List[str]:
    """This rank's turn of ``names`` (every world-th, from its rank)."""
    rank, world = _rank_and_world()
    return list(names)[rank::world]


class CheckpointStore:
    """Named, verified, atomically completed checkpoints in one directory.

    Args:
        root: the directory (``<out>/checkpoints`` for the trainer).
        keep: how many complete checkpoints of each name to keep (``--keep-checkpoints``).

    :meth:`save`, :meth:`verify`, :meth:`intact` and :meth:`load` are collective in a
    multi-process run: every rank calls them.
    """

    def __init__(self, root: Union[str, Path], keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = int(keep)
        self._damaged: set[Path] = set()

    # --- what is there ---------------------------------------------------------------

    def _survey(self) -> Tuple[List[Checkpoint], List[Path], List[Path]]:
        """``(complete, unfinished, foreign)``: the entries of :attr:`root` by name, each
        sorted into the kinds the module docstring names, every manifest read once (the
        pointer files are none of the three)."""
        if not self.root.is_dir():
            return [], [], []
        complete: List[Checkpoint] = []
        unfinished: List[Path] = []
        foreign: List[Path] = []
        for entry in sorted(self.root.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                manifest = _read_manifest(entry)
                # A manifest records its directory: a copy under another name (a user's
                # backup) is not this store's to load or prune.
                if manifest is not None and manifest.get("directory") == entry.name:
                    complete.append(Checkpoint(entry, manifest))
                    continue
                ours = (entry / WRITING_MARKER).exists() or (
                    # A kill between creating a directory and its marker (or between
                    # removing the marker and the directory) leaves it empty: nothing
                    # in it to lose.
                    entry.name.split("-")[0] in POINTERS and not any(entry.iterdir())
                )
                if ours and manifest is None:
                    unfinished.append(entry)
                    continue
            elif entry.name in _POINTER_TEMPS:
                unfinished.append(entry)
                continue
            if entry.name not in POINTERS and entry.name not in _POINTER_TEMPS:
                foreign.append(entry)
        return complete, unfinished, foreign

    def complete(self, name: Optional[str] = None) -> List[Checkpoint]:
        """The complete checkpoints (of ``name``, or all), newest first. Nothing is
        verified or loaded: this reads the manifests only."""
        found = [c for c in self._survey()[0] if name is None or c.manifest.get("name") == name]
        return sorted(found, key=lambda c: c.sequence, reverse=True)

    def newest(self, name: str) -> Optional[Checkpoint]:
        """The newest complete checkpoint of ``name`` (not verified), or None."""
        complete = self.complete(name)
        return complete[0] if complete else None

    def path_of(self, name: str) -> Optional[Path]:
        """The directory of the newest complete checkpoint of ``name``, or None."""
        newest = self.newest(name)
        return None if newest is None else newest.path

    def unfinished(self) -> List[Path]:
        """Directories this project started writing and never completed (its marker and
        no manifest, or an empty ``latest-*``/``best-*``), and its own temporary pointer
        files."""
        return self._survey()[1]

    def foreign(self) -> List[Path]:
        """Entries that are neither checkpoints of this project nor its pointer files
        (left alone by every clean-up)."""
        return self._survey()[2]

    def remove_unfinished(self) -> List[Path]:
        """Removes :meth:`unfinished` and returns what it removed (rank 0 only)."""
        removed = self.unfinished()
        for path in removed:
            if path.is_dir():
                _remove_checkpoint_dir(path)
            else:
                path.unlink()
        return removed

    def remove_own(self) -> Tuple[List[Path], List[Path]]:
        """``--overwrite``: removes every checkpoint, unfinished write and pointer of this
        project; returns ``(removed, left alone)`` (foreign entries are left)."""
        left = self.foreign()
        removed = (
            [e for e in sorted(self.root.iterdir()) if e not in left] if self.root.is_dir() else []
        )
        for path in removed:
            if path.is_dir() and not path.is_symlink():
                _remove_checkpoint_dir(path)
            else:
                path.unlink()
        if self.root.is_dir() and not left:
            self.root.rmdir()
        return removed, left

    # --- verification ----------------------------------------------------------------

    def verify(self, checkpoint: Checkpoint) -> List[str]:
        """What does not match ``checkpoint``'s manifest, as ``"FILE: reason"`` (empty if
        it is intact): every listed file's size and CRC-32, and no unlisted checkpoint
        file beside them. The ranks read the files in turn; every rank gets the result."""
        files: Mapping[str, Mapping[str, Any]] = checkpoint.manifest.get("files", {})
        problems: List[str] = []
        for name in _share(sorted(files)):
            why = check_file(checkpoint.path / name, files[name])
            if why is not None:
                problems.append(f"{checkpoint.path / name}: {why}")
        if _is_main():
            for entry in sorted(checkpoint.path.iterdir()):
                data_like = entry.suffix == ".distcp" or entry.name.endswith(
                    (METADATA_FILE, TRAINER_STATE)
                )
                if data_like and entry.name not in files:
                    problems.append(f"{entry}: not part of this checkpoint (not in its manifest)")
        merged = [p for part in _gathered(problems, "checkpoint verification") for p in part]
        return sorted(merged)

    def intact(
        self, name: str, say: Callable[[str], None] = lambda _: None
    ) -> Optional[Checkpoint]:
        """The newest complete checkpoint of ``name`` whose files match its manifest;
        each newer damaged one is reported through ``say`` (one line) and skipped.

        Returns:
            None when there is no complete checkpoint of ``name``.

        Raises:
            DamagedCheckpointError: every complete checkpoint is damaged (naming the
                first mismatching file of the newest).
        """
        names = _from_main([c.path.name for c in self.complete(name)], "checkpoint listing")
        candidates = [Checkpoint(self.root / n, _read_manifest(self.root / n) or {}) for n in names]
        first_problem: Optional[str] = None
        for i, checkpoint in enumerate(candidates):
            problems = (
                self.verify(checkpoint)
                if checkpoint.manifest
                else [f"{checkpoint.path}: manifest unreadable"]
            )
            if not problems:
                return checkpoint
            self._damaged.add(checkpoint.path)
            first_problem = first_problem or problems[0]
            later = candidates[i + 1] if i + 1 < len(candidates) else None
            say(
                f"checkpoint {checkpoint.path} is damaged ({problems[0]}"
                + (f"; {len(problems) - 1} more" if len(problems) > 1 else "")
                + (f"): falling back to {later.path}" if later else "): no older checkpoint")
            )
        if first_problem is not None:
            raise DamagedCheckpointError(
                f"no intact '{name}' checkpoint in {self.root}: {first_problem} (the manifest "
                "lists other bytes); restore the file, or start anew with --overwrite"
            )
        return None

    def _resolve(self, which: Union[str, Checkpoint]) -> Checkpoint:
        if isinstance(which, Checkpoint):
            return which
        found = self.intact(which)
        if found is None:
            raise FileNotFoundError(f"no '{which}' checkpoint in {self.root}")
        return found

    # --- writing ---------------------------------------------------------------------

    def save(
        self,
        name: str,
        tag: str,
        tensors: Dict[str, Any],
        trainer_state: Dict[str, Any],
        *,
        step: Optional[int] = None,
        fingerprint: Optional[str] = None,
        uses: Sequence[str] = (),
    ) -> Checkpoint:
        """Writes ``tensors`` (nested dicts of tensors / ShardedTensors) and
        ``trainer_state`` (rank 0's; tensors and plain values only) as a new checkpoint
        of ``name`` in a fresh directory ``<name>-<tag>`` (``-2``, ``-3``, ... if taken),
        completes it with its manifest, moves the pointer and prunes old checkpoints.

        Raises:
            NonFiniteStateError: a tensor holds a NaN or inf (on any rank); nothing is
                written.
            CheckpointWriteError: a write failed (disk full, read-only); the unfinished
                directory is removed and the previous checkpoint stays.
        """
        require_finite(tensors, self.root / f"{name}-{tag}", lambda: self.describe(name))
        planned = self._start(name, tag) if _is_main() else None
        directory, sequence = _from_main(planned, f"checkpoint {name} start")
        target = self.root / directory
        try:
            with single_process_checkpoint():
                state_dict_saver.save(tensors, checkpoint_id=str(target))
            if _is_main():
                _atomic_write(target / TRAINER_STATE, lambda f: torch.save(trainer_state, f))
            _barrier(f"checkpoint write of {target}")
            records = _file_records(target)
            if _is_main():
                self._complete(
                    target,
                    {
                        "format": MANIFEST_FORMAT,
                        "version": MANIFEST_VERSION,
                        "name": name,
                        "directory": directory,
                        "tag": tag,
                        "sequence": sequence,
                        "step": step,
                        "fingerprint": fingerprint,
                        "world_size": _rank_and_world()[1],
                        "uses": list(uses),
                        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "files": {n: records[n] for n in sorted(records)},
                    },
                )
            _barrier(f"checkpoint completion of {target}")
        except CollectiveError:
            raise
        except (OSError, RuntimeError, CheckpointException) as e:
            failed = self._write_failed(e, target, name)
            if failed is None:
                raise  # not the environment: a bug, shown whole
            raise failed from None
        return Checkpoint(target, _read_manifest(target) or {})

    def _start(self, name: str, tag: str) -> Tuple[str, int]:
        """Rank 0 makes the new checkpoint's directory, marked as being written; returns
        its name and the checkpoint's sequence number (one above every complete one's)."""
        self.root.mkdir(parents=True, exist_ok=True)
        sequence = 1 + max((c.sequence for c in self.complete()), default=0)
        directory = f"{name}-{tag}"
        n = 1
        while (self.root / directory).exists():
            n += 1
            directory = f"{name}-{tag}-{n}"
        (self.root / directory).mkdir()
        (self.root / directory / WRITING_MARKER).write_text(
            json.dumps({"pid": os.getpid(), "started": time.time()})
        )
        return directory, sequence

    def _complete(self, target: Path, manifest: Dict[str, Any]) -> None:
        """Rank 0 completes the written checkpoint ``target``: its manifest, last (the
        marker then goes), the pointer of its name, and the pruning of older ones."""
        _atomic_write(target / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        (target / WRITING_MARKER).unlink()
        _fsync_dir(target)
        _atomic_write(self.root / manifest["name"], lambda f: f.write(target.name.encode()))
        self._prune()

    def _write_failed(
        self, error: BaseException, target: Path, name: str
    ) -> Optional[CheckpointWriteError]:
        """The refusal of a write of ``target`` that the environment failed (a full disk,
        a read-only directory), once rank 0 removed the unfinished directory (else the
        next start does); None for any other error (a bug, to be shown whole)."""
        # Before the removal, which frees what the write took (no_space reads the free
        # space for an error without an errno: torch's "unexpected pos").
        full = no_space(error, target)
        if isinstance(error, RuntimeError) and full is None:
            return None
        if _is_main() and target.exists() and _read_manifest(target) is None:
            try:
                _remove_checkpoint_dir(target)
            except OSError:
                pass  # the next start removes it (it carries the marker)
        why = (
            f"{full}"
            if full is not None
            else f"cannot write checkpoint {target}: {os_reason(error)}"
        )
        return CheckpointWriteError(
            f"{why}; removed the unfinished directory; {self.describe(name)}"
        )

    def _prune(self) -> None:
        """Removes complete checkpoints beyond the newest :attr:`keep` of each name that
        no kept one uses (rank 0, after a checkpoint is complete)."""
        complete = self.complete()
        by_name: Dict[str, List[Checkpoint]] = {}
        for c in complete:
            by_name.setdefault(c.name, []).append(c)
        kept: List[Checkpoint] = []
        for group in by_name.values():
            kept += [c for c in group if c.path not in self._damaged][: self.keep]
        used = {u for c in kept for u in c.uses}
        for c in complete:
            if c not in kept and c.path.name not in used and c.path not in self._damaged:
                _remove_checkpoint_dir(c.path)

    # --- reading ---------------------------------------------------------------------

    def trainer_state(self, which: Union[str, Checkpoint]) -> Optional[Dict[str, Any]]:
        """The trainer state of a checkpoint (or of the newest intact one of a name;
        None if there is none), loaded with ``weights_only=True``."""
        if isinstance(which, str):
            found = self.intact(which)
            if found is None:
                return None
            which = found
        state: Dict[str, Any] = load_plain(which.path / TRAINER_STATE)
        return state

    def load(self, which: Union[str, Checkpoint], tensors: Dict[str, Any]) -> Dict[str, Any]:
        """Loads a checkpoint (or the newest intact one of a name) in place into
        ``tensors`` and returns its trainer state.

        Raises:
            FileNotFoundError: no such checkpoint.
            DamagedCheckpointError: its files do not match its manifest.
            CheckpointMismatchError: a tensor of ``tensors`` is missing from the
                checkpoint or has another shape there (nothing is loaded then).
            UnsafeFileError: a file holds something other than tensors and plain values.
        """
        checkpoint = self._resolve(which)
        state = self.trainer_state(checkpoint)
        assert state is not None
        self.check_fits(checkpoint.path, tensors)
        with single_process_checkpoint():
            state_dict_loader.load(
                tensors,
                storage_reader=SafeFileSystemReader(str(checkpoint.path)),
                planner=SafeLoadPlanner(),
            )
        return state

    def describe(self, name: str) -> str:
        """How a stop message names the newest checkpoint of ``name`` (its manifest only:
        nothing is loaded)."""
        newest = self.newest(name)
        if newest is None:
            return "this run wrote no checkpoint (none to resume from)"
        step = "?" if newest.step is None else newest.step
        return (
            f"the last good checkpoint is {newest.path} (step {step}; --resume continues from it)"
        )

    @staticmethod
    def check_fits(path: Path, tensors: Mapping[str, Any]) -> None:
        """Raises :class:`CheckpointMismatchError` naming the first tensor that the
        checkpoint at ``path`` lacks or holds with another shape."""
        saved = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
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
        everyone = {k for keys in _gathered(sorted(wanted), "checkpoint key check") for k in keys}
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


def _file_records(target: Path) -> Dict[str, Any]:
    """Every file of the checkpoint ``target`` (but the writing marker) -> its size and
    CRC-32 (:func:`~torchrec_cowclip.readback.file_record`): rank 0 lists them, the ranks
    read them in turn, every rank gets all."""
    listed = _from_main(
        sorted(p.name for p in target.iterdir() if p.name != WRITING_MARKER)
        if _is_main()
        else None,
        f"checkpoint listing of {target}",
    )
    mine = {n: file_record(target / n) for n in _share(listed)}
    records: Dict[str, Any] = {}
    for part in _gathered(mine, f"checkpoint checksums of {target}"):
        records.update(part)
    return records


def _remove_checkpoint_dir(path: Path) -> None:
    """Removes a checkpoint directory of this project so that a kill at any moment leaves
    it recognisable as ours and unfinished (removed at the next start): the writing
    marker goes in before the manifest goes, and out last."""
    marker = path / WRITING_MARKER
    if not marker.exists():
        marker.write_text(json.dumps({"pid": os.getpid(), "removing": time.time()}))
    (path / MANIFEST).unlink(missing_ok=True)
    for entry in path.iterdir():
        if entry == marker:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    marker.unlink()
    path.rmdir()


def os_reason(error: BaseException) -> str:
    """The first OS-level reason in ``error`` (a DCP ``CheckpointException`` wraps each
    rank's), as ``strerror`` plus the file where known."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, (inner, _trace) = next(iter(sorted(failures.items())))
        return f"rank {rank}: {os_reason(inner)}"
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror}{where}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    checkpoint is kept (called only then). One reduction per tensor, one collective."""
    bad = nonfinite_tensors(tensors)
    count = len(bad)
    if _distributed():
        flag = torch.tensor([count], dtype=torch.int64)
        run_collective("checkpoint finiteness check", None, lambda: dist.all_reduce(flag))
        count = int(flag)
    if count:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise NonFiniteStateError(
            f"refusing to write {path}: non-finite values in {shown or 'another rank'}; "
            f"{previous()}. Lower --lr / --lr-embed or check the data."
        )

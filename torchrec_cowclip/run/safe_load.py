"""Reading back checkpoint files without running code from them.

Checkpoints travel between people and jobs, so nothing in one may execute on load.
A checkpoint holds three kinds of file, each read by a loader that cannot run code:

* ``trainer_state.pt`` and any other plain file: ``torch.load(weights_only=True)``,
  torch's own unpickler that builds only tensors and plain Python values (dicts, lists,
  tuples, numbers, strings, None);
* DCP's ``.metadata`` (a pickle of ``torch.distributed.checkpoint.metadata.Metadata``):
  :class:`SafeFileSystemReader`, a ``FileSystemReader`` whose ``read_metadata`` unpickles
  through :class:`RestrictedUnpickler`, which admits only the classes that metadata is
  made of (:func:`allowed_globals`) and refuses any other name before creating anything;
* the ``.distcp`` data files: DCP reads tensors with ``weights_only=True`` already; the
  non-tensor items it would ``torch.load`` with ``weights_only=False`` go through
  :class:`SafeLoadPlanner`, which loads them with ``weights_only=True``.

The metadata is checked before anything is read through it (:func:`check_storage`):
every tensor's chunks must cover it exactly, and every chunk must lie within a plain
file of the checkpoint's own directory (a bare file name: no path, no ``..``, no link),
in as many bytes as its elements need, with no storage transform (DCP's compression,
which this project never writes). So a crafted ``.metadata`` can neither point a read
outside its directory, nor at a device or a FIFO, nor make a loader allocate more than
the files hold, and a truncated data file is refused by name, not half-read.

A refused file raises :class:`UnsafeFileError`, one line naming the file and the name
it tried to reach.

Example::

    >>> import io, os, pickle, tempfile
    >>> class Payload:
    ...     def __reduce__(self):
    ...         return (os.system, ("echo pwned",))
    >>> path = os.path.join(tempfile.mkdtemp(), ".metadata")
    >>> with open(path, "wb") as f:
    ...     pickle.dump(Payload(), f)
    >>> read_dcp_metadata(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    torchrec_cowclip.run.safe_load.UnsafeFileError: .../.metadata: refused to load: it names ...system, which a checkpoint's metadata never holds (a file that could run code); nothing was loaded
"""

from __future__ import annotations

import builtins
import io
import math
import os
import pathlib
import pickle
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, Tuple, Union

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import ReadItem

from torchrec_cowclip.compat import dcp_metadata_private_classes
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.readback import RefusedFileError, open_member

METADATA_FILE = ".metadata"


class UnsafeFileError(ConfigError):
    """A checkpoint file holds something other than tensors and plain values (a crafted
    file that could run code); nothing of it was loaded."""


def allowed_globals() -> Dict[Tuple[str, str], Any]:
    """``(module, name) -> object`` of everything a DCP ``.metadata`` pickle may name:
    DCP's metadata dataclasses, ``torch.Size``, the dtypes, paths and the few private
    names of :func:`~torchrec_cowclip.compat.dcp_metadata_private_classes`."""
    allowed: Dict[Tuple[str, str], Any] = {}
    for cls in (
        dcp_metadata.Metadata,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        torch.Size,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
        OrderedDict,
    ):
        allowed[(cls.__module__, cls.__qualname__)] = cls
    allowed[("collections", "OrderedDict")] = OrderedDict
    for name in ("set", "frozenset"):
        allowed[("builtins", name)] = getattr(builtins, name)
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    allowed.update(dcp_metadata_private_classes())
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves only the names of :func:`allowed_globals`.

    Any other global (a function such as ``os.system``, a class with side effects) raises
    :class:`UnsafeFileError` when the pickle first names it, before it is called.
    """

    def __init__(self, file: Any, path: Union[str, Path]) -> None:
        super().__init__(file)
        self._path = path
        self._allowed = allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise UnsafeFileError(
                f"{self._path}: refused to load: it names {module}.{name}, which a "
                "checkpoint's metadata never holds (a file that could run code); nothing "
                "was loaded"
            )
        return found


def regular_file(path: Union[str, Path]) -> os.stat_result:
    """The ``lstat`` of ``path`` if it is a plain file (not a link, a directory, a device
    or a FIFO, which could point elsewhere or block a read forever).

    Raises:
        UnsafeFileError: it is something else.
        FileNotFoundError: it does not exist.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFileError(f"{path}: refused to load: a symbolic link, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(
            f"{path}: refused to load: not a regular file (a directory, device, FIFO or socket)"
        )
    return st


def check_storage(directory: Union[str, Path], metadata: dcp_metadata.Metadata) -> None:
    """Refuses DCP ``metadata`` that reads outside ``directory`` or more than its files
    hold (see the module docstring), before anything is read through it.

    Raises:
        UnsafeFileError: naming the tensor and the file.
    """
    root = Path(directory)
    sizes: Dict[str, int] = {}
    chunks: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, dcp_metadata.TensorStorageMetadata):
            continue
        itemsize = torch.empty((), dtype=meta.properties.dtype).element_size()
        total = 0
        for chunk in meta.chunks:
            ends = [o + n for o, n in zip(chunk.offsets, chunk.sizes)]
            if len(ends) != len(meta.size) or any(
                o < 0 or e > n for o, e, n in zip(chunk.offsets, ends, meta.size)
            ):
                raise UnsafeFileError(
                    f"{root / METADATA_FILE}: refused to load: a chunk of '{fqn}' lies outside "
                    f"its size {list(meta.size)}"
                )
            numel = math.prod(chunk.sizes)
            chunks[(fqn, tuple(chunk.offsets))] = numel * itemsize
            total += numel
        if total != math.prod(meta.size):
            raise UnsafeFileError(
                f"{root / METADATA_FILE}: refused to load: the chunks of '{fqn}' hold {total} "
                f"elements, its size {list(meta.size)} {math.prod(meta.size)}"
            )
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or "\\" in name
            or "\0" in name
        ):
            raise UnsafeFileError(
                f"{root / METADATA_FILE}: refused to load: '{index.fqn}' is stored in "
                f"{name!r}, not a file of this checkpoint's directory"
            )
        if getattr(info, "transform_descriptors", None):
            raise UnsafeFileError(
                f"{root / METADATA_FILE}: refused to load: '{index.fqn}' is stored through "
                f"transforms {list(info.transform_descriptors)}, which this project never writes"
            )
        if name not in sizes:
            try:
                sizes[name] = regular_file(root / name).st_size
            except FileNotFoundError:
                raise UnsafeFileError(
                    f"{root / name}: refused to load: missing (its metadata stores "
                    f"'{index.fqn}' there)"
                ) from None
        start, length = int(info.offset), int(info.length)
        needed = chunks.get((index.fqn, tuple(index.offset or ())), 0)
        if start < 0 or length < needed or start + length > sizes[name]:
            raise UnsafeFileError(
                f"{root / name}: refused to load: it has {sizes[name]} bytes, and its "
                f"metadata stores '{index.fqn}' ({needed} bytes of elements) at bytes "
                f"{start}..{start + length} (a truncated or foreign file); nothing was loaded"
            )


def read_dcp_metadata(path: Union[str, Path]) -> dcp_metadata.Metadata:
    """The ``Metadata`` pickled in DCP's ``.metadata`` file at ``path``, unpickled by
    :class:`RestrictedUnpickler`, and its storage checked (:func:`check_storage`).

    Raises:
        UnsafeFileError: the file names anything but metadata classes, is not a
            metadata pickle at all, is not a plain file, or reads outside its directory
            or past its files' ends.
    """
    try:
        with open_member(path) as (f, _):  # opened once: nothing swapped in after a check
            loaded = RestrictedUnpickler(f, path).load()
    except FileNotFoundError:
        raise UnsafeFileError(f"{path}: refused to load: missing") from None
    except RefusedFileError as e:
        raise UnsafeFileError(str(e).replace(": refused: ", ": refused to load: ", 1)) from None
    except UnsafeFileError:
        raise
    except Exception as e:  # a damaged or foreign file: any unpickling failure
        raise UnsafeFileError(
            f"{path}: refused to load: not a checkpoint metadata file ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if not isinstance(loaded, dcp_metadata.Metadata):
        raise UnsafeFileError(
            f"{path}: refused to load: it holds a {type(loaded).__name__}, not DCP metadata"
        )
    check_storage(Path(path).parent, loaded)
    return loaded


def load_plain(path: Union[str, Path]) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU: tensors and plain values only.

    Raises:
        UnsafeFileError: the file holds anything else (torch's reason is quoted).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message explains weights_only at length; the line naming the refused
        # global is the one worth a user's eye.
        reason = next((line for line in str(e).splitlines() if "GLOBAL" in line), "")
        raise UnsafeFileError(
            f"{path}: refused to load: it holds more than tensors and plain values "
            f"({reason.strip() or 'not loadable with weights_only=True'}); nothing was loaded"
        ) from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with :func:`read_dcp_metadata` as its metadata reader."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_dcp_metadata(Path(self.path) / name)
        storage_meta = metadata.storage_meta
        if storage_meta is None:
            storage_meta = metadata.storage_meta = dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor items with ``weights_only=True``
    (the default planner unpickles them without restriction)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeFileError(
                f"checkpoint item '{read_item.dest_index.fqn}': refused to load: it holds "
                "more than tensors and plain values; nothing more was loaded"
            ) from None
        fqn = read_item.dest_index.fqn
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        # Where DefaultLoadPlanner.load_bytes puts it: the item's place in the nested
        # state dict the caller passed, which exists already (load works in place).
        node: Any = self.original_state_dict
        path = self.mappings[fqn]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = loaded

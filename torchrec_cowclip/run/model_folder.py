"""A finished run's model, self-contained: ``<out>/model/``, everything needed to score.

When a run finishes, the trainer writes ``<out>/model/`` (through ``model.tmp`` and one
rename, so a run killed while writing it leaves none, and the next start removes the
temporary):

* ``weights/final/`` (the weights at the end) and, with a validation split,
  ``weights/best/`` (the best validation epoch's; the reported ones under early stopping): DCP checkpoints of the model's
  tensors alone, each rank writing its shards, global layout (they load on one process);
* ``encoders/``: the vocabulary (``id_vocab.npz``: per column the kept values in id order,
  ``data.pipeline.run_encoders``), where the run has one; hashing keeps no state (its
  options rebuild it);
* ``model.json``: the model factory's arguments, which weights train reported
  (``reported``), the run's metrics and its whole configuration;
* ``data.json``: the data kind and its options (every field of the kind's options
  dataclass), the schema (label, dense and sparse columns, table sizes), how its files
  were read (a text layout's delimiter and header), the encoding, and the dense plan the
  model was trained with (each column's transform and the training split's statistics,
  ``data.parsing.dense.DensePlan``: raw values in, the model's dense inputs out);
* ``manifest.json``, written last: the format and version, and every file's size and
  SHA-256 (version 1 folders, still read, recorded CRC-32s).

:meth:`RunFolder.open` checks the folder before anything of it is read, and refuses in
one line (:class:`RunFolderError`, or :class:`~.safe_load.UnsafeFileError`):

* its shape: every path it names (the manifest's files, ``model.json``'s weights,
  ``data.json``'s vocabulary) relative, inside the folder, through no link, a regular
  file (no device, FIFO or socket) listed in the manifest; nothing in the folder that
  the manifest does not list; descriptions of bounded size;
* its bytes: every file's size and digest against the manifest (another format, a newer
  version, a changed, missing or unlisted file);
* its descriptions: ``model.json`` and ``data.json`` exactly as this version writes them
  (no unknown key, a known model, data kind and encoding, sizes that are whole
  positive numbers, columns that agree between the schema, the reader, the dense plan
  and the model);
* its sizes against its weights: the model the arguments describe is built on the
  ``meta`` device (no memory) and every tensor's shape compared with the weights'
  checkpoint metadata, whose chunks must lie within their files
  (:func:`~.safe_load.check_storage`); so nothing is allocated that the weights' own
  bytes do not back.

Nothing in it is read by a deserialiser that can run code: JSON,
``np.load(allow_pickle=False)``, DCP through :mod:`.safe_load`. The folder does not
depend on ``--cache-dir`` (which may be deleted) nor on where it lies (move it anywhere).
What the manifest does and does not protect against: docs/reliability.md.

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.train import TrainConfig, train
    >>> tmp = tempfile.mkdtemp()
    >>> result = train(TrainConfig(data="synthetic:3000", synthetic_scale=0.001,
    ...                            synthetic_max_cardinality=200, hidden=(8,), batch_size=512,
    ...                            progress=False, out=f"{tmp}/run", cache_dir=f"{tmp}/cache"))
    >>> run = RunFolder.open(result.run_dir)
    >>> run.model_name, run.reported, run.schema.n_sparse, sorted(run.weights)
    ('deepfm', 'final', 26, ['final'])
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import time
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException

from torchrec_cowclip._version import __version__
from torchrec_cowclip.data import parse_spec
from torchrec_cowclip.data.parsing.dense import DensePlan
from torchrec_cowclip.data.parsing.rows import TextLayout, TextRowSource
from torchrec_cowclip.data.parsing.time import time_feature_names
from torchrec_cowclip.data.pipeline.cache import SHA256, check_file, file_record
from torchrec_cowclip.data.pipeline.encode import SparseEncoding
from torchrec_cowclip.data.pipeline.npyfile import CHECKSUM
from torchrec_cowclip.data.pipeline.run_encoders import keep_encoder, restore_encoder
from torchrec_cowclip.data.registry import SourceKind, source_kind, source_kinds
from torchrec_cowclip.data.schema import Schema
from torchrec_cowclip.data.settings import DataSettings
from torchrec_cowclip.data.source_options import SourceOptions
from torchrec_cowclip.data.sources.table import ParquetRowSource
from torchrec_cowclip.distributed.comm import run_collective
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.models import MODELS as MODEL_FACTORIES
from torchrec_cowclip.models import build_model
from torchrec_cowclip.models.base import CTRModel
from torchrec_cowclip.models.embeddings import EMBEDDING_BACKENDS, EMBEDDING_DTYPES
from torchrec_cowclip.models.spec import ModelSpec
from torchrec_cowclip.notices import single_process_checkpoint
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.row_step import compiled_update_mode
from torchrec_cowclip.readback import RefusedFileError, read_json
from torchrec_cowclip.run.checkpoints import CheckpointStore, os_reason, require_finite
from torchrec_cowclip.run.no_space import space_checked
from torchrec_cowclip.run.safe_load import (
    METADATA_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
)

MODEL_DIR = "model"
MANIFEST = "manifest.json"
MODEL_FILE = "model.json"
DATA_FILE = "data.json"
WEIGHTS_DIR = "weights"
ENCODERS_DIR = "encoders"
FORMAT = "torchrec_cowclip run folder"
#: The run-folder format this version writes (2: SHA-256 per file); it reads 1 and 2.
VERSION = 2
#: The digest each format version's manifest records per file.
VERSION_DIGESTS = {1: CHECKSUM, 2: SHA256}
#: The most bytes a description (manifest.json, model.json, data.json) may have.
MAX_DESCRIPTION_BYTES = 64 << 20
#: The key of the model's tensors in a weights checkpoint.
WEIGHTS_KEY = "weights"
#: How the weights a run reported are named: the last step's, or early stopping's best.
WEIGHT_NAMES = ("final", "best")

#: The keys of ``model.json`` (:func:`describe_model`) and ``data.json`` (:func:`describe_data`).
MODEL_KEYS = (
    "model",
    "arguments",
    "weights",
    "reported",
    "metrics",
    "eval_batch_size",
    "init_from",
    "config",
    "torchrec_cowclip",
)
DATA_KEYS = (
    "kind",
    "spec",
    "test_spec",
    "options",
    "schema",
    "reader",
    "encoder",
    "dense_transforms",
    "dense_plan",
    "source_format",
    "rows",
)
#: The model factory's arguments a run folder keeps (:meth:`ModelSpec.arguments <torchrec_cowclip.models.spec.ModelSpec.arguments>`).
ARGUMENTS = (
    "num_dense",
    "sparse_names",
    "cardinalities",
    "embedding_dim",
    "hidden",
    "cross_layers",
    "init_std",
    "embedding_backend",
    "embedding_dtype",
    "init_seed",
)

__all__ = [
    "MODEL_DIR",
    "RunFolder",
    "RunFolderError",
    "RunFolderWriter",
    "describe_data",
    "describe_model",
    "jsonable",
]


class RunFolderError(ConfigError):
    """A run folder that cannot be used as it is (missing, of another format or a newer
    version, changed since it was written); the message names the file."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(what: str) -> None:
    if _distributed():
        run_collective(what, None, dist.barrier)


def jsonable(value: Any) -> Any:
    """``value`` with tuples (and nested tuples) as lists, as JSON holds them."""
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def _tuples(value: Any) -> Any:
    """The inverse of :func:`jsonable` for dataclass fields: lists back to tuples."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shape(shape: Optional[Tuple[int, ...]]) -> str:
    return "absent" if shape is None else str(list(shape))


def _check_arguments(arguments: Any, refuse: Callable[[str], RunFolderError]) -> Dict[str, Any]:
    """``model.json``'s ``arguments``, each of the type and range :meth:`~torchrec_cowclip.models.spec.ModelSpec.arguments`
    writes (checked before any model is built from them).

    Raises:
        the error ``refuse(why)`` makes, naming the argument and its value.
    """
    if not isinstance(arguments, dict):
        raise refuse(f"'arguments' is {_shown(arguments)}, not a mapping")
    unknown = sorted(set(arguments) - set(ARGUMENTS))
    missing = sorted(set(ARGUMENTS) - set(arguments))
    if unknown or missing:
        raise refuse(
            f"model arguments {unknown} are not known"
            if unknown
            else f"model arguments {missing} are missing"
        )
    for key, least in (("num_dense", 0), ("embedding_dim", 1), ("cross_layers", 0)):
        if not _whole(arguments[key], least):
            raise refuse(f"'{key}' is {_shown(arguments[key])}, not a whole number >= {least}")
    for key in ("cardinalities", "hidden"):
        value = arguments[key]
        if not isinstance(value, list) or not all(_whole(v, 1) for v in value):
            raise refuse(f"'{key}' is {_shown(value)}, not a list of whole numbers >= 1")
    names = arguments["sparse_names"]
    if (
        not isinstance(names, list)
        or not names
        or not all(isinstance(n, str) and n for n in names)
        or len(set(names)) != len(names)
        or len(names) != len(arguments["cardinalities"])
    ):
        raise refuse(f"'sparse_names' is {_shown(names)}: not distinct names, one per table size")
    std = arguments["init_std"]
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not 0 <= std < math.inf:
        raise refuse(f"'init_std' is {_shown(std)}, not a finite number >= 0")
    for key, allowed in (
        ("embedding_backend", EMBEDDING_BACKENDS),
        ("embedding_dtype", EMBEDDING_DTYPES),
    ):
        if arguments[key] not in allowed:
            raise refuse(f"'{key}' is {_shown(arguments[key])}, not one of {list(allowed)}")
    seed = arguments["init_seed"]
    if seed is not None and not _whole(seed, 0):
        raise refuse(f"'init_seed' is {_shown(seed)}, not a whole number >= 0")
    return arguments


def describe_model(
    model: ModelSpec,
    settings: Mapping[str, Any],
    dataset: Any,
    metrics: Mapping[str, Any],
    weights: Sequence[str],
    reported: str,
) -> Dict[str, Any]:
    """``model.json``: the factory's arguments, the weights and the run's numbers;
    ``settings`` are the run's options as its record keeps them (``TrainConfig.as_dict``)."""
    inputs = len(dataset.dense_plan.output_names)
    return {
        "model": model.name,
        "arguments": model.arguments(dataset.schema, inputs),
        "weights": {name: f"{WEIGHTS_DIR}/{name}" for name in weights},
        "reported": reported,
        "metrics": {
            k: metrics.get(k)
            for k in ("auc", "logloss", "best_epoch", "epochs", "steps", "train_samples")
        },
        "eval_batch_size": settings["eval_batch_size"],
        "init_from": settings["init_from"],
        "config": jsonable(dict(settings)),
        "torchrec_cowclip": __version__,
    }


def _reader(kind: SourceKind, data: DataSettings, opts: SourceOptions) -> Dict[str, Any]:
    """How the training files were read: a text layout (delimiter, header, columns), a
    parquet file's columns, or the kind's own reader."""
    args = parse_spec(data.spec)[1]
    source = kind.conversion(args, [], opts).source
    if isinstance(source, TextRowSource):
        return {"format": "text", "layout": jsonable(source.layout.payload())}
    if isinstance(source, ParquetRowSource):
        return {
            "format": "parquet",
            "label": source.label,
            "dense": list(source.dense),
            "sparse": list(source.sparse),
            "na_values": list(source.na_values),
            **({"time": list(source.time)} if source.time else {}),
        }
    return {"format": kind.name}


def describe_data(data: DataSettings, dataset: Any, encoder: Mapping[str, Any]) -> Dict[str, Any]:
    """``data.json``: the kind, every option of its options dataclass, the schema, the
    reader and the encoder (as :func:`~torchrec_cowclip.data.pipeline.run_encoders.keep_encoder`
    returned it)."""
    kind = data.kind()
    opts = data.source_options()
    options = {f.name: jsonable(getattr(opts, f.name)) for f in fields(opts)}
    return {
        "kind": kind.name,
        "spec": data.spec,
        "test_spec": data.test_spec,
        "options": options,
        "schema": dataset.schema.to_json(),
        "reader": _reader(kind, data, opts),
        "encoder": dict(encoder),
        "dense_transforms": list(dataset.dense_transforms),
        "dense_plan": dataset.dense_plan.to_json(),
        "source_format": dataset.meta.get("source_format"),
        "rows": len(dataset),
    }


def _file_records(root: Path) -> Dict[str, Dict[str, Any]]:
    return {
        str(p.relative_to(root)): file_record(p, SHA256)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


class RunFolderWriter:
    """Writes ``<out>/model`` as the module docstring says; every rank calls
    :meth:`save_weights` and :meth:`complete` (DCP writes each rank's shards)."""

    def __init__(self, out: Union[str, Path], main: bool = True) -> None:
        self.final = Path(out) / MODEL_DIR
        self.tmp = Path(out) / f"{MODEL_DIR}.tmp"
        self.main = main
        self.weights: List[str] = []
        if main:
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            with space_checked(self.final, self._discard):
                (self.tmp / WEIGHTS_DIR).mkdir(parents=True)
        _barrier(f"run folder start {self.tmp}")

    def save_weights(self, name: str, state: Mapping[str, Any], prefix: str = "") -> None:
        """Writes the model's ``state`` (its ``state_dict``, keys without ``prefix``) as
        the weights ``name``.

        Raises:
            NonFiniteStateError: a weight is NaN or inf (nothing is written).
        """
        tensors = {WEIGHTS_KEY: {k[len(prefix) :]: v for k, v in state.items()}}
        target = self.tmp / WEIGHTS_DIR / name
        require_finite(tensors, target, lambda: "the run folder is not written")
        with space_checked(self.final, self._discard):
            if self.main:
                target.mkdir()
            _barrier(f"run folder weights {target}")
            with single_process_checkpoint():
                state_dict_saver.save(tensors, checkpoint_id=str(target))
        self.weights.append(name)

    def _discard(self) -> None:
        """Removes the unfinished folder (a failed write: nothing half-written stays)."""
        if self.main and self.tmp.exists():
            shutil.rmtree(self.tmp)

    def complete(self, model: Dict[str, Any], data_of: Callable[[Path], Dict[str, Any]]) -> Path:
        """Writes ``model.json``, the encoders and ``data.json`` (``data_of(encoders
        directory)`` writes the encoder files and returns ``data.json``), the manifest,
        and moves the folder into place (replacing a previous run's)."""
        if self.main:
            with space_checked(self.final, self._discard):
                encoders = self.tmp / ENCODERS_DIR
                encoders.mkdir()
                (self.tmp / DATA_FILE).write_text(json.dumps(data_of(encoders), indent=1))
                (self.tmp / MODEL_FILE).write_text(json.dumps(model, indent=1))
                manifest = {
                    "format": FORMAT,
                    "version": VERSION,
                    "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "torchrec_cowclip": __version__,
                    "files": _file_records(self.tmp),
                }
                (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if self.final.exists():
                shutil.rmtree(self.final)  # a resumed run's previous model (RUN_FILES)
            os.replace(self.tmp, self.final)
        _barrier(f"run folder completion {self.final}")
        return self.final


def encoder_writer(dataset: Any) -> Callable[[Path], Dict[str, Any]]:
    """Copies the dataset's encoder (its cache entry's ``meta["encoder"]``) into a run
    folder's encoders directory; returns the encoder's description."""

    def write(directory: Path) -> Dict[str, Any]:
        encoder = dataset.meta.get("encoder")
        if encoder is None:
            raise RunFolderError(
                f"cache entry {dataset.path} keeps no encoder (an older cache format): "
                "the run folder cannot be written"
            )
        kept = keep_encoder(Path(dataset.path), encoder, directory)
        if kept["vocabulary"] is not None:  # a file, relative to model/
            kept["vocabulary"] = f"{ENCODERS_DIR}/{kept['vocabulary']}"
        return kept

    return write


def _read_json(path: Path) -> Dict[str, Any]:
    """A description of the folder (:func:`~torchrec_cowclip.readback.read_json`: a plain
    file opened once, of at most :data:`MAX_DESCRIPTION_BYTES`, holding a JSON object)."""
    try:
        return read_json(path, MAX_DESCRIPTION_BYTES)
    except FileNotFoundError:
        raise RunFolderError(f"{path}: missing") from None
    except RefusedFileError as e:
        raise RunFolderError(str(e)) from None


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _member(model_dir: Path, name: Any, what: str, directory: bool = False) -> Path:
    """``model_dir / name`` where ``name`` is a relative path that stays inside the
    folder through plain directories to a plain file (``directory``: a plain
    directory); checked with ``lstat`` before anything is opened.

    Raises:
        RunFolderError: naming ``what`` named it and why it is refused.
    """
    text = name if isinstance(name, str) else ""
    parts = PurePosixPath(text).parts
    if (
        not text
        or PurePosixPath(text).is_absolute()
        or "\\" in text
        or "\0" in text
        or any(part in ("..", ".") for part in text.split("/"))
        or "/".join(parts) != text
    ):
        raise RunFolderError(
            f"{model_dir}: {what} names {name!r}: a run folder names its own files only "
            "(a relative path inside it, without '..')"
        )
    path = model_dir
    for i, part in enumerate(parts):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            raise RunFolderError(f"{path}: missing ({what} names it)") from None
        last = i == len(parts) - 1
        wanted = stat.S_ISDIR(mode) if directory or not last else stat.S_ISREG(mode)
        if not wanted:
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            if directory or not last:
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
            raise RunFolderError(
                f"{path}: {kind} ({what} names it; a run folder holds plain files and "
                "directories only)"
            )
    return path


def _check_tree(model_dir: Path, files: Mapping[str, Any]) -> None:
    """Refuses anything in the folder but plain files the manifest lists and plain
    directories: a link, a device, a FIFO, a socket, an unlisted file."""
    for top, dirs, names in os.walk(model_dir):
        for name in sorted(dirs + names):
            path = Path(top) / name
            mode = os.lstat(path).st_mode
            relative = str(path.relative_to(model_dir))
            if stat.S_ISLNK(mode):
                raise RunFolderError(
                    f"{path}: a symbolic link: a run folder holds plain files only; replace "
                    "it by the file itself"
                )
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise RunFolderError(
                    f"{path}: not a regular file (a device, FIFO or socket): remove it"
                )
            if relative != MANIFEST and relative not in files:
                raise RunFolderError(
                    f"{path}: not part of this run folder (not in its manifest); remove it"
                )


def _manifest_files(model_dir: Path, manifest: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The manifest's ``files`` after checking its format, version and records."""
    where = model_dir / MANIFEST
    if manifest.get("format") != FORMAT:
        raise RunFolderError(f"{where}: not a torchrec_cowclip run folder")
    version = manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RunFolderError(
            f"{where}: format version {version!r} is not a positive integer (a damaged or "
            "hand-edited manifest)"
        )
    if version > VERSION:
        raise RunFolderError(
            f"{model_dir}: run folder format version {version} (written by "
            f"torchrec_cowclip {manifest.get('torchrec_cowclip', '?')}); this "
            f"torchrec_cowclip {__version__} reads versions up to {VERSION}: score it with "
            "the version that trained it, or retrain"
        )
    digest = VERSION_DIGESTS[version]
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise RunFolderError(
            f"{where}: 'files' is {type(files).__name__}, not a mapping of the folder's "
            "files to their sizes and digests"
        )
    for name, record in files.items():
        if (
            not isinstance(record, dict)
            or set(record) != {"bytes", digest}
            or not isinstance(record["bytes"], int)
            or isinstance(record["bytes"], bool)
            or record["bytes"] < 0
            or not isinstance(record[digest], str)
        ):
            raise RunFolderError(
                f"{where}: the record of {name!r} is not {{'bytes': size, '{digest}': "
                f"digest}} (format version {version})"
            )
        _member(model_dir, name, f"{MANIFEST} 'files'")
    return dict(files)


def _model_dir(path: Path) -> Path:
    if (path / MODEL_DIR / MANIFEST).is_file():
        return path / MODEL_DIR
    if (path / MANIFEST).is_file() and (path / MODEL_FILE).is_file():
        return path
    hint = ""
    if (path / f"{MODEL_DIR}.tmp").exists() or (path / "checkpoints").is_dir():
        hint = (
            " (the run has not finished: a run writes model/ at its end; continue it with --resume)"
        )
    raise RunFolderError(f"{path}: not a run folder, no {MODEL_DIR}/{MANIFEST}{hint}")


class RunFolder:
    """A finished run's ``model/`` folder, verified against its manifest.

    Attributes:
        path: the run directory (``--out``).
        model_dir: its ``model/``.
        manifest, model_info, data_info: the parsed ``manifest.json``, ``model.json``,
            ``data.json``.
    """

    def __init__(self, model_dir: Path, manifest: Dict[str, Any]) -> None:
        self.model_dir = model_dir
        self.path = model_dir.parent if model_dir.name == MODEL_DIR else model_dir
        self.manifest = manifest
        self.model_info: Dict[str, Any] = _read_json(model_dir / MODEL_FILE)
        self.data_info: Dict[str, Any] = _read_json(model_dir / DATA_FILE)

    @classmethod
    def open(
        cls, path: Union[str, Path], verify: bool = True, require_sha256: bool = False
    ) -> "RunFolder":
        """Opens and verifies the run folder at ``path`` (the run's ``--out``, or its
        ``model/``), as the module docstring says; ``verify=False`` checks its shape and
        descriptions but neither the files' bytes nor the weights (nothing but the
        descriptions may be used then); ``require_sha256`` refuses a format-1 folder
        (CRC-32s, which an edit can be made to keep: docs/reliability.md).

        Raises:
            RunFolderError: not a run folder, another format or a newer version, a path
                that leaves the folder or is not a plain file, a file that does not
                match the manifest, a description this version does not write, sizes
                that the weights do not have (named, with the reason).
            UnsafeFileError: weights whose metadata could run code or reads outside
                its files.
        """
        model_dir = _model_dir(Path(path).expanduser())
        manifest = _read_json(model_dir / MANIFEST)
        files = _manifest_files(model_dir, manifest)
        if require_sha256 and VERSION_DIGESTS[manifest["version"]] != SHA256:
            raise RunFolderError(
                f"{model_dir / MANIFEST}: format version {manifest['version']} records "
                f"{VERSION_DIGESTS[manifest['version']]} digests, and --require-sha256 asks "
                "for SHA-256 (format 2): retrain with this version, or drop --require-sha256"
            )
        _check_tree(model_dir, files)
        for name in sorted(files) if verify else ():
            why = check_file(model_dir / name, files[name])
            if why is not None:
                raise RunFolderError(
                    f"{model_dir / name}: {why}: the run folder changed after training "
                    "(its manifest lists other bytes); restore the file or retrain"
                )
        for name in (MODEL_FILE, DATA_FILE):
            if name not in files:
                raise RunFolderError(f"{model_dir / name}: not in the manifest")
        folder = cls(model_dir, manifest)
        folder._check_descriptions()
        if verify:
            for name in sorted(folder.weights):
                folder.check_weights(name)
        return folder

    # --- checks ----------------------------------------------------------------------

    def _refuse(self, file: str, what: str) -> RunFolderError:
        return RunFolderError(
            f"{self.model_dir / file}: {what} (not what torchrec_cowclip {__version__} "
            "writes: a damaged, hand-edited or newer run folder)"
        )

    def _check_descriptions(self) -> None:
        """``model.json`` and ``data.json`` as :func:`describe_model` and
        :func:`describe_data` write them, and consistent with each other."""
        info, data = self.model_info, self.data_info
        for file, value, keys in (
            (MODEL_FILE, info, MODEL_KEYS),
            (DATA_FILE, data, DATA_KEYS),
        ):
            unknown, missing = sorted(set(value) - set(keys)), sorted(set(keys) - set(value))
            if unknown or missing:
                raise self._refuse(
                    file,
                    f"keys {unknown} are not known" if unknown else f"keys {missing} are missing",
                )
        if info["model"] not in MODEL_FACTORIES:
            raise self._refuse(
                MODEL_FILE, f"model {info['model']!r} is not one of {sorted(MODEL_FACTORIES)}"
            )
        arguments = _check_arguments(info["arguments"], lambda why: self._refuse(MODEL_FILE, why))
        for key, wanted in (("metrics", dict), ("config", dict), ("torchrec_cowclip", str)):
            if not isinstance(info[key], wanted):
                raise self._refuse(MODEL_FILE, f"'{key}' is not a {wanted.__name__}")
        if not _whole(info["eval_batch_size"], 1):
            raise self._refuse(
                MODEL_FILE, f"'eval_batch_size' is {_shown(info['eval_batch_size'])}, not >= 1"
            )
        weights = info["weights"]
        if not isinstance(weights, dict) or not weights or set(weights) - set(WEIGHT_NAMES):
            raise self._refuse(
                MODEL_FILE, f"weights {weights!r} are not a mapping of {WEIGHT_NAMES}"
            )
        if info["reported"] not in weights:
            raise self._refuse(
                MODEL_FILE, f"the reported weights {info['reported']!r} are not listed"
            )
        for name, where in weights.items():
            _member(self.model_dir, where, f"{MODEL_FILE} weights '{name}'", directory=True)
            if f"{where}/{METADATA_FILE}" not in self.manifest["files"]:
                raise self._refuse(
                    MODEL_FILE, f"weights '{name}' ({where}) hold no checkpoint metadata"
                )
        if data["kind"] not in source_kinds():
            raise self._refuse(
                DATA_FILE, f"data kind {data['kind']!r} is not one of {sorted(source_kinds())}"
            )
        try:
            kind = self.kind
            self.options()
            schema = Schema.from_json(data["schema"])
            plan = self.dense_plan()
            layout = self.text_layout()
        except RunFolderError:
            raise
        except Exception as e:  # any malformed field: one line naming it
            raise self._refuse(
                DATA_FILE, f"unreadable ({type(e).__name__}: {_reason(e)})"
            ) from None
        roundtrips = {
            "schema": (schema.to_json(), data["schema"]),
            "dense_plan": (jsonable(plan.to_json()), data["dense_plan"]),
        }
        if layout is not None:
            roundtrips["reader"] = (
                {"format": "text", "layout": jsonable(layout.payload())},
                data["reader"],
            )
        for key, (written, read) in roundtrips.items():
            if written != read:
                raise self._refuse(DATA_FILE, f"'{key}' holds fields this version does not know")
        if not all(math.isfinite(v) for v in (*plan.shift, *plan.scale)) or 0.0 in plan.scale:
            raise self._refuse(
                DATA_FILE, "the dense plan's shifts and scales must be finite (scales not 0)"
            )
        try:
            self._check_columns(kind, schema, plan, layout, arguments)
        except (KeyError, TypeError, ValueError) as e:  # a field of another shape
            raise self._refuse(
                DATA_FILE, f"unreadable ({type(e).__name__}: {_reason(e)})"
            ) from None
        encoder = data["encoder"]
        vocabulary = encoder.get("vocabulary") if isinstance(encoder, dict) else None
        if not isinstance(encoder, dict) or not isinstance(encoder.get("encoding"), dict):
            raise self._refuse(DATA_FILE, "'encoder' is not {'encoding': {...}, 'vocabulary': ...}")
        if vocabulary is not None:
            _member(self.model_dir, vocabulary, f"{DATA_FILE} encoder vocabulary")
            if vocabulary not in self.manifest["files"]:
                raise RunFolderError(
                    f"{self.model_dir / vocabulary}: not in the manifest ({DATA_FILE} names it)"
                )

    def _check_columns(
        self,
        kind: SourceKind,
        schema: Schema,
        plan: DensePlan,
        layout: Optional[TextLayout],
        arguments: Mapping[str, Any],
    ) -> None:
        """The columns and sizes agree between the schema, the reader, the dense plan
        and the model's arguments."""
        names = {
            "the dense plan's columns": (plan.names, schema.dense_names),
            "the model's categorical columns": (
                tuple(arguments["sparse_names"]),
                schema.sparse_names,
            ),
            "the model's table sizes": (
                tuple(arguments["cardinalities"]),
                schema.cardinalities,
            ),
            "the model's dense inputs": ((arguments["num_dense"],), (len(plan.output_names),)),
        }
        reader = self.reader
        # Each time column is read as two categoricals after the others (data.parsing.time).
        time = time_feature_names(self.time_columns())
        if layout is not None and isinstance(layout.label, str):
            names["the reader's dense columns"] = (
                tuple(map(str, layout.dense)),
                schema.dense_names,
            )
            names["the reader's categorical columns"] = (
                (*map(str, layout.sparse), *time),
                schema.sparse_names,
            )
        elif layout is not None:
            names["the reader's column counts"] = (
                (len(layout.dense), len(layout.sparse) + len(time)),
                (schema.n_dense, schema.n_sparse),
            )
        elif reader.get("format") == "parquet":
            names["the reader's dense columns"] = (tuple(reader["dense"]), schema.dense_names)
            names["the reader's categorical columns"] = (
                (*reader["sparse"], *time),
                schema.sparse_names,
            )
        transforms = tuple(self.data_info["dense_transforms"])
        names["the dense transforms"] = (transforms, plan.transforms)
        for what, (got, schema_has) in names.items():
            if tuple(got) != tuple(schema_has):
                shown = [(a, b) for a, b in zip(got, schema_has) if a != b][:1] or [
                    (len(got), len(schema_has))
                ]
                raise self._refuse(
                    DATA_FILE,
                    f"{what} disagree with the schema (first: {shown[0][0]!r} where the schema "
                    f"has {shown[0][1]!r})",
                )
        options = self.data_info["options"]
        for key, schema_has in (
            ("dense", schema.dense_names),
            ("sparse", schema.sparse_names[: schema.n_sparse - len(time)]),
        ):
            given = options.get(key)
            if given and tuple(given) != tuple(schema_has):
                raise self._refuse(
                    DATA_FILE, f"the data option {key} {given} disagrees with the schema's columns"
                )

    def check_weights(self, weights: Optional[str] = None) -> None:
        """Refuses ``weights`` whose tensors are not those of the model ``model.json``
        describes, before anything of the model is allocated. The checkpoint's metadata
        is read first (and checked against its files, :func:`~.safe_load.check_storage`);
        then no size argument may exceed the largest dimension it holds, nor a count
        (layers, columns) its number of tensors, which bounds what even a ``meta``
        build costs; then the model is built on the ``meta`` device and every shape
        compared.

        Raises:
            RunFolderError: a size beyond the weights', a tensor missing, extra or of
                another shape (the first named).
            UnsafeFileError: the weights' metadata.
        """
        path = self.weights_dir(weights)
        saved = self.saved_shapes(weights)
        arguments = self.model_arguments()

        def mismatch(what: str) -> RunFolderError:
            return RunFolderError(
                f"{self.model_dir / MODEL_FILE}: its arguments do not match the weights in "
                f"{path}: {what}; nothing was allocated"
            )

        largest = max((max(shape) for shape in saved.values() if shape), default=0)
        sizes = [
            ("num_dense", arguments["num_dense"]),
            ("embedding_dim", arguments["embedding_dim"]),
        ]
        sizes += [(f"cardinalities[{i}]", v) for i, v in enumerate(arguments["cardinalities"])]
        sizes += [(f"hidden[{i}]", v) for i, v in enumerate(arguments["hidden"])]
        for name, value in sizes:
            if value > largest:
                raise mismatch(f"'{name}' is {value}, larger than any dimension there ({largest})")
        counts = {
            "cross_layers": arguments["cross_layers"],
            "the hidden layers": len(arguments["hidden"]),
            "the categorical columns": len(arguments["sparse_names"]),
        }
        for name, value in counts.items():
            if value > len(saved):
                raise mismatch(f"{name} number {value}, more than its {len(saved)} tensors")
        compiled_update_mode()  # the environment's value refused as itself, not the folder
        try:
            expected = {
                k: tuple(v.shape)
                for k, v in self._build(torch.device("meta")).state_dict().items()
                if isinstance(v, torch.Tensor)
            }
        except Exception as e:  # arguments the factory refuses: one line naming the file
            raise self._refuse(
                MODEL_FILE, f"the model cannot be built from its arguments ({_reason(e)})"
            ) from None
        for key in sorted(set(expected) | set(saved)):
            if expected.get(key) != saved.get(key):
                raise mismatch(
                    f"'{key}' is {_shape(saved.get(key))} there, {_shape(expected.get(key))} "
                    "by the arguments"
                )

    # --- what it holds ------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return str(self.model_info["model"])

    @property
    def weights(self) -> Dict[str, str]:
        """Weights name (``final``, ``best``) -> its directory, relative to ``model/``."""
        return dict(self.model_info["weights"])

    @property
    def reported(self) -> str:
        """The weights whose test metrics the run reported (``metrics.json``)."""
        return str(self.model_info["reported"])

    @property
    def metrics(self) -> Dict[str, Any]:
        return dict(self.model_info.get("metrics", {}))

    @property
    def config(self) -> Dict[str, Any]:
        """The run's ``TrainConfig`` as a dict."""
        return dict(self.model_info["config"])

    @property
    def schema(self) -> Schema:
        return Schema.from_json(self.data_info["schema"])

    @property
    def kind(self) -> SourceKind:
        return source_kind(str(self.data_info["kind"]))

    def options(self, **overrides: Any) -> SourceOptions:
        """The kind's options dataclass as the run had it (``overrides`` replace fields).

        Raises:
            RunFolderError: an option this version does not know (a newer run folder).
        """
        kind = self.kind
        known = {f.name: f for f in fields(kind.options)}
        saved = dict(self.data_info["options"])
        unknown = sorted(set(saved) - set(known))
        if unknown:
            raise RunFolderError(
                f"{self.model_dir / DATA_FILE}: data options {unknown} are not known to "
                f"this version of torchrec_cowclip ({__version__})"
            )
        values = {k: _tuples(v) for k, v in saved.items()}
        values.update(overrides)
        return kind.options(**values)

    @property
    def reader(self) -> Dict[str, Any]:
        return dict(self.data_info["reader"])

    def text_layout(self) -> Optional[TextLayout]:
        """The layout the run's text files were read with (None for other readers)."""
        reader = self.reader
        if reader["format"] != "text":
            return None
        return TextLayout(**{k: _tuples(v) for k, v in reader["layout"].items()})

    def time_columns(self) -> Tuple[str, ...]:
        """The columns the run read as timestamps (``--time-columns``), by name."""
        return tuple(self.data_info["options"].get("time_columns") or ())

    def na_values(self) -> Tuple[str, ...]:
        """The texts the run read as missing values (``--na-values``), for new rows."""
        layout = self.text_layout()
        if layout is not None:
            return layout.na_values
        return tuple(self.reader.get("na_values") or ())

    def dense_plan(self) -> DensePlan:
        """The run's dense plan: raw dense values -> the model's dense inputs, as trained."""
        return DensePlan.from_json(self.data_info["dense_plan"])

    def encoder(self) -> SparseEncoding:
        """What encodes new rows' categoricals as the training rows'
        (:func:`~torchrec_cowclip.data.pipeline.run_encoders.restore_encoder`)."""
        hash_size = self.data_info["options"].get("hash_size")
        schema = self.schema
        encoding = restore_encoder(self.data_info["encoder"], schema, hash_size, self.model_dir)
        sizes = tuple(encoding.cardinalities())
        if sizes != tuple(schema.cardinalities):
            raise RunFolderError(
                f"{self.model_dir / DATA_FILE}: the encoder's table sizes {list(sizes)[:8]} "
                f"are not the schema's {list(schema.cardinalities)[:8]}: a damaged or "
                "hand-edited run folder"
            )
        return encoding

    def vocabulary_file(self) -> Optional[Path]:
        """The encoder's vocabulary file (checked by :meth:`open`: inside the folder, in
        its manifest), or None for an encoding without one."""
        kept = self.data_info["encoder"].get("vocabulary")
        return None if kept is None else self.model_dir / str(kept)

    def weights_dir(self, weights: Optional[str] = None) -> Path:
        """The directory of ``weights`` (default: :attr:`reported`).

        Raises:
            RunFolderError: the run has no such weights (naming those it has).
        """
        name = self.reported if weights is None else weights
        if name not in self.weights:
            raise RunFolderError(
                f"{self.path}: no '{name}' weights; it has {', '.join(sorted(self.weights))}"
                + (" (best weights are kept with --val-fraction)" if name == "best" else "")
            )
        return self.model_dir / self.weights[name]

    # --- the model ----------------------------------------------------------------------

    def model_arguments(self) -> Dict[str, Any]:
        return dict(self.model_info["arguments"])

    def build_model(
        self, weights: Optional[str] = None, device: Union[str, torch.device] = "cpu"
    ) -> CTRModel:
        """The trained model on ``device``, in eval mode, with ``weights`` loaded
        (default: the reported ones). Its tables are built as in training (the same
        backend and storage type) with no optimizer state."""
        model = self._build(torch.device(device))
        self.load_weights(model, weights)
        return model.eval()

    def _build(self, device: torch.device) -> CTRModel:
        return build_model(
            self.model_name,
            **self.model_arguments(),
            embedding_options=CowClipOptions(optimizer="sgd", cowclip=None),
            device=device,
        )

    def load_weights(self, model: torch.nn.Module, weights: Optional[str] = None) -> None:
        """Loads ``weights`` into ``model`` (whose tensors must have their shapes).

        Raises:
            CheckpointMismatchError: a tensor is missing or has another shape.
        """
        tensors = {WEIGHTS_KEY: model.state_dict()}
        self.read_weights(tensors, weights)
        model.load_state_dict(tensors[WEIGHTS_KEY])

    def read_weights(self, tensors: Dict[str, Any], weights: Optional[str] = None) -> None:
        """Loads ``weights`` in place into ``{"weights": state dict}`` (tensors or
        sharded tensors of the saved shapes)."""
        path = self.weights_dir(weights)
        CheckpointStore.check_fits(path, tensors)
        try:
            with single_process_checkpoint():
                state_dict_loader.load(
                    tensors,
                    storage_reader=SafeFileSystemReader(str(path)),
                    planner=SafeLoadPlanner(),
                )
        except CheckpointException as e:
            raise RunFolderError(
                f"{path}: the weights cannot be read ({os_reason(e)}); restore the run "
                "folder or retrain"
            ) from None

    def saved_shapes(self, weights: Optional[str] = None) -> Dict[str, Tuple[int, ...]]:
        """The saved tensors' shapes, keyed as the model's ``state_dict``."""
        meta = SafeFileSystemReader(str(self.weights_dir(weights))).read_metadata()
        prefix = WEIGHTS_KEY + "."
        return {
            key[len(prefix) :]: tuple(m.size)
            for key, m in meta.state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(m, "size")
        }

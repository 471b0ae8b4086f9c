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
  CRC-32.

:meth:`RunFolder.open` verifies every file against the manifest before anything is read,
and refuses another format, a newer version, a changed or an unlisted file in one line
(:class:`RunFolderError`). Nothing in it is read by a deserialiser that can run code:
JSON, ``np.load(allow_pickle=False)``, DCP through :mod:`.safe_load`. The folder does not
depend on ``--cache-dir`` (which may be deleted) nor on where it lies (move it anywhere).

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
import os
import shutil
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

from torchrec_cowclip._version import __version__
from torchrec_cowclip.data import parse_spec
from torchrec_cowclip.data.options import SourceOptions
from torchrec_cowclip.data.parsing.dense import DensePlan
from torchrec_cowclip.data.parsing.rows import TextLayout, TextRowSource
from torchrec_cowclip.data.pipeline.cache import check_file, file_record
from torchrec_cowclip.data.pipeline.dataset import kind_options
from torchrec_cowclip.data.pipeline.encode import SparseEncoding
from torchrec_cowclip.data.pipeline.run_encoders import keep_encoder, restore_encoder
from torchrec_cowclip.data.registry import SourceKind, source_kind
from torchrec_cowclip.data.schema import Schema
from torchrec_cowclip.data.sources.table import ParquetRowSource
from torchrec_cowclip.distributed.comm import run_collective
from torchrec_cowclip.models import build_model
from torchrec_cowclip.models.base import CTRModel
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.train.checkpoint import CheckpointStore, require_finite
from torchrec_cowclip.train.config import ConfigError, TrainConfig
from torchrec_cowclip.train.notices import single_process_checkpoint
from torchrec_cowclip.train.safe_load import SafeFileSystemReader, SafeLoadPlanner

MODEL_DIR = "model"
MANIFEST = "manifest.json"
MODEL_FILE = "model.json"
DATA_FILE = "data.json"
WEIGHTS_DIR = "weights"
ENCODERS_DIR = "encoders"
FORMAT = "torchrec_cowclip run folder"
#: The run-folder format this version writes and reads (a newer one is refused).
VERSION = 1
#: The key of the model's tensors in a weights checkpoint.
WEIGHTS_KEY = "weights"
#: How the weights a run reported are named: the last step's, or early stopping's best.
WEIGHT_NAMES = ("final", "best")

__all__ = [
    "MODEL_DIR",
    "RunFolder",
    "RunFolderError",
    "RunFolderWriter",
    "describe_data",
    "describe_model",
    "jsonable",
    "model_arguments",
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


def model_arguments(config: TrainConfig, schema: Schema, num_dense: int) -> Dict[str, Any]:
    """The arguments the trainer builds its model with (``build_model(config.model,
    **these)``), the training-only ones aside: what a run folder rebuilds it from.
    ``num_dense`` counts the dense plan's inputs (the columns and any missing-value
    indicators)."""
    return {
        "num_dense": int(num_dense),
        "sparse_names": list(schema.sparse_names),
        "cardinalities": list(schema.cardinalities),
        "embedding_dim": config.embedding_dim,
        "hidden": list(config.hidden),
        "cross_layers": config.cross_layers,
        "init_std": config.init_std,
        "embedding_backend": config.embedding_backend,
        "embedding_dtype": config.embedding_dtype,
        "init_seed": config.seed,
    }


def describe_model(
    config: TrainConfig,
    dataset: Any,
    metrics: Mapping[str, Any],
    weights: Sequence[str],
    reported: str,
) -> Dict[str, Any]:
    """``model.json``: the factory's arguments, the weights and the run's numbers."""
    inputs = len(dataset.dense_plan.output_names)
    return {
        "model": config.model,
        "arguments": model_arguments(config, dataset.schema, inputs),
        "weights": {name: f"{WEIGHTS_DIR}/{name}" for name in weights},
        "reported": reported,
        "metrics": {
            k: metrics.get(k)
            for k in ("auc", "logloss", "best_epoch", "epochs", "steps", "train_samples")
        },
        "eval_batch_size": config.eval_batch_size,
        "init_from": config.init_from,
        "config": jsonable(config.as_dict()),
        "torchrec_cowclip": __version__,
    }


def _reader(kind: SourceKind, config: TrainConfig, opts: SourceOptions) -> Dict[str, Any]:
    """How the training files were read: a text layout (delimiter, header, columns), a
    parquet file's columns, or the kind's own reader."""
    args = parse_spec(config.data)[1]
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
        }
    return {"format": kind.name}


def describe_data(config: TrainConfig, dataset: Any, encoder: Mapping[str, Any]) -> Dict[str, Any]:
    """``data.json``: the kind, every option of its options dataclass, the schema, the
    reader and the encoder (as :func:`~torchrec_cowclip.data.pipeline.run_encoders.keep_encoder`
    returned it)."""
    kind = config.source_kind()
    opts = kind_options(kind, config.data_options())
    options = {f.name: jsonable(getattr(opts, f.name)) for f in fields(opts)}
    return {
        "kind": kind.name,
        "spec": config.data,
        "test_spec": config.test_data,
        "options": options,
        "schema": dataset.schema.to_json(),
        "reader": _reader(kind, config, opts),
        "encoder": dict(encoder),
        "dense_transforms": list(dataset.dense_transforms),
        "dense_plan": dataset.dense_plan.to_json(),
        "source_format": dataset.meta.get("source_format"),
        "rows": len(dataset),
    }


def _file_records(root: Path) -> Dict[str, Dict[str, Any]]:
    return {
        str(p.relative_to(root)): file_record(p)
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
        if self.main:
            target.mkdir()
        _barrier(f"run folder weights {target}")
        with single_process_checkpoint():
            state_dict_saver.save(tensors, checkpoint_id=str(target))
        self.weights.append(name)

    def complete(self, model: Dict[str, Any], data_of: Callable[[Path], Dict[str, Any]]) -> Path:
        """Writes ``model.json``, the encoders and ``data.json`` (``data_of(encoders
        directory)`` writes the encoder files and returns ``data.json``), the manifest,
        and moves the folder into place (replacing a previous run's)."""
        if self.main:
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
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RunFolderError(f"{path}: unreadable ({_reason(e)})") from None
    if not isinstance(value, dict):
        raise RunFolderError(f"{path}: not a JSON object")
    return value


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__


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
    def open(cls, path: Union[str, Path], verify: bool = True) -> "RunFolder":
        """Opens and verifies the run folder at ``path`` (the run's ``--out``, or its
        ``model/``); ``verify=False`` reads its descriptions only (nothing else of it
        may be used then).

        Raises:
            RunFolderError: not a run folder, another format or a newer version, or a
                file that does not match the manifest (named, with the reason).
        """
        model_dir = _model_dir(Path(path).expanduser())
        manifest = _read_json(model_dir / MANIFEST)
        if manifest.get("format") != FORMAT:
            raise RunFolderError(f"{model_dir / MANIFEST}: not a torchrec_cowclip run folder")
        version = manifest.get("version")
        if not isinstance(version, int) or version > VERSION or version < 1:
            raise RunFolderError(
                f"{model_dir}: run folder format version {version} (written by "
                f"torchrec_cowclip {manifest.get('torchrec_cowclip', '?')}); this "
                f"torchrec_cowclip {__version__} reads version {VERSION}: score it with "
                "the version that trained it, or retrain"
            )
        files: Mapping[str, Mapping[str, Any]] = manifest.get("files", {})
        for name in sorted(files) if verify else ():
            why = check_file(model_dir / name, files[name])
            if why is not None:
                raise RunFolderError(
                    f"{model_dir / name}: {why}: the run folder changed after training "
                    "(its manifest lists other bytes); restore the file or retrain"
                )
        for p in sorted(model_dir.rglob("*")) if verify else ():
            relative = str(p.relative_to(model_dir))
            if p.is_file() and relative != MANIFEST and relative not in files:
                raise RunFolderError(
                    f"{p}: not part of this run folder (not in its manifest); remove it"
                )
        return cls(model_dir, manifest)

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
        return restore_encoder(self.data_info["encoder"], self.schema, hash_size, self.model_dir)

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
        arguments = self.model_arguments()
        model = build_model(
            self.model_name,
            **arguments,
            embedding_options=CowClipOptions(optimizer="sgd", cowclip=None),
            device=device,
        )
        self.load_weights(model, weights)
        return model.eval()

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
        with single_process_checkpoint():
            state_dict_loader.load(
                tensors, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner()
            )

    def saved_shapes(self, weights: Optional[str] = None) -> Dict[str, Tuple[int, ...]]:
        """The saved tensors' shapes, keyed as the model's ``state_dict``."""
        meta = SafeFileSystemReader(str(self.weights_dir(weights))).read_metadata()
        prefix = WEIGHTS_KEY + "."
        return {
            key[len(prefix) :]: tuple(m.size)
            for key, m in meta.state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(m, "size")
        }

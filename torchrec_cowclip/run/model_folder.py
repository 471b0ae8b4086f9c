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

One module per job: this one reads a folder (:class:`RunFolder`); :mod:`.folder_writer`
writes one, :mod:`.folder_checks` holds the checks above, :mod:`.folder_layout` its names.

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

from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.api import CheckpointException

from torchrec_cowclip._version import __version__
from torchrec_cowclip.data.parsing.dense import DensePlan
from torchrec_cowclip.data.parsing.rows import TextLayout
from torchrec_cowclip.data.parsing.time import time_feature_names, trend_feature_names
from torchrec_cowclip.data.pipeline.encode import SparseEncoding
from torchrec_cowclip.data.pipeline.run_encoders import restore_encoder
from torchrec_cowclip.data.registry import SourceKind, source_kind
from torchrec_cowclip.data.schema import Schema
from torchrec_cowclip.data.source_options import SourceOptions
from torchrec_cowclip.models import build_model
from torchrec_cowclip.models.base import CTRModel
from torchrec_cowclip.notices import single_process_checkpoint
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.readback import SHA256, check_file
from torchrec_cowclip.run.checkpoints import CheckpointStore, os_reason
from torchrec_cowclip.run.folder_checks import (
    check_descriptions,
    check_tree,
    check_weights,
    manifest_files,
    model_dir_of,
    read_description,
)
from torchrec_cowclip.run.folder_layout import (
    DATA_FILE,
    MANIFEST,
    MODEL_DIR,
    MODEL_FILE,
    VERSION_DIGESTS,
    WEIGHTS_KEY,
    RunFolderError,
    jsonable,
)
from torchrec_cowclip.run.folder_writer import (
    RunFolderWriter,
    describe_data,
    describe_model,
)
from torchrec_cowclip.run.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
)

# The reader, with the names of the layout (and the writer) it was the home of before
# the split: folder_layout.py, folder_writer.py, folder_checks.py.
__all__ = [
    "MANIFEST",
    "MODEL_DIR",
    "RunFolder",
    "RunFolderError",
    "RunFolderWriter",
    "describe_data",
    "describe_model",
    "jsonable",
]


def _tuples(value: Any) -> Any:
    """The inverse of :func:`jsonable` for dataclass fields: lists back to tuples."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _tuples(v) for k, v in value.items()}
    return value


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
        self.model_info: Dict[str, Any] = read_description(model_dir / MODEL_FILE)
        self.data_info: Dict[str, Any] = read_description(model_dir / DATA_FILE)

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
        model_dir = model_dir_of(Path(path).expanduser())
        manifest = read_description(model_dir / MANIFEST)
        files = manifest_files(model_dir, manifest)
        if require_sha256 and VERSION_DIGESTS[manifest["version"]] != SHA256:
            raise RunFolderError(
                f"{model_dir / MANIFEST}: format version {manifest['version']} records "
                f"{VERSION_DIGESTS[manifest['version']]} digests, and --require-sha256 asks "
                "for SHA-256 (format 2): retrain with this version, or drop --require-sha256"
            )
        check_tree(model_dir, files)
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
        check_descriptions(folder)
        if verify:
            for name in sorted(folder.weights):
                folder.check_weights(name)
        return folder

    def check_weights(self, weights: Optional[str] = None) -> None:
        """Refuses ``weights`` whose tensors are not those of the model ``model.json``
        describes, before anything of the model is allocated
        (:func:`~.folder_checks.check_weights`).

        Raises:
            RunFolderError: a size beyond the weights', a tensor missing, extra or of
                another shape (the first named).
            UnsafeFileError: the weights' metadata.
        """
        check_weights(self, weights)

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

    def trend_columns(self) -> Tuple[str, ...]:
        """The dense trend features of the time columns (``--time-trend``; the last dense
        columns), or none."""
        if not self.data_info["options"].get("time_trend"):
            return ()
        return tuple(trend_feature_names(self.time_columns()))

    def row_dense_columns(self) -> Tuple[str, ...]:
        """The dense columns a row to score holds: the model's dense inputs but the trend
        features, the last ones, which the time columns give."""
        names = self.schema.dense_names
        return names[: len(names) - len(self.trend_columns())]

    def row_categorical_columns(self) -> Tuple[str, ...]:
        """The categorical columns a row to score holds: the model's categorical features
        but each time column's hour and weekday, the last ones, which its timestamp gives."""
        names = self.schema.sparse_names
        return names[: len(names) - len(time_feature_names(self.time_columns()))]

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
        model = self.empty_model(torch.device(device))
        self.load_weights(model, weights)
        return model.eval()

    def empty_model(self, device: torch.device) -> CTRModel:
        """The model the arguments describe on ``device``, without weights."""
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

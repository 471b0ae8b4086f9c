"""Writes a finished run's ``<out>/model/`` (:class:`RunFolderWriter`): the weights, the
encoders, ``model.json`` and ``data.json`` (:func:`describe_model`, :func:`describe_data`)
and, last, the manifest, through ``model.tmp`` and one rename (the folder's contents:
:mod:`~torchrec_cowclip.run.model_folder`)."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence, Union

import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver

from torchrec_cowclip._version import __version__
from torchrec_cowclip.data import parse_spec
from torchrec_cowclip.data.parsing.rows import TextRowSource
from torchrec_cowclip.data.pipeline.run_encoders import keep_encoder
from torchrec_cowclip.data.registry import SourceKind
from torchrec_cowclip.data.settings import DataSettings
from torchrec_cowclip.data.source_options import SourceOptions
from torchrec_cowclip.data.sources.table import ParquetRowSource
from torchrec_cowclip.distributed.comm import run_collective
from torchrec_cowclip.models.spec import ModelSpec
from torchrec_cowclip.notices import single_process_checkpoint
from torchrec_cowclip.readback import SHA256, file_record
from torchrec_cowclip.run.checkpoints import require_finite
from torchrec_cowclip.run.folder_layout import (
    DATA_FILE,
    ENCODERS_DIR,
    FORMAT,
    MANIFEST,
    MODEL_DIR,
    MODEL_FILE,
    VERSION,
    WEIGHTS_DIR,
    WEIGHTS_KEY,
    RunFolderError,
    jsonable,
)
from torchrec_cowclip.run.no_space import space_checked


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(what: str) -> None:
    if _distributed():
        run_collective(what, None, dist.barrier)


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

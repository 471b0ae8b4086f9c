"""The checks of a run folder before anything of it is used (:meth:`RunFolder.open
<torchrec_cowclip.run.model_folder.RunFolder.open>` runs them): the paths it names, the
files it holds against its manifest, its descriptions as this version writes them and
consistent with each other, and its weights' shapes against the model its arguments
describe. Each refuses in one line naming the file (:class:`~.folder_layout.RunFolderError`).
``folder`` is a :class:`~torchrec_cowclip.run.model_folder.RunFolder`."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from torchrec_cowclip._version import __version__
from torchrec_cowclip.data.parsing.dense import DensePlan
from torchrec_cowclip.data.parsing.rows import TextLayout
from torchrec_cowclip.data.parsing.time import time_feature_names
from torchrec_cowclip.data.registry import SourceKind, source_kinds
from torchrec_cowclip.data.schema import Schema
from torchrec_cowclip.models import MODELS as MODEL_FACTORIES
from torchrec_cowclip.models.embeddings import EMBEDDING_BACKENDS, EMBEDDING_DTYPES
from torchrec_cowclip.optim.row_step import compiled_update_mode
from torchrec_cowclip.readback import RefusedFileError, read_json
from torchrec_cowclip.run.folder_layout import (
    ARGUMENTS,
    DATA_FILE,
    DATA_KEYS,
    FORMAT,
    MANIFEST,
    MAX_DESCRIPTION_BYTES,
    MODEL_DIR,
    MODEL_FILE,
    MODEL_KEYS,
    VERSION,
    VERSION_DIGESTS,
    WEIGHT_NAMES,
    RunFolderError,
    jsonable,
)
from torchrec_cowclip.run.safe_load import (
    METADATA_FILE,
)


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shape(shape: Optional[Tuple[int, ...]]) -> str:
    return "absent" if shape is None else str(list(shape))


def read_description(path: Path) -> Dict[str, Any]:
    """A description of the folder (:func:`~torchrec_cowclip.readback.read_json`: a plain
    file opened once, of at most :data:`MAX_DESCRIPTION_BYTES`, holding a JSON object)."""
    try:
        return read_json(path, MAX_DESCRIPTION_BYTES)
    except FileNotFoundError:
        raise RunFolderError(f"{path}: missing") from None
    except RefusedFileError as e:
        raise RunFolderError(str(e)) from None


def reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def member(model_dir: Path, name: Any, what: str, directory: bool = False) -> Path:
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


def check_tree(model_dir: Path, files: Mapping[str, Any]) -> None:
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


def manifest_files(model_dir: Path, manifest: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
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
        member(model_dir, name, f"{MANIFEST} 'files'")
    return dict(files)


def model_dir_of(path: Path) -> Path:
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


def check_arguments(arguments: Any, refuse: Callable[[str], RunFolderError]) -> Dict[str, Any]:
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


def refusal(folder: Any, file: str, what: str) -> RunFolderError:
    """The refusal of ``folder``'s ``file`` for ``what``."""
    return RunFolderError(
        f"{folder.model_dir / file}: {what} (not what torchrec_cowclip {__version__} "
        "writes: a damaged, hand-edited or newer run folder)"
    )


def check_descriptions(folder: Any) -> None:
    """``model.json`` and ``data.json`` as :func:`describe_model` and
    :func:`describe_data` write them, and consistent with each other."""
    info, data = folder.model_info, folder.data_info
    for file, value, keys in (
        (MODEL_FILE, info, MODEL_KEYS),
        (DATA_FILE, data, DATA_KEYS),
    ):
        unknown, missing = sorted(set(value) - set(keys)), sorted(set(keys) - set(value))
        if unknown or missing:
            raise refusal(
                folder,
                file,
                f"keys {unknown} are not known" if unknown else f"keys {missing} are missing",
            )
    if info["model"] not in MODEL_FACTORIES:
        raise refusal(
            folder, MODEL_FILE, f"model {info['model']!r} is not one of {sorted(MODEL_FACTORIES)}"
        )
    arguments = check_arguments(info["arguments"], lambda why: refusal(folder, MODEL_FILE, why))
    for key, wanted in (("metrics", dict), ("config", dict), ("torchrec_cowclip", str)):
        if not isinstance(info[key], wanted):
            raise refusal(folder, MODEL_FILE, f"'{key}' is not a {wanted.__name__}")
    if not _whole(info["eval_batch_size"], 1):
        raise refusal(
            folder, MODEL_FILE, f"'eval_batch_size' is {_shown(info['eval_batch_size'])}, not >= 1"
        )
    weights = info["weights"]
    if not isinstance(weights, dict) or not weights or set(weights) - set(WEIGHT_NAMES):
        raise refusal(
            folder, MODEL_FILE, f"weights {weights!r} are not a mapping of {WEIGHT_NAMES}"
        )
    if info["reported"] not in weights:
        raise refusal(
            folder, MODEL_FILE, f"the reported weights {info['reported']!r} are not listed"
        )
    for name, where in weights.items():
        member(folder.model_dir, where, f"{MODEL_FILE} weights '{name}'", directory=True)
        if f"{where}/{METADATA_FILE}" not in folder.manifest["files"]:
            raise refusal(
                folder, MODEL_FILE, f"weights '{name}' ({where}) hold no checkpoint metadata"
            )
    if data["kind"] not in source_kinds():
        raise refusal(
            folder, DATA_FILE, f"data kind {data['kind']!r} is not one of {sorted(source_kinds())}"
        )
    try:
        kind = folder.kind
        folder.options()
        schema = Schema.from_json(data["schema"])
        plan = folder.dense_plan()
        layout = folder.text_layout()
    except RunFolderError:
        raise
    except Exception as e:  # any malformed field: one line naming it
        raise refusal(folder, DATA_FILE, f"unreadable ({type(e).__name__}: {reason(e)})") from None
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
            raise refusal(folder, DATA_FILE, f"'{key}' holds fields this version does not know")
    if not all(math.isfinite(v) for v in (*plan.shift, *plan.scale)) or 0.0 in plan.scale:
        raise refusal(
            folder, DATA_FILE, "the dense plan's shifts and scales must be finite (scales not 0)"
        )
    try:
        check_columns(folder, kind, schema, plan, layout, arguments)
    except (KeyError, TypeError, ValueError) as e:  # a field of another shape
        raise refusal(folder, DATA_FILE, f"unreadable ({type(e).__name__}: {reason(e)})") from None
    encoder = data["encoder"]
    vocabulary = encoder.get("vocabulary") if isinstance(encoder, dict) else None
    if not isinstance(encoder, dict) or not isinstance(encoder.get("encoding"), dict):
        raise refusal(folder, DATA_FILE, "'encoder' is not {'encoding': {...}, 'vocabulary': ...}")
    if vocabulary is not None:
        member(folder.model_dir, vocabulary, f"{DATA_FILE} encoder vocabulary")
        if vocabulary not in folder.manifest["files"]:
            raise RunFolderError(
                f"{folder.model_dir / vocabulary}: not in the manifest ({DATA_FILE} names it)"
            )


def check_columns(
    folder: Any,
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
    reader = folder.reader
    # Each time column is read as two categoricals after the others (data.parsing.time).
    time = time_feature_names(folder.time_columns())
    # ... and, with --time-trend, one dense feature each after the dense columns.
    trend = folder.trend_columns()
    if layout is not None and isinstance(layout.label, str):
        names["the reader's dense columns"] = (
            (*map(str, layout.dense), *trend),
            schema.dense_names,
        )
        names["the reader's categorical columns"] = (
            (*map(str, layout.sparse), *time),
            schema.sparse_names,
        )
    elif layout is not None:
        names["the reader's column counts"] = (
            (len(layout.dense) + len(trend), len(layout.sparse) + len(time)),
            (schema.n_dense, schema.n_sparse),
        )
    elif reader.get("format") == "parquet":
        names["the reader's dense columns"] = ((*reader["dense"], *trend), schema.dense_names)
        names["the reader's categorical columns"] = (
            (*reader["sparse"], *time),
            schema.sparse_names,
        )
    transforms = tuple(folder.data_info["dense_transforms"])
    names["the dense transforms"] = (transforms, plan.transforms)
    for what, (got, schema_has) in names.items():
        if tuple(got) != tuple(schema_has):
            shown = [(a, b) for a, b in zip(got, schema_has) if a != b][:1] or [
                (len(got), len(schema_has))
            ]
            raise refusal(
                folder,
                DATA_FILE,
                f"{what} disagree with the schema (first: {shown[0][0]!r} where the schema "
                f"has {shown[0][1]!r})",
            )
    options = folder.data_info["options"]
    for key, schema_has in (
        ("dense", schema.dense_names[: schema.n_dense - len(trend)]),
        ("sparse", schema.sparse_names[: schema.n_sparse - len(time)]),
    ):
        given = options.get(key)
        if given and tuple(given) != tuple(schema_has):
            raise refusal(
                folder,
                DATA_FILE,
                f"the data option {key} {given} disagrees with the schema's columns",
            )


def check_weights(folder: Any, weights: Optional[str] = None) -> None:
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
    path = folder.weights_dir(weights)
    saved = folder.saved_shapes(weights)
    arguments = folder.model_arguments()

    def mismatch(what: str) -> RunFolderError:
        return RunFolderError(
            f"{folder.model_dir / MODEL_FILE}: its arguments do not match the weights in "
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
            for k, v in folder.empty_model(torch.device("meta")).state_dict().items()
            if isinstance(v, torch.Tensor)
        }
    except Exception as e:  # arguments the factory refuses: one line naming the file
        raise refusal(
            folder, MODEL_FILE, f"the model cannot be built from its arguments ({reason(e)})"
        ) from None
    for key in sorted(set(expected) | set(saved)):
        if expected.get(key) != saved.get(key):
            raise mismatch(
                f"'{key}' is {_shape(saved.get(key))} there, {_shape(expected.get(key))} "
                "by the arguments"
            )

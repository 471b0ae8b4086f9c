"""Warm start: ``train --init-from RUN`` trains on new data from a finished run's model.

CTR models are retrained on the next day's log, starting from yesterday's model. A
warm start takes from RUN's run folder (:mod:`torchrec_cowclip.run.model_folder`):

* its encoders: the new rows are encoded with RUN's vocabularies, whose ids never
  move, grown by the new values the new training rows hold at least ``--min-count``
  times (:class:`~torchrec_cowclip.data.pipeline.run_encoders.GrowingVocabulary`), and
  fed through RUN's dense plan (its transforms, with the statistics of RUN's training
  split: ``standardize`` and ``minmax`` keep RUN's scaling, the indicators RUN's);
* its weights (the reported ones): every tensor is loaded; a table that grew keeps
  RUN's rows and its new rows start as training initialises them (the counter-based
  initial weights of ``embedding.row_init``, a function of the seed, table and row);
* with ``--init-optimizer-state``, the optimizer state of RUN's last checkpoint
  (``checkpoints/latest``, found and verified with RUN, before anything is read or
  written): Adam's moments and step counts, the warm-up's progress; a grown table's
  new rows start with empty state.

Before anything is read or written the command is checked against RUN, and refused
in one line naming each difference: the data kind, the model (``--model``,
``--embedding-dim``, ``--hidden``, ``--cross-layers``, ``--embedding-backend``,
``--embedding-dtype``), and every data option but those that describe the files
rather than the model (``--on-bad-row``, ``--min-count``, ``--delimiter``,
``--no-header``, ``--columns``, the generator's seed). The new data's columns must be
RUN's. On the command line, the flags not given take RUN's values, every setting but the
new data, the output and this machine's resources (:func:`warm_start_defaults`), and
the run names them (:func:`inherited_line`); from Python, :func:`warm_start_config`
does the same.

Tables grow on one process; a sharded warm start needs tables of RUN's sizes (hashing,
``--hash-size``, never grows them).

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.train import TrainConfig, train
    >>> tmp = tempfile.mkdtemp()
    >>> run = dict(batch_size=512, progress=False, cache_dir=f"{tmp}/cache")
    >>> day1 = train(TrainConfig(data="synthetic:3000", synthetic_scale=0.001,
    ...                          synthetic_max_cardinality=200, hidden=(8,),
    ...                          out=f"{tmp}/day1", **run))
    >>> config = warm_start_config(day1.run_dir, data="synthetic:3000", synthetic_seed=1,
    ...                            out=f"{tmp}/day2", **run)
    >>> config.init_from == str(day1.run_dir), config.hidden, config.synthetic_scale
    (True, (8,), 0.001)
    >>> day2 = train(config)
    >>> day2["steps"]
    5
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import state_dict_loader

from torchrec_cowclip.data.errors import DataError
from torchrec_cowclip.data.parsing.dense import DensePlan
from torchrec_cowclip.data.pipeline.encode import Conversion, VocabularyEncoding
from torchrec_cowclip.data.pipeline.run_encoders import (
    AtLeastSizes,
    GrowingVocabulary,
    IdVocabulary,
)
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.notices import single_process_checkpoint
from torchrec_cowclip.run.checkpoints import (
    CHECKPOINTS_DIR,
    Checkpoint,
    CheckpointStore,
    _flat_tensors,
)
from torchrec_cowclip.run.folder_layout import jsonable
from torchrec_cowclip.run.model_folder import RunFolder
from torchrec_cowclip.run.safe_load import SafeFileSystemReader, SafeLoadPlanner
from torchrec_cowclip.train.config import TrainConfig, TrainSettings
from torchrec_cowclip.train.options import declarations

#: TrainConfig fields that make the model: a warm start must have RUN's.
ARCHITECTURE = (
    "model",
    "embedding_dim",
    "hidden",
    "cross_layers",
    "embedding_backend",
    "embedding_dtype",
)
#: Data options that describe the files, not the model: a warm start may change them.
FILE_OPTIONS = frozenset(
    {"on_bad_row", "min_count", "delimiter", "seed", "header", "columns", "na_values"}
)
#: Data options whose TrainConfig field is not their flag's name, and how a value of the
#: option reads there (``TrainConfig.data_options`` the other way round).
_OPTION_FIELDS: Dict[str, Tuple[str, Callable[[Any], Any]]] = {
    "header": ("no_header", lambda header: not header),
}
#: Data options a warm start does not take from RUN (the new files' own).
_NOT_INHERITED = frozenset({"on_bad_row", "seed"})
#: TrainConfig fields a warm start never takes from RUN (declared ``inherited=False``):
#: the new data, where this run writes and resumes, the warm start itself, and this
#: machine's resources.
NOT_INHERITED_SETTINGS = frozenset(
    option.name for option in declarations(TrainConfig) if not option.option.inherited
)
#: The prefix of the model's keys in the trainer's state (its ``CTRTrainTask``).
TASK_PREFIX = "model."


class WarmStartRefused(ConfigError):
    """``--init-from`` with a command, data or model that does not fit RUN."""


def _flag_of(option: "dataclasses.Field[Any]") -> str:
    return str(option.metadata.get("flag") or option.name)


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "none"
    return "none" if value is None else str(value)


def warm_start_defaults(path: Union[str, Path]) -> Dict[str, Any]:
    """TrainConfig values a warm start from ``path`` takes from RUN where the command
    does not give them: every setting of RUN's (the model, the batch size and recipe, the
    optimizer, the validation split, the epochs, the seed, ...) and its data options, but
    :data:`NOT_INHERITED_SETTINGS` (the new data, the output, this machine's resources),
    the bad-row policy and the generator's seed."""
    run = RunFolder.open(path, verify=False)  # the trainer verifies it before any use
    config, data = run.config, run.data_info
    own = {option.name for option in declarations(TrainConfig)}
    defaults = {
        name: value
        for name, value in config.items()
        if name in own and name not in NOT_INHERITED_SETTINGS
    }
    defaults.update({name: config[name] for name in (*ARCHITECTURE, "init_std")})
    if config["embedding_backend"] != "cowclip":
        defaults["cowclip"] = False
    for option in fields(run.kind.options):
        flag = option.metadata.get("flag")
        value = data["options"].get(option.name)
        if not flag or value is None or option.name in _NOT_INHERITED:
            continue
        name, read = _OPTION_FIELDS.get(option.name, (flag[2:].replace("-", "_"), _same))
        if name in own:
            defaults[name] = read(value)
    return defaults


def _same(value: Any) -> Any:
    return value


def inherited_line(path: Union[str, Path], inherited: Mapping[str, Any]) -> Optional[str]:
    """One line naming the settings a warm start took from RUN (``inherited``: flag
    field -> value), or None when it took none.

    Example::

        >>> inherited_line("runs/day1", {"batch_size": 2048, "hidden": [32, 16]})
        'from --init-from runs/day1 (flags not given): --batch-size 2048, --hidden 32,16'
        >>> inherited_line("runs/day1", {"cowclip": False})
        'from --init-from runs/day1 (flags not given): --no-cowclip'
    """
    if not inherited:
        return None
    options = {option.name: option for option in declarations(TrainConfig)}
    shown = ", ".join(
        options[name].flag
        if options[name].form in ("switch", "off")
        else f"{options[name].flag} {_shown(value)}"
        for name, value in inherited.items()
    )
    return f"from --init-from {path} (flags not given): {shown}"


def warm_start_config(path: Union[str, Path], **overrides: Any) -> TrainConfig:
    """A :class:`TrainConfig` that warm-starts from ``path``: RUN's model and data
    settings (:func:`warm_start_defaults`), then ``overrides``."""
    return TrainConfig.from_dict({**warm_start_defaults(path), "init_from": str(path), **overrides})


class RunEncoders:
    """RUN's encoders as an ``open_dataset(encoders=...)`` override (see the module
    docstring): its vocabularies grown, or its table sizes kept."""

    def __init__(self, run: RunFolder, min_count: int) -> None:
        self.run, self.min_count = run, int(min_count)
        kept = run.vocabulary_file()
        self.vocabulary: Optional[IdVocabulary] = None if kept is None else IdVocabulary.load(kept)

    def key(self) -> Dict[str, Any]:
        files = self.run.manifest["files"]
        return {
            "run_encoders": {n: r for n, r in sorted(files.items()) if n.startswith("encoders/")},
            "cardinalities": list(self.run.schema.cardinalities),
            "min_count": self.min_count,
        }

    def apply(self, conversion: Conversion) -> Conversion:
        check_columns(self.run, *conversion.source.names(conversion.train[0]))
        encoding = conversion.encoding
        if self.vocabulary is not None:
            if not isinstance(encoding, VocabularyEncoding):
                raise WarmStartRefused(
                    f"--init-from {self.run.path}: RUN encoded its categoricals with a "
                    f"vocabulary, this command with {encoding.describe()['kind']}"
                )
            grown = GrowingVocabulary(self.vocabulary, self.min_count)
            return dataclasses.replace(conversion, encoding=grown)
        sized = AtLeastSizes(encoding, self.run.schema.cardinalities)
        return dataclasses.replace(conversion, encoding=sized)


def check_columns(run: RunFolder, dense: List[str], sparse: List[str]) -> None:
    """Refuses new data whose dense or categorical columns are not RUN's."""
    schema = run.schema
    for what, new, old in (
        ("dense", list(dense), list(schema.dense_names)),
        ("categorical", list(sparse), list(schema.sparse_names)),
    ):
        if new != old:
            raise DataError(
                f"--init-from {run.path}: the new data's {what} columns {new} are not "
                f"RUN's {old} (a warm start needs the same schema)"
            )


class WarmStart:
    """A verified RUN for ``--init-from`` and the checks of a command against it.

    Attributes:
        optimizer_checkpoint: with ``--init-optimizer-state``, RUN's last checkpoint
            (verified), whose optimizer state :meth:`load_into` loads; else None.
    """

    def __init__(
        self,
        run: RunFolder,
        settings: TrainSettings,
        optimizer_checkpoint: Optional[Checkpoint] = None,
    ) -> None:
        self.run, self.settings = run, settings
        self.encoders = RunEncoders(run, settings.data.options["min_count"])
        self.optimizer_checkpoint = optimizer_checkpoint

    @classmethod
    def open(cls, settings: TrainSettings) -> "WarmStart":
        """Opens (verifies) ``--init-from`` and checks the command against it; with
        ``--init-optimizer-state``, also finds (verifies) RUN's last checkpoint, so that
        a RUN without one is refused before anything is read or written.

        Raises:
            RunFolderError: RUN is not an intact run folder.
            WarmStartRefused: the command differs from RUN where it must not (every
                difference named with both values), RUN is ``--out``, or
                ``--init-optimizer-state`` and RUN has no checkpoint.
            DamagedCheckpointError: ``--init-optimizer-state`` and every checkpoint of
                RUN's is damaged.
        """
        init_from, out = settings.run.init_from, settings.run.out
        assert init_from is not None
        path = Path(init_from).expanduser()
        if out is not None and path.resolve() == Path(out).expanduser().resolve():
            raise WarmStartRefused(
                f"--init-from {path} is this run's --out: write the warm-started run "
                "to another --out"
            )
        run = RunFolder.open(path, require_sha256=settings.run.require_sha256)
        check_command(run, settings)
        if not settings.run.init_optimizer_state:
            return cls(run, settings)
        store = CheckpointStore(run.path / CHECKPOINTS_DIR)
        checkpoint = store.intact("latest")
        if checkpoint is None:
            raise WarmStartRefused(
                f"--init-optimizer-state: {run.path} has no checkpoint to take the "
                f"optimizer state from ({store.root} is empty or gone): drop the flag"
            )
        return cls(run, settings, checkpoint)

    def check_dataset(self, dataset: Any) -> None:
        """Refuses a converted dataset whose schema is not RUN's, grown."""
        schema, old = dataset.schema, self.run.schema
        check_columns(self.run, list(schema.dense_names), list(schema.sparse_names))
        smaller = [
            f"{n} {a} < {b}"
            for n, a, b in zip(schema.sparse_names, schema.cardinalities, old.cardinalities)
            if a < b
        ]
        if smaller:
            raise WarmStartRefused(
                f"--init-from {self.run.path}: the new data's tables are smaller than "
                f"RUN's ({', '.join(smaller)})"
            )

    def keep_dense_plan(self, dataset: Any) -> DensePlan:
        """Puts RUN's dense plan on ``dataset`` (its model's inputs: RUN's transforms,
        statistics and indicators, not the new rows') and returns it.

        Raises:
            WarmStartRefused: the new data's dense columns take other transforms.
        """
        plan = self.run.dense_plan()
        transforms = tuple(dataset.dense_transforms)
        if (tuple(dataset.schema.dense_names), transforms) != (plan.names, plan.transforms):
            raise WarmStartRefused(
                f"--init-from {self.run.path}: RUN's dense columns {list(plan.names)} took "
                f"{list(plan.transforms)}, the new data's {list(dataset.schema.dense_names)} "
                f"take {list(transforms)}"
            )
        # The start line names what the statistics were taken over: RUN's rows, not these.
        plan = dataclasses.replace(
            plan, fitted_on=f"{plan.fitted_on or 'its rows'} of --init-from {self.run.path}"
        )
        dataset.dense_plan = plan
        return plan

    def load_into(self, runtime: Any) -> str:
        """Loads RUN's weights (and, with ``--init-optimizer-state``, the optimizer state of
        the checkpoint :meth:`open` found) into ``runtime``'s model; returns the line the
        run logs."""
        checkpoint = self.optimizer_checkpoint
        state = runtime.model_tensors()["model"]
        mine = {k[len(TASK_PREFIX) :]: v for k, v in state.items()}
        grown = _load_grown(
            mine,
            self.run.saved_shapes(),
            lambda target: self.run.read_weights({"weights": target}),
            runtime.world_size,
            f"--init-from {self.run.path}",
        )
        runtime.train_module.load_state_dict(state)
        said = f"initialised from {self.run.path} ({self.run.reported} weights"
        if grown:
            shown = [f"{k.split('.')[-2]} {a}->{b}" for k, (a, b) in grown.items()]
            more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
            said += f"; {len(shown)} tables grew (rows: {', '.join(shown[:3])}{more})"
        if checkpoint is not None:
            said += "; optimizer state of " + self._load_optimizer(runtime, checkpoint)
        return said + ")"

    def _load_optimizer(self, runtime: Any, checkpoint: Checkpoint) -> str:
        runtime.prepare_optimizer_state()
        full = runtime.optimizer.state_dict()
        target = {"optimizer": {"state": full["state"]}}
        meta = SafeFileSystemReader(str(checkpoint.path)).read_metadata().state_dict_metadata
        saved = {k: tuple(m.size) for k, m in meta.items() if hasattr(m, "size")}

        def read(into: Dict[str, Any]) -> None:
            with single_process_checkpoint():
                state_dict_loader.load(
                    into,
                    storage_reader=SafeFileSystemReader(str(checkpoint.path)),
                    planner=SafeLoadPlanner(),
                )

        flat = _flat_tensors(target)
        _load_grown(flat, saved, read, runtime.world_size, "--init-optimizer-state")
        runtime.optimizer.load_state_dict(full)
        return str(checkpoint.path)


def check_command(run: RunFolder, settings: TrainSettings) -> None:
    """Refuses, naming every difference with both values, a command whose data kind,
    model or model-making data options are not RUN's."""
    saved = run.config
    diffs: List[Tuple[str, str, str]] = []
    kind = settings.data.kind()
    if kind.name != run.kind.name:
        diffs.append(("the data kind", f"{run.kind.name}:", f"{kind.name}:"))
    for name in ARCHITECTURE:
        # The record holds the options as model.json's config does (plain JSON types).
        mine = settings.record[name]
        if name in saved and saved[name] != mine:
            diffs.append(("--" + name.replace("_", "-"), _shown(saved[name]), _shown(mine)))
    if kind.name == run.kind.name:
        try:
            options = settings.data.source_options()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for option in fields(options):
            if option.name in FILE_OPTIONS:
                continue
            old = run.data_info["options"].get(option.name)
            new = jsonable(getattr(options, option.name))
            if old != new:
                diffs.append((_flag_of(option), _shown(old), _shown(new)))
    if diffs:
        (what, old, new), rest = diffs[0], diffs[1:]
        raise WarmStartRefused(
            f"--init-from {run.path}: RUN was trained with {what} {old}, this command has "
            f"{new}" + "".join(f"; {w} {o} vs {n}" for w, o, n in rest)
        )


def _load_grown(
    target: Mapping[str, Any],
    saved: Mapping[str, Tuple[int, ...]],
    read: Callable[[Dict[str, Any]], None],
    world_size: int,
    what: str,
) -> Dict[str, Tuple[int, int]]:
    """Loads saved tensors (``read(into)`` fills a dict keyed like ``target``) into
    ``target``'s tensors in place; a tensor whose first dimension grew takes the saved
    rows first and keeps the rest. Returns ``{key: (saved rows, rows)}`` of those.

    Raises:
        WarmStartRefused: a tensor missing, of another shape than the saved one grown,
            or grown under sharding.
    """
    grown: Dict[str, Tuple[int, int]] = {}
    for key, value in target.items():
        shape = tuple(value.size())
        old = saved.get(key)
        if old is None:
            raise WarmStartRefused(f"{what}: RUN has no tensor {key!r} (another model?)")
        if old == shape:
            continue
        if len(old) != len(shape) or old[1:] != shape[1:] or old[0] > shape[0]:
            raise WarmStartRefused(f"{what}: {key!r} is {list(old)} in RUN and {list(shape)} here")
        grown[key] = (old[0], shape[0])
    if not grown:
        read(dict(target))
        return grown
    if world_size > 1:
        first = next(iter(grown))
        raise WarmStartRefused(
            f"{what}: tables grow ({first}: {grown[first][0]} -> {grown[first][1]} rows) and "
            f"this run is sharded over {world_size} processes: warm-start on one process, "
            "or keep the tables' sizes (--hash-size)"
        )
    old_tensors = {
        k: (torch.empty(saved[k], dtype=v.dtype) if k in grown else v) for k, v in target.items()
    }
    read(old_tensors)
    with torch.no_grad():
        for key, (rows, _) in grown.items():
            target[key][:rows].copy_(old_tensors[key])
    return grown

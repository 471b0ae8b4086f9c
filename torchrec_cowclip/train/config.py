"""Everything a training run is configured by, validated in one place, and resolved once.

:class:`TrainConfig` is the run's options as the command line (or a Python caller) gives
them, flat. :meth:`TrainConfig.resolve` turns them, once, into what each part of a run
consumes, and nothing else: the data to read (:class:`~torchrec_cowclip.data.settings.DataSettings`),
the model to build (:class:`~torchrec_cowclip.models.spec.ModelSpec`), the optimizers
(:class:`OptimizerSettings`: the tables' :class:`~torchrec_cowclip.optim.options.CowClipOptions`
and the dense Adam's lr and warm-up, the scaling recipe applied) and the loop's
(:class:`RunSettings`), with the record a run writes of its options (:class:`TrainSettings`).

Example::

    >>> settings = TrainConfig(data="synthetic:100000", batch_size=8192).resolve()
    >>> settings.optimizers.embedding.lr, round(settings.optimizers.dense_lr, 6)
    (0.0001, 0.002263)
    >>> settings.model.name, settings.data.options["seed"], settings.run.epochs
    ('deepfm', 0, 1)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from torchrec_cowclip.data.settings import DataSettings
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.models import MODELS as MODEL_FACTORIES
from torchrec_cowclip.models.spec import ModelSpec
from torchrec_cowclip.optim.options import CowClip, CowClipOptions, Helen
from torchrec_cowclip.optim.row_step import compiled_update_mode
from torchrec_cowclip.optim.rules import OPTIMIZERS
from torchrec_cowclip.process_context import ONE_PROCESS, ProcessContext
from torchrec_cowclip.train.scaling import RECIPES, ScaledHyperparameters, scale_hyperparameters

#: The CLI's choices, read from the registries they select from.
MODELS = tuple(MODEL_FACTORIES)
EMBEDDING_OPTIMIZERS = OPTIMIZERS  # live: a registered update rule is a choice too


@dataclass
class TrainConfig:
    """Options of ``torchrec-cowclip train`` (see ``--help`` for each).

    ``lr``, ``lr_embed``, ``l2``, ``clip_r``, ``clip_zeta``, ``warmup_epochs`` left as
    None take the values of the scaling recipe ``recipe`` (default ``paper``, the paper's
    rule; :mod:`torchrec_cowclip.train.scaling`).

    Example::

        >>> cfg = TrainConfig(model="deepfm", data="synthetic:100000", batch_size=8192,
        ...                   out="runs/demo")
        >>> cfg.validate()
    """

    model: str = "deepfm"
    data: str = "synthetic:200000"
    # None: a new runs/<YYYYmmdd-HHMMSS> (torchrun: runs/torchrun-<run id>), see run_dir.
    out: Optional[str] = None
    test_data: Optional[str] = None
    batch_size: int = 1024
    base_batch_size: int = 1024
    # None: the data kind's default (DATA_DEFAULTS: 1 for the paper's data, more with early
    # stopping for table:), as are val_fraction and early_stop_patience.
    epochs: Optional[int] = None
    lr: Optional[float] = None
    lr_embed: Optional[float] = None
    l2: Optional[float] = None
    clip_r: Optional[float] = None
    clip_zeta: Optional[float] = None
    warmup_epochs: Optional[float] = None
    count_lr_power: Optional[float] = None
    recipe: str = "paper"
    cowclip: bool = True
    embedding_backend: str = "cowclip"
    embedding_optimizer: str = "adam"
    embedding_dtype: str = "fp32"
    embedding_dim: int = 10
    hidden: Tuple[int, ...] = (400, 400, 400)
    cross_layers: int = 3
    init_std: float = 1e-2
    seed: int = 0
    test_fraction: float = 0.1
    val_fraction: Optional[float] = None
    early_stop_patience: Optional[int] = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    # False, True (--resume) or "auto" (--resume auto: resume if there is a checkpoint).
    resume: Union[bool, str] = False
    overwrite: bool = False
    max_steps: int = 0
    eval_batch_size: int = 65536
    cache_dir: str = "data_cache"
    on_bad_row: str = "error"
    hash_size: Optional[int] = None
    min_count: int = 1
    # None: the data kind's default (log for the Criteo layouts, signed-log for tables).
    dense_transform: Optional[str] = None
    missing_indicator: bool = False
    label: Optional[str] = None
    dense: List[str] = field(default_factory=list)
    sparse: List[str] = field(default_factory=list)
    delimiter: Optional[str] = None
    no_header: bool = False
    columns: List[str] = field(default_factory=list)
    na_values: List[str] = field(default_factory=list)
    time_columns: List[str] = field(default_factory=list)
    synthetic_scale: Optional[float] = None
    synthetic_max_cardinality: Optional[int] = None
    synthetic_seed: Optional[int] = None
    device: str = "auto"
    threads: int = 0
    progress: bool = True
    log_every: int = 20
    row_clip_stats: bool = False
    helen_rho: Optional[float] = None
    helen_bound: Optional[float] = None
    helen_perturb_dense: bool = False
    sharding: str = "auto"
    dist_timeout_s: float = 300.0
    # Warm start (train.warm_start): the weights and encoders of a finished run's folder.
    init_from: Optional[str] = None
    init_optimizer_state: bool = False
    require_sha256: bool = False

    def with_data_defaults(self) -> Tuple["TrainConfig", Optional[str]]:
        """This config with the options left None that depend on the data kind filled in
        (:data:`DATA_DEFAULTS`), and the line that says which were chosen and why (None
        when none was chosen for the kind's sake: the paper's data keeps the paper's).

        Example::

            >>> cfg, said = TrainConfig(data="table:x.csv", epochs=3).with_data_defaults()
            >>> cfg.epochs, cfg.val_fraction, cfg.early_stop_patience, cfg.lr_embed
            (3, 0.1, 2, 0.01)
            >>> TrainConfig(data="synthetic:1000").with_data_defaults()[0].epochs
            1
        """
        kind = self.data.partition(":")[0].strip().lower()
        table = kind in DATA_DEFAULTS
        defaults = DATA_DEFAULTS.get(kind, PAPER_DEFAULTS)
        chosen = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        val = chosen.get("val_fraction", self.val_fraction)
        if "early_stop_patience" in chosen and not val:
            chosen["early_stop_patience"] = 0  # no validation split to stop on
        filled = replace(self, **chosen)
        shown = {k: v for k, v in chosen.items() if k in defaults and v != PAPER_DEFAULTS.get(k)}
        if not table or not shown:
            return filled, None
        return filled, (
            f"defaults for your own table (flags not given): {_shown_defaults(shown)}: a "
            "log of thousands to millions of rows needs more than the paper's one epoch at "
            "its Criteo lr (1e-4); the validation split picks the epoch and keeps its "
            "weights (README: your first model on your own data)"
        )

    def validate(self, process: Optional[ProcessContext] = None) -> None:
        """Raises :class:`ConfigError` naming the first bad option (the data kind's
        defaults filled in first: :meth:`with_data_defaults`); ``process``: the launch
        the run is checked against (default: this process's,
        :meth:`ProcessContext.from_environment`)."""
        if self.epochs is None or self.val_fraction is None or self.early_stop_patience is None:
            self.with_data_defaults()[0].validate(process)
            return
        if self.model not in MODELS:
            raise ConfigError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.count_lr_power and self.embedding_backend != "cowclip":
            raise ConfigError(
                "--count-lr-power sets the fused update's per-row lr: use "
                "--embedding-backend cowclip"
            )
        if self.row_clip_stats and self.embedding_backend != "cowclip":
            raise ConfigError(
                "--row-clip-stats counts the CowClip update's clips: use "
                "--embedding-backend cowclip"
            )
        self._validate_helen()
        if self.embedding_optimizer not in EMBEDDING_OPTIMIZERS:
            raise ConfigError(
                f"--embedding-optimizer must be one of {', '.join(EMBEDDING_OPTIMIZERS)}, "
                f"got {self.embedding_optimizer!r}"
            )
        positive = {
            "--batch-size": self.batch_size,
            "--base-batch-size": self.base_batch_size,
            "--epochs": self.epochs,
            "--embedding-dim": self.embedding_dim,
            "--eval-batch-size": self.eval_batch_size,
            "--keep-checkpoints": self.keep_checkpoints,
            "--log-every": self.log_every,
            "--cross-layers": self.cross_layers,
        }
        for flag, count in positive.items():
            if count <= 0:
                raise ConfigError(f"{flag} must be > 0, got {count}")
        non_negative = {
            "--early-stop-patience": self.early_stop_patience,
            "--checkpoint-every": self.checkpoint_every,
            "--max-steps": self.max_steps,
            "--init-std": self.init_std,
            "--threads": self.threads,
        }
        for flag, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{flag} must be >= 0, got {value}")
        self._validate_numbers()
        if self.recipe not in RECIPES:
            raise ConfigError(f"--recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        unclipped = "--no-cowclip" if not self.cowclip else None
        if not RECIPES[self.recipe].cowclip:
            unclipped = f"--recipe {self.recipe} (no clip)"
        if unclipped:
            for flag, clip in (("--clip-r", self.clip_r), ("--clip-zeta", self.clip_zeta)):
                if clip is not None:
                    raise ConfigError(f"{flag} {clip:g} has no effect with {unclipped}: drop one")
        if self.resume not in (False, True, "auto"):
            raise ConfigError(f"--resume takes no value or 'auto', got {self.resume!r}")
        if self.init_optimizer_state and not self.init_from:
            raise ConfigError("--init-optimizer-state carries --init-from's optimizer: give both")
        if self.require_sha256 and not self.init_from:
            raise ConfigError("--require-sha256 applies to --init-from's run folder: give both")
        if self.init_from is not None and not str(self.init_from).strip():
            raise ConfigError("--init-from needs a run directory, got an empty one")
        if self.resume and self.overwrite:
            raise ConfigError(
                "--resume continues the run in --out, --overwrite deletes it: give one"
            )
        for flag, seed in (("--seed", self.seed), ("--synthetic-seed", self.synthetic_seed)):
            if seed is not None and not 0 <= seed < 2**32:
                raise ConfigError(f"{flag} must be in [0, 2**32), got {seed}")
        if not 0.0 <= self.test_fraction < 1.0:
            raise ConfigError(f"--test-fraction must be in [0, 1), got {self.test_fraction}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.early_stop_patience and self.val_fraction <= 0.0:
            raise ConfigError("--early-stop-patience needs a validation split: set --val-fraction")
        if self.test_data is None and self.test_fraction <= 0.0:
            raise ConfigError("no test set: give --test-data or a --test-fraction > 0")
        if self.embedding_backend not in ("cowclip", "torchrec"):
            raise ConfigError(
                f"--embedding-backend must be cowclip or torchrec, got {self.embedding_backend!r}"
            )
        if self.embedding_backend == "torchrec" and self.cowclip and RECIPES[self.recipe].cowclip:
            raise ConfigError("--embedding-backend torchrec has no CowClip: add --no-cowclip")
        if self.embedding_dtype not in ("fp32", "fp16", "bf16"):
            raise ConfigError(
                f"--embedding-dtype must be fp32, fp16 or bf16, got {self.embedding_dtype!r}"
            )
        if self.embedding_dtype != "fp32" and self.embedding_backend != "cowclip":
            raise ConfigError(
                f"--embedding-dtype {self.embedding_dtype} needs --embedding-backend cowclip"
            )
        self._validate_data()
        from torchrec_cowclip.train.processes import SHARDING_CHOICES

        if self.sharding not in SHARDING_CHOICES:
            raise ConfigError(
                f"--sharding must be one of {', '.join(SHARDING_CHOICES)}, got {self.sharding!r}"
            )
        if self.dist_timeout_s <= 0:
            raise ConfigError(f"--dist-timeout must be > 0, got {self.dist_timeout_s}")
        if any(h <= 0 for h in self.hidden):
            raise ConfigError(f"--hidden sizes must be > 0, got {list(self.hidden)}")
        self._validate_placement(process or ProcessContext.from_environment())

    def _validate_data(self) -> None:
        """``--data``, ``--test-data`` and every data option against the data kind, before
        anything is read: an option of another kind is refused naming its flag."""
        from torchrec_cowclip.data import parse_spec
        from torchrec_cowclip.data.pipeline.dataset import kind_options

        for flag, spec in (("--data", self.data), ("--test-data", self.test_data)):
            if spec is not None:
                try:
                    parse_spec(spec)
                except ValueError as e:
                    raise ConfigError(f"{flag}: {e}") from None
        kind = self.source_kind()
        try:
            opts = kind_options(kind, self.data_options())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.test_data is None:
            self._check_sources(kind, opts, [])
            return
        test_kind, test_paths = parse_spec(self.test_data)
        if test_kind != kind.name:
            raise ConfigError(
                f"--test-data must be of the same kind as --data ({kind.name}:), "
                f"got {self.test_data!r}"
            )
        try:
            kind.check_test_paths(test_paths)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.test_fraction != TrainConfig.test_fraction:
            raise ConfigError(
                f"--test-fraction {self.test_fraction:g} has no effect with --test-data (its "
                "rows are the test set): drop one"
            )
        self._check_sources(kind, opts, test_paths)

    def _check_sources(self, kind: Any, opts: Any, test_paths: List[str]) -> None:
        """The chosen columns against each file's first line (``SourceKind.check_sources``),
        still before any row is read."""
        from torchrec_cowclip.data import DataError, parse_spec

        try:
            kind.check_sources(parse_spec(self.data)[1], list(test_paths), opts)
        except DataError as e:
            raise ConfigError(str(e)) from None

    def source_kind(self) -> Any:
        """The registered :class:`~torchrec_cowclip.data.registry.SourceKind` of ``--data``."""
        from torchrec_cowclip.data import parse_spec
        from torchrec_cowclip.data.registry import source_kind

        return source_kind(parse_spec(self.data)[0])

    def _validate_numbers(self) -> None:
        # NaN passes every ordered comparison's negation and inf every lower bound, so
        # finiteness is checked first, for every float option.
        floats = {
            "--lr": self.lr,
            "--lr-embed": self.lr_embed,
            "--l2": self.l2,
            "--clip-r": self.clip_r,
            "--clip-zeta": self.clip_zeta,
            "--warmup-epochs": self.warmup_epochs,
            "--count-lr-power": self.count_lr_power,
            "--init-std": self.init_std,
            "--test-fraction": self.test_fraction,
            "--val-fraction": self.val_fraction,
            "--synthetic-scale": self.synthetic_scale,
            "--dist-timeout": self.dist_timeout_s,
        }
        for flag, value in floats.items():
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{flag} must be a finite number, got {value}")
        for flag, value in {
            "--lr": self.lr,
            "--lr-embed": self.lr_embed,
            "--l2": self.l2,
            "--clip-zeta": self.clip_zeta,
            "--warmup-epochs": self.warmup_epochs,
        }.items():
            if value is not None and value < 0:
                raise ConfigError(f"{flag} must be >= 0, got {value}")
        if self.clip_r is not None and self.clip_r <= 0:
            raise ConfigError(f"--clip-r must be > 0, got {self.clip_r}")

    def _validate_helen(self) -> None:
        recipe = RECIPES.get(self.recipe)
        if self.helen_rho is None and (recipe is None or recipe.helen_rho is None):
            if self.helen_perturb_dense:
                raise ConfigError("--helen-perturb-dense has no effect without --helen-rho")
            if self.helen_bound is not None:
                raise ConfigError(
                    f"--helen-bound {self.helen_bound:g} has no effect without --helen-rho"
                )
            return
        if self.embedding_backend != "cowclip":
            raise ConfigError(
                "Helen (--helen-rho, or a recipe with Helen) trains the fused CowClip "
                "tables: use --embedding-backend cowclip"
            )
        try:
            Helen(
                0.0 if self.helen_rho is None else self.helen_rho,
                Helen.bound if self.helen_bound is None else self.helen_bound,
                self.helen_perturb_dense,
            )
        except ValueError as e:
            flag = "--helen-rho" if "rho" in str(e) else "--helen-bound"
            raise ConfigError(f"{flag}: {e}") from None

    def _validate_placement(self, process: ProcessContext) -> None:
        """Options that depend on the machine and the launcher: the device must exist,
        ``--sharding`` needs more than one process (``process``, named by torchrun), and
        several processes need a ``--batch-size`` they can share and the CowClip tables."""
        world = process.world_size
        # Without --out a torchrun job's directory is named by its run id (the same for
        # every rank and restart); anything else gets a new one (run/out_dir.py).
        elastic = bool(process.run_id)
        if self.out is None and self.resume and not elastic:
            raise ConfigError(
                "--resume continues the run in --out: give --out (the default, a new "
                "runs/<timestamp>, holds no run to resume)"
            )
        if self.out is None and world > 1 and not elastic:
            raise ConfigError(
                f"the {world} processes of a run share one directory: give --out (without "
                "torchrun there is no run id to name one by)"
            )
        if self.sharding != "auto" and world <= 1:
            raise ConfigError(
                f"--sharding {self.sharding} shards tables over processes: this is one process "
                "(launch with torchrun/torchx, or drop --sharding)"
            )
        if world > 1:
            if self.batch_size % world:
                raise ConfigError(
                    f"--batch-size {self.batch_size} must be divisible by the number of "
                    f"processes ({world}): each takes an equal part of every global batch"
                )
            if self.embedding_backend != "cowclip":
                raise ConfigError(
                    "multi-process runs shard the CowClip tables: use --embedding-backend cowclip"
                )
            if self.row_clip_stats:
                raise ConfigError(
                    "--row-clip-stats counts rows of unsharded tables: run one process"
                )
        if self.device == "auto":
            return
        import torch

        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ConfigError(
                f"--device must be auto, cpu or cuda[:N], got {self.device!r}"
            ) from None
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise ConfigError(
                    f"--device {self.device}: this machine has no CUDA device "
                    "(use --device cpu or auto)"
                )
            if device.index is not None and device.index >= count:
                raise ConfigError(
                    f"--device {self.device}: this machine has {count} CUDA "
                    f"device(s), cuda:0 to cuda:{count - 1}"
                )
        elif device.type != "cpu":
            raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {self.device!r}")

    def hyperparameters(self) -> ScaledHyperparameters:
        """The run's learning rates, L2, clip and warm-up: the recipe's scaling rule at
        ``batch_size``, from the data's profile (Avazu's for ``avazu:``, else Criteo's),
        with every explicitly given value winning.

        Example::

            >>> hp = TrainConfig(batch_size=4096, recipe="sqrt").hyperparameters()
            >>> round(hp.embedding_lr, 6), hp.cowclip
            (0.0002, False)
        """
        return scale_hyperparameters(
            self.batch_size,
            dataset="avazu" if self.data.startswith("avazu:") else "criteo",
            base_batch_size=self.base_batch_size,
            embedding_dim=self.embedding_dim,
            dense_lr=self.lr,
            embedding_lr=self.lr_embed,
            l2=self.l2,
            clip_r=self.clip_r,
            clip_zeta=self.clip_zeta,
            warmup_epochs=self.warmup_epochs,
            recipe=self.recipe,
            count_lr_power=self.count_lr_power,
            helen_rho=self.helen_rho,
            helen_bound=self.helen_bound,
        )

    def data_settings(self) -> DataSettings:
        """The data this run reads and how it splits it (:meth:`data_options`)."""
        return DataSettings(
            spec=self.data,
            test_spec=self.test_data,
            cache_dir=self.cache_dir,
            options=self.data_options(),
            test_fraction=self.test_fraction,
            val_fraction=float(self.with_data_defaults()[0].val_fraction or 0.0),
            split_seed=self.seed,
        )

    def model_spec(self) -> ModelSpec:
        """The model this run builds (its tables start from ``--seed``)."""
        return ModelSpec(
            name=self.model,
            embedding_dim=self.embedding_dim,
            hidden=tuple(self.hidden),
            cross_layers=self.cross_layers,
            init_std=self.init_std,
            embedding_backend=self.embedding_backend,
            embedding_dtype=self.embedding_dtype,
            init_seed=self.seed,
        )

    def data_options(self) -> Dict[str, Any]:
        """``open_dataset``'s options for ``--data``: the kind's own (None where not
        given, as the run record has always listed them) and any other that was set
        (which the kind then refuses, naming its flag: ``data.dataset.kind_options``).

        ``--seed`` is the trainer's (weights, batch order, splits) and reaches no data
        source; a kind with a generator draws its rows with ``--synthetic-seed``, which
        defaults to ``--seed``.
        """
        from dataclasses import fields

        takes = {f.name for f in fields(self.source_kind().options)}
        generator_seed = self.synthetic_seed
        if generator_seed is None and "seed" in takes:
            generator_seed = self.seed
        chosen = {
            "on_bad_row": self.on_bad_row,
            "min_count": self.min_count,
            "hash_size": self.hash_size,
            "dense_transform": self.dense_transform,
            "missing_indicator": True if self.missing_indicator else None,
            "label": self.label,
            "dense": self.dense or None,
            "sparse": self.sparse or None,
            "delimiter": self.delimiter,
            "header": False if self.no_header else None,
            "columns": self.columns or None,
            "na_values": self.na_values or None,
            "time_columns": self.time_columns or None,
            "cardinality_scale": self.synthetic_scale,
            "max_cardinality": self.synthetic_max_cardinality,
            "seed": generator_seed,
        }
        return {k: v for k, v in chosen.items() if k in takes or v is not None}

    def as_dict(self) -> Dict[str, Any]:
        """The options as plain JSON types (what a run's record writes)."""
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """The config :meth:`as_dict` wrote (a sweep cell's, a warm start's).

        Example::

            >>> config = TrainConfig(hidden=(16, 8), dense=["price"])
            >>> TrainConfig.from_dict(config.as_dict()) == config
            True
        """
        values = dict(values)
        if "hidden" in values:
            values["hidden"] = tuple(values["hidden"])
        return cls(**values)

    def resolve(self, process: Optional[ProcessContext] = None) -> "TrainSettings":
        """The options, validated (:meth:`validate`), resolved once into what each part of
        a run consumes (see the module docstring); the scaling recipe is applied here.
        ``process``: the launch the run is part of (default: read now from this process's
        environment, :meth:`ProcessContext.from_environment`), handed down with the
        settings.

        Raises:
            ConfigError: naming the first bad option.
        """
        process = process or ProcessContext.from_environment()
        self.validate(process)
        compiled_update_mode()  # the environment's kernel mode, refused by name before any state
        config, said = self.with_data_defaults()
        return config._resolved(said, process)

    def _resolved(self, defaults_line: Optional[str], process: ProcessContext) -> "TrainSettings":
        hp = self.hyperparameters()
        clipped = self.cowclip and hp.cowclip
        embedding = CowClipOptions(
            optimizer=self.embedding_optimizer,
            lr=hp.embedding_lr,
            weight_decay=hp.embedding_weight_decay,
            cowclip=CowClip(r=hp.clip_r, zeta=hp.clip_zeta) if clipped else None,
            count_lr=hp.count_lr if self.embedding_backend == "cowclip" else None,
            helen=hp.helen(self.helen_perturb_dense),
        )
        return TrainSettings(
            data=self.data_settings(),
            model=self.model_spec(),
            optimizers=OptimizerSettings(
                embedding=embedding, dense_lr=hp.dense_lr, warmup_epochs=hp.warmup_epochs
            ),
            run=RunSettings(**{f: getattr(self, f) for f in RunSettings.__dataclass_fields__}),
            hp=hp,
            record=self.as_dict(),
            defaults_line=defaults_line,
            process=process,
        )


#: The options the paper's data (criteo:, criteo-npy:, avazu:, synthetic:) leaves None take.
PAPER_DEFAULTS: Dict[str, Any] = {"epochs": 1, "val_fraction": 0.0, "early_stop_patience": 0}
#: The options your own table (``table:``) leaves None take: a validation split with early
#: stopping over up to 10 epochs, and an embedding lr for small logs (measured against
#: logistic regression and LightGBM in docs/results.md, benchmarks/own_log.py).
DATA_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "table": {"epochs": 10, "val_fraction": 0.1, "early_stop_patience": 2, "lr_embed": 1e-2},
}


def _shown_defaults(chosen: Mapping[str, Any]) -> str:
    flags = {
        "epochs": "--epochs",
        "val_fraction": "--val-fraction",
        "early_stop_patience": "--early-stop-patience",
        "lr_embed": "--lr-embed",
        "l2": "--l2",
    }
    return " ".join(f"{flags[k]} {v:g}" for k, v in chosen.items())


@dataclass(frozen=True)
class OptimizerSettings:
    """The run's optimizers: the tables' (their rule, lr, coupled L2, clip, per-row lr and
    Helen, as one :class:`~torchrec_cowclip.optim.options.CowClipOptions`; the stock
    ``torchrec`` backend's Adam takes its lr and weight decay) and the dense Adam's lr and
    linear warm-up."""

    embedding: CowClipOptions
    dense_lr: float
    warmup_epochs: float


@dataclass(frozen=True)
class RunSettings:
    """What the loop, its processes and its run directory are told (``--help`` names each)."""

    out: Optional[str]
    resume: Union[bool, str]
    overwrite: bool
    epochs: int
    max_steps: int
    batch_size: int
    seed: int
    eval_batch_size: int
    checkpoint_every: int
    keep_checkpoints: int
    early_stop_patience: int
    log_every: int
    progress: bool
    row_clip_stats: bool
    device: str
    threads: int
    sharding: str
    dist_timeout_s: float
    init_from: Optional[str]
    init_optimizer_state: bool
    require_sha256: bool


#: Config fields a scaling recipe fills in when left None -> the resolved value's field
#: in :class:`~torchrec_cowclip.train.scaling.ScaledHyperparameters`.
_RESOLVED: Dict[str, str] = {
    "lr": "dense_lr",
    "lr_embed": "embedding_lr",
    "l2": "l2",
    "clip_r": "clip_r",
    "clip_zeta": "clip_zeta",
    "warmup_epochs": "warmup_epochs",
    "count_lr_power": "count_lr_power",
    "helen_rho": "helen_rho",
    "helen_bound": "helen_bound",
}


@dataclass(frozen=True)
class TrainSettings:
    """A run's options, resolved (:meth:`TrainConfig.resolve`).

    Attributes:
        hp: every value of the scaling recipe at this batch, for the run's record and lines.
        record: the options as the run writes them (``metrics.json``'s hyperparameters,
            ``model.json``'s config, each checkpoint's config), the data kind's defaults
            filled in.
        defaults_line: which options the data kind chose and why (the start summary's).
        process: the launch the run is part of (rank, world size, local ranks), resolved
            once with the options.
    """

    data: DataSettings
    model: ModelSpec
    optimizers: OptimizerSettings
    run: RunSettings
    hp: ScaledHyperparameters
    record: Dict[str, Any]
    defaults_line: Optional[str] = None
    process: ProcessContext = ONE_PROCESS

    def record_settings(self) -> Dict[str, Any]:
        """The options with every recipe default resolved (``--lr 8e-4`` and the recipe's
        8e-4 are the same setting): what a checkpoint's run record compares on resume."""
        settings = dict(self.record)
        for name, resolved in _RESOLVED.items():
            settings[name] = getattr(self.hp, resolved)
        return settings

    def writing_to(self, out: str) -> "TrainSettings":
        """The same run, written to ``out`` (a new directory chosen for it)."""
        return replace(self, run=replace(self.run, out=out), record={**self.record, "out": out})

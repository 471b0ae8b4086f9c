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

import dataclasses
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from torchrec_cowclip.cli_help import REQUIRE_SHA256_HELP
from torchrec_cowclip.data.settings import DataSettings
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.models import MODELS as MODEL_FACTORIES
from torchrec_cowclip.models.embeddings import EMBEDDING_BACKENDS
from torchrec_cowclip.models.spec import ModelSpec
from torchrec_cowclip.optim.options import CowClip, CowClipOptions, Helen
from torchrec_cowclip.optim.row_step import compiled_update_mode
from torchrec_cowclip.optim.rules import OPTIMIZERS
from torchrec_cowclip.process_context import ONE_PROCESS, ProcessContext
from torchrec_cowclip.run.resume_guard import Setting
from torchrec_cowclip.train.options import (
    GROUPS,
    a_directory,
    check_group,
    declarations,
    fraction,
    group_values,
    non_negative,
    option,
    positive,
    positive_sizes,
    resume_mode,
    seed_range,
)
from torchrec_cowclip.train.processes import SHARDING_CHOICES
from torchrec_cowclip.train.scaling import RECIPES, ScaledHyperparameters, scale_hyperparameters

#: The CLI's choices, read from the registries they select from.
MODELS = tuple(MODEL_FACTORIES)
EMBEDDING_OPTIMIZERS = OPTIMIZERS  # live: a registered update rule is a choice too

#: What each --model is (the names are the factory registry's; a model registered there
#: without a line here shows its name alone).
_MODEL_HELP = {
    "deepfm": "DeepFM",
    "wdl": "Wide&Deep",
    "dcn": "DCN (--cross-layers cross layers)",
    "dcnv2": "DCNv2, the reference's DCN-Mix",
    "dlrm": "TorchRec's DLRM (dot interaction)",
    "dlrm_dcn": "TorchRec's DLRM with a DCN interaction",
}
_RECIPE = "optimizer and recipe"  # the --help group of the batch, the recipe and its values


#: The data group's options that are fields of :class:`DataSettings` (by their names
#: there); the rest are the source kind's options (:meth:`TrainConfig.data_options`).
_DATA_FIELDS = tuple(
    f.name for f in dataclasses.fields(DataSettings) if f.name not in ("options", "split_seed")
)


def _header(no_header: bool) -> Optional[bool]:
    """``--no-header`` as the source kind's ``header`` (not given: the kind's default)."""
    return False if no_header else None


def _given(value: Any) -> Any:
    """A data option as a source kind is given it: a switch off or an empty list is not
    given (None, as a run record has always listed it)."""
    return None if value is False or value == [] else value


@dataclass
class TrainConfig:
    """Options of ``torchrec-cowclip train``, each declared once here: its name, type and
    default, and in :func:`~torchrec_cowclip.train.options.option` its ``--help`` group and
    text, flag, choices and check (the parser, the checks, the records and the command
    lines are derived from these; fields in ``--help``'s order).

    ``lr``, ``lr_embed``, ``l2``, ``clip_r``, ``clip_zeta``, ``warmup_epochs`` left as
    None take the values of the scaling recipe ``recipe`` (default ``paper``, the paper's
    rule; :mod:`torchrec_cowclip.train.scaling`).

    Example::

        >>> cfg = TrainConfig(model="deepfm", data="synthetic:100000", batch_size=8192,
        ...                   out="runs/demo")
        >>> cfg.validate()
    """

    # --- data ---------------------------------------------------------------------------
    data: str = option(
        "synthetic:200000",
        group="data",
        to="spec",
        required=True,
        inherited=False,
        help="training data, KIND:ARG: table:PATH[,PATH...] (your own CSV/TSV/delimited text "
        "or parquet, with --label/--dense/--sparse), criteo:PATH[,PATH...] (raw Criteo: "
        "Kaggle train.txt or 1TB day_N), criteo-npy:DIR (TorchRec's preprocessed "
        "day_N_{dense,sparse,labels}.npy), avazu:PATH, synthetic:ROWS (built-in Criteo-like "
        "data), synthetic-hard:ROWS (the same, harder). Converted once into --cache-dir; "
        "required",
    )
    test_data: Optional[str] = option(
        None,
        group="data",
        to="test_spec",
        inherited=False,
        help="explicit test files (the same kind as --data); default: a random "
        "--test-fraction of --data's rows",
    )
    test_fraction: float = option(
        0.1,
        group="data",
        check=fraction,
        help="share of --data's rows drawn at random (seeded by --seed) as the test split",
    )
    # None: the data kind's default (DATA_DEFAULTS), as are epochs and early_stop_patience.
    val_fraction: Optional[float] = option(
        None,
        group="data",
        check=fraction,
        help="share of the training rows held out for validation (early stopping, "
        "best_epoch); 0: no validation split (default: 0.1 for table:, 0 for the paper's data)",
    )
    label: Optional[str] = option(
        None, group="data", help="table: the label column (0/1); default: none"
    )
    dense: List[str] = option(
        factory=list,
        group="data",
        help="table:, avazu: numeric columns (names stripped: 'price, age' is price and "
        "age); default: none",
    )
    sparse: List[str] = option(
        factory=list,
        group="data",
        help="table:, avazu: categorical columns, each its own embedding table; default: "
        "none for table: (give them), every column but id and the label for avazu:",
    )
    delimiter: Optional[str] = option(
        None,
        group="data",
        help="field separator of text files: one character, or tab, comma, semicolon, "
        "pipe, space; default: from the extension (.csv comma, .tsv/.txt tab)",
    )
    no_header: bool = option(
        False,
        group="data",
        to="header",
        given=_header,
        help="table: the files have no header line; their columns are --columns, or "
        "their positions 0, 1, ... (default: the first line names the columns)",
    )
    columns: List[str] = option(
        factory=list,
        group="data",
        help="table: the columns of header-less files, in order (implies --no-header, "
        "as pandas' names=); default: none",
    )
    na_values: List[str] = option(
        factory=list,
        group="data",
        help="table: texts that mean a missing value in the dense and categorical columns "
        "besides an empty field, as pandas' na_values= (e.g. N/A,NA,-): a dense one becomes "
        "0 after the transform (with --missing-indicator, flagged), a categorical one the "
        "missing id; default: none",
    )
    time_columns: List[str] = option(
        factory=list,
        group="data",
        help="table: timestamp columns (Unix seconds or milliseconds, an ISO 8601 date-time, a "
        "parquet timestamp), each entering the model as two categorical features, its hour "
        "of day (NAME_hour) and day of week (NAME_weekday, 0 Monday), in UTC: the cycles a "
        "click log's time drives, not a trend that new days sit outside of; default: none",
    )
    time_trend: bool = option(
        False,
        group="data",
        help="table: with --time-columns, also a dense feature per time column, NAME_days: "
        "the time since the training split's start, scaled by its span (min-max on the "
        "training split). Helps where clicks drift steadily over the logged days and you "
        "score rows inside them; hurts where you score later days, which lie past "
        "everything the model saw (the trend is extrapolated; predict and evaluate count "
        "them as outside the training range); default: off",
    )
    # None: the data kind's default (log for the Criteo layouts, signed-log for tables).
    dense_transform: Optional[str] = option(
        None,
        group="data",
        metavar="SPEC",
        help="how dense columns enter the model: one transform for all (log, signed-log, "
        "standardize, minmax, none), per column (price=log,score=standardize) or both "
        "(standardize,price=log). log: log(1 + x), a negative x set to 0 and counted; "
        "signed-log: sign(x) log(1 + |x|); standardize: (x - mean) / std; minmax: "
        "(x - min) / (max - min); statistics of the training split only. A missing value "
        "becomes 0 after the transform (the mean under standardize); default: per kind: log "
        "for criteo:, criteo-npy: (as stored) and synthetic: (Criteo's convention: missing "
        "and negative counts 0, counted and reported), signed-log for table: and avazu:",
    )
    missing_indicator: bool = option(
        False,
        group="data",
        help="criteo:, avazu:, table: add a 0/1 input per dense column with missing values "
        "in the training split (scikit-learn's add_indicator)",
    )
    # None: the data kind's default (DATA_DEFAULTS; none for the paper's data).
    dense_buckets: Optional[int] = option(
        None,
        group="data",
        check=non_negative,
        metavar="N",
        help="criteo:, avazu:, table: add each dense column's quantile bucket among N (the "
        "training split's quantiles, recorded for scoring) as N 0/1 inputs, a step function "
        "for threshold effects; 0: none (default: 16 for table:, 0 for the paper's data)",
    )
    on_bad_row: str = option(
        "error",
        group="data",
        choices=("error", "skip"),
        inherited=False,
        help="a malformed row: error stops at file:line with the reason; skip drops it and "
        "counts it per reason (metrics.json: dataset.bad_rows_skipped)",
    )
    hash_size: Optional[int] = option(
        None,
        group="data",
        help="hash categorical values into this many ids per feature; default: an exact "
        "vocabulary of the training files",
    )
    min_count: int = option(
        1,
        group="data",
        help="vocabulary: values seen fewer times share one out-of-vocabulary id",
    )
    synthetic_scale: Optional[float] = option(
        None,
        group="data",
        to="cardinality_scale",
        help="synthetic: multiply Criteo Kaggle's cardinalities by this (default: 1.0)",
    )
    synthetic_max_cardinality: Optional[int] = option(
        None,
        group="data",
        to="max_cardinality",
        help="synthetic: cap every table at this many rows (default: 1,000,000)",
    )
    synthetic_seed: Optional[int] = option(
        None,
        group="data",
        to="seed",
        check=seed_range,
        inherited=False,
        help="synthetic: the generator's seed, to draw other rows than --seed's (default: --seed)",
    )
    cache_dir: str = option(
        "data_cache",
        group="data",
        resumable=True,
        inherited=False,
        help="where converted data (a verified binary cache) is kept and reused",
    )
    # --- model ---------------------------------------------------------------------------
    model: str = option(
        "deepfm",
        group="model",
        to="name",
        choices=MODELS,
        help="; ".join(f"{name}: {_MODEL_HELP.get(name, name)}" for name in MODELS),
    )
    embedding_dim: int = option(10, group="model", check=positive, help="embedding size D")
    cross_layers: int = option(
        3, group="model", check=positive, help="dcn, dcnv2, dlrm_dcn: cross layers"
    )
    init_std: float = option(
        1e-2, group="model", check=non_negative, help="embedding init N(0, std^2)"
    )
    hidden: Tuple[int, ...] = option(
        (400, 400, 400),
        group="model",
        check=positive_sizes,
        given=tuple,  # a Python caller's list, as the spec's tuple
        help="DNN layer sizes",
    )
    embedding_backend: str = option(
        "cowclip",
        group="model",
        choices=EMBEDDING_BACKENDS,
        help="cowclip: the fused CowClip tables; torchrec: stock EmbeddingBagCollection + "
        "torch.optim.Adam, for comparison (needs --no-cowclip)",
    )
    embedding_dtype: str = option(
        "fp32",
        group="model",
        choices=("fp32", "fp16", "bf16"),
        help="storage of the table weights: fp16/bf16 halve their bytes (updated in float32 "
        "with stochastic rounding; optimizer state stays float32)",
    )
    # --- optimizer and recipe ---------------------------------------------------------------
    batch_size: int = option(
        1024, group=_RECIPE, check=positive, also=("run",), help="global training batch"
    )
    base_batch_size: int = option(
        1024,
        group=_RECIPE,
        check=positive,
        help="the batch the recipe's base values are for (s = batch / base)",
    )
    recipe: str = option(
        "paper",
        group=_RECIPE,
        choices=tuple(RECIPES),
        help="how every value below scales with s; "
        + "; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values()),
    )
    # lr ... helen_bound left None take the recipe's value at this batch.
    lr: Optional[float] = option(
        None,
        group=_RECIPE,
        to="dense_lr",
        check=non_negative,
        help="dense lr (default: the recipe's; paper: 8e-4 * sqrt(s), Avazu 1e-4 * sqrt(s))",
    )
    lr_embed: Optional[float] = option(
        None,
        group=_RECIPE,
        to="embedding_lr",
        check=non_negative,
        help="embedding lr (default: 3e-3 for table:; else the recipe's, paper: 1e-4, not scaled)",
    )
    l2: Optional[float] = option(
        None,
        group=_RECIPE,
        check=non_negative,
        help="embedding L2 lambda (default: the recipe's; paper: 1e-5 * s)",
    )
    clip_r: Optional[float] = option(
        None, group=_RECIPE, check=positive, help="CowClip's ratio r (default: the recipe's, 1)"
    )
    clip_zeta: Optional[float] = option(
        None,
        group=_RECIPE,
        check=non_negative,
        help="CowClip's lower bound zeta (default: r^2 * sqrt(dim) * bound, bound 1e-5 "
        "Criteo-like, 1e-4 Avazu)",
    )
    warmup_epochs: Optional[float] = option(
        None,
        group=_RECIPE,
        check=non_negative,
        help="linear warm-up of the dense lr, in epochs (default: the recipe's; paper: 1)",
    )
    count_lr_power: Optional[float] = option(
        None,
        group=_RECIPE,
        help="per-id-frequency embedding lr: a row seen c times in the batch steps with "
        "lr * min(c, s) ** POWER (not in the paper; default: the recipe's, paper: 0 = off; "
        "docs/scaling.md)",
    )
    # Helen checks its own values (optim.options.Helen), naming the flag.
    helen_rho: Optional[float] = option(
        None,
        group=_RECIPE,
        finite=False,
        help="train the tables with Helen (frequency-wise sharpness-aware minimisation, two "
        "passes per step) with this perturbation radius at this batch (reference: 0.05); "
        "default: the recipe's (off but for recipes with Helen; docs/algorithm.md)",
    )
    helen_bound: Optional[float] = option(
        None,
        group=_RECIPE,
        finite=False,
        help="Helen's lower bound on a row's frequency share n_j / max n (default: the "
        "recipe's, 0.3)",
    )
    cowclip: bool = option(
        True,
        group=_RECIPE,
        flag="--no-cowclip",
        label="CowClip",
        help="train the same fused tables without clipping (a lazy optimizer); default: "
        "CowClip clips",
    )
    embedding_optimizer: str = option(
        "adam",
        group=_RECIPE,
        choices=EMBEDDING_OPTIMIZERS,
        help="the tables' optimizer (the paper's: adam)",
    )
    helen_perturb_dense: bool = option(
        False,
        group=_RECIPE,
        help="Helen also perturbs the dense parameters (SAM with their global gradient "
        "norm); default: they step with the first pass's gradient",
    )
    # --- run ---------------------------------------------------------------------------------
    # None: a new runs/<YYYYmmdd-HHMMSS> (torchrun: runs/torchrun-<run id>), see run_dir.
    out: Optional[str] = option(
        None,
        group="run",
        resumable=True,
        inherited=False,
        help="run directory (metrics.json, steps.csv, epochs.csv, tb/, checkpoints/); an "
        "existing run there is refused without --resume or --overwrite; default: a new "
        "runs/<YYYYmmdd-HHMMSS> (under torchrun: runs/torchrun-<run id>)",
    )
    overwrite: bool = option(
        False,
        group="run",
        resumable=True,
        inherited=False,
        help="delete the previous run's files in --out first",
    )
    # False, True (--resume) or "auto" (--resume auto: resume if there is a checkpoint).
    resume: Union[bool, str] = option(
        False,
        group="run",
        resumable=True,
        metavar="auto",
        check=resume_mode,
        inherited=False,
        help="continue from the newest intact checkpoint in --out (any number of "
        "processes); refused if a setting that changes the result differs from the "
        "checkpoint's. 'auto': the same if there is a checkpoint, else start anew (for "
        "torchrun --max-restarts and schedulers' retries); default: a new run",
    )
    epochs: Optional[int] = option(
        None,
        group="run",
        resumable=True,
        check=positive,
        help="passes over the training split (default: 10 for table:, stopped early on the "
        "validation AUC; 1 for the paper's data)",
    )
    max_steps: int = option(
        0,
        group="run",
        resumable=True,
        check=non_negative,
        help="stop after this many steps (0: no limit)",
    )
    seed: int = option(
        0,
        group="run",
        check=seed_range,
        help="initial weights, batch order and the random splits, for every data kind "
        "(synthetic data is also drawn with it unless --synthetic-seed is given)",
    )
    early_stop_patience: Optional[int] = option(
        None,
        group="run",
        check=non_negative,
        help="stop after this many epochs without a better validation AUC and keep the "
        "best epoch's weights (needs --val-fraction; 0: off; default: 2 for table:, 0 for "
        "the paper's data)",
    )
    checkpoint_every: int = option(
        0,
        group="run",
        resumable=True,
        check=non_negative,
        help="checkpoint every this many steps (0: at epoch ends only)",
    )
    eval_batch_size: int = option(
        65536, group="run", check=positive, help="rows per evaluation batch"
    )
    threads: int = option(
        0,
        group="run",
        check=non_negative,
        inherited=False,
        help="torch intra-op threads (0: torch's choice)",
    )
    log_every: int = option(
        20,
        group="run",
        resumable=True,
        check=positive,
        help="write a steps.csv row (and TensorBoard scalars) every this many steps",
    )
    keep_checkpoints: int = option(
        2,
        group="run",
        resumable=True,
        check=positive,
        metavar="K",
        help="keep the last K complete checkpoints (a damaged newest one falls back to "
        "the one before)",
    )
    device: str = option(
        "auto",
        group="run",
        inherited=False,
        help="auto (CUDA if there is one, else CPU), cpu or cuda[:N]",
    )
    progress: bool = option(
        True,
        group="run",
        resumable=True,
        flag="--no-progress",
        inherited=False,
        help="no progress bars (the epoch lines stay); default: progress bars on stderr",
    )
    row_clip_stats: bool = option(
        False,
        group="run",
        help="count clipped updates per embedding row and report the clip rate by id "
        "frequency in the training split (metrics.json: clip_by_frequency; one process)",
    )
    # Warm start (train.warm_start): the weights and encoders of a finished run's folder.
    init_from: Optional[str] = option(
        None,
        group="run",
        metavar="RUN",
        check=a_directory,
        inherited=False,
        help="warm start from RUN's model (a finished run's --out): its weights and "
        "encoders, its vocabularies grown by the new ids; the flags not given take RUN's "
        "values (docs/serving.md, Warm start); default: none (a new model)",
    )
    init_optimizer_state: bool = option(
        False,
        group="run",
        inherited=False,
        help="with --init-from: also carry the optimizer state of RUN's last checkpoint",
    )
    require_sha256: bool = option(
        False, group="run", resumable=True, help="with --init-from: " + REQUIRE_SHA256_HELP
    )
    # --- distributed ---------------------------------------------------------------------------
    sharding: str = option(
        "auto",
        group="distributed",
        resumable=True,
        choices=SHARDING_CHOICES,
        help="how the embedding tables are sharded (auto: TorchRec's planner chooses per "
        "table); refused on one process",
    )
    dist_timeout_s: float = option(
        300.0,
        group="distributed",
        resumable=True,
        flag="--dist-timeout",
        check=positive,
        inherited=False,
        help="seconds any collective may wait (a dead rank fails the job after this)",
    )

    def with_data_defaults(self) -> Tuple["TrainConfig", Optional[str]]:
        """This config with the options left None that depend on the data kind filled in
        (:data:`DATA_DEFAULTS`), and the line that says which were chosen and why (None
        when none was chosen for the kind's sake: the paper's data keeps the paper's).

        Example::

            >>> cfg, said = TrainConfig(data="table:x.csv", epochs=3).with_data_defaults()
            >>> cfg.epochs, cfg.val_fraction, cfg.early_stop_patience, cfg.lr_embed
            (3, 0.1, 2, 0.003)
            >>> cfg.dense_buckets, said.split(": ")[1]
            (16, '--val-fraction 0.1 --early-stop-patience 2 --lr-embed 0.003 --dense-buckets 16')
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
            "weights; quantile buckets let numeric columns act through thresholds "
            "(README: your first model on your own data)"
        )

    def validate(self, process: Optional[ProcessContext] = None) -> None:
        """Raises :class:`ConfigError` naming the first bad option: the checks
        :meth:`resolve` makes (the data kind's defaults filled in first); ``process``: the
        launch the run is checked against (default: this process's,
        :meth:`ProcessContext.from_environment`)."""
        self.resolve(process)

    def _check(self, process: ProcessContext) -> None:
        """The checks of a config whose data kind's defaults are filled in."""
        for group in GROUPS:  # each group checks its own options' values
            check_group(self, group)
        self._check_combinations()
        self._validate_data()
        self._validate_placement(process or ProcessContext.from_environment())

    def _check_combinations(self) -> None:
        """The rules between options (each option's own values are its declaration's to
        check), in one place."""
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
        unclipped = "--no-cowclip" if not self.cowclip else None
        if not RECIPES[self.recipe].cowclip:
            unclipped = f"--recipe {self.recipe} (no clip)"
        if unclipped:
            for flag, clip in (("--clip-r", self.clip_r), ("--clip-zeta", self.clip_zeta)):
                if clip is not None:
                    raise ConfigError(f"{flag} {clip:g} has no effect with {unclipped}: drop one")
        if self.init_optimizer_state and not self.init_from:
            raise ConfigError("--init-optimizer-state carries --init-from's optimizer: give both")
        if self.require_sha256 and not self.init_from:
            raise ConfigError("--require-sha256 applies to --init-from's run folder: give both")
        if self.resume and self.overwrite:
            raise ConfigError(
                "--resume continues the run in --out, --overwrite deletes it: give one"
            )
        if self.early_stop_patience and not self.val_fraction:
            raise ConfigError("--early-stop-patience needs a validation split: set --val-fraction")
        if self.test_data is None and self.test_fraction <= 0.0:
            raise ConfigError("no test set: give --test-data or a --test-fraction > 0")
        if self.embedding_backend == "torchrec" and self.cowclip and RECIPES[self.recipe].cowclip:
            raise ConfigError("--embedding-backend torchrec has no CowClip: add --no-cowclip")
        if self.embedding_dtype != "fp32" and self.embedding_backend != "cowclip":
            raise ConfigError(
                f"--embedding-dtype {self.embedding_dtype} needs --embedding-backend cowclip"
            )

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

    def _data_settings(self) -> DataSettings:
        """The data this run reads and how it splits it: the data group's options
        (:func:`~torchrec_cowclip.train.options.group_values`), those that are no field
        of :class:`DataSettings` as the source kind's options (:meth:`data_options`)."""
        values = group_values(self, "data")
        own = {name: values[name] for name in _DATA_FIELDS}
        return DataSettings(**own, options=self.data_options(), split_seed=self.seed)

    def data_options(self) -> Dict[str, Any]:
        """``open_dataset``'s options for ``--data``: the data group's options that are
        no field of :class:`DataSettings`, by the kind's names for them; the kind's own
        (None where not given, as the run record has always listed them) and any other
        that was set (which the kind then refuses, naming its flag:
        ``data.dataset.kind_options``).

        ``--seed`` is the trainer's (weights, batch order, splits) and reaches no data
        source; a kind with a generator draws its rows with ``--synthetic-seed``, which
        defaults to ``--seed``.
        """
        from dataclasses import fields

        takes = {f.name for f in fields(self.source_kind().options)}
        values = group_values(self, "data", unset=_given)
        chosen = {k: v for k, v in values.items() if k not in _DATA_FIELDS}
        if chosen["seed"] is None and "seed" in takes:
            chosen["seed"] = self.seed
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
        # The one place the data kind's defaults are filled in: every consumer (the
        # trainer, a sweep's cells, a plan) takes them from the settings.
        config, said = self.with_data_defaults()
        config._check(process)
        compiled_update_mode()  # the environment's kernel mode, refused by name before any state
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
            data=self._data_settings(),
            model=ModelSpec(**group_values(self, "model"), init_seed=self.seed),
            optimizers=OptimizerSettings(
                embedding=embedding, dense_lr=hp.dense_lr, warmup_epochs=hp.warmup_epochs
            ),
            run=RunSettings(**group_values(self, "run"), **group_values(self, "distributed")),
            hp=hp,
            record=self.as_dict(),
            defaults_line=defaults_line,
            process=process,
        )


#: The options the paper's data (criteo:, criteo-npy:, avazu:, synthetic:) leaves None take.
PAPER_DEFAULTS: Dict[str, Any] = {"epochs": 1, "val_fraction": 0.0, "early_stop_patience": 0}
#: The options your own table (``table:``) leaves None take: a validation split with early
#: stopping over up to 10 epochs, an embedding lr for small logs, and the dense columns'
#: quantile buckets (measured against logistic regression and LightGBM in
#: docs/results.md, benchmarks/own_log.py).
DATA_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "table": {
        "epochs": 10,
        "val_fraction": 0.1,
        "early_stop_patience": 2,
        "lr_embed": 3e-3,
        "dense_buckets": 16,
    },
}


#: What a run record's settings are to the resume guard and a sweep (run/resume_guard.py),
#: from the declarations: how a message names each (its flag, and label), its values on/off
#: for a switch on by default, whether a resumed run may change it.
RECORDED_SETTINGS: Dict[str, Setting] = {
    option.name: Setting(option.named, option.form == "off", option.option.resumable)
    for option in declarations(TrainConfig)
}


def _shown_defaults(chosen: Mapping[str, Any]) -> str:
    return " ".join(f"{RECORDED_SETTINGS[k].flag} {v:g}" for k, v in chosen.items())


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
    """What the loop, its processes and its run directory are told: the options of the
    run and distributed groups and ``--batch-size``, made from their declarations
    (:func:`~torchrec_cowclip.train.options.group_values`: an option added to either group
    is a field here, or the settings refuse to be made; ``--help`` names each)."""

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


#: Config fields a scaling recipe fills in when left None (the recipe group's options
#: without a default) -> the resolved value's field in
#: :class:`~torchrec_cowclip.train.scaling.ScaledHyperparameters` (their ``to``).
_RESOLVED: Dict[str, str] = {
    option.name: option.option.to or option.name
    for option in declarations(TrainConfig)
    if option.option.group == _RECIPE and option.default is None
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

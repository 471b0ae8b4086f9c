"""``torchrec-cowclip train``: its flags, their config, and the command's run.

The flags are defined here once, in five groups (data, model, optimizer and recipe, run,
distributed); the commands that train or read train's data (``sweep``, ``plan``) add the
same groups, and :func:`train_argv` writes a config back as the flags that make it (a
sweep cell's command, a plan's launch command). :func:`run_train` is the command itself,
after its flags: the training run, its summary, and every failure as one line and an exit
status (:func:`exiting_on_failure`), as the program's command line
(:mod:`torchrec_cowclip.cli`, whose docstring shows a command) and a sweep's cell
processes run it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from typing import (
    Any,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    get_args,
    get_type_hints,
)

from torchrec_cowclip.cli_help import HelpFormatter, add_require_sha256
from torchrec_cowclip.failures import (
    EXIT_DIVERGED,
    EXIT_ENVIRONMENT,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    ConfigError,
)
from torchrec_cowclip.models.embeddings import EMBEDDING_BACKENDS
from torchrec_cowclip.process_context import ProcessContext
from torchrec_cowclip.train.config import EMBEDDING_OPTIMIZERS, MODELS, TrainConfig, TrainSettings
from torchrec_cowclip.train.processes import SHARDING_CHOICES
from torchrec_cowclip.train.scaling import RECIPES

_DATA_HELP = (
    "training data, KIND:ARG: table:PATH[,PATH...] (your own CSV/TSV/delimited text or "
    "parquet, with --label/--dense/--sparse), criteo:PATH[,PATH...] (raw Criteo: Kaggle "
    "train.txt or 1TB day_N), criteo-npy:DIR (TorchRec's preprocessed "
    "day_N_{dense,sparse,labels}.npy), avazu:PATH, synthetic:ROWS (built-in Criteo-like "
    "data), synthetic-hard:ROWS (the same, harder). Converted once into --cache-dir; required"
)

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


def _csv_list(text: str) -> List[str]:
    """``"price, age"`` -> ``["price", "age"]``: names are stripped (an empty item is
    dropped; the data options refuse a name given twice)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _int_list(text: str) -> List[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _resume_mode(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"takes no value or 'auto', got {text!r}")
    return text


def _shown_list(values: Sequence[Any]) -> str:
    return ",".join(str(v) for v in values)


#: How the data is split: flag -> help.
_SPLIT_VALUES: Dict[str, str] = {
    "--test-fraction": "share of --data's rows drawn at random (seeded by --seed) as the test "
    "split",
    "--val-fraction": "share of the training rows held out for validation (early stopping, "
    "best_epoch); 0: no validation split (default: 0.1 for table:, 0 for the paper's data)",
}

#: How ids are numbered, and synthetic data drawn: flag -> help.
_ID_VALUES: Dict[str, str] = {
    "--hash-size": "hash categorical values into this many ids per feature; default: an exact "
    "vocabulary of the training files",
    "--min-count": "vocabulary: values seen fewer times share one out-of-vocabulary id",
    "--synthetic-scale": "synthetic: multiply Criteo Kaggle's cardinalities by this (default: 1.0)",
    "--synthetic-max-cardinality": "synthetic: cap every table at this many rows "
    "(default: 1,000,000)",
    "--synthetic-seed": "synthetic: the generator's seed, to draw other rows than --seed's "
    "(default: --seed)",
}


#: The model's sizes: flag -> help.
_MODEL_VALUES: Dict[str, str] = {
    "--embedding-dim": "embedding size D",
    "--cross-layers": "dcn, dcnv2, dlrm_dcn: cross layers",
    "--init-std": "embedding init N(0, std^2)",
}


def _add_value_flags(group: Any, flags: Mapping[str, str]) -> None:
    """Adds the ``flags`` (flag -> help) whose type and default are their TrainConfig
    field's (``--min-count``: ``min_count: int = 1``)."""
    d = TrainConfig()
    hints = get_type_hints(TrainConfig)
    for flag, text in flags.items():
        name = flag[2:].replace("-", "_")
        kind = next(t for t in (int, float) if t in (hints[name], *get_args(hints[name])))
        group.add_argument(flag, type=kind, default=getattr(d, name), help=text)


def _add_list_flag(group: Any, flag: str, text: str) -> None:
    """A flag that takes comma-separated names (``A,B,...``; default: none)."""
    group.add_argument(flag, type=_csv_list, default=[], metavar="A,B,...", help=text)


def add_train_arguments(parser: argparse.ArgumentParser, data_required: bool = True) -> None:
    """Adds ``train``'s arguments to ``parser``, in five groups: data, model, optimizer and
    recipe, run, distributed. Another command that trains (a sweep) reuses them
    (``data_required``: whether ``--data`` must be given).

    Example::

        >>> p = argparse.ArgumentParser(formatter_class=HelpFormatter)
        >>> add_train_arguments(p)
        >>> args = p.parse_args(["--data", "synthetic:1000", "--dense", "price, age"])
        >>> args.dense, args.batch_size, args.out is None
        (['price', 'age'], 1024, True)
    """
    add_data_arguments(parser, required=data_required)
    add_model_arguments(parser)
    _add_run_arguments(parser)


def add_data_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Adds ``train``'s data group (``--data`` and every option of how it is read) to
    ``parser``: another command that reads train's data (a plan) reads it with the same
    flags. ``required``: whether ``--data`` must be given."""
    d = TrainConfig()
    kinds_default = (
        "default: per kind: log for criteo:, criteo-npy: (as stored) and synthetic: (Criteo's "
        "convention: missing and negative counts 0, counted and reported), signed-log for "
        "table: and avazu:"
    )

    g = parser.add_argument_group("data")
    g.add_argument(
        "--data",
        required=required,
        help=_DATA_HELP if required else _DATA_HELP + " (default: none)",
    )
    g.add_argument(
        "--test-data",
        default=None,
        help="explicit test files (the same kind as --data); default: a random "
        "--test-fraction of --data's rows",
    )
    _add_value_flags(g, _SPLIT_VALUES)
    g.add_argument("--label", default=None, help="table: the label column (0/1); default: none")
    _add_list_flag(
        g,
        "--dense",
        "table:, avazu: numeric columns (names stripped: 'price, age' is price and "
        "age); default: none",
    )
    _add_list_flag(
        g,
        "--sparse",
        "table:, avazu: categorical columns, each its own embedding table; default: "
        "none for table: (give them), every column but id and the label for avazu:",
    )
    g.add_argument(
        "--delimiter",
        default=None,
        help="field separator of text files: one character, or tab, comma, semicolon, "
        "pipe, space; default: from the extension (.csv comma, .tsv/.txt tab)",
    )
    g.add_argument(
        "--no-header",
        action="store_true",
        help="table: the files have no header line; their columns are --columns, or "
        "their positions 0, 1, ... (default: the first line names the columns)",
    )
    _add_list_flag(
        g,
        "--columns",
        "table: the columns of header-less files, in order (implies --no-header, "
        "as pandas' names=); default: none",
    )
    _add_list_flag(
        g,
        "--na-values",
        "table: texts that mean a missing value in the dense and categorical columns "
        "besides an empty field, as pandas' na_values= (e.g. N/A,NA,-): a dense one becomes "
        "0 after the transform (with --missing-indicator, flagged), a categorical one the "
        "missing id; default: none",
    )
    _add_list_flag(
        g,
        "--time-columns",
        "table: timestamp columns (Unix seconds or milliseconds, an ISO 8601 date-time, a "
        "parquet timestamp), each entering the model as two categorical features, its hour "
        "of day (NAME_hour) and day of week (NAME_weekday, 0 Monday), in UTC: the cycles a "
        "click log's time drives, not a trend that new days sit outside of; default: none",
    )
    g.add_argument(
        "--dense-transform",
        default=None,
        metavar="SPEC",
        help="how dense columns enter the model: one transform for all (log, signed-log, "
        "standardize, minmax, none), per column (price=log,score=standardize) or both "
        "(standardize,price=log). log: log(1 + x), a negative x set to 0 and counted; "
        "signed-log: sign(x) log(1 + |x|); standardize: (x - mean) / std; minmax: "
        "(x - min) / (max - min); statistics of the training split only. A missing value "
        "becomes 0 after the transform (the mean under standardize); " + kinds_default,
    )
    g.add_argument(
        "--missing-indicator",
        action="store_true",
        help="criteo:, avazu:, table: add a 0/1 input per dense column with missing values "
        "in the training split (scikit-learn's add_indicator)",
    )
    g.add_argument(
        "--on-bad-row",
        choices=("error", "skip"),
        default=d.on_bad_row,
        help="a malformed row: error stops at file:line with the reason; skip drops it and "
        "counts it per reason (metrics.json: dataset.bad_rows_skipped)",
    )
    _add_value_flags(g, _ID_VALUES)
    g.add_argument(
        "--cache-dir",
        default=d.cache_dir,
        help="where converted data (a verified binary cache) is kept and reused",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``train``'s model group (``--model``, ``--embedding-dim``, ...) to ``parser``."""
    d = TrainConfig()
    m = parser.add_argument_group("model")
    m.add_argument(
        "--model",
        choices=MODELS,
        default=d.model,
        help="; ".join(f"{name}: {_MODEL_HELP.get(name, name)}" for name in MODELS),
    )
    _add_value_flags(m, _MODEL_VALUES)
    m.add_argument(
        "--hidden",
        type=_int_list,
        default=list(d.hidden),
        metavar="N,N,...",
        help=f"DNN layer sizes (default: {_shown_list(d.hidden)})",
    )
    m.add_argument(
        "--embedding-backend",
        choices=EMBEDDING_BACKENDS,
        default=d.embedding_backend,
        help="cowclip: the fused CowClip tables; torchrec: stock EmbeddingBagCollection + "
        "torch.optim.Adam, for comparison (needs --no-cowclip)",
    )
    m.add_argument(
        "--embedding-dtype",
        choices=("fp32", "fp16", "bf16"),
        default=d.embedding_dtype,
        help="storage of the table weights: fp16/bf16 halve their bytes (updated in float32 "
        "with stochastic rounding; optimizer state stays float32)",
    )


#: The batch and the one the recipe's base values are for: flag -> help.
_BATCH_VALUES: Dict[str, str] = {
    "--batch-size": "global training batch",
    "--base-batch-size": "the batch the recipe's base values are for (s = batch / base)",
}

#: The values the recipe sets from ``s = batch / base``, each overridden by its flag:
#: flag -> help.
_RECIPE_VALUES: Dict[str, str] = {
    "--lr": "dense lr (default: the recipe's; paper: 8e-4 * sqrt(s), Avazu 1e-4 * sqrt(s))",
    "--lr-embed": "embedding lr (default: 1e-2 for table:; else the recipe's, paper: 1e-4, "
    "not scaled)",
    "--l2": "embedding L2 lambda (default: the recipe's; paper: 1e-5 * s)",
    "--clip-r": "CowClip's ratio r (default: the recipe's, 1)",
    "--clip-zeta": "CowClip's lower bound zeta (default: r^2 * sqrt(dim) * bound, bound 1e-5 "
    "Criteo-like, 1e-4 Avazu)",
    "--warmup-epochs": "linear warm-up of the dense lr, in epochs (default: the recipe's; paper: 1)",
    "--count-lr-power": "per-id-frequency embedding lr: a row seen c times in the batch steps with "
    "lr * min(c, s) ** POWER (not in the paper; default: the recipe's, paper: 0 = off; "
    "docs/scaling.md)",
    "--helen-rho": "train the tables with Helen (frequency-wise sharpness-aware minimisation, two "
    "passes per step) with this perturbation radius at this batch (reference: 0.05); "
    "default: the recipe's (off but for recipes with Helen; docs/algorithm.md)",
    "--helen-bound": "Helen's lower bound on a row's frequency share n_j / max n (default: the recipe's, 0.3)",
}


#: The run's counts and sizes: flag -> help.
_RUN_COUNTS: Dict[str, str] = {
    "--epochs": "passes over the training split (default: 10 for table:, stopped early on the "
    "validation AUC; 1 for the paper's data)",
    "--max-steps": "stop after this many steps (0: no limit)",
    "--seed": "initial weights, batch order and the random splits, for every data kind "
    "(synthetic data is also drawn with it unless --synthetic-seed is given)",
    "--early-stop-patience": "stop after this many epochs without a better validation AUC and keep the "
    "best epoch's weights (needs --val-fraction; 0: off; default: 2 for table:, 0 for the "
    "paper's data)",
    "--checkpoint-every": "checkpoint every this many steps (0: at epoch ends only)",
    "--eval-batch-size": "rows per evaluation batch",
    "--threads": "torch intra-op threads (0: torch's choice)",
    "--log-every": "write a steps.csv row (and TensorBoard scalars) every this many steps",
}


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``train``'s optimizer and recipe, run and distributed groups."""
    d = TrainConfig()
    s = parser.add_argument_group(
        "optimizer and recipe",
        "the scaling rule sets every value from --batch-size / --base-batch-size; an "
        "explicit value overrides the recipe's",
    )
    _add_value_flags(s, _BATCH_VALUES)
    s.add_argument(
        "--recipe",
        choices=tuple(RECIPES),
        default=d.recipe,
        help="how every value below scales with s; "
        + "; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values()),
    )
    _add_value_flags(s, _RECIPE_VALUES)
    s.add_argument(
        "--no-cowclip",
        dest="cowclip",
        action="store_false",
        help="train the same fused tables without clipping (a lazy optimizer); default: "
        "CowClip clips",
    )
    s.add_argument(
        "--embedding-optimizer",
        choices=EMBEDDING_OPTIMIZERS,
        default=d.embedding_optimizer,
        help="the tables' optimizer (the paper's: adam)",
    )
    s.add_argument(
        "--helen-perturb-dense",
        action="store_true",
        help="Helen also perturbs the dense parameters (SAM with their global gradient "
        "norm); default: they step with the first pass's gradient",
    )

    r = parser.add_argument_group("run")
    r.add_argument(
        "--out",
        default=None,
        help="run directory (metrics.json, steps.csv, epochs.csv, tb/, checkpoints/); an "
        "existing run there is refused without --resume or --overwrite; default: a new "
        "runs/<YYYYmmdd-HHMMSS> (under torchrun: runs/torchrun-<run id>)",
    )
    r.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the previous run's files in --out first",
    )
    r.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_mode,
        metavar="auto",
        help="continue from the newest intact checkpoint in --out (any number of "
        "processes); refused if a setting that changes the result differs from the "
        "checkpoint's. 'auto': the same if there is a checkpoint, else start anew (for "
        "torchrun --max-restarts and schedulers' retries); default: a new run",
    )
    _add_value_flags(r, _RUN_COUNTS)
    r.add_argument(
        "--keep-checkpoints",
        type=int,
        default=d.keep_checkpoints,
        metavar="K",
        help="keep the last K complete checkpoints (a damaged newest one falls back to "
        "the one before)",
    )
    r.add_argument(
        "--device",
        default=d.device,
        help="auto (CUDA if there is one, else CPU), cpu or cuda[:N]",
    )
    r.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bars (the epoch lines stay); default: progress bars on stderr",
    )
    r.add_argument(
        "--row-clip-stats",
        action="store_true",
        help="count clipped updates per embedding row and report the clip rate by id "
        "frequency in the training split (metrics.json: clip_by_frequency; one process)",
    )
    r.add_argument(
        "--init-from",
        default=None,
        metavar="RUN",
        help="warm start from RUN's model (a finished run's --out): its weights and "
        "encoders, its vocabularies grown by the new ids; the flags not given take RUN's "
        "values (docs/serving.md, Warm start); default: none (a new model)",
    )
    r.add_argument(
        "--init-optimizer-state",
        action="store_true",
        help="with --init-from: also carry the optimizer state of RUN's last checkpoint",
    )
    add_require_sha256(r, "with --init-from: ")

    t = parser.add_argument_group("distributed", "under torchrun or torchx (README, Scale out)")
    t.add_argument(
        "--sharding",
        default=d.sharding,
        choices=SHARDING_CHOICES,
        help="how the embedding tables are sharded (auto: TorchRec's planner chooses per "
        "table); refused on one process",
    )
    t.add_argument(
        "--dist-timeout",
        dest="dist_timeout_s",
        type=float,
        default=d.dist_timeout_s,
        help="seconds any collective may wait (a dead rank fails the job after this)",
    )


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """``parser``'s command ``name``, or ``parser`` itself when it has no commands."""
    # argparse lists a parser's subcommands only in these attributes.
    actions = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = next(actions, None)
    if commands is None:
        return parser
    command: argparse.ArgumentParser = commands.choices[name]
    return command


def train_flags(parser: argparse.ArgumentParser) -> List[str]:
    """The long flags of ``parser``'s ``train`` command (or of ``parser``, a parser of
    train's arguments alone), in ``--help`` order (not ``--help``).

    Example::

        >>> flags = train_flags(train_parser())
        >>> flags[:3], "--seed" in flags, "--help" in flags
        (['--data', '--test-data', '--test-fraction'], True, False)
    """
    # argparse lists a parser's arguments only in this attribute.
    return [
        a.option_strings[-1]
        for a in _command_parser(parser, "train")._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def _given_flags(command: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> set:
    """The ``train`` options ``argv`` gives (their dests), told apart from defaults by
    parsing once with every default set to a marker."""
    marker = object()
    # argparse lists a parser's arguments only in this attribute.
    saved = {a.dest: a.default for a in command._actions if a.option_strings}
    command.set_defaults(**dict.fromkeys(saved, marker))
    try:
        parsed = vars(build_parser_for_given(command, argv))
    finally:
        command.set_defaults(**saved)
    return {dest for dest, value in parsed.items() if dest in saved and value is not marker}


def build_parser_for_given(
    command: argparse.ArgumentParser, argv: Optional[Sequence[str]]
) -> argparse.Namespace:
    """``argv`` (``train ...``) parsed by the ``train`` command's own parser."""
    args = list(sys.argv[1:] if argv is None else argv)
    return command.parse_args(args[1:] if args and args[0] == "train" else args)


def _differs(value: Any, default: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) != list(default)
    return bool(value != default)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed :func:`add_train_arguments` flags; arguments of
    the command's own (a sweep's) are left out.

    Example::

        >>> args = train_parser().parse_args(["--data", "synthetic:1000"])
        >>> config_from_args(args).data, config_from_args(args).hidden
        ('synthetic:1000', (400, 400, 400))
    """
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["hidden"] = tuple(values["hidden"])
    return TrainConfig(**values)


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers the ``train`` command on ``subparsers``."""
    train = subparsers.add_parser(
        "train",
        help="train a CTR model and write metrics.json",
        description="Train a CTR model on --data and write metrics.json, logs and checkpoints "
        "to --out.",
        formatter_class=HelpFormatter,
    )
    add_train_arguments(train)
    return train


def train_parser() -> argparse.ArgumentParser:
    """A parser of ``train``'s arguments alone (to write and check a config's command)."""
    parser = argparse.ArgumentParser(prog="torchrec-cowclip train", add_help=False)
    add_train_arguments(parser)
    return parser


def _flag_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def train_argv(
    parser: argparse.ArgumentParser, config: TrainConfig, what: str = "a train command"
) -> List[str]:
    """The ``train`` arguments that make ``config`` (every option not at its default),
    checked by parsing them back with ``parser`` (:func:`train_parser`); ``what`` names
    the command in the refusal.

    Example::

        >>> train_argv(train_parser(), TrainConfig(data="synthetic:1000", hidden=(16, 8)))
        ['--data', 'synthetic:1000', '--hidden', '16,8']

    Raises:
        ConfigError: an option that has no command-line form, or flags that do not
            reproduce the config.
    """
    values = config.as_dict()
    argv: List[str] = []
    # argparse lists a parser's arguments only in this attribute.
    for action in parser._actions:
        if not action.option_strings or action.dest not in values:
            continue
        value, default = values[action.dest], action.default
        if value == default or (
            isinstance(default, (list, tuple)) and list(value) == list(default)
        ):
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false / store_const
            if value != action.const:
                raise ConfigError(f"{flag}: {value!r} has no command-line form")
            argv.append(flag)
        elif action.nargs == "?" and value is action.const:
            argv.append(flag)
        elif value is not None:
            argv += [flag, _flag_value(value)]
    try:
        back = config_from_args(parser.parse_args(argv))
    except SystemExit:
        back = None
    if back != config:
        raise ConfigError(f"{what} does not reproduce its settings: {' '.join(argv)}")
    return argv


def command_settings(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    argv: Optional[Sequence[str]],
    process: Optional[ProcessContext] = None,
) -> Tuple[TrainSettings, Optional[str]]:
    """The settings of a parsed ``train`` command (its config validated and resolved once),
    and the line naming what a warm start took from RUN (None without ``--init-from``): the
    flags not given take RUN's values (its model, its data)."""
    said = None
    if args.init_from:
        from torchrec_cowclip.train.warm_start import inherited_line, warm_start_defaults

        command = _command_parser(parser, "train")
        given = _given_flags(command, argv)
        defaults = warm_start_defaults(args.init_from)
        # argparse lists a parser's arguments only in this attribute.
        stock = {a.dest: a.default for a in command._actions}
        inherited = {
            k: v
            for k, v in defaults.items()
            if k not in given and k in stock and _differs(v, stock[k])
        }
        command.set_defaults(**defaults)
        args = parser.parse_args(argv)
        said = inherited_line(args.init_from, inherited)
    return config_from_args(args).resolve(process), said


def failure(error: BaseException, interrupted: str) -> Optional[Tuple[int, str]]:
    """How a command that raised ``error`` exits: its status and the one line it writes on
    stderr; None for an error that is no refusal, failure or stop (a bug: shown whole).
    ``interrupted`` says what a Ctrl-C outside a training loop stopped (the command, and
    whether anything was written)."""
    from torchrec_cowclip.data.errors import DataError  # deferred: keeps --help fast
    from torchrec_cowclip.distributed.comm import CollectiveError
    from torchrec_cowclip.run.checkpoints import CheckpointWriteError, NonFiniteStateError
    from torchrec_cowclip.run.no_space import one_line
    from torchrec_cowclip.run.stop import RunStopped
    from torchrec_cowclip.train.trainer import NonFiniteLossError

    if isinstance(error, (ConfigError, DataError, FileNotFoundError, ImportError)):
        return EXIT_USAGE, f"torchrec-cowclip: error: {error}\n"
    if isinstance(error, (NonFiniteLossError, NonFiniteStateError)):
        return EXIT_DIVERGED, f"torchrec-cowclip: {error}\n"
    if isinstance(error, (CheckpointWriteError, CollectiveError, OSError)):
        return EXIT_ENVIRONMENT, f"torchrec-cowclip: error: {one_line(error)}\n"
    if isinstance(error, RunStopped):
        return error.exit_status, f"torchrec-cowclip: {error}\n"
    if isinstance(error, KeyboardInterrupt):
        # Ctrl-C outside a training loop (which stops after its step instead): every
        # writer has removed its temporaries on the way out.
        return EXIT_INTERRUPTED, f"torchrec-cowclip: interrupted by SIGINT ({interrupted})\n"
    return None


@contextlib.contextmanager
def exiting_on_failure(interrupted: str) -> Iterator[None]:
    """Around a command's work: a :func:`failure` becomes its line on stderr and
    ``SystemExit`` with its status; anything else propagates."""
    try:
        yield
    except BaseException as error:
        failed = failure(error, interrupted)
        if failed is None:
            raise
        status, line = failed
        sys.stderr.write(line)
        raise SystemExit(status) from None


#: What ``torchrec-cowclip train`` prints when the run ends (rank 0), from metrics.json.
SUMMARY_KEYS = (
    "auc",
    "logloss",
    "best_epoch",
    "epochs",
    "steps",
    "train_samples_per_s",
    "rows_updated",
    "rows_clipped",
)


def run_train(settings: TrainSettings, said: Optional[str] = None) -> int:
    """The ``train`` command for a resolved config: trains, prints the summary (rank 0)
    and returns 0; a failure exits (:func:`exiting_on_failure`). ``said``: the warm start's
    line (:func:`command_settings`), printed once RUN is verified."""
    from torchrec_cowclip.train.processes import shutdown_distributed
    from torchrec_cowclip.train.trainer import Trainer

    main = settings.process.is_main
    with exiting_on_failure("train"):
        trainer = Trainer(settings)  # RUN verified and the command checked against it
        if said is not None and main:
            print(said, file=sys.stderr, flush=True)
        metrics = trainer.run()
    shutdown_distributed()
    if not main:
        return 0  # rank 0 reports for a multi-process run
    print(json.dumps({k: metrics[k] for k in SUMMARY_KEYS}, indent=2))
    return 0

"""``torchrec-cowclip`` / ``python -m torchrec_cowclip``: the command line.

Example::

    torchrec-cowclip train --model deepfm --data criteo:train.txt --batch-size 131072 \\
        --epochs 1 --out runs/criteo-128k
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
from typing import Any, Iterator, List, Optional, Sequence

from torchrec_cowclip.cli_help import HelpFormatter
from torchrec_cowclip.models.embeddings import EMBEDDING_BACKENDS
from torchrec_cowclip.plan.cli import add_plan_parser
from torchrec_cowclip.serve.cli import COMMANDS as SERVING_COMMANDS
from torchrec_cowclip.serve.cli import add_commands, run_command
from torchrec_cowclip.sweep.cli import add_sweep_parser
from torchrec_cowclip.train.config import EMBEDDING_OPTIMIZERS, MODELS, ConfigError, TrainConfig
from torchrec_cowclip.train.distributed import SHARDING_CHOICES
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


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``train``'s arguments to ``parser``, in five groups: data, model, optimizer and
    recipe, run, distributed. Another command that trains (a sweep) reuses them.

    Example::

        >>> p = argparse.ArgumentParser(formatter_class=HelpFormatter)
        >>> add_train_arguments(p)
        >>> args = p.parse_args(["--data", "synthetic:1000", "--dense", "price, age"])
        >>> args.dense, args.batch_size, args.out is None
        (['price', 'age'], 1024, True)
    """
    add_data_arguments(parser)
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
    g.add_argument(
        "--test-fraction",
        type=float,
        default=d.test_fraction,
        help="share of --data's rows drawn at random (seeded by --seed) as the test split",
    )
    g.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="share of the training rows held out for validation (early stopping, "
        "best_epoch); 0: no validation split",
    )
    g.add_argument("--label", default=None, help="table: the label column (0/1); default: none")
    g.add_argument(
        "--dense",
        type=_csv_list,
        default=[],
        metavar="A,B,...",
        help="table:, avazu: numeric columns (names stripped: 'price, age' is price and "
        "age); default: none",
    )
    g.add_argument(
        "--sparse",
        type=_csv_list,
        default=[],
        metavar="A,B,...",
        help="table:, avazu: categorical columns, each its own embedding table; default: "
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
    g.add_argument(
        "--columns",
        type=_csv_list,
        default=[],
        metavar="A,B,...",
        help="table: the columns of header-less files, in order (implies --no-header, "
        "as pandas' names=); default: none",
    )
    g.add_argument(
        "--na-values",
        type=_csv_list,
        default=[],
        metavar="A,B,...",
        help="table: texts that mean a missing value in the dense and categorical columns "
        "besides an empty field, as pandas' na_values= (e.g. N/A,NA,-): a dense one becomes "
        "0 after the transform (with --missing-indicator, flagged), a categorical one the "
        "missing id; default: none",
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
    g.add_argument(
        "--hash-size",
        type=int,
        default=None,
        help="hash categorical values into this many ids per feature; default: an exact "
        "vocabulary of the training files",
    )
    g.add_argument(
        "--min-count",
        type=int,
        default=d.min_count,
        help="vocabulary: values seen fewer times share one out-of-vocabulary id",
    )
    g.add_argument(
        "--cache-dir",
        default=d.cache_dir,
        help="where converted data (a verified binary cache) is kept and reused",
    )
    g.add_argument(
        "--synthetic-scale",
        type=float,
        default=None,
        help="synthetic: multiply Criteo Kaggle's cardinalities by this (default: 1.0)",
    )
    g.add_argument(
        "--synthetic-max-cardinality",
        type=int,
        default=None,
        help="synthetic: cap every table at this many rows (default: 1,000,000)",
    )
    g.add_argument(
        "--synthetic-seed",
        type=int,
        default=None,
        help="synthetic: the generator's seed, to draw other rows than --seed's (default: --seed)",
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
    m.add_argument("--embedding-dim", type=int, default=d.embedding_dim, help="embedding size D")
    m.add_argument(
        "--hidden",
        type=_int_list,
        default=list(d.hidden),
        metavar="N,N,...",
        help=f"DNN layer sizes (default: {_shown_list(d.hidden)})",
    )
    m.add_argument(
        "--cross-layers",
        type=int,
        default=d.cross_layers,
        help="dcn, dcnv2, dlrm_dcn: cross layers",
    )
    m.add_argument("--init-std", type=float, default=d.init_std, help="embedding init N(0, std^2)")
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


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``train``'s optimizer and recipe, run and distributed groups."""
    d = TrainConfig()
    s = parser.add_argument_group(
        "optimizer and recipe",
        "the scaling rule sets every value from --batch-size / --base-batch-size; an "
        "explicit value overrides the recipe's",
    )
    s.add_argument("--batch-size", type=int, default=d.batch_size, help="global training batch")
    s.add_argument(
        "--base-batch-size",
        type=int,
        default=d.base_batch_size,
        help="the batch the recipe's base values are for (s = batch / base)",
    )
    s.add_argument(
        "--recipe",
        choices=tuple(RECIPES),
        default=d.recipe,
        help="how every value below scales with s; "
        + "; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values()),
    )
    s.add_argument(
        "--lr",
        type=float,
        default=None,
        help="dense lr (default: the recipe's; paper: 8e-4 * sqrt(s), Avazu 1e-4 * sqrt(s))",
    )
    s.add_argument(
        "--lr-embed",
        type=float,
        default=None,
        help="embedding lr (default: the recipe's; paper: 1e-4, not scaled)",
    )
    s.add_argument(
        "--l2",
        type=float,
        default=None,
        help="embedding L2 lambda (default: the recipe's; paper: 1e-5 * s)",
    )
    s.add_argument(
        "--clip-r", type=float, default=None, help="CowClip's ratio r (default: the recipe's, 1)"
    )
    s.add_argument(
        "--clip-zeta",
        type=float,
        default=None,
        help="CowClip's lower bound zeta (default: r^2 * sqrt(dim) * bound, bound 1e-5 "
        "Criteo-like, 1e-4 Avazu)",
    )
    s.add_argument(
        "--warmup-epochs",
        type=float,
        default=None,
        help="linear warm-up of the dense lr, in epochs (default: the recipe's; paper: 1)",
    )
    s.add_argument(
        "--count-lr-power",
        type=float,
        default=None,
        help="per-id-frequency embedding lr: a row seen c times in the batch steps with "
        "lr * min(c, s) ** POWER (not in the paper; default: the recipe's, paper: 0 = off; "
        "docs/scaling.md)",
    )
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
        "--helen-rho",
        type=float,
        default=d.helen_rho,
        help="train the tables with Helen (frequency-wise sharpness-aware minimisation, two "
        "passes per step) with this perturbation radius at this batch (reference: 0.05); "
        "default: the recipe's (off but for recipes with Helen; docs/algorithm.md)",
    )
    s.add_argument(
        "--helen-bound",
        type=float,
        default=d.helen_bound,
        help="Helen's lower bound on a row's frequency share n_j / max n (default: the "
        "recipe's, 0.3)",
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
    r.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training split")
    r.add_argument(
        "--max-steps",
        type=int,
        default=d.max_steps,
        help="stop after this many steps (0: no limit)",
    )
    r.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="initial weights, batch order and the random splits, for every data kind "
        "(synthetic data is also drawn with it unless --synthetic-seed is given)",
    )
    r.add_argument(
        "--early-stop-patience",
        type=int,
        default=d.early_stop_patience,
        help="stop after this many epochs without a better validation AUC and keep the "
        "best epoch's weights (needs --val-fraction; 0: off)",
    )
    r.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="checkpoint every this many steps (0: at epoch ends only)",
    )
    r.add_argument(
        "--keep-checkpoints",
        type=int,
        default=d.keep_checkpoints,
        metavar="K",
        help="keep the last K complete checkpoints (a damaged newest one falls back to "
        "the one before)",
    )
    r.add_argument(
        "--eval-batch-size", type=int, default=d.eval_batch_size, help="rows per evaluation batch"
    )
    r.add_argument(
        "--device",
        default=d.device,
        help="auto (CUDA if there is one, else CPU), cpu or cuda[:N]",
    )
    r.add_argument(
        "--threads", type=int, default=d.threads, help="torch intra-op threads (0: torch's choice)"
    )
    r.add_argument(
        "--log-every",
        type=int,
        default=d.log_every,
        help="write a steps.csv row (and TensorBoard scalars) every this many steps",
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrec-cowclip",
        description="Large-batch CTR training on TorchRec with CowClip (Zheng et al., AAAI 2023).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a CTR model and write metrics.json",
        description="Train a CTR model on --data and write metrics.json, logs and checkpoints "
        "to --out.",
        formatter_class=HelpFormatter,
    )
    add_train_arguments(train)
    # The sweep runs `train` once per cell: it takes train's arguments from here
    # (torchrec_cowclip.sweep.cli never imports this module: no cycle).
    add_sweep_parser(sub, add_train_arguments, config_from_args)
    # `plan` reads train's data and model flags and writes train's launch command.
    add_plan_parser(
        sub, add_data_arguments, add_model_arguments, add_train_arguments, config_from_args
    )
    add_commands(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    # argparse lists a parser's subcommands only in these attributes.
    actions = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command: argparse.ArgumentParser = next(actions).choices[name]
    return command


def train_flags(parser: argparse.ArgumentParser) -> List[str]:
    """The long flags of ``parser``'s ``train`` command, in ``--help`` order (not ``--help``).

    Example::

        >>> flags = train_flags(build_parser())
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

        >>> args = build_parser().parse_args(["train", "--data", "synthetic:1000"])
        >>> config_from_args(args).data, config_from_args(args).hidden
        ('synthetic:1000', (400, 400, 400))
    """
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["hidden"] = tuple(values["hidden"])
    return TrainConfig(**values)


#: Exit statuses (README, "Reliability"): the command, its data or its checkpoint is
#: wrong; the training diverged; the environment failed (a full or read-only disk, a
#: dead or hung peer); a signal stopped the run after its checkpoint (``RunStopped``, 75).
EXIT_USAGE, EXIT_DIVERGED, EXIT_ENVIRONMENT = 2, 3, 4
#: Ctrl-C (SIGINT) where no step is in flight: 128 + SIGINT, as a shell reports it.
EXIT_INTERRUPTED = 130


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, a redirect):
    logging assigns ``stream``, which here is always the current stderr."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _Lines(logging.Formatter):
    """A record as its message, a warning or worse marked as such."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


_HANDLER = _Stderr()
_HANDLER.setFormatter(_Lines("%(message)s"))


@contextlib.contextmanager
def package_log_shown(rank: int) -> Iterator[None]:
    """The package's log on stderr while the command runs: what converting data is doing
    and its notes (rows skipped, values clipped or set to 0) from rank 0, errors from every
    rank. Its records do not also reach the root logger's handlers meanwhile (one that an
    imported library configured would print each twice); the logger is restored after."""
    logger = logging.getLogger("torchrec_cowclip")
    saved = logger.level, logger.propagate
    logger.addHandler(_HANDLER)
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(_HANDLER)
        logger.level, logger.propagate = saved


def main(argv: Optional[Sequence[str]] = None) -> int:
    with package_log_shown(int(os.environ.get("RANK", "0"))):
        return _main(argv)


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "sweep":
        return int(args.run_sweep(args))
    if args.command == "plan":
        return int(args.run_plan(args, argv))
    from torchrec_cowclip.data.errors import DataError  # deferred: keeps --help fast
    from torchrec_cowclip.distributed.comm import CollectiveError
    from torchrec_cowclip.train.checkpoint import CheckpointWriteError, NonFiniteStateError
    from torchrec_cowclip.train.distributed import shutdown_distributed
    from torchrec_cowclip.train.no_space import one_line
    from torchrec_cowclip.train.stop import RunStopped, raising_on_sigterm
    from torchrec_cowclip.train.trainer import NonFiniteLossError, Trainer
    from torchrec_cowclip.train.warm_start import inherited_line, warm_start_defaults

    try:
        if args.command in SERVING_COMMANDS:
            with raising_on_sigterm(f"{args.command}: nothing was written; run it again"):
                summary = run_command(args)
            print(json.dumps(summary, indent=2, default=str))
            return 0
        said = None
        if args.init_from:
            # A warm start: the flags not given take RUN's values (its model, its data).
            command = _command_parser(parser, "train")
            given = _given_flags(command, argv)
            defaults = warm_start_defaults(args.init_from)
            stock = {a.dest: a.default for a in command._actions}
            inherited = {
                k: v
                for k, v in defaults.items()
                if k not in given and k in stock and _differs(v, stock[k])
            }
            command.set_defaults(**defaults)
            args = parser.parse_args(argv)
            said = inherited_line(args.init_from, inherited)
        config = config_from_args(args)
        config.validate()
        trainer = Trainer(config)  # RUN verified and the command checked against it
        if args.init_from and said is not None and int(os.environ.get("RANK", "0")) == 0:
            print(said, file=sys.stderr, flush=True)
        metrics = trainer.run()
    except (ConfigError, DataError, FileNotFoundError, ImportError) as e:
        parser.exit(EXIT_USAGE, f"torchrec-cowclip: error: {e}\n")
    except (NonFiniteLossError, NonFiniteStateError) as e:
        parser.exit(EXIT_DIVERGED, f"torchrec-cowclip: {e}\n")
    except (CheckpointWriteError, CollectiveError, OSError) as e:
        parser.exit(EXIT_ENVIRONMENT, f"torchrec-cowclip: error: {one_line(e)}\n")
    except RunStopped as e:
        parser.exit(e.exit_status, f"torchrec-cowclip: {e}\n")
    except KeyboardInterrupt:
        # Ctrl-C outside a training loop (which stops after its step instead): every
        # writer has removed its temporaries on the way out.
        where = (
            f"{args.command}: nothing was written"
            if args.command in SERVING_COMMANDS
            else args.command
        )
        parser.exit(EXIT_INTERRUPTED, f"torchrec-cowclip: interrupted by SIGINT ({where})\n")
    shutdown_distributed()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports for a multi-process run
    summary = {
        k: metrics[k]
        for k in (
            "auc",
            "logloss",
            "best_epoch",
            "epochs",
            "steps",
            "train_samples_per_s",
            "rows_updated",
            "rows_clipped",
        )
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``torchrec-cowclip train``: its flags, their config, and the command's run.

The flags are built here from the options' declarations
(:class:`~torchrec_cowclip.train.config.TrainConfig`, :mod:`torchrec_cowclip.train.options`),
in their five groups (data, model, optimizer and recipe, run, distributed); the commands
that train or read train's data (``sweep``, ``plan``) add the same groups, and
:func:`train_argv` writes a config as the flags that make it (a sweep cell's command, a
plan's launch command), from the same declarations. :func:`run_train` is the command itself,
after its flags: the training run, its summary, and every failure as one line and an exit
status (:func:`exiting_on_failure`), as the program's command line
(:mod:`torchrec_cowclip.cli`, whose docstring shows a command) and a sweep's cell
processes run it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Collection, Dict, Iterator, List, Optional, Sequence, Tuple

from torchrec_cowclip.cli_help import HelpFormatter
from torchrec_cowclip.failures import (
    EXIT_DIVERGED,
    EXIT_ENVIRONMENT,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    ConfigError,
)
from torchrec_cowclip.process_context import ProcessContext
from torchrec_cowclip.train.config import TrainConfig, TrainSettings
from torchrec_cowclip.train.options import GROUPS, Declared, declarations


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


#: How each form of option (:attr:`~torchrec_cowclip.train.options.Declared.form`) is
#: parsed: ``add_argument``'s keywords.
_FORMS: Dict[str, Dict[str, Any]] = {
    "switch": {"action": "store_true"},
    "off": {"action": "store_false"},
    "names": {"type": _csv_list, "metavar": "A,B,..."},
    "ints": {"type": _int_list, "metavar": "N,N,..."},
    "optional": {"nargs": "?", "const": True, "type": _resume_mode},
    "value": {},
}


def parsed_default(option: Declared) -> Any:
    """What the parser gives for ``option`` when its flag is not given: its default (a
    list for a tuple), None for one a training command must be given (``--data``)."""
    if option.option.required:
        return None
    default = option.default
    return list(default) if isinstance(default, tuple) else default


def _add_option(
    group: Any,
    option: Declared,
    required: bool = False,
    given_only: bool = False,
    text: Optional[str] = None,
    aliases: Sequence[str] = (),
) -> None:
    """Adds ``option``'s flag to ``group`` as its declaration says (``required``: a
    required option must be given; ``given_only``: no default, so that a parse holds
    only the options given; ``text`` and ``aliases``: another command's help for it and
    other flags of it)."""
    o, default = option.option, parsed_default(option)
    text = o.help if text is None else text
    if o.required and not required:
        text += " (default: none)"
    if option.form == "ints" and default:
        text += f" (default: {','.join(str(v) for v in default)})"
    keywords: Dict[str, Any] = {"dest": option.name, "help": text, **_FORMS[option.form]}
    if option.form == "value":
        if option.scalar is not None:
            keywords["type"] = option.scalar
        if o.choices is not None:
            keywords["choices"] = o.choices
    if o.metavar:
        keywords["metavar"] = o.metavar
    if o.required and required:
        keywords["required"] = True
    keywords["default"] = argparse.SUPPRESS if given_only else default
    group.add_argument(option.flag, *aliases, **keywords)


def add_train_option(group: Any, name: str, text: str, *aliases: str) -> None:
    """Adds ``train``'s option ``name`` (a field of
    :class:`~torchrec_cowclip.train.config.TrainConfig`) to another command's ``group``
    as declared - its flag, type, default and choices - with that command's help
    ``text`` (and more flags, ``aliases``): a plan's ``--batch-size`` is train's.

    Example::

        >>> p = argparse.ArgumentParser()
        >>> add_train_option(p, "embedding_optimizer", "the tables' optimizer", "--optimizer")
        >>> p.parse_args(["--optimizer", "sgd"]).embedding_optimizer
        'sgd'
    """
    option = next(o for o in declarations(TrainConfig) if o.name == name)
    _add_option(group, option, text=text, aliases=aliases)


def add_train_arguments(
    parser: argparse.ArgumentParser,
    data_required: bool = True,
    groups: Optional[Collection[str]] = None,
    leave_out: Collection[str] = (),
    given_only: bool = False,
) -> None:
    """Adds ``train``'s arguments to ``parser``, from their declarations
    (:class:`~torchrec_cowclip.train.config.TrainConfig`), in their ``--help`` groups
    (:data:`~torchrec_cowclip.train.options.GROUPS`: data, model, optimizer and recipe,
    run, distributed; ``groups``: only these). Another command that trains (a sweep) or
    reads train's data (a plan) reuses them: ``data_required``: whether ``--data`` must
    be given; ``leave_out``: the options (field names) the command declares otherwise;
    ``given_only``: no defaults (a parse holds the options given, nothing else).

    Example::

        >>> p = argparse.ArgumentParser(formatter_class=HelpFormatter)
        >>> add_train_arguments(p)
        >>> args = p.parse_args(["--data", "synthetic:1000", "--dense", "price, age"])
        >>> args.dense, args.batch_size, args.out is None
        (['price', 'age'], 1024, True)
    """
    options = declarations(TrainConfig)
    for title, description in GROUPS.items():
        if groups is not None and title not in groups:
            continue
        group = parser.add_argument_group(title, description)
        for option in options:
            if option.option.group == title and option.name not in leave_out:
                _add_option(group, option, data_required, given_only)


def add_data_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Adds ``train``'s data group (``--data`` and every option of how it is read) to
    ``parser``: another command that reads train's data (a plan) reads it with the same
    flags. ``required``: whether ``--data`` must be given."""
    add_train_arguments(parser, required, groups=("data",))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``train``'s model group (``--model``, ``--embedding-dim``, ...) to ``parser``."""
    add_train_arguments(parser, groups=("model",))


def group_options(title: str) -> List[Declared]:
    """The options of ``train``'s ``--help`` group ``title`` (``data``, ``model``, ...),
    in order: what another command that adds the group (a plan) checks them by.

    Example::

        >>> [o.flag for o in group_options("distributed")]
        ['--sharding', '--dist-timeout']
    """
    return [o for o in declarations(TrainConfig) if o.option.group == title]


def train_flags(parser: Optional[argparse.ArgumentParser] = None) -> List[str]:
    """The long flags of ``train``, in ``--help`` order (not ``--help``): its options'
    declarations, which every parser of train's arguments (``parser``, the program's or
    train's own) is built from.

    Example::

        >>> flags = train_flags()
        >>> flags[:3], "--seed" in flags, "--help" in flags
        (['--data', '--test-data', '--test-fraction'], True, False)
    """
    return [option.flag for option in declarations(TrainConfig)]


def given_options(argv: Optional[Sequence[str]]) -> Dict[str, Any]:
    """The ``train`` options ``argv`` (``train ...``) gives, by field name: parsed by a
    parser of train's arguments without defaults, so that it holds only those given."""
    parser = argparse.ArgumentParser(prog="torchrec-cowclip train", add_help=False)
    add_train_arguments(parser, data_required=False, given_only=True)
    args = list(sys.argv[1:] if argv is None else argv)
    return vars(parser.parse_args(args[1:] if args and args[0] == "train" else args))


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed :func:`add_train_arguments` flags; arguments of
    the command's own (a sweep's) are left out.

    Example::

        >>> args = train_parser().parse_args(["--data", "synthetic:1000"])
        >>> config_from_args(args).data, config_from_args(args).hidden
        ('synthetic:1000', (400, 400, 400))
    """
    names = {option.name for option in declarations(TrainConfig)}
    return TrainConfig.from_dict({k: v for k, v in vars(args).items() if k in names})


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
    """A parser of ``train``'s arguments alone."""
    parser = argparse.ArgumentParser(prog="torchrec-cowclip train", add_help=False)
    add_train_arguments(parser)
    return parser


def train_argv(
    parser: Optional[argparse.ArgumentParser], config: TrainConfig, what: str = "a train command"
) -> List[str]:
    """The ``train`` arguments that make ``config``: each option not at the value its
    flag's absence gives, written as its declaration's form says (``parser``, a parser of
    train's arguments, is built from the same declarations); ``what`` names the command
    in the refusal.

    Example::

        >>> train_argv(train_parser(), TrainConfig(data="synthetic:1000", hidden=(16, 8)))
        ['--data', 'synthetic:1000', '--hidden', '16,8']

    Raises:
        ConfigError: an option that has no command-line form (its words would not
            reproduce the config).
    """
    argv: List[str] = []
    for option in declarations(TrainConfig):
        try:
            argv += option.argv(getattr(config, option.name), parsed_default(option))
        except ValueError as e:
            raise ConfigError(f"{what} does not reproduce its settings: {e}") from None
    return argv


def command_settings(
    args: argparse.Namespace,
    argv: Optional[Sequence[str]],
    process: Optional[ProcessContext] = None,
) -> Tuple[TrainSettings, Optional[str]]:
    """The settings of a parsed ``train`` command (its config validated and resolved once,
    for the launch ``process``), and the line naming what a warm start took from RUN (None
    without ``--init-from``): the options not given take RUN's values (its model, its
    data; :func:`~torchrec_cowclip.train.warm_start.warm_start_defaults`)."""
    config, said = config_from_args(args), None
    if args.init_from:
        from torchrec_cowclip.train.warm_start import inherited_line, warm_start_defaults

        given = given_options(argv)
        stock = {option.name: parsed_default(option) for option in declarations(TrainConfig)}
        taken = {k: v for k, v in warm_start_defaults(args.init_from).items() if k not in given}
        inherited = {k: v for k, v in taken.items() if k in stock and _differs(v, stock[k])}
        config = TrainConfig.from_dict({**config.as_dict(), **taken})
        said = inherited_line(args.init_from, inherited)
    return config.resolve(process), said


def _differs(value: Any, default: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) != list(default)
    return bool(value != default)


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
    from torchrec_cowclip.train.loop import NonFiniteLossError

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
    from torchrec_cowclip.train.start import start_run

    main = settings.process.is_main
    with exiting_on_failure("train"):
        loop = start_run(settings)  # RUN verified and the command checked against it
        if said is not None and main:
            print(said, file=sys.stderr, flush=True)
        metrics = loop.run()
    shutdown_distributed()
    if not main:
        return 0  # rank 0 reports for a multi-process run
    print(json.dumps({k: metrics[k] for k in SUMMARY_KEYS}, indent=2))
    return 0

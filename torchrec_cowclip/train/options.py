"""How a training option is declared: once, as a field of
:class:`~torchrec_cowclip.train.config.TrainConfig` made by :func:`option`.

The field gives the option's name, type and default; :class:`Option`, in its metadata,
the rest: the ``--help`` group and text, the flag (default ``--`` and the name with
dashes), the choices, a metavar, the check of its value, whether ``--data``-reading
commands must be given it, and whether ``--init-from`` takes RUN's value for it.
Everything else is derived from that: the parser and ``--help``
(:mod:`torchrec_cowclip.train.command`), the check of each value (:meth:`Declared.check`),
the command line a config is written as (:meth:`Declared.argv`), the records a run and a sweep
cell write (``TrainConfig.as_dict``), what a warm start inherits.

Example::

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Demo:
    ...     batch_size: int = option(1024, group="run", help="global batch", check=positive)
    ...     cowclip: bool = option(True, group="run", help="clip", flag="--no-cowclip")
    >>> [(d.name, d.flag, d.form) for d in declarations(Demo)]
    [('batch_size', '--batch-size', 'value'), ('cowclip', '--no-cowclip', 'off')]
    >>> declarations(Demo)[0].check(0)
    Traceback (most recent call last):
    ...
    torchrec_cowclip.failures.ConfigError: --batch-size must be > 0, got 0
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Collection,
    Dict,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from torchrec_cowclip.failures import ConfigError

#: A check of one value: None when it is fine, else what is wrong with it, said after
#: the flag (``"must be > 0, got 0"``).
Check = Callable[[Any], Optional[str]]

#: ``--help``'s groups of train's options, in order: title -> description.
GROUPS: Dict[str, Optional[str]] = {
    "data": None,
    "model": None,
    "optimizer and recipe": "the scaling rule sets every value from --batch-size / "
    "--base-batch-size; an explicit value overrides the recipe's",
    "run": None,
    "distributed": "under torchrun or torchx (README, Scale out)",
}


@dataclass(frozen=True)
class Option:
    """An option's declaration beside its field (see the module docstring).

    Attributes:
        group: its ``--help`` group (:data:`GROUPS`).
        help: its ``--help`` text (the default is appended unless the text says it).
        flag: its flag; default ``--`` and the field's name with dashes.
        choices: the values it takes (a live registry is read when checked).
        metavar: how ``--help`` names its value.
        check: the check of a value (:data:`Check`); a float is also checked finite.
        required: a command that trains must give it (``--data``).
        inherited: ``--init-from`` takes RUN's value where the command gives none.
        finite: a float value must be finite (False where its own type checks it).
        label: how a message comparing two runs' settings names the option beside its
            flag (``CowClip (--no-cowclip)``); default: the flag alone.
        resumable: a resumed run may change it (``--resume`` compares every other
            setting with the checkpoint's; run/resume_guard.py), because it changes no
            number the run produces (weights, metrics.json): how often the run logs,
            checkpoints or shows progress, where it stops (``--epochs`` only upwards), how
            it was started, where it writes, where the binary cache lives (the data is
            compared by fingerprint), how long a collective may wait; ``--sharding`` too,
            deliberately: a checkpoint re-shards on load (the same math on the same global
            batches; only float summation order differs). Not ``--threads``, ``--device``
            or ``--eval-batch-size``, which can move the last bits of float sums, nor
            ``--init-std``, which metrics.json reports.
        to: its name in its group's settings where that is not the option's own
            (``--model`` is the model spec's ``name``; ``--synthetic-scale`` the source
            kind's ``cardinality_scale``; ``--lr`` the recipe's resolved ``dense_lr``).
        given: what its group's settings are given for a value (``--no-header``: the
            source kind's ``header=False``); default: the value as it is.
        also: other groups whose settings are given it too (``--batch-size``, a recipe
            option, is also the loop's: ``("run",)``).
    """

    group: str
    help: str
    flag: Optional[str] = None
    choices: Optional[Collection[str]] = None
    metavar: Optional[str] = None
    check: Optional[Check] = None
    required: bool = False
    inherited: bool = True
    finite: bool = True
    label: Optional[str] = None
    resumable: bool = False
    to: Optional[str] = None
    given: Optional[Callable[[Any], Any]] = None
    also: Tuple[str, ...] = ()

    def flag_of(self, name: str) -> str:
        return self.flag or "--" + name.replace("_", "-")


def option(
    default: Any = dataclasses.MISSING,
    *,
    factory: Optional[Callable[[], Any]] = None,
    **declaration: Any,
) -> Any:
    """A dataclass field declaring an option: its default (or ``factory``), and the
    :class:`Option` (``group``, ``help``, ...) in its metadata."""
    metadata = {"option": Option(**declaration)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Declared:
    """One option as its class declares it: the field's name, type and default with its
    :class:`Option` (:func:`declarations`)."""

    name: str
    type: Any
    field: "dataclasses.Field[Any]"
    option: Option

    @property
    def flag(self) -> str:
        """Its flag (``--dist-timeout`` for ``dist_timeout_s``)."""
        return self.option.flag_of(self.name)

    @property
    def named(self) -> str:
        """How a message comparing two runs' settings names it: its flag, after its
        label where it has one (``CowClip (--no-cowclip)``)."""
        label = self.option.label
        return f"{label} ({self.flag})" if label else self.flag

    @property
    def default(self) -> Any:
        """Its default (a fresh one for a list)."""
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default

    @property
    def value_type(self) -> Any:
        """Its type, ``Optional[X]`` as ``X`` (:func:`without_none`)."""
        return without_none(self.type)

    @property
    def form(self) -> str:
        """How the option is written on a command line, from its type: ``switch`` (a bool
        off by default: the flag sets it), ``off`` (a bool on by default: its ``--no-``
        flag clears it), ``names`` (``A,B,...``), ``ints`` (``N,N,...``), ``optional``
        (the flag alone, or with ``auto``), or ``value`` (the flag and one value)."""
        kind = self.value_type
        if kind is bool:
            return "off" if self.field.default is True else "switch"
        origin = get_origin(kind)
        if origin is list:
            return "names"
        if origin is tuple:
            return "ints"
        if origin is Union:  # a bool or a word: --resume [auto]
            return "optional"
        return "value"

    @property
    def scalar(self) -> Optional[type]:
        """The type a ``value`` option's text converts to (None: it stays text)."""
        kind = self.value_type
        return kind if kind in (int, float) else None

    def check(self, value: Any) -> None:
        """Raises :class:`ConfigError` naming the flag if ``value`` is not one the option
        takes: finite (a float), one of its choices, its own check."""
        if value is None:
            return
        o = self.option
        if o.finite and self.scalar is float and not math.isfinite(value):
            raise ConfigError(f"{self.flag} must be a finite number, got {value}")
        if o.choices is not None and value not in o.choices:
            raise ConfigError(f"{self.flag} must be one of {', '.join(o.choices)}, got {value!r}")
        wrong = o.check(value) if o.check is not None else None
        if wrong:
            raise ConfigError(f"{self.flag} {wrong}")

    def argv(self, value: Any, parsed_default: Any) -> List[str]:
        """The command-line words that give ``value`` (none where it is
        ``parsed_default``, what the parser gives without the flag).

        Raises:
            ValueError: a value the flag cannot give.
        """
        if _same(value, parsed_default):
            return []
        flag, form = self.flag, self.form
        if form in ("switch", "off"):
            if value is not (form == "switch"):
                raise ValueError(f"{flag}: {value!r} has no command-line form")
            return [flag]
        if form == "optional" and value is True:
            return [flag]
        if value is None:
            raise ValueError(f"{flag}: None has no command-line form")
        if form in ("names", "ints"):
            items = [str(v) for v in value]
            if any("," in item or item != item.strip() or not item for item in items):
                raise ValueError(f"{flag}: {items} cannot be written comma-separated")
            text = ",".join(items)
        else:
            text = repr(value) if isinstance(value, float) else str(value)
        # A value that starts with '-' is joined to its flag, not read as a flag itself.
        return [f"{flag}={text}"] if text.startswith("-") else [flag, text]


def without_none(kind: Any) -> Any:
    """``Optional[X]`` -> ``X``; any other type as it is.

    Example::

        >>> without_none(Optional[int]), without_none(Union[bool, str])
        (<class 'int'>, typing.Union[bool, str])
    """
    args = [a for a in get_args(kind) if a is not type(None)]
    if get_origin(kind) is Union and len(args) == 1:
        return args[0]
    return kind


def declarations(cls: type) -> List[Declared]:
    """The options ``cls`` (a dataclass of :func:`option` fields) declares, in order."""
    hints = get_type_hints(cls)
    return [
        Declared(f.name, hints[f.name], f, f.metadata["option"])
        for f in dataclasses.fields(cls)
        if "option" in f.metadata
    ]


def group_values(
    config: Any, group: str, unset: Callable[[Any], Any] = lambda value: value
) -> Dict[str, Any]:
    """The values of ``config``'s options in ``group`` (a :data:`GROUPS` title, or a group
    an option is :attr:`~Option.also` given to) by their names in the group's settings
    (:attr:`Option.to`), as the settings are given them (:attr:`Option.given`, else
    ``unset``: the group's rule for a value left as it is).

    Example::

        >>> @dataclass
        ... class Demo:
        ...     model: str = option("deepfm", group="model", help="m", to="name")
        ...     dim: int = option(10, group="model", help="d")
        ...     seed: int = option(0, group="run", help="s")
        ...     batch: int = option(64, group="model", help="b", also=("run",))
        >>> group_values(Demo(), "model"), group_values(Demo(), "run")
        ({'name': 'deepfm', 'dim': 10, 'batch': 64}, {'seed': 0, 'batch': 64})
    """
    values = {}
    for declared in declarations(type(config)):
        o = declared.option
        if o.group == group or group in o.also:
            value = getattr(config, declared.name)
            values[o.to or declared.name] = o.given(value) if o.given else unset(value)
    return values


def check_group(config: Any, group: str) -> None:
    """Checks each of ``config``'s options in ``group`` (:meth:`Declared.check`): what a
    settings group checks of its own fields, before any rule between options.

    Raises:
        ConfigError: naming the first bad option's flag.
    """
    for declared in declarations(type(config)):
        if declared.option.group == group:
            declared.check(getattr(config, declared.name))


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) == list(default)
    return bool(value == default)


# --- the checks options share ----------------------------------------------------------


def positive(value: float) -> Optional[str]:
    return None if value > 0 else f"must be > 0, got {value}"


def non_negative(value: float) -> Optional[str]:
    return None if value >= 0 else f"must be >= 0, got {value}"


def fraction(value: float) -> Optional[str]:
    return None if 0.0 <= value < 1.0 else f"must be in [0, 1), got {value}"


def seed_range(value: int) -> Optional[str]:
    return None if 0 <= value < 2**32 else f"must be in [0, 2**32), got {value}"


def positive_sizes(values: Sequence[int]) -> Optional[str]:
    return None if all(v > 0 for v in values) else f"sizes must be > 0, got {list(values)}"


def resume_mode(value: Union[bool, str]) -> Optional[str]:
    return None if value in (False, True, "auto") else f"takes no value or 'auto', got {value!r}"


def a_directory(value: str) -> Optional[str]:
    return None if str(value).strip() else "needs a run directory, got an empty one"

"""A sweep's cells: every (batch size, recipe, seed) of the grid as one ``train`` config,
the settings they share, and which cells are the same run.

A cell is named ``b<batch>-<recipe>-s<seed>`` and trains in ``<out>/cells/<name>/``. Two
cells whose runs would compute the same numbers share one run: at the base batch
(``s = 1``) ``fixed-l2-count`` is ``fixed-l2`` (a row's lr factor ``min(c, s) ** p`` is 1),
and ``sqrt``, ``linear`` and ``none`` are the same no-clip run; the later cell reports
the earlier one's results instead of training again.

Example::

    >>> from torchrec_cowclip.train.config import TrainConfig
    >>> base = TrainConfig(data="synthetic:100000", epochs=2)
    >>> cells = plan_cells(base, [1024, 4096], ["fixed-l2", "fixed-l2-count"], [0])
    >>> [(c.name, c.shares) for c in cells]  # doctest: +NORMALIZE_WHITESPACE
    [('b1024-fixed-l2-s0', None), ('b1024-fixed-l2-count-s0', 'b1024-fixed-l2-s0'),
     ('b4096-fixed-l2-s0', None), ('b4096-fixed-l2-count-s0', None)]
    >>> parse_batch_sizes("1024,4096x")
    Traceback (most recent call last):
    ...
    torchrec_cowclip.sweep.grid.SweepError: --batch-sizes: expected comma-separated positive integers such as 1024,4096,16384, got '1024,4096x'
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.run.folder_layout import jsonable
from torchrec_cowclip.run.resume_guard import setting_flag, shown_setting
from torchrec_cowclip.train.config import RECORDED_SETTINGS, TrainConfig, TrainSettings
from torchrec_cowclip.train.options import declarations
from torchrec_cowclip.train.scaling import RECIPES

#: How the cells' training lengths compare: the same ``--epochs`` at every batch size
#: (every cell sees the same training samples, as in the paper), or the base batch's
#: number of steps (batch ``b`` trains ``epochs * b / base`` epochs).
EQUAL_MODES = ("epochs", "steps")

#: The config fields the grid sets per cell (and the learning rates where ``--lr-embed`` /
#: ``--lr`` list more than one value: the shared settings hold None for those) -> the
#: sweep's flag that lists their values, and an example of it. A cell record
#: (``cell.json``) holds them under these names.
GRID_FIELDS: Dict[str, Tuple[str, str]] = {
    "batch_size": ("--batch-sizes", "1024,16384"),
    "recipe": ("--recipes", "paper,fixed-l2-count,none"),
    "seed": ("--seeds", "0,1"),
}
#: train's options a sweep takes lists of, under their own flags (a learning-rate search):
#: config field -> its tag in a cell's name (``le`` in ``b1024-paper-le0.001-s0``), in
#: the order cell names write them.
LR_GRID = {"lr_embed": "le", "lr": "lr"}


def train_flag(field: str) -> str:
    """The flag train declares for its option ``field`` (a grid's field, an
    :data:`LR_GRID` option).

    Example::

        >>> [train_flag(field) for field in [*GRID_FIELDS, *LR_GRID]]
        ['--batch-size', '--recipe', '--seed', '--lr-embed', '--lr']
    """
    return next(o.flag for o in declarations(TrainConfig) if o.name == field)


#: Settings in which runs of one sweep may differ, because they change how a cell runs,
#: not what it computes (``--threads`` moves at most the last bits of float sums; the
#: sweep sets it from ``--parallel``), or are set by the sweep itself.
FREE_SETTINGS: FrozenSet[str] = frozenset(
    {
        "out",
        "resume",
        "overwrite",
        "progress",
        "threads",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "cache_dir",
        "dist_timeout_s",
    }
)


class SweepError(ConfigError):
    """A bad sweep command or a sweep directory it cannot continue; one line."""


def _int_list(text: str, flag: str, example: str) -> List[int]:
    items = [item.strip() for item in text.split(",")]
    try:
        values = [int(item) for item in items]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise SweepError(f"{flag}: expected comma-separated {example}, got {text!r}")
    duplicates = sorted({v for v in values if values.count(v) > 1})
    if duplicates:
        raise SweepError(f"{flag}: {', '.join(map(str, duplicates))} given twice in {text!r}")
    return values


def parse_batch_sizes(text: str) -> List[int]:
    """``--batch-sizes 1024,4096,...``: distinct positive integers, in the order given."""
    example = "positive integers such as 1024,4096,16384"
    values = _int_list(text, "--batch-sizes", example)
    if 0 in values:
        raise SweepError(f"--batch-sizes: expected comma-separated {example}, got {text!r}")
    return values


def parse_seeds(text: str) -> List[int]:
    """``--seeds 0,1``: distinct integers in ``[0, 2**32)``."""
    values = _int_list(text, "--seeds", "integers >= 0 such as 0,1,2")
    big = [v for v in values if v >= 2**32]
    if big:
        raise SweepError(f"--seeds: {big[0]} is not below 2**32")
    return values


def parse_rates(text: Optional[str], flag: str) -> List[Optional[float]]:
    """``--lr-embed 1e-4,1e-3``: distinct positive learning rates in the order given;
    ``[None]`` (the recipe's) when the flag is not given.

    Example::

        >>> parse_rates("1e-4, 1e-3", "--lr-embed"), parse_rates(None, "--lr")
        ([0.0001, 0.001], [None])
    """
    if text is None:
        return [None]
    items = [item.strip() for item in str(text).split(",")]
    try:
        values = [float(item) for item in items]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise SweepError(
            f"{flag}: expected comma-separated positive rates such as 1e-4,1e-3, got {text!r}"
        )
    duplicates = sorted({v for v in values if values.count(v) > 1})
    if duplicates:
        raise SweepError(
            f"{flag}: {', '.join(f'{v:g}' for v in duplicates)} given twice in {text!r}"
        )
    return list[Optional[float]](values)


def parse_recipes(text: str) -> List[str]:
    """``--recipes paper,fixed-l2-count,none``: names of the trainer's recipes
    (:data:`~torchrec_cowclip.train.scaling.RECIPES`, the no-clip baselines included)."""
    names = [item.strip() for item in text.split(",")]
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        raise SweepError(
            f"--recipes: unknown recipe {unknown[0] if unknown else text!r}; choose from "
            f"{', '.join(RECIPES)}"
        )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SweepError(f"--recipes: {', '.join(duplicates)} given twice in {text!r}")
    return names


def cell_name(
    batch_size: int, recipe: str, seed: int, rates: Optional[Dict[str, float]] = None
) -> str:
    """``b1024-paper-s0``; with a learning-rate grid ``b1024-paper-le0.001-s0``."""
    tags = "".join(f"-{LR_GRID[k]}{v:g}" for k, v in (rates or {}).items())
    return f"b{batch_size}-{recipe}{tags}-s{seed}"


def variant_label(recipe: str, rates: Optional[Dict[str, float]] = None) -> str:
    """How the report names a recipe with its grid rates: ``paper --lr-embed 0.001``."""
    return " ".join([recipe, *(f"{train_flag(k)} {v:g}" for k, v in (rates or {}).items())])


@dataclass
class Cell:
    """One (batch size, recipe, seed) of a sweep and the ``train`` config that runs it.

    Attributes:
        config: the cell's run (its ``out`` is set by the runner), which holds the cell's
            batch size, recipe and seed.
        settings: ``config`` resolved (``TrainConfig.resolve``): what the sweep reads of
            the cell's run (its data, its recipe's values).
        shares: the name of an earlier cell whose run computes the same numbers; this cell
            reports that run's results and trains nothing.
    """

    config: TrainConfig
    settings: TrainSettings
    shares: Optional[str] = None
    #: The learning rates of a grid over ``--lr-embed`` / ``--lr`` (field -> value).
    rates: Dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def recipe(self) -> str:
        return self.config.recipe

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def grid_values(self) -> Dict[str, Any]:
        """The cell's values of :data:`GRID_FIELDS`, by field (as ``cell.json`` holds them)."""
        return {field: getattr(self.config, field) for field in GRID_FIELDS}

    @property
    def name(self) -> str:
        return cell_name(self.batch_size, self.recipe, self.seed, self.rates)

    @property
    def variant(self) -> str:
        return variant_label(self.recipe, self.rates)


def cell_epochs(epochs: int, batch_size: int, base_batch_size: int, equal: str) -> int:
    """The epochs a cell trains: ``epochs``, or (``equal="steps"``) as many as it takes
    at ``batch_size`` to make the base batch's number of steps.

    Example::

        >>> cell_epochs(2, 16384, 1024, "steps"), cell_epochs(2, 16384, 1024, "epochs")
        (32, 2)
    """
    if equal == "epochs":
        return epochs
    if equal != "steps":
        raise SweepError(f"--equal must be one of {', '.join(EQUAL_MODES)}, got {equal!r}")
    if (epochs * batch_size) % base_batch_size:
        raise SweepError(
            f"--equal steps: batch {batch_size} x {epochs} epoch(s) is not a whole number "
            f"of epochs at --base-batch-size {base_batch_size}: choose batch sizes that are "
            "multiples of it (or --equal epochs)"
        )
    return epochs * batch_size // base_batch_size


def shared_settings(settings: Mapping[str, Any]) -> Dict[str, Any]:
    """The settings every cell of a sweep has in common: a config's (``as_dict``) without
    the grid's fields and :data:`FREE_SETTINGS`."""
    return {k: v for k, v in settings.items() if k not in FREE_SETTINGS and k not in GRID_FIELDS}


def cell_settings(settings: Mapping[str, Any]) -> Dict[str, Any]:
    """What a cell's run is compared by when the sweep meets it again: its config's
    settings (``as_dict``) without :data:`FREE_SETTINGS`."""
    return {k: v for k, v in settings.items() if k not in FREE_SETTINGS}


def setting_differences(
    recorded: Dict[str, Any], current: Dict[str, Any]
) -> List[Tuple[str, str, str]]:
    """``(flag, recorded value, current value)`` for every setting that differs (a
    setting only one side knows counts as different, with ``none`` on the other, but for
    an option a record written before it existed lacks: its declared default, the value
    that sweep ran with).

    Example::

        >>> setting_differences({"epochs": 1}, {"epochs": 1, "time_columns": []})
        []
        >>> setting_differences({"epochs": 1}, {"epochs": 2, "batch_size": 2048})
        [('--epochs', '1', '2'), ('--batch-size', '1024', '2048')]
    """
    defaults = {option.name: jsonable(option.default) for option in declarations(TrainConfig)}
    found = []
    for field in list(current) + [f for f in recorded if f not in current]:
        old, new = recorded.get(field, defaults.get(field)), current.get(field)
        if old != new:
            found.append(
                (
                    setting_flag(field, RECORDED_SETTINGS),
                    shown_setting(field, old, RECORDED_SETTINGS),
                    shown_setting(field, new, RECORDED_SETTINGS),
                )
            )
    return found


def describe_differences(diffs: Sequence[Tuple[str, str, str]]) -> str:
    """``--epochs 2 there, 3 here; --hidden 8 vs 16``: the differences for one line."""
    (flag, old, new), rest = diffs[0], diffs[1:]
    return f"{flag} {old} there, {new} here" + "".join(f"; {f} {o} vs {n}" for f, o, n in rest)


def _same_run_key(cell: Cell) -> str:
    """A text equal for two cells exactly when their runs compute the same numbers."""
    config = cell.config
    hp = cell.settings.hp.as_dict()
    del hp["recipe"]
    clipped = hp["cowclip"] and config.cowclip
    hp["cowclip"] = clipped
    if not clipped:  # no clip: its r and zeta are never used
        del hp["clip_r"], hp["clip_zeta"]
    if hp["helen_rho"] is None:
        del hp["helen_bound"]
    if hp["scale"] <= 1.0:
        # CountLR caps a row's factor min(c, s) ** p at max(1, s) = 1 here: every row
        # steps with the plain lr, as with power 0.
        hp["count_lr_power"] = 0.0
    settings = {k: v for k, v in cell_settings(config.as_dict()).items() if k != "recipe"}
    return json.dumps({"hp": hp, "settings": settings}, sort_keys=True, default=str)


def plan_cells(
    base: TrainConfig,
    batch_sizes: Sequence[int],
    recipes: Sequence[str],
    seeds: Sequence[int],
    equal: str = "epochs",
    has_run: Callable[[str], bool] = lambda name: False,
    rates: Optional[Mapping[str, Sequence[Optional[float]]]] = None,
) -> List[Cell]:
    """The grid's cells, seed by seed, batch by batch, recipe by recipe, rate by rate (so
    the figure of the first seed is complete first), each config resolved.

    Args:
        base: the settings every cell shares (its batch size, recipe and seed are replaced),
            the data kind's defaults filled in where the sweep made it (as train's
            ``TrainConfig.resolve`` fills them); each cell is resolved from it.
        equal: an :data:`EQUAL_MODES` name.
        rates: per :data:`LR_GRID` field, the values of the grid (a field with one value
            is set on every cell and not named in the cells' names).
        has_run: whether a cell's folder already holds a run: of cells that are the same
            run, one that has a run is the one that trains (or has trained); otherwise the
            first.

    Raises:
        SweepError: a cell's config is refused (naming the cell and the option).
    """
    grid = {k: list(v) for k, v in (rates or {}).items() if k in LR_GRID}
    fixed: Dict[str, Any] = {k: v[0] for k, v in grid.items() if len(v) == 1 and v[0] is not None}
    base = replace(base, **fixed)
    searched = [k for k, v in grid.items() if len(v) > 1]
    combos: List[Dict[str, float]] = [{}]
    for k in searched:
        combos = [{**c, k: float(v)} for c in combos for v in grid[k] if v is not None]
    cells = []
    for seed in seeds:
        for batch_size in batch_sizes:
            epochs = cell_epochs(base.epochs or 1, batch_size, base.base_batch_size, equal)
            for recipe in recipes:
                for combo in combos:
                    config = replace(
                        base,
                        batch_size=batch_size,
                        recipe=recipe,
                        seed=seed,
                        epochs=epochs,
                        **dict[str, Any](combo),
                    )
                    try:
                        settings = config.resolve()
                    except ConfigError as e:
                        name = cell_name(batch_size, recipe, seed, combo)
                        raise SweepError(f"cell {name}: {e}") from None
                    cells.append(Cell(config, settings, rates=combo))
    runs: Dict[str, List[Cell]] = {}
    for cell in cells:
        runs.setdefault(_same_run_key(cell), []).append(cell)
    for same in runs.values():
        trains = next((c for c in same if has_run(c.name)), same[0])
        for cell in same:
            if cell is not trains:
                cell.shares = trains.name
    return cells

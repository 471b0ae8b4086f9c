"""``torchrec-cowclip plan``: will the tables and their optimizer state fit on N devices,
and how are they sharded - answered on this machine, before a launch.

It builds the model ``train`` would build (its tables on the meta device: nothing is
allocated) from a preset table set, any data ``train`` reads (with the same flags), or a
finished run, and runs TorchRec's planner on it with this project's sharder and the
trainer's planner (:mod:`torchrec_cowclip.plan.job`). It prints the plan and the
commands that launch that job, writes it as JSON with ``--json``, and exits 0 when it
fits, 3 when it does not (naming the smallest world size that fits), 2 for a refused
command.

This module takes ``train``'s argument groups and their conversion to a config from the
``train`` command (:mod:`torchrec_cowclip.train.command`), so that both stay defined once.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from torchrec_cowclip.cli_help import RawDescriptionHelpFormatter
from torchrec_cowclip.data.settings import DataSettings
from torchrec_cowclip.plan.job import DEFAULT_HEADROOM, JobSpec
from torchrec_cowclip.train.command import (
    add_data_arguments,
    add_model_arguments,
    add_train_option,
    config_from_args,
    group_options,
    parsed_default,
    train_argv,
)
from torchrec_cowclip.train.config import TrainConfig, TrainSettings
from torchrec_cowclip.train.options import declarations

#: Exit status of a plan that does not fit the devices.
EXIT_DOES_NOT_FIT = 3
_GIB = float(1 << 30)
#: The most memory --hbm-gb or --ddr-gb may say a device has (1 PiB: any real device
#: holds less; a larger number is a typo, and 1e308 GB has no byte count).
MAX_DEVICE_GB = 1 << 20

DESCRIPTION = """\
Plan a sharded training job before launching it: TorchRec's planner, run on this machine
with the model train would build (its tables on the meta device), this project's sharder
(which tells the planner each table's optimizer state) and the trainer's planner. Prints
per table its rows, sharding type and ranks; per rank the bytes of table weights and
optimizer state; the largest rank; whether the job fits; the planner's own estimates
(each rank's storage with its input/output buffers and its step time); and the torchrun
and torchx commands that launch it. Exit status 0: it fits; 3: it does not (the smallest
world size that fits is named); 2: a refused command.

examples:
  torchrec-cowclip plan --tables criteo-1tb --model dlrm --embedding-dim 128 \\
      --embedding-optimizer rowwise_adagrad --world-size 8 --hbm-gb 80 --batch-size 16384
  torchrec-cowclip plan --data table:clicks.csv --label click --sparse user,item \\
      --world-size 2 --compute-device cpu --json plan.json
  torchrec-cowclip plan --run runs/criteo --embedding-dim 64 --world-size 16
"""


#: train's options a plan's job takes, as train declares them (flag, type, default,
#: choices, check): name -> what it means to a plan, and the plan's other flags of it.
_JOB_OPTIONS: Dict[str, Tuple[str, ...]] = {
    "batch_size": (
        "the global batch, as train's: the planner sizes each rank's input and "
        "communication by batch / world size",
    ),
    "embedding_optimizer": (
        "the tables' optimizer, whose state is planned: adam 2 float32 per weight, "
        "rowwise_adagrad 1 float32 per row (per column shard), sgd none",
        "--optimizer",
    ),
    "recipe": (
        "train's scaling recipe, passed to the launch command (a recipe sets "
        "learning rates, L2 and the clip, not the optimizer's state)",
    ),
    "sharding": (
        "auto: TorchRec's planner chooses per table (as train's --sharding auto); "
        "or one sharding type for every table",
    ),
}


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``plan`` on ``subparsers``: its tables (``--tables``, ``--run``, or train's
    data group), train's model group, the job and the output."""
    p = subparsers.add_parser(
        "plan",
        help="plan a sharded job: per-rank table and optimizer bytes, whether it fits N devices",
        description=DESCRIPTION,
        formatter_class=RawDescriptionHelpFormatter,
    )
    _add_tables_arguments(p)
    add_data_arguments(p, required=False)
    add_model_arguments(p)
    _add_job_arguments(p)
    _add_output_arguments(p)
    p.set_defaults(run_plan=functools.partial(run_command, parser=p))
    return p


def _add_tables_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tables`` group: ``--tables`` and ``--run`` (train's data group is the third
    way)."""
    t = p.add_argument_group(
        "tables", "give one: --tables, --data (any data train reads, with its flags), or --run"
    )
    t.add_argument(
        "--tables",
        default=None,
        metavar="PRESET|FILE",
        help="a public table set: criteo-kaggle (26 tables, 33.8M rows) or criteo-1tb "
        "(26 tables, 177.9M rows), Criteo's 13 dense inputs; or your own tables, a .json, "
        ".yaml or .csv file of name, rows, dim and optional dtype, pooling_factor, "
        "sharding per table, planned alone with their rows as written (default: none)",
    )
    t.add_argument(
        "--run",
        default=None,
        metavar="RUN",
        help="a finished run's --out: its tables, model and settings, any flag given "
        "overriding them (default: none)",
    )


def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The ``job`` group: the devices, train's options of the job (:data:`_JOB_OPTIONS`),
    the tables' constraints and the headroom."""
    j = p.add_argument_group("job")
    j.add_argument("--world-size", type=int, default=1, help="devices (processes) of the job")
    j.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="devices per host (default: up to 8 per host on cuda, all on one host on cpu)",
    )
    j.add_argument(
        "--compute-device",
        default="cuda",
        help="cuda: the tables live in each GPU's HBM; cpu: in each process's DDR",
    )
    j.add_argument(
        "--hbm-gb",
        type=float,
        default=None,
        help="HBM per GPU in GiB (2**30 bytes, TorchRec's 'GB') (default: this machine's "
        "GPU's, as train plans with; without one TorchRec's 32)",
    )
    j.add_argument(
        "--ddr-gb",
        type=float,
        default=None,
        help="DDR per process in GiB, for --compute-device cpu (default: TorchRec's 128)",
    )
    for name, (text, *aliases) in _JOB_OPTIONS.items():
        add_train_option(j, name, text, *aliases)
    j.add_argument(
        "--constrain",
        action="append",
        default=[],
        metavar="TABLE=SHARDING",
        help="the one sharding type TABLE may take (repeatable; over --sharding and a "
        "table file's own): data_parallel, table_wise, row_wise, column_wise, "
        "table_row_wise or table_column_wise",
    )
    j.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        metavar="FRACTION",
        help="the share of each device's usable memory (after TorchRec's reservation) a "
        "rank should leave free for what the plan does not count (activations, the dense "
        "optimizer); a plan with a rank leaving less is 'fits, tight' (exit 0) "
        f"(default: {DEFAULT_HEADROOM:g})",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """The ``output`` group: ``--json`` and ``--planner-stats``."""
    o = p.add_argument_group("output")
    o.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the plan as JSON: tables (name, rows, dim, sharding, ranks, "
        "shards), ranks (rank, bytes, weights_bytes, optimizer_bytes, planner "
        "estimates), fits, smallest_world_size (default: none)",
    )
    o.add_argument(
        "--planner-stats",
        action="store_true",
        help="also print the planner's statistics (on stderr): per rank its storage, "
        "share of the device and step-time estimates, per table its shards, in B/KiB/MiB/GiB",
    )


def _error(message: str) -> int:
    print(f"torchrec-cowclip plan: error: {message}", file=sys.stderr)
    return 2


def run_command(
    args: argparse.Namespace, argv: Optional[Sequence[str]], parser: argparse.ArgumentParser
) -> int:
    """``plan``'s body: 0 when the job fits, 3 when it does not, 2 for a refused command
    (one line on stderr naming the flag, file or table)."""
    from torchrec_cowclip.data.errors import DataError
    from torchrec_cowclip.failures import ConfigError
    from torchrec_cowclip.run.no_space import one_line

    try:
        return _run(args, argv, parser)
    except (ConfigError, DataError, OSError) as e:
        return _error(one_line(e))


def _run_defaults(run: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """RUN's settings for every option of ``plan`` that ``train`` has (its model, data,
    batch size, optimizer, recipe, sharding)."""
    defaults = {k: v for k, v in run.config.items() if k in vars(args)}
    if "hidden" in defaults:
        defaults["hidden"] = list(defaults["hidden"])
    return defaults


def _source(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """Which of --tables, --data, --run names the tables (exactly one)."""
    from torchrec_cowclip.plan.job import PlanError

    given = [
        f for f, v in (("--tables", args.tables), ("--data", args.data), ("--run", args.run)) if v
    ]
    if not given:
        raise PlanError(
            "no tables to plan: give --tables criteo-kaggle|criteo-1tb, --data (any data "
            "train reads, with its flags) or --run RUN"
        )
    if len(given) > 1:
        raise PlanError(f"{' and '.join(given)} both name the tables: give one")
    if given[0] != "--data":
        for option in group_options("data"):
            flag = option.flag
            if option.name != "data" and getattr(args, option.name) != parsed_default(option):
                raise PlanError(f"{flag} says how --data is read: give --data, or drop {flag}")
    return given[0]


def _check_positive(flag: str, value: Optional[float]) -> None:
    from torchrec_cowclip.plan.job import PlanError

    if value is not None and not (math.isfinite(value) and value > 0):
        raise PlanError(f"{flag} must be > 0, got {value:g}")
    if flag.endswith("-gb") and value is not None and value > MAX_DEVICE_GB:
        raise PlanError(
            f"{flag} {value:g} is more than any device holds (at most {MAX_DEVICE_GB:,} GB)"
        )


def _resolve(config: TrainConfig, parser: argparse.ArgumentParser, source: str) -> TrainSettings:
    """``train``'s settings of the options, checked as train checks them (one line
    naming the flag); the data options only where the tables come from ``--data`` (a
    preset's or a run's data is not read)."""
    checked = replace(config, sharding="auto", device="auto")
    if source != "--data":
        fresh = TrainConfig()
        data_options = [option.name for option in group_options("data")]
        checked = replace(checked, **{k: getattr(fresh, k) for k in data_options})
    return checked.resolve()


def _device_bytes(args: argparse.Namespace) -> Tuple[int, int]:
    """``(HBM, DDR)`` bytes per device: the flags', else this machine's GPU (as ``train``
    plans with) or TorchRec's defaults."""
    from torchrec.distributed.planner.constants import DDR_CAP, HBM_CAP

    hbm, ddr = HBM_CAP, DDR_CAP
    if args.hbm_gb is not None:
        hbm = int(args.hbm_gb * _GIB)
    else:
        import torch

        if torch.cuda.is_available():
            hbm = int(torch.cuda.get_device_properties(0).total_memory)
    if args.ddr_gb is not None:
        ddr = int(args.ddr_gb * _GIB)
    return hbm, ddr


def _job_flags(args: argparse.Namespace) -> Tuple[int, Optional[int]]:
    """Checks the job's flags; returns ``(devices per host, per host for the search)``."""
    from torchrec_cowclip.plan.job import PlanError

    if args.compute_device not in ("cuda", "cpu"):
        raise PlanError(f"--compute-device must be cuda or cpu, got {args.compute_device!r}")
    for flag, value in (
        ("--world-size", args.world_size),
        ("--nproc-per-node", args.nproc_per_node),
    ):
        _check_positive(flag, value)
    for option in declarations(TrainConfig):  # train's options of the job, as train checks them
        if option.name in _JOB_OPTIONS:
            option.check(getattr(args, option.name))
    for flag, value in (("--hbm-gb", args.hbm_gb), ("--ddr-gb", args.ddr_gb)):
        _check_positive(flag, value)
    if not (math.isfinite(args.headroom) and 0 <= args.headroom < 1):
        raise PlanError(f"--headroom must be in [0, 1), got {args.headroom:g}")
    world = args.world_size
    if args.batch_size % world:
        raise PlanError(
            f"--batch-size {args.batch_size} must be divisible by --world-size {world}: each "
            "rank takes an equal part of every global batch"
        )
    per_host = args.nproc_per_node or (8 if args.compute_device == "cuda" else None)
    local = world if per_host is None else min(world, per_host)
    if world % local:
        raise PlanError(
            f"--world-size {world} does not fill hosts of --nproc-per-node {per_host}: give "
            f"a multiple of {per_host}"
        )
    if args.embedding_backend != "cowclip":
        raise PlanError(
            f"--embedding-backend {args.embedding_backend} trains on one process without "
            "sharding: plan the CowClip tables (--embedding-backend cowclip)"
        )
    return local, per_host


def _table_file(name: str) -> bool:
    """Whether ``--tables NAME`` names a file of tables (not a preset)."""
    from torchrec_cowclip.plan.tables import TABLE_FILE_SUFFIXES

    return Path(name).suffix.lower() in TABLE_FILE_SUFFIXES or Path(name).exists()


def _model_flags_unused(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuses a model flag with a table file: its tables are planned alone, as written."""
    from torchrec_cowclip.plan.job import PlanError

    for option in group_options("model"):
        if getattr(args, option.name) != parsed_default(option):
            flag = option.flag
            raise PlanError(
                f"{flag} says how train builds its model: --tables {args.tables} plans your "
                f"own tables alone, each with its rows, dim and dtype as written: drop {flag}"
            )


def _tables(
    source: str, args: argparse.Namespace, data: Optional[DataSettings], run: Any
) -> Tuple[Any, int, str, Optional[str]]:
    """``(schema, dense inputs, where the sizes come from, the data a launch trains on)``
    for the tables of ``source`` (None: the command's own ``--data``, which ``data`` is
    when the tables come from it); a table file's tables come as the list of its
    :class:`~torchrec_cowclip.plan.tables.TableSpec` in the schema's place."""
    from torchrec_cowclip.data.pipeline.dataset import parse_spec
    from torchrec_cowclip.plan.job import PlanError
    from torchrec_cowclip.plan.presets import PRESETS
    from torchrec_cowclip.plan.tables import read_table_file

    if source == "--tables":
        preset = PRESETS.get(args.tables)
        if preset is None and _table_file(args.tables):
            tables = read_table_file(Path(args.tables))
            rows = sum(t.rows for t in tables)
            return tables, 0, f"{args.tables} ({len(tables)} tables, {rows:,} rows)", None
        if preset is None:
            raise PlanError(
                f"--tables: unknown preset {args.tables!r}; known: {', '.join(PRESETS)} (or "
                "a .json, .yaml or .csv file of tables; or give --data or --run)"
            )
        schema = preset.schema
        return schema, schema.n_dense, f"{preset.name} ({preset.source})", preset.data
    if source == "--run":
        arguments = run.model_arguments()
        return run.schema, int(arguments["num_dense"]), f"run {args.run}", None
    assert data is not None
    sized = data.kind().planned_sizes(parse_spec(data.spec)[1], data.source_options())
    if sized is not None:  # generated rows: their sizes from the options, nothing written
        schema, dense, rows = sized
        return schema, dense, f"{data.spec} ({rows:,} rows, sizes from its options)", None
    dataset = data.open()  # converted once into --cache-dir, as train does
    dense = len(dataset.dense_plan.output_names)
    return dataset.schema, dense, f"{data.spec} ({len(dataset):,} rows{_ids_note(dataset)})", None


def _ids_note(dataset: Any) -> str:
    """How a vocabulary's table sizes relate to the data: each table has a row per
    distinct value and two more (out-of-vocabulary id 0, missing id 1); hashed tables
    have the --hash-size asked."""
    from torchrec_cowclip.data import MISSING_ID, OOV_ID

    if dataset.meta.get("encoding", {}).get("kind") == "vocabulary":
        return (
            f"; each table: its distinct values + 2 rows, ids {OOV_ID} out of vocabulary "
            f"and {MISSING_ID} missing"
        )
    return ""


def _job_name(args: argparse.Namespace, data: str) -> str:
    """A name for the launched job's run directory: the preset, the run's folder, or the
    data's first file (``synthetic-3000`` for generated rows)."""
    if args.tables or args.run:
        return str(Path(args.tables or args.run).name)
    kind, _, rest = data.partition(":")
    first = rest.split(",")[0]
    named = Path(first).stem if "/" in first or "." in first else f"{kind}-{first}"
    return named or "job"


def _run(
    args: argparse.Namespace, argv: Optional[Sequence[str]], parser: argparse.ArgumentParser
) -> int:
    from torchrec_cowclip import notices
    from torchrec_cowclip.plan.job import plan_job
    from torchrec_cowclip.plan.printout import (
        does_not_fit,
        format_plan,
        format_planner_stats,
    )
    from torchrec_cowclip.plan.tables import parse_constraint
    from torchrec_cowclip.run.log import write_text_atomically
    from torchrec_cowclip.run.model_folder import RunFolder

    notices.install()
    source = _source(args, parser)
    run = None
    if source == "--run":
        # RUN's settings where the command gives none (its descriptions only: no weight
        # is read, so the run's files are not verified).
        run = RunFolder.open(args.run, verify=False)
        parser.set_defaults(**_run_defaults(run, args))
        args = parser.parse_args(list(sys.argv[2:] if argv is None else argv[1:]))
    local, per_host = _job_flags(args)
    constraints = dict(parse_constraint(c) for c in args.constrain)
    config = config_from_args(args)
    settings = _resolve(config, parser, source)
    data = settings.data if source == "--data" else None
    schema, num_dense, tables_from, launch_data = _tables(source, args, data, run)
    own_tables = isinstance(schema, list)
    if own_tables:
        _model_flags_unused(args, parser)
    hbm, ddr = _device_bytes(args)
    spec = JobSpec(
        model="tables" if own_tables else config.model,
        model_arguments={} if own_tables else settings.model.arguments(schema, num_dense),
        optimizer=config.embedding_optimizer,
        batch_size=config.batch_size,
        world_size=args.world_size,
        local_world_size=local,
        compute_device=args.compute_device,
        hbm_bytes=hbm,
        ddr_bytes=ddr,
        sharding=config.sharding,
        tables=tuple(schema) if own_tables else (),
        constraints=constraints,
        headroom=args.headroom,
    )
    plan = plan_job(spec, per_host)
    launch = None
    if not own_tables and not spec.constraints:
        launch = _launch(args, config, spec, launch_data)
    sys.stdout.write(format_plan(plan, tables_from, launch))
    if args.planner_stats:
        sys.stderr.write(format_planner_stats(plan))
    if args.json:
        launched = launch if plan.fits else None  # a job that does not fit is not launched
        document = {**plan.to_json(), "tables_from": tables_from, "launch": launched}
        write_text_atomically(Path(args.json), json.dumps(document, indent=2) + "\n")
    if plan.fits:
        return 0
    print(f"torchrec-cowclip plan: {does_not_fit(plan)}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def _launch(
    args: argparse.Namespace, config: TrainConfig, spec: JobSpec, data: Optional[str]
) -> Dict[str, str]:
    """The commands that launch the planned job (torchrun, torchx): train's flags of
    ``config`` on the job's devices, on ``data`` (a preset's; None: the config's own),
    into a run directory named after the tables, the model and the job."""
    from torchrec_cowclip.plan.printout import launch_commands

    out = f"runs/{_job_name(args, config.data)}-{config.model}-{spec.world_size}x{spec.compute_device}"
    launch_config = replace(
        config,
        data=data or config.data,
        out=out,
        device="cpu" if spec.compute_device == "cpu" else config.device,
        cache_dir=config.cache_dir,
    )
    train_args = train_argv(None, launch_config, "a cell's train command")
    return launch_commands(
        spec.world_size, spec.local_world_size, spec.compute_device == "cuda", train_args
    )

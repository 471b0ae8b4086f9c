"""``torchrec-cowclip sweep``: the paper's AUC-against-batch-size study on any data the
trainer reads, as one resumable command.

It takes every option of ``train`` (data, model, run) and trains one cell per batch size
of ``--batch-sizes``, recipe of ``--recipes`` and seed of ``--seeds``; each cell is an
ordinary train run in ``<out>/cells/<cell>/`` (:mod:`.runner`). The report
(:mod:`.report`, :mod:`.plots`) is rewritten as cells finish.

This module takes ``train``'s arguments and their conversion to a config from the
``train`` command (:mod:`torchrec_cowclip.train.command`), so that both stay defined once.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict

from torchrec_cowclip.cli_help import RawDescriptionHelpFormatter
from torchrec_cowclip.process_context import ProcessContext
from torchrec_cowclip.sweep.grid import GRID_FIELDS, LR_GRID, train_flag
from torchrec_cowclip.train.command import add_train_arguments, train_argv
from torchrec_cowclip.train.config import TrainConfig
from torchrec_cowclip.train.options import declarations

if TYPE_CHECKING:  # the runner is imported when a sweep runs, not for --help
    from torchrec_cowclip.sweep.runner import SweepSpec

#: train's options a sweep refuses (flag -> why): those it sets per cell (the grid's
#: fields, each given as a list of the sweep's own), ``--resume`` and ``--overwrite``.
_PER_CELL: Dict[str, str] = {
    **{
        train_flag(name): f"a sweep sets it per cell: give {lists}, e.g. {lists} {example}"
        for name, (lists, example) in GRID_FIELDS.items()
    },
    "--resume": "a sweep always continues where it stopped: run the same command again",
    "--overwrite": "a sweep never deletes a run: remove the cell folders to train them "
    "again, or choose another --out",
}

#: What a sweep's flag of a learning rate (:data:`~.grid.LR_GRID`) says after train's help.
_LISTED = (
    "; or several, comma-separated (e.g. 1e-4,1e-3,1e-2): one cell per value, a "
    "learning-rate search drawn in the same table and plots (two rates listing several: "
    "every pair)"
)
#: train's options the sweep declares as its own (a directory of cells, threads per
#: cell), besides the per-cell and the listed ones.
_OWN = ("out", "threads")

DESCRIPTION = """\
Train one cell per batch size x recipe x seed (x --lr-embed x --lr where they list several
values: a learning-rate search) on the same data, each an ordinary `train` run in
OUT/cells/<cell>/, and report them: sweep.csv / sweep.json (one row per cell),
sweep.md and the console (AUC change against the base batch per recipe, mean and spread
over seeds), sweep_auc.png (AUC against the batch size), sweep_curves.png (AUC and loss
per cell against the samples seen) and sweep_time.png. The data is converted once into
--cache-dir and shared by every cell. Run the same command again after a stop or a kill:
finished cells are kept, the others continue from their checkpoints.

example:
  torchrec-cowclip sweep --data table:clicks.csv --label click --batch-sizes 1024,8192,32768 \\
      --recipes paper,fixed-l2-count,none --seeds 0,1 --epochs 2 --val-fraction 0.05 \\
      --out runs/sweep-clicks
"""


def available_cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_sweep_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``sweep`` on ``subparsers``: ``train``'s arguments less the per-cell ones,
    and the sweep's own."""
    p = subparsers.add_parser(
        "sweep",
        help="train a grid of batch sizes x recipes x seeds and plot AUC against batch size",
        description=DESCRIPTION,
        formatter_class=RawDescriptionHelpFormatter,
    )
    train = {option.name: option for option in declarations(TrainConfig)}
    per_cell = [name for name, option in train.items() if option.flag in _PER_CELL]
    # --data is not required for --report-only (run_command checks it); the sweep
    # declares a few of train's options as its own (--out, --threads, the per-cell ones).
    add_train_arguments(p, data_required=False, leave_out=[*_OWN, *LR_GRID, *per_cell])
    g = p.add_argument_group("sweep")
    _add_grid_arguments(g)
    _add_resource_arguments(g)
    for flag in _PER_CELL:
        p.add_argument(
            flag,
            dest="per_cell_" + flag[2:].replace("-", "_"),
            nargs="?",
            const=True,
            default=None,
            help=argparse.SUPPRESS,
        )
    p.set_defaults(run_sweep=run_command)
    return p


def _add_grid_arguments(g: Any) -> None:
    """The grid: the batch sizes, recipes, seeds and learning rates a sweep lists, and
    how the cells' lengths compare."""
    g.add_argument(
        "--batch-sizes",
        default=None,
        metavar="B1,B2,...",
        help="the batch sizes, e.g. 1024,16384,65536,131072 (required)",
    )
    g.add_argument(
        "--recipes",
        default="paper",
        metavar="R1,R2,...",
        help="train's --recipe names, the no-clip baselines sqrt, linear and none included",
    )
    g.add_argument("--seeds", default="0", metavar="S1,S2,...", help="train's --seed values")
    train = {option.name: option for option in declarations(TrainConfig)}
    for name in LR_GRID:
        rate = train[name]
        g.add_argument(
            rate.flag, default=None, metavar="LR1,LR2,...", help=rate.option.help + _LISTED
        )
    g.add_argument(
        "--equal",
        choices=("epochs", "steps"),
        default="epochs",
        help="epochs: --epochs at every batch size, so every cell sees the same training "
        "samples (the paper's comparison); steps: the base batch's number of steps, "
        "--epochs * batch / --base-batch-size epochs (pair it with --early-stop-patience)",
    )


def _add_resource_arguments(g: Any) -> None:
    """How the cells run (at once, on how many cores), where they write and what is kept
    of them, and ``--report-only``."""
    g.add_argument("--parallel", type=int, default=1, help="cells trained at once")
    g.add_argument(
        "--cores",
        type=int,
        default=available_cores(),
        help="the cores the sweep may use: each of the --parallel cells gets cores / "
        "parallel threads unless --threads says",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of each cell (0: --cores / --parallel)",
    )
    g.add_argument(
        "--out",
        default="runs/sweep",
        help="the sweep's directory: cells/<cell>/ (one train run each), sweep.csv, "
        "sweep.json, sweep.md and the PNGs",
    )
    g.add_argument(
        "--delete-finished-checkpoints",
        action="store_true",
        help="remove a cell's checkpoints once it has finished (its metrics, logs and "
        "curves stay); with Criteo-sized tables (5.6M rows) and Adam one checkpoint is "
        "0.74 GB, and a cell keeps --keep-checkpoints of them",
    )
    g.add_argument(
        "--delete-finished-models",
        action="store_true",
        help="remove a cell's run folder (model/: the weights, encoders and schema that "
        "predict and export read) once it has finished; at Criteo-sized tables it holds "
        "about 0.5 GB of weights per weight set, final and best",
    )
    g.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: rebuild the table, CSV, JSON and plots from the cells in --out",
    )


def run_command(args: argparse.Namespace) -> int:
    """``sweep``'s body: 0 when every cell finished (or diverged, a result kept), 1 when a
    cell failed, 2 for a refused command, 75 when stopped by a signal."""
    from torchrec_cowclip.data.errors import DataError
    from torchrec_cowclip.failures import ConfigError
    from torchrec_cowclip.run.no_space import one_line

    try:
        return _run(args)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"torchrec-cowclip sweep: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the environment (a full disk writing cell.json): one line, 4
        print(f"torchrec-cowclip sweep: error: {one_line(e)}", file=sys.stderr)
        return 4


def _refuse_per_cell_flags(args: argparse.Namespace) -> None:
    from torchrec_cowclip.sweep.grid import SweepError

    for flag, why in _PER_CELL.items():
        if getattr(args, "per_cell_" + flag[2:].replace("-", "_")) is not None:
            raise SweepError(f"{flag}: {why}")


def _threads(args: argparse.Namespace) -> int:
    from torchrec_cowclip.sweep.grid import SweepError

    if args.parallel < 1 or args.cores < 1 or args.threads < 0:
        raise SweepError(
            f"--parallel and --cores must be >= 1 and --threads >= 0, got --parallel "
            f"{args.parallel}, --cores {args.cores}, --threads {args.threads}"
        )
    if args.parallel > args.cores:
        raise SweepError(
            f"--parallel {args.parallel} cells need at least as many --cores, got {args.cores}"
        )
    if args.threads and args.threads * args.parallel > args.cores:
        raise SweepError(
            f"--parallel {args.parallel} x --threads {args.threads} = "
            f"{args.threads * args.parallel} threads exceed --cores {args.cores}: lower one"
        )
    return args.threads or args.cores // args.parallel


def _run(args: argparse.Namespace) -> int:
    from torchrec_cowclip.sweep.grid import SweepError

    _refuse_per_cell_flags(args)
    out = Path(args.out)
    if args.report_only:
        return _report(out)
    if args.data is None:
        raise SweepError("--data is required (but for --report-only)")
    if args.batch_sizes is None:
        raise SweepError("--batch-sizes is required, e.g. --batch-sizes 1024,16384")
    if ProcessContext.from_environment().is_distributed:
        raise SweepError(
            "a sweep starts one process per cell: run it as one process, not under torchrun"
        )
    spec = _planned(args, out, _threads(args))
    outcomes = _train(spec)
    _report(out)
    return _exit_status(outcomes)


def _planned(args: argparse.Namespace, out: Path, threads: int) -> SweepSpec:
    """The sweep's :class:`~.runner.SweepSpec` with its cells, every cell's command
    checked before anything is written."""
    from torchrec_cowclip.sweep.grid import (
        parse_batch_sizes,
        parse_rates,
        parse_recipes,
        parse_seeds,
        plan_cells,
    )
    from torchrec_cowclip.sweep.runner import CELL_COMMAND, SweepSpec, holds_run

    # The sweep's values of train's options (train's defaults for the rest).
    train = {option.name: option for option in declarations(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in train}
    # The learning rates may be lists (a grid dimension): the grid sets them per cell.
    rates = {name: parse_rates(getattr(args, name), train[name].flag) for name in LR_GRID}
    values.update({k: v[0] if len(v) == 1 else None for k, v in rates.items()})
    # The base is no run (each cell sets its batch, recipe and seed, and is resolved from
    # it): the data kind's defaults are filled in here, once, as every cell runs with them.
    base = TrainConfig.from_dict(values).with_data_defaults()[0]
    spec = SweepSpec(
        out=out,
        base=base,
        batch_sizes=parse_batch_sizes(args.batch_sizes),
        recipes=parse_recipes(args.recipes),
        seeds=parse_seeds(args.seeds),
        equal=args.equal,
        parallel=args.parallel,
        threads=threads,
        delete_finished_checkpoints=args.delete_finished_checkpoints,
        delete_finished_models=args.delete_finished_models,
    )
    spec.cells = plan_cells(
        base,
        spec.batch_sizes,
        spec.recipes,
        spec.seeds,
        spec.equal,
        has_run=lambda name: holds_run(out, name),
        rates=rates,
    )
    for cell in spec.cells:  # every cell's command is checked before anything is written
        train_argv(None, cell.config, CELL_COMMAND)
    return spec


def _train(spec: SweepSpec) -> Dict[str, str]:
    """Trains the cells of ``spec`` in its claimed directory, the report rewritten as each
    ends; each cell's outcome by name."""
    from torchrec_cowclip.sweep import report as reporting
    from torchrec_cowclip.sweep.runner import (
        claim_sweep_dir,
        prepare_data,
        prepare_native_update,
        record_cells,
        run_cells,
    )

    out = spec.out
    created = not out.exists()
    lock = claim_sweep_dir(spec)
    try:
        say = functools.partial(print, file=sys.stderr, flush=True)
        record_cells(spec, prepare_data(spec, say))
        trained = len({c.shares or c.name for c in spec.cells})
        say(
            f"sweep {out}: {len(spec.cells)} cells ({trained} runs), {spec.parallel} at a time "
            f"with {spec.threads} thread(s) each"
        )
        prepare_native_update(spec)

        def ended(cell: Any, outcome: str) -> None:
            report = reporting.build_report(out)
            reporting.write_report(out, report)
            row = next(r for r in report["cells"] if r["cell"] == cell.name)
            say(f"cell {cell.name}: {outcome}" + _result(row))

        return run_cells(spec, say=say, on_end=ended)
    finally:
        lock.release()
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # refused before anything was written: leave no trace


def _exit_status(outcomes: Dict[str, str]) -> int:
    """75 when a cell was stopped by a signal, 1 (naming them) when cells failed, else 0."""
    if any(o == "stopped" for o in outcomes.values()):
        return 75
    failed = sorted(name for name, o in outcomes.items() if o == "failed")
    if failed:
        print(
            f"torchrec-cowclip sweep: {len(failed)} cell(s) failed ({', '.join(failed)}): "
            "see their train.log; run the same command again to retry them",
            file=sys.stderr,
        )
        return 1
    return 0


def _result(row: Dict[str, Any]) -> str:
    import math

    if not math.isfinite(row["best_auc"]):
        return ""
    clipped = row["clipped_fraction"]
    return (
        (
            f": validation AUC {row['best_val_auc']:.4f}, test AUC {row['best_auc']:.4f} "
            if row["best_by"] == "val"
            else f": test AUC {row['best_auc']:.4f} (chosen on test: no validation split) "
        )
        + f"(epoch {row['best_epoch']}), last test AUC {row['last_auc']:.4f}, "
        f"{row['epochs']} epoch(s), {row['wall_s']:.0f} s"
        + (f", {100 * clipped:.3g}% row updates clipped" if clipped is not None else "")
    )


def _report(out: Path) -> int:
    """Writes the report and the plots of the cells in ``out`` and prints the table."""
    from torchrec_cowclip.sweep import report as reporting
    from torchrec_cowclip.sweep.grid import SweepError
    from torchrec_cowclip.sweep.plots import write_plots

    report = reporting.build_report(out)
    if not report["cells"]:
        raise SweepError(f"no sweep cells in {out} (no {out}/cells/*/cell.json)")
    paths = reporting.write_report(out, report)
    paths.update(write_plots(report, out))
    base = report["sweep"]["base_batch"]
    print(f"\n{reporting.title(report)}")
    print(
        f"AUC: mean ± sd over seeds; change: {report['sweep']['changes']}, "
        "mean (min..max) over seeds; best epoch: by validation AUC with --val-fraction, "
        "else by test AUC"
    )
    print(reporting.format_table(report["summary"], base))
    print(reporting.best_cell(report["summary"]))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0

"""Running a sweep: its directory, its data (converted once), and its cells, each an
ordinary train run in ``<out>/cells/<cell>/``, in a process of its own.

Layout of ``<out>``::

    sweep-settings.json         the settings every cell shares (a later command must match)
    cells/<cell>/cell.json      the cell's grid point, settings, data, config (what its
                                process trains), command (the same run as a train
                                command) and attempts
    cells/<cell>/train.log      the cell's output, attempt after attempt
    cells/<cell>/...            the train run itself: metrics.json, epochs.csv, curves.png, ...
    sweep.csv, sweep.json, sweep.md, sweep_*.png    the report (:mod:`.report`, :mod:`.plots`)

Continuing: a cell whose folder holds ``metrics.json`` is finished and never run again;
one that diverged (``train`` exit status 3) keeps that outcome; any other starts with
``--resume auto``, so a checkpoint left by a stopped or killed sweep is continued and a
cell killed before its first checkpoint starts anew. A cell that was run with other
settings than this command's, or on other data, is refused before anything runs.

Each cell process (:mod:`.cell`: ``train(config)`` with the config of its ``cell.json``,
as the ``train`` command runs it, that gets a SIGTERM when the sweep dies, on which it
checkpoints and stops) gets ``--threads`` = the sweep's threads per cell, so a
killed sweep leaves no run behind holding a cell's lock. SIGTERM or Ctrl-C on the sweep
stops its cells the same way; re-running the command continues them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, Iterator, List, Optional

from torchrec_cowclip.failures import EXIT_DIVERGED, EXIT_STOPPED, ConfigError
from torchrec_cowclip.readback import RefusedFileError
from torchrec_cowclip.readback import read_json as read_back
from torchrec_cowclip.run.checkpoints import CHECKPOINTS_DIR, CheckpointStore
from torchrec_cowclip.run.folder_layout import MANIFEST, MODEL_DIR
from torchrec_cowclip.run.log import write_text_atomically
from torchrec_cowclip.run.out_dir import RunDirLock, has_checkpoint, run_files
from torchrec_cowclip.sweep.grid import (
    Cell,
    SweepError,
    cell_settings,
    describe_differences,
    setting_differences,
    shared_settings,
)
from torchrec_cowclip.train.command import train_argv
from torchrec_cowclip.train.config import TrainConfig

CELLS_DIR = "cells"
#: How a refusal names a cell's command (:func:`~torchrec_cowclip.train.command.train_argv`).
CELL_COMMAND = "a cell's train command"
#: The environment variable that names the sweep's pid to its cells (:mod:`.cell`).
PARENT_PID = "TORCHREC_COWCLIP_SWEEP_PID"
CELL_RECORD = "cell.json"
CELL_LOG = "train.log"
SETTINGS_FILE = "sweep-settings.json"


Say = Callable[[str], None]


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class SweepSpec:
    """What one ``sweep`` command asks for.

    Attributes:
        out: the sweep's directory.
        base: the settings every cell shares (batch size, recipe and seed set per cell),
            the data kind's defaults filled in (table: epochs, validation), as every cell
            runs.
        parallel: cells trained at once.
        threads: torch threads of each cell.
        delete_finished_checkpoints: remove a cell's checkpoints once it has finished
            (its metrics, logs and curves stay; a finished cell is never trained again).
        delete_finished_models: remove a cell's run folder (``model/``: its weights,
            encoders and schema, what predict and export read) once it has finished.
    """

    out: Path
    base: TrainConfig
    batch_sizes: List[int]
    recipes: List[str]
    seeds: List[int]
    equal: str = "epochs"
    parallel: int = 1
    threads: int = 1
    delete_finished_checkpoints: bool = False
    delete_finished_models: bool = False
    cells: List[Cell] = field(default_factory=list)

    def settings(self) -> Dict[str, Any]:
        """``sweep-settings.json``'s content: what every cell of this directory shares."""
        return {"equal": self.equal, "settings": shared_settings(self.base.as_dict())}


def cell_dir(out: Path, name: str) -> Path:
    return Path(out) / CELLS_DIR / name


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A JSON file of the sweep, or None if absent; a damaged one is refused by name."""
    try:
        return read_back(path)
    except FileNotFoundError:
        return None
    except RefusedFileError as e:
        raise SweepError(f"{e}: restore it or move the folder away") from None


def write_json(path: Path, data: Dict[str, Any]) -> None:
    write_text_atomically(path, json.dumps(data, indent=2, default=str) + "\n")


def cell_status(out: Path, name: str) -> str:
    """``finished``, ``diverged``, ``shared`` (reports another cell's run), ``failed`` (its
    last attempt: retried by the next run), ``unfinished`` (stopped or killed: continued by
    the next run) or ``new``."""
    d = cell_dir(out, name)
    record = read_json(d / CELL_RECORD) or {}
    if record.get("shares"):
        return "shared"
    if (d / "metrics.json").exists():
        return "finished"
    attempts = record.get("attempts") or []
    if attempts and attempts[-1].get("outcome") in ("diverged", "failed"):
        return str(attempts[-1]["outcome"])
    return "unfinished" if attempts else "new"


def holds_run(out: Path, name: str) -> bool:
    """Whether a cell's folder holds a train run (finished or started)."""
    d = cell_dir(out, name)
    return d.is_dir() and bool(run_files(d))


def claim_sweep_dir(spec: SweepSpec) -> RunDirLock:
    """Locks ``spec.out`` for this sweep (one sweep per directory at a time) and refuses a
    directory that holds a train run or a sweep with other settings (:func:`record_cells`
    records this sweep's)."""
    out = spec.out
    if out.is_dir() and run_files(out):
        raise SweepError(
            f"--out {out} holds a train run ({', '.join(p.name for p in run_files(out))}): "
            "a sweep keeps its runs in <out>/cells/; choose another --out"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SweepError(f"--out {out} cannot be created: {e.strerror or e}") from None
    lock = RunDirLock.acquire(out)
    try:
        path = out / SETTINGS_FILE
        recorded = read_json(path)
        current = spec.settings()
        if recorded is not None:
            diffs = setting_differences(recorded.get("settings", {}), current["settings"])
            if recorded.get("equal") != current["equal"]:
                diffs.insert(0, ("--equal", str(recorded.get("equal")), current["equal"]))
            if diffs:
                raise SweepError(
                    f"--out {out} holds a sweep with other settings ({describe_differences(diffs)}): "
                    "give its settings to continue or extend it, or choose another --out"
                )
    except BaseException:
        lock.release()
        raise
    return lock


def prepare_data(spec: SweepSpec, say: Say = _say) -> Dict[str, Dict[str, Any]]:
    """Converts the data of every cell into the binary cache, once for all the cells that
    read the same data (every cell but where synthetic rows are drawn per ``--seed``),
    and checks each cell's splits against its batch size, before any cell trains.

    Returns:
        cell name -> the data part of its run record (source, options, rows, cache entry).
    """
    from torchrec_cowclip.train.data import check_split_sizes

    opened: Dict[str, Any] = {}
    records: Dict[str, Dict[str, Any]] = {}
    for cell in spec.cells:
        data = cell.settings.data
        key = json.dumps([data.spec, data.test_spec, data.cache_dir, data.options], default=str)
        if key not in opened:
            t0 = time.perf_counter()
            opened[key] = data.open()
            meta = opened[key].meta
            say(
                f"data {data.spec}: {len(opened[key]):,} rows, cache entry "
                f"{meta.get('kind')}-{meta.get('key')} in {data.cache_dir} "
                f"({time.perf_counter() - t0:.1f} s), shared by every cell that reads it"
            )
        dataset = opened[key]
        train, val, test = data.split(dataset)
        try:
            check_split_sizes(
                data, cell.config.batch_size, len(train), len(val), len(test), world_size=1
            )
        except ConfigError as e:
            raise SweepError(f"cell {cell.name}: {e}") from None
        records[cell.name] = data.record(dataset)
    return records


def prepare_native_update(spec: SweepSpec) -> None:
    """Builds the native CPU update once (first use on this machine) before any cell
    starts, so that no cell counts the build in its training time and parallel cells do
    not wait on one another's build."""
    import torch

    from torchrec_cowclip.embedding.row_kernels import select_kernel
    from torchrec_cowclip.optim.row_step import kernel_mode
    from torchrec_cowclip.optim.rules import update_rule

    devices = {c.config.device for c in spec.cells}
    if any(d == "cpu" or (d == "auto" and not torch.cuda.is_available()) for d in devices):
        # What a CPU cell's tables choose (its processes inherit TORCHREC_COWCLIP_COMPILE):
        # the native kernels are built here, once, if that is them.
        select_kernel(torch.device("cpu"), update_rule("adam"), kernel_mode())


def _data_differences(recorded: Dict[str, Any], current: Dict[str, Any]) -> List[Any]:
    if not recorded:
        return []
    old = (recorded.get("rows"), recorded.get("cache_entry"))
    new = (current.get("rows"), current.get("cache_entry"))
    if old == new:
        return []
    return [
        (
            "--data content",
            f"{old[0]} rows in cache entry {old[1]}",
            f"{new[0]} rows in cache entry {new[1]}",
        )
    ]


def record_cells(spec: SweepSpec, data: Dict[str, Dict[str, Any]]) -> None:
    """Checks every cell folder that exists against this sweep's cell, then writes the
    sweep's settings and each cell's ``cell.json`` (keeping its attempts): nothing is
    written while any cell is refused.

    Raises:
        SweepError: a cell run with other settings or on other data, or a folder holding
            a run that no sweep started.
    """
    records = {}
    for cell in spec.cells:
        d = cell_dir(spec.out, cell.name)
        record = read_json(d / CELL_RECORD)
        if record is None and holds_run(spec.out, cell.name):
            raise SweepError(
                f"{d} holds a run that no sweep started (no {CELL_RECORD}): move it away "
                "or choose another --out"
            )
        if record is not None:
            diffs = setting_differences(
                record.get("settings", {}), cell_settings(cell.config.as_dict())
            )
            diffs += _data_differences(record.get("data") or {}, data[cell.name])
            if diffs:
                raise SweepError(
                    f"cell {cell.name} in {spec.out} was run with other settings "
                    f"({describe_differences(diffs)}): give the sweep's settings, or another --out"
                )
            _threads_for(spec, cell, record)  # a damaged record, refused before any cell runs
        records[cell.name] = record or {}
    if not (spec.out / SETTINGS_FILE).exists():
        write_json(spec.out / SETTINGS_FILE, spec.settings())
    for cell in spec.cells:
        old = records[cell.name]
        d = cell_dir(spec.out, cell.name)
        d.mkdir(parents=True, exist_ok=True)
        write_json(
            d / CELL_RECORD,
            {
                "cell": cell.name,
                **cell.grid_values,
                "rates": cell.rates,
                "variant": cell.variant,
                "shares": cell.shares,
                "settings": cell_settings(cell.config.as_dict()),
                "data": data[cell.name],
                "command": old.get("command"),
                "attempts": old.get("attempts") or [],
            },
        )


@dataclass
class _Running:
    cell: Cell
    process: "subprocess.Popen[bytes]"
    started: float
    threads: int
    log: Any


class _StopOnSignal:
    """SIGTERM / SIGINT while cells run: start no more and pass the signal on to the
    running cells (a second one too, which stops a cell at once)."""

    def __init__(self, running: Dict[str, _Running], say: Say) -> None:
        self.running = running
        self.say = say
        self.requested: Optional[str] = None
        self._previous: Dict[int, Any] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            self.say(
                f"received {name}: stopping the running cells after their current step "
                "(each writes a checkpoint); re-run the same command to continue"
            )
        for run in self.running.values():
            if run.process.poll() is None:
                run.process.send_signal(signal.SIGTERM)

    def __enter__(self) -> "_StopOnSignal":
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _threads_for(spec: SweepSpec, cell: Cell, record: Dict[str, Any]) -> int:
    """A cell continued from a checkpoint keeps the thread count it was started with
    (``train --resume`` refuses another); any other gets the sweep's."""
    attempts = record.get("attempts") or []
    if attempts and has_checkpoint(cell_dir(spec.out, cell.name)):
        # The last attempt wrote the checkpoint, or continued one with the same threads.
        last = attempts[-1] if isinstance(attempts[-1], dict) else {}
        threads = last.get("threads", spec.threads)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise SweepError(
                f"{cell_dir(spec.out, cell.name) / CELL_RECORD}: the last attempt's threads "
                f"is {threads!r}, not a whole number >= 1 (a damaged or hand-edited file): "
                "restore it, or move the cell's folder away"
            )
        return threads
    return spec.threads


def _last_line(log: Path) -> str:
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - 4096))
            lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _outcome(status: int, finished: bool) -> str:
    if status == 0 and finished:
        return "finished"
    if status == EXIT_DIVERGED:  # a result of the recipe at that batch, kept
        return "diverged"
    if status in (EXIT_STOPPED, -signal.SIGTERM, -signal.SIGINT):
        return "stopped"
    return "failed"


def run_cells(
    spec: SweepSpec,
    say: Say = _say,
    on_end: Callable[[Cell, str], None] = lambda cell, outcome: None,
) -> Dict[str, str]:
    """Trains every cell that is neither finished, diverged nor shared, ``spec.parallel``
    at a time, each as ``python -m torchrec_cowclip.sweep.cell <cell folder>``: ``train``
    with the config its ``cell.json`` holds.

    Returns:
        cell name -> outcome of this command's attempt (``finished``, ``diverged``,
        ``stopped``, ``failed``); cells not attempted are absent.
    """
    statuses = {c.name: cell_status(spec.out, c.name) for c in spec.cells}
    todo = [c for c in spec.cells if statuses[c.name] in ("new", "unfinished", "failed")]
    kept = [s for s in statuses.values() if s in ("finished", "diverged")]
    if kept:
        say(f"{len(kept)} of {len(spec.cells)} cells finished (or diverged) before: not run again")
    outcomes: Dict[str, str] = {}
    running: Dict[str, _Running] = {}
    with _StopOnSignal(running, say) as stop:
        while (todo and stop.requested is None) or running:
            while todo and len(running) < spec.parallel and stop.requested is None:
                cell = todo.pop(0)
                running[cell.name] = _start(spec, cell, say)
            time.sleep(0.1)
            for name, run in list(running.items()):
                status = run.process.poll()
                if status is None:
                    continue
                del running[name]
                outcome = _end(spec, run, status)
                outcomes[name] = outcome
                on_end(run.cell, outcome)
        if stop.requested is not None and todo:
            say(f"stopped by {stop.requested}: {len(todo)} cells not started")
    return outcomes


def _start(spec: SweepSpec, cell: Cell, say: Say) -> _Running:
    d = cell_dir(spec.out, cell.name)
    record = read_json(d / CELL_RECORD) or {}
    threads = _threads_for(spec, cell, record)
    config = replace(cell.config, out=str(d), resume="auto", threads=threads, progress=False)
    # The cell runs from the config; its command is kept for the reader (the same run).
    argv = train_argv(None, config, what=CELL_COMMAND)
    attempts = record.setdefault("attempts", [])
    attempts.append(
        {
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "threads": threads,
            "continues": has_checkpoint(d),
        }
    )
    record["command"] = ["torchrec-cowclip", "train", *argv]
    record["config"] = config.as_dict()
    write_json(d / CELL_RECORD, record)
    log = (d / CELL_LOG).open("ab")
    log.write(f"--- attempt {len(attempts)}: {' '.join(record['command'])}\n".encode())
    log.flush()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        PARENT_PID: str(os.getpid()),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "torchrec_cowclip.sweep.cell", str(d)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # a Ctrl-C reaches the sweep, which stops its cells
    )
    how = "continuing its checkpoint" if attempts[-1]["continues"] else "starting"
    say(
        f"cell {cell.name}: {how} ({threads} thread{'s' if threads > 1 else ''}), log {d / CELL_LOG}"
    )
    return _Running(cell, process, time.perf_counter(), threads, log)


def _end(spec: SweepSpec, run: _Running, status: int) -> str:
    run.log.close()
    d = cell_dir(spec.out, run.cell.name)
    record = read_json(d / CELL_RECORD) or {}
    outcome = _outcome(status, (d / "metrics.json").exists())
    attempt = record["attempts"][-1]
    attempt.update(
        wall_s=round(time.perf_counter() - run.started, 3),
        exit_status=status,
        outcome=outcome,
    )
    if outcome != "finished":
        attempt["message"] = _last_line(d / CELL_LOG)
    elif spec.delete_finished_checkpoints:
        removed, _ = CheckpointStore(d / CHECKPOINTS_DIR).remove_own()
        attempt["checkpoints_deleted"] = len(removed)
    if outcome == "finished" and spec.delete_finished_models:
        # Only a complete run folder (its manifest written last) that the cell's run wrote.
        if (d / MODEL_DIR / MANIFEST).is_file():
            shutil.rmtree(d / MODEL_DIR)
            attempt["model_deleted"] = True
    write_json(d / CELL_RECORD, record)
    return outcome


def iter_cell_records(out: Path) -> Iterator[Dict[str, Any]]:
    """Every ``cell.json`` under ``out/cells``, in name order."""
    root = Path(out) / CELLS_DIR
    if not root.is_dir():
        return
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        record = read_json(d / CELL_RECORD)
        if record is not None:
            yield checked_record(d, record)


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def checked_record(d: Path, record: Dict[str, Any]) -> Dict[str, Any]:
    """``record``, the ``cell.json`` of cell directory ``d``, if it has the fields and
    types the sweep writes: it names ``d`` itself, a cell it shares lies beside it (a
    plain name under ``cells/``), and its sizes are whole numbers.

    Raises:
        SweepError: naming the file, the field and its value.
    """

    def refuse(why: str) -> SweepError:
        return SweepError(f"{d / CELL_RECORD}: {why}: not what the sweep writes; move it away")

    if record.get("cell") != d.name:
        raise refuse(f"'cell' is {record.get('cell')!r}, not its own folder's name {d.name!r}")
    shares = record.get("shares")
    if shares is not None and (
        not isinstance(shares, str)
        or shares in ("", ".", "..")
        or "/" in shares
        or "\\" in shares
        or "\0" in shares
        or not (d.parent / shares).is_dir()
    ):
        raise refuse(f"'shares' is {shares!r}, not another cell of this sweep")
    for key, least in (("batch_size", 1), ("seed", 0)):
        if not _whole(record.get(key), least):
            raise refuse(f"'{key}' is {record.get(key)!r}, not a whole number >= {least}")
    for key, kinds in (("recipe", (str,)), ("variant", (str, type(None)))):
        if not isinstance(record.get(key), kinds):
            raise refuse(f"'{key}' is {record.get(key)!r}, not a name")
    if not isinstance(record.get("rates") or {}, dict):
        raise refuse(f"'rates' is {record.get('rates')!r}, not a mapping")
    attempts = record.get("attempts") or []
    if not isinstance(attempts, list) or not all(
        isinstance(a, dict)
        and isinstance(a.get("wall_s", 0.0), (int, float))
        and not isinstance(a.get("wall_s", 0.0), bool)
        for a in attempts
    ):
        raise refuse("'attempts' is not a list of attempts with their wall_s")
    return record

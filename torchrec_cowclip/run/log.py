"""Run logs in ``--out``: ``steps.csv`` and ``epochs.csv``, TensorBoard event files in
``tb/`` (tensorboardX, no TensorFlow needed), a tqdm progress bar on stderr, and each
epoch's row as the terminal shows it (:func:`epoch_line`).

Example::

    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp()) / "run"
    >>> log = RunLog(out)
    >>> log.step(10, {"loss": 0.45, "samples_per_s": 1.2e5})
    >>> log.epoch({"epoch": 1, "test_auc": 0.79})
    >>> log.close()
    >>> (out / "epochs.csv").read_text().splitlines()
    ['epoch,test_auc', '1,0.79']
    >>> duration(3725.0)
    '1h02m'
    >>> epoch_line({"epoch": 1, "epochs": 2, "test_auc": 0.81234, "train_loss": 0.45,
    ...             "epoch_s": 12.0, "train_samples_per_s": 10500.0, "peak_rss_mb": 812.0,
    ...             "rows_updated": 300, "rows_clipped": 0, "eta_s": 13.0})
    'epoch 1/2: test_auc 0.81234, train_loss 0.45000 | 12s, 10,500 samples/s, peak RSS 812 MB | rows updated 300, clipped 0 | run ETA 13s'
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, TextIO

from tensorboardX import SummaryWriter
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information

from torchrec_cowclip.run.no_space import no_space


class RunOutputError(OSError):
    """Writing a run file failed (disk full, read-only, quota); the message names it."""


def _output_error(path: Path, error: OSError) -> OSError:
    full = no_space(error, path)
    if full is not None:
        return full
    return RunOutputError(error.errno, f"cannot write {path}: {error.strerror or error}")


def write_text_atomically(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through ``path.tmp`` and ``os.replace``, so a kill or a
    full disk leaves the old file or the new one, never a part.

    Raises:
        RunOutputError: naming ``path`` (the temporary file is removed);
            :class:`~.no_space.NoSpaceError` for a full disk.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _output_error(path, e) from None


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def epoch_line(row: Mapping[str, Any]) -> str:
    """One line for an epoch's row of ``epochs.csv`` (plus ``epochs`` and ``eta_s``); an
    AUC of None (its split's labels hold one class) reads ``undefined (one class)``."""
    metrics = ", ".join(
        f"{k} {row[k]:.{3 if k.endswith('calibration') else 5}f}"
        if isinstance(row[k], float)
        else f"{k} undefined (one class)"
        for k in (
            "test_auc",
            "test_logloss",
            "test_calibration",
            "val_auc",
            "val_logloss",
            "val_calibration",
            "train_loss",
        )
        if (isinstance(row.get(k), float) and not (k.endswith("calibration") and row[k] != row[k]))
        or (k.endswith("_auc") and k in row and row[k] is None)
    )
    parts = [f"epoch {row['epoch']}/{row['epochs']}: {metrics}"]
    if "epoch_s" in row:
        parts.append(
            f"{duration(row['epoch_s'])}, {row['train_samples_per_s']:,.0f} samples/s, "
            f"peak RSS {row['peak_rss_mb']:,.0f} MB"
        )
    if row.get("rows_updated") is not None:
        parts.append(f"rows updated {row['rows_updated']:,}, clipped {row['rows_clipped']:,}")
    if row.get("eta_s") is not None:
        parts.append(f"run ETA {duration(row['eta_s'])}")
    return " | ".join(parts)


class _CsvLog:
    """Appends dict rows to a CSV whose header is the first row's keys."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Optional[TextIO] = None
        self._writer: Optional[csv.DictWriter[str]] = None

    def write(self, row: Dict[str, Any]) -> None:
        try:
            if self._writer is None:
                exists = self.path.exists() and self.path.stat().st_size > 0
                self._file = self.path.open("a", newline="")
                self._writer = csv.DictWriter(
                    self._file, fieldnames=list(row), extrasaction="ignore"
                )
                if not exists:
                    self._writer.writeheader()
            self._writer.writerow(row)
            assert self._file is not None
            self._file.flush()
        except OSError as e:
            raise _output_error(self.path, e) from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def truncate(self, column: str, last: int) -> int:
        """Drops the rows whose ``column`` is past ``last`` (written by a run killed after
        its last checkpoint, which a resumed run writes again); returns how many. The file
        is rewritten beside itself and renamed, so a kill leaves the old or the new one."""
        if self._writer is not None or not self.path.exists():
            return 0
        with self.path.open(newline="") as f:
            reader = csv.DictReader(f)
            fields, rows = reader.fieldnames, list(reader)
        kept = [r for r in rows if r.get(column, "").isdigit() and int(r[column]) <= last]
        if fields is None or len(kept) == len(rows):
            return 0
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(kept)
        os.replace(tmp, self.path)
        return len(rows) - len(kept)


class RunLog:
    """Where a training run reports: CSV, TensorBoard and the terminal."""

    def __init__(self, out: Path, enabled_progress: bool = True, enabled: bool = True) -> None:
        # enabled=False (ranks other than 0 of a multi-process run): nothing is written.
        self.out = out
        self.enabled = enabled
        self.enabled_progress = enabled_progress and enabled
        self._steps = _CsvLog(out / "steps.csv")
        self._epochs = _CsvLog(out / "epochs.csv")
        self._tb = SummaryWriter(str(out / "tb")) if enabled else None

    def rewind(self, step: int, epoch: int) -> None:
        """A resumed run continues from ``step`` (and ``epoch`` finished epochs): the CSV
        rows past them, logged after the checkpoint by the run that was stopped, are
        dropped so that each step and epoch appears once."""
        if not self.enabled:
            return
        dropped = self._steps.truncate("step", step) + self._epochs.truncate("epoch", epoch)
        if dropped:
            self.info(
                f"dropped {dropped} log rows written after the checkpoint (logged again as "
                "the run repeats those steps)"
            )

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    def progress_bar(self, total: int, initial: int, desc: str, unit: str = "step") -> tqdm:
        return tqdm(
            total=total,
            initial=initial,
            desc=desc,
            disable=not self.enabled_progress,
            unit=unit,
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def step(self, step: int, values: Dict[str, float]) -> None:
        if self._tb is None:  # not enabled
            return
        self._steps.write({"step": step, **values})
        for key, value in values.items():
            self._tb.add_scalar(f"train/{key}", value, step)

    def epoch(self, row: Dict[str, Any]) -> None:
        if self._tb is None:  # not enabled
            return
        self._epochs.write(row)
        for key, value in row.items():
            if key != "epoch" and isinstance(value, (int, float)):
                self._tb.add_scalar(f"epoch/{key}", value, row["epoch"])

    def close(self) -> None:
        self._steps.close()
        self._epochs.close()
        if self._tb is not None:
            self._tb.close()

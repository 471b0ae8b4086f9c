"""What the training loop tells, and where (:class:`RunReport`): the loop's one
collaborator for it. The lines' text is :mod:`.console`'s; the files they go to (the run
log: ``steps.csv``, ``epochs.csv``, TensorBoard, the terminal) are
:class:`~torchrec_cowclip.run.log.RunLog`'s.

Example::

    >>> import contextlib, io, tempfile
    >>> from pathlib import Path
    >>> out, said = Path(tempfile.mkdtemp()), io.StringIO()
    >>> report = RunReport(out, ["run: 1 epoch"], (1, 10, 0, 1), log_every=5, main=True,
    ...                    bars=False)
    >>> with contextlib.redirect_stderr(said):
    ...     report.open()
    ...     report.epoch({"epoch": 1, "step": 10, "test_auc": 0.75}, eta_s=None)
    ...     report.close()
    >>> said.getvalue().splitlines()[0], (out / "epochs.csv").read_text().splitlines()
    ('run: 1 epoch', ['epoch,step,test_auc', '1,10,0.75'])
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from torchrec_cowclip.run.log import RunLog, duration, epoch_line
from torchrec_cowclip.run.resume_guard import resumed_message
from torchrec_cowclip.train.run_state import Progress


class RunReport:
    """Everything the training loop tells, and where: the start summary, a progress bar
    per epoch and per evaluation, each step's row (every ``log_every`` steps) and each
    epoch's (``steps.csv``, ``epochs.csv``, TensorBoard, the epoch's line), early stopping,
    and the finished run's weights and calibration. Only the main process writes
    (``main``); ``bars``: whether the progress bars are drawn.

    Args:
        out: the run directory (its run log).
        lines: the start summary (:func:`~torchrec_cowclip.train.console.start_lines`).
        eta_plan: what the run's ETA counts (:meth:`Progress.eta
            <torchrec_cowclip.train.run_state.Progress.eta>`): its epochs, their steps,
            ``--max-steps`` and the evaluations per epoch.
        log_every: the steps between two rows of ``steps.csv``.
    """

    def __init__(
        self,
        out: Path,
        lines: Sequence[str],
        eta_plan: Tuple[int, int, int, int],
        log_every: int,
        main: bool,
        bars: bool,
    ) -> None:
        self.out, self.lines, self.eta_plan = out, list(lines), eta_plan
        self.epochs, self.steps_per_epoch = eta_plan[0], eta_plan[1]
        self.log_every, self.main, self.bars = log_every, main, bars
        self._log: Optional[RunLog] = None
        self._bar: Any = None
        # Samples and time since steps.csv's last row (its samples/s).
        self._since, self._samples_since = time.perf_counter(), 0

    def say(self, line: str) -> None:
        """One line on stderr (the main process's)."""
        if self.main:
            print(line, file=sys.stderr, flush=True)

    def open(self, resumed: Optional[Tuple[Progress, Path]] = None) -> None:
        """Starts the run log and tells the start summary; a run ``resumed`` at a progress
        from a checkpoint says so and drops the rows logged after it."""
        lines = list(self.lines)
        if resumed is not None:
            p, checkpoint = resumed
            lines.append(
                resumed_message(
                    p.global_step, p.epoch, p.batch_in_epoch, self.steps_per_epoch, checkpoint
                )
            )
        self._log = RunLog(self.out, enabled_progress=self.bars and self.main, enabled=self.main)
        for line in lines:
            self._log.info(line)
        if resumed is not None:
            self._log.rewind(resumed[0].global_step, resumed[0].epoch)

    def _opened(self) -> RunLog:
        if self._log is None:
            raise RuntimeError("the run's report is not open: open() it first")
        return self._log

    def info(self, line: str) -> None:
        """A line of the run (in the run log's terminal)."""
        self._opened().info(line)

    def epoch_started(self, p: Progress) -> None:
        """The epoch's progress bar, from where ``p`` is."""
        self._bar = self._opened().progress_bar(
            total=self.steps_per_epoch,
            initial=p.batch_in_epoch,
            desc=f"epoch {p.epoch + 1}/{self.epochs}",
        )
        self._since, self._samples_since = time.perf_counter(), 0

    def stepped(
        self,
        p: Progress,
        loss: float,
        running: float,
        samples: int,
        step_s: float,
        dense_lr: Callable[[], float],
        helen: bool,
    ) -> None:
        """A training step done: its row every ``log_every`` steps (with the dense
        learning rate ``dense_lr`` gives, asked then only), the bar moved on with the
        running loss, the speed, the run's ETA at ``step_s`` a step and, for Helen, what
        its second pass adds."""
        self._samples_since += samples
        if p.global_step % self.log_every == 0:
            now = time.perf_counter()
            rate = self._samples_since / max(now - self._since, 1e-9)
            self._since, self._samples_since = now, 0
            values = {"loss": loss, "running_loss": running, "samples_per_s": rate}
            self._opened().step(p.global_step, {**values, "dense_lr": dense_lr()})
        self._bar.update(1)
        postfix = {
            "loss": f"{running:.4f}",
            "samples_s": f"{p.train_samples / max(p.train_seconds, 1e-9):,.0f}",
            "run_eta": duration(self.eta(p, step_s)),
        }
        if helen:
            postfix["helen_extra"] = f"+{p.helen_cost()['extra_fraction']:.0%}"
        self._bar.set_postfix(postfix)

    def eta(self, p: Progress, step_s: float) -> float:
        """Seconds left in the run from ``p`` at ``step_s`` a step (:meth:`Progress.eta
        <torchrec_cowclip.train.run_state.Progress.eta>` of what it counts)."""
        return p.eta(step_s, *self.eta_plan)

    def epoch_ended(self) -> None:
        """Closes the epoch's progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def evaluation_bar(self, total: int, name: str, rows: int) -> Any:
        """A progress bar over an evaluation's ``total`` batches of ``rows`` rows."""
        return self._opened().progress_bar(
            total=total, initial=0, desc=f"evaluating {name} ({rows:,} rows)", unit="batch"
        )

    def epoch(self, row: Dict[str, Any], eta_s: Optional[float]) -> None:
        """An epoch's row (``epochs.csv``, TensorBoard) and line, with the run's ETA."""
        log = self._opened()
        log.epoch(row)
        log.info(epoch_line({**row, "epochs": self.epochs, "eta_s": eta_s}))

    def close(self) -> None:
        """Closes the run log (the lines after it go straight to stderr)."""
        self.epoch_ended()
        if self._log is not None:
            self._log.close()

"""The start of a training run (:func:`start_run`): its resolved settings taken down the
layers once - ``--init-from``'s run verified and the command checked against it, ``--out``
made or claimed, the data opened and split, the model placed and its optimizers built, the
checkpoints readied - and handed to the loop as the pieces it runs
(:class:`~torchrec_cowclip.train.loop.TrainingLoop`), with what it tells
(:class:`~torchrec_cowclip.train.report.RunReport`) and what it leaves
(:class:`~torchrec_cowclip.train.finish.RunFinish`).

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.train import TrainConfig, train
    >>> tmp = tempfile.mkdtemp()
    >>> metrics = train(TrainConfig(model="deepfm", data="synthetic:3000", synthetic_scale=0.01,
    ...                             synthetic_max_cardinality=500, hidden=(8,), batch_size=512,
    ...                             epochs=1, progress=False, out=f"{tmp}/run",
    ...                             cache_dir=f"{tmp}/cache"))
    >>> metrics["steps"], sorted(metrics["epoch_auc"]) == [metrics["auc"]]
    (5, True)
    >>> metrics.run_dir.name, sorted(p.name for p in (metrics.run_dir / "model").iterdir())
    ('run', ['data.json', 'encoders', 'manifest.json', 'model.json', 'weights'])
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from torchrec_cowclip import notices
from torchrec_cowclip.data.pipeline.cache import sources_seen
from torchrec_cowclip.run.checkpoints import CHECKPOINTS_DIR, CheckpointStore
from torchrec_cowclip.run.out_dir import RunDirLock, claim_run_dir, new_run_dir
from torchrec_cowclip.run.resume_guard import run_fingerprint, run_record
from torchrec_cowclip.train.config import RECORDED_SETTINGS, TrainConfig, TrainSettings
from torchrec_cowclip.train.console import start_lines
from torchrec_cowclip.train.data import open_training_data
from torchrec_cowclip.train.finish import RunFinish
from torchrec_cowclip.train.loop import TrainingLoop
from torchrec_cowclip.train.metrics import TrainResult
from torchrec_cowclip.train.report import RunReport
from torchrec_cowclip.train.run_state import RunCheckpoints, total_steps_of
from torchrec_cowclip.train.runtime import make_runtime
from torchrec_cowclip.train.warm_start import WarmStart


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def start_run(settings: TrainSettings) -> TrainingLoop:
    """The loop of the run ``settings`` describe, its pieces built (see the module
    docstring); ``start_run(config.resolve()).run()`` trains. ``--init-from``'s run is
    verified before ``--out`` is made or claimed; a start that fails releases the claim and
    removes the empty directory it made.

    Raises:
        RunDirError: ``--out`` holds another run (see
            :func:`~torchrec_cowclip.run.out_dir.claim_run_dir`).
    """
    notices.install()
    warm = WarmStart.open(settings) if settings.run.init_from else None
    created = None
    if settings.run.out is None:  # a new directory, never one that holds a run
        created = new_run_dir(process=settings.process)
        settings = settings.writing_to(str(created))
    run, main = settings.run, settings.process.is_main
    out = Path(str(run.out))
    # One checkpoint store: the claim asks and cleans it, the run's checkpoints keep it.
    store = CheckpointStore(out / CHECKPOINTS_DIR, keep=run.keep_checkpoints)
    # Rank 0 (the launcher names it before the process group exists) holds the output
    # directory's lock for the run's life.
    run_dir = claim_run_dir(out, run.resume, run.overwrite, main=main, checkpoints=store)
    try:
        return _pieces(settings, out, store, run_dir, warm)
    except BaseException:
        run_dir.release()
        if created is not None and main and not any(created.iterdir()):
            created.rmdir()  # the empty directory this failed start made
        raise


def _pieces(
    settings: TrainSettings,
    out: Path,
    store: CheckpointStore,
    run_dir: RunDirLock,
    warm: Optional[WarmStart],
) -> TrainingLoop:
    run = settings.run
    if run.threads:
        torch.set_num_threads(run.threads)
    _seed_everything(run.seed)
    # validate() has checked that the test files are of --data's kind.
    with sources_seen() as sources:
        data = open_training_data(
            settings.data,
            run.batch_size,
            settings.model.embedding_dim,
            settings.optimizers.embedding.optimizer,
            warm=warm,
            process=settings.process,
        )
    record = run_record(settings.record_settings(), settings.data.record(data.dataset), sources)
    fingerprint = run_fingerprint(record, RECORDED_SETTINGS)
    runtime = make_runtime(settings, data.dataset, data.train_idx)
    if run.row_clip_stats:
        runtime.model.embedding_collection.track_row_clips()
    checkpoints = RunCheckpoints(
        out, store, runtime, settings.record, record, fingerprint, run.row_clip_stats
    )
    total_steps = total_steps_of(run.epochs, runtime.steps_per_epoch, run.max_steps)
    report = RunReport(
        out,
        start_lines(settings, data, runtime, out, total_steps),
        # The run's ETA: its epochs, their steps, --max-steps and the evaluations per
        # epoch (the test split's, and the validation split's).
        (run.epochs, runtime.steps_per_epoch, run.max_steps, 2 if len(data.val_idx) else 1),
        run.log_every,
        main=runtime.is_main,
        bars=run.progress,
    )
    if runtime.is_main:
        checkpoints.clean(report.say)
    finish = RunFinish(settings, out, data, runtime, checkpoints, report)
    return TrainingLoop(run, runtime, data, checkpoints, report, finish, run_dir, warm)


def train(config: TrainConfig) -> TrainResult:
    """Runs training as configured; returns the metrics written to ``out/metrics.json``
    (a dict) carrying ``run_dir`` (whose ``model/`` ``torchrec_cowclip.load_model``
    scores with) and ``model`` (the trained module)."""
    return start_run(config.resolve()).run()

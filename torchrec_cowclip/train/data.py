"""A run's data, opened once and checked before any model is built: the splits, the
share of positive labels in each, the dense plan the model's inputs take, and a model
whose embedding tables cannot fit in memory refused before they are allocated.

:func:`open_training_data` is what a run's start (:mod:`.start`) opens; a sweep converts
its cells' data and checks their splits with the same pieces (:meth:`DataSettings.open
<torchrec_cowclip.data.settings.DataSettings.open>`, :func:`check_split_sizes`) before
any cell trains.

A table's size is its row count, which comes from the data: ids that were never mapped
to a contiguous range (``criteo-npy:`` days holding TorchRec's raw 32-bit hashes, before
``contiguous_preproc_criteo``) make every table 2**32 rows, and allocating them would
die with an allocator error after minutes of data work. :func:`check_tables_fit` adds up
what the model's ``embedding_dim`` tables alone hold - float32 weights plus the
embedding optimizer's state - and refuses, in one line naming the largest table and
the flag that fixes it, a total beyond the memory of the machines of the run.

Example::

    >>> table_bytes(1_000_000, 16, "adam")   # weights, exp_avg, exp_avg_sq
    192000000
    >>> check_tables_fit(["C1"], [2**32], embedding_dim=10, optimizer="adam",
    ...                  memory_bytes=64 << 30, fix="--hash-size")
    Traceback (most recent call last):
    ...
    torchrec_cowclip.failures.ConfigError: table emb_C1 would need 480.0 GiB (4,294,967,296 rows x 10, float32 with adam state), and the tables 480.0 GiB in all, more than the 64.0 GiB of memory of this run's machines: the ids look unmapped (raw hashes?); hash them into fewer rows with --hash-size (e.g. --hash-size 1000000)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch

from torchrec_cowclip.data.parsing.dense import DensePlan
from torchrec_cowclip.data.settings import DataSettings
from torchrec_cowclip.embedding.table_batch import storage_bytes
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.models.embeddings import embedding_table_name
from torchrec_cowclip.process_context import ONE_PROCESS, ProcessContext

_GIB = float(1 << 30)


def table_bytes(rows: int, dim: int, optimizer: str) -> int:
    """Bytes of one float32 table of ``rows x dim`` with ``optimizer``'s state: a state
    laid out per element (``"D"``, Adam's moments) is another ``rows x dim``, one per row
    (row-wise Adagrad's ``sum``) another ``rows`` (:func:`~torchrec_cowclip.embedding.table_batch.storage_bytes`)."""
    weights, state = storage_bytes(rows, dim, torch.float32, optimizer)
    return weights + state


def machine_memory_bytes(process: ProcessContext = ONE_PROCESS) -> int:
    """Physical memory of this machine times the number of machines of the run
    (``process``: its world and local world sizes)."""
    pages = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    return pages * process.nodes


def check_tables_fit(
    sparse_names: Sequence[str],
    cardinalities: Sequence[int],
    embedding_dim: int,
    optimizer: str,
    memory_bytes: Optional[int] = None,
    fix: str = "--hash-size",
    process: ProcessContext = ONE_PROCESS,
) -> None:
    """Raises :class:`~torchrec_cowclip.failures.ConfigError` if the
    ``embedding_dim`` tables of ``sparse_names`` (rows ``cardinalities``) with
    ``optimizer``'s state need more than ``memory_bytes`` (default: the memory of the
    machines of ``process``, :func:`machine_memory_bytes`). A lower bound of the model's
    size: first-order tables, dense layers and activations come on top. ``fix`` is the
    flag the message suggests (``--hash-size``, or ``--synthetic-max-cardinality`` for
    generated data)."""
    limit = machine_memory_bytes(process) if memory_bytes is None else int(memory_bytes)
    sizes = [table_bytes(rows, embedding_dim, optimizer) for rows in cardinalities]
    total = sum(sizes)
    if total <= limit or not sizes:
        return
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    example = "1000000"
    raise ConfigError(
        f"table {embedding_table_name(sparse_names[largest])} would need "
        f"{sizes[largest] / _GIB:.1f} GiB ({int(cardinalities[largest]):,} rows x "
        f"{embedding_dim}, float32 with {optimizer} state), and the tables "
        f"{total / _GIB:.1f} GiB in all, more than the {limit / _GIB:.1f} GiB of memory of "
        f"this run's machines: the ids look unmapped (raw hashes?); hash them into fewer "
        f"rows with {fix} (e.g. {fix} {example})"
    )


def positive_rates(labels: Any, splits: Dict[str, np.ndarray]) -> Dict[str, Optional[float]]:
    """The share of positive labels in each split (None for an empty one).

    Example::

        >>> positive_rates(np.array([1, 0, 0, 1.0]), {"train": np.array([0, 1, 2]),
        ...                                            "test": np.array([], dtype=np.int64)})
        {'train': 0.3333333333333333, 'test': None}
    """
    rates: Dict[str, Optional[float]] = {}
    for name, rows in splits.items():
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        rates[name] = (
            float(np.asarray(labels[rows], dtype=np.float64).mean()) if len(rows) else None
        )
    return rates


def check_training_labels(data: DataSettings, rate: Optional[float], rows: int) -> None:
    """Refuses a training split whose labels are all 0 or all 1: the model would learn a
    constant and every AUC would be undefined."""
    if rate is not None and rate in (0.0, 1.0):
        raise ConfigError(
            f"every one of the {rows:,} training labels of {data.spec} is {int(rate)} (the "
            f"--label column has one class): a CTR model needs clicks and non-clicks"
        )


def check_split_sizes(
    data: DataSettings, batch_size: int, n_train: int, n_val: int, n_test: int, world_size: int
) -> None:
    """Refuses, before any model is built, splits that would train no step or evaluate
    nothing: a ``--batch-size`` larger than the training split (the last incomplete
    batch of an epoch is dropped on any number of processes, so no full batch means no
    step), an empty test or validation split, or one with fewer rows than processes."""
    _refuse_split(
        n_train,
        batch_size,
        f"no training rows in {data.spec} after the split",
        f"--batch-size {batch_size} is larger than the {n_train:,} training rows "
        f"of {data.spec}: no full batch, so no step would train; lower --batch-size",
    )
    splits = [("test", n_test, "--test-fraction / --test-data")]
    if data.val_fraction > 0:
        splits.append(("validation", n_val, "--val-fraction"))
    for name, rows, flag in splits:
        _refuse_split(
            rows,
            world_size,
            f"the {name} split of {data.spec} is empty: raise {flag}",
            f"the {name} split of {data.spec} has {rows} rows, fewer than the "
            f"{world_size} processes that evaluate it: raise {flag}",
        )


def _refuse_split(rows: int, needs: int, empty: str, short: str) -> None:
    """Refuses a split of ``rows`` rows that has none (saying ``empty``) or fewer than
    the ``needs`` it must have (saying ``short``)."""
    if rows == 0:
        raise ConfigError(empty)
    if rows < needs:
        raise ConfigError(short)


@dataclass
class TrainingData:
    """A run's data, opened and checked (:func:`open_training_data`).

    Attributes:
        plan_seconds: how long fitting the dense plan took (reading the training rows).
    """

    dataset: Any
    train_idx: np.ndarray
    val_idx: np.ndarray
    test_idx: np.ndarray
    positive_rates: Dict[str, Optional[float]]
    dense_plan: DensePlan
    plan_seconds: float


def open_training_data(
    data: DataSettings,
    batch_size: int,
    embedding_dim: int,
    optimizer: str,
    warm: Any = None,
    process: ProcessContext = ONE_PROCESS,
) -> TrainingData:
    """Opens ``data`` (a warm start's ``warm``: with RUN's encoders, checked against RUN,
    RUN's dense plan kept), splits it and refuses, in one line, a one-class training split,
    splits that would train or evaluate nothing, and ``embedding_dim`` tables with
    ``optimizer``'s state beyond the machines' memory; all of which it checks before it
    fits the dense plan (which reads the training split)."""
    dataset = data.open(None if warm is None else warm.encoders)
    if warm is not None:
        warm.check_dataset(dataset)
    train_idx, val_idx, test_idx = data.split(dataset)
    rates = positive_rates(
        dataset.labels, {"train": train_idx, "validation": val_idx, "test": test_idx}
    )
    check_training_labels(data, rates["train"], len(train_idx))
    check_split_sizes(
        data, batch_size, len(train_idx), len(val_idx), len(test_idx), process.world_size
    )
    check_tables_fit(
        dataset.schema.sparse_names,
        dataset.schema.cardinalities,
        embedding_dim,
        optimizer,
        # The options list every option the kind takes: hashing fixes raw ids, else a cap.
        fix="--hash-size" if "hash_size" in data.options else "--synthetic-max-cardinality",
        process=process,
    )
    started = time.perf_counter()
    plan = (
        dataset.fit_dense_plan(train_idx)  # the training split's statistics
        if warm is None
        else warm.keep_dense_plan(dataset)  # RUN's: its model's inputs
    )
    plan_seconds = time.perf_counter() - started
    return TrainingData(dataset, train_idx, val_idx, test_idx, rates, plan, plan_seconds)

"""Refusing a model whose embedding tables cannot fit in memory, before allocating them.

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
    torchrec_cowclip.train.config.ConfigError: table emb_C1 would need 480.0 GiB (4,294,967,296 rows x 10, float32 with adam state), and the tables 480.0 GiB in all, more than the 64.0 GiB of memory of this run's machines: the ids look unmapped (raw hashes?); hash them into fewer rows with --hash-size (e.g. --hash-size 1000000)
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from torchrec_cowclip.embedding.table_batch import storage_bytes
from torchrec_cowclip.models.embeddings import embedding_table_name
from torchrec_cowclip.train.config import ConfigError

_GIB = float(1 << 30)


def table_bytes(rows: int, dim: int, optimizer: str) -> int:
    """Bytes of one float32 table of ``rows x dim`` with ``optimizer``'s state: a state
    laid out per element (``"D"``, Adam's moments) is another ``rows x dim``, one per row
    (row-wise Adagrad's ``sum``) another ``rows`` (:func:`~torchrec_cowclip.embedding.table_batch.storage_bytes`)."""
    weights, state = storage_bytes(rows, dim, torch.float32, optimizer)
    return weights + state


def machine_memory_bytes() -> int:
    """Physical memory of this machine times the number of machines of the run (torchrun
    sets ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) or world
    nodes = max(world // max(local, 1), 1)
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES")) * nodes


def check_tables_fit(
    sparse_names: Sequence[str],
    cardinalities: Sequence[int],
    embedding_dim: int,
    optimizer: str,
    memory_bytes: Optional[int] = None,
    fix: str = "--hash-size",
) -> None:
    """Raises :class:`~torchrec_cowclip.train.config.ConfigError` if the
    ``embedding_dim`` tables of ``sparse_names`` (rows ``cardinalities``) with
    ``optimizer``'s state need more than ``memory_bytes`` (default
    :func:`machine_memory_bytes`). A lower bound of the model's size: first-order
    tables, dense layers and activations come on top. ``fix`` is the flag the message
    suggests (``--hash-size``, or ``--synthetic-max-cardinality`` for generated data)."""
    limit = machine_memory_bytes() if memory_bytes is None else int(memory_bytes)
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

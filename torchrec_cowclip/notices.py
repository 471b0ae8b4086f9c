"""The known notices of torch and TorchRec that a training run cannot act on, filtered once
and narrowly: each by the logger or module that emits it and the start of its message,
with the reason it says nothing to the user. Anything else still shows.

What the trainer can fix where it arises it fixes there instead (TorchRec's planner
topology is built with ``TopologyFactory`` and its storage reservation where the planner
is made, ``distributed/planning.py``; ``--on-bad-row skip`` reports once; a
one-process checkpoint is written and read inside :func:`single_process_checkpoint`).
:func:`install` is called by every training run (the CLI and the Python API alike); it
is idempotent.

Example::

    >>> install()
    >>> logging.getLogger("torchrec.distributed.utils").filters[-1].allows(
    ...     "Sharding Type is data_parallel, caching params will be ignored")
    False
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Iterator, Tuple, Type

import torch.distributed as dist

from torchrec_cowclip.compat import FX_TRACING_LOGGER, add_fx_tracing_filter


@dataclass(frozen=True)
class LogNotice:
    """Log records of ``logger`` whose message starts with ``prefix``; ``why`` they say
    nothing to the user."""

    logger: str
    prefix: str
    why: str


@dataclass(frozen=True)
class WarningNotice:
    """``warnings`` of ``category`` attributed to ``module`` (a regular expression, as
    :func:`warnings.filterwarnings` takes it) whose message matches ``message``."""

    category: Type[Warning]
    message: str
    module: str
    why: str


LOG_NOTICES: Tuple[LogNotice, ...] = (
    LogNotice(
        FX_TRACING_LOGGER,
        "is_fx_tracing will return true",
        "torch.fx's own ProxyableClassMeta calls the deprecated check whenever a "
        "KeyedJaggedTensor or KeyedTensor is built; this package asks is_fx_symbolic_tracing()",
    ),
    LogNotice(
        "root",
        "Sharding spec not found for ",
        "TorchRec's planner says it of every data-parallel table, which has no sharding spec",
    ),
    LogNotice(
        "torchrec.distributed.utils",
        "Sharding Type is data_parallel, caching params will be ignored",
        "said of every data-parallel table; the trainer passes no caching parameters",
    ),
    LogNotice(
        "torchrec.distributed.planner.storage_reservations",
        "There is a known issue with TorchRec's dense tensor size calculation in dry run",
        "the trainer's plans are no dry runs: the dense layers exist when the planner sizes them",
    ),
)

#: What ``torch.distributed.checkpoint`` says at every save and load without a process
#: group; :func:`single_process_checkpoint` keeps it from a one-process run's checkpoints.
SINGLE_PROCESS_CHECKPOINT = WarningNotice(
    UserWarning,
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent "
    r"is to (save|load) in a single process",
    r"torch\.distributed\.checkpoint",
    "a one-process run's checkpoint is a single-process one by design",
)

WARNING_NOTICES: Tuple[WarningNotice, ...] = (
    WarningNotice(
        FutureWarning,
        r"`broadcast_buffers` is deprecated",
        r"torchrec\.distributed\.model_parallel",
        "TorchRec's DistributedModelParallel wraps the dense layers in DDP with it",
    ),
    WarningNotice(
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        r"torch\.distributed",
        "TorchRec's collectives call them",
    ),
)


class _Drop(logging.Filter):
    """Drops the records of one logger whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: Tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def allows(self, message: str) -> bool:
        return not message.startswith(self.prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.allows(record.getMessage())


def _drop_filters() -> Tuple[Tuple[str, _Drop], ...]:
    by_logger: dict[str, Tuple[str, ...]] = {}
    for n in LOG_NOTICES:
        by_logger[n.logger] = by_logger.get(n.logger, ()) + (n.prefix,)
    return tuple((name, _Drop(prefixes)) for name, prefixes in by_logger.items())


_FILTERS = _drop_filters()


def install() -> None:
    """Filters :data:`LOG_NOTICES` and :data:`WARNING_NOTICES` (idempotent)."""
    for name, drop in _FILTERS:
        if name == FX_TRACING_LOGGER:
            add_fx_tracing_filter(drop)
        else:
            logger = logging.getLogger() if name == "root" else logging.getLogger(name)
            logger.addFilter(drop)
    for w in WARNING_NOTICES:
        # filterwarnings moves an identical filter to the front instead of adding another.
        warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)


@contextlib.contextmanager
def single_process_checkpoint() -> Iterator[None]:
    """Around a ``torch.distributed.checkpoint`` save or load: without a process group,
    its notice that the checkpoint is a one-process one (it is meant to be) is dropped;
    with one, nothing changes."""
    if dist.is_available() and dist.is_initialized():
        yield
        return
    w = SINGLE_PROCESS_CHECKPOINT
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
        yield

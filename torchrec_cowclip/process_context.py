"""This process's place in its launch, read once from the launcher's environment.

``torchrun`` (and torchx's ``dist.ddp``) name each process's rank, the world size, its
local rank and the processes per machine in ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``, and the job in ``TORCHELASTIC_RUN_ID`` and
``TORCHELASTIC_RESTART_COUNT``. This module is the only one that reads them: a command
resolves a :class:`ProcessContext` once, at its start, and hands it to what needs it
(the run's settings carry it to the trainer, its run directory, its data and its
process group).

Example::

    >>> ctx = ProcessContext.from_environment({"RANK": "1", "WORLD_SIZE": "4",
    ...                                        "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    >>> ctx.is_main, ctx.is_distributed, ctx.nodes
    (False, True, 2)
    >>> ProcessContext.from_environment({}) == ProcessContext()
    True
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from torchrec_cowclip.failures import ConfigError

#: The launcher's variables (torchrun sets them) read as whole numbers.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class ProcessContext:
    """Where this process stands in its launch (a plain run: rank 0 of 1).

    Attributes:
        rank: this process's global rank (``RANK``).
        world_size: the number of processes of the run (``WORLD_SIZE``).
        local_rank: its rank on this machine (``LOCAL_RANK``).
        local_world_size: the processes torchrun started on this machine
            (``LOCAL_WORLD_SIZE``; default: ``world_size``).
        run_id: the elastic job's id (``TORCHELASTIC_RUN_ID``), the same for every rank
            and restart; None outside torchrun.
        restart_count: the elastic agent's attempt (``TORCHELASTIC_RESTART_COUNT``);
            None outside torchrun.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    run_id: Optional[str] = None
    restart_count: Optional[str] = None

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> "ProcessContext":
        """The context the launcher's variables in ``environ`` (default: ``os.environ``)
        describe.

        Raises:
            ConfigError: a launcher's variable that is no whole number, named with its
                value (before anything reads it).
        """
        env = os.environ if environ is None else environ
        for name in LAUNCH_VARIABLES:
            value = env.get(name)
            if value is not None and not value.strip().isdigit():
                raise ConfigError(
                    f"the environment variable {name}={value!r} is not a whole number "
                    "(torchrun sets it; unset it to run one process)"
                )
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))) or world,
            run_id=env.get("TORCHELASTIC_RUN_ID") or None,
            restart_count=env.get("TORCHELASTIC_RESTART_COUNT"),
        )

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run's files and reports."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """More than one process: the run needs a process group."""
        return self.world_size > 1

    @property
    def nodes(self) -> int:
        """The machines of the run (``world_size / local_world_size``, at least 1)."""
        return max(self.world_size // max(self.local_world_size, 1), 1)


#: A plain run: one process, rank 0 (the default of what takes a context).
ONE_PROCESS = ProcessContext()

"""TorchRec's sharding planner as this project runs it: the same planner for the trainer
and for ``torchrec-cowclip plan``, with the CowClip tables' memory counted as the fused
update allocates it.

TorchRec's planner sizes a table's optimizer state as a multiple of its weight bytes
(Adam 2x, row-wise Adagrad ``1 / dim``). The fused CowClip update keeps its state in
float32 whatever the weights' type and one per-row value in every column shard, so for
float16/bfloat16 tables (Adam: 4 bytes of state per 2-byte weight) and for column-sharded
row-wise Adagrad tables that multiple is wrong. :class:`CowClipStorageEstimator` is
TorchRec's storage estimator with the state of the CowClip sharder's tables replaced by
its exact size (:func:`~torchrec_cowclip.embedding.table_batch.storage_bytes`); every
other part of the estimate (weights, input and output buffers, other sharders' tables)
is TorchRec's. :func:`make_planner` builds TorchRec's ``EmbeddingShardingPlanner`` with
it and TorchRec's default storage reservation, and :class:`PlanRecorder` (a TorchRec
``Stats``) keeps what the planner decided and estimated.

Example::

    >>> from torchrec import EmbeddingBagConfig, DataType
    >>> from torchrec_cowclip import CowClipEmbeddingBagCollection, CowClipOptions
    >>> from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder
    >>> ebc = CowClipEmbeddingBagCollection(
    ...     [EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=1_000_000,
    ...                         feature_names=["f"], data_type=DataType.FP16)],
    ...     options=CowClipOptions(optimizer="adam"), device="meta")
    >>> recorder = PlanRecorder()
    >>> planner = make_planner(planner_topology(2, "cuda", hbm_bytes=8 << 30), 512,
    ...     constraints={"t": ParameterConstraints(sharding_types=["table_wise"])},
    ...     stats=[recorder])
    >>> plan = planner.plan(ebc, [CowClipEmbeddingBagCollectionSharder(module_type=type(ebc))])
    >>> shard = recorder.best_plan[0].shards[0]
    >>> shard_bytes(shard.size, torch.float16, "adam")   # fp16 weights, float32 moments
    (32000000, 128000000)
    >>> shard.storage.hbm >= 160_000_000   # TorchRec's multiple would say 96,000,000
    True
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import (
    KernelConfig,
    ParameterConstraints,
    SharderDataMap,
    ShardingOption,
    Stats,
    Storage,
    Topology,
    TopologyFactory,
    TrainerConfig,
)

from torchrec_cowclip import compat
from torchrec_cowclip.distributed.sharder import planned_optimizer
from torchrec_cowclip.embedding.table_batch import storage_bytes

__all__ = [
    "RESERVED_SHARE",
    "CowClipStorageEstimator",
    "PlanRecorder",
    "make_planner",
    "planner_topology",
    "shard_bytes",
]

#: The share of each device's HBM TorchRec's planner keeps free by default (its
#: ``HeuristicalStorageReservation`` percentage), on top of 6x the dense parameters and
#: 20 batches of input ids.
RESERVED_SHARE = 0.15


def shard_bytes(size: Sequence[int], dtype: torch.dtype, optimizer: str) -> Tuple[int, int]:
    """``(weight bytes, optimizer-state bytes)`` of a shard of ``size = [rows, columns]``
    of a table stored as ``dtype`` and trained with ``optimizer`` by the fused update."""
    return storage_bytes(int(size[0]), int(size[1]), dtype, optimizer)


class CowClipStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's ``EmbeddingStorageEstimator`` with the optimizer state of the CowClip
    sharder's tables counted as the fused update allocates it (see the module docstring).

    Args: those of ``EmbeddingStorageEstimator`` (``topology``, ``constraints``, ...).
    """

    def __init__(self, topology: Topology, *args: Any, **kwargs: Any) -> None:
        super().__init__(topology, *args, **kwargs)
        # The fused kernel keeps a table where its weights are: HBM on a GPU, else DDR.
        self._state_in_hbm = topology.compute_device in ("cuda", "mtia")

    def estimate(
        self, sharding_options: List[ShardingOption], sharder_data_map: SharderDataMap
    ) -> None:
        ours = [o for o in sharding_options if planned_optimizer(o.tensor) is not None]
        # TorchRec's part without its multiple of the state; the exact state is added.
        with compat.optimizer_marks_hidden(o.tensor for o in ours):
            super().estimate(sharding_options, sharder_data_map)
        for option in ours:
            optimizer = str(planned_optimizer(option.tensor))
            for shard in option.shards:
                _, state = shard_bytes(shard.size, option.tensor.dtype, optimizer)
                extra = Storage(
                    hbm=state if self._state_in_hbm else 0,
                    ddr=0 if self._state_in_hbm else state,
                    ssd=0,
                )
                shard.storage = extra if shard.storage is None else shard.storage + extra


class PlanRecorder(Stats):
    """A TorchRec planner ``Stats`` that keeps the planner's outcome instead of logging it:
    the chosen sharding options with each shard's rank, storage and perf estimates
    (after a failed search: the last proposal, its shards without ranks), the search's
    size and time, and each device's storage left for the tables after TorchRec's
    storage reservation (``reserved_topology``)."""

    def __init__(self) -> None:
        self.best_plan: List[ShardingOption] = []
        self.num_proposals = 0
        self.num_plans = 0
        self.run_time_s = 0.0
        self.reserved_topology: Optional[Topology] = None

    def log(
        self,
        sharding_plan: Any,
        topology: Topology,
        batch_size: int,
        storage_reservation: Any,
        num_proposals: int,
        num_plans: int,
        run_time: float,
        best_plan: List[ShardingOption],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.best_plan = list(best_plan)
        self.num_proposals, self.num_plans = int(num_proposals), int(num_plans)
        self.run_time_s = float(run_time)
        self.reserved_topology = getattr(storage_reservation, "last_reserved_topology", None)


def planner_topology(
    world_size: int,
    compute_device: str,
    local_world_size: Optional[int] = None,
    hbm_bytes: Optional[int] = None,
    ddr_bytes: Optional[int] = None,
) -> Topology:
    """TorchRec's ``Topology`` of ``world_size`` devices, ``local_world_size`` per host
    (None: all on one), with ``hbm_bytes`` / ``ddr_bytes`` each (None: TorchRec's
    defaults, 32 GiB and 128 GiB), built by TorchRec's ``TopologyFactory``."""
    return TopologyFactory.create_topology(
        TrainerConfig(
            world_size=world_size,
            local_world_size=local_world_size,
            hbm_cap_bytes=hbm_bytes,
            ddr_cap_bytes=ddr_bytes,
        ),
        kernel_config=KernelConfig(compute_device=compute_device),
    )


def _storage_reservation() -> HeuristicalStorageReservation:
    # TorchRec's planner default. Its construction warns that it over-estimates the dense
    # layers of a dry run (tensors on the meta device): here only the tables are on meta.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="HeuristicalStorageReservation is known", category=FutureWarning
        )
        return HeuristicalStorageReservation(percentage=RESERVED_SHARE)


def make_planner(
    topology: Topology,
    batch_size: int,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    stats: Optional[List[Stats]] = None,
) -> EmbeddingShardingPlanner:
    """TorchRec's ``EmbeddingShardingPlanner`` for ``topology`` and a per-rank
    ``batch_size``, as TorchRec builds it by default but for the storage estimator
    (:class:`CowClipStorageEstimator`); ``stats`` replace TorchRec's stats table (None:
    TorchRec's ``EmbeddingStats``, which logs it)."""
    estimators = [
        EmbeddingPerfEstimator(topology=topology, constraints=constraints),
        CowClipStorageEstimator(topology=topology, constraints=constraints),
    ]
    return EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        enumerator=EmbeddingEnumerator(
            topology=topology, batch_size=batch_size, constraints=constraints, estimator=estimators
        ),
        storage_reservation=_storage_reservation(),
        constraints=constraints,
        stats=stats,
    )

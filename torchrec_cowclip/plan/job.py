"""A sharded job's plan before its launch: TorchRec's planner, run on this machine with the
model, sharder and planner the trainer would use (:func:`~torchrec_cowclip.distributed.planning.make_planner`),
for N devices of a given memory.

The model is built as ``train`` builds it, its tables on the meta device (nothing is
allocated, so a plan for Criteo 1TB runs on a laptop); the CowClip sharder tells the
planner each table's optimizer state, which its storage estimator counts as the fused
update allocates it. The plan says per table its sharding type and ranks, per rank the
bytes of table weights and optimizer state it will hold, whether the job fits the
devices, and the planner's own estimates (per-rank storage with input and output
buffers, per-rank step time, the memory TorchRec reserves). A job that does not fit is
planned again on more devices, to name the smallest world size that fits.

Example::

    >>> spec = JobSpec(model="dcn", optimizer="rowwise_adagrad", batch_size=512,
    ...                world_size=2, local_world_size=2, compute_device="cpu",
    ...                hbm_bytes=0, ddr_bytes=1 << 30,
    ...                model_arguments=dict(num_dense=1, sparse_names=["a", "b"],
    ...                                     cardinalities=[100_000, 10], embedding_dim=8,
    ...                                     hidden=[16]))
    >>> plan = plan_job(spec)
    >>> plan.table_bytes   # 100,010 rows of 4 x (8 + 1) weight bytes and 2 x 4 state bytes
    4400440
    >>> plan.fits, [r.rank for r in plan.ranks], sum(r.bytes for r in plan.ranks) >= 4400440
    (True, [0, 1], True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.plan.tables import TableSpec, check_names

__all__ = [
    "DEFAULT_HEADROOM",
    "JobPlan",
    "JobPlanner",
    "JobSpec",
    "PlanError",
    "RankPlan",
    "ShardPlan",
    "TablePlan",
    "format_bytes",
    "plan_job",
    "world_size_candidates",
]

#: The share of each device's usable memory (after TorchRec's reservation) a rank should
#: leave free for what the plan does not count (activations, the dense optimizer, the
#: allocator's fragmentation); a rank with less is reported "fits, tight".
DEFAULT_HEADROOM = 0.10
#: Planner runs the search for the smallest world size that fits makes at most.
MAX_SEARCH_PLANS = 24
#: The largest world size that search considers.
MAX_WORLD_SIZE = 1 << 16
_PERF_FIELDS = ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "input_dist_comms")


class PlanError(ConfigError):
    """A plan that cannot be made from these arguments (one line naming the flag or table)."""


@dataclass(frozen=True)
class JobSpec:
    """What is planned: the model (``build_model``'s name and arguments, as ``train``
    builds it), the tables' optimizer, the global batch and the devices.

    Attributes:
        model: ``--model``.
        model_arguments: ``build_model``'s keyword arguments (the tables' names, sizes,
            dim and storage type among them); the tables are built on the meta device.
        optimizer: the tables' update rule (``--embedding-optimizer``).
        batch_size: the global batch; each rank takes ``batch_size / world_size``.
        world_size: devices (processes) of the job.
        local_world_size: devices per host.
        compute_device: ``"cuda"`` (tables in HBM) or ``"cpu"`` (tables in DDR).
        hbm_bytes, ddr_bytes: each device's memory.
        sharding: ``auto`` (the planner chooses per table) or one sharding type for all.
        tables: a list of tables to plan by themselves (``model`` is then ``"tables"``
            and ``model_arguments`` empty): a :class:`~torchrec_cowclip.plan.tables.TableSpec`
            each, its sharding constraint and pooling factor honoured.
        constraints: table name -> the one sharding type the planner may give it (over
            ``sharding`` and a table's own).
        headroom: the share of each device's usable memory a rank should leave free;
            less is "fits, tight" (:attr:`JobPlan.tight_ranks`).
    """

    model: str
    model_arguments: Mapping[str, Any]
    optimizer: str
    batch_size: int
    world_size: int
    local_world_size: int
    compute_device: str
    hbm_bytes: int
    ddr_bytes: int
    sharding: str = "auto"
    tables: Tuple[TableSpec, ...] = ()
    constraints: Mapping[str, str] = field(default_factory=dict)
    headroom: float = DEFAULT_HEADROOM

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        check_names(self.tables, "the table list")
        if not (math.isfinite(self.headroom) and 0 <= self.headroom < 1):
            raise PlanError(f"--headroom must be in [0, 1), got {self.headroom:g}")

    @classmethod
    def of_tables(cls, tables: Sequence[TableSpec], **job: Any) -> "JobSpec":
        """A job planning ``tables`` alone (a user's own; no model is built); ``job``: the
        other fields (``optimizer``, ``batch_size``, ``world_size``, ...)."""
        return cls(model="tables", model_arguments={}, tables=tuple(tables), **job)

    @property
    def device_bytes(self) -> int:
        """The memory the tables live in, per device: HBM on CUDA, else DDR."""
        return self.hbm_bytes if self.compute_device == "cuda" else self.ddr_bytes

    @property
    def embedding_dtype(self) -> str:
        """The tables' storage type (``"fp16/fp32"`` for a table list of several)."""
        if self.tables:
            return "/".join(sorted({t.dtype for t in self.tables}))
        return str(self.model_arguments.get("embedding_dtype", "fp32"))

    def table_shardings(self, table_names: Sequence[str]) -> Dict[str, str]:
        """Each constrained table's one sharding type: ``constraints``, else the table's
        own (a table list's), else ``sharding`` unless it is ``auto``.

        Raises:
            PlanError: a constraint naming no table.
        """
        unknown = sorted(set(self.constraints) - set(table_names))
        if unknown:
            known = ", ".join(table_names[:6]) + (", ..." if len(table_names) > 6 else "")
            raise PlanError(f"--constrain {unknown[0]}: no such table; the tables: {known}")
        own = {t.name: t.sharding for t in self.tables if t.sharding}
        shardings = {}
        for name in table_names:
            chosen = self.constraints.get(name) or own.get(name)
            if chosen is None and self.sharding != "auto":
                chosen = self.sharding
            if chosen is not None:
                shardings[name] = chosen
        return shardings

    @property
    def hosts(self) -> int:
        return max(self.world_size // self.local_world_size, 1)

    def on(self, world_size: int, local_world_size: int) -> "JobSpec":
        """The same job on ``world_size`` devices, ``local_world_size`` per host."""
        return replace(self, world_size=world_size, local_world_size=local_world_size)


@dataclass(frozen=True)
class ShardPlan:
    """One shard: where it is, its rows and columns, its bytes (exact) and the planner's
    estimates (its storage with its input/output buffers, its time per step in ms)."""

    rank: int
    rows: int
    cols: int
    row_offset: int
    col_offset: int
    weights_bytes: int
    optimizer_bytes: int
    planner_bytes: int
    perf_ms: Mapping[str, float]


@dataclass(frozen=True)
class TablePlan:
    """One table and how it is sharded."""

    name: str
    rows: int
    dim: int
    dtype: str
    sharding: str
    compute_kernel: str
    weights_bytes: int  # one copy of the whole table (a data-parallel one has a copy per rank)
    optimizer_bytes: int
    shards: Tuple[ShardPlan, ...]

    @property
    def ranks(self) -> List[int]:
        """The ranks of its shards, in shard order (every rank for a data-parallel table)."""
        return [s.rank for s in self.shards]

    def to_json(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "rows": self.rows,
            "dim": self.dim,
            "dtype": self.dtype,
            "sharding": self.sharding,
            "compute_kernel": self.compute_kernel,
            "ranks": self.ranks,
            "weights_bytes": self.weights_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "shards": [
                {
                    "rank": s.rank,
                    "rows": s.rows,
                    "cols": s.cols,
                    "row_offset": s.row_offset,
                    "col_offset": s.col_offset,
                    "weights_bytes": s.weights_bytes,
                    "optimizer_bytes": s.optimizer_bytes,
                    "planner_bytes": s.planner_bytes,
                    "perf_ms": dict(s.perf_ms),
                }
                for s in self.shards
            ],
        }


@dataclass(frozen=True)
class RankPlan:
    """One rank's share: its table weights and optimizer state (exact), and the planner's
    estimates: its storage with input/output buffers, and its time per step in ms."""

    rank: int
    weights_bytes: int
    optimizer_bytes: int
    planner_bytes: int
    perf_ms: Mapping[str, float]

    @property
    def bytes(self) -> int:
        """Table weights plus optimizer state on this rank."""
        return self.weights_bytes + self.optimizer_bytes

    @property
    def step_ms(self) -> float:
        """The planner's estimate of this rank's embedding time per step."""
        return float(sum(v for k, v in self.perf_ms.items() if k != "input_dist_comms"))


@dataclass
class JobPlan:
    """The planner's answer for one :class:`JobSpec`.

    Attributes:
        spec: what was planned.
        fits: whether the planner placed every shard within each device's usable memory.
        tables, ranks: the plan (empty when it does not fit).
        table_bytes: weights plus optimizer state of one copy of every table.
        usable_bytes: each device's memory less TorchRec's storage reservation (None
            when the reservation alone exceeds the device).
        proposals, plans, run_time_s: the planner's search.
        error: the planner's reason when it does not fit (its first line).
        smallest_world_size: when it does not fit, the smallest world size that does
            (None: none up to the search's limit; see ``searched``).
        searched: the world sizes planned in that search, in order.
        constraints: each constrained table's one sharding type.
    """

    spec: JobSpec
    fits: bool
    tables: List[TablePlan]
    ranks: List[RankPlan]
    table_bytes: int
    largest_table: Tuple[str, int]
    usable_bytes: Optional[int]
    proposals: int = 0
    plans: int = 0
    run_time_s: float = 0.0
    error: Optional[str] = None
    smallest_world_size: Optional[int] = None
    searched: List[int] = field(default_factory=list)
    constraints: Dict[str, str] = field(default_factory=dict)

    @property
    def largest_rank(self) -> Optional[RankPlan]:
        """The rank holding the most table and state bytes (None without a plan)."""
        return max(self.ranks, key=lambda r: (r.bytes, -r.rank)) if self.ranks else None

    @property
    def headroom_bytes(self) -> Optional[int]:
        """The bytes a rank should leave free: ``spec.headroom`` of the usable memory."""
        return None if self.usable_bytes is None else int(self.spec.headroom * self.usable_bytes)

    def free_bytes(self, rank: RankPlan) -> int:
        """What ``rank`` leaves free of the usable memory, after the planner's estimate of
        its storage (its tables, state and input/output buffers)."""
        assert self.usable_bytes is not None
        return self.usable_bytes - rank.planner_bytes

    @property
    def tight_ranks(self) -> List[RankPlan]:
        """The ranks of a plan that fits leaving less than the headroom free, fullest first."""
        if not self.fits or self.headroom_bytes is None:
            return []
        tight = [r for r in self.ranks if self.free_bytes(r) < self.headroom_bytes]
        return sorted(tight, key=self.free_bytes)

    @property
    def reserved_bytes(self) -> Optional[int]:
        """What TorchRec's storage reservation keeps of each device."""
        return None if self.usable_bytes is None else self.spec.device_bytes - self.usable_bytes

    def to_json(self) -> Dict[str, Any]:
        spec = self.spec
        largest = self.largest_rank
        return {
            "fits": self.fits,
            "tables": [t.to_json() for t in self.tables],
            "ranks": [
                {
                    "rank": r.rank,
                    "bytes": r.bytes,
                    "weights_bytes": r.weights_bytes,
                    "optimizer_bytes": r.optimizer_bytes,
                    "planner_bytes": r.planner_bytes,
                    "perf_ms": dict(r.perf_ms),
                }
                for r in self.ranks
            ],
            "largest_rank": None if largest is None else largest.rank,
            "largest_rank_bytes": None if largest is None else largest.bytes,
            "table_bytes": self.table_bytes,
            "largest_table": {"name": self.largest_table[0], "bytes": self.largest_table[1]},
            "model": spec.model,
            "embedding_dim": spec.model_arguments.get("embedding_dim"),
            "embedding_dtype": spec.embedding_dtype,
            "optimizer": spec.optimizer,
            "batch_size": spec.batch_size,
            "world_size": spec.world_size,
            "nproc_per_node": spec.local_world_size,
            "compute_device": spec.compute_device,
            "device_bytes": spec.device_bytes,
            "usable_bytes": self.usable_bytes,
            "reserved_bytes": self.reserved_bytes,
            "sharding": spec.sharding,
            "constraints": dict(self.constraints),
            "headroom": spec.headroom,
            "headroom_bytes": self.headroom_bytes,
            "tight": bool(self.tight_ranks),
            "tight_ranks": [
                {"rank": r.rank, "free_bytes": self.free_bytes(r)} for r in self.tight_ranks
            ],
            "planner": {
                "proposals": self.proposals,
                "plans": self.plans,
                "run_time_s": round(self.run_time_s, 3),
                "max_rank_step_ms": max((r.step_ms for r in self.ranks), default=None),
                "error": self.error,
            },
            "smallest_world_size": spec.world_size if self.fits else self.smallest_world_size,
            "searched_world_sizes": list(self.searched),
        }


def format_bytes(count: int) -> str:
    """``count`` bytes in B, KiB, MiB or GiB (powers of 2, as TorchRec's planner counts).

    Example::

        >>> format_bytes(512), format_bytes(3 << 20), format_bytes(91_107_468_800)
        ('512 B', '3.00 MiB', '84.85 GiB')
    """
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.2f} {unit}"
    return f"{count} B"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _perf(perf: Any) -> Dict[str, float]:
    return {name: float(getattr(perf, name, 0.0) or 0.0) for name in _PERF_FIELDS}


class JobPlanner:
    """The job's model (tables on the meta device) and sharder, built once and planned
    for any number of devices."""

    def __init__(self, spec: JobSpec) -> None:
        import torch

        from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder
        from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
        from torchrec_cowclip.embedding.table_batch import storage_bytes, storage_dtype
        from torchrec_cowclip.models import build_model
        from torchrec_cowclip.models.task import CTRTrainTask
        from torchrec_cowclip.optim.options import CowClipOptions

        options = CowClipOptions(optimizer=spec.optimizer)
        if spec.tables:
            # The user's own tables, alone: their model is theirs, its dense part unknown.
            ebc = CowClipEmbeddingBagCollection(
                [t.config() for t in spec.tables], options=options, device="meta"
            )
            self.module: torch.nn.Module = ebc
        else:
            model = build_model(
                spec.model,
                **dict(spec.model_arguments),
                table_device="meta",
                embedding_options=options,
            )
            ebc = model.embedding_collection
            self.module = CTRTrainTask(model)
        self.sharders: List[Any] = [CowClipEmbeddingBagCollectionSharder(module_type=type(ebc))]
        self.configs = list(ebc.embedding_bag_configs())
        self.table_names = [t.name for t in self.configs]
        self._dtypes: Dict[str, torch.dtype] = {
            t.name: storage_dtype(t.data_type) for t in self.configs
        }
        self.sizes = {
            t.name: sum(
                storage_bytes(
                    t.num_embeddings, t.embedding_dim, self._dtypes[t.name], spec.optimizer
                )
            )
            for t in self.configs
        }
        self.table_bytes = sum(self.sizes.values())
        self.largest_table = max(self.sizes.items(), key=lambda kv: kv[1])

    def check_whole_tables_fit(self, spec: JobSpec) -> None:
        """Refuses (:class:`PlanError`) a table larger than a device when ``spec``'s
        sharding keeps every table whole on one device (``table_wise``,
        ``data_parallel``): no number of devices would fit it."""
        shardings = spec.table_shardings(self.table_names)
        for t in self.configs:
            sharding = shardings.get(t.name)
            # Row and column shards split a table over devices; these keep it whole.
            if (
                sharding in ("table_wise", "data_parallel")
                and self.sizes[t.name] > spec.device_bytes
            ):
                how = (
                    f"--sharding {sharding}"
                    if spec.sharding == sharding and t.name not in spec.constraints
                    else f"its constraint {sharding}"
                )
                raise PlanError(
                    f"table {t.name} ({t.num_embeddings:,} rows x {t.embedding_dim}, "
                    f"{str(t.data_type.value).lower()} with {spec.optimizer} "
                    f"state: {format_bytes(self.sizes[t.name])}) is larger than every device "
                    f"({format_bytes(spec.device_bytes)}) and {how} keeps it whole on one: "
                    "give --sharding auto or row_wise (--constrain TABLE=row_wise), devices "
                    "with more memory, or fewer rows (--hash-size)"
                )

    def constraints(self, spec: JobSpec) -> Optional[Dict[str, Any]]:
        """TorchRec's ``ParameterConstraints`` per table: its one sharding type
        (:meth:`JobSpec.table_shardings`) and a table list's pooling factors (None: none)."""
        from torchrec.distributed.planner.types import ParameterConstraints

        shardings = spec.table_shardings(self.table_names)
        pooling = {t.name: t.pooling_factor for t in spec.tables if t.pooling_factor}
        constraints = {}
        for name in self.table_names:
            kwargs: Dict[str, Any] = {}
            if name in shardings:
                kwargs["sharding_types"] = [shardings[name]]
            if name in pooling:
                kwargs["pooling_factors"] = [float(pooling[name])]
            if kwargs:
                constraints[name] = ParameterConstraints(**kwargs)
        return constraints or None

    def plan(self, spec: JobSpec, stats: Sequence[Any] = ()) -> JobPlan:
        """Runs TorchRec's planner for ``spec``'s devices (``stats``: more TorchRec
        ``Stats`` to give the planner, e.g. its ``EmbeddingStats`` table)."""
        from torchrec.distributed.planner.types import PlannerError

        from torchrec_cowclip.distributed.planning import (
            PlanRecorder,
            make_planner,
            planner_topology,
        )

        topology = planner_topology(
            spec.world_size,
            spec.compute_device,
            spec.local_world_size,
            hbm_bytes=spec.hbm_bytes if spec.compute_device == "cuda" else None,
            ddr_bytes=spec.ddr_bytes,
        )
        recorder = PlanRecorder()
        planner = make_planner(
            topology,
            spec.batch_size // spec.world_size,
            self.constraints(spec),
            stats=[recorder, *stats],
        )
        plan = JobPlan(
            spec,
            fits=False,
            tables=[],
            ranks=[],
            table_bytes=self.table_bytes,
            largest_table=self.largest_table,
            usable_bytes=None,
            constraints=spec.table_shardings(self.table_names),
        )
        try:
            planner.plan(self.module, self.sharders)
            plan.fits = True
        except PlannerError as e:
            plan.error = _first_line(e)
        plan.proposals, plan.plans = recorder.num_proposals, recorder.num_plans
        plan.run_time_s = recorder.run_time_s
        reserved = recorder.reserved_topology
        if reserved is not None:
            storage = reserved.devices[0].storage
            plan.usable_bytes = int(storage.hbm if spec.compute_device == "cuda" else storage.ddr)
        if plan.fits:
            self._fill(plan, recorder.best_plan)
        return plan

    def _fill(self, plan: JobPlan, options: Sequence[Any]) -> None:
        from torchrec_cowclip.distributed.planning import shard_bytes
        from torchrec_cowclip.distributed.sharder import planned_optimizer

        spec = plan.spec
        tier = "hbm" if spec.compute_device == "cuda" else "ddr"
        per_rank: Dict[int, List[ShardPlan]] = {r: [] for r in range(spec.world_size)}
        by_name = {t.name: t for t in self.configs}
        for option in options:
            dtype = self._dtypes[option.name]
            optimizer = planned_optimizer(option.tensor) or spec.optimizer
            shards = []
            for shard in option.shards:
                weights, state = shard_bytes(shard.size, dtype, optimizer)
                planned = ShardPlan(
                    rank=int(shard.rank),
                    rows=int(shard.size[0]),
                    cols=int(shard.size[1]),
                    row_offset=int(shard.offset[0]),
                    col_offset=int(shard.offset[1]),
                    weights_bytes=weights,
                    optimizer_bytes=state,
                    planner_bytes=int(getattr(shard.storage, tier)),
                    perf_ms=_perf(shard.perf),
                )
                shards.append(planned)
                per_rank[planned.rank].append(planned)
            config = by_name[option.name]
            weights, state = shard_bytes(
                (config.num_embeddings, config.embedding_dim), dtype, optimizer
            )
            plan.tables.append(
                TablePlan(
                    name=option.name,
                    rows=int(config.num_embeddings),
                    dim=int(config.embedding_dim),
                    dtype=str(dtype).removeprefix("torch."),
                    sharding=str(option.sharding_type),
                    compute_kernel=str(option.compute_kernel),
                    weights_bytes=weights,
                    optimizer_bytes=state,
                    shards=tuple(shards),
                )
            )
        order = {name: i for i, name in enumerate(self.table_names)}
        plan.tables.sort(key=lambda t: order[t.name])
        plan.ranks = [
            RankPlan(
                rank=r,
                weights_bytes=sum(s.weights_bytes for s in shards),
                optimizer_bytes=sum(s.optimizer_bytes for s in shards),
                planner_bytes=sum(s.planner_bytes for s in shards),
                perf_ms={k: sum(s.perf_ms[k] for s in shards) for k in _PERF_FIELDS},
            )
            for r, shards in per_rank.items()
        ]


def world_size_candidates(
    spec: JobSpec, per_host: Optional[int], start: int, limit: int = MAX_WORLD_SIZE
) -> List[int]:
    """World sizes from ``start`` up to ``limit`` that a job like ``spec`` can launch with:
    the global batch divides evenly over them, and with ``per_host`` devices per host
    (None: any number on one host) they fill whole hosts (or part of one).

    Example::

        >>> spec = JobSpec("dlrm", {}, "adam", 4096, 8, 8, "cuda", 80 << 30, 0)
        >>> world_size_candidates(spec, per_host=8, start=5, limit=64)
        [8, 16, 32, 64]
    """
    found = []
    for n in range(max(start, 1), limit + 1):
        if spec.batch_size % n:
            continue
        if per_host is not None and n > per_host and n % per_host:
            continue
        found.append(n)
    return found


def smallest_fitting(
    planner: JobPlanner, plan: JobPlan, per_host: Optional[int]
) -> Tuple[Optional[int], List[int]]:
    """The smallest world size above ``plan``'s at which the job fits, and the world
    sizes tried. The search starts where the devices' memory could hold one copy of
    every table and its state, and plans at most :data:`MAX_SEARCH_PLANS` sizes."""
    spec = plan.spec
    if spec.sharding == "data_parallel":
        return None, []  # every device holds every table: more devices never fit more
    start = max(spec.world_size + 1, math.ceil(plan.table_bytes / max(spec.device_bytes, 1)))
    tried: List[int] = []
    for n in world_size_candidates(spec, per_host, start):
        if len(tried) >= MAX_SEARCH_PLANS:
            break
        tried.append(n)
        local = n if per_host is None else min(n, per_host)
        if planner.plan(spec.on(n, local)).fits:
            return n, tried
    return None, tried


def plan_job(spec: JobSpec, per_host: Optional[int] = None, stats: Sequence[Any] = ()) -> JobPlan:
    """Plans ``spec``; if it does not fit, also finds the smallest world size that does
    (:func:`smallest_fitting`, with ``per_host`` devices per host).

    Raises:
        PlanError: a table larger than a device that the sharding keeps whole.
    """
    planner = JobPlanner(spec)
    planner.check_whole_tables_fit(spec)
    plan = planner.plan(spec, stats)
    if not plan.fits:
        plan.smallest_world_size, plan.searched = smallest_fitting(planner, plan, per_host)
    return plan

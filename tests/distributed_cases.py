"""Worker functions of the distributed tests (run in spawned ranks by distributed_harness).

Each scenario trains a DistributedModelParallel model sharded by the CowClip sharder on
a sequence of global batches (rank r gets samples [r*B, (r+1)*B) and minimises the mean
loss of its local samples), and, on rank 0, the unsharded CowClipEmbeddingBagCollection
on the whole global batch with the mean loss over the global batch: the gradients of the
two are equal (TorchRec's gradient division / the data-parallel union average), so the
weights, optimizer states and clip counts must be too. Results are written to files for
the test process to assert on.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from cowclip_testing import kjt_from_bags, mixed_scale_weights
from distributed_harness import save_result
from tiny import bag_config
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection, Helen
from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder
from torchrec_cowclip.optim.options import CowClipOptions

HYPER = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)


@dataclass
class Scenario:
    """A model, its plan, and how it is trained."""

    tables: List[EmbeddingBagConfig]
    plan: Optional[Dict[str, Tuple[str, List[int]]]]  # table -> (type, ranks); None: planner
    optimizer: str = "adam"
    cowclip: Optional[CowClip] = CowClip(r=1.0, zeta=1e-3)
    unclipped: Tuple[str, ...] = ()
    steps: int = 3
    local_batch: int = 4
    seed: int = 0
    max_len: int = 4
    cowclip_module: bool = False  # shard a CowClipEmbeddingBagCollection
    weights: Optional[Dict[str, Tensor]] = None  # initial weights (default: mixed scales)
    hyper: Dict[str, Any] = field(default_factory=lambda: dict(HYPER))
    batches: Optional[List[Any]] = None  # explicit global batches (bags, weights, upstream)
    weighted: bool = False  # per-sample weights on every feature
    constraints: Optional[Dict[str, List[str]]] = None  # planner: allowed types per table
    sharder_options: Dict[str, Any] = field(default_factory=dict)  # for cowclip_module
    helen: Optional[Helen] = None  # train with Helen's two-pass step (a curved loss)


class Model(nn.Module):
    """Just the collection: the loss is built from its pooled outputs by key."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor) -> Any:
        return self.ebc(kjt)


# --- data -------------------------------------------------------------------------------


def initial_weights(s: Scenario) -> Dict[str, Tensor]:
    if s.weights is not None:
        return s.weights
    gen = torch.Generator().manual_seed(1000 + s.seed)
    return {t.name: mixed_scale_weights(t.num_embeddings, t.embedding_dim, gen) for t in s.tables}


def global_batches(s: Scenario, world: int, steps: int) -> List[Tuple[Any, Any, Dict[str, Tensor]]]:
    """Per step: the global batch's bags per feature, their per-sample weights (None
    unless ``s.weighted``) and the upstream gradient per output key."""
    if s.batches is not None:
        return s.batches[:steps]
    gen = torch.Generator().manual_seed(s.seed)
    rows = {f: t.num_embeddings for t in s.tables for f in t.feature_names}
    batch = world * s.local_batch
    out = []
    for _ in range(steps):
        bags, weights = {}, {}
        for f, n in rows.items():
            lengths = torch.randint(0, s.max_len + 1, (batch,), generator=gen).tolist()
            hi = min(n, 3 * s.max_len + 3)
            bags[f] = [torch.randint(0, hi, (k,), generator=gen).tolist() for k in lengths]
            weights[f] = [(torch.rand(k, generator=gen) * 2).tolist() for k in lengths]
        upstream = {}
        for key, dim in _output_dims(s.tables).items():
            upstream[key] = torch.randn(batch, dim, generator=gen)
        out.append((bags, weights if s.weighted else None, upstream))
    return out


def _output_dims(tables: Sequence[EmbeddingBagConfig]) -> Dict[str, int]:
    count: Dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            count[f] = count.get(f, 0) + 1
    dims = {}
    for t in tables:
        for f in t.feature_names:
            dims[f if count[f] == 1 else f"{f}@{t.name}"] = t.embedding_dim
    return dims


def local_slice(batch, rank: int, b: int):
    """Rank ``rank``'s samples of a global batch."""
    bags, weights, upstream = batch
    lo, hi = rank * b, (rank + 1) * b
    return (
        {f: v[lo:hi] for f, v in bags.items()},
        None if weights is None else {f: v[lo:hi] for f, v in weights.items()},
        {k: u[lo:hi] for k, u in upstream.items()},
    )


def mean_loss(outputs: Dict[str, Tensor], upstream: Dict[str, Tensor]) -> Tensor:
    """Mean over the samples of sum_k <out_k, u_k>: each rank's local mean loss."""
    batch = next(iter(upstream.values())).shape[0]
    return sum((outputs[k] * u).sum() for k, u in upstream.items()) / batch


def curved_mean_loss(outputs: Dict[str, Tensor], upstream: Dict[str, Tensor]) -> Tensor:
    """:func:`mean_loss` plus half the squared outputs, so that the gradient depends on
    the weights (Helen's second pass differs from its first)."""
    batch = next(iter(upstream.values())).shape[0]
    square = sum(0.5 * outputs[k].square().sum() for k in upstream)
    return mean_loss(outputs, upstream) + square / batch


def _step(module: nn.Module, s: Scenario, forward: Any, upstream: Dict[str, Tensor]) -> None:
    """One training step: one backward, or Helen's two passes through ``helen_step``."""
    if s.helen is None:
        mean_loss(forward(), upstream).backward()
    else:
        module.helen_step(lambda: curved_mean_loss(forward(), upstream))


# --- building -----------------------------------------------------------------------------


def sharder_for(s: Scenario) -> CowClipEmbeddingBagCollectionSharder:
    if s.cowclip_module:
        return CowClipEmbeddingBagCollectionSharder(
            module_type=CowClipEmbeddingBagCollection, **s.sharder_options
        )
    return CowClipEmbeddingBagCollectionSharder(
        options=CowClipOptions(
            optimizer=s.optimizer,
            cowclip=s.cowclip,
            unclipped_tables=s.unclipped,
            helen=s.helen,
            **s.hyper,
        )
    )


def unsharded(s: Scenario, device: str = "cpu") -> CowClipEmbeddingBagCollection:
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in s.tables],
        is_weighted=s.weighted,
        device=device,
        options=CowClipOptions(
            optimizer=s.optimizer,
            cowclip=s.cowclip,
            unclipped_tables=s.unclipped,
            helen=s.helen,
            **s.hyper,
        ),
    )
    with torch.no_grad():
        for name, w in initial_weights(s).items():
            ebc.embedding_bags[name].weight.copy_(w)
    return ebc


def plan_for(s: Scenario, module: nn.Module, sharder, world: int) -> ShardingPlan:
    generators = {}
    for name, (kind, ranks) in s.plan.items():
        if kind == ShardingType.TABLE_WISE.value:
            generators[name] = table_wise(rank=ranks[0], compute_kernel="fused")
        elif kind in (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value):
            generators[name] = column_wise(ranks=ranks, compute_kernel="fused")
        elif kind == ShardingType.DATA_PARALLEL.value:
            generators[name] = data_parallel()
        elif kind == ShardingType.ROW_WISE.value:
            generators[name] = row_wise(compute_kernel="fused")
        elif kind == ShardingType.TABLE_ROW_WISE.value:
            generators[name] = table_row_wise(host_index=0)
        else:
            raise ValueError(kind)
    module_plan = construct_module_sharding_plan(
        module, generators, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    for name, (kind, _) in s.plan.items():
        if kind == ShardingType.TABLE_COLUMN_WISE.value:
            # TorchRec has no plan helper for table_column_wise; within one host it is
            # a column-wise plan under another name.
            module_plan[name] = replace(module_plan[name], sharding_type=kind)
    return ShardingPlan(plan={"ebc": module_plan})


def sharded_model(s: Scenario, world: int, load_initial: bool = True) -> DistributedModelParallel:
    if s.cowclip_module:
        ebc: nn.Module = unsharded(s)
    else:
        ebc = EmbeddingBagCollection(
            tables=[replace(t) for t in s.tables],
            is_weighted=s.weighted,
            device=torch.device("meta"),
        )
    sharder = sharder_for(s)
    model = Model(ebc)
    if s.plan is not None:
        plan: Optional[ShardingPlan] = plan_for(s, ebc, sharder, world)
    elif s.constraints is not None:
        plan = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu"),
            constraints={
                t: ParameterConstraints(sharding_types=k) for t, k in s.constraints.items()
            },
        ).collective_plan(model, [sharder], dist.group.WORLD)
    else:
        plan = None  # DistributedModelParallel runs TorchRec's planner
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=plan,
    )
    if load_initial:
        weights = initial_weights(s)
        dmp.load_state_dict({f"ebc.embedding_bags.{n}.weight": w for n, w in weights.items()})
    return dmp


# --- gathering full tensors ------------------------------------------------------------


def _local_pieces(value: Any) -> List[Tuple[List[int], Tensor]]:
    if isinstance(value, ShardedTensor):
        return [
            (list(s.metadata.shard_offsets), s.tensor.detach().clone())
            for s in value.local_shards()
        ]
    return [([0] * value.dim(), value.detach().clone())]


def _global_size(value: Any) -> List[int]:
    return list(value.size())


def gather_full(named: Dict[str, Any]) -> Dict[str, Tensor]:
    """All ranks' pieces of each tensor (ShardedTensor or replicated), assembled; on every rank."""
    mine = {k: (_global_size(v), _local_pieces(v)) for k, v in named.items()}
    everyone: List[Dict[str, Any]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    full: Dict[str, Tensor] = {}
    for rank_items in everyone:
        for key, (size, pieces) in rank_items.items():
            for offsets, tensor in pieces:
                if key not in full:  # half tables stay half; the rest as float32
                    dtype = tensor.dtype if tensor.is_floating_point() else torch.float32
                    full[key] = torch.full(size, float("nan"), dtype=dtype)
                index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
                full[key][index] = tensor
    return full


def sharded_state(dmp: DistributedModelParallel) -> Dict[str, Tensor]:
    """Full weights and optimizer states, keyed like the unsharded module's."""
    named: Dict[str, Any] = {}
    for key, value in dmp.state_dict().items():
        named[key.removeprefix("ebc.")] = value
    for param_key, state in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            named[f"{param_key.removeprefix('ebc.')}/{name}"] = value
    return gather_full(named)


def unsharded_state(ebc: CowClipEmbeddingBagCollection) -> Dict[str, Tensor]:
    out = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
    for param_key, state in ebc.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out[f"{param_key}/{name}"] = value.detach().clone()
    return out


def sharded_clip_totals(dmp: DistributedModelParallel) -> Dict[str, Tuple[int, int]]:
    stats = dmp.module.ebc.global_clip_stats()
    return {t: (s.total_rows_updated, s.total_rows_clipped) for t, s in stats.items()}


# --- training -----------------------------------------------------------------------------


def train_sharded(dmp, s: Scenario, batches, rank: int, world: int) -> None:
    for batch in batches:
        bags, weights, upstream = local_slice(batch, rank, s.local_batch)
        kjt = kjt_from_bags(bags, weights)
        _step(dmp.module.ebc, s, lambda: dmp(kjt).to_dict(), upstream)


def train_unsharded(ebc: CowClipEmbeddingBagCollection, batches, s: Scenario) -> None:
    for bags, weights, upstream in batches:
        kjt = kjt_from_bags(bags, weights)
        _step(ebc, s, lambda: ebc(kjt).to_dict(), upstream)


def equality_case(rank: int, world: int, s: Scenario) -> Optional[Dict[str, Any]]:
    """Trains sharded and (on rank 0) unsharded; returns both results on rank 0."""
    dmp = sharded_model(s, world)
    batches = global_batches(s, world, s.steps)
    train_sharded(dmp, s, batches, rank, world)
    sharded_ebc = dmp.module.ebc
    plain_backward_error = None
    if s.helen is not None:
        bags, weights, upstream = local_slice(batches[0], rank, s.local_batch)
        try:
            mean_loss(dmp(kjt_from_bags(bags, weights)).to_dict(), upstream).backward()
        except RuntimeError as e:
            plain_backward_error = str(e)
    result = {
        "plain_backward_error": plain_backward_error,
        "sharded": sharded_state(dmp),
        "sharded_clips": sharded_clip_totals(dmp),
        "plan": {t: p.sharding_type for t, p in sharded_ebc.module_sharding_plan.items()},
        "compute_kernels": {
            t: p.compute_kernel for t, p in sharded_ebc.module_sharding_plan.items()
        },
        "state_dict_types": {k: type(v).__name__ for k, v in dmp.state_dict().items()},
        "optimizer_keys": sorted(dmp.fused_optimizer.state_dict()["state"]),
        "hyperparameters": [
            {k: v for k, v in g.items() if k != "params"} for g in dmp.fused_optimizer.param_groups
        ],
        "sharded_type": type(sharded_ebc).__name__,
        "lookup_types": [type(lookup).__name__ for lookup in sharded_ebc._lookups],
        "kernel_types": sorted(
            {type(m).__name__ for lookup in sharded_ebc._lookups for m in lookup.modules()}
        ),
        "dense_parameters": [
            n for n, p in dmp.named_parameters() if not hasattr(p, "_in_backward_optimizers")
        ],
    }
    if rank != 0:
        return None
    ref = unsharded(s)
    train_unsharded(ref, batches, s)
    result["unsharded"] = unsharded_state(ref)
    result["unsharded_clips"] = {
        t: (v.total_rows_updated, v.total_rows_clipped) for t, v in ref.clip_stats().items()
    }
    return result


def run_scenarios(rank: int, world: int, scenarios: Dict[str, Scenario], out_path: str) -> None:
    """Runs :func:`equality_case` for each scenario; rank 0 saves ``{name: result}``."""
    results = {name: equality_case(rank, world, s) for name, s in scenarios.items()}
    if rank == 0:
        save_result(results, out_path)


# --- checkpoints ----------------------------------------------------------------------


def checkpoint_phase(
    rank: int,
    world: int,
    scenarios: Dict[str, Scenario],
    load_root: Optional[str],
    start_step: int,
    save_root: Optional[str],
    save_step: int,
    out_path: str,
) -> None:
    """Per scenario: builds the model for this world size (fresh weights), loads
    ``load_root/<name>`` (a ``torch.distributed.checkpoint`` of model + fused optimizer
    taken after ``start_step`` steps), trains to ``save_step`` and saves
    ``save_root/<name>`` there, then trains to ``s.steps``. Rank 0 saves the final full
    states, ``{name: state}``."""
    import torch.distributed.checkpoint as dcp

    finals = {}
    for name, s in scenarios.items():
        dmp = sharded_model(s, world, load_initial=load_root is None)
        batches = global_batches(s, world, s.steps)
        if load_root is not None:
            state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(load_root, name))
            dmp.load_state_dict(state["model"])
            dmp.fused_optimizer.load_state_dict(state["optim"])
        train_sharded(dmp, s, batches[start_step:save_step], rank, world)
        if save_root is not None:
            dcp.save(
                {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()},
                checkpoint_id=os.path.join(save_root, name),
            )
        train_sharded(dmp, s, batches[save_step:], rank, world)
        finals[name] = sharded_state(dmp)
    if rank == 0:
        save_result(finals, out_path)


def reference_states(
    s: Scenario, world: int, at_steps: Sequence[int]
) -> Dict[int, Dict[str, Tensor]]:
    """The unsharded module's full state after each of ``at_steps`` steps."""
    ref = unsharded(s)
    batches = global_batches(s, world, s.steps)
    states = {}
    for step, batch in enumerate(batches, start=1):
        train_unsharded(ref, [batch], s)
        if step in at_steps:
            states[step] = unsharded_state(ref)
    return states


# --- failures -----------------------------------------------------------------------------


def failing_rank_case(rank: int, world: int, mode: str) -> None:
    """Rank 1 dies (``mode="exit"``) or stops responding (``"hang"``) in its second
    backward, once TorchRec's output all-to-all is done and before the column-wise
    lookup's whole-row norm exchange; rank 0 trains on and must fail, not hang."""
    import time

    s = Scenario(
        tables=[
            bag_config("tw", 8, 40, ["fa"]),
            bag_config("cw", 8, 50, ["fb"]),
        ],
        plan={"tw": ("table_wise", [0]), "cw": ("column_wise", [0, 1])},
        steps=3,
    )
    dmp = sharded_model(s, world)
    batches = global_batches(s, world, s.steps)
    sharded_ebc = dmp.module.ebc
    column_lookup = sharded_ebc._lookups[sharded_ebc._sharding_types.index("column_wise")]
    calls = {"n": 0}

    def fail(_: Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            if mode == "exit":
                os._exit(3)
            time.sleep(600)

    def hook_output(module: nn.Module, inputs: Any, output: Tensor) -> None:
        output.register_hook(fail)

    if rank == 1:
        # The gradient of the lookup's output exists once the output all-to-all's
        # backward has run; the lookup's kernels and its update come after.
        column_lookup.register_forward_hook(hook_output)
    train_sharded(dmp, s, batches, rank, world)


# --- meta construction and world-size-invariant initialisation ----------------------------


def init_tables() -> List[EmbeddingBagConfig]:
    """One table per sharding type; TorchRec's default init (uniform) on some, the
    models' N(0, std) on others, a dim-1 table and a table smaller than some worlds."""
    normal = functools.partial(nn.init.normal_, mean=0.0, std=0.05)
    return [
        bag_config("tw", 8, 5000, ["fa"]),
        EmbeddingBagConfig(
            name="cw", embedding_dim=12, num_embeddings=4500, feature_names=["fb"], init_fn=normal
        ),
        EmbeddingBagConfig(
            name="rw", embedding_dim=4, num_embeddings=9001, feature_names=["fc"], init_fn=normal
        ),
        bag_config("dp", 4, 300, ["fd"]),
        bag_config("twrw", 4, 4099, ["fe"]),
        EmbeddingBagConfig(
            name="tiny", embedding_dim=1, num_embeddings=2, feature_names=["ff"], init_fn=normal
        ),
    ]


def init_plan(world: int) -> Dict[str, Tuple[str, List[int]]]:
    last = world - 1
    return {
        "tw": ("table_wise", [last]),
        "cw": ("column_wise", list(range(world)) if world > 1 else [0, 0]),
        "rw": ("row_wise", []),
        "dp": ("data_parallel", []),
        "twrw": ("table_row_wise", []),
        "tiny": ("row_wise", []),
    }


def init_invariance_case(rank: int, world: int, optimizer: str, out_path: str) -> None:
    """Shards a meta-device CowClip collection and writes, on rank 0, the full initial
    weights gathered from all ranks and every rank's table storage against its shards."""
    # A different global RNG state per rank: the start must not depend on it.
    torch.manual_seed(100 + rank)
    tables = init_tables()
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables],
        device="meta",
        init_seed=17,
        options=CowClipOptions(optimizer=optimizer),
    )
    meta_only = all(
        t.device.type == "meta" for b in ebc._batches for t in (b.weight, *b.state.values())
    )
    s = Scenario(tables=tables, plan=init_plan(world), optimizer=optimizer, cowclip_module=True)
    sharder = sharder_for(s)
    model = Model(ebc)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=plan_for(s, ebc, sharder, world),
    )
    weights = gather_full({k.removeprefix("ebc."): v for k, v in dmp.state_dict().items()})
    sharded = next(m for m in dmp.modules() if hasattr(m, "table_storage_bytes"))
    held, expected = sharded.table_storage_bytes(), 0
    per_value = {"adam": 3, "rowwise_adagrad": 1, "sgd": 1}[optimizer]
    for kernel in sharded._kernels():
        for shard in kernel._config.embedding_tables:
            cells = shard.local_rows * shard.local_cols
            expected += 4 * cells * per_value
            if optimizer == "rowwise_adagrad":
                expected += 4 * shard.local_rows
    assert expected > 0 or world > 1, "one process holds every table"
    storage = [None] * world
    dist.all_gather_object(storage, (held, expected))
    if rank == 0:
        save_result({"weights": weights, "storage": storage, "meta_only": meta_only}, out_path)


# --- a planned job against the sharded run it plans ----------------------------------------


def planned_job_case(rank: int, world: int, jobs: List[Any], out_path: str) -> None:
    """Builds and shards each job of ``jobs`` (``torchrec_cowclip.plan.JobSpec``s) as
    the trainer's ``ShardedRuntime`` does (the model's tables on meta, the CowClip sharder,
    ``shard_model``'s planner), takes one training step, and writes on rank 0, per job,
    each rank's bytes of table weights and optimizer state and the plan
    (table -> sharding type, ranks)."""
    import json

    from torchrec.datasets.utils import Batch

    from torchrec_cowclip.models import build_model
    from torchrec_cowclip.models.task import CTRTrainTask
    from torchrec_cowclip.train.processes import DistContext, shard_model

    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    results = []
    for job in jobs:
        arguments = job.model_arguments
        model = build_model(
            job.model,
            **arguments,
            table_device="meta",
            embedding_options=CowClipOptions(optimizer=job.optimizer),
        )
        ebc = model.embedding_collection
        dmp = shard_model(
            CTRTrainTask(model),
            [t.name for t in ebc.embedding_bag_configs()],
            [CowClipEmbeddingBagCollectionSharder(module_type=type(ebc))],
            job.sharding,
            ctx,
            job.batch_size,
        )
        local = job.batch_size // world
        gen = torch.Generator().manual_seed(rank)
        ids = [torch.randint(0, c, (local,), generator=gen) for c in arguments["cardinalities"]]
        batch = Batch(
            dense_features=torch.rand(local, arguments["num_dense"], generator=gen),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=list(arguments["sparse_names"]),
                values=torch.cat(ids),
                lengths=torch.ones(local * len(ids), dtype=torch.int64),
            ),
            labels=torch.randint(0, 2, (local,), generator=gen).float(),
        )
        loss, _ = dmp(batch)
        loss.backward()  # the tables update here: every state tensor exists after it
        sharded = next(m for m in dmp.modules() if hasattr(m, "table_storage_bytes"))
        held = [None] * world
        dist.all_gather_object(held, sharded.table_storage_bytes())
        plan = {
            table: [p.sharding_type, list(p.ranks or [])]
            for module_plan in dmp.plan.plan.values()
            for table, p in module_plan.items()
        }
        results.append({"bytes": held, "plan": plan})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)

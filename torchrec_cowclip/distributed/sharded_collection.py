"""The sharded CowClip collection: TorchRec's sharded EBC with CowClip lookups.

:class:`~torchrec.distributed.embeddingbag.ShardedEmbeddingBagCollection` does all of
sharding but the lookup: it turns the plan into TorchRec's sharding strategies (input
all-to-all, output all-to-all / reduce-scatter, shard placement), builds the state dict
(``embedding_bags.<table>.weight`` as ``ShardedTensor``) from the lookups, and combines
the lookups' fused optimizers. This subclass overrides exactly two steps:

* ``_create_lookups``: one :class:`~.sharded_lookup.CowClipPooledEmbeddingsLookup` per sharding
  type, over the table groups TorchRec's sharding computed, with the strategy that
  sharding type needs (:mod:`.row_sync`: whole rows for table-wise and row-wise tables,
  whole-row sums for column shards, the union of all replicas' rows for data-parallel);
* ``init_data_parallel``: no ``DistributedDataParallel`` around data-parallel lookups
  (their fused update keeps the replicas identical itself; :class:`~.sharded_lookup.ReplicatedLookup`).

Before TorchRec's construction runs, the ranks agree on one row kernel
(:mod:`torchrec_cowclip.embedding.row_kernels`) for all their table batches: the native and
the torch kernels agree to about 1e-6, not bit for bit, and a data-parallel table's
replicas must stay identical.
"""

from __future__ import annotations

import warnings
from dataclasses import fields, replace
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.types import (
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingEnv2D,
    ShardingType,
)
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface

from torchrec_cowclip import compat
from torchrec_cowclip.distributed.comm import ColumnShardGroups, run_collective
from torchrec_cowclip.distributed.row_sync import ColumnShardRows, ReplicatedRows
from torchrec_cowclip.distributed.sharded_lookup import (
    SUPPORTED_COMPUTE_KERNELS,
    CowClipPooledEmbeddingsLookup,
    ReplicatedLookup,
)
from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.embedding.row_init import RowInit, row_initializers
from torchrec_cowclip.embedding.row_kernels import KINDS, RowKernel, kernel_of_kind, select_kernel
from torchrec_cowclip.embedding.row_updates import HelenSteps, LocalRows, RowSync, RowUpdates
from torchrec_cowclip.embedding.table_batch import COUNTER_NAMES, TableClipStats
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.row_step import COMPILE_ENV, kernel_mode
from torchrec_cowclip.optim.rules import UpdateRule

#: Sharding types whose tables keep whole rows on one rank (row-wise: each id's row lives
#: on the rank that TorchRec's input dist sends its occurrences to, so counts are global).
_LOCAL_ROWS = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
)
#: Sharding types that split a table's columns across ranks.
_COLUMN_SHARDS = (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value)
#: Every sharding type the CowClip sharder supports.
SUPPORTED_SHARDING_TYPES = (
    ShardingType.DATA_PARALLEL.value,
    *_LOCAL_ROWS,
    *_COLUMN_SHARDS,
)


class ShardedCowClipEmbeddingBagCollection(HelenSteps, ShardedEmbeddingBagCollection):
    """An ``EmbeddingBagCollection`` sharded by TorchRec and trained by CowClip in backward.

    Built by :class:`~torchrec_cowclip.distributed.CowClipEmbeddingBagCollectionSharder`;
    behaves as TorchRec's sharded EBC (same forward, ``state_dict`` keys and types,
    ``fused_optimizer``), with every table updated by the fused CowClip step of the
    unsharded :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection` on the global
    batch (see :mod:`.row_sync` for the per-sharding-type rules).

    Example::

        dmp = DistributedModelParallel(model, sharders=[CowClipEmbeddingBagCollectionSharder()],
                                       plan=plan, env=ShardingEnv.from_process_group(pg),
                                       device=torch.device("cpu"))
        dmp(batch).sum().backward()          # tables updated here, on every rank
        dmp.module.ebc.clip_stats()          # rows updated / clipped per local table
    """

    def __init__(
        self,
        module: EmbeddingBagCollectionInterface,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        options: CowClipOptions,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        module_fqn: Optional[str] = None,
    ) -> None:
        plan = _checked_plan(table_name_to_parameter_sharding, env)
        options.check_tables(t.name for t in module.embedding_bag_configs())
        if options.output_dtype != torch.float32:
            raise ValueError(
                f"output_dtype={options.output_dtype} is honoured by the unsharded "
                "CowClipEmbeddingBagCollection only; a sharded one gives float32 pooled "
                "outputs (cast them in the model, or drop output_dtype)"
            )
        # TorchRec's constructor creates the lookups (`_create_lookups`), which need the
        # options, and initialises the tables (`reset_parameters`), which needs the
        # initialisers; plain attributes may be set before nn.Module.__init__. The
        # tables, env and device are kept here too, not read back from TorchRec's
        # private attributes of the same content.
        self._cowclip_options = options
        self._cowclip_tables = module.embedding_bag_configs()
        self._cowclip_env = env
        self._cowclip_device = device
        self._row_inits = _agreed_row_initializers(module, env)
        # Built (the native library, on first use) and agreed on before any step, in the
        # kernel mode the unsharded module was built with (resolved once there).
        self._cowclip_kernel = _agreed_kernel(
            device if device is not None else torch.device("cpu"),
            options.rule,
            env,
            module.kernel_mode
            if isinstance(module, CowClipEmbeddingBagCollection)
            else kernel_mode(),
        )
        # The lookups TorchRec's constructor creates each open a channel into this.
        self._row_updates = RowUpdates(
            [t.name for t in self._cowclip_tables],
            options.helen,
            device if device is not None else torch.device("cpu"),
            reduce_table_statistics=_all_reduce_table_statistics(env.process_group),
            name="sharded CowClip collection",
        )
        # `options` carry what the sharder's fused_params and the weights' in-backward
        # marks said; TorchRec's constructor would hand them to FBGEMM, whose kernels these
        # are not, and refuse the CowClip optimizer classes.
        with compat.in_backward_marks_hidden(module):
            super().__init__(
                module=module,
                table_name_to_parameter_sharding=plan,
                env=env,
                fused_params=None,
                device=device,
                qcomm_codecs_registry=qcomm_codecs_registry,
                module_fqn=module_fqn,
            )
        self._divide_only_row_wise_means()

    # --- the update -------------------------------------------------------------------

    @property
    def row_updates(self) -> RowUpdates:
        """The coordinator every touched-row update of this rank's shards goes through:
        one channel per lookup (sharding type), in one order on every rank
        (:mod:`torchrec_cowclip.embedding.row_updates`)."""
        return self._row_updates

    @property
    def row_kernel(self) -> RowKernel:
        """How this rank's table batches group and update their touched rows, of the
        same kind on every rank (:func:`_agreed_kernel`)."""
        return self._cowclip_kernel

    def _divide_only_row_wise_means(self) -> None:
        """TorchRec applies MEAN pooling of row-wise tables after its reduce-scatter, by
        dividing the whole output by a per-feature divisor; it sets the divisor to 1 only
        for the SUM features of row-wise tables, so features of other sharding types
        (already pooled by their kernels, MEAN included) would be divided by their bag
        lengths too. List them with the SUM features so their divisor is 1."""
        divided = compat.row_wise_divisor_features(self)
        if divided is None:
            return
        row_split = {f for fs in divided.values() for f in fs}
        divided[PoolingType.SUM.value].extend(
            f for t in self._cowclip_tables for f in t.feature_names if f not in row_split
        )

    @property
    def cowclip_options(self) -> CowClipOptions:
        """The options the tables were sharded with (live lr: ``fused_optimizer``)."""
        return self._cowclip_options

    def clip_stats(self) -> Dict[str, TableClipStats]:
        """Per table held by this rank: rows updated / clipped / skipped as non-finite,
        last step and in total. Tables on other ranks are absent; data-parallel tables
        report the union update every replica applied."""
        stats: Dict[str, TableClipStats] = {}
        for lookup in compat.sharded_lookups(self):
            stats.update(lookup.clip_stats())
        return {t.name: stats[t.name] for t in self._cowclip_tables if t.name in stats}

    def global_clip_stats(self) -> Dict[str, TableClipStats]:
        """Per table, over all ranks: a collective, call it on every rank.

        Row-wise shards hold different rows, so their counts add up; column shards and
        data-parallel replicas update the same rows, so one copy is kept (ranks that
        disagree there would be a bug, and raise).
        """
        env = self._cowclip_env
        gathered: List[Optional[Dict[str, TableClipStats]]] = [None] * env.world_size
        torch.distributed.all_gather_object(gathered, self.clip_stats(), group=env.process_group)
        row_split = {
            name
            for name, p in self.module_sharding_plan.items()
            if p.sharding_type in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
        }
        merged: Dict[str, TableClipStats] = {}
        for rank_stats in gathered:
            for name, stats in (rank_stats or {}).items():
                if name not in merged:
                    merged[name] = stats
                elif name in row_split:
                    merged[name] = _add_stats(merged[name], stats)
                elif merged[name] != stats:
                    raise RuntimeError(f"ranks disagree on the clip counts of table '{name}'")
        return {t.name: merged[t.name] for t in self._cowclip_tables if t.name in merged}

    def table_counters(self) -> Dict[str, Tensor]:
        """Per table, its global ``[6]`` clip counters (the unsharded module's
        :meth:`~torchrec_cowclip.CowClipEmbeddingBagCollection.table_counters` layout):
        a collective, call it on every rank."""
        return {
            name: torch.tensor([getattr(stats, c) for c in COUNTER_NAMES], dtype=torch.int64)
            for name, stats in self.global_clip_stats().items()
        }

    def load_table_counters(self, counters: Dict[str, Tensor]) -> None:
        """Restores :meth:`table_counters` (saved at any world size) into this rank's
        shards."""
        names = sorted(t.name for t in self._cowclip_tables)
        if sorted(counters) != names:
            raise ValueError(
                f"clip counters are for tables {sorted(counters)}, this module has {names}"
            )
        for name in names:  # all checked before any shard takes its counters
            value = counters[name]
            if tuple(value.shape) != (len(COUNTER_NAMES),) or value.dtype != torch.int64:
                raise ValueError(
                    f"clip counters of table '{name}': {list(value.shape)} {value.dtype}, "
                    f"expected [{len(COUNTER_NAMES)}] torch.int64; nothing was loaded"
                )
        for kernel in self._kernels():
            kernel.load_table_counters(counters)

    def table_storage_bytes(self) -> int:
        """Bytes of table weights and optimizer state this rank holds (its shards only)."""
        return sum(kernel.storage_bytes() for kernel in self._kernels())

    def _kernels(self) -> List[Any]:
        kernels = []
        for lookup in compat.sharded_lookups(self):
            inner = lookup.module if isinstance(lookup, ReplicatedLookup) else lookup
            kernels.extend(compat.lookup_kernels(inner))
        return kernels

    def reset_parameters(self) -> None:
        """Initialises this rank's shards: each holds exactly the rows and columns of the
        unsharded module's initial tables (see
        :meth:`~torchrec_cowclip.distributed.sharded_kernel.CowClipBatchedEmbeddingBag.initialise_shards`),
        whatever the plan and world size; optimizer state and counters start at zero."""
        if self._cowclip_device is not None and self._cowclip_device.type == "meta":
            return
        for kernel in self._kernels():
            kernel.initialise_shards(self._row_inits)

    # --- the steps of TorchRec's construction this class replaces ------------------------

    def _create_lookups(self) -> None:
        pg = self._cowclip_env.process_group
        for sharding, sharding_type in compat.embedding_shardings(self):
            row_sync: RowSync
            if sharding_type in _LOCAL_ROWS:
                row_sync = LocalRows()
            elif sharding_type in _COLUMN_SHARDS:
                # From the global plan, so that every rank creates the same groups in
                # the same order (a collective), whichever shards it holds.
                row_sync = ColumnShardRows(
                    ColumnShardGroups(
                        {
                            name: table.ranks or []
                            for name, table in self.module_sharding_plan.items()
                            if table.sharding_type == sharding_type
                        },
                        pg,
                    )
                )
            else:
                row_sync = ReplicatedRows(pg)
            compat.sharded_lookups(self).append(
                CowClipPooledEmbeddingsLookup(
                    grouped_configs=compat.grouped_configs(sharding),
                    device=self._cowclip_device,
                    pg=pg,
                    env=self._cowclip_env,
                    sharding_type=ShardingType(sharding_type),
                    options=self._cowclip_options,
                    channel=self._row_updates.channel(row_sync),
                    kernel=self._cowclip_kernel,
                    scale_weight_gradients=sharding_type != ShardingType.DATA_PARALLEL.value,
                )
            )

    def init_data_parallel(self) -> None:
        lookups = compat.sharded_lookups(self)
        for i, (sharding, _) in enumerate(compat.embedding_shardings(self)):
            if isinstance(sharding, DpPooledEmbeddingSharding):
                lookups[i] = ReplicatedLookup(lookups[i])


def _agreed_row_initializers(
    module: EmbeddingBagCollectionInterface, env: ShardingEnv
) -> Dict[str, Optional[RowInit]]:
    """The tables' initialisers as rank 0 has them (a CowClip module's own; for a stock
    EBC, its configs' ``init_fn`` under rank 0's seed), so that ranks that were seeded
    differently still start from one model."""
    if isinstance(module, CowClipEmbeddingBagCollection):
        inits: Dict[str, Optional[RowInit]] = module.row_initializers
    else:
        inits = row_initializers(module.embedding_bag_configs(), torch.initial_seed())
    if env.process_group is not None and torch.distributed.is_initialized():
        box: List[Any] = [inits]
        torch.distributed.broadcast_object_list(box, src=0, group=env.process_group)
        inits = box[0]
    return inits


def _agreed_kernel(
    device: torch.device, rule: UpdateRule, env: ShardingEnv, mode: str
) -> RowKernel:
    """This rank's row kernel, of one kind on every rank of ``env`` (a collective).

    Every rank chooses in its kernel ``mode``
    (:func:`~torchrec_cowclip.embedding.row_kernels.select_kernel`) and the ranks compare.
    Where they differ and every rank is in ``auto`` mode (a native build failed on some), all take the kind every one of them can run - the most conservative
    of those chosen - with a warning naming the ranks; where a rank was told otherwise
    (``TORCHREC_COWCLIP_COMPILE`` set differently), ValueError naming it.
    """
    kernel = select_kernel(device, rule, mode)
    pg = env.process_group
    if pg is None or not dist.is_initialized():
        return kernel
    mine = (kernel.kind, mode)
    gathered: List[Any] = [None] * dist.get_world_size(pg)
    run_collective(
        "the ranks' row kernels", pg, lambda: dist.all_gather_object(gathered, mine, group=pg)
    )
    kinds = [kind for kind, _ in gathered]
    if len(set(kinds)) == 1:
        return kernel
    ranks = dist.get_process_group_ranks(pg)
    chose = ", ".join(f"rank {r}: {kind}" for r, kind in zip(ranks, kinds))
    if all(mode == "auto" for _, mode in gathered):
        common = max(kinds, key=KINDS.index)
        warnings.warn(
            f"torchrec_cowclip: the ranks chose different row kernels ({chose}; a native "
            f"build failed?); every rank updates with the {common} kernel, so that "
            "replicated tables stay identical",
            RuntimeWarning,
            stacklevel=3,
        )
        return kernel if kernel.kind == common else kernel_of_kind(common, device)
    i = next(i for i, kind in enumerate(kinds) if kind != kinds[0])
    raise ValueError(
        f"rank {ranks[i]} updates its rows with the {kinds[i]} row kernel "
        f"({COMPILE_ENV}={gathered[i][1]}), rank {ranks[0]} with {kinds[0]} "
        f"({COMPILE_ENV}={gathered[0][1]}): the ranks of a sharded collection must use one "
        f"kind; set {COMPILE_ENV} alike on every rank"
    )


def _add_stats(a: TableClipStats, b: TableClipStats) -> TableClipStats:
    """Counts of two row shards of one table (same steps)."""
    counts = {
        f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a) if f.name != "steps"
    }
    return TableClipStats(**counts, steps=max(a.steps, b.steps))


def _checked_plan(
    plan: Dict[str, ParameterSharding], env: ShardingEnv
) -> Dict[str, ParameterSharding]:
    """The plan with TorchRec's ``dense`` read as ``fused``, or ValueError naming what
    the CowClip sharder cannot do."""
    if isinstance(env, ShardingEnv2D):
        raise ValueError("the CowClip sharder does not support 2D sharding environments")
    if env.output_dtensor:
        raise ValueError(
            "the CowClip sharder produces ShardedTensor state dicts; "
            "ShardingEnv(output_dtensor=True) is not supported"
        )
    checked: Dict[str, ParameterSharding] = {}
    for table, sharding in plan.items():
        if sharding.sharding_type not in SUPPORTED_SHARDING_TYPES:
            raise ValueError(
                f"table '{table}': sharding type '{sharding.sharding_type}' is not supported "
                f"by the CowClip sharder (supported: {list(SUPPORTED_SHARDING_TYPES)})"
            )
        kernel = EmbeddingComputeKernel(sharding.compute_kernel)
        if kernel not in SUPPORTED_COMPUTE_KERNELS:
            raise ValueError(
                f"table '{table}': compute kernel '{sharding.compute_kernel}' is not "
                f"supported by the CowClip sharder (use 'fused')"
            )
        checked[table] = replace(sharding, compute_kernel=EmbeddingComputeKernel.FUSED.value)
    return checked


def _all_reduce_table_statistics(
    pg: Optional[dist.ProcessGroup],
) -> Callable[[Tensor, Tensor], None]:
    """Helen's per-table statistics summed (squared norms: row and column shards hold
    disjoint parts) and maxed (largest counts) over every rank of the module."""

    def reduce(sq_norm: Tensor, max_count: Tensor) -> None:
        def exchange() -> None:
            dist.all_reduce(sq_norm, op=dist.ReduceOp.SUM, group=pg)
            dist.all_reduce(max_count, op=dist.ReduceOp.MAX, group=pg)

        run_collective("Helen: all-reduce of the tables' gradient norms and counts", pg, exchange)

    return reduce

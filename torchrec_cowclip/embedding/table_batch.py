"""Storage of a table batch: tables of one embedding dim and pooling in one tensor.

Table batching is what makes the fused update cheap: all tables of one dim (pooling and
storage type) share one ``[sum(rows), D]`` weight and one set of optimizer-state tensors, so a batch's lookup is
one kernel call and its update is one gather/compute/scatter over the distinct rows,
whatever the number of tables. A table is a row range of the batch; the per-table
tensors that ``state_dict()`` and the fused optimizer expose are views into it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    PoolingType,
    data_type_to_dtype,
)

from torchrec_cowclip.embedding.row_kernels import RowKernel
from torchrec_cowclip.optim.functional import STORAGE_DTYPES, rounding_row_keys
from torchrec_cowclip.optim.rules import STATE_LAYOUT

#: Buffer-name prefix of the optimizer state tensors (``state_exp_avg``, ...).
_STATE_PREFIX = "state_"

#: The optimizer state's type, whatever the weights' (float16 / bfloat16 weights are
#: updated in float32 and rounded back; their state stays float32).
STATE_DTYPE = torch.float32

#: Rows of :attr:`TableBatch.counters`, one column per table.
COUNTER_NAMES = (
    "rows_updated",
    "rows_clipped",
    "rows_nonfinite",
    "total_rows_updated",
    "total_rows_clipped",
    "total_rows_nonfinite",
)


@dataclass(frozen=True)
class TableClipStats:
    """What the fused update did to one table: the last step and since construction
    (or :meth:`ClipCounters.reset <torchrec_cowclip.embedding.clip_counters.ClipCounters.reset>`).

    ``rows_updated`` counts distinct rows updated; ``rows_clipped`` those among them
    whose gradient the CowClip clip shrank; ``rows_nonfinite`` rows skipped because their
    gradient had a NaN or inf (they keep their weight and optimizer state).
    """

    rows_updated: int
    rows_clipped: int
    rows_nonfinite: int
    total_rows_updated: int
    total_rows_clipped: int
    total_rows_nonfinite: int
    steps: int

    @property
    def clipped_fraction(self) -> float:
        """Share of all row updates so far whose gradient was clipped."""
        return self.total_rows_clipped / max(self.total_rows_updated, 1)


class TableBatch(nn.Module):
    """Tables sharing one embedding dim and pooling, stored and updated together.

    Its tensors are buffers of this module (not persistent: ``state_dict`` keeps
    TorchRec's per-table keys, which the owning collection serves as views), so device
    moves, ``to_empty`` and copies are ``nn.Module``'s own.

    Args:
        tables: the configs, in the collection's order.
        embedding_names: per table, the output key of each of its features (the
            feature name, or ``feature@table`` for a feature several tables look up).
        optimizer: ``"adam"``, ``"rowwise_adagrad"`` or ``"sgd"``; decides the state.
        clipped: per table, whether CowClip may clip it.
        device: where the tensors live.
        kernel: how the batch's touched rows are grouped and updated
            (:mod:`~torchrec_cowclip.embedding.row_kernels`), chosen by the owner for
            ``device``; an owner that moves the batch chooses again.
        global_offsets: per table, the (row, column) of its first element in the whole
            table it is a shard of (default: (0, 0), whole tables); the stochastic
            rounding of float16 / bfloat16 tables is keyed by global rows and columns, so
            a shard rounds as the whole table would.

    Attributes:
        weight: ``[R, D]`` all tables' rows, table ``i`` at ``row_offsets[i]:row_offsets[i+1]``,
            in the tables' ``data_type`` (FP32, FP16 or BF16).
        state: optimizer state tensors over the same rows (see ``STATE_LAYOUT``), float32
            whatever the weight's type.
        step: ``[T]`` int64 step count per table.
        feature_names: the features looked up in this batch, table by table (a
            feature shared by two tables appears twice).
        kernel: its :class:`~torchrec_cowclip.embedding.row_kernels.RowKernel`.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        embedding_names: Sequence[Sequence[str]],
        optimizer: str,
        clipped: Sequence[bool],
        device: torch.device,
        kernel: RowKernel,
        global_offsets: Optional[Sequence[Tuple[int, int]]] = None,
    ) -> None:
        super().__init__()
        self.kernel = kernel
        #: Half tables round their updated rows stochastically, else to nearest
        #: (``CowClipOptions.stochastic_rounding``, set by the owning collection).
        self.stochastic_rounding = True
        self.tables: List[EmbeddingBagConfig] = list(tables)
        self.dim: int = tables[0].embedding_dim
        self.pooling: PoolingType = tables[0].pooling
        dtype = storage_dtype(tables[0].data_type)
        offsets_of_shards = list(global_offsets or [(0, 0)] * len(tables))
        # Per table: rounding seed (from its name, so every process and every shard of it
        # agrees), step (filled in per step), global row and column of its first element.
        self.rounding_list: List[List[int]] = [
            [zlib.crc32(t.name.encode()), 0, int(row), int(col)]
            for t, (row, col) in zip(tables, offsets_of_shards)
        ]
        self.optimizer = optimizer
        self.table_names: List[str] = [t.name for t in tables]
        rows = [t.num_embeddings for t in tables]
        offsets = [0]
        for n in rows:
            offsets.append(offsets[-1] + n)
        self.row_offsets_list: List[int] = offsets
        self.feature_names: List[str] = [f for t in tables for f in t.feature_names]
        self.embedding_names: List[str] = [e for names in embedding_names for e in names]
        feature_table = [i for i, t in enumerate(tables) for _ in t.feature_names]
        self.feature_table_list: List[int] = feature_table
        self.all_clipped: bool = all(clipped)
        self.clip_enabled_list: List[bool] = [bool(c) for c in clipped]

        total = offsets[-1]
        self.feature_row_offset_list: List[int] = [offsets[i] for i in feature_table]
        self.feature_num_rows_list: List[int] = [rows[i] for i in feature_table]
        buffers: Dict[str, Optional[Tensor]] = {
            "weight": torch.empty(total, self.dim, dtype=dtype, device=device),
            "step": torch.zeros(len(tables), dtype=torch.int64, device=device),
            "counters": torch.zeros(
                len(COUNTER_NAMES), len(tables), dtype=torch.int64, device=device
            ),
            # Optional per-row [2, R] int64 (updated, clipped) counts; None unless asked for.
            "row_counters": None,
        }
        self.state_names: List[str] = [name for name, _ in STATE_LAYOUT[optimizer]]
        for name, shape in state_shapes(total, self.dim, optimizer).items():
            buffers[_STATE_PREFIX + name] = torch.zeros(shape, dtype=STATE_DTYPE, device=device)
        for name, tensor in {**buffers, **self._index_tensors(device)}.items():
            self.register_buffer(name, tensor, persistent=False)
        self._index_cache: Dict[Tuple[str, int], Tensor] = {}
        # Batches equal in this look up the same row ids for the same KJT.
        self.lookup_layout: Tuple[Tuple[str, ...], Tuple[int, ...], Tuple[int, ...]] = (
            tuple(self.feature_names),
            tuple(self.feature_row_offset_list),
            tuple(self.feature_num_rows_list),
        )

    # Registered buffers, declared for type checkers.
    weight: Tensor
    step: Tensor
    counters: Tensor
    row_counters: Optional[Tensor]
    row_offsets: Tensor
    clip_enabled: Tensor
    feature_num_rows: Tensor
    rounding: Tensor
    feature_rows: Tensor

    def _index_tensors(self, device: torch.device) -> Dict[str, Tensor]:
        """The index tensors, from their Python lists."""
        return {
            "row_offsets": torch.tensor(self.row_offsets_list, dtype=torch.int64, device=device),
            "clip_enabled": torch.tensor(self.clip_enabled_list, dtype=torch.bool, device=device),
            "feature_num_rows": torch.tensor(
                self.feature_num_rows_list, dtype=torch.int64, device=device
            ),
            "rounding": torch.tensor(self.rounding_list, dtype=torch.int64, device=device),
            "feature_rows": torch.tensor(
                list(zip(self.feature_row_offset_list, self.feature_num_rows_list)),
                dtype=torch.int64,
                device=device,
            ).view(-1, 2),
        }

    def rounding_keys(self) -> Tensor:
        """``[T, 4]`` int64 per table: rounding seed, step count, global row and column
        of its first element: what the native kernel keys the stochastic rounding of a
        float16 / bfloat16 table by."""
        keys = self.rounding.clone()
        keys[:, 1] = self.step
        return keys

    def row_rounding_keys(self, rows: Tensor, table_of_row: Tensor) -> Tensor:
        """``[U]`` :func:`~torchrec_cowclip.optim.functional.rounding_row_keys` of batch
        rows ``rows`` (of tables ``table_of_row``) at the tables' current step."""
        keys = self.rounding[table_of_row]
        global_row = rows - self.row_offsets[table_of_row] + keys[:, 2]
        return rounding_row_keys(keys[:, 0], self.step[table_of_row], global_row)

    @property
    def state(self) -> Dict[str, Tensor]:
        """The optimizer state tensors over all rows, by name (see ``STATE_LAYOUT``)."""
        return {name: getattr(self, _STATE_PREFIX + name) for name in self.state_names}

    @property
    def compute_dtype(self) -> torch.dtype:
        """The type the update and the pooled outputs compute in: float32 for float16 /
        bfloat16 storage, the weight's own type otherwise."""
        half = self.weight.dtype in (torch.float16, torch.bfloat16)
        return torch.float32 if half else self.weight.dtype

    @property
    def num_tables(self) -> int:
        return len(self.table_names)

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    def table_weight(self, i: int) -> Tensor:
        """``[N_i, D]`` view of table ``i``'s rows."""
        return self.weight[self.row_offsets_list[i] : self.row_offsets_list[i + 1]]

    def table_state(self, i: int) -> Dict[str, Tensor]:
        """Views of table ``i``'s optimizer state, ``step`` included (a 0-d view)."""
        lo, hi = self.row_offsets_list[i], self.row_offsets_list[i + 1]
        views = {name: tensor[lo:hi] for name, tensor in self.state.items()}
        views["step"] = self.step[i]
        return views

    def bag_gradient_rows(self, batch_size: int) -> Tensor:
        """``[F * B]``: for each bag in KJT (feature-major) order, its row in the
        ``[B * F, D]`` view of the batch-major pooled output's gradient.

        Cached per batch size: it depends on nothing else, and computing it per step
        was 3 full passes over the ids.
        """

        def build() -> Tensor:
            bag = torch.arange(self.num_features * batch_size, device=self.weight.device)
            return (bag % batch_size) * self.num_features + bag // batch_size

        return self._cached_index("bag_gradient_rows", batch_size, build)

    def feature_bag_starts(self, batch_size: int) -> Tensor:
        """``[F + 1]``: the index of each feature's first bag in a KJT's offsets
        (``f * batch_size``), and the end (cached)."""
        return self._cached_index(
            "feature_bag_starts",
            batch_size,
            lambda: torch.arange(self.num_features + 1, device=self.weight.device) * batch_size,
        )

    def unit_offsets(self, num_bags: int) -> Tensor:
        """``arange(num_bags + 1)``: offsets of ``num_bags`` bags of one id each (cached)."""
        return self._cached_index(
            "unit_offsets",
            num_bags,
            lambda: torch.arange(num_bags + 1, device=self.weight.device),
        )

    def _cached_index(self, kind: str, size: int, build: Callable[[], Tensor]) -> Tensor:
        """Index tensors that depend only on a batch size, built once per size (a run
        sees a few: train, eval, a last partial batch); dropped on device moves."""
        key = (kind, size)
        cached = self._index_cache.get(key)
        if cached is None:
            if len(self._index_cache) >= 8:
                self._index_cache.clear()
            cached = self._index_cache[key] = build()
        return cached

    def table_of_rows(self, rows: Tensor) -> Tensor:
        """Index of the table each batch row id belongs to."""
        return torch.bucketize(rows, self.row_offsets[1:], right=True)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "TableBatch":
        # Leaving the meta device (``to_empty``) leaves every buffer uninitialised: the
        # index tensors are rebuilt from their lists and the state zeroed; the weights are
        # then the owner's ``reset_parameters`` to fill.
        from_meta = self.weight.device.type == "meta"
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # (no annotations in torch)
        self._index_cache = {}
        if from_meta and self.weight.device.type != "meta":
            for name, tensor in self._index_tensors(self.weight.device).items():
                setattr(self, name, tensor)
            self.reset_state()
        return self

    def storage_bytes(self) -> int:
        """Bytes of the weight and optimizer-state tensors (0 on the meta device)."""
        if self.weight.device.type == "meta":
            return 0
        return sum(t.numel() * t.element_size() for t in (self.weight, *self.state.values()))

    def reset_state(self) -> None:
        """Zeroes the optimizer state, step counts and clip counters (a fresh table)."""
        for tensor in self.state.values():
            tensor.zero_()
        self.step.zero_()
        self.counters.zero_()
        if self.row_counters is not None:
            self.row_counters.zero_()

    def stats(self) -> Dict[str, TableClipStats]:
        counters = self.counters.tolist()
        steps = self.step.tolist()
        return {
            name: TableClipStats(
                **{field: row[i] for field, row in zip(COUNTER_NAMES, counters)}, steps=steps[i]
            )
            for i, name in enumerate(self.table_names)
        }

    def reset_stats(self) -> None:
        self.counters.zero_()


def group_into_table_batches(tables: Sequence[EmbeddingBagConfig]) -> List[List[int]]:
    """Indices of the tables of each (dim, pooling, data type) group, in first-appearance
    order."""
    groups: Dict[Tuple[int, PoolingType, DataType], List[int]] = {}
    for i, table in enumerate(tables):
        groups.setdefault((table.embedding_dim, table.pooling, table.data_type), []).append(i)
    return list(groups.values())


def state_shapes(rows: int, dim: int, optimizer: str) -> Dict[str, Tuple[int, ...]]:
    """The shape of each optimizer-state tensor ``optimizer`` keeps for ``rows`` rows of
    ``dim`` columns (a whole table, or one shard of it: a column shard keeps its own
    per-row state), as a table batch allocates it (``STATE_LAYOUT``: ``"D"`` one value
    per column, ``"1"`` one per row).

    Example::

        >>> state_shapes(1000, 16, "adam"), state_shapes(1000, 16, "rowwise_adagrad")
        ({'exp_avg': (1000, 16), 'exp_avg_sq': (1000, 16)}, {'sum': (1000,)})
    """
    return {
        name: (int(rows), int(dim)) if per_row == "D" else (int(rows),)
        for name, per_row in STATE_LAYOUT[optimizer]
    }


def storage_bytes(rows: int, dim: int, dtype: torch.dtype, optimizer: str) -> Tuple[int, int]:
    """``(weight bytes, optimizer-state bytes)`` of ``rows x dim`` table rows stored as
    ``dtype`` and trained with ``optimizer``: exactly what :meth:`TableBatch.storage_bytes`
    counts for them.

    Example::

        >>> storage_bytes(1_000_000, 16, torch.float16, "adam")   # fp16 weights, fp32 moments
        (32000000, 128000000)
        >>> storage_bytes(1_000_000, 16, torch.bfloat16, "rowwise_adagrad")
        (32000000, 4000000)
    """
    state = sum(math.prod(shape) for shape in state_shapes(rows, dim, optimizer).values())
    return int(rows) * int(dim) * dtype.itemsize, state * STATE_DTYPE.itemsize


def storage_dtype(data_type: DataType) -> torch.dtype:
    """The torch dtype of a table's ``data_type``: FP32, FP16 or BF16; ValueError for
    the others (the quantised types are for inference, not for training)."""
    dtype: torch.dtype = data_type_to_dtype(data_type)
    if dtype not in STORAGE_DTYPES:
        raise ValueError(
            f"embedding tables are trained in FP32, FP16 or BF16 storage, got {data_type}"
        )
    return dtype

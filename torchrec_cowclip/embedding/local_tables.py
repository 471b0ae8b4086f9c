"""A collection's tables as it stores them: the table configs (checked), their features in
lookup order, the table batches of one dim, pooling and data type, the one row kernel the
batches share (chosen from the kernel mode, again after a device move) and each table's
counter-based initialisation; and the way through them: the lookup over the batches
(:class:`~.batched_lookup.BatchedLookup`), the KJT's checks and key order on the way in,
the output's type and keys on the way out, the refusal while they are on the meta device.

Example::

    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec_cowclip.optim.options import CowClipOptions
    >>> tables = LocalTables(
    ...     [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=10, feature_names=[n])
    ...      for n, d in (("a", 4), ("b", 8), ("c", 4))],
    ...     CowClipOptions(), torch.device("cpu"), kernel_mode="0", init_seed=0)
    >>> [batch.table_names for batch in tables.batches], tables.embedding_names
    ([['a', 'c'], ['b']], ['a', 'b', 'c'])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol, Tuple, Union

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_cowclip.embedding.batched_lookup import BatchedLookup
from torchrec_cowclip.embedding.row_init import RowInit, row_initializers
from torchrec_cowclip.embedding.row_kernels import RowKernel, select_kernel
from torchrec_cowclip.embedding.row_updates import LocalRows, RowUpdates
from torchrec_cowclip.embedding.table_batch import TableBatch, group_into_table_batches
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.row_step import kernel_mode as resolve_kernel_mode

__all__ = ["LocalTables"]


class _Movable(Protocol):
    """What follows the batches in a move: indexes over them (the lookup, the row updates)."""

    def to(self, device: torch.device) -> Any: ...


class LocalTables:
    """The tables of one unsharded collection, stored as table batches.

    Args:
        tables: TorchRec's table configs (checked here: names, sizes, data type, pooling,
            features; a table without features takes its name, TorchRec's convention).
        options: how they train (the optimizer, the unclipped tables, stochastic rounding,
            the output type; checked against the tables).
        device: where they live (None: the CPU).
        kernel_mode: the row kernel's mode, resolved once (an explicit value, else the
            environment's); the kernel itself is chosen from it here and after a device
            move, not per step: building the native one, if it is that, happens now.
        init_seed: the counter-based initialisation's seed (None: ``torch.initial_seed()``).
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        options: CowClipOptions,
        device: Optional[Union[str, torch.device]],
        kernel_mode: Optional[str],
        init_seed: Optional[int],
    ) -> None:
        _validate_tables(tables)
        options.check_tables(t.name for t in tables)
        self.configs = tables
        self.rule = options.rule
        self.device = device = torch.device("cpu" if device is None else device)
        self.kernel_mode = resolve_kernel_mode(kernel_mode)
        kernel = select_kernel(device, options.rule, self.kernel_mode)
        seed = torch.initial_seed() if init_seed is None else int(init_seed)
        self.row_inits: dict[str, Optional[RowInit]] = row_initializers(tables, seed)
        names_by_table = get_embedding_names_by_table(tables)
        self.embedding_names: list[str] = [e for names in names_by_table for e in names]
        self.lengths_per_embedding: list[int] = [
            t.embedding_dim for t in tables for _ in t.feature_names
        ]
        #: The pooled outputs' type (FBGEMM's ``output_dtype``; they are pooled in float32).
        self.output_dtype = options.output_dtype
        unclipped = options.unclipped_tables
        self.batches: list[TableBatch] = [
            TableBatch(
                [tables[i] for i in group],
                [names_by_table[i] for i in group],
                options.optimizer,
                [tables[i].name not in unclipped for i in group],
                device,
                kernel,
            )
            for group in group_into_table_batches(tables)
        ]
        for batch in self.batches:
            batch.stochastic_rounding = options.stochastic_rounding
        self._key_permutations: dict[tuple[str, ...], Optional[list[int]]] = {}

    @property
    def kernel(self) -> RowKernel:
        """The row kernel every batch updates its rows with."""
        return self.batches[0].kernel

    @property
    def unclipped_tables(self) -> tuple[str, ...]:
        """Names of the tables that are updated but never clipped."""
        return tuple(
            name
            for batch in self.batches
            for name, clipped in zip(batch.table_names, batch.clip_enabled_list)
            if not clipped
        )

    def storage_options(self) -> dict[str, Any]:
        """The options the tables' storage keeps (``CowClipOptions`` fields)."""
        rounding = self.batches[0].stochastic_rounding
        return {"stochastic_rounding": rounding, "output_dtype": self.output_dtype}

    def storage_bytes(self) -> int:
        """Bytes of table weights and optimizer state (0 on meta)."""
        return sum(batch.storage_bytes() for batch in self.batches)

    def reset(self, weight_of: Callable[[str], Tensor]) -> None:
        """Initialises every table's weight (``weight_of(name)``: its row initialiser,
        else the config's ``init_fn``) and zeroes the optimizer state and counters;
        nothing on the meta device."""
        if self.device.type == "meta":
            return
        with torch.no_grad():
            for table in self.configs:
                weight = weight_of(table.name)
                row_init = self.row_inits[table.name]
                if row_init is not None:
                    row_init(weight)
                else:
                    assert table.init_fn is not None  # EmbeddingBagConfig always sets one
                    table.init_fn(weight)
            for batch in self.batches:
                batch.reset_state()

    def move(self, fn: Callable[[Tensor], Tensor], *followers: _Movable) -> torch.device:
        """Applies ``fn`` (a device or dtype move) to every batch; a new device gets the
        row kernel of the same mode there, and ``followers`` (what indexes the batches:
        the lookup, the row updates) are moved after them. Returns the device."""
        for batch in self.batches:
            batch._apply(fn)
        moved_to = self.batches[0].weight.device
        if moved_to != self.device:
            kernel = select_kernel(moved_to, self.rule, self.kernel_mode)
            for batch in self.batches:
                batch.kernel = kernel
        self.device = moved_to
        for follower in followers:
            follower.to(moved_to)
        return moved_to

    def require_storage(self) -> None:
        """Raises RuntimeError, naming the ways out, while the tables are on the meta
        device (no storage, no optimizer state)."""
        if self.device.type == "meta":
            raise RuntimeError(
                "this CowClipEmbeddingBagCollection is on the meta device (no storage): shard "
                "it with DistributedModelParallel(..., sharders=torchrec_cowclip.distributed."
                "get_default_sharders()) (TorchRec's default sharders, and a CowClip sharder "
                "left at module_type=EmbeddingBagCollection, do not match this class), or "
                "call to_empty(device=...) and reset_parameters() first"
            )

    def lookup_inputs(
        self, features: KeyedJaggedTensor, order: list[str], is_weighted: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """The values, offsets and weights (None: unweighted) of ``features`` with its
        keys in ``order`` (the lookup's: a feature shared by tables repeats).

        Raises:
            ValueError: the keys are not exactly the tables' features (missing,
                unexpected or repeated ones named), the KJT is variable-batch, its ids
                are not integers, or a weighted collection's KJT has no weights.
        """
        keys = tuple(features.keys())
        if keys not in self._key_permutations:
            self._key_permutations[keys] = _key_permutation(keys, order)
        permutation = self._key_permutations[keys]
        if permutation is not None:
            features = features.permute(permutation)
        values, offsets = features.values(), features.offsets()
        weights = features.weights_or_none() if is_weighted else None
        _check_structure(features, values, weights, is_weighted)
        return values, offsets, weights

    def lookup(
        self, row_updates: RowUpdates, row_options: Callable[[], CowClipOptions]
    ) -> BatchedLookup:
        """All the batches as one lookup whose rows are local, updating through
        ``row_updates`` with the hyperparameters ``row_options()`` gives at each backward
        (the lookup is two custom ops, :mod:`.lookup_op`, compiled or not)."""
        names = self.embedding_names
        return BatchedLookup(
            self.batches, names, row_updates, LocalRows(), row_options, self.device
        )

    def output(self, pooled: Tensor) -> KeyedTensor:
        """The lookup's float32 ``pooled`` embeddings cast once to :attr:`output_dtype`
        (the cast's backward hands the update a float32 gradient), keyed."""
        return self.keyed(
            pooled if pooled.dtype == self.output_dtype else pooled.to(self.output_dtype)
        )

    def keyed(self, pooled: Tensor) -> KeyedTensor:
        """``[B, sum of dims]`` pooled embeddings under the tables' embedding names."""
        return KeyedTensor(
            keys=self.embedding_names, length_per_key=self.lengths_per_embedding, values=pooled
        )


def _validate_tables(tables: Sequence[EmbeddingBagConfig]) -> None:
    if not tables:
        raise ValueError("tables must not be empty")
    names: set[str] = set()
    for table in tables:
        if table.name in names:
            raise ValueError(f"Duplicate table name {table.name}")
        names.add(table.name)
        if table.num_embeddings <= 0 or table.embedding_dim <= 0:
            raise ValueError(
                f"table '{table.name}': num_embeddings and embedding_dim must be > 0, "
                f"got {table.num_embeddings} and {table.embedding_dim}"
            )
        if table.data_type not in (DataType.FP32, DataType.FP16, DataType.BF16):
            raise ValueError(
                f"table '{table.name}': data_type must be FP32, FP16 or BF16 (half types are "
                f"stored in half and updated in float32 with stochastic rounding), got "
                f"{table.data_type}"
            )
        if table.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ValueError(
                f"table '{table.name}': pooling must be SUM or MEAN, got {table.pooling}"
            )
        if not table.feature_names:
            table.feature_names = [table.name]  # TorchRec's convention
        if len(set(table.feature_names)) != len(table.feature_names):
            raise ValueError(f"table '{table.name}' lists a feature twice: {table.feature_names}")


def _key_permutation(keys: tuple[str, ...], wanted: list[str]) -> Optional[list[int]]:
    """KJT key indices in table-batch order (a feature shared by tables repeats)."""
    expected = sorted(set(wanted))
    missing = [k for k in expected if k not in keys]
    unexpected = [k for k in keys if k not in expected]
    duplicated = sorted({k for k in keys if keys.count(k) > 1})
    if missing or unexpected or duplicated:
        raise ValueError(
            "KeyedJaggedTensor keys do not match the collection's features: "
            f"missing {missing}, unexpected {unexpected}, duplicated {duplicated}; "
            f"expected exactly {expected}"
        )
    permutation = [keys.index(k) for k in wanted]
    return None if permutation == list(range(len(keys))) else permutation


def _check_structure(
    features: KeyedJaggedTensor, values: Tensor, weights: Optional[Tensor], is_weighted: bool
) -> None:
    """What a KJT's structure must be that its types show (the lookup op checks what only
    its values show: :func:`~torchrec_cowclip.embedding.batched_lookup.BatchedLookup.forward_impl`)."""
    if features.variable_stride_per_key():
        raise ValueError(
            "variable-batch KeyedJaggedTensors (stride per key) are not supported; "
            "give every feature the same batch size"
        )
    if values.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"KeyedJaggedTensor values must be int32 or int64 ids, got {values.dtype}")
    if is_weighted and weights is None:
        raise ValueError(
            "this collection is weighted (is_weighted=True) but the "
            "KeyedJaggedTensor has no weights"
        )

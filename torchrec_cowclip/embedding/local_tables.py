"""A collection's tables as it stores them: the table configs (checked), their features in
lookup order, the table batches of one dim, pooling and data type, the one row kernel the
batches share (chosen from the kernel mode, again after a device move) and each table's
counter-based initialisation.

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
from typing import Optional

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.embedding.row_init import RowInit, row_initializers
from torchrec_cowclip.embedding.row_kernels import RowKernel, select_kernel
from torchrec_cowclip.embedding.table_batch import TableBatch, group_into_table_batches
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.row_step import kernel_mode as resolve_kernel_mode

__all__ = ["LocalTables"]


class LocalTables:
    """The tables of one unsharded collection, stored as table batches.

    Args:
        tables: TorchRec's table configs (checked here: names, sizes, data type, pooling,
            features; a table without features takes its name, TorchRec's convention).
        options: how they train (the optimizer, the unclipped tables, stochastic rounding;
            checked against the tables).
        device: where they live.
        kernel_mode: the row kernel's mode, resolved once (an explicit value, else the
            environment's); the kernel itself is chosen from it here and after a device
            move, not per step: building the native one, if it is that, happens now.
        init_seed: the counter-based initialisation's seed (None: ``torch.initial_seed()``).
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        options: CowClipOptions,
        device: torch.device,
        kernel_mode: Optional[str],
        init_seed: Optional[int],
    ) -> None:
        _validate_tables(tables)
        options.check_tables(t.name for t in tables)
        self.configs = tables
        self.rule = options.rule
        self.device = device
        self.kernel_mode = resolve_kernel_mode(kernel_mode)
        kernel = select_kernel(device, options.rule, self.kernel_mode)
        seed = torch.initial_seed() if init_seed is None else int(init_seed)
        self.row_inits: dict[str, Optional[RowInit]] = row_initializers(tables, seed)
        names_by_table = get_embedding_names_by_table(tables)
        self.embedding_names: list[str] = [e for names in names_by_table for e in names]
        self.lengths_per_embedding: list[int] = [
            t.embedding_dim for t in tables for _ in t.feature_names
        ]
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

    def storage_bytes(self) -> int:
        """Bytes of table weights and optimizer state (0 on meta)."""
        return sum(batch.storage_bytes() for batch in self.batches)

    def reset(self, weight_of: Callable[[str], Tensor]) -> None:
        """Initialises every table's weight (``weight_of(name)``: its row initialiser,
        else the config's ``init_fn``) and zeroes the optimizer state and counters."""
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

    def move(self, fn: Callable[[Tensor], Tensor]) -> torch.device:
        """Applies ``fn`` (a device or dtype move) to every batch; a new device gets the
        row kernel of the same mode there. Returns the device they are on."""
        for batch in self.batches:
            batch._apply(fn)
        moved_to = self.batches[0].weight.device
        if moved_to != self.device:
            kernel = select_kernel(moved_to, self.rule, self.kernel_mode)
            for batch in self.batches:
                batch.kernel = kernel
        self.device = moved_to
        return moved_to

    def in_batched_order(self, features: KeyedJaggedTensor, order: list[str]) -> KeyedJaggedTensor:
        """``features`` with its keys in ``order`` (the lookup's: a feature shared by
        tables repeats); refused naming missing, unexpected or repeated keys."""
        keys = tuple(features.keys())
        if keys not in self._key_permutations:
            self._key_permutations[keys] = _key_permutation(keys, order)
        permutation = self._key_permutations[keys]
        return features if permutation is None else features.permute(permutation)


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

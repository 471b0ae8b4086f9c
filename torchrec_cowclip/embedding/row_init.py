"""Counter-based table initialisation: each initial weight is a pure function of
``(seed, table, row, column)``.

Sharding must not change where training starts. TorchRec initialises a sharded table by
calling the config's ``init_fn`` on each rank's local shard, so the weights depend on
the plan and the world size; and building the whole table on every rank first, to copy
the right slice out, defeats sharding. A :class:`RowInit` instead hashes the element's
global coordinates, so any row block (a row-wise or column-wise shard, a data-parallel
replica, a whole table) can be generated on its own, anywhere, bit-identically, and no
torch RNG state is consumed.

Example::

    >>> import torch
    >>> init = RowInit.normal(std=0.01, seed=7, table="t0")
    >>> whole = torch.empty(6, 4)
    >>> _ = init(whole)                        # TorchRec's init_fn protocol: a whole table
    >>> block = torch.empty(2, 2)
    >>> _ = init.fill_(block, row_offset=3, col_offset=2, table_dim=4)  # rows 3-4, cols 2-3
    >>> torch.equal(block, whole[3:5, 2:4])
    True
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig

#: Rows of a table drawn from one generator. A block's values depend on the table's
#: width and the block's index only, so any shard regenerates exactly the blocks it
#: overlaps (at most two partial ones) and copies out its rows and columns.
BLOCK_ROWS = 4096
DISTRIBUTIONS = ("normal", "uniform")


def _block_seed(seed: int, table: str, block: int) -> int:
    """A 63-bit generator seed for one row block of one table (stable across processes
    and Python runs, unlike ``hash``)."""
    name = zlib.crc32(table.encode("utf-8"))
    low = zlib.crc32(f"{seed}:{name}:{block}:lo".encode("ascii"))
    high = zlib.crc32(f"{seed}:{name}:{block}:hi".encode("ascii"))
    return ((high & 0x7FFFFFFF) << 32) | low


@dataclass(frozen=True)
class RowInit:
    """A table's initial weights as a function of ``(seed, table, row, column)``.

    Usable as an ``EmbeddingBagConfig.init_fn`` (called with the whole table), and by
    the sharded kernels on any block of rows and columns through :meth:`fill_`.

    Args:
        distribution: ``"normal"`` (``a`` = mean, ``b`` = std) or ``"uniform"``
            (on ``[a, b)``).
        a, b: the distribution's parameters.
        seed: the run's seed.
        table: the table's name (two tables with one seed get different weights).
    """

    distribution: str
    a: float
    b: float
    seed: int
    table: str

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"RowInit distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}"
            )
        if not (math.isfinite(self.a) and math.isfinite(self.b)):
            raise ValueError(f"RowInit parameters must be finite, got a={self.a}, b={self.b}")
        if self.distribution == "normal" and self.b < 0:
            raise ValueError(f"RowInit normal std must be >= 0, got {self.b}")
        if self.distribution == "uniform" and self.b < self.a:
            raise ValueError(f"RowInit uniform bounds must have a <= b, got [{self.a}, {self.b})")

    @classmethod
    def normal(cls, std: float, seed: int, table: str, mean: float = 0.0) -> "RowInit":
        """N(mean, std**2) weights (the reference's N(0, 1e-2) tables)."""
        return cls("normal", float(mean), float(std), int(seed), table)

    @classmethod
    def uniform(cls, low: float, high: float, seed: int, table: str) -> "RowInit":
        """U[low, high) weights (TorchRec's default: ``+-sqrt(1 / num_embeddings)``)."""
        return cls("uniform", float(low), float(high), int(seed), table)

    def __call__(self, weight: Tensor) -> Tensor:
        """Fills a whole table in place (TorchRec's ``init_fn`` protocol)."""
        return self.fill_(weight, row_offset=0, col_offset=0, table_dim=weight.shape[-1])

    @torch.no_grad()
    def fill_(self, weight: Tensor, row_offset: int, col_offset: int, table_dim: int) -> Tensor:
        """Fills ``weight`` (``[rows, cols]``) in place with rows
        ``row_offset:row_offset+rows`` and columns ``col_offset:col_offset+cols`` of the
        table, whose full width is ``table_dim``.

        Values are drawn on the CPU by torch's generator, one :data:`BLOCK_ROWS`-row
        block of the full width at a time, so they do not depend on the device, the
        shard boundaries or the world size.
        """
        if weight.dim() != 2:
            raise ValueError(f"RowInit fills 2-d tables, got shape {tuple(weight.shape)}")
        rows, cols = weight.shape
        if col_offset < 0 or row_offset < 0 or col_offset + cols > table_dim:
            raise ValueError(
                f"table '{self.table}': block at rows {row_offset}+{rows}, columns "
                f"{col_offset}+{cols} is outside a table of width {table_dim}"
            )
        if rows == 0 or cols == 0 or weight.device.type == "meta":
            return weight
        generator = torch.Generator(device="cpu")
        first, last = row_offset // BLOCK_ROWS, (row_offset + rows - 1) // BLOCK_ROWS
        for block in range(first, last + 1):
            lo = max(block * BLOCK_ROWS, row_offset)
            hi = min((block + 1) * BLOCK_ROWS, row_offset + rows)
            # The block's full height, even past this table's end: then a block's
            # values never depend on where the table (or a shard) stops.
            generator.manual_seed(_block_seed(self.seed, self.table, block))
            if self.distribution == "uniform":
                values = torch.empty(BLOCK_ROWS, table_dim).uniform_(
                    self.a, self.b, generator=generator
                )
            else:
                values = torch.empty(BLOCK_ROWS, table_dim).normal_(
                    self.a, self.b, generator=generator
                )
            piece = values[
                lo - block * BLOCK_ROWS : hi - block * BLOCK_ROWS, col_offset : col_offset + cols
            ]
            weight[lo - row_offset : hi - row_offset].copy_(piece)
        return weight


def _as_row_init(
    init_fn: Optional[Callable[..., object]], seed: int, table: str
) -> Optional[RowInit]:
    """The counter-based equivalent of ``init_fn`` where one exists: a :class:`RowInit`
    itself, or a ``functools.partial`` of ``torch.nn.init.uniform_`` / ``normal_`` with
    keyword parameters (TorchRec's default init is the former)."""
    if isinstance(init_fn, RowInit):
        return init_fn
    if not isinstance(init_fn, functools.partial) or init_fn.args:
        return None
    kw = dict(init_fn.keywords)
    if init_fn.func is torch.nn.init.uniform_ and set(kw) <= {"a", "b"}:
        return RowInit.uniform(kw.get("a", 0.0), kw.get("b", 1.0), seed, table)
    if init_fn.func is torch.nn.init.normal_ and set(kw) <= {"mean", "std"}:
        return RowInit.normal(kw.get("std", 1.0), seed, table, mean=kw.get("mean", 0.0))
    return None


def row_initializers(
    tables: Sequence[EmbeddingBagConfig], seed: int
) -> Dict[str, Optional[RowInit]]:
    """Per table, the :class:`RowInit` its weights start from, or None for an
    ``init_fn`` with no counter-based equivalent (it is then called as given: on the
    whole table unsharded, on each local shard sharded, as TorchRec does).

    Example::

        >>> from torchrec import EmbeddingBagConfig
        >>> t = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100,
        ...                        feature_names=["f"])   # TorchRec's default uniform init
        >>> row_initializers([t], seed=0)["t"].distribution
        'uniform'
    """
    return {t.name: _as_row_init(t.init_fn, seed, t.name) for t in tables}

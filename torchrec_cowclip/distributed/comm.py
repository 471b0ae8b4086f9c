"""The collectives of the sharded CowClip update.

Two exchanges make a sharded step equal to the unsharded one:

* column-wise tables (:class:`ColumnShardGroups`): every shard of a table holds some
  columns of the same rows (each sees the same ids), so the whole-row sums the clip
  needs (:func:`~torchrec_cowclip.optim.functional.partial_row_sums`) are the sum of the
  shards' parts: one ``all_reduce`` per set of ranks holding a table's shards;
* data-parallel tables (:func:`all_gather_row_gradients`): every replica saw only its
  local batch, so the replicas exchange their ``(rows, counts, row gradients)`` and each
  applies the update of the union.

Both raise :class:`CollectiveError`, naming the exchange and the ranks involved, when
a peer rank died or the process group timed out, instead of leaving the caller to
decode a transport error.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from torchrec_cowclip.compat import process_group_timeout
from torchrec_cowclip.embedding.row_gradients import RowGradients

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective of the sharded CowClip update failed (a peer died or timed out)."""


#: Text that marks a transport failure of a collective in a ``RuntimeError`` (gloo and
#: NCCL raise plain ``RuntimeError``s for a peer that died or timed out, e.g. gloo's
#: "Connection reset by peer", "Timed out waiting ... for recv", "Application timeout
#: caused pair closure").
_TRANSPORT_MARKERS = (
    "gloo",
    "NCCL",
    "nccl",
    "ProcessGroup",
    "c10d",
    "imed out",
    "timeout",
    "Connection",
    "pair closure",
)


def is_transport_error(error: BaseException) -> bool:
    """Whether ``error`` is a collective's transport failure (a dead or hung peer, a
    timeout) rather than an error of the computation around it."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(m in str(error) for m in _TRANSPORT_MARKERS)
    )


def run_collective(what: str, pg: Optional[dist.ProcessGroup], fn: Callable[[], T]) -> T:
    """Runs ``fn`` (one or more collectives on ``pg``), turning a transport failure into a
    :class:`CollectiveError` that says, in one line, which exchange failed, on which rank,
    among whom and after how long a wait. Other errors pass unchanged, and so does a
    :class:`CollectiveError` of an exchange inside ``fn`` (it names its exchange)."""
    try:
        return fn()
    except CollectiveError:
        raise
    except RuntimeError as error:
        if not is_transport_error(error) or not dist.is_initialized():
            raise
        ranks = dist.get_process_group_ranks(pg) if pg is not None else "all"
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        raise CollectiveError(
            f"{what} failed on rank {dist.get_rank()} (ranks {ranks} of "
            f"{dist.get_world_size()}, timeout {process_group_timeout(pg)}): {first[:300]}. "
            "A peer rank probably died or stopped responding; the step cannot complete."
        ) from error


class ColumnShardGroups:
    """Who holds the column shards of which table, with a process group per set of ranks.

    Created at sharding time on every rank from the (global) sharding plan, so every
    rank creates the same groups in the same order, as ``torch.distributed.new_group``
    requires. A set equal to the whole sharding group reuses it; a set of one rank
    (all shards of a table local) needs no communication.

    Args:
        table_ranks: per column-sharded table, the ranks (in ``pg``) holding its shards.
        pg: the sharding environment's process group.

    Example (on every rank of ``pg``; needs an initialised process group)::

        groups = ColumnShardGroups({"t": [0, 1], "u": [1, 1]}, pg)
        totals = groups.all_reduce_by_table({"t": partial_t, "u": partial_u})
    """

    def __init__(self, table_ranks: Mapping[str, Sequence[int]], pg: dist.ProcessGroup) -> None:
        self._pg = pg
        members = dist.get_process_group_ranks(pg)
        self._my_rank = dist.get_rank(pg)
        tables_by_ranks: Dict[Tuple[int, ...], List[str]] = {}
        for table in sorted(table_ranks):
            key = tuple(sorted(set(table_ranks[table])))
            tables_by_ranks.setdefault(key, []).append(table)
        # Sorted so that every rank issues the all-reduces of a step in the same global
        # order: ranks sharing two groups meet in both in the same order, so blocking
        # collectives cannot wait on each other in a cycle.
        self._groups: List[Tuple[Tuple[int, ...], List[str], Optional[dist.ProcessGroup]]] = []
        for ranks in sorted(tables_by_ranks):
            if len(ranks) == 1:
                group = None
            elif len(ranks) == len(members):
                group = pg
            else:
                group = _subgroup([members[r] for r in ranks], process_group_timeout(pg))
            self._groups.append((ranks, tables_by_ranks[ranks], group))

    def all_reduce_by_table(self, partials: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """Sums each table's per-row partial sums over the ranks holding its shards.

        ``partials`` holds, for every column-sharded table this rank has shards of, this
        rank's ``[U_t, k]`` contribution (rows aligned across the shards). Returns the
        totals, same keys and shapes.
        """
        totals: Dict[str, Tensor] = {}
        for ranks, tables, group in self._groups:
            if self._my_rank not in ranks:
                continue
            missing = [t for t in tables if t not in partials]
            if missing:
                raise RuntimeError(
                    f"rank {self._my_rank} holds shards of {missing} but computed no row "
                    "sums for them this step; column shards must all take part in a step"
                )
            if group is None:
                totals.update({t: partials[t] for t in tables})
                continue
            flat = torch.cat([partials[t] for t in tables], dim=0).contiguous()
            run_collective(
                f"CowClip sharded update: all-reduce of whole-row norms of column-sharded tables {tables} "
                f"across ranks {list(ranks)}",
                group,
                lambda: dist.all_reduce(flat, group=group),
            )
            for t, total in zip(tables, flat.split([partials[t].shape[0] for t in tables])):
                totals[t] = total
        return totals


_SUBGROUPS: Dict[Tuple[Tuple[int, ...], Optional[timedelta]], dist.ProcessGroup] = {}


def _subgroup(global_ranks: List[int], timeout: Optional[timedelta]) -> dist.ProcessGroup:
    """A process group over ``global_ranks``, shared by every module that needs it.

    ``new_group`` must be entered by every process of the world in the same order; the
    sharding of a model runs the same code on every rank, and the cache is filled in the
    same order everywhere, so hits and misses agree across ranks.
    """
    key = (tuple(global_ranks), timeout)
    if key not in _SUBGROUPS:
        _SUBGROUPS[key] = dist.new_group(ranks=list(global_ranks), timeout=timeout)
    return _SUBGROUPS[key]


def all_gather_row_gradients(
    parts: Sequence[RowGradients], pg: dist.ProcessGroup
) -> List[List[RowGradients]]:
    """Every replica's row gradients of each part (table batch), in rank order.

    Three collectives however many parts: the sizes, then all ids and counts as one
    int64 buffer, then all gradients as one float buffer (each padded to the largest
    rank's length, since ``all_gather`` needs equal sizes).

    Returns:
        ``result[p][r]`` is rank ``r``'s :class:`RowGradients` of part ``p``.
    """
    world = dist.get_world_size(pg)
    device = parts[0].grad.device if parts else torch.device("cpu")
    dims = [p.grad.shape[1] for p in parts]
    sizes = torch.tensor([p.rows.numel() for p in parts], dtype=torch.int64, device=device)
    ints = torch.cat([torch.cat([p.rows, p.counts]) for p in parts]) if parts else sizes[:0]
    floats = (
        torch.cat([p.grad.reshape(-1) for p in parts]) if parts else torch.zeros(0, device=device)
    )

    def exchange() -> Tuple[Tensor, List[Tensor], List[Tensor]]:
        all_sizes = [torch.empty_like(sizes) for _ in range(world)]
        dist.all_gather(all_sizes, sizes, group=pg)
        per_rank = torch.stack(all_sizes)  # [world, parts]
        int_len = (2 * per_rank).sum(dim=1)
        float_len = (per_rank * torch.tensor(dims, dtype=torch.int64, device=device)).sum(dim=1)
        return per_rank, _gather_padded(ints, int_len, pg), _gather_padded(floats, float_len, pg)

    per_rank, all_ints, all_floats = run_collective(
        f"CowClip sharded update: all-gather of the row gradients of {len(parts)} data-parallel table batch(es)",
        pg,
        exchange,
    )
    result: List[List[RowGradients]] = [[] for _ in parts]
    for r in range(world):
        counts_r = per_rank[r].tolist()
        int_chunks = all_ints[r].split([2 * u for u in counts_r])
        float_chunks = all_floats[r].split([u * d for u, d in zip(counts_r, dims)])
        for p, (u, d) in enumerate(zip(counts_r, dims)):
            rows, counts = int_chunks[p].split([u, u])
            result[p].append(
                RowGradients(rows=rows, counts=counts, grad=float_chunks[p].view(u, d))
            )
    return result


def _gather_padded(local: Tensor, lengths: Tensor, pg: dist.ProcessGroup) -> List[Tensor]:
    """All ranks' 1-d ``local`` (of the given per-rank ``lengths``), unpadded, in rank order."""
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    gathered = [torch.empty_like(padded) for _ in range(lengths.numel())]
    dist.all_gather(gathered, padded, group=pg)
    return [g[: int(n)] for g, n in zip(gathered, lengths.tolist())]

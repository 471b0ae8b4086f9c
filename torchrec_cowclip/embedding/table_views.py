"""The per-table weights a collection serves: each a view into its table batch, held under
the name TorchRec's ``EmbeddingBagCollection`` uses (``embedding_bags.<table>.weight``),
kept pointing at the batches (and at the fused optimizer's state) across device moves and
copies.

Example::

    >>> import torch
    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec_cowclip import CowClipEmbeddingBagCollection
    >>> ebc = CowClipEmbeddingBagCollection([EmbeddingBagConfig(
    ...     name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])])
    >>> weight = table_weight(ebc.embedding_bags, "t")
    >>> weight.data_ptr() == ebc._batches[0].weight.data_ptr(), list(ebc.state_dict())
    (True, ['embedding_bags.t.weight'])
"""

from __future__ import annotations

from typing import Any, MutableMapping, Sequence, Set

import torch
from torch import nn

from torchrec_cowclip.compat import mark_updated_in_backward
from torchrec_cowclip.embedding.table_batch import TableBatch

__all__ = ["TableWeight", "bind_table_views", "table_weight", "table_weights"]


class TableWeight(nn.Module):
    """Holds one table's weight, a view into its table batch, under the name
    (``embedding_bags.<table>.weight``) that ``torchrec.EmbeddingBagCollection`` uses."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


def table_weights(batches: Sequence[TableBatch]) -> nn.ModuleDict:
    """Each table of ``batches`` as a :class:`TableWeight` whose parameter views its batch
    and carries TorchRec's mark of a parameter updated inside backward (which keeps it
    out of dense optimizers built with ``in_backward_optimizer_filter``)."""
    bags = nn.ModuleDict()
    for batch in batches:
        for i, name in enumerate(batch.table_names):
            param = nn.Parameter(batch.table_weight(i))
            mark_updated_in_backward(param)
            bags[name] = TableWeight(param)
    return bags


def table_weight(bags: nn.ModuleDict, name: str) -> nn.Parameter:
    """Table ``name``'s parameter."""
    holder = bags[name]
    assert isinstance(holder, TableWeight)
    return holder.weight


def bind_table_views(
    bags: nn.ModuleDict, batches: Sequence[TableBatch], state: MutableMapping[Any, Any]
) -> Set[int]:
    """Re-points every table's parameter (and its optimizer ``state``) at its batch's
    tensors, after a device move, a copy or an unpickling cloned them apart. Returns the
    parameters' ids (what a move of the module must leave as they are)."""
    bound: Set[int] = set()
    for batch in batches:
        for i, name in enumerate(batch.table_names):
            param = table_weight(bags, name)
            view = batch.table_weight(i)
            if param.device == view.device:
                param.data = view
            else:
                # `.data` cannot change a parameter's device type (meta -> cpu): swap the
                # contents, keeping the object the optimizer holds.
                marks = dict(param.__dict__)
                # (swap_tensors carries no annotations)
                torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
                    param, nn.Parameter(view, param.requires_grad)
                )
                param.__dict__.update(marks)
            state[param] = batch.table_state(i)
            bound.add(id(param))
    return bound

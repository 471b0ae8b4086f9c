"""TorchRec's own DLRM and DLRM_DCN, built on a CowClip embedding collection.

Nothing of DLRM is re-implemented here: :func:`build_dlrm` builds the collection
and hands it to ``torchrec.models.dlrm.DLRM`` (or ``DLRM_DCN``) unchanged, which shows
that :class:`CowClipEmbeddingBagCollection` slots into TorchRec's models as is.
:class:`DLRMModel` only adapts the interface to this package's models:
``forward(dense, sparse) -> logits [B]`` plus ``dense_parameters()``.

DLRM's constraints, checked up front with a clear message: it needs dense features
(its bottom MLP's output is one of the interacting vectors), every table of one
dim equal to the bottom MLP's last size, and each feature in one table only (its
``SparseArch`` reads the pooled ``KeyedTensor`` by feature name, while a shared
feature's key is ``feature@table``). So DLRM has no first-order tables.

Example::

    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> from torchrec_cowclip.models import build_dlrm
    >>> model = build_dlrm(["C1", "C2"], [100, 50], num_dense=13, embedding_dim=16,
    ...                    dense_arch_layer_sizes=(64, 16), over_arch_layer_sizes=(64, 1))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id per field
    ...     keys=["C1", "C2"], values=torch.tensor([5, 99, 7, 49]),
    ...     lengths=torch.ones(4, dtype=torch.int64))
    >>> model(torch.rand(2, 13), kjt).shape     # logits [B]
    torch.Size([2])
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch
from torch import Tensor
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.models.base import CTRModel
from torchrec_cowclip.models.embeddings import (
    DeviceLike,
    EmbeddingOptions,
    build_embedding_collection,
    build_table_configs,
)

DLRMInteraction = Literal["dot", "dcn"]


class DLRMModel(CTRModel):
    """A ``torchrec.models.dlrm.DLRM`` (or subclass) as ``forward(dense, sparse) -> [B]``.

    Args:
        dlrm: the TorchRec model; its ``sparse_arch.embedding_bag_collection`` is this
            model's :attr:`embedding_collection`.
        num_dense: its ``dense_in_features``.

    Example::

        >>> from torchrec_cowclip import CowClipEmbeddingBagCollection, CowClipOptions
        >>> ebc = CowClipEmbeddingBagCollection([EmbeddingBagConfig(
        ...     name="t_C1", embedding_dim=8, num_embeddings=100, feature_names=["C1"])],
        ...     options=CowClipOptions(lr=1e-4))
        >>> model = DLRMModel(DLRM(embedding_bag_collection=ebc, dense_in_features=13,
        ...     dense_arch_layer_sizes=[32, 8], over_arch_layer_sizes=[16, 1]), num_dense=13)
        >>> model.embedding_collection is ebc
        True
    """

    def __init__(self, dlrm: DLRM, num_dense: int) -> None:
        super().__init__()
        self.dlrm = dlrm
        self.num_dense = num_dense
        self.sparse_feature_names = list(dlrm.sparse_arch.sparse_feature_names)

    @property
    def embedding_collection(self) -> EmbeddingBagCollectionInterface:
        return self.dlrm.sparse_arch.embedding_bag_collection

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        """``dense [B, num_dense]``, ``sparse`` KJT of :attr:`sparse_feature_names` -> logits ``[B]``."""
        self._check_inputs(dense)
        logits: Tensor = self.dlrm(dense_features=dense, sparse_features=sparse).squeeze(1)
        return logits


def check_dlrm_tables(
    tables: Sequence[EmbeddingBagConfig], num_dense: int, bottom_out: int
) -> None:
    """Raises ValueError, naming the problem, where TorchRec's DLRM would fail later or
    with a bare assert: no dense features, tables of several dims, a dim other than the
    bottom MLP's output, or a feature looked up by more than one table.

    Example::

        >>> tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=10, num_embeddings=100,
        ...                              feature_names=[f]) for f in ("C1", "C2")]
        >>> check_dlrm_tables(tables, num_dense=13, bottom_out=10)     # fine: no error
        >>> check_dlrm_tables(tables, num_dense=13, bottom_out=16)     # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: ...
    """
    if num_dense <= 0:
        raise ValueError(
            "DLRM needs dense features (num_dense > 0): its bottom MLP output is one of "
            "the vectors it interacts; use deepfm/wdl/dcn/dcnv2 for data without dense "
            "features (e.g. Avazu)"
        )
    dims = sorted({t.embedding_dim for t in tables})
    if len(dims) != 1:
        raise ValueError(
            f"DLRM needs every table of one embedding dim, got dims {dims} "
            f"({[(t.name, t.embedding_dim) for t in tables]})"
        )
    if dims[0] != bottom_out:
        raise ValueError(
            f"DLRM's bottom MLP must end in the embedding dim {dims[0]}, "
            f"but dense_arch_layer_sizes ends in {bottom_out}"
        )
    features = [f for t in tables for f in t.feature_names]
    shared = sorted({f for f in features if features.count(f) > 1})
    if shared:
        raise ValueError(
            "DLRM reads pooled embeddings by feature name, so a feature may be in one "
            f"table only; shared: {shared}"
        )


def build_dlrm(
    sparse_names: Sequence[str],
    cardinalities: Sequence[int],
    num_dense: int,
    embedding_dim: int = 10,
    dense_arch_layer_sizes: Optional[Sequence[int]] = None,
    over_arch_layer_sizes: Sequence[int] = (400, 400, 400, 1),
    interaction: DLRMInteraction = "dot",
    dcn_num_layers: int = 3,
    dcn_low_rank_dim: int = 32,
    embedding: EmbeddingOptions = EmbeddingOptions(),
    device: DeviceLike = None,
) -> DLRMModel:
    """TorchRec's ``DLRM`` (``interaction="dot"``) or ``DLRM_DCN`` (``"dcn"``) on a
    CowClip (or stock) collection of one ``embedding_dim`` table per feature.

    Args:
        sparse_names, cardinalities: one table per feature, ``cardinalities`` rows.
        num_dense: dense features; must be > 0.
        embedding_dim: D of every table.
        dense_arch_layer_sizes: bottom MLP; must end in ``embedding_dim``
            (default ``(400, 400, embedding_dim)``).
        over_arch_layer_sizes: top MLP; at least two layers, ending in 1.
        interaction: pairwise dot products (DLRM) or a low-rank cross net (DLRM_DCN).
        dcn_num_layers, dcn_low_rank_dim: DLRM_DCN's ``LowRankCrossNet``.
        embedding: backend, in-backward optimizer, CowClip and init of the tables
            (every table is clipped: DLRM has no first-order tables).
        device: where tables and layers live.

    Example::

        >>> import torch
        >>> from torchrec import KeyedJaggedTensor
        >>> model = build_dlrm(["C1", "C2"], [100, 50], num_dense=13,
        ...                    interaction="dcn", dcn_low_rank_dim=8)
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id per field
        ...     keys=["C1", "C2"], values=torch.tensor([5, 99, 7, 49]),
        ...     lengths=torch.ones(4, dtype=torch.int64))
        >>> model(torch.rand(2, 13), kjt).shape
        torch.Size([2])
    """
    if interaction not in ("dot", "dcn"):
        raise ValueError(f"interaction must be 'dot' or 'dcn', got {interaction!r}")
    bottom = (
        list(dense_arch_layer_sizes)
        if dense_arch_layer_sizes is not None
        else [400, 400, embedding_dim]
    )
    top = list(over_arch_layer_sizes)
    if len(top) < 2 or top[-1] != 1:
        raise ValueError(
            f"over_arch_layer_sizes needs at least two layers and must end in 1, got {top}"
        )
    if not bottom:
        raise ValueError("dense_arch_layer_sizes must not be empty")
    tables, _ = build_table_configs(
        sparse_names, cardinalities, embedding_dim, embedding.init_std, with_first_order=False
    )
    check_dlrm_tables(tables, num_dense, bottom[-1])  # before allocating the tables
    collection = build_embedding_collection(tables, embedding, device=device)
    dense_device = None if device is None else torch.device(device)
    if interaction == "dot":
        dlrm: DLRM = DLRM(
            embedding_bag_collection=collection,
            dense_in_features=num_dense,
            dense_arch_layer_sizes=bottom,
            over_arch_layer_sizes=top,
            dense_device=dense_device,
        )
    else:
        dlrm = DLRM_DCN(
            embedding_bag_collection=collection,
            dense_in_features=num_dense,
            dense_arch_layer_sizes=bottom,
            over_arch_layer_sizes=top,
            dcn_num_layers=dcn_num_layers,
            dcn_low_rank_dim=dcn_low_rank_dim,
            dense_device=dense_device,
        )
    if dense_device is not None:
        # TorchRec builds the interaction (a buffer, DLRM_DCN's cross net) without a
        # device argument; the tables are already where they belong.
        for arch in (dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch):
            arch.to(dense_device)
    return DLRMModel(dlrm, num_dense)

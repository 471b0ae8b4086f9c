"""CTR models of the CowClip paper on TorchRec, and one factory for them all.

Every model is ``forward(dense [B, n_dense], sparse: KeyedJaggedTensor) -> logits [B]``,
owns its tables as ``model.embedding_collection`` (a
:class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`, or a stock
``torchrec.EmbeddingBagCollection`` with ``embedding_backend="torchrec"``) and lists
what a dense optimizer must train in ``model.dense_parameters()``.

Example::

    >>> import torch, torch.nn.functional as F
    >>> from torchrec import KeyedJaggedTensor
    >>> from torchrec_cowclip import CowClip, CowClipOptions
    >>> from torchrec_cowclip.models import build_model
    >>> clip = CowClip.from_reference(r=1.0, bound=1e-5, embedding_dim=10)
    >>> model = build_model("deepfm", num_dense=13, sparse_names=["C1", "C2"],
    ...                     cardinalities=[100, 50],
    ...                     embedding_options=CowClipOptions(lr=1e-4, cowclip=clip))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id per field
    ...     keys=["C1", "C2"], values=torch.tensor([5, 99, 7, 49]),
    ...     lengths=torch.ones(4, dtype=torch.int64))
    >>> dense, labels = torch.rand(2, 13), torch.tensor([0.0, 1.0])
    >>> dense_opt = torch.optim.Adam(model.dense_parameters(), lr=8e-4)
    >>> row = model.embedding_collection.embedding_bags["emb_C1"].weight[5].clone()
    >>> loss = F.binary_cross_entropy_with_logits(model(dense, kjt), labels)
    >>> loss.backward()                 # the embedding tables are updated here
    >>> dense_opt.step(); dense_opt.zero_grad()
    >>> bool((model.embedding_collection.embedding_bags["emb_C1"].weight[5] != row).any())
    True
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from torchrec_cowclip.models.base import CTRModel, FirstOrderLogit, dense_parameters_of
from torchrec_cowclip.models.dcn import DCN, DCNv2
from torchrec_cowclip.models.deepfm import DeepFM, fm_second_order
from torchrec_cowclip.models.dlrm import DLRMInteraction, DLRMModel, build_dlrm, check_dlrm_tables
from torchrec_cowclip.models.embeddings import (
    DeviceLike,
    EmbeddingBackend,
    EmbeddingOptions,
    FieldEmbeddings,
    build_embedding_collection,
    build_table_configs,
    embedding_table_name,
    linear_table_name,
)
from torchrec_cowclip.models.wide_deep import WideAndDeep
from torchrec_cowclip.optim.options import DEFAULT_OPTIONS, CowClipOptions


def _field_model(cls: Callable[..., CTRModel]) -> Callable[..., CTRModel]:
    def build(*, hidden: Sequence[int], cross_layers: int, **common: Any) -> CTRModel:
        extra = {"cross_layers": cross_layers} if cls in (DCN, DCNv2) else {}
        return cls(hidden=hidden, **extra, **common)

    return build


def _dlrm(interaction: DLRMInteraction) -> Callable[..., CTRModel]:
    def build(*, hidden: Sequence[int], cross_layers: int, **common: Any) -> CTRModel:
        # hidden sizes both MLPs unless the caller sizes them with model_options.
        common.setdefault("dense_arch_layer_sizes", (*hidden, common["embedding_dim"]))
        common.setdefault("over_arch_layer_sizes", (*hidden, 1))
        if interaction == "dcn":
            common.setdefault("dcn_num_layers", cross_layers)
        return build_dlrm(interaction=interaction, **common)

    return build


MODELS: Dict[str, Callable[..., CTRModel]] = {
    "deepfm": _field_model(DeepFM),
    "wdl": _field_model(WideAndDeep),
    "dcn": _field_model(DCN),
    "dcnv2": _field_model(DCNv2),
    "dlrm": _dlrm("dot"),
    "dlrm_dcn": _dlrm("dcn"),
}


def build_model(
    name: str,
    *,
    sparse_names: Sequence[str],
    cardinalities: Sequence[int],
    num_dense: Optional[int] = None,
    dense_names: Optional[Sequence[str]] = None,
    embedding_dim: int = 10,
    hidden: Sequence[int] = (400, 400, 400),
    cross_layers: int = 3,
    init_std: float = 1e-2,
    embedding_backend: EmbeddingBackend = "cowclip",
    device: DeviceLike = None,
    init_seed: Optional[int] = None,
    table_device: DeviceLike = None,
    embedding_options: Optional[CowClipOptions] = None,
    embedding_dtype: str = "fp32",
    **model_options: Any,
) -> CTRModel:
    """Builds one of :data:`MODELS` with the paper's defaults (D 10, DNN 400-400-400,
    3 cross layers, N(0, 1e-2) embeddings, Adam lr 1e-4 on the tables).

    Args:
        name: ``"deepfm"``, ``"wdl"``, ``"dcn"``, ``"dcnv2"``, ``"dlrm"`` (TorchRec's
            DLRM) or ``"dlrm_dcn"`` (TorchRec's DLRM_DCN).
        sparse_names, cardinalities: the sparse features and their table sizes.
        num_dense / dense_names: the dense features, by count or by name (one of the
            two; both only if they agree). 0 is fine except for the DLRMs.
        embedding_dim: D of the clipped tables.
        hidden: DNN layer sizes (DLRM: both its bottom MLP, then D, and its top MLP,
            then 1).
        cross_layers: cross layers of DCN / DCNv2 / DLRM_DCN.
        init_std: tables start as N(0, init_std).
        embedding_backend: ``"cowclip"`` (fused, in backward) or ``"torchrec"`` (stock
            EBC whose weights a dense optimizer trains; ``embedding_options`` is then
            unused).
        embedding_options: the in-backward optimizer, its hyperparameters and the clip
            as one :class:`~torchrec_cowclip.optim.options.CowClipOptions` (weight decay
            is ``2 * lambda`` of the reference's ``--l2``; the reference's Criteo clip is
            ``CowClip.from_reference(r=1.0, bound=1e-5, embedding_dim=10)``). None:
            ``CowClipOptions()``.
        device: where tables and layers live.
        init_seed: seed of the tables' counter-based initial weights (None:
            ``torch.initial_seed()``): the same for every sharding plan and world size.
        table_device: where the tables are built, if not ``device``: ``"meta"`` for
            ``DistributedModelParallel`` to allocate only each rank's shards.
        embedding_dtype: the tables' storage, ``"fp32"``, ``"fp16"`` or ``"bf16"``
            (:class:`~torchrec_cowclip.models.embeddings.EmbeddingOptions`).
        model_options: passed to the model: ``cross_parameterization`` (DCN),
            ``low_rank`` and ``num_experts`` (DCNv2), ``dense_arch_layer_sizes``,
            ``over_arch_layer_sizes`` and ``dcn_low_rank_dim`` (DLRMs).

    Raises:
        ValueError: unknown ``name`` (the message lists the valid ones), inconsistent
            dense arguments, or a model's own constraint (e.g. DLRM without dense).

    Example::

        >>> model = build_model("dcnv2", num_dense=0, sparse_names=["a", "b"],
        ...                     cardinalities=[10, 20], hidden=(32, 32), low_rank=8)
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names are {sorted(MODELS)}")
    n_dense = _resolve_num_dense(num_dense, dense_names)
    embedding = EmbeddingOptions(
        backend=embedding_backend,
        training=DEFAULT_OPTIONS if embedding_options is None else embedding_options,
        init_std=init_std,
        init_seed=init_seed,
        table_device=None if table_device is None else str(table_device),
        data_type=embedding_dtype,
    )
    return MODELS[name](
        sparse_names=list(sparse_names),
        cardinalities=list(cardinalities),
        num_dense=n_dense,
        embedding_dim=embedding_dim,
        hidden=tuple(hidden),
        cross_layers=cross_layers,
        embedding=embedding,
        device=device,
        **model_options,
    )


def _resolve_num_dense(num_dense: Optional[int], dense_names: Optional[Sequence[str]]) -> int:
    if dense_names is not None:
        if num_dense is not None and len(dense_names) != num_dense:
            raise ValueError(f"num_dense={num_dense} disagrees with {len(dense_names)} dense_names")
        n = len(dense_names)
    elif num_dense is not None:
        n = int(num_dense)
    else:
        raise ValueError("give num_dense or dense_names (0 / [] for no dense features)")
    if n < 0:
        raise ValueError(f"num_dense must be >= 0, got {n}")
    return n


__all__ = [
    "CTRModel",
    "DCN",
    "DCNv2",
    "DLRMModel",
    "DeepFM",
    "DeviceLike",
    "EmbeddingBackend",
    "EmbeddingOptions",
    "FieldEmbeddings",
    "FirstOrderLogit",
    "MODELS",
    "WideAndDeep",
    "build_dlrm",
    "build_embedding_collection",
    "build_model",
    "build_table_configs",
    "check_dlrm_tables",
    "dense_parameters_of",
    "embedding_table_name",
    "fm_second_order",
    "linear_table_name",
]

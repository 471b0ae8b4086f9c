"""Embedding tables of the CTR models: one builder for the table configs and the EBC.

Every sparse feature gets an ``embedding_dim`` table (the one CowClip clips) and, for
the DeepCTR-style models (DeepFM, Wide&Deep, DCN, DCNv2), a dim-1 "first-order"
table (the reference's linear part, never clipped). Both kinds live in ONE
collection so a step does one ``EmbeddingBagCollection`` call for all of them.

Example::

    >>> from torchrec_cowclip.models.embeddings import EmbeddingOptions, FieldEmbeddings
    >>> fields = FieldEmbeddings(["C1", "C2"], [100, 50], embedding_dim=10,
    ...                          options=EmbeddingOptions(training=CowClipOptions(lr=1e-4)))
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(   # 2 samples, one id per field
    ...     keys=["C1", "C2"], values=torch.tensor([5, 99, 7, 49]),
    ...     lengths=torch.ones(4, dtype=torch.int64))
    >>> emb, first_order = fields(kjt)
    >>> emb.shape, first_order.shape             # [B, F, D], [B, F]
    (torch.Size([2, 2, 10]), torch.Size([2, 2]))
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import List, Literal, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_cowclip.compat import is_fx_symbolic_tracing
from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.optim.options import DEFAULT_OPTIONS, CowClipOptions

EmbeddingBackend = Literal["cowclip", "torchrec"]
EMBEDDING_BACKENDS: Tuple[str, ...] = ("cowclip", "torchrec")
#: How the tables can store their weights (``EmbeddingBagConfig.data_type``).
EMBEDDING_DTYPES: Tuple[str, ...] = ("fp32", "fp16", "bf16")
DeviceLike = Optional[Union[str, torch.device]]


def embedding_table_name(feature: str) -> str:
    """Name of the ``embedding_dim`` table of ``feature`` (clipped by CowClip)."""
    return f"emb_{feature}"


def linear_table_name(feature: str) -> str:
    """Name of the dim-1 first-order table of ``feature`` (never clipped)."""
    return f"linear_{feature}"


@dataclass(frozen=True)
class EmbeddingOptions:
    """How the embedding tables are built and trained.

    Args:
        backend: ``"cowclip"``: a :class:`CowClipEmbeddingBagCollection` updated inside
            backward as ``training`` says; ``"torchrec"``: a stock
            ``torchrec.EmbeddingBagCollection`` whose weights are ordinary parameters
            for a dense optimizer (``training`` is then unused).
        training: the in-backward optimizer, its hyperparameters and the clip, as one
            :class:`~torchrec_cowclip.optim.options.CowClipOptions` (coupled L2 is
            ``weight_decay``, ``2 * lambda`` of the reference's ``--l2``, applied to
            the first-order tables too, as the reference's ``l2_reg_linear`` is the
            same ``--l2``). The reference's Criteo clip is ``CowClip.from_reference(r=1.0,
            bound=1e-5, embedding_dim=10)``.
        init_std: tables start as N(0, init_std); the reference CowClip runs use 1e-2.
        init_seed: seed of the tables' counter-based initial weights (None:
            ``torch.initial_seed()``); the same seed gives the same tables unsharded and
            under any sharding plan.
        table_device: where the tables are built when not where the dense layers are:
            ``"meta"`` builds them without storage, for
            ``DistributedModelParallel`` to allocate each rank's shards only.
        data_type: how the tables store their weights: ``"fp32"``, or ``"fp16"`` /
            ``"bf16"`` (half the bytes; updated in float32 and rounded back
            stochastically, optimizer state float32; the cowclip backend only).

    Example::

        >>> from torchrec_cowclip.optim.options import CowClipOptions
        >>> opts = EmbeddingOptions(training=CowClipOptions(lr=1e-4, weight_decay=2e-5))
        >>> opts.training.lr, opts.backend
        (0.0001, 'cowclip')
    """

    backend: EmbeddingBackend = "cowclip"
    training: CowClipOptions = DEFAULT_OPTIONS
    init_std: float = 1e-2
    init_seed: Optional[int] = None
    table_device: Optional[str] = None
    data_type: str = "fp32"

    def __post_init__(self) -> None:
        if self.backend not in EMBEDDING_BACKENDS:
            raise ValueError(
                f"embedding backend must be one of {EMBEDDING_BACKENDS}, got {self.backend!r}"
            )
        if self.data_type not in EMBEDDING_DTYPES:
            raise ValueError(
                f"embedding data_type must be one of {EMBEDDING_DTYPES}, got {self.data_type!r}"
            )
        if self.data_type != "fp32" and self.backend != "cowclip":
            raise ValueError(
                f"embedding data_type {self.data_type} needs the cowclip backend (the stock "
                "EBC's half weights would be trained by a dense optimizer in half)"
            )
        if not isinstance(self.training, CowClipOptions):
            raise TypeError(
                f"training must be a CowClipOptions, got {type(self.training).__name__}"
            )
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")
        object.__setattr__(self, "init_std", float(self.init_std))


def validate_sparse_features(sparse_names: Sequence[str], cardinalities: Sequence[int]) -> None:
    """Raises ValueError unless names are non-empty, unique and each has a cardinality > 0."""
    if not sparse_names:
        raise ValueError("at least one sparse feature is required")
    if len(sparse_names) != len(cardinalities):
        raise ValueError(
            f"got {len(sparse_names)} sparse feature names but {len(cardinalities)} cardinalities"
        )
    duplicated = sorted({n for n in sparse_names if list(sparse_names).count(n) > 1})
    if duplicated:
        raise ValueError(f"sparse feature names must be unique, repeated: {duplicated}")
    bad = [(n, c) for n, c in zip(sparse_names, cardinalities) if int(c) <= 0]
    if bad:
        raise ValueError(f"cardinalities must be > 0, got {bad}")


def build_table_configs(
    sparse_names: Sequence[str],
    cardinalities: Sequence[int],
    embedding_dim: int,
    init_std: float,
    with_first_order: bool,
) -> Tuple[List[EmbeddingBagConfig], List[EmbeddingBagConfig]]:
    """One ``embedding_dim`` table per feature and, if asked, one dim-1 table per feature.

    Returns ``(embedding_tables, first_order_tables)``; the second list is empty when
    ``with_first_order`` is False. Pooling is SUM: a one-hot field gives its row as is.

    Example::

        >>> emb, lin = build_table_configs(["C1"], [100], 10, 1e-2, True)
        >>> [(t.name, t.embedding_dim) for t in emb + lin]
        [('emb_C1', 10), ('linear_C1', 1)]
    """
    validate_sparse_features(sparse_names, cardinalities)
    if embedding_dim <= 0:
        raise ValueError(f"embedding_dim must be > 0, got {embedding_dim}")
    # A partial (not a lambda) keeps the configs picklable and deep-copyable.
    init_fn = functools.partial(nn.init.normal_, mean=0.0, std=float(init_std))

    def config(name: str, dim: int, feature: str, rows: int) -> EmbeddingBagConfig:
        return EmbeddingBagConfig(
            name=name,
            embedding_dim=dim,
            num_embeddings=int(rows),
            feature_names=[feature],
            pooling=PoolingType.SUM,
            init_fn=init_fn,
        )

    embedding_tables = [
        config(embedding_table_name(f), embedding_dim, f, n)
        for f, n in zip(sparse_names, cardinalities)
    ]
    first_order_tables = (
        [config(linear_table_name(f), 1, f, n) for f, n in zip(sparse_names, cardinalities)]
        if with_first_order
        else []
    )
    return embedding_tables, first_order_tables


def build_embedding_collection(
    tables: List[EmbeddingBagConfig],
    options: EmbeddingOptions,
    unclipped_tables: Sequence[str] = (),
    device: DeviceLike = None,
) -> EmbeddingBagCollectionInterface:
    """The collection for ``tables``: CowClip-fused or stock TorchRec, by ``options.backend``.

    ``unclipped_tables`` are updated by the in-backward optimizer but never clipped
    (ignored by the torchrec backend, which has no clip).

    Example::

        >>> emb, lin = build_table_configs(["C1"], [100], 10, 1e-2, True)
        >>> ebc = build_embedding_collection(emb + lin, EmbeddingOptions(),
        ...                                  unclipped_tables=[t.name for t in lin])
    """
    if options.table_device is not None:
        device = options.table_device
    if options.data_type != "fp32":
        data_type = DataType(options.data_type.upper())
        tables = [dataclasses.replace(t, data_type=data_type) for t in tables]
    if options.backend == "torchrec":
        return EmbeddingBagCollection(
            tables=tables, device=None if device is None else torch.device(device)
        )
    training = options.training.replace(
        unclipped_tables=options.training.unclipped_tables | frozenset(unclipped_tables)
    )
    return CowClipEmbeddingBagCollection(
        tables, options=training, device=device, init_seed=options.init_seed
    )


class FieldEmbeddings(nn.Module):
    """Looks up every sparse field once: ``[B, F, D]`` embeddings and ``[B, F]`` first-order terms.

    The embedding tables come first and the first-order tables after them in the
    collection, so the pooled ``KeyedTensor`` (whose values are in table order, for
    TorchRec's EBC and the CowClip one alike) splits into the two parts by two views,
    with no per-feature Python loop; a sharded collection's output, in sharding order,
    is regrouped by key.

    Args:
        sparse_names: the fields, in the order of the output's F axis.
        cardinalities: rows of each field's tables.
        embedding_dim: D.
        options: backend, in-backward optimizer, clip and init.
        with_first_order: also build the dim-1 (unclipped) tables.
        device: where the tables live.

    Example::

        >>> fields = FieldEmbeddings(["C1", "C2"], [100, 50], 10, EmbeddingOptions())
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["C1", "C2"], values=torch.tensor([3, 7, 1, 2]),
        ...     lengths=torch.ones(4, dtype=torch.int64))
        >>> emb, first_order = fields(kjt)   # [2, 2, 10], [2, 2]
    """

    def __init__(
        self,
        sparse_names: Sequence[str],
        cardinalities: Sequence[int],
        embedding_dim: int,
        options: EmbeddingOptions,
        with_first_order: bool = True,
        device: DeviceLike = None,
    ) -> None:
        super().__init__()
        embedding_tables, first_order_tables = build_table_configs(
            sparse_names, cardinalities, embedding_dim, options.init_std, with_first_order
        )
        self.sparse_feature_names: List[str] = list(sparse_names)
        self.embedding_dim = embedding_dim
        self.with_first_order = with_first_order
        self.first_order_table_names: List[str] = [t.name for t in first_order_tables]
        self.collection: EmbeddingBagCollectionInterface = build_embedding_collection(
            embedding_tables + first_order_tables,
            options,
            unclipped_tables=self.first_order_table_names,
            device=device,
        )
        self._expected_keys: List[str] = [
            f"{f}@{t.name}" if with_first_order else f
            for t in embedding_tables + first_order_tables
            for f in t.feature_names
        ]
        n = len(self.sparse_feature_names)
        self._key_groups: List[List[str]] = [self._expected_keys[:n], self._expected_keys[n:]]

    def forward(self, sparse: KeyedJaggedTensor) -> Tuple[Tensor, Optional[Tensor]]:
        """Returns ``(embeddings [B, F, D], first_order [B, F] or None)``."""
        pooled = self.collection(sparse)
        n_fields = len(self.sparse_feature_names)
        # (Under TorchRec's pipeline tracing the keys are not known: take the general path.)
        if not is_fx_symbolic_tracing() and pooled.keys() == self._expected_keys:
            # Table order (unsharded collections): two views, no copy.
            values = pooled.values()
            width = n_fields * self.embedding_dim
            if self.with_first_order:
                # One split, not two slices: its backward is one cat, where each slice's
                # is a zero-filled [B, F * (D + 1)] buffer plus an add.
                emb_values, first_order = torch.split(values, [width, n_fields], dim=1)
            else:
                emb_values, first_order = values[:, :width], None
        else:
            # A sharded collection returns its keys in sharding order: regroup by name
            # with TorchRec's fused permute rather than trusting positions.
            groups = self._key_groups if self.with_first_order else self._key_groups[:1]
            regrouped = KeyedTensor.regroup([pooled], groups)
            emb_values = regrouped[0]
            first_order = regrouped[1] if self.with_first_order else None
        embeddings = emb_values.reshape(-1, n_fields, self.embedding_dim)
        return embeddings, first_order

"""CowClipEmbeddingBagCollection: a TorchRec EmbeddingBagCollection trained by CowClip
inside backward.

The collection is TorchRec's collection; what else it offers it holds as collaborators:
its tables as table batches (``local_tables.py``: the checked configs, the batches, the
row kernel, the initialisation) and their lookup (``batched_lookup.py``), the per-table
weight views (``table_views.py``), the clip counters (``clip_counters.py``, per-row
tracking included), the forward ``torch.export`` traces (``export_forward.py``),
TorchRec's quantization (``quantization.py``) and the ``apply_optimizer_in_backward``
marks made on a built collection (:class:`~torchrec_cowclip.optim.torchrec_config.LateMarks`).

The constructor's arguments in more detail:

* ``options`` is one :class:`~torchrec_cowclip.optim.options.CowClipOptions`, what the
  sharder, the model factory and the trainer pass on: the optimizer (``"adam"``, the
  paper's, ``"rowwise_adagrad"``, ``"sgd"``, per-element ``"adagrad"`` or ``"adamw"``),
  its hyperparameters, the clip (``cowclip=None`` turns it off), the unclipped tables, the
  optional per-id-frequency lr (``count_lr``, not in the paper, ``docs/scaling.md``) and
  Helen's two-pass step (``helen``: call ``helen_step`` with a closure instead of
  ``loss.backward()``, which then raises).
* Half tables (``data_type`` FP16 or BF16) hold their weights in that type; the update
  runs in float32 and rounds back stochastically (to nearest with
  ``CowClipOptions(stochastic_rounding=False)``); the optimizer state is float32, the
  pooled outputs float32 unless ``output_dtype`` says otherwise.
* ``device="meta"`` allocates no storage: shard such a module with
  ``DistributedModelParallel`` and the
  :class:`~torchrec_cowclip.distributed.CowClipEmbeddingBagCollectionSharder` (each rank
  then allocates and initialises only its own shards and their optimizer state), or
  materialise it with ``to_empty(device=...)`` followed by ``reset_parameters()``.
* ``init_seed`` seeds the counter-based initialisation
  (:class:`~torchrec_cowclip.embedding.row_init.RowInit`): a table whose ``init_fn`` is a
  ``RowInit`` keeps its own seed; one whose ``init_fn`` is a ``functools.partial`` of
  ``torch.nn.init.uniform_``/``normal_`` (TorchRec's default is one) is drawn from this
  seed, so it starts from the same weights unsharded and under any sharding plan or
  world size.
* ``kernel_mode`` says how the table batches update their rows (the row kernel:
  ``"auto"``, ``"1"``, ``"triton"``, ``"inductor"`` or ``"0"``,
  :mod:`torchrec_cowclip.optim.row_step`); it is kept for the module's life (a device
  move chooses the kernel of the new device in the same mode).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
)
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_cowclip.embedding.clip_counters import ClipCounters
from torchrec_cowclip.embedding.export_forward import exported_pooling
from torchrec_cowclip.embedding.local_tables import LocalTables
from torchrec_cowclip.embedding.quantization import (  # noqa: F401 (their home before)
    QconfigGuard,
    quantization_mapping,
    quantize_embeddings,
)
from torchrec_cowclip.embedding.row_init import RowInit
from torchrec_cowclip.embedding.row_kernels import RowKernel
from torchrec_cowclip.embedding.row_updates import HelenSteps, RowUpdates
from torchrec_cowclip.embedding.table_batch import TableClipStats
from torchrec_cowclip.embedding.table_views import bind_table_views, table_weight, table_weights
from torchrec_cowclip.optim.fused import CowClipFusedOptimizer
from torchrec_cowclip.optim.load_check import check_module_loadable
from torchrec_cowclip.optim.options import CowClipOptions, checked_options
from torchrec_cowclip.optim.torchrec_config import LateMarks, converted_options


class CowClipEmbeddingBagCollection(
    HelenSteps, EmbeddingBagCollectionInterface, FusedOptimizerModule
):
    """An ``EmbeddingBagCollection`` whose tables are updated by CowClip during backward.

    Tables of one embedding dim (and pooling) are stored as one table batch: the
    forward is one pooled lookup per batch and the backward one fused update over the
    distinct rows the batch touched - clip each row's gradient against
    ``count * max(r * ||W[j]||, zeta)``, add coupled L2, take an Adam / row-wise Adagrad /
    SGD step - with no dense gradient and no Python loop over tables or ids
    (``docs/algorithm.md``). There is no separate ``step()``: calling
    ``loss.backward()`` updates the tables. A forward without a backward (evaluation,
    ``torch.no_grad()``) changes nothing.

    Args (each in more detail in the module docstring):
        tables: as for ``torchrec.EmbeddingBagCollection``: SUM or MEAN pooling, shared
            tables, mixed dims, FP32, FP16 or BF16 (half tables updated in float32).
        options: how the tables are trained (optimizer, hyperparameters, clip, unclipped
            tables, ``count_lr``, Helen), as one
            :class:`~torchrec_cowclip.optim.options.CowClipOptions`. None: the defaults.
        is_weighted: features carry per-sample weights, which get their gradient when
            they require one, as TorchRec's EBC gives it.
        device: where the tables live (default CPU); ``"meta"`` allocates nothing.
        init_seed: seed of the initialisation that is the same under any sharding plan.
            None: ``torch.initial_seed()``.
        kernel_mode: the row kernel's mode, kept across device moves. None: the
            ``TORCHREC_COWCLIP_COMPILE`` environment variable's, read now.

    Example::

        >>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        >>> from torchrec_cowclip import CowClip, CowClipOptions
        >>> ebc = CowClipEmbeddingBagCollection(
        ...     tables=[EmbeddingBagConfig(name="t0", embedding_dim=8,
        ...                                num_embeddings=1000, feature_names=["f0"])],
        ...     options=CowClipOptions(lr=1e-3, cowclip=CowClip(r=1.0, zeta=1e-5)))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["f0"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
        >>> kt = ebc(kjt)                       # KeyedTensor, values [2, 8]
        >>> kt.values().sum().backward()        # rows 1, 2, 3 are updated here
        >>> ebc.clip_stats()["t0"].rows_updated
        3
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        options: Optional[CowClipOptions] = None,
        *,
        is_weighted: bool = False,
        device: Optional[Union[str, torch.device]] = None,
        init_seed: Optional[int] = None,
        kernel_mode: Optional[str] = None,
    ) -> None:
        super().__init__()
        # One value object validates the optimizer, hyperparameters and unclipped tables
        # for this module and for its sharded form alike.
        options = checked_options(options)
        self._tables = LocalTables(tables, options, device, kernel_mode, init_seed)
        self._batches = self._tables.batches
        self._is_weighted = is_weighted
        self.embedding_bags = table_weights(self._batches)
        names = [t.name for t in tables]
        params = {f"embedding_bags.{n}.weight": self._table_weight(n) for n in names}
        self._fused_optimizer = CowClipFusedOptimizer(params, state={}, options=options)
        self._row_updates = RowUpdates(names, options.helen, self.device)
        self._lookup = self._tables.lookup(self._row_updates, self._fused_optimizer.row_options)
        self._clip_counters = ClipCounters(self._batches, names)
        self._late_marks = LateMarks()
        self._bind_views()
        self.reset_parameters()

    @classmethod
    def from_ebc(
        cls,
        ebc: EmbeddingBagCollection,
        options: Optional[CowClipOptions] = None,
        *,
        device: Optional[Union[str, torch.device]] = None,
        init_seed: Optional[int] = None,
        kernel_mode: Optional[str] = None,
    ) -> "CowClipEmbeddingBagCollection":
        """Converts a ``torchrec.EmbeddingBagCollection``, copying its tables' weights;
        ``is_weighted`` is the EBC's, ``device`` defaults to the EBC's (``init_seed`` and
        ``kernel_mode`` as for the constructor).

        Weights marked by TorchRec's ``apply_optimizer_in_backward`` are trained as
        marked (:mod:`torchrec_cowclip.optim.torchrec_config`: e.g.
        ``torchrec.optim.RowWiseAdagrad`` or ``torchrec_cowclip.optim.CowClipAdam``);
        marks that disagree with ``options`` raise ValueError naming both.

        Example::

            >>> import torchrec
            >>> tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
            ...                              feature_names=["f"])]
            >>> ebc = torchrec.EmbeddingBagCollection(tables=tables)
            >>> cowclip_ebc = CowClipEmbeddingBagCollection.from_ebc(
            ...     ebc, options=CowClipOptions(lr=1e-4))
            >>> key = "embedding_bags.t.weight"
            >>> torch.equal(cowclip_ebc.state_dict()[key], ebc.state_dict()[key])
            True
        """
        module = cls(
            [replace(t) for t in ebc.embedding_bag_configs()],
            options=converted_options(ebc, options),
            is_weighted=ebc.is_weighted(),
            device=ebc.device if device is None else device,
            init_seed=init_seed,
            kernel_mode=kernel_mode,
        )
        module.load_state_dict(ebc.state_dict())
        return module

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``, refused whole - naming the first bad key and its
        shapes - unless every weight fits (``nn.Module`` copies the others before it
        raises): :func:`~torchrec_cowclip.optim.load_check.check_module_loadable`."""
        check_module_loadable(state_dict, self.state_dict(), strict, type(self).__name__)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``features``, as ``torchrec.EmbeddingBagCollection``.

        Raises:
            ValueError: the KJT's keys are not exactly this collection's features, it
                is variable-batch, its lengths are negative or do not add up to its
                values, or weights are missing on a weighted collection.
            IndexError: an id is outside ``[0, num_embeddings)`` of its table (raised
                in forward, so no weight has changed).
            RuntimeError: the collection is on the meta device.
        """
        self._tables.require_storage()
        if torch.compiler.is_exporting():  # a self-contained program (export_forward.py)
            return exported_pooling(self._tables, self._table_weight, features, self._is_weighted)
        if self._late_marks.pending():  # apply_optimizer_in_backward on the built tables
            self._fused_optimizer.param_groups[0].update(self._late_marks.read(self, self.options))
        order = self._lookup.feature_order
        pooled = self._lookup(*self._tables.lookup_inputs(features, order, self._is_weighted))
        return self._tables.output(pooled)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._tables.configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._tables.device

    @property
    def options(self) -> CowClipOptions:
        """How the tables train now: the fused optimizer's live hyperparameters (an
        ``lr`` changed by a schedule included), the unclipped tables and Helen."""
        fused = self._fused_optimizer
        return CowClipOptions.from_param_group(
            fused.hyperparameters, fused.optimizer_name, self.unclipped_tables
        ).replace(helen=self.helen, **self._tables.storage_options())

    @property
    def unclipped_tables(self) -> tuple[str, ...]:
        """Names of the tables that are updated but never clipped."""
        return self._tables.unclipped_tables

    def table_storage_bytes(self) -> int:
        """Bytes of table weights and optimizer state this module holds (0 on meta)."""
        return self._tables.storage_bytes()

    @property
    def kernel_mode(self) -> str:
        """The kernel mode the module was built with (``kernel_mode=``, resolved once)."""
        return self._tables.kernel_mode

    @property
    def row_kernel(self) -> RowKernel:
        """How every table batch groups and updates its touched rows
        (:mod:`torchrec_cowclip.embedding.row_kernels`), chosen at build or the last move."""
        return self._tables.kernel

    @property
    def row_updates(self) -> RowUpdates:
        """The coordinator every touched-row update of this collection goes through
        (:mod:`torchrec_cowclip.embedding.row_updates`)."""
        return self._row_updates

    @property
    def fused_optimizer(self) -> CowClipFusedOptimizer:
        """The ``KeyedOptimizer`` of the in-backward update (state, lr, checkpoints).

        Raises:
            RuntimeError: on the meta device (no state; ``DistributedModelParallel`` asks
                for it when no sharder of its list matches this class, and would then
                allocate every table whole on every rank).
        """
        self._tables.require_storage()
        return self._fused_optimizer

    @property
    def clip_counters(self) -> ClipCounters:
        """What the update did to each table and row (:class:`~.clip_counters.ClipCounters`)."""
        return self._clip_counters

    def clip_stats(self) -> dict[str, TableClipStats]:
        """:meth:`ClipCounters.stats`: per table, rows updated, clipped and skipped."""
        return self._clip_counters.stats()

    def table_counters(self) -> dict[str, Tensor]:
        """:meth:`ClipCounters.table_counters`: the checkpoint form."""
        return self._clip_counters.table_counters()

    def load_table_counters(self, counters: Mapping[str, Tensor]) -> None:
        """:meth:`ClipCounters.load_table_counters`, all checked first."""
        self._clip_counters.load_table_counters(counters)

    def track_row_clips(self, enabled: bool = True) -> None:
        """:meth:`ClipCounters.track_rows`: count each row's updates and clips."""
        self._clip_counters.track_rows(enabled)

    def row_clip_counts(self) -> dict[str, tuple[Tensor, Tensor]]:
        """:meth:`ClipCounters.row_counts`: per table, ``(updated, clipped)`` per row."""
        return self._clip_counters.row_counts()

    @property
    def row_initializers(self) -> dict[str, Optional[RowInit]]:
        """Per table, the counter-based initialisation its weights start from (None: its
        ``init_fn``, called as given); the sharder initialises each shard from these."""
        return dict(self._tables.row_inits)

    def reset_parameters(self) -> None:
        """Initialises every table (:attr:`row_initializers`, else its ``init_fn``) and
        zeroes the optimizer state and counters; nothing happens on the meta device."""
        self._tables.reset(self._table_weight)

    # TorchRec's quantization: refused in one line where it would skip this collection.
    qconfig = QconfigGuard()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        # A move moves the table batches and re-points the per-table views at them
        # (moving the views alone would silently detach them from the batches).
        self._tables.move(fn, self._row_updates, self._lookup)
        views = self._bind_views()  # now viewing the moved batches: left as they are
        moved: nn.Module = super()._apply(lambda t: t if id(t) in views else fn(t), recurse)
        return moved

    def __setstate__(self, state: dict[str, Any]) -> None:
        # deepcopy and unpickling clone each per-table parameter on its own; re-point
        # them (and the optimizer's state views) at the copied table batches.
        super().__setstate__(state)
        self._bind_views()

    def _bind_views(self) -> set[int]:
        return bind_table_views(self.embedding_bags, self._batches, self._fused_optimizer.state)

    def _table_weight(self, name: str) -> nn.Parameter:
        return table_weight(self.embedding_bags, name)

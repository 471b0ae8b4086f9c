"""Every use of a private name of TorchRec or torch, in one place.

The sharder extends TorchRec at three overridden methods (:func:`extension_points`) and
reads a few attributes TorchRec documents nowhere; torch keeps ``ShardedTensor``, the
process group's timeout, FX's tracing check and the effect tokens of custom ops
(:func:`register_ordered_effect`) under private paths; the native kernels
use one symbol of FBGEMM that libtorch_cpu carries (:func:`fbgemm_radix_sort_available`);
and a few torch modules hold the default process group once imported after it exists
(:func:`import_modules_holding_the_default_group`). Each such name is
reached only through this module, each accessor says why it is needed, and
``tests/test_compat.py`` checks every one against the installed versions, so a TorchRec
or torch upgrade that moves one fails there, naming it, rather than deep inside a
sharded step.

TorchRec is imported only when a TorchRec accessor is used, so that the parts of the
package that need torch alone (the row step) import without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

if TYPE_CHECKING:
    from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
    from torchrec.distributed.composable.table_batched_embedding_slice import (
        TableBatchedEmbeddingSlice,
    )
    from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
    from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.modules.embedding_configs import PoolingMode

__all__ = [
    "FX_TRACING_LOGGER",
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "TableBatchedEmbeddingSlice",
    "add_fx_tracing_filter",
    "dcp_metadata_private_classes",
    "dmp_data_parallel",
    "embedding_shardings",
    "extension_points",
    "fbgemm_radix_sort_available",
    "grouped_configs",
    "import_modules_holding_the_default_group",
    "pipelined_forward_target",
    "in_backward_mark_count",
    "in_backward_marks_hidden",
    "in_backward_optimizer",
    "is_fx_symbolic_tracing",
    "kernel_pooling_mode",
    "lookup_kernels",
    "mark_static_dim",
    "mark_updated_in_backward",
    "optimizer_marks_hidden",
    "process_group_timeout",
    "qconfig_propagation",
    "recompile_limit_at_least",
    "register_ordered_effect",
    "row_wise_divisor_features",
    "set_planner_optimizer_class",
    "sharded_lookups",
    "sharded_tensor",
    "use_pipelined_forward",
]


def extension_points() -> tuple[tuple[type, str, tuple[str, ...]], ...]:
    """The TorchRec methods this package overrides, with the parameters they must keep.

    The sharder: ``ShardedEmbeddingBagCollection.__init__`` calls the first two (lookups,
    then the data-parallel wrapping), ``GroupedPooledEmbeddingsLookup.__init__`` the third
    once per table group; a renamed one would silently fall back to FBGEMM's kernels.
    Helen's pipelines (``train/helen_pipeline.py``): each pipeline's ``progress`` calls its
    ``_backward`` (replaced by Helen's two passes) and ``TrainPipelineBase`` its
    ``_wait_for_batch`` with the batch of the step; a sharded module's pipelined forward
    is a ``PipelinedForward`` called with the module's arguments."""
    from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
    from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

    return (
        (ShardedEmbeddingBagCollection, "_create_lookups", ("self",)),
        (ShardedEmbeddingBagCollection, "init_data_parallel", ("self",)),
        (
            GroupedPooledEmbeddingsLookup,
            "_create_embedding_kernel",
            ("self", "config", "device", "pg", "sharding_type", "env"),
        ),
        (TrainPipelineBase, "_backward", ("self", "losses")),
        (TrainPipelineSparseDist, "_backward", ("self", "losses")),
        (TrainPipelineBase, "_wait_for_batch", ("self", "cur_batch")),
        (PipelinedForward, "__call__", ("self", "input", "kwargs")),
    )


def __getattr__(name: str) -> Any:
    # TableBatchedEmbeddingSlice: the per-table parameter over a kernel's shards that
    # TorchRec registers as ``embedding_bags.<table>.weight`` (imported on first use).
    if name == "TableBatchedEmbeddingSlice":
        from torchrec.distributed.composable.table_batched_embedding_slice import (
            TableBatchedEmbeddingSlice,
        )

        return TableBatchedEmbeddingSlice
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The logger torch's one-time ``is_fx_tracing()`` deprecation notice goes to (the CLI
#: filters that notice; it concerns a call torch.fx itself makes).
FX_TRACING_LOGGER = "torch.fx._symbolic_trace"

# --- DistributedModelParallel ---------------------------------------------------------


def dmp_data_parallel(dmp: nn.Module) -> Optional[nn.Module]:
    """The ``DistributedDataParallel`` DMP put around its dense part (``_dmp_wrapped_module``;
    DMP's public ``.module`` skips it), or None (one process, or not a DMP)."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = getattr(dmp, "_dmp_wrapped_module", None)
    return wrapped if isinstance(wrapped, DistributedDataParallel) else None


# --- train pipelines -------------------------------------------------------------------


def use_pipelined_forward(pipeline_class: type, forward_class: type) -> None:
    """Makes ``pipeline_class`` (a ``TrainPipelineSparseDist``) rewrite its sharded
    modules' forwards into ``forward_class`` (``_pipelined_forward_type``, the class
    attribute TorchRec's own pipelines set for this)."""
    pipeline_class._pipelined_forward_type = forward_class  # type: ignore[attr-defined]


def pipelined_forward_target(forward: Any) -> tuple[Any, Optional[Any], torch.device]:
    """A ``PipelinedForward``'s sharded module, and the stream and device its input
    distribution runs on (``_module``, ``_stream``, ``_device``): what a forward that
    reuses a waited input distribution needs."""
    return forward._module, forward._stream, forward._device


# --- torch.ao.quantization --------------------------------------------------------------

#: Where torch's eager-mode quantization gives each module its qconfig: the function,
#: its module, and the locals it holds the qconfig spec and the module's name in.
QCONFIG_PROPAGATION = ("_propagate_qconfig_helper", "torch.ao.quantization.quantize")


def qconfig_propagation() -> Optional[tuple[Mapping[Any, Any], str]]:
    """``(qconfig spec, module name)`` of the ``torch.ao.quantization`` qconfig propagation
    on the call stack (``quantize_dynamic``'s, which TorchRec's ``quantize_embeddings``
    calls), or None outside one.

    Why it is needed: ``quantize_embeddings`` quantizes the modules whose exact type its
    spec names (``torchrec.EmbeddingBagCollection``), so another collection is left in
    float32 without a word; reading the spec when torch asks a module for its ``qconfig``
    is the one moment a collection can tell and refuse (``_propagate_qconfig_helper``'s
    ``qconfig_dict`` and ``prefix`` locals)."""
    name, module = QCONFIG_PROPAGATION
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == name and frame.f_globals.get("__name__") == module:
            spec = frame.f_locals.get("qconfig_dict")
            if isinstance(spec, Mapping):
                return spec, str(frame.f_locals.get("prefix", ""))
            return None
        frame = frame.f_back  # type: ignore[assignment]
    return None


# --- ShardedEmbeddingBagCollection ----------------------------------------------------


def sharded_lookups(module: ShardedEmbeddingBagCollection) -> list[Any]:
    """The live list of a sharded EBC's lookups, one per sharding type in
    :func:`embedding_shardings` order (``_lookups``): ``_create_lookups`` fills it and
    ``init_data_parallel`` replaces the data-parallel entry; TorchRec's forward, state
    dict and fused optimizer read it."""
    return module._lookups


def embedding_shardings(module: ShardedEmbeddingBagCollection) -> list[tuple[Any, str]]:
    """``(sharding, sharding_type)`` of each sharding type of a sharded EBC
    (``_embedding_shardings`` and ``_sharding_types``, in the order of its lookups): the
    input the overridden ``_create_lookups`` builds its lookups from."""
    return list(zip(module._embedding_shardings, module._sharding_types))


def row_wise_divisor_features(
    module: ShardedEmbeddingBagCollection,
) -> Optional[dict[str, list[str]]]:
    """The live per-pooling lists of features TorchRec's MEAN-pooling callback divides
    after the reduce-scatter (``_pooling_type_to_rs_features``; a feature listed under
    SUM gets divisor 1), or None when it registers no callback
    (``_has_mean_pooling_callback``). The sharded CowClip collection lists the features
    its kernels already pooled, so they are not divided twice."""
    if not module._has_mean_pooling_callback:
        return None
    return module._pooling_type_to_rs_features


def grouped_configs(sharding: Any) -> list[GroupedEmbeddingConfig]:
    """The table groups on this rank of one of TorchRec's embedding shardings: exactly
    what the sharding's own ``create_lookup`` hands its lookup
    (``_grouped_embedding_configs``; table-row-wise keeps one list per rank,
    ``_grouped_embedding_configs_per_rank[_rank]``)."""
    if hasattr(sharding, "_grouped_embedding_configs"):
        return sharding._grouped_embedding_configs
    return sharding._grouped_embedding_configs_per_rank[sharding._rank]


# --- lookups and kernels --------------------------------------------------------------


def lookup_kernels(lookup: GroupedPooledEmbeddingsLookup) -> list[Any]:
    """A grouped lookup's kernels, one per table group, in creation order
    (``_emb_modules``, which ``_create_embedding_kernel``'s results are appended to)."""
    return list(lookup._emb_modules)


def kernel_pooling_mode(kernel: BaseBatchedEmbeddingBag[Any]) -> PoolingMode:
    """The pooling TorchRec chose for a kernel's group (``_pooling``): SUM for row-wise
    shards of a MEAN table, whose division by the whole bag's length TorchRec applies
    after the reduce-scatter."""
    return kernel._pooling


class _InBackwardOptimizers(list):
    """The ``_in_backward_optimizers`` list of a parameter the fused update trains.

    torch's ``_apply_optimizer_in_backward`` (TorchRec's ``apply_optimizer_in_backward``
    calls it) creates ``_in_backward_optimizers``, ``_optimizer_classes`` and
    ``_optimizer_kwargs`` together, only when the first is missing, then appends to all
    three; this list is appended to first, so it creates the other two (empty) on the
    marked parameters before torch appends to them, and counts the mark
    (:func:`in_backward_mark_count`) for the collection to read it at its next forward.
    Until a mark, the parameter carries no ``_optimizer_classes`` (TorchRec's planner and
    sharders read a present one as the mark)."""

    def append(self, optimizer: Any) -> None:
        global _MARKS
        for group in getattr(optimizer, "param_groups", ()):
            for param in group.get("params", ()):
                if not hasattr(param, "_optimizer_classes"):
                    param._optimizer_classes = []
                    param._optimizer_kwargs = []
        _MARKS += 1
        super().append(optimizer)


_MARKS = 0


def in_backward_mark_count() -> int:
    """How many ``apply_optimizer_in_backward`` marks have reached parameters marked by
    :func:`mark_updated_in_backward` in this process: a collection whose count is behind
    reads its tables' marks again."""
    return _MARKS


def mark_updated_in_backward(param: Tensor) -> None:
    """Marks ``param`` as updated inside backward (``_in_backward_optimizers``), as
    TorchRec's fused kernels do: ``in_backward_optimizer_filter`` then keeps it out of
    dense optimizers, and the plan helpers pick the ``fused`` kernel for it. A later
    ``apply_optimizer_in_backward`` on it is recorded as on any parameter
    (:class:`_InBackwardOptimizers`), not crashed on."""
    from torchrec.optim.fused import EmptyFusedOptimizer

    # A new attribute on a torch Parameter, which the stubs do not declare.
    param._in_backward_optimizers = _InBackwardOptimizers([EmptyFusedOptimizer()])  # type: ignore[attr-defined]


def in_backward_optimizer(param: Tensor) -> Optional[tuple[type, dict[str, Any]]]:
    """The ``(optimizer class, kwargs)`` that torch's / TorchRec's
    ``apply_optimizer_in_backward`` marked ``param`` with (``_optimizer_classes``,
    ``_optimizer_kwargs``: what TorchRec's sharders read to configure FBGEMM), or None.

    Raises:
        ValueError: more than one optimizer was applied (TorchRec supports one).
    """
    classes = getattr(param, "_optimizer_classes", None)
    kwargs = getattr(param, "_optimizer_kwargs", None)
    if not classes or kwargs is None:
        return None
    if len(classes) != 1 or len(kwargs) != 1:
        raise ValueError(
            f"apply_optimizer_in_backward applied {len(classes)} optimizers to one table "
            "weight; a fused table trains with one"
        )
    return classes[0], dict(kwargs[0])


@contextlib.contextmanager
def in_backward_marks_hidden(module: nn.Module) -> Iterator[None]:
    """Inside the block, ``module``'s parameters carry no ``apply_optimizer_in_backward``
    mark (``_optimizer_classes``, ``_optimizer_kwargs``); they are put back after it.

    TorchRec's ``ShardedEmbeddingBagCollection`` constructor reads the marks to configure
    FBGEMM and refuses a class it cannot map to an ``EmbOptimType`` (this project's
    ``CowClipAdam``, ...); the CowClip kernels are configured from the options the sharder
    read from those marks beforehand, so TorchRec's constructor must not see them.
    """
    with optimizer_marks_hidden(module.parameters()):
        yield


@contextlib.contextmanager
def optimizer_marks_hidden(params: Iterable[Tensor]) -> Iterator[None]:
    """Inside the block, the tensors ``params`` carry no optimizer mark
    (``_optimizer_classes``, ``_optimizer_kwargs``: ``apply_optimizer_in_backward``'s, or
    :func:`set_planner_optimizer_class`'s); they are put back after it.

    TorchRec's storage estimator sizes a tensor's optimizer state from the mark's class;
    the planner's CowClip storage estimator (``distributed/planning.py``) counts the
    state as the fused update allocates it instead, so TorchRec's part must not see it.
    """
    saved = []
    for param in {id(p): p for p in params}.values():
        if hasattr(param, "_optimizer_classes"):
            saved.append(
                (param, param._optimizer_classes, getattr(param, "_optimizer_kwargs", None))
            )
            del param._optimizer_classes
            if hasattr(param, "_optimizer_kwargs"):
                del param._optimizer_kwargs
    try:
        yield
    finally:
        for param, classes, kwargs in saved:
            param._optimizer_classes = classes
            if kwargs is not None:
                param._optimizer_kwargs = kwargs  # type: ignore[attr-defined]


def set_planner_optimizer_class(
    param: Tensor, optimizer_class: type[torch.optim.Optimizer]
) -> None:
    """Tells TorchRec's storage estimator which optimizer's state size to plan for
    ``param`` (``_optimizer_classes``)."""
    # A new attribute on a torch Parameter, which the stubs do not declare.
    param._optimizer_classes = [optimizer_class]  # type: ignore[attr-defined]


# --- torch.distributed ----------------------------------------------------------------


def process_group_timeout(pg: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    """The timeout ``pg`` (default: the world) was created with, if its backend exposes
    it (``_get_backend(...).options._timeout``): error messages name it, and subgroups
    inherit it."""
    try:
        group = pg if pg is not None else dist.group.WORLD
        # dist.group.WORLD is Optional in the stubs; None raises AttributeError, handled.
        backend = group._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


def sharded_tensor(
    local_shards: list[Shard],
    metadata: ShardedTensorMetadata,
    pg: Optional[dist.ProcessGroup],
) -> ShardedTensor:
    """A ``ShardedTensor`` over existing local shards (views, not copies) with known
    global metadata, without a collective (``_init_from_local_shards_and_global_metadata``,
    what TorchRec's own fused kernels use for their optimizer state)."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards=local_shards, sharded_tensor_metadata=metadata, process_group=pg
    )


def dcp_metadata_private_classes() -> dict[tuple[str, str], Any]:
    """The private names a ``torch.distributed.checkpoint`` ``.metadata`` pickle refers
    to, by ``(module, name)``: ``FileSystemWriter``'s per-item storage record
    (``filesystem._StorageInfo``), the memory-format enum of ``TensorProperties``
    (``metadata._MEM_FORMAT_ENCODING``) and the layout decoder torch registers for
    pickling ``torch.layout`` (``serialization._get_layout``). The restricted unpickler of
    :mod:`torchrec_cowclip.run.safe_load` admits exactly these besides public classes."""
    from torch import serialization
    from torch.distributed.checkpoint import filesystem, metadata

    return {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): (
            metadata._MEM_FORMAT_ENCODING
        ),
        ("torch.serialization", "_get_layout"): serialization._get_layout,
    }


# --- torch.compile --------------------------------------------------------------------


def mark_static_dim(tensor: Tensor, dim: int) -> None:
    """Compiles ``dim`` of ``tensor`` as a constant under ``torch.compile(dynamic=True)``
    (``torch._dynamo.mark_static``; ``torch.compiler`` has no public equivalent)."""
    torch._dynamo.mark_static(tensor, dim)


@contextlib.contextmanager
def recompile_limit_at_least(limit: int) -> Iterator[None]:
    """Raises Dynamo's per-function recompile limit to at least ``limit`` inside the
    block (``torch._dynamo.config.recompile_limit``)."""
    config = torch._dynamo.config
    with config.patch(recompile_limit=max(limit, config.recompile_limit)):
        yield


def register_ordered_effect(op: Any) -> None:
    """Declares that ``op`` (a custom op's overload) has side effects its schema does not
    show, ordered with every other such op: ``torch.compile`` then neither drops, merges
    nor reorders its calls (``torch.library._register_effectful_op`` with
    ``EffectType.ORDERED``, torch's effect tokens; no public equivalent)."""
    from torch._library.effects import EffectType

    torch.library._register_effectful_op(op, EffectType.ORDERED)


def add_fx_tracing_filter(notice: logging.Filter) -> None:
    """Adds ``notice`` to the logger of torch.fx's tracing check (:data:`FX_TRACING_LOGGER`);
    idempotent."""
    logging.getLogger(FX_TRACING_LOGGER).addFilter(notice)


# --- libtorch_cpu's FBGEMM ----------------------------------------------------------------

#: The C++ symbol of ``fbgemm::radix_sort_parallel<int32_t, int32_t>`` (``fbgemm/Utils.h``,
#: which torch ships; the template is instantiated in libtorch_cpu, not declared by any
#: public torch API). The native grouping of one large row range calls it.
FBGEMM_RADIX_SORT_SYMBOL = "_ZN6fbgemm19radix_sort_parallelIiiEESt4pairIPT_PT0_ES3_S5_S3_S5_llb"


@functools.lru_cache(maxsize=None)
def fbgemm_radix_sort_available() -> bool:
    """Whether this torch's libtorch_cpu exports :data:`FBGEMM_RADIX_SORT_SYMBOL` (and
    ships the header declaring it): the native kernels are built to call it when it does,
    and to use their own radix sort, same result, when a torch upgrade drops it."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    if not os.path.exists(os.path.join(os.path.dirname(lib), "include", "fbgemm", "Utils.h")):
        return False
    try:
        library = ctypes.CDLL(os.path.join(lib, "libtorch_cpu.so"), mode=os.RTLD_NOLOAD)
        getattr(library, FBGEMM_RADIX_SORT_SYMBOL)
    except (OSError, AttributeError):
        return False
    return True


# --- process groups ---------------------------------------------------------------------

#: torch modules with functions whose default argument is ``dist.group.WORLD``, evaluated
#: when the module is first imported: imported after ``init_process_group``, the default
#: holds the default process group for the life of the process, past
#: ``destroy_process_group``. TorchRec imports the first two lazily (on ``import
#: torchrec``, and in ``apply_optimizer_in_backward``).
MODULES_HOLDING_THE_DEFAULT_GROUP = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
)


def import_modules_holding_the_default_group() -> None:
    """Imports :data:`MODULES_HOLDING_THE_DEFAULT_GROUP`; called before a process group is
    created, their defaults are None, not the group.

    Why it matters: a gloo process group that outlives ``destroy_process_group`` keeps its
    worker threads until the interpreter finalizes; a worker that then frees a finished
    collective's tensors takes the GIL of a finalizing interpreter, which ends the thread
    with a forced unwind through a ``noexcept`` destructor: ``terminate called without an
    active exception``, SIGABRT at exit (``tests/test_process_exit.py``)."""
    for name in MODULES_HOLDING_THE_DEFAULT_GROUP:
        importlib.import_module(name)

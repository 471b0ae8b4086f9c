"""Every private TorchRec / torch name of :mod:`torchrec_cowclip.compat`, one test each.

A TorchRec or torch upgrade that moves, renames or re-types one of them fails here with
a message naming it and the accessor to fix, instead of deep inside a sharded step.
The accessors are exercised on a real sharded collection (one rank, gloo) holding
every sharding type.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from datetime import timedelta
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torchrec
from torch import nn
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.distributed import sharding_plan as plans
from torchrec.distributed.embedding_sharding import EmbeddingSharding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import PoolingMode
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_cowclip import CowClipEmbeddingBagCollection, compat
from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder
from torchrec_cowclip.distributed.sharded_kernel import CowClipBatchedEmbeddingBag
from torchrec_cowclip.distributed.sharded_lookup import (
    CowClipPooledEmbeddingsLookup,
    ReplicatedLookup,
)
from torchrec_cowclip.optim.options import CowClipOptions

VERSIONS = f"torchrec {torchrec.__version__}, torch {torch.__version__}"


@contextlib.contextmanager
def private_name(name: str, accessor: str) -> Iterator[None]:
    """Turns a failure inside the block into one line naming the private name."""
    try:
        yield
    except (AttributeError, ImportError, KeyError, TypeError, AssertionError) as error:
        pytest.fail(
            f"{name} moved or changed in {VERSIONS} ({type(error).__name__}: {error}); "
            f"update torchrec_cowclip/compat.py::{accessor}",
            pytrace=False,
        )


#: (sharding type helper, pooling) per table: every sharding type, MEAN on a row-wise
#: table so that TorchRec registers its MEAN-pooling callback.
PLAN = {
    "tw": (lambda: plans.table_wise(rank=0), PoolingType.MEAN),
    "rw": (plans.row_wise, PoolingType.MEAN),
    "twrw": (lambda: plans.table_row_wise(host_index=0), PoolingType.SUM),
    "cw": (lambda: plans.column_wise(ranks=[0, 0]), PoolingType.SUM),
    "dp": (plans.data_parallel, PoolingType.SUM),
}
TIMEOUT = timedelta(seconds=321)


@pytest.fixture(scope="module")
def sharded():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=TIMEOUT)
    try:
        tables = [
            EmbeddingBagConfig(
                name=name,
                embedding_dim=8,
                num_embeddings=16,
                feature_names=[f"f_{name}"],
                pooling=pooling,
            )
            for name, (_, pooling) in PLAN.items()
        ]
        module = CowClipEmbeddingBagCollection(tables, options=CowClipOptions(lr=0.1))
        sharder = CowClipEmbeddingBagCollectionSharder(module_type=CowClipEmbeddingBagCollection)
        plan = plans.construct_module_sharding_plan(
            module,
            {name: helper() for name, (helper, _) in PLAN.items()},
            sharder=sharder,
            local_size=1,
            world_size=1,
            device_type="cpu",
        )
        # Sharding reads most of the names: a moved one fails here, named by the traceback.
        with private_name("a TorchRec name read while sharding", "the accessor in the traceback"):
            built = sharder.shard(
                module, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu")
            )
        yield built
    finally:
        dist.destroy_process_group()


def _inner(lookup: nn.Module) -> nn.Module:
    return lookup.module if isinstance(lookup, ReplicatedLookup) else lookup


@pytest.mark.parametrize(
    "owner, method, parameters",
    compat.extension_points(),
    ids=[f"{c.__name__}.{m}" for c, m, _ in compat.extension_points()],
)
def test_extension_point(owner, method, parameters):
    with private_name(f"{owner.__name__}.{method}", "extension_points"):
        assert tuple(inspect.signature(getattr(owner, method)).parameters) == parameters


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed._shard.metadata", "ShardMetadata"),
        ("torch.distributed._shard.sharded_tensor", "Shard"),
        ("torch.distributed._shard.sharded_tensor", "ShardedTensor"),
        ("torch.distributed._shard.sharded_tensor", "ShardedTensorMetadata"),
        ("torch.fx._symbolic_trace", "is_fx_symbolic_tracing"),
        (
            "torchrec.distributed.composable.table_batched_embedding_slice",
            "TableBatchedEmbeddingSlice",
        ),
    ],
)
def test_private_import_path(module, name):
    with private_name(f"{module}.{name}", name):
        assert getattr(importlib.import_module(module), name) is getattr(compat, name)


def test_sharded_lookups_and_embedding_shardings(sharded):
    with private_name(
        "ShardedEmbeddingBagCollection._lookups/_embedding_shardings/_sharding_types",
        "sharded_lookups, embedding_shardings",
    ):
        shardings = compat.embedding_shardings(sharded)
        lookups = compat.sharded_lookups(sharded)
        assert sorted(t for _, t in shardings) == sorted(
            p.sharding_type for p in sharded.module_sharding_plan.values()
        )
        assert all(isinstance(s, EmbeddingSharding) for s, _ in shardings)
        assert len(lookups) == len(shardings)
        assert all(isinstance(_inner(lookup), CowClipPooledEmbeddingsLookup) for lookup in lookups)
        # The live list: what TorchRec's forward and state dict iterate.
        assert compat.sharded_lookups(sharded) is lookups
        assert {type(lookups[i]) for i, (_, t) in enumerate(shardings) if t == "data_parallel"} == {
            ReplicatedLookup
        }


def test_grouped_configs(sharded):
    with private_name("EmbeddingSharding._grouped_embedding_configs[_per_rank]", "grouped_configs"):
        for sharding, sharding_type in compat.embedding_shardings(sharded):
            groups = compat.grouped_configs(sharding)
            assert all(isinstance(g, GroupedEmbeddingConfig) for g in groups), sharding_type
            names = {t.name for g in groups for t in g.embedding_tables}
            expected = {
                n
                for n, p in sharded.module_sharding_plan.items()
                if p.sharding_type == sharding_type
            }
            assert names == expected, sharding_type


def test_row_wise_divisor_features(sharded):
    with private_name(
        "ShardedEmbeddingBagCollection._pooling_type_to_rs_features/_has_mean_pooling_callback",
        "row_wise_divisor_features",
    ):
        divided = compat.row_wise_divisor_features(sharded)
        assert divided is not None
        assert divided[PoolingType.MEAN.value] == ["f_rw"]
        # The sharded CowClip collection lists every other feature with divisor 1.
        assert sorted(divided[PoolingType.SUM.value]) == ["f_cw", "f_dp", "f_tw", "f_twrw"]


def test_lookup_kernels_and_their_pooling_mode(sharded):
    with private_name(
        "GroupedPooledEmbeddingsLookup._emb_modules / BaseBatchedEmbeddingBag._pooling",
        "lookup_kernels, kernel_pooling_mode",
    ):
        modes = {}
        for lookup, (sharding, _) in zip(
            compat.sharded_lookups(sharded), compat.embedding_shardings(sharded)
        ):
            kernels = compat.lookup_kernels(_inner(lookup))
            assert len(kernels) == len(compat.grouped_configs(sharding))
            for kernel in kernels:
                assert isinstance(kernel, CowClipBatchedEmbeddingBag)
                for name, _ in kernel.named_split_embedding_weights():
                    modes[name.split(".")[0]] = compat.kernel_pooling_mode(kernel)
        # Row-wise shards of a MEAN table pool with SUM (TorchRec divides afterwards).
        assert modes["rw"] == PoolingMode.SUM and modes["tw"] == PoolingMode.MEAN


def test_mark_updated_in_backward():
    kept, fused = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    with private_name("Parameter._in_backward_optimizers", "mark_updated_in_backward"):
        compat.mark_updated_in_backward(fused)
        named = [("kept", kept), ("fused", fused)]
        assert [n for n, _ in in_backward_optimizer_filter(iter(named))] == ["kept"]
        assert [n for n, _ in in_backward_optimizer_filter(iter(named), include=True)] == ["fused"]


def test_a_mark_updated_in_backward_takes_torchs_apply_optimizer_in_backward():
    from torch.distributed.optim import _apply_optimizer_in_backward

    fused = nn.Parameter(torch.zeros(3, 2))
    compat.mark_updated_in_backward(fused)
    assert not hasattr(fused, "_optimizer_classes")  # TorchRec reads a present one as a mark
    count = compat.in_backward_mark_count()
    with private_name(
        "Parameter._in_backward_optimizers/_optimizer_classes/_optimizer_kwargs "
        "(created together by torch, appended to in that order)",
        "mark_updated_in_backward",
    ):
        _apply_optimizer_in_backward(torch.optim.Adam, [fused], {"lr": 0.5})
        assert compat.in_backward_optimizer(fused) == (torch.optim.Adam, {"lr": 0.5})
        assert len(fused._in_backward_optimizers) == 2
    assert compat.in_backward_mark_count() == count + 1


def test_set_planner_optimizer_class():
    import torchrec.distributed.planner.shard_estimators as estimators

    param = nn.Parameter(torch.zeros(1))
    with private_name("Parameter._optimizer_classes", "set_planner_optimizer_class"):
        compat.set_planner_optimizer_class(param, torch.optim.Adam)
        # What TorchRec's storage estimator reads (its numbers: test_distributed_units.py).
        assert "_optimizer_classes" in inspect.getsource(estimators)
        assert param._optimizer_classes == [torch.optim.Adam]


def test_in_backward_optimizer_reads_apply_optimizer_in_backward_marks():
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    marked, plain = nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(4, 2))
    with private_name("Parameter._optimizer_classes/_optimizer_kwargs", "in_backward_optimizer"):
        apply_optimizer_in_backward(RowWiseAdagrad, [marked], {"lr": 0.5})
        assert compat.in_backward_optimizer(marked) == (RowWiseAdagrad, {"lr": 0.5})
        assert compat.in_backward_optimizer(plain) is None
        apply_optimizer_in_backward(RowWiseAdagrad, [marked], {"lr": 0.1})
        with pytest.raises(ValueError, match="applied 2 optimizers"):
            compat.in_backward_optimizer(marked)


def test_in_backward_marks_hidden_restores_the_marks():
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = nn.Linear(2, 2)
    apply_optimizer_in_backward(RowWiseAdagrad, [module.weight], {"lr": 0.5})
    with private_name("Parameter._optimizer_classes", "in_backward_marks_hidden"):
        with compat.in_backward_marks_hidden(module):
            assert compat.in_backward_optimizer(module.weight) is None
        assert compat.in_backward_optimizer(module.weight) == (RowWiseAdagrad, {"lr": 0.5})


def test_optimizer_marks_hidden_hides_the_planners_mark_and_restores_it():
    import torchrec.distributed.planner.shard_estimators as estimators

    alias, plain = nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(4, 2))
    with private_name("Parameter._optimizer_classes", "optimizer_marks_hidden"):
        compat.set_planner_optimizer_class(alias, torch.optim.Adam)
        # What TorchRec's storage estimator sizes the state by (getattr of the attribute).
        assert 'getattr(tensor, "_optimizer_classes"' in inspect.getsource(estimators)
        with compat.optimizer_marks_hidden([alias, plain, alias]):
            assert not hasattr(alias, "_optimizer_classes")
        assert alias._optimizer_classes == [torch.optim.Adam]
        assert not hasattr(plain, "_optimizer_classes")


def test_pipelined_forward_type_and_target():
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

    from torchrec_cowclip.train.helen_pipeline import HelenTrainPipelineSparseDist

    with private_name("TrainPipelineSparseDist._pipelined_forward_type", "use_pipelined_forward"):
        assert TrainPipelineSparseDist._pipelined_forward_type is PipelinedForward
        assert issubclass(HelenTrainPipelineSparseDist._pipelined_forward_type, PipelinedForward)
    module, stream = nn.Linear(1, 1), None
    forward = PipelinedForward("ebc", args=None, module=module, context=None, stream=stream)
    with private_name("PipelinedForward._module/_stream/_device", "pipelined_forward_target"):
        target, got_stream, device = compat.pipelined_forward_target(forward)
        assert target is module and got_stream is None and isinstance(device, torch.device)


def test_table_batched_embedding_slice_views_its_data():
    data = torch.arange(12.0).view(6, 2)
    with private_name("TableBatchedEmbeddingSlice", "TableBatchedEmbeddingSlice"):
        view = compat.TableBatchedEmbeddingSlice(
            data=data, start_offset=1, end_offset=3, num_embeddings=-1, embedding_dim=2
        )
        assert isinstance(view, nn.Parameter)
        assert view.tolist() == [[2.0, 3.0], [4.0, 5.0]]
        assert view.data_ptr() == data[1].data_ptr()  # rows 1-2, not a copy


def test_dmp_data_parallel(sharded):
    """DMP keeps the DDP it wraps its dense part in under ``_dmp_wrapped_module``."""
    from torchrec.distributed.model_parallel import DistributedModelParallel

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = CowClipEmbeddingBagCollection(
                [
                    EmbeddingBagConfig(
                        name="t", embedding_dim=4, num_embeddings=8, feature_names=["f"]
                    )
                ]
            )
            self.dense = nn.Linear(4, 1)

    sharder = CowClipEmbeddingBagCollectionSharder(module_type=CowClipEmbeddingBagCollection)
    dmp = DistributedModelParallel(
        Model(),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        sharders=[sharder],
    )
    with private_name("DistributedModelParallel._dmp_wrapped_module", "dmp_data_parallel"):
        ddp = compat.dmp_data_parallel(dmp)
        assert isinstance(ddp, nn.parallel.DistributedDataParallel)
        assert ddp.module.dense is dmp.module.dense
    assert compat.dmp_data_parallel(nn.Linear(1, 1)) is None


def test_process_group_timeout(sharded):
    with private_name("ProcessGroup._get_backend(...).options._timeout", "process_group_timeout"):
        assert compat.process_group_timeout(None) == TIMEOUT
        assert compat.process_group_timeout(dist.group.WORLD) == TIMEOUT


def test_sharded_tensor_wraps_local_shards_without_copying(sharded):
    from torch.distributed._shard.sharded_tensor import TensorProperties

    local = torch.ones(4, 3)
    with private_name(
        "ShardedTensor._init_from_local_shards_and_global_metadata", "sharded_tensor"
    ):
        shard_meta = compat.ShardMetadata(
            shard_offsets=[0, 0], shard_sizes=[4, 3], placement="rank:0/cpu"
        )
        global_meta = compat.ShardedTensorMetadata(
            shards_metadata=[shard_meta],
            size=torch.Size([4, 3]),
            tensor_properties=TensorProperties(dtype=torch.float32),
        )
        st = compat.sharded_tensor([compat.Shard(local, shard_meta)], global_meta, dist.group.WORLD)
        assert isinstance(st, compat.ShardedTensor) and st.size() == torch.Size([4, 3])
        assert st.local_shards()[0].tensor.data_ptr() == local.data_ptr()


def test_is_fx_symbolic_tracing():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(compat.is_fx_symbolic_tracing())
            return x

    with private_name("torch.fx._symbolic_trace.is_fx_symbolic_tracing", "is_fx_symbolic_tracing"):
        Probe()(torch.zeros(1))
        torch.fx.symbolic_trace(Probe())
        assert seen == [False, True]


def test_fx_tracing_logger():
    notice = logging.Filter("never matches")
    with private_name("the torch.fx._symbolic_trace logger", "FX_TRACING_LOGGER"):
        module = importlib.import_module(compat.FX_TRACING_LOGGER)
        assert module.log.name == compat.FX_TRACING_LOGGER
        compat.add_fx_tracing_filter(notice)
        try:
            assert notice in module.log.filters
        finally:
            module.log.removeFilter(notice)


def test_mark_static_dim_and_recompile_limit():
    config = torch._dynamo.config
    before = config.recompile_limit
    with private_name(
        "torch._dynamo.mark_static / config.recompile_limit",
        "mark_static_dim, recompile_limit_at_least",
    ):
        compat.mark_static_dim(torch.zeros(2, 3), 1)
        with compat.recompile_limit_at_least(before + 5):
            assert config.recompile_limit == before + 5
        with compat.recompile_limit_at_least(1):
            assert config.recompile_limit == before
        assert config.recompile_limit == before


def test_register_ordered_effect():
    """The lookup op (registered on import of embedding/lookup_op.py) has torch's ordered
    effect: ``torch.compile`` threads effect tokens through its calls."""
    from torch._library.effects import EffectType

    from torchrec_cowclip.embedding import lookup_op  # noqa: F401  (registers the ops)

    with private_name(
        "torch.library._register_effectful_op / torch._higher_order_ops.effects",
        "register_ordered_effect",
    ):
        from torch._higher_order_ops.effects import _get_effect

        assert _get_effect(torch.ops.torchrec_cowclip.lookup.default) == EffectType.ORDERED
        assert _get_effect(torch.ops.torchrec_cowclip.lookup_backward.default) is None


#: The TorchRec attributes compat.py reads for the rest of the package (names our own
#: classes also use, such as ``_device``, ``_pg`` or ``_embedding_bag_configs``, are told
#: apart by review, not here).
TORCHREC_PRIVATE_ATTRIBUTES = {
    "_lookups",
    "_embedding_shardings",
    "_sharding_types",
    "_pooling_type_to_rs_features",
    "_has_mean_pooling_callback",
    "_grouped_embedding_configs",
    "_grouped_embedding_configs_per_rank",
    "_emb_modules",
    "_pooling",
    "_in_backward_optimizers",
    "_optimizer_classes",
    "_init_from_local_shards_and_global_metadata",
    "_get_backend",
    "_timeout",
}


def test_only_compat_names_private_torchrec_and_torch_names():
    import ast
    from pathlib import Path

    package = Path(compat.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(package.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                top = node.module.split(".")[0]
                if top in ("torch", "torchrec") and any(
                    p.startswith("_") for p in node.module.split(".")
                ):
                    found.append(f"{where} imports {node.module}")
            elif isinstance(node, ast.Attribute):
                if node.attr in TORCHREC_PRIVATE_ATTRIBUTES:
                    found.append(f"{where} reads .{node.attr}")
                elif (
                    isinstance(node.value, ast.Name)
                    and node.value.id == "torch"
                    and node.attr.startswith("_")
                ):
                    found.append(f"{where} reads torch.{node.attr}")
    assert not found, "private TorchRec/torch names outside compat.py: " + "; ".join(found)


def test_the_module_imports_without_torchrec():
    """The row step needs torch alone: compat.py must not import TorchRec until a
    TorchRec accessor is used."""
    import subprocess
    import sys

    code = (
        "import sys, importlib.util\n"
        "sys.modules['torchrec'] = None  # any import of torchrec now raises\n"
        f"spec = importlib.util.spec_from_file_location('compat_alone', {compat.__file__!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "import torch; module.mark_static_dim(torch.zeros(2, 2), 1)\n"
        "print(module.is_fx_symbolic_tracing())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_dcp_metadata_private_classes():
    """The private names a DCP ``.metadata`` pickle refers to are where the restricted
    unpickler expects them: a real metadata file names exactly allowed globals."""
    import io
    import pickle
    import tempfile

    import torch
    from torch.distributed.checkpoint import state_dict_saver

    from torchrec_cowclip.run.safe_load import allowed_globals

    with private_name(
        "filesystem._StorageInfo, metadata._MEM_FORMAT_ENCODING, serialization._get_layout",
        "dcp_metadata_private_classes",
    ):
        named = compat.dcp_metadata_private_classes()
        assert {name for _, name in named} == {
            "_StorageInfo",
            "_MEM_FORMAT_ENCODING",
            "_get_layout",
        }
        for (module, name), value in named.items():
            assert getattr(importlib.import_module(module), name) is value
        root = tempfile.mkdtemp()
        state_dict_saver.save({"w": torch.ones(2, 3), "i": torch.arange(4)}, checkpoint_id=root)
        seen = set()

        class Recording(pickle.Unpickler):
            def find_class(self, module, name):
                seen.add((module, name))
                return super().find_class(module, name)

        Recording(io.BytesIO(open(f"{root}/.metadata", "rb").read())).load()
        assert seen <= set(allowed_globals()), sorted(seen - set(allowed_globals()))
        assert seen & set(named), "the metadata no longer names the private classes"


def test_libtorch_cpu_carries_fbgemms_radix_sort():
    """The native grouping calls FBGEMM's ``radix_sort_parallel<int32, int32>`` from
    libtorch_cpu (a symbol no public torch API declares); a torch without it builds the
    kernels with their own radix sort instead (same result, slower on one large table)."""
    from torchrec_cowclip.embedding import native

    with private_name(
        f"libtorch_cpu's {compat.FBGEMM_RADIX_SORT_SYMBOL}", "fbgemm_radix_sort_available"
    ):
        assert compat.fbgemm_radix_sort_available()
    assert "-DCOWCLIP_FBGEMM_RADIX_SORT=1" in native.build_flags()


def test_qconfig_propagation_reads_torchs_qconfig_spec_and_module_name():
    """torch.ao.quantization's propagation is where compat.qconfig_propagation looks: the
    function and its locals exist, and a module asked for its qconfig there sees them."""
    import importlib
    import inspect

    function, module = compat.QCONFIG_PROPAGATION
    helper = getattr(importlib.import_module(module), function)
    assert helper.__module__ == module
    assert {"qconfig_dict", "prefix"} <= set(inspect.signature(helper).parameters)
    seen = []

    class Probe(torch.nn.Module):
        def __getattr__(self, name):
            if name == "qconfig":
                seen.append(compat.qconfig_propagation())
            return super().__getattr__(name)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Probe())
    torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, inplace=True)
    spec, name = seen[0]
    assert torch.nn.Linear in spec and name == "1"
    assert compat.qconfig_propagation() is None

"""Per-sample weights that require grad get the gradient TorchRec's EBC gives them:
``d loss / d w_p = <bag gradient, looked-up row>`` at each position (times ``1 / len``
under MEAN pooling), on every update path, unsharded and through the sharded kernel
(which shares the autograd node); weights that do not require grad cost nothing."""

from __future__ import annotations

import shutil
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed import sharding_plan as plans
from torchrec.distributed.types import ShardingEnv

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection, CowClipOptions, compat
from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder
from torchrec_cowclip.embedding import triton_ops

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="no C++ compiler"
)
#: A plain SGD step with the clip on: the tables move, and the gradient of the weights
#: must still be the forward's.
OPTIONS = CowClipOptions(optimizer="sgd", lr=0.5, cowclip=CowClip(r=1.0, zeta=1e-3))


def _tables(pooling: PoolingType):
    return [
        EmbeddingBagConfig(
            name="t0",
            embedding_dim=4,
            num_embeddings=9,
            feature_names=["f0", "f1"],
            pooling=pooling,
        ),
        EmbeddingBagConfig(
            name="t1", embedding_dim=3, num_embeddings=7, feature_names=["f2"], pooling=pooling
        ),
    ]


def _kjt(keys, single_hot: bool, gen: torch.Generator, requires_grad: bool = True):
    batch = 5
    lengths = (
        torch.ones(len(keys) * batch, dtype=torch.int64)
        if single_hot
        else torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    )
    if not single_hot:
        lengths[0], lengths[1] = 0, 3  # an empty bag, a long one
    rows = {"f0": 9, "f1": 9, "f2": 7}
    per_key = lengths.view(len(keys), batch).sum(1).tolist()
    values = torch.cat(
        [torch.randint(0, rows[k], (n,), generator=gen) for k, n in zip(keys, per_key)]
    )
    weights = (torch.rand(values.numel(), generator=gen) + 0.5).requires_grad_(requires_grad)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=values, lengths=lengths, weights=weights
    )
    return kjt, weights


def _torchrec_gradient(tables, kjt, weights, upstream, state):
    """TorchRec's EBC (SUM pooling; under MEAN it is fed ``w / len``, what MEAN pooling of
    weighted bags means here and in FBGEMM's TBE): the reference gradient of ``weights``."""
    stock = torchrec.EmbeddingBagCollection(
        tables=[replace(t, pooling=PoolingType.SUM) for t in tables], is_weighted=True
    )
    stock.load_state_dict(state)
    leaf = weights.detach().clone().requires_grad_(True)
    fed = leaf
    if tables[0].pooling == PoolingType.MEAN:
        lengths = kjt.lengths()
        inv = 1.0 / lengths.clamp_min(1).to(torch.float32)
        fed = leaf * torch.repeat_interleave(inv, lengths)
    ref_kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=fed
    )
    out = stock(ref_kjt)
    (out.values() * upstream).sum().backward()
    return out.values().detach(), leaf.grad


@pytest.mark.parametrize(
    "mode",
    [
        "0",
        pytest.param("1", marks=needs_compiler),
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                triton_ops.availability(torch.device("cpu")) is not None,
                reason="Triton cannot run on CPU tensors here (TRITON_INTERPRET=1)",
            ),
        ),
    ],
    ids=["eager", "native", "triton"],
)
@pytest.mark.parametrize("single_hot", [False, True], ids=["multi_hot", "single_hot"])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN], ids=["sum", "mean"])
def test_weights_get_torchrecs_gradient(pooling, single_hot, mode, monkeypatch):
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", mode)
    gen = torch.Generator().manual_seed(3)
    tables = _tables(pooling)
    ours = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables], options=OPTIONS, is_weighted=True
    )
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    # Keys in another order than the tables': the KJT's permute carries the gradient.
    kjt, weights = _kjt(["f2", "f0", "f1"], single_hot, gen)
    upstream = torch.randn(5, 4 + 4 + 3, generator=gen)
    ref_out, ref_grad = _torchrec_gradient(tables, kjt, weights, upstream, state)
    out = ours(kjt)
    torch.testing.assert_close(out.values(), ref_out)
    (out.values() * upstream).sum().backward()
    assert weights.grad is not None
    torch.testing.assert_close(weights.grad, ref_grad)
    # The tables were updated in the same backward, after the gradient was taken.
    assert not torch.equal(
        ours.state_dict()["embedding_bags.t0.weight"], state["embedding_bags.t0.weight"]
    )


def test_weights_that_do_not_require_grad_cost_nothing(monkeypatch):
    from torchrec_cowclip.embedding.batched_lookup import BatchedLookup

    kept = []
    real = BatchedLookup.forward_impl

    def recording(self, values, offsets, weights, keep_rows):
        result = real(self, values, offsets, weights, keep_rows)
        kept.append([tuple(rows.shape) for rows in result[3]])
        return result

    monkeypatch.setattr(BatchedLookup, "forward_impl", recording)
    gen = torch.Generator().manual_seed(4)
    ours = CowClipEmbeddingBagCollection(
        _tables(PoolingType.SUM), options=OPTIONS, is_weighted=True
    )
    for requires_grad in (False, True):
        kjt, weights = _kjt(["f0", "f1", "f2"], False, gen, requires_grad=requires_grad)
        out = ours(kjt).values()
        # The forward keeps the rows it read (one block per table batch) only for weights
        # that need their gradient.
        n = kjt.values().numel()
        assert kept.pop() == ([(n, 4), (n, 3)] if requires_grad else [])
        out.sum().backward()
        assert (weights.grad is not None) == requires_grad


@pytest.fixture(scope="module")
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    compat.import_modules_holding_the_default_group()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    try:
        yield ShardingEnv.from_process_group(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_the_sharded_kernel_gives_the_same_gradient(one_rank):
    """The sharded kernel's lookup (table-wise, one rank) shares the autograd node: its
    weights get TorchRec's gradient too (TorchRec's input dist hands the kernels the
    weights its feature processors made, which may require grad)."""
    gen = torch.Generator().manual_seed(5)
    tables = _tables(PoolingType.SUM)
    module = CowClipEmbeddingBagCollection(
        [replace(t) for t in tables], options=OPTIONS, is_weighted=True
    )
    state = {k: v.clone() for k, v in module.state_dict().items()}
    sharder = CowClipEmbeddingBagCollectionSharder(module_type=CowClipEmbeddingBagCollection)
    plan = plans.construct_module_sharding_plan(
        module,
        {t.name: plans.table_wise(rank=0) for t in tables},
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    sharded = sharder.shard(module, plan, one_rank, torch.device("cpu"))
    (lookup,) = compat.sharded_lookups(sharded)
    kjt, weights = _kjt(["f0", "f1", "f2"], False, gen)
    upstream = torch.randn(5, 4 + 4 + 3, generator=gen)
    ref_out, ref_grad = _torchrec_gradient(tables, kjt, weights, upstream, state)
    out = lookup(kjt)
    torch.testing.assert_close(out, ref_out)
    (out * upstream).sum().backward()
    torch.testing.assert_close(weights.grad, ref_grad)

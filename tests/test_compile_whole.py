"""A model holding the CowClip collection compiles whole: TorchRec's DLRM and DeepFM trace
as one graph with no break (the lookup and its fused update are two custom ops,
embedding/lookup_op.py), and ``torch.compile(fullgraph=True)`` training steps - the update
in the compiled backward, and under compiled autograd - equal eager ones, on the native
CPU kernels and on the Triton kernels (under Triton's interpreter without a GPU)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torchrec import KeyedJaggedTensor

from torchrec_cowclip import CowClip, CowClipOptions
from torchrec_cowclip.embedding import triton_ops
from torchrec_cowclip.models import build_model

FEATURES = ["C1", "C2", "C3"]
CARDINALITIES = [60, 40, 25]
BATCH = 16

KERNELS = [
    pytest.param("1", id="native"),
    pytest.param(
        "triton",
        id="triton",
        marks=pytest.mark.skipif(
            triton_ops.availability(torch.device("cpu")) is not None,
            reason="Triton cannot run on CPU tensors here (TRITON_INTERPRET=1)",
        ),
    ),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own models: Dynamo's caches (and recompile counts of the
    code they share) start empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(name, mode, monkeypatch):
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", mode)  # the row kernel, chosen when built
    torch.manual_seed(0)
    options = CowClipOptions(lr=1e-2, cowclip=CowClip(r=1.0, zeta=1e-3))
    kw = dict(sparse_names=FEATURES, cardinalities=CARDINALITIES, num_dense=4, init_seed=3)
    if name == "dlrm":
        return build_model(
            "dlrm",
            **kw,
            embedding_dim=8,
            dense_arch_layer_sizes=(16, 8),
            over_arch_layer_sizes=(16, 1),
            embedding_options=options,
        )
    return build_model("deepfm", **kw, embedding_dim=8, hidden=(16,), embedding_options=options)


def _batch(seed, single_hot=False):
    gen = torch.Generator().manual_seed(seed)
    lengths = (
        torch.ones(len(FEATURES) * BATCH, dtype=torch.int64)
        if single_hot
        else torch.randint(0, 4, (len(FEATURES) * BATCH,), generator=gen)
    )
    values = torch.cat(
        [
            torch.randint(0, n, (int(lengths[f * BATCH : (f + 1) * BATCH].sum()),), generator=gen)
            for f, n in enumerate(CARDINALITIES)
        ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths)
    dense = torch.rand(BATCH, 4, generator=gen)
    labels = torch.randint(0, 2, (BATCH,), generator=gen).float()
    return dense, kjt, labels


def _train(model, steps, backward=None):
    optimizer = torch.optim.Adam(model.dense_parameters(), lr=1e-2)
    for step in steps:
        dense, kjt, labels = _batch(step, single_hot=step % 2 == 1)
        loss = F.binary_cross_entropy_with_logits(model(dense, kjt), labels)
        optimizer.zero_grad()
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()


def _assert_same_state(a, b, atol=1e-5):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sb[key], sa[key], rtol=1e-5, atol=atol, msg=key)
    stats_a = a.embedding_collection.clip_stats()
    stats_b = b.embedding_collection.clip_stats()
    assert stats_a == stats_b and all(s.steps == 4 for s in stats_a.values())


@pytest.mark.parametrize("name", ["dlrm", "deepfm"])
def test_the_model_traces_as_one_graph_with_no_break(name, monkeypatch):
    model = _model(name, "1", monkeypatch)
    dense, kjt, _ = _batch(0)
    explained = torch._dynamo.explain(model)(dense, kjt)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
        str(reason.reason) for reason in explained.break_reasons
    ]


@pytest.mark.parametrize("mode", KERNELS)
@pytest.mark.parametrize("name", ["dlrm", "deepfm"])
def test_fullgraph_training_steps_equal_eager_ones(name, mode, monkeypatch):
    """Four steps (multi-hot with empty bags, then single-hot, alternating) of the model
    compiled with ``fullgraph=True`` and of the same model eager: every weight, the
    optimizer state in the tables and the clip counters agree to 1e-5."""
    eager = _model(name, mode, monkeypatch)
    compiled = copy.deepcopy(eager)
    _train(eager, range(4))
    _train(torch.compile(compiled, fullgraph=True), range(4))
    _assert_same_state(eager, compiled)
    opt_eager = eager.embedding_collection.fused_optimizer.state_dict()["state"]
    opt_compiled = compiled.embedding_collection.fused_optimizer.state_dict()["state"]
    for table, state in opt_eager.items():
        for key, value in state.items():
            torch.testing.assert_close(opt_compiled[table][key], value, rtol=1e-5, atol=1e-7)


def test_compiled_autograd_traces_the_update(monkeypatch):
    """The backward traced by compiled autograd (the fused update is an op with a fake
    kernel in its graph) trains like the eager backward, step after step."""
    from torch._dynamo import compiled_autograd

    eager = _model("dlrm", "1", monkeypatch)
    compiled = copy.deepcopy(eager)
    _train(eager, range(4))
    model = torch.compile(compiled, fullgraph=True)

    def backward(loss):
        with compiled_autograd._enable(torch.compile(fullgraph=True)):
            loss.backward()

    _train(model, range(4), backward)
    _assert_same_state(eager, compiled)


def test_errors_read_the_same_compiled(monkeypatch):
    """An id outside its table raises the eager one-line IndexError from the compiled
    model, before any change; a second backward of one forward is refused."""
    model = _model("dlrm", "1", monkeypatch)
    compiled = torch.compile(model, fullgraph=True)
    dense, kjt, labels = _batch(1, single_hot=True)
    compiled(dense, kjt)
    before = copy.deepcopy(model.state_dict())
    values = kjt.values().clone()
    values[BATCH + 3] = CARDINALITIES[1]
    bad = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=kjt.lengths())
    with pytest.raises(IndexError, match=r"feature 'C2' \(table .*id 40 in sample 3") as raised:
        compiled(dense, bad)
    assert "\n" not in str(raised.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    loss = F.binary_cross_entropy_with_logits(compiled(dense, kjt), labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward reached the same CowClip lookup"):
        loss.backward()


#: The torch functions and tensor methods that read a value back to the host (a CUDA
#: synchronisation, illegal while a CUDA graph is captured) or size their output by the
#: data.
HOST_READS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "masked_select",
    "unique",
    "unique_consecutive",
    "cpu",
    "numpy",
}


@pytest.mark.skipif(
    triton_ops.availability(torch.device("cpu")) is not None,
    reason="Triton cannot run on CPU tensors here (TRITON_INTERPRET=1)",
)
@pytest.mark.parametrize("name", ["dlrm", "deepfm"])
def test_a_triton_step_reads_nothing_back_to_the_host(name, monkeypatch):
    """The Triton path's forward and backward - checks, lookup, grouping, update, row
    counters - call nothing that reads a value back to the host or sizes a tensor by the
    data, as while a CUDA graph is captured (the kernels' flags are then left on the
    device): the CPU stand-in for a capture, whose steps must equal ordinary ones. (The
    eager path, which slices the KJT by its values, reads them: the check can fail.)"""
    eager = _model(name, "0", monkeypatch)
    assert _host_reads(eager, monkeypatch) != []
    model = _model(name, "triton", monkeypatch)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.embedding_collection.track_row_clips()
    for step in range(2):
        dense, kjt, labels = _batch(step, single_hot=step == 1)
        F.binary_cross_entropy_with_logits(reference(dense, kjt), labels).backward()
        assert _host_reads(model, monkeypatch, step) == []
    for key, value in reference.embedding_collection.state_dict().items():
        torch.testing.assert_close(model.embedding_collection.state_dict()[key], value)
    assert model.embedding_collection.clip_stats() == reference.embedding_collection.clip_stats()
    ours, theirs = (m.embedding_collection.row_clip_counts() for m in (model, reference))
    assert all(torch.equal(ours[t][i], theirs[t][i]) for t in ours for i in (0, 1))


def _host_reads(model, monkeypatch, step=0):
    """The host reads of one training step of ``model`` (outside the Triton launches,
    whose interpreter copies tensors to NumPy), as while a CUDA graph is captured: every
    tensor method and torch function of :data:`HOST_READS` is wrapped to record its calls
    (inside the lookup ops' implementations too)."""
    found, paused = [], [False]

    def watched(name, real):
        def call(*args, **kwargs):
            data_sized = name == "repeat_interleave" and kwargs.get("output_size") is None
            masked = name == "__getitem__" and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool
                for a in (args[1] if isinstance(args[1], tuple) else (args[1],))
            )
            if not paused[0] and (name in HOST_READS or data_sized or masked):
                found.append(name)
            return real(*args, **kwargs)

        return call

    kernels = triton_ops._kernels()

    class Paused:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                paused[0] = True
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    paused[0] = False

            return launch

    class PausedKernels:
        def __getattr__(self, kernel):
            return Paused(getattr(kernels, kernel))

    dense, kjt, labels = _batch(step, single_hot=step == 1)
    with monkeypatch.context() as patch:
        for name in [*HOST_READS, "repeat_interleave", "__getitem__"]:
            if hasattr(torch.Tensor, name):
                patch.setattr(torch.Tensor, name, watched(name, getattr(torch.Tensor, name)))
            if hasattr(torch, name):
                patch.setattr(torch, name, watched(name, getattr(torch, name)))
        patch.setattr(triton_ops, "_kernels", lambda: PausedKernels())
        patch.setattr(triton_ops, "capturing", lambda device: True)
        F.binary_cross_entropy_with_logits(model(dense, kjt), labels).backward()
    return found

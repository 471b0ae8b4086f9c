"""The package's torch-only core imports and runs without torchrec and fbgemm_gpu (the
GPU machine has torch alone), and its public names all still resolve."""

import textwrap
from pathlib import Path

import pytest
from subprocess_testing import python_c

import torchrec_cowclip

REPO = Path(__file__).resolve().parents[1]

# A meta-path finder first in line that refuses torchrec and fbgemm_gpu, as on a machine
# where they are not installed; then the core imports and one row step runs.
WITHOUT_TORCHREC = textwrap.dedent("""
    import sys

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Refuse())
    import torch
    from torchrec_cowclip import CowClip
    from torchrec_cowclip.optim.row_step import row_step
    from torchrec_cowclip.optim import functional, reference

    weight = torch.ones(4, 2)
    clipped = row_step(compiled=False)(weight, {}, torch.tensor([1, 3]), torch.full((2, 2), 10.0),
                        torch.tensor([1, 1]), optimizer="sgd", lr=0.1, betas=(0.9, 0.999),
                        eps=1e-8, weight_decay=0.0, cowclip=CowClip(r=1.0, zeta=0.0))
    # ||g|| = 14.1 > tau = 1 * ||w|| = 1.41: the step is clipped to norm 1.41 * lr
    assert clipped.tolist() == [True, True], clipped
    assert torch.allclose(weight[1], torch.tensor([0.9, 0.9])), weight
    assert torch.equal(weight[0], torch.ones(2)) and callable(reference.reference_cowclip_step_)
    # The Triton kernels' host side, the data schemas and the GPU benchmark's torch-only part.
    from torchrec_cowclip.embedding import triton_ops
    from torchrec_cowclip.data.schema import CRITEO_KAGGLE_CARDINALITIES
    sys.path.insert(0, "benchmarks")
    import gpu_kernels
    assert callable(triton_ops.fused_update_) and len(CRITEO_KAGGLE_CARDINALITIES) == 26
    assert not any(m.split(".")[0] in ("torchrec", "fbgemm_gpu") for m in sys.modules)
    try:
        from torchrec_cowclip import CowClipEmbeddingBagCollection  # noqa: F401
    except ModuleNotFoundError as error:
        print("collection:", error)
    print("ok")
""")


def test_core_imports_and_steps_without_torchrec_or_fbgemm():
    run = python_c(WITHOUT_TORCHREC, REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "ok"
    # The collection, built on torchrec, still names what is missing.
    assert "collection: No module named 'torchrec" in run.stdout


def test_every_public_name_resolves():
    pytest.importorskip("torchrec", reason="the lazy names are built on torchrec")
    from torchrec_cowclip import data, embedding, optim

    for package in (torchrec_cowclip, embedding, optim, data):
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)
            assert name in dir(package)
    from torchrec_cowclip import (
        CowClipEmbeddingBagCollection,
        CowClipFusedOptimizer,
        TableClipStats,
    )
    from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection as direct

    assert CowClipEmbeddingBagCollection is direct
    assert CowClipFusedOptimizer.__module__ == "torchrec_cowclip.optim.fused"
    assert TableClipStats.__module__ == "torchrec_cowclip.embedding.table_batch"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="'torchrec_cowclip' has no attribute 'Nope'"):
        torchrec_cowclip.Nope  # noqa: B018

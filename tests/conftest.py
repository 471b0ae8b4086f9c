"""Test-session defaults: the update path, the devices, and what is collected without torchrec.

The fused update is compiled by TorchInductor by default (torchrec_cowclip.optim.row_step);
a cold compile costs seconds per graph, and the suite builds hundreds of small modules
in many processes. So tests run the eager update unless they ask for the compiled one
(``set_compiled_update("1")`` in-process, or ``TORCHREC_COWCLIP_COMPILE=1`` in the
environment of spawned ranks): test_row_step, the collection's reference comparisons and
one sharded case compare the compiled path with the reference; everything else checks
behaviour that is the same on both paths. An explicit value in the environment wins.
"""

import importlib.util
import os

os.environ.setdefault("TORCHREC_COWCLIP_COMPILE", "0")

# A GPU machine may have torch alone (``import torchrec`` needs fbgemm_gpu): there, only the
# modules that need torch alone are collected, so that ``pytest -m gpu`` still runs the row
# step's device tests instead of failing on the other modules' imports.
TORCH_ONLY = {"test_functional.py", "test_lazy_imports.py", "test_row_step.py"}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


if not all(_installed(name) for name in ("torchrec", "fbgemm_gpu")):
    collect_ignore_glob = [
        name
        for name in os.listdir(os.path.dirname(__file__))
        if name.startswith("test_") and name.endswith(".py") and name not in TORCH_ONLY
    ]

import pytest  # noqa: E402
import torch  # noqa: E402

# cpu always; cuda (marked ``gpu``: ``pytest -m gpu`` selects these) where a CUDA device is.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """The device a test runs its module on; its reference stays float64 on CPU."""
    return torch.device(request.param)


@pytest.fixture
def wrong_row_step():
    """The row step made slightly wrong (each call also adds 1e-3 to the weight of its
    first row), for the tests that prove a reference comparison can fail."""
    from torchrec_cowclip.optim import row_step

    real = row_step.row_step_

    def wrong(*args, **kwargs):
        clipped = real(*args, **kwargs)
        weight_table, rows = args[0], args[2]
        if rows.numel():
            with torch.no_grad():
                weight_table[rows[0]] += 1e-3
        return clipped

    return wrong

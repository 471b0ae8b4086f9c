"""Test-session defaults: the update path, the devices, and what is collected without torchrec.

By default (``TORCHREC_COWCLIP_COMPILE=auto``) a table batch on CPU is updated by the
native CPU kernels, on CUDA by the Inductor-compiled row step
(``torchrec_cowclip.embedding.row_kernels``); the suite builds hundreds of small modules in
many processes, and the per-call overhead of either (a cold Inductor compile costs
seconds per graph) is wasted on tiny tables. So tests run the eager update unless they
ask for another path when they build their modules (``monkeypatch.setenv`` or
``set_compiled_update`` in-process, ``TORCHREC_COWCLIP_COMPILE`` in the environment of
spawned ranks): test_native, test_triton_kernels and test_row_step, the collection's
reference comparisons (on the native, Triton and Inductor paths) and a few sharded cases
hold the fused and compiled paths to the reference; everything else
checks behaviour that is the same on every path. An explicit value in the environment
wins; the native library is built once per checkout into ``TORCH_EXTENSIONS_DIR``.
"""

import importlib.util
import os

os.environ.setdefault("TORCHREC_COWCLIP_COMPILE", "0")


def _cuda_visible() -> bool:
    """Whether a CUDA device is visible, without initialising CUDA in this process."""
    import torch

    return torch.cuda.is_available()


# Without a GPU the Triton kernels run on CPU tensors under Triton's interpreter (read when
# the kernels are first defined): test_triton_kernels and the collection's "triton" path
# prove them here; with a GPU they compile for real (``pytest -m gpu``).
if not _cuda_visible():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A GPU machine may have torch alone (``import torchrec`` needs fbgemm_gpu): there, only the
# modules that need torch alone are collected, so that ``pytest -m gpu`` still runs the row
# step's device tests instead of failing on the other modules' imports.
TORCH_ONLY = {
    "test_functional.py",
    "test_lazy_imports.py",
    "test_row_step.py",
    "test_triton_kernels.py",
}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


#: Modules that import an optional package the GPU machine's carried wheels leave out
#: (benchmarks/gpu_wheels.py: plots and parquet I/O, about 60 MB): not collected there.
#: Neither holds a device test.
NEEDS = {"test_plots.py": "matplotlib", "test_predict.py": "pyarrow"}

collect_ignore_glob = [name for name, package in NEEDS.items() if not _installed(package)]
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
def wrong_row_step(monkeypatch):
    """The eager row step (:func:`~torchrec_cowclip.optim.row_step.gather_step_scatter_`,
    for the kernels chosen after this fixture) made slightly wrong - each call also adds
    1e-3 to the weight of its first row - for the tests that prove a reference comparison
    can fail."""
    from torchrec_cowclip.optim import row_step

    real = row_step.gather_step_scatter_

    def wrong(*args, **kwargs):
        clipped = real(*args, **kwargs)
        weight_table, rows = args[0], args[2]
        if rows.numel():
            with torch.no_grad():
                weight_table[rows[0]] += 1e-3
        return clipped

    monkeypatch.setattr(row_step, "gather_step_scatter_", wrong)

"""benchmarks/gpu_check.py on CPU at its quick sizes: the checks pass, a deliberately
wrong update is caught, and the mode without torchrec runs the row-step checks alone.

The GPU run itself (``benchmarks/gpu.sh``) cannot happen in CI; these keep the script
working so that it is ready when a GPU is."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def _quick(tmp_path, *extra):
    return ["--device", "cpu", "--quick", "--compile", "0", "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), *extra]


def _report(tmp_path):
    return json.loads((tmp_path / "out" / "gpu_check.json").read_text())


def test_quick_cpu_run_passes_and_reports_every_part(gpu_check, tmp_path, capsys):
    assert gpu_check.main(_quick(tmp_path, "--steps", "2")) == 0
    report = _report(tmp_path)
    correctness = report["correctness"]
    assert correctness["failed"] == 0 and correctness["passed"] > 100
    groups = {c["group"] for c in correctness["checks"]}
    assert {"row step adam+cowclip D=16 masked", "collection adam+cowclip",
            "collection rowwise_adagrad+cowclip", "collection sgd+cowclip",
            "collection out-of-range id"} <= groups

    (timing,) = report["embedding"]["per_batch"]
    variants = timing["variants"]
    for name in (gpu_check.ADAM_NAME, gpu_check.ADAGRAD_NAME):
        assert variants[name]["steps"] == 2 and variants[name]["median_ms"] > 0
    if report["fbgemm"]:
        assert variants[gpu_check.FBGEMM_NAME]["median_ms"] > 0

    deepfm = report["deepfm"]
    assert deepfm["timed_steps"] == 3 and deepfm["losses_finite"]
    assert deepfm["epoch_s_extrapolated"] > 0 and not deepfm["goal_applies"]

    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-2] == "RESULT: PASS"
    assert "EXTRAPOLATED" in out and "memory-bandwidth floor" in out


def test_a_wrong_update_is_detected(gpu_check, tmp_path):
    from torchrec_cowclip.embedding import fused_update, row_step

    original = row_step.row_step_
    assert gpu_check.main(_quick(tmp_path, "--parts", "correctness", "--inject-error")) == 1
    checks = _report(tmp_path)["correctness"]["checks"]
    failed_groups = {c["group"] for c in checks if not c["passed"]}
    # Both the row step alone and the collection's update catch it.
    assert "row step sgd+cowclip D=16" in failed_groups
    assert "collection adam+cowclip" in failed_groups
    assert row_step.row_step_ is original and fused_update.row_step_ is original


def test_without_torchrec_only_the_row_step_checks_run(tmp_path):
    # A subprocess: this mode replaces the package's modules in sys.modules.
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *_quick(tmp_path, "--core-only", "--parts", "correctness,deepfm")],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2, run.stdout + run.stderr  # incomplete, no mismatch
    report = _report(tmp_path)
    assert not report["project_full"]
    checks = report["correctness"]["checks"]
    assert checks and all(c["passed"] for c in checks)
    assert all(c["group"].startswith("row step") for c in checks)
    assert "needs torchrec_cowclip" in report["part_errors"]["deepfm"]

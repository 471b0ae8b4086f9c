"""The benchmark scripts at tiny sizes (end_to_end.py, embedding_step.py, gpu_timing.py,
method_step_time.py, compare_checkouts.py): the files each writes (JSON, CSV, PNG with
matplotlib), end_to_end's peak-RSS table (one entry per timed variant, each from its own
subprocess), and the refusals and exit statuses they promise."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from torchrec_cowclip.data.schema import CRITEO_KAGGLE_CARDINALITIES

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_end_to_end(tmp_path: Path, out: Path, *extra: str) -> list:
    """end_to_end.py's arguments at a tiny size: one round of one step per variant, no
    deepctr-torch, tables of at most 1,000 rows, one thread, writing under ``tmp_path``."""
    return [
        "--rows", "2048", "--batch-sizes", "256", "--rounds", "1", "--warmup", "0",
        "--steps-per-round", "1", "--no-deepctr", *extra, "--max-cardinality", "1000",
        "--threads", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(out),
    ]  # fmt: skip


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_end_to_end_writes_csv_json_png_and_memory(bench, tmp_path):
    import end_to_end

    out = tmp_path / "out"
    result = end_to_end.main(tiny_end_to_end(tmp_path, out))
    variants = [end_to_end.OURS, end_to_end.STOCK, end_to_end.DENSE]
    assert json.loads((out / "end_to_end.json").read_text())["results"] == result["results"]
    rows = _csv(out / "end_to_end.csv")
    assert [r["variant"] for r in rows] == variants
    assert list(rows[0]) == list(result["results"][0])
    memory = {m["variant"]: m for m in result["memory"]}
    assert list(memory) == variants
    for m in memory.values():
        assert "error" not in m, m
        assert m["peak_mib"] > 0 and m["state_bytes_per_row"] >= 0
    # Adam: two fp32 moments of the D = 10 row and the first-order weight per id
    assert memory[end_to_end.OURS]["state_bytes_per_row"] == pytest.approx(88, abs=1)
    assert memory[end_to_end.STOCK]["state_bytes_per_row"] == pytest.approx(88, abs=1)
    assert memory[end_to_end.DENSE]["state_bytes_per_row"] == 0
    mem_rows = _csv(out / "end_to_end_memory.csv")
    assert [r["variant"] for r in mem_rows] == variants
    assert list(mem_rows[0]) == end_to_end.MEMORY_FIELDS
    assert (out / "end_to_end.png").exists() == HAVE_MATPLOTLIB


def test_end_to_end_fbgemm_anchors_train_through_dmp(bench, tmp_path):
    """The two TorchRec DMP + FBGEMM anchors (one process, gloo: in a subprocess of its
    own, so this test process starts no process group)."""
    import subprocess
    import sys

    out = tmp_path / "out"
    script = BENCHMARKS / "end_to_end.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            *tiny_end_to_end(tmp_path, out, "--no-stock", "--no-memory", "--dim", "8"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = [r["variant"] for r in json.loads((out / "end_to_end.json").read_text())["results"]]
    import end_to_end

    assert sorted(variants) == sorted(
        [end_to_end.OURS, end_to_end.DENSE, end_to_end.FBGEMM, end_to_end.FBGEMM_COWCLIP]
    )
    assert "ours / faster anchor" in proc.stdout


def test_embedding_step_writes_csv_json_png(bench, tmp_path):
    import embedding_step

    out, extra_json = tmp_path / "out", tmp_path / "copy.json"
    result = embedding_step.main(
        [
            "--tables",
            "2",
            "--rows",
            "500",
            "--dim",
            "8",
            "--batch-size",
            "128",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--no-inductor",
            "--half",
            "--rules",
            "--out",
            str(out),
            "--json",
            str(extra_json),
        ]
    )
    assert set(result["ratio_paired_vs_fbgemm_cowclip"]) >= {embedding_step.ADAGRAD_NAME}
    assert set(result["ratio_paired_rules"]) == set(embedding_step.RULE_NAMES.values())
    assert all(r["vs_adam"] > 0 for r in result["ratio_paired_rules"].values())
    assert (
        result["storage_bytes"][embedding_step.HALF_NAMES["fp16"]]
        < result["storage_bytes"][embedding_step.ADAM_NAME]
    )
    assert (
        json.loads((out / "embedding_step.json").read_text())["floor_ms_adam"]
        == result["floor_ms_adam"]
    )
    assert json.loads(extra_json.read_text())["variants"].keys() == result["variants"].keys()
    rows = _csv(out / "embedding_step.csv")
    assert [r["variant"] for r in rows] == [
        *result["variants"],
        "ours adam: backward + fused update",
    ]
    assert {"variant", "median_ms", "min_ms", "vs_fbgemm_paired", "floor_ms_adam"} <= set(rows[0])
    assert (out / "embedding_step.png").exists() == HAVE_MATPLOTLIB


def test_gpu_timing_runs_every_cpu_part(bench, tmp_path, capsys):
    """benchmarks/gpu_timing.py at --quick sizes on CPU (the GPU run is benchmarks/gpu.sh):
    the Triton kernels alone (under Triton's interpreter), the embedding step of ours and
    FBGEMM's CPU TBE (its Adam is CUDA-only: skipped, and said), DeepFM; the CUDA-graph part
    needs CUDA and is not among the CPU's default parts."""
    import gpu_kernels
    import gpu_timing

    out = tmp_path / "out"
    status = gpu_timing.main(
        [
            "--device",
            "cpu",
            "--quick",
            "--steps",
            "2",
            "--batch-sizes",
            "64",  # the interpreter runs a Triton step in about a second at this size
            "--threads",
            "1",
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
        ]
    )
    report = json.loads((out / "gpu_timing.json").read_text())
    assert report["args"]["parts"] == ["kernels", "embedding", "deepfm"]
    (kernels,) = report["kernels"]["per_batch"]
    assert list(kernels["variants"]) == [
        gpu_kernels.TRITON_ADAM,
        gpu_kernels.TRITON_ADAGRAD,
        gpu_kernels.INDUCTOR_ADAM,
    ]
    assert all(v["steps"] == 2 and v["median_ms"] > 0 for v in kernels["variants"].values())
    (timing,) = report["embedding"]["per_batch"]
    names = [
        gpu_timing.ADAM_NAME,
        gpu_timing.ADAGRAD_NAME,
        gpu_timing.INDUCTOR_NAME,
        gpu_timing.FBGEMM_NAME,
        gpu_timing.FBGEMM_COWCLIP_NAME,
        gpu_timing.ROW_STEP_NAME.format(path="eager"),
    ]
    assert list(timing["variants"]) == names
    assert all(
        timing["variants"][n]["steps"] == 2 and timing["variants"][n]["median_ms"] > 0
        for n in names
    )
    # FBGEMM's CPU TBE has no Adam: the one skip, said, and the exit status says so.
    (skipped,) = report["embedding"]["skipped"]
    assert skipped.startswith(gpu_timing.FBGEMM_ADAM_NAME) and status == 2
    assert timing["floor_ms_adam"] > 0
    assert report["embedding"]["rows"] == sum(min(k, 2000) for k in CRITEO_KAGGLE_CARDINALITIES)
    deepfm = report["deepfm"]
    assert [e["batch_size"] for e in deepfm["per_batch"]] == [512]
    assert deepfm["timed_steps"] == 3 and deepfm["losses_finite"]
    assert deepfm["epoch_s_extrapolated"] > 0 and not deepfm["goal_applies"]
    printed = capsys.readouterr().out
    assert "EXTRAPOLATED" in printed and "memory-bandwidth floor" in printed
    assert "Triton kernels alone" in printed


def test_method_step_time_writes_paired_ratios(bench, tmp_path):
    import method_step_time

    result = method_step_time.main(
        [
            "--batch-sizes", "64", "--rounds", "2", "--warmup", "1", "--steps-per-round", "1",
            "--time-limit", "5", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path),
        ]
    )  # fmt: skip
    records = {r["method"]: r for r in result["records"]}
    assert set(records) == set(method_step_time.METHODS)
    assert records["adam"]["ratio_to_adam"] == 1.0
    assert all(r["ms_per_step_median"] > 0 and r["rounds"] == 2 for r in records.values())
    saved = json.loads((tmp_path / "method_step_time.json").read_text())
    assert saved["records"] == result["records"]
    assert (tmp_path / "method_step_time.csv").read_text().startswith("batch_size,method,")


def test_compare_checkouts_times_both_workers_and_checks_max_ratio(bench, tmp_path):
    import compare_checkouts

    repo = BENCHMARKS.parent
    tiny = ["--rounds", "2", "--warmup", "1", "--tables", "2", "--rows", "100", "--dim", "4",
            "--batch-size", "64", "--threads", "1", "--json", str(tmp_path / "c.json")]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        compare_checkouts.main(["--before", str(repo), "--max-ratio", "1e-9", *tiny])
    assert refused.value.code == 1
    result = json.loads((tmp_path / "c.json").read_text())
    package = str(repo / "torchrec_cowclip")
    assert result["packages"] == {"before": package, "after": package}
    for part in ("forward", "backward", "release", "step"):
        assert result[part]["before_ms"] > 0 and result[part]["after_ms"] > 0
        assert result[part]["paired_ratio"] > 0


def test_compare_checkouts_refuses_a_directory_without_the_package(bench, tmp_path, capsys):
    import compare_checkouts

    with pytest.raises(SystemExit) as refused:
        compare_checkouts.main(["--before", str(tmp_path)])
    assert refused.value.code == 2
    assert f"--before {tmp_path}: not a checkout of this project" in capsys.readouterr().err

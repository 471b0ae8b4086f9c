"""Trust at the edges, round 4 (issue 48): every file the project reads back goes
through one JSON reader (bounded size and depth, each key once, strings that encode)
and one way to open it (once, no link followed, no FIFO blocking, ``fstat`` of the
descriptor); every refusal is one line, exit 2, naming the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving_cases import (
    cli_refusal,
    copy_run,
    read_rows,
    reseal_run_folder,
    trained_sample,
    write_rows,
)
from tiny import TINY_CLI

from torchrec_cowclip.cli import main
from torchrec_cowclip.data.pipeline import cache
from torchrec_cowclip.readback import MAX_JSON_DEPTH, RefusedFileError, read_json
from torchrec_cowclip.run.model_folder import RunFolder, RunFolderError

REPO = Path(__file__).resolve().parents[1]
DEEP = "[" * 200_000 + "]" * 200_000


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return trained_sample(tmp_path_factory.mktemp("crafted"))


def _predict_refused(capsys, run: Path, trained: dict, tmp_path: Path) -> str:
    out = tmp_path / "scores.csv"
    err = cli_refusal(capsys, "predict", "--run", run, "--data", trained["test"], "--output", out)
    assert not out.exists()
    return err


# --- the JSON reader ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"a": ' + DEEP + "}", f"nested more than {MAX_JSON_DEPTH} deep"),
        ('{"a": ' + "[" * 70 + "]" * 70 + "}", f"nested more than {MAX_JSON_DEPTH} deep"),
        ('{"version": 99, "version": 2}', "the key 'version' appears twice"),
        ('{"files": {"\\ud800x": 1}}', "a string no file can hold"),
        ('{"name": "\\udfff"}', "a string no file can hold"),
        (b'{"a": "\xff"}', "not UTF-8"),
        ("[1, 2]", "not a JSON object (a list)"),
        ("{", "not JSON ("),
    ],
)
def test_the_json_reader_refuses_in_one_line_naming_the_file(tmp_path, text, why):
    path = tmp_path / "x.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(RefusedFileError) as refused:
        read_json(path)
    assert str(refused.value).startswith(f"{path}: refused: ") and why in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_json_reader_bounds_the_bytes_and_refuses_links_and_fifos(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"a": "' + "x" * 100 + '"}')
    with pytest.raises(RefusedFileError, match="bytes, more than the 64 such a file may have"):
        read_json(path, limit=64)
    (tmp_path / "link.json").symlink_to(path)
    with pytest.raises(RefusedFileError, match="a symbolic link"):
        read_json(tmp_path / "link.json")
    os.mkfifo(tmp_path / "fifo.json")  # no writer: a blocking open would never return
    with pytest.raises(RefusedFileError, match="not a regular file"):
        read_json(tmp_path / "fifo.json")
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "absent.json")


def test_a_member_is_checked_on_its_descriptor_not_by_its_name(tmp_path, monkeypatch):
    """The reader and the file check never stat a name they then open: a FIFO swapped in
    between could block them forever (check-then-open)."""
    path = tmp_path / "x.json"
    path.write_text('{"a": 1}')
    record = cache.file_record(path)

    def by_name(*args, **kwargs):
        raise AssertionError("checked by name, then opened: a race")

    monkeypatch.setattr(os, "lstat", by_name)
    monkeypatch.setattr(os, "stat", by_name)
    assert read_json(path) == {"a": 1}
    assert cache.check_file(path, record) is None


_SWAPPER = """
import os, sys, threading
from pathlib import Path
from torchrec_cowclip.run.model_folder import RunFolder, RunFolderError
model = Path(sys.argv[1])
target, kept, fifo = model / "model.json", model / "model.json.kept", model / "fifo"
os.link(target, kept)
os.mkfifo(fifo)
stop = False
def swap():
    while not stop:
        os.replace(fifo, target); os.mkfifo(fifo)
        os.link(kept, fifo); os.replace(fifo, target); os.mkfifo(fifo)
threading.Thread(target=swap, daemon=True).start()
seen = set()
for _ in range(300):
    try:
        RunFolder(model, {"files": {}})
        seen.add("read")
    except RunFolderError as e:
        seen.add("refused" if "not a regular file" in str(e) else str(e))
stop = True
print(sorted(seen))
"""


def test_a_fifo_swapped_in_while_opening_never_blocks(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _SWAPPER, str(run / "model")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().replace("'", '"'))
    assert set(seen) <= {"read", "refused"} and "refused" in seen, seen


# --- run folders: every crafted description one line, exit 2 ------------------------------


def _write_resealed(run: Path, name: str, text: str) -> None:
    (run / "model" / name).write_text(text)
    reseal_run_folder(run / "model")


@pytest.mark.parametrize("name", ["manifest.json", "model.json", "data.json"])
def test_deeply_nested_descriptions_are_one_line(trained, tmp_path, capsys, name):
    run = copy_run(trained, tmp_path)
    if name == "manifest.json":
        (run / "model" / name).write_text('{"format": ' + DEEP + "}")
    else:
        _write_resealed(run, name, '{"model": ' + DEEP + "}")
    err = _predict_refused(capsys, run, trained, tmp_path)
    assert f"{run / 'model' / name}: refused: JSON nested more than" in err
    err = cli_refusal(
        capsys, "train", "--init-from", run, "--data", f"table:{trained['train']}",
        "--out", tmp_path / "warm",
    )  # fmt: skip
    assert f"{run / 'model' / name}: refused" in err
    err = _returns_2(capsys, "plan", "--run", run, "--compute-device", "cpu")
    assert f"{run / 'model' / name}: refused" in err


def test_a_name_that_cannot_be_encoded_is_one_line(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    manifest = run / "model" / "manifest.json"
    value = json.loads(manifest.read_text())
    value["files"]["\ud800x"] = {"bytes": 1, "sha256": "0" * 64}
    manifest.write_text(json.dumps(value))  # ensure_ascii: written as \\ud800
    err = _predict_refused(capsys, run, trained, tmp_path)
    assert f"{manifest}: refused: text that is not UTF-8 or a string no file can hold" in err


def test_duplicate_keys_are_refused_not_read_last_one_wins(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    manifest = run / "model" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace("{", '{"version": 99, ', 1))
    err = _predict_refused(capsys, run, trained, tmp_path)
    assert f"{manifest}: refused: the key 'version' appears twice" in err

    run = copy_run(trained, tmp_path / "b")
    model = run / "model" / "model.json"
    _write_resealed(run, "model.json", model.read_text().replace("{", '{"model": "bogus", ', 1))
    with pytest.raises(RunFolderError, match="the key 'model' appears twice"):
        RunFolder.open(run)


# --- caches ---------------------------------------------------------------------------------


def test_a_fifo_or_deep_digest_memo_is_read_as_none(tmp_path):
    source = tmp_path / "source.csv"
    source.write_text("1,2,3\n")
    memo = tmp_path / "cache" / cache.DIGEST_MEMO
    memo.parent.mkdir()
    for plant in (lambda: os.mkfifo(memo), lambda: memo.write_text('{"a": ' + DEEP + "}")):
        memo.unlink(missing_ok=True)
        plant()
        cache._SOURCE_DIGESTS.clear()
        started = time.monotonic()
        with cache.source_digest_memo(memo.parent):
            assert cache.source_digest(source) == cache.sha256_of(source)[1]
        assert time.monotonic() - started < 10
        assert json.loads(memo.read_text())[str(source)]["sha256"]  # rewritten whole


def test_a_deep_cache_meta_is_rebuilt_not_a_traceback(tmp_path):
    def build(tmp: Path) -> dict:
        (tmp / "x.txt").write_text("x")
        return {"rows": 1}

    entry = cache.build_entry(tmp_path, "demo", {"o": 1}, build)
    (entry / cache.META_FILE).write_text('{"a": ' + DEEP + "}")
    with pytest.raises(RefusedFileError, match="nested more than"):
        cache.read_meta(entry)
    assert cache.build_entry(tmp_path, "demo", {"o": 1}, build) == entry
    assert cache.read_meta(entry)["rows"] == 1


# --- sweep cells under --report-only --------------------------------------------------------


def _cell(out: Path, name: str, **fields) -> Path:
    record = {
        "cell": name,
        "batch_size": 8,
        "recipe": "paper",
        "seed": 0,
        "rates": {},
        "variant": None,
        "shares": None,
        "attempts": [],
        **fields,
    }
    d = out / "cells" / name
    d.mkdir(parents=True)
    (d / "cell.json").write_text(json.dumps(record))
    return d / "cell.json"


def _returns_2(capsys, *argv) -> str:
    """A command that returns (not exits) 2: its one line on stderr."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def _report_only(capsys, out: Path) -> str:
    return _returns_2(capsys, "sweep", "--report-only", f"--out={out}")


def test_a_well_formed_cell_is_reported(tmp_path, capsys):
    _cell(tmp_path, "b8-paper-s0")
    assert main(["sweep", "--report-only", f"--out={tmp_path}"]) == 0


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"batch_size": "big"}, "'batch_size' is 'big', not a whole number >= 1"),
        ({"cell": "../../../escape_cell"}, "'cell' is '../../../escape_cell', not its own"),
        ({"shares": "../../escape"}, "'shares' is '../../escape', not another cell"),
        ({"seed": 1.5}, "'seed' is 1.5"),
        ({"attempts": [{"wall_s": "long"}]}, "'attempts' is not a list"),
    ],
)
def test_crafted_cells_are_refused_in_one_line(tmp_path, capsys, fields, why):
    record = _cell(tmp_path, "b8-paper-s0", **fields)
    err = _report_only(capsys, tmp_path)
    assert f"{record}: {why}" in err


def test_a_deep_cell_record_is_refused_in_one_line(tmp_path, capsys):
    record = _cell(tmp_path, "b8-paper-s0")
    record.write_text('{"cell": ' + DEEP + "}")
    assert f"{record}: refused: JSON nested more than" in _report_only(capsys, tmp_path)


def test_a_crafted_metrics_file_is_named(tmp_path, capsys):
    record = _cell(tmp_path, "b8-paper-s0")
    (record.parent / "metrics.json").write_text('{"epoch_auc": [0.5], "train_samples": "x"}')
    assert f"{record.parent / 'metrics.json'}: not what a run writes" in _report_only(
        capsys, tmp_path
    )


# --- environment values: one line, exit 2, the variable named ------------------------------


def test_a_garbage_kernel_mode_is_the_environment_not_the_run_folder(
    trained, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "garbage")
    culprit = "the environment variable TORCHREC_COWCLIP_COMPILE='garbage'"
    err = _predict_refused(capsys, trained["run"], trained, tmp_path)
    assert culprit in err and "run folder" not in err, err
    err = cli_refusal(capsys, *TINY_CLI, "--out", tmp_path / "t")
    assert culprit in err and not (tmp_path / "t").exists(), err


def test_triton_on_cpu_without_its_interpreter_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHREC_COWCLIP_COMPILE", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY_CLI, "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "torchrec-cowclip: error: the environment variable TORCHREC_COWCLIP_COMPILE=triton: "
        )
    ), err


# --- plan: sizes, not data ------------------------------------------------------------------


def test_plan_computes_generated_tables_from_their_sizes_and_writes_no_row(tmp_path, capsys):
    """``synthetic:10**15`` is planned from its options: nothing generated, no cache."""
    cache_dir = tmp_path / "cache"
    started = time.monotonic()
    status = main(
        ["plan", "--data", "synthetic:1000000000000000", "--synthetic-max-cardinality",
         "1000000000000000", "--cache-dir", str(cache_dir), "--compute-device", "cpu"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and time.monotonic() - started < 60
    assert "1,000,000,000,000,000 rows, sizes from its options" in out, out
    assert not cache_dir.exists() or not any(cache_dir.rglob("*.npy"))


@pytest.mark.parametrize("flag", ["--ddr-gb", "--hbm-gb"])
def test_a_device_memory_without_a_byte_count_is_one_line(capsys, flag):
    err = _returns_2(capsys, "plan", "--tables", "criteo-1tb", flag, "1e308",
                     "--compute-device", "cpu")  # fmt: skip
    assert f"{flag} 1e+308 is more than any device holds" in err


@pytest.mark.parametrize(
    "text, why",
    [
        ('[{"name": "a", "rows": 10, "rows": 20, "dim": 4}]', "the key 'rows' appears twice"),
        (DEEP, f"JSON nested more than {MAX_JSON_DEPTH} deep"),
        (None, "not a regular file"),  # a FIFO: refused, never waited on
    ],
)
def test_a_crafted_table_file_is_one_line(tmp_path, capsys, text, why):
    path = tmp_path / "tables.json"
    if text is None:
        os.mkfifo(path)
    else:
        path.write_text(text)
    err = _returns_2(capsys, "plan", "--tables", path, "--compute-device", "cpu")
    assert f"{path}: refused: {why}" in err, err


# --- scoring files --------------------------------------------------------------------------


@pytest.mark.parametrize("command, column", [("predict", "I3"), ("evaluate", "label")])
def test_a_scoring_file_naming_a_column_twice_is_refused(
    trained, tmp_path, capsys, command, column
):
    """``id,...,I3,...,I3``: which I3 is meant is a guess; the first is not taken silently."""
    source = trained["unlabeled" if command == "predict" else "test"]
    header, *body = read_rows(source)
    write_rows(tmp_path / "twice.csv", [[*header, column], *[[*r, "7"] for r in body]])
    argv = [command, "--run", trained["run"], "--data", tmp_path / "twice.csv"]
    if command == "predict":
        argv += ["--output", tmp_path / "scores.csv"]
    err = cli_refusal(capsys, *argv)
    at = f"{header.index(column) + 1}, {len(header) + 1}"
    assert f"twice.csv:1 names the column {column!r} 2 times (fields {at})" in err, err


# --- --require-sha256 -----------------------------------------------------------------------


def _as_format_1(run: Path) -> None:
    """Rewrites the run folder's manifest as version 1 writes it (CRC-32 per file)."""
    model = run / "model"
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["version"] = 1
    manifest["files"] = {name: cache.file_record(model / name) for name in manifest["files"]}
    (model / "manifest.json").write_text(json.dumps(manifest))


def test_require_sha256_refuses_a_crc32_run_folder_for_scoring_and_warm_start(
    trained, tmp_path, capsys
):
    run = copy_run(trained, tmp_path)
    _as_format_1(run)
    assert RunFolder.open(run).manifest["version"] == 1  # still read without the flag
    why = "format version 1 records crc32 digests, and --require-sha256 asks for SHA-256"
    out = tmp_path / "scores.csv"
    predict = ["predict", "--run", run, "--data", trained["test"], "--output", out]
    assert why in cli_refusal(capsys, *predict, "--require-sha256")
    assert why in cli_refusal(
        capsys, "evaluate", "--run", run, "--data", trained["test"], "--require-sha256"
    )
    assert why in cli_refusal(
        capsys, "export", "--run", run, "--out", tmp_path / "m.pt2", "--require-sha256"
    )
    warm = ["train", "--init-from", run, "--data", f"table:{trained['train']}",
            "--out", tmp_path / "warm", "--max-steps", "1", "--no-progress"]  # fmt: skip
    assert why in cli_refusal(capsys, *warm, "--require-sha256")
    assert not (tmp_path / "warm" / "model").exists()
    # A format-2 folder passes the same flag.
    assert RunFolder.open(trained["run"], require_sha256=True).manifest["version"] == 2
    err = cli_refusal(capsys, "train", *TINY_CLI[1:], "--require-sha256")
    assert "--require-sha256 applies to --init-from's run folder: give both" in err


# --- resume: nothing deleted on a false premise, the running loss continued -------------------


def _tiny(out: Path, cache: Path, **overrides):
    from tiny import tiny_config

    from torchrec_cowclip.train.start import start_run

    return start_run(tiny_config(out=str(out), cache_dir=str(cache), **overrides).resolve()).run()


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def test_resume_auto_deletes_no_log_when_the_manifests_are_gone(tmp_path, capsys):
    from torchrec_cowclip.run.checkpoints import WRITING_MARKER
    from torchrec_cowclip.run.out_dir import RunDirError

    out, cache = tmp_path / "run", tmp_path / "cache"
    _tiny(out, cache, max_steps=4, checkpoint_every=2)
    (out / "metrics.json").unlink()  # as a run killed after its checkpoints leaves it
    for manifest in (out / "checkpoints").glob("*/manifest.json"):
        manifest.unlink()
    before = _snapshot(out)
    with pytest.raises(RunDirError, match="no complete checkpoint .* nothing was removed"):
        _tiny(out, cache, resume="auto")
    assert _snapshot(out) == before
    # A killed first checkpoint write (its marker, no manifest) is still cleaned up.
    fresh = tmp_path / "fresh"
    _tiny(fresh, cache, max_steps=1)
    shutil.rmtree(fresh / "checkpoints")
    (fresh / "metrics.json").unlink()
    (fresh / "checkpoints" / "latest-e0-s1").mkdir(parents=True)
    (fresh / "checkpoints" / "latest-e0-s1" / WRITING_MARKER).write_text("")
    capsys.readouterr()
    _tiny(fresh, cache, resume="auto", max_steps=1)
    assert "left by an attempt that wrote none" in capsys.readouterr().err


def test_a_resumed_run_logs_the_running_loss_of_the_uninterrupted_one(tmp_path):
    cache = tmp_path / "cache"
    _tiny(tmp_path / "whole", cache, epochs=2)
    _tiny(tmp_path / "resumed", cache, epochs=2, max_steps=13)  # stops mid-epoch 2
    _tiny(tmp_path / "resumed", cache, epochs=2, resume=True)
    whole, resumed = (
        (tmp_path / name / "steps.csv").read_text().splitlines() for name in ("whole", "resumed")
    )
    header = whole[0].split(",")
    keep = [header.index(c) for c in ("step", "loss", "running_loss")]
    rows = [[[r.split(",")[i] for i in keep] for r in log[1:]] for log in (whole, resumed)]
    assert len(rows[0]) == 20 and rows[0] == rows[1]


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"])
def test_a_launch_variable_that_is_no_number_is_one_line(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setenv(name, "abc")
    err = cli_refusal(capsys, *TINY_CLI, "--out", tmp_path / "t")
    assert f"the environment variable {name}='abc' is not a whole number" in err, err
    assert not (tmp_path / "t").exists()


def test_crafted_sweep_settings_are_one_line(tmp_path, capsys):
    _cell(tmp_path, "b8-paper-s0")
    settings = tmp_path / "sweep-settings.json"
    settings.write_text(json.dumps({"settings": {"base_batch_size": "big"}}))
    assert f"{settings}: 'base_batch_size' is 'big'" in _report_only(capsys, tmp_path)

"""Trust at the edges (issue 36): a run folder names nothing outside itself and nothing but
plain files, its sizes are checked against its weights before any allocation, every
malformed description is refused in one line, outputs are claimed by one writer and never
replace an input, a full disk is one line, a one-class AUC is undefined, and the readers
follow one rule for numbers and line ends."""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from serving_cases import (
    cli_json,
    cli_refusal,
    copy_run,
    read_rows,
    reseal_run_folder,
    train_table,
    trained_sample,
    write_rows,
)

import torchrec_cowclip
from torchrec_cowclip.data.errors import DataError
from torchrec_cowclip.data.parsing.delimited import MAX_LINE_BYTES, DelimitedFile
from torchrec_cowclip.data.parsing.fields import parse_numeric
from torchrec_cowclip.readback import SHA256, check_file, file_record
from torchrec_cowclip.run import no_space
from torchrec_cowclip.run.model_folder import MANIFEST, RunFolder, RunFolderError
from torchrec_cowclip.run.safe_load import UnsafeFileError, read_dcp_metadata
from torchrec_cowclip.serve import outputs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return trained_sample(tmp_path_factory.mktemp("edges"))


_copy = copy_run


def _edit(run: Path, name: str, change) -> None:
    """Applies ``change`` to the model folder's JSON file ``name``, then re-seals the
    manifest (a forger's edit: every digest matches)."""
    path = run / "model" / name
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))
    reseal_run_folder(run / "model")


def _distcp(run: Path) -> Path:
    return next((run / "model" / "weights" / "final").glob("*.distcp"))


def _predict_refused(capsys, run: Path, test: Path, tmp_path: Path) -> str:
    """``predict`` refuses ``run`` in one line (exit 2) and writes nothing."""
    out = tmp_path / "scores.csv"
    err = cli_refusal(capsys, "predict", "--run", run, "--data", test, "--output", out)
    assert not out.exists() and not list(tmp_path.glob(".scores.csv*"))
    return err


# --- 1. paths that leave the folder, links, devices, FIFOs, the digest ------------------------


def test_every_path_a_run_folder_names_stays_inside_it(trained, tmp_path, capsys):
    outside = tmp_path / "outside"
    shutil.copytree(trained["run"] / "model" / "weights", outside)
    flipped = _distcp(trained["run"]).name
    data = bytearray((outside / "final" / flipped).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (outside / "final" / flipped).write_bytes(bytes(data))
    cases = [
        ("model.json", lambda m: m["weights"].update(final=str(outside / "final")), "'/"),
        ("model.json", lambda m: m["weights"].update(final="../../outside/final"), "'../"),
        ("data.json", lambda d: d["encoder"].update(vocabulary="../../../../etc/passwd"), "'../"),
        ("data.json", lambda d: d["encoder"].update(vocabulary="/dev/zero"), "'/dev/zero'"),
    ]
    for i, (name, change, shown) in enumerate(cases):
        run = _copy(trained, tmp_path / f"case{i}")
        _edit(run, name, change)
        err = _predict_refused(capsys, run, trained["test"], tmp_path)
        assert "a run folder names its own files only" in err and shown in err, err
    # The manifest itself may not list a file outside the folder.
    run = _copy(trained, tmp_path / "manifest")
    manifest = json.loads((run / "model" / MANIFEST).read_text())
    manifest["files"]["../../../../etc/passwd"] = file_record(Path("/etc/hostname"), SHA256)
    (run / "model" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RunFolderError, match="names '../../../../etc/passwd'"):
        RunFolder.open(run)


def test_links_devices_and_fifos_are_refused_before_anything_is_read(trained, tmp_path):
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a read blocked"))
    signal.alarm(60)
    try:
        run = _copy(trained, tmp_path / "link")
        vocab = run / "model" / "encoders" / "id_vocab.npz"
        vocab.unlink()
        vocab.symlink_to("/dev/zero")
        with pytest.raises(RunFolderError, match=r"id_vocab.npz: a symbolic link"):
            RunFolder.open(run)
        run = _copy(trained, tmp_path / "fifo")
        fifo = run / "model" / "encoders" / "pipe"
        os.mkfifo(fifo)
        manifest = json.loads((run / "model" / MANIFEST).read_text())
        manifest["files"]["encoders/pipe"] = {"bytes": 0, SHA256: "0" * 64}
        (run / "model" / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(RunFolderError, match=r"pipe: not a regular file"):
            RunFolder.open(run)
        # A linked directory is refused too, not walked.
        run = _copy(trained, tmp_path / "dirlink")
        (run / "model" / "encoders" / "elsewhere").symlink_to(tmp_path)
        with pytest.raises(RunFolderError, match="elsewhere: a symbolic link"):
            RunFolder.open(run)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _crc_preserving_edit(data: bytes, at: int) -> bytes:
    """``data`` with bytes ``[at, at + 4)`` inverted and the next four chosen so that its
    CRC-32 is unchanged: a same-size edit that a CRC-32 manifest cannot see (CRC-32 is
    affine over GF(2), so four free bytes reach any value)."""
    target = zlib.crc32(data)
    edited = bytearray(data)
    edited[at : at + 4] = bytes(b ^ 0xFF for b in data[at : at + 4])
    base, free = zlib.crc32(edited), at + 4
    pivots: dict = {}
    for bit in range(32):
        probe = bytearray(edited)
        probe[free + bit // 8] ^= 1 << (bit % 8)
        vector, mask = zlib.crc32(probe) ^ base, 1 << bit
        while vector:
            top = vector.bit_length() - 1
            if top not in pivots:
                pivots[top] = (vector, mask)
                break
            vector, mask = vector ^ pivots[top][0], mask ^ pivots[top][1]
    want, mask = base ^ target, 0
    while want:
        vector, bits = pivots[want.bit_length() - 1]
        want, mask = want ^ vector, mask ^ bits
    for bit in range(32):
        if mask >> bit & 1:
            edited[free + bit // 8] ^= 1 << (bit % 8)
    assert zlib.crc32(edited) == target and edited != data
    return bytes(edited)


def test_the_manifest_is_sha256_which_sees_an_edit_crc32_cannot(trained, tmp_path):
    run = _copy(trained, tmp_path)
    manifest = json.loads((run / "model" / MANIFEST).read_text())
    assert manifest["version"] == 2
    assert all(set(r) == {"bytes", SHA256} for r in manifest["files"].values())
    weights = _distcp(run)
    crc_record = file_record(weights)  # what a version-1 manifest recorded
    weights.write_bytes(_crc_preserving_edit(weights.read_bytes(), weights.stat().st_size // 2))
    assert check_file(weights, crc_record) is None  # CRC-32 and size: the edit passes
    with pytest.raises(RunFolderError, match=rf"{weights.name}: checksum mismatch"):
        RunFolder.open(run)


# --- 2. sizes checked before anything is allocated, bounded lines -----------------------------


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize(
    "argument, value, shown",
    [
        ("cardinalities", 50_000_000, "'cardinalities[0]' is 50000000, larger than any dimension"),
        ("cardinalities", 10**10, "'cardinalities[0]' is 10000000000, larger than any dimension"),
        ("embedding_dim", 10**9, "'embedding_dim' is 1000000000, larger than any dimension"),
        ("hidden", [10**6, 10**6], "'hidden[0]' is 1000000, larger than any dimension"),
        ("cross_layers", 10**9, "cross_layers number 1000000000, more than its"),
        ("cardinalities", 29, "emb_C1.weight' is [28, 4] there, [29, 4] by the arguments"),
        ("embedding_dim", 3, "_linear.weight' is [8, 261] there, [8, 235] by the arguments"),
    ],
)
def test_sizes_are_checked_against_the_weights_before_any_allocation(
    trained, tmp_path, argument, value, shown
):
    run = _copy(trained, tmp_path)

    def change(model: dict) -> None:
        if argument == "cardinalities":
            model["arguments"]["cardinalities"][0] = value
        else:
            model["arguments"][argument] = value

    _edit(run, "model.json", change)
    if argument == "cardinalities":  # the schema agrees, so the weights are what refuse it
        _edit(run, "data.json", lambda d: d["schema"]["cardinalities"].__setitem__(0, value))
    before, started = _peak_rss_mb(), time.perf_counter()
    with pytest.raises(RunFolderError) as refused:
        torchrec_cowclip.load_model(run)
    assert time.perf_counter() - started < 5 and _peak_rss_mb() - before < 200
    message = str(refused.value)
    assert (
        "its arguments do not match the weights" in message and "nothing was allocated" in message
    )
    assert shown in message and "\n" not in message


def test_checkpoint_metadata_cannot_claim_more_than_its_files_hold(trained, tmp_path):
    run = _copy(trained, tmp_path / "size")
    metadata_path = run / "model" / "weights" / "final" / ".metadata"
    metadata = read_dcp_metadata(metadata_path)
    key = next(k for k in metadata.state_dict_metadata if k.endswith("emb_C1.weight"))
    tensor = metadata.state_dict_metadata[key]
    tensor.size = torch.Size([10**10, tensor.size[1]])
    tensor.chunks[0].sizes = tensor.size
    metadata_path.write_bytes(pickle.dumps(metadata))
    reseal_run_folder(run / "model")
    with pytest.raises(
        UnsafeFileError, match=r"metadata stores '.*emb_C1.weight' \(160000000000 bytes"
    ):
        torchrec_cowclip.load_model(run)
    # A chunk stored outside the checkpoint's directory.
    run = _copy(trained, tmp_path / "path")
    metadata_path = run / "model" / "weights" / "final" / ".metadata"
    metadata = read_dcp_metadata(metadata_path)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../../data.json"
    metadata_path.write_bytes(pickle.dumps(metadata))
    reseal_run_folder(run / "model")
    with pytest.raises(UnsafeFileError, match="not a file of this checkpoint's directory"):
        RunFolder.open(run)


def test_a_truncated_weight_file_with_a_resealed_manifest_is_one_line(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    weights = _distcp(run)
    weights.write_bytes(weights.read_bytes()[:-700])
    reseal_run_folder(run / "model")
    err = _predict_refused(capsys, run, trained["test"], tmp_path)
    assert f"{weights}: refused to load: it has {weights.stat().st_size} bytes" in err
    assert "a truncated or foreign file" in err


def test_a_line_longer_than_the_bound_is_refused_without_reading_the_file(
    trained, tmp_path, capsys
):
    header = read_rows(trained["test"])[0]
    huge = tmp_path / "one_line.csv"
    with open(huge, "wb") as f:  # a header, then 3 MiB without a newline
        f.write((",".join(header) + "\n").encode())
        f.write(b"7" * (3 * MAX_LINE_BYTES))
    started = time.perf_counter()
    err = _predict_refused(capsys, trained["run"], huge, tmp_path)
    assert f"{huge}:2: a line longer than 1 MiB" in err and time.perf_counter() - started < 10
    no_newline = tmp_path / "binary.csv"
    no_newline.write_bytes(b"x" * (2 * MAX_LINE_BYTES))
    with pytest.raises(DataError, match=r"binary.csv:1: a line longer than 1 MiB"):
        DelimitedFile(no_newline, header=True)
    # A long line inside a block (the block is larger than the bound) is refused too.
    middle = tmp_path / "middle.csv"
    middle.write_bytes(b"a,b\n1,2\n" + b"3," + b"4" * (MAX_LINE_BYTES + 10) + b"\n5,6\n")
    with pytest.raises(DataError, match=r"middle.csv:3: a line longer"):
        list(DelimitedFile(middle, header=True).blocks([0, 1]))


# --- 3. one-line refusals for malformed descriptions ------------------------------------------


def _schema_renamed(data: dict) -> None:
    data["schema"]["dense_names"][0] = "price"


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("model.json", lambda m: m["arguments"].update(embedding_dim=-4), "'embedding_dim' is -4"),
        (
            "model.json",
            lambda m: m["arguments"].update(embedding_dim=4.5),
            "'embedding_dim' is 4.5",
        ),
        (
            "model.json",
            lambda m: m["arguments"]["cardinalities"].__setitem__(2, 0),
            "'cardinalities'",
        ),
        (
            "model.json",
            lambda m: m["arguments"].update(extra=1),
            "model arguments ['extra'] are not",
        ),
        ("model.json", lambda m: m.update(model="gbdt"), "model 'gbdt' is not one of"),
        ("data.json", lambda d: d.update(extra=1), "keys ['extra'] are not known"),
        ("data.json", lambda d: d["reader"]["layout"].update(quoting=1), "unreadable"),
        ("data.json", lambda d: d.update(kind="excel"), "data kind 'excel' is not one of"),
        ("data.json", _schema_renamed, "the dense plan's columns disagree with the schema"),
        (
            "data.json",
            lambda d: d["dense_plan"]["columns"][0].update(name="price"),
            "the dense plan's columns disagree",
        ),
        ("data.json", lambda d: d["dense_plan"]["columns"][0].update(scale=0.0), "finite"),
    ],
)
def test_malformed_descriptions_are_refused_in_one_line(
    trained, tmp_path, capsys, name, change, message
):
    run = _copy(trained, tmp_path / "run")
    _edit(run, name, change)
    err = _predict_refused(capsys, run, trained["test"], tmp_path)
    assert f"model/{name}: " in err and message in err, err


def test_malformed_manifests_are_refused_in_one_line(trained, tmp_path, capsys):
    for change, message in [
        (lambda m: m.update(files=sorted(m["files"])), "'files' is list, not a mapping"),
        (lambda m: m.update(version="1"), "format version '1' is not a positive integer"),
        (lambda m: m.update(version=True), "format version True is not a positive integer"),
        (lambda m: m["files"]["model.json"].update(crc32="0"), "the record of 'model.json'"),
    ]:
        run = _copy(trained, tmp_path / f"case{len(list(tmp_path.glob('case*')))}")
        path = run / "model" / MANIFEST
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))
        err = _predict_refused(capsys, run, trained["test"], tmp_path)
        assert message in err, err


def test_evaluate_on_a_header_only_file_is_one_line(trained, tmp_path, capsys):
    header_only = write_rows(tmp_path / "header.csv", read_rows(trained["test"])[:1])
    err = cli_refusal(capsys, "evaluate", "--run", trained["run"], "--data", header_only)
    assert f"{header_only}: no rows to evaluate" in err


def test_ctrl_c_during_predict_is_one_line_exit_130_and_leaves_nothing(
    trained, tmp_path, capsys, monkeypatch
):
    from torchrec_cowclip.serve.predictor import Predictor

    real = Predictor.scores

    def interrupted(self, *args, **kwargs):
        for part in real(self, *args, **kwargs):
            yield part
            raise KeyboardInterrupt  # Ctrl-C once the first batch is written

    monkeypatch.setattr(Predictor, "scores", interrupted)
    out = tmp_path / "scores.csv"
    err = cli_refusal(
        capsys, "predict", "--run", trained["run"], "--data", trained["test"], "--output", out,
        "--batch-size", "8", status=130,
    )  # fmt: skip
    assert err == "torchrec-cowclip: interrupted by SIGINT (predict: nothing was written)"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


_SLOW_PREDICT = """
import sys, time
from torchrec_cowclip.serve.predictor import Predictor
real = Predictor.scores
def slow(self, *a, **k):
    for part in real(self, *a, **k):
        yield part
        print("scoring", flush=True)
        time.sleep(60)
Predictor.scores = slow
from torchrec_cowclip.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_predict_is_one_line_exit_75_and_leaves_nothing(trained, tmp_path):
    """A real signal in a real process (Ctrl-C's KeyboardInterrupt: the test above)."""
    out = tmp_path / "scores.csv"
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW_PREDICT, "predict", "--run", str(trained["run"]),
         "--data", str(trained["test"]), "--output", str(out), "--batch-size", "8",
         "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert process.stdout is not None and process.stdout.readline() == "scoring\n"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 75, err
    assert err.strip() == (
        "torchrec-cowclip: stopped by SIGTERM: predict: nothing was written; run it again"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- 4, 5. one writer per output; inputs and other files never replaced unasked --------------


def test_a_second_writer_of_an_output_is_refused_and_leftovers_are_removed(
    trained, tmp_path, capsys
):
    out = tmp_path / "scores.csv"
    held = outputs.claim_output("--output", out, [])  # another predict, writing it now
    try:
        err = cli_refusal(
            capsys, "predict", "--run", trained["run"], "--data", trained["test"], "--output", out
        )
        assert f"--output {out} is being written by another process (pid {os.getpid()})" in err
    finally:
        held.release()
    assert not out.exists()
    stale = tmp_path / ".scores.csv.tmp-999999"  # what a SIGKILLed predict leaves
    stale.write_text("half")
    summary = cli_json(
        capsys, "predict", "--run", trained["run"], "--data", trained["test"], "--output", out
    )
    assert summary["rows"] == 50 and sorted(p.name for p in tmp_path.iterdir()) == ["scores.csv"]


def test_an_output_that_appears_while_scoring_is_not_replaced(
    trained, tmp_path, capsys, monkeypatch
):
    from torchrec_cowclip.serve.predictor import Predictor

    out = tmp_path / "scores.csv"
    real = Predictor.scores

    def racing(self, *args, **kwargs):
        yield from real(self, *args, **kwargs)
        out.write_text("written by someone else meanwhile")

    monkeypatch.setattr(Predictor, "scores", racing)
    err = cli_refusal(
        capsys, "predict", "--run", trained["run"], "--data", trained["test"], "--output", out
    )
    assert "appeared while it was being written: not replaced" in err
    assert out.read_text() == "written by someone else meanwhile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.csv"]


def test_predict_never_writes_over_its_input_or_into_the_run_folder(trained, tmp_path, capsys):
    data = Path(shutil.copy(trained["test"], tmp_path / "rows.csv"))
    before = data.read_bytes()
    for output in (data, tmp_path / "." / "rows.csv"):
        err = cli_refusal(
            capsys, "predict", "--run", trained["run"], "--data", f"table:{data}",
            "--output", output, "--overwrite",
        )  # fmt: skip
        assert f"is the input file {data}: its scores would replace its rows" in err
    assert data.read_bytes() == before
    inside = trained["run"] / "model" / "scores.csv"
    err = cli_refusal(
        capsys, "predict", "--run", trained["run"], "--data", data, "--output", inside
    )
    assert "lies inside the run folder" in err and not inside.exists()


def test_export_replaces_none_of_its_files_without_overwrite(trained, tmp_path, capsys):
    out = tmp_path / "exp" / "model.pt2"
    out.parent.mkdir()
    for name in ("model.serving.json", "model.vocab.json"):
        mine = out.with_name(name)
        mine.write_text("mine")
        err = cli_refusal(capsys, "export", "--run", trained["run"], "--out", out)
        assert f"{mine} exists: add --overwrite to replace it" in err
        assert mine.read_text() == "mine" and not out.exists()
        mine.unlink()
    err = cli_refusal(
        capsys, "export", "--run", trained["run"], "--out", trained["run"] / "model" / "m.pt2"
    )
    assert "lies inside the run folder" in err


# --- 6. a full disk, in one line, leaving nothing half-written --------------------------------


def test_a_full_disk_while_scoring_is_one_line_and_a_rerun_works(
    trained, tmp_path, capsys, monkeypatch
):
    real_open = open

    def full(path, mode="r", *args, **kwargs):
        if "w" in mode and ".tmp-" in str(path):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this machine")
    monkeypatch.setattr(outputs, "open", full, raising=False)
    out = tmp_path / "scores.csv"
    argv = ["predict", "--run", trained["run"], "--data", trained["test"], "--output", out]
    err = cli_refusal(capsys, *argv, status=4)
    assert err == f"torchrec-cowclip: error: no space left on device: {out}"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert cli_json(capsys, *argv)["rows"] == 50


def test_a_full_disk_without_an_errno_is_still_named(trained, tmp_path, capsys, monkeypatch):
    """torch's zip writer reports a short write as ``unexpected pos``: the free space
    tells it apart from a bug."""

    def short_write(program, path):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch.export, "save", short_write)
    monkeypatch.setattr(no_space, "free_bytes", lambda path: 4096)
    out = tmp_path / "model.pt2"
    err = cli_refusal(capsys, "export", "--run", trained["run"], "--out", out, status=4)
    assert err == f"torchrec-cowclip: error: no space left on device: {out}"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # With space left, the same error is a bug, raised as it is.
    monkeypatch.setattr(no_space, "free_bytes", lambda path: 10**12)
    assert no_space.no_space(RuntimeError("unexpected pos 704 vs 598"), out) is None
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with no_space.space_checked(out):
            raise RuntimeError("unexpected pos 704 vs 598")


def test_a_full_disk_while_writing_the_model_folder_is_one_line_and_resumes(
    trained, tmp_path, capsys, monkeypatch
):
    import pathlib

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this machine")
    real_open = pathlib.Path.open

    def open_(self, mode="r", *args, **kwargs):
        if "w" in mode and "model.tmp" in str(self) and self.suffix == ".distcp":
            return real_open(Path("/dev/full"), mode, *args, **kwargs)
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    out = tmp_path / "run"
    flags = dict(epochs=1)
    with pytest.raises(SystemExit) as stopped:
        train_table(out, trained["train"], trained["test"], trained["root"] / "cache", **flags)
    assert stopped.value.code == 4
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"torchrec-cowclip: error: no space left on device: {out}/model"
    assert not (out / "model.tmp").exists() and not (out / "model").exists()
    monkeypatch.undo()
    train_table(
        out, trained["train"], trained["test"], trained["root"] / "cache", resume="auto", **flags
    )
    assert RunFolder.open(out).reported == "final"


_FILL_THEN_TRAIN = """
import os, sys
from torchrec_cowclip.run import model_folder as run_folder
from torchrec_cowclip.cli import main
disk, argv = sys.argv[1], sys.argv[2:]
real = run_folder.RunFolderWriter.save_weights
def fill_then_save(self, *args, **kwargs):
    # Fill the disk, then free 8 KiB: the write of the weights is cut short, and the zip
    # writer of torch reports it as unexpected pos, not as ENOSPC.
    fd = os.open(os.path.join(disk, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:
        pass
    while True:
        try:
            os.write(fd, bytes(4096))
        except OSError:
            break
    os.ftruncate(fd, os.fstat(fd).st_size - 8192)
    os.close(fd)
    return real(self, *args, **kwargs)
run_folder.RunFolderWriter.save_weights = fill_then_save
try:
    status = main(argv)
except SystemExit as e:
    status = e.code
print("status", status, flush=True)
os.unlink(os.path.join(disk, "filler"))  # space again: the same command continues
run_folder.RunFolderWriter.save_weights = real
try:
    status = main(argv[:-1] + ["--resume", "auto", argv[-1]])
except SystemExit as e:
    status = e.code
print("status", status, flush=True)
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare to mount a small file system in a private namespace",
)
def test_a_really_full_disk_cutting_the_weights_short_is_one_line(trained, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    argv = [
        "train", f"--data=table:{trained['train']}", "--label=label", "--dense=I1,I2",
        "--sparse=C1,C2", "--batch-size=32", "--hidden=8", "--threads=1", "--no-progress",
        f"--cache-dir={trained['root'] / 'cache'}", f"--out={out}",
    ]  # fmt: skip
    program = tmp_path / "fill_then_train.py"
    program.write_text(_FILL_THEN_TRAIN)
    script = (
        f"mount -t tmpfs -o size=8m tmpfs {disk} && "
        f"{sys.executable} {program} {disk} {' '.join(argv)}; ls -a {out}"
    )
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("mount namespaces are not available here")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    lines = [x for x in done.stderr.splitlines() if x.startswith("torchrec-cowclip")]
    assert lines == [f"torchrec-cowclip: error: no space left on device: {out}/model"], done.stderr
    assert "Traceback" not in done.stderr and "unexpected pos" not in done.stderr
    statuses = [x for x in done.stdout.splitlines() if x.startswith("status")]
    assert statuses == ["status 4", "status 0"], done.stdout
    assert "model" in done.stdout.split() and "model.tmp" not in done.stdout.split()


# --- 7. AUC is undefined on one class ---------------------------------------------------------


def test_auc_is_null_with_a_reason_on_one_class(trained, tmp_path, capsys):
    header, *body = read_rows(trained["test"])
    positives = write_rows(tmp_path / "positives.csv", [header] + [["1", *r[1:]] for r in body])
    metrics = cli_json(capsys, "evaluate", "--run", trained["run"], "--data", positives)
    assert metrics["auc"] is None and metrics["positives"] == metrics["rows"] == 50
    assert metrics["auc_note"] == "AUC is undefined: all 50 labels are 1 (it needs both classes)"
    assert metrics["logloss"] > 0
    # Training reports the same on a one-class test file (not 0.0).
    capsys.readouterr()
    run = train_table(tmp_path / "run", trained["train"], positives, tmp_path / "cache")
    assert run["auc"] is None and run["epoch_auc"] == [None, None]
    assert run["auc_note"] == "AUC is undefined: the test split's labels hold one class"
    assert "epoch 2/2: test_auc undefined (one class), test_logloss" in capsys.readouterr().err
    assert (
        json.loads((tmp_path / "run" / "model" / "model.json").read_text())["metrics"]["auc"]
        is None
    )


# --- 8. one rule for inputs -------------------------------------------------------------------


def test_in_memory_columns_refuse_an_infinity_as_files_do(trained):
    model = torchrec_cowclip.load_model(trained["run"])
    header, *body = read_rows(trained["test"])
    columns = {name: [r[i] for r in body] for i, name in enumerate(header)}
    numbers = {**columns, "I1": [float(v) if v else np.nan for v in columns["I1"]]}
    assert len(model.predict(numbers)) == 50  # NaN: a missing value
    for given, bad in ((numbers, np.inf), (columns, "inf"), (columns, "1_000")):
        column = list(given["I1"])
        column[3] = bad
        with pytest.raises(DataError, match=r"column 'I1', row 3: .* is not a finite number"):
            model.predict({**given, "I1": column})


def test_numbers_are_decimal_text_by_one_rule():
    values, bad = parse_numeric(np.array([b"1e3", b" 2.5 ", b".5", b"-7.", b"1_000", b"0x10",
                                          b"nan", b"inf", b"Infinity", b"1e999"]))  # fmt: skip
    assert values[:4].tolist() == [1000.0, 2.5, 0.5, -7.0]
    assert bad.tolist() == [False] * 4 + [True] * 6


def test_a_file_converted_to_crlf_twice_keeps_no_cr_in_its_values(tmp_path):
    path = tmp_path / "twice.csv"
    path.write_bytes(b"label,a,b\r\r\n1,x,c1\r\r\n0,y,c2\r\r\n1,z,c3\r\r")
    blocks = list(DelimitedFile(path, header=True).blocks([0, 1, 2]))
    assert [v for b in blocks for v in b.columns[2].tolist()] == [b"c1", b"c2", b"c3"]
    assert [b.bad_lines for b in blocks] == [[], []]
    quoted = tmp_path / "quoted.csv"
    quoted.write_bytes(b'label,a,b\r\r\n1,"x,1",c1\r\r\n')
    block = next(DelimitedFile(quoted, header=True).blocks([0, 1, 2]))
    assert block.columns[2].tolist() == [b"c1"] and block.columns[1].tolist() == [b"x,1"]

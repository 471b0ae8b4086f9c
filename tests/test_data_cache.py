"""The memory-mapped cache (reuse, rebuild, atomicity) and TorchRec's npy layout."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest

from torchrec_cowclip.data import BAD_LABEL, CTRDataset, DataError, open_dataset
from torchrec_cowclip.data.parsing.rows import TextRowSource
from torchrec_cowclip.data.pipeline.cache import CACHE_VERSION
from torchrec_cowclip.data.sources.criteo_npy import find_npy_days

DATA = Path(__file__).resolve().parent / "data"
CRITEO_TSV = DATA / "criteo_sample.tsv"


def _entries(cache: Path, kind: str):
    return sorted(p for p in cache.iterdir() if p.is_dir() and p.name.startswith(kind + "-"))


def _forbid_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the source was parsed again")

    monkeypatch.setattr(TextRowSource, "blocks", fail)


def test_cache_layout_and_meta(tmp_path: Path) -> None:
    ds = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path)
    assert {p.name for p in ds.path.iterdir()} == {
        "dense.npy",
        "sparse.npy",
        "labels.npy",
        "meta.json",
        # What encoded the categoricals (a run folder takes it from here): the vocabulary.
        "vocab.npz",
    }
    meta = json.loads((ds.path / "meta.json").read_text())
    assert meta["encoder"] == {
        "files": ["vocab.npz"],
        "encoding": {"kind": "vocabulary", "min_count": 1, "oov_id": 0, "missing_id": 1},
    }
    assert meta["version"] == CACHE_VERSION
    assert meta["rows"] == 200
    assert meta["schema"]["sparse_names"][0] == "C1" and len(meta["schema"]["cardinalities"]) == 26
    assert meta["bad_rows"] == {}
    assert meta["source"] == f"criteo:{CRITEO_TSV}"
    assert meta["payload"]["sources"][0]["path"] == str(CRITEO_TSV.resolve())
    assert (
        isinstance(ds.dense, np.memmap)
        and isinstance(ds.sparse, np.memmap)
        and isinstance(ds.labels, np.memmap)
    )
    assert ds.sparse.dtype == np.int32
    # no temp dirs left behind
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_cache_reuse_without_reparsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, hash_size=5000)
    arrays = [np.array(a) for a in (first.dense, first.sparse, first.labels)]
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.path.iterdir()}
    _forbid_parsing(monkeypatch)
    again = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, hash_size=5000)
    assert again.path == first.path
    assert {p.name: p.stat().st_mtime_ns for p in again.path.iterdir()} == mtimes
    for a, b in zip(arrays, (again.dense, again.sparse, again.labels)):
        np.testing.assert_array_equal(a, b)
    assert again.schema == first.schema
    # opening the entry directly works too
    np.testing.assert_array_equal(CTRDataset(first.path).sparse, arrays[1])


def test_cache_rebuilds_when_an_option_or_the_file_changes(tmp_path: Path) -> None:
    src = tmp_path / "train.txt"
    src.write_bytes(CRITEO_TSV.read_bytes())
    cache = tmp_path / "cache"
    base = open_dataset(f"criteo:{src}", cache)
    other_option = open_dataset(f"criteo:{src}", cache, min_count=2)
    other_transform = open_dataset(f"criteo:{src}", cache, dense_transform="none")
    assert len({base.path, other_option.path, other_transform.path}) == 3
    assert other_option.schema.cardinalities != base.schema.cardinalities
    # vocabulary counted once for all three (the statistics pass is cached separately)
    assert len(_entries(cache, "stats")) == 1
    # a changed file (new content, new mtime) rebuilds
    lines = CRITEO_TSV.read_text().splitlines(keepends=True)
    src.write_text("".join(lines[:100]))
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = open_dataset(f"criteo:{src}", cache)
    assert changed.path not in (base.path, other_option.path, other_transform.path)
    assert len(changed) == 100
    assert len(_entries(cache, "stats")) == 2


def test_rebuild_flag_and_incomplete_entry(tmp_path: Path) -> None:
    ds = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, hash_size=100)
    path = ds.path
    (path / "meta.json").unlink()  # as if a writer died before finishing
    again = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, hash_size=100)
    assert again.path == path and (path / "meta.json").exists()
    before = (path / "meta.json").stat().st_mtime_ns
    rebuilt = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, hash_size=100, rebuild=True)
    assert (rebuilt.path / "meta.json").stat().st_mtime_ns >= before
    np.testing.assert_array_equal(rebuilt.sparse, np.array(ds.sparse))


def test_vocabulary_file_is_saved_and_reloadable(tmp_path: Path) -> None:
    from torchrec_cowclip.data.parsing.vocab import Vocabulary

    ds = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path)
    (stats,) = _entries(tmp_path, "stats")
    vocab = Vocabulary.load(stats / "vocab.npz")
    assert vocab.names == list(ds.schema.sparse_names)
    assert vocab.cardinalities(1) == ds.schema.cardinalities
    assert int(vocab.counts(0).sum()) == int((ds.sparse[:, 0] != 1).sum())


# ---------------------------------------------------------------- TorchRec npy layout


def _torchrec_npy_days(tmp_path: Path) -> Path:
    """Day files written by TorchRec's own converter from the raw sample."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    lines = CRITEO_TSV.read_text().splitlines(keepends=True)
    raw, out = tmp_path / "raw", tmp_path / "npy"
    raw.mkdir()
    out.mkdir()
    for day, part in enumerate((lines[:120], lines[120:])):
        (raw / f"day_{day}").write_text("".join(part))
        BinaryCriteoUtils.tsv_to_npys(
            str(raw / f"day_{day}"),
            str(out / f"day_{day}_dense.npy"),
            str(out / f"day_{day}_sparse.npy"),
            str(out / f"day_{day}_labels.npy"),
        )
    return out


def test_criteo_npy_round_trip(tmp_path: Path) -> None:
    out = _torchrec_npy_days(tmp_path)
    assert [d.prefix for d in find_npy_days(out)] == ["day_0", "day_1"]
    size = 1000
    ds = open_dataset(f"criteo-npy:{out}", tmp_path / "cache", hash_size=size)
    assert len(ds) == 200 and ds.schema.cardinalities == (size,) * 26
    rows = [line.rstrip("\n").split("\t") for line in CRITEO_TSV.read_text().splitlines()]
    expected_sparse = np.array([[int(v or "0", 16) % size for v in r[14:]] for r in rows])
    np.testing.assert_array_equal(ds.sparse, expected_sparse)
    np.testing.assert_array_equal(ds.labels, np.array([float(r[0]) for r in rows], np.float32))
    dense = np.concatenate([np.load(out / f"day_{d}_dense.npy") for d in (0, 1)])
    np.testing.assert_array_equal(ds.dense, dense)  # already log-transformed by TorchRec: kept
    # one prefix as the test set
    split = open_dataset(
        f"criteo-npy:{out / 'day_0'}",
        tmp_path / "cache",
        hash_size=size,
        test_paths=[out / "day_1"],
    )
    assert split.test_start == 120 and len(split) == 200
    assert split.split()[2].tolist() == list(range(120, 200))


def test_criteo_npy_contiguous_ids_and_minmax(tmp_path: Path) -> None:
    d = tmp_path / "npy"
    d.mkdir()
    rng = np.random.default_rng(0)
    np.save(d / "day_0_dense.npy", rng.random((50, 13), dtype=np.float32) * 5)
    np.save(d / "day_0_sparse.npy", rng.integers(0, 40, (50, 26)).astype(np.int32))
    np.save(d / "day_0_labels.npy", rng.integers(0, 2, 50).astype(np.int32))  # [N] labels
    ds = open_dataset(f"criteo-npy:{d}", tmp_path / "cache", dense_transform="minmax")
    sparse = np.load(d / "day_0_sparse.npy")
    np.testing.assert_array_equal(ds.sparse, sparse)
    assert ds.schema.cardinalities == tuple(int(m) + 1 for m in sparse.max(0))
    inputs = ds.dense_inputs()
    assert np.isclose(inputs.min(), 0) and np.isclose(inputs.max(), 1)


def test_criteo_npy_bad_rows(tmp_path: Path) -> None:
    d = tmp_path / "npy"
    d.mkdir()
    np.save(d / "day_0_dense.npy", np.zeros((4, 13), np.float32))
    np.save(d / "day_0_sparse.npy", np.ones((4, 26), np.int64))
    np.save(
        d / "day_0_labels.npy", np.array([[0], [1], [-1], [1]], np.int32)
    )  # -1: Kaggle test filler
    with pytest.raises(DataError, match=f"day_0_labels.npy:3: {BAD_LABEL}"):
        open_dataset(f"criteo-npy:{d}", tmp_path / "cache")
    ds = open_dataset(f"criteo-npy:{d}", tmp_path / "cache", on_bad_row="skip")
    assert len(ds) == 3 and ds.bad_rows == {BAD_LABEL: 1}
    np.save(d / "day_1_dense.npy", np.zeros((3, 13), np.float32))
    np.save(d / "day_1_sparse.npy", np.ones((2, 26), np.int64))
    np.save(d / "day_1_labels.npy", np.zeros(3, np.int32))
    with pytest.raises(DataError, match="row counts differ"):
        open_dataset(f"criteo-npy:{d}", tmp_path / "cache", on_bad_row="skip")
    with pytest.raises(FileNotFoundError, match="no <prefix>_dense.npy"):
        open_dataset(f"criteo-npy:{tmp_path / 'cache'}", tmp_path / "cache2")


def _same_size_edit(path: Path) -> None:
    """Flips the first row's label (same size) and puts the mtime back, as ``touch -r``
    or ``rsync --times`` would."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[0] = ord("1") if data[0] == ord("0") else ord("0")
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_same_size_edit_with_its_mtime_put_back_is_never_read_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrec_cowclip.data.pipeline import cache

    src = tmp_path / "train.tsv"
    src.write_bytes(CRITEO_TSV.read_bytes())
    before = open_dataset(f"criteo:{src}", tmp_path / "c")
    label = float(before.labels[0])
    _same_size_edit(src)
    after = open_dataset(f"criteo:{src}", tmp_path / "c")
    assert after.path != before.path and float(after.labels[0]) == 1.0 - label
    meta = json.loads((after.path / "meta.json").read_text())
    assert meta["payload"]["sources"][0]["sha256"] == cache.sha256_of(src)[1]
    # A new process reuses the digest while the file's stat (ctime included) is unchanged,
    # and reads the file again once it changes.
    reads = []
    real = cache.sha256_of
    monkeypatch.setattr(cache, "sha256_of", lambda p, o=0: reads.append(p) or real(p, o))
    cache._SOURCE_DIGESTS.clear()
    assert open_dataset(f"criteo:{src}", tmp_path / "c").path == after.path and reads == []
    _same_size_edit(src)
    cache._SOURCE_DIGESTS.clear()
    assert open_dataset(f"criteo:{src}", tmp_path / "c").path == before.path
    assert [Path(p).name for p in reads] == ["train.tsv"]


def _checkpointed_run(tmp_path: Path) -> Tuple[Path, List[str]]:
    """A run of ``tmp_path/train.tsv`` stopped at its step-2 checkpoint: ``(the source,
    the command that resumes it with --resume auto, to give --max-steps)``."""
    from tiny import TINY_FILE_RUN, tiny_cli

    from torchrec_cowclip.cli import main

    src = tmp_path / "train.tsv"
    src.write_bytes(CRITEO_TSV.read_bytes())
    argv = tiny_cli(
        TINY_FILE_RUN, data=f"criteo:{src}", batch_size=32, checkpoint_every=2,
        out=tmp_path / "run", cache_dir=tmp_path / "c",
    ) + ["--resume", "auto"]  # fmt: skip
    assert main(argv + ["--max-steps", "2"]) == 0
    return src, argv


def _resume_refused(capsys, argv: List[str]) -> str:
    from torchrec_cowclip.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main(argv + ["--max-steps", "4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert refused.value.code == 2 and "--resume refused" in err, err
    return err


def test_resume_auto_refuses_data_edited_behind_its_mtime(tmp_path: Path, capsys) -> None:
    src, argv = _checkpointed_run(tmp_path)
    _same_size_edit(src)
    assert "--data content" in _resume_refused(capsys, argv)


def test_resume_auto_refuses_an_edit_hidden_by_a_forged_digest_record(
    tmp_path: Path, capsys
) -> None:
    """The source edited (same size, mtime put back), then its current size, mtime,
    ctime, inode and device written into ``.source-digests.json`` with the old SHA-256
    (issue 48): the cache key is the old one, but the run's own record of the file (its
    stamp then) says it changed, so it is read again and the resume refused."""
    from torchrec_cowclip.data.pipeline import cache

    src, argv = _checkpointed_run(tmp_path)
    old = cache.sha256_of(src)[1]
    _same_size_edit(src)
    now = src.stat()
    stamp = [now.st_size, now.st_mtime_ns, now.st_ctime_ns, now.st_ino, now.st_dev]
    memo = tmp_path / "c" / cache.DIGEST_MEMO
    memo.write_text(json.dumps({str(src.resolve()): {"stat": stamp, "sha256": old}}))
    cache._SOURCE_DIGESTS.clear()  # a new process
    err = _resume_refused(capsys, argv)
    assert f"{src.resolve()} is not the file the checkpoint" in err, err
    assert f"though the cache's digest record ({cache.DIGEST_MEMO}) says it is" in err

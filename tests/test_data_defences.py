"""Data that defends itself: a verified cache, no lost first row, one-line option errors,
clipped dense outliers, and a registry a new format plugs into."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest

from torchrec_cowclip import readback
from torchrec_cowclip.cli import main
from torchrec_cowclip.data import (
    BAD_LABEL,
    DENSE_CLIP,
    CacheCorrupt,
    CTRDataset,
    DataError,
    DataOptionError,
    FileSourceOptions,
    SourceKind,
    open_dataset,
    register_source,
    source_kinds,
)
from torchrec_cowclip.data.errors import BadRowLog
from torchrec_cowclip.data.parsing.fields import check_labels
from torchrec_cowclip.data.parsing.rows import RowBlock, SparseCheck, validate_block
from torchrec_cowclip.data.pipeline import cache as cache_module
from torchrec_cowclip.data.pipeline.cache import CACHE_VERSION, build_entry, cache_key, fingerprint
from torchrec_cowclip.data.pipeline.encode import Conversion
from torchrec_cowclip.data.sources.criteo_npy import StoredIds

DATA = Path(__file__).resolve().parent / "data"
CRITEO_TSV = DATA / "criteo_sample.tsv"


def _copy(tmp_path: Path, name: str = "train.txt") -> Path:
    src = tmp_path / name
    src.write_bytes(CRITEO_TSV.read_bytes())
    return src


# ---------------------------------------------------------------- cache verification


def test_truncated_array_is_rebuilt_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = _copy(tmp_path)
    first = open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    expected = np.array(first.sparse)
    sparse = first.path / "sparse.npy"
    sparse.write_bytes(sparse.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING):
        again = open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    assert again.path == first.path
    np.testing.assert_array_equal(again.sparse, expected)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("sparse.npy is corrupt (size" in w and "rebuilding" in w for w in warnings), warnings


def test_same_size_in_range_corruption_is_detected_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = _copy(tmp_path)
    first = open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    expected_sparse, expected_dense = np.array(first.sparse), np.array(first.dense)
    del first  # drop the memmaps before writing through others
    entry = open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000).path
    for name, value in (("sparse.npy", 7), ("dense.npy", 0.5)):
        arr = np.load(entry / name, mmap_mode="r+")
        flat = arr.reshape(-1)
        flat[3] = value if flat[3] != value else value + 1  # still a valid id / dense value
        arr.flush()
        del arr, flat
        with caplog.at_level(logging.WARNING):
            ds = open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
        assert f"{name} is corrupt (checksum mismatch)" in caplog.text
        np.testing.assert_array_equal(ds.sparse, expected_sparse)
        np.testing.assert_array_equal(ds.dense, expected_dense)
        caplog.clear()


def test_corrupt_statistics_entry_is_rebuilt_and_a_killed_build_cleaned_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = _copy(tmp_path)
    first = open_dataset(f"criteo:{src}", tmp_path / "c")
    (stats,) = [p for p in (tmp_path / "c").iterdir() if p.name.startswith("stats-")]
    vocab = stats / "vocab.npz"
    vocab.write_bytes(vocab.read_bytes()[:-10])
    stale = tmp_path / "c" / f".tmp-{first.path.name}-killed"
    stale.mkdir()
    with caplog.at_level(logging.WARNING):
        again = open_dataset(
            f"criteo:{src}", tmp_path / "c", min_count=2
        )  # re-encodes from the statistics
    assert "vocab.npz is corrupt (size" in caplog.text
    assert again.schema.cardinalities != first.schema.cardinalities
    assert "vocab.npz" in json.loads((stats / "meta.json").read_text())["checks"]
    open_dataset(f"criteo:{src}", tmp_path / "c", rebuild=True)
    assert not stale.exists()


def test_opening_a_corrupt_entry_directly_fails_in_one_line(tmp_path: Path) -> None:
    src = _copy(tmp_path)
    entry = open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000).path
    labels = entry / "labels.npy"
    labels.write_bytes(labels.read_bytes()[:-4])
    with pytest.raises(CacheCorrupt) as e:
        CTRDataset(entry)
    assert "\n" not in str(e.value) and "labels.npy is corrupt" in str(e.value)


def test_corrupt_entry_whose_source_is_gone_fails_in_one_line(tmp_path: Path) -> None:
    src = _copy(tmp_path)
    entry = open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000).path
    (entry / "sparse.npy").write_bytes(b"")
    src.unlink()
    with pytest.raises(FileNotFoundError) as e:
        open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    assert str(e.value) == f"data file not found: {src}"
    # the same when the source vanishes between the key and the rebuild
    payload = {"x": 1}

    def build(tmp: Path) -> Dict[str, Any]:
        np.save(tmp / "a.npy", np.arange(3))
        return {"rows": 3}

    demo = build_entry(tmp_path / "c", "demo", payload, build)
    (demo / "a.npy").write_bytes(b"junk")

    def gone(tmp: Path) -> Dict[str, Any]:
        raise FileNotFoundError(f"data file not found: {src}")

    with pytest.raises(CacheCorrupt) as e2:
        build_entry(tmp_path / "c", "demo", payload, gone)
    assert "\n" not in str(e2.value)
    assert "a.npy is corrupt" in str(
        e2.value
    ) and f"its source is gone: data file not found: {src}" in str(e2.value)


def test_checksums_are_read_once_per_process_and_after_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _copy(tmp_path)
    ds = open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    reads: List[str] = []
    real = readback._digest_read

    def counted(kind: str, f, offset: int = 0):
        if kind == readback.CRC32:
            reads.append(Path(f.name).name)
        return real(kind, f, offset)

    monkeypatch.setattr(readback, "_digest_read", counted)
    open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    assert reads == []  # built by this process: sizes only
    cache_module._VERIFIED.clear()  # as a new process
    open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    assert sorted(set(reads)) == ["dense.npy", "labels.npy", "sparse.npy"]
    reads.clear()
    open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    assert reads == []
    (ds.path / "labels.npy").touch()
    open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    assert "labels.npy" in reads


def test_a_rewritten_meta_json_has_every_checksum_read_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The memo of verified entries knows an entry by all its files, meta.json too: a
    record changed since the last check is held against the file's bytes (issue 45)."""
    src = _copy(tmp_path)
    entry = open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000).path
    meta_path = entry / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["checks"]["labels.npy"]["crc32"] = "00000000"
    meta_path.write_text(json.dumps(meta, indent=1))
    with caplog.at_level(logging.WARNING):
        open_dataset(f"criteo:{src}", tmp_path / "c", hash_size=1000)
    assert "labels.npy is corrupt (checksum mismatch)" in caplog.text


def test_older_format_entry_is_rebuilt_in_place_and_keys_are_stable(tmp_path: Path) -> None:
    src = _copy(tmp_path)
    ds = open_dataset(f"criteo:{src}", tmp_path / "c")
    # the key as the version-1 format computed it: unchanged, so old entries are found
    options = {"on_bad_row": "error", "min_count": 1, "hash_size": None, "dense_transform": "log"}
    columns = {"label": None, "dense": None, "sparse": None, "delimiter": None}
    payload = {
        "sources": fingerprint([src]),
        "test": fingerprint([]),
        "options": options,
        "columns": columns,
    }
    assert ds.path.name == f"criteo-{cache_key({'kind': 'criteo', **payload})}"
    meta = json.loads((ds.path / "meta.json").read_text())
    meta["version"] = 1
    del meta["checks"]
    (ds.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CacheCorrupt, match=f"format version 1, expected {CACHE_VERSION}"):
        CTRDataset(ds.path)  # an entry without checksums is not trusted
    again = open_dataset(f"criteo:{src}", tmp_path / "c")
    assert (
        again.path == ds.path
        and again.meta["version"] == CACHE_VERSION
        and "sparse.npy" in again.meta["checks"]
    )


# ---------------------------------------------------------------- first row


def test_bom_does_not_hide_the_first_row(tmp_path: Path) -> None:
    plain = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path / "c", hash_size=1000)
    bom = tmp_path / "bom.tsv"
    bom.write_bytes(b"\xef\xbb\xbf" + CRITEO_TSV.read_bytes())
    ds = open_dataset(f"criteo:{bom}", tmp_path / "c", hash_size=1000, on_bad_row="error")
    assert len(ds) == 200
    np.testing.assert_array_equal(ds.sparse, plain.sparse)
    np.testing.assert_array_equal(ds.dense, plain.dense)
    # a header with a BOM still names its first column
    avazu = DATA / "avazu_sample.csv"
    bom_csv = tmp_path / "bom.csv"
    bom_csv.write_bytes(b"\xef\xbb\xbf" + avazu.read_bytes())
    assert (
        open_dataset(f"avazu:{bom_csv}", tmp_path / "c").schema
        == open_dataset(f"avazu:{avazu}", tmp_path / "c").schema
    )


def test_non_numeric_first_label_is_a_bad_row(tmp_path: Path) -> None:
    lines = CRITEO_TSV.read_text().splitlines(keepends=True)
    p = tmp_path / "day_0"
    p.write_text("x" + lines[0][1:] + "".join(lines[1:]))
    with pytest.raises(DataError, match=f"^{p}:1: {BAD_LABEL}: got 'x'$"):
        open_dataset(f"criteo:{p}", tmp_path / "c")
    ds = open_dataset(f"criteo:{p}", tmp_path / "c", on_bad_row="skip")
    assert len(ds) == 199 and ds.bad_rows == {BAD_LABEL: 1}
    # Criteo's CSV form with a header line (names in the label and dense fields) still reads
    assert len(open_dataset(f"criteo:{DATA / 'criteo_sample.csv'}", tmp_path / "c")) == 200


# ---------------------------------------------------------------- option errors


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--data", "synthetic:0"],
            "--data: synthetic:0: synthetic:ROWS needs a positive whole row count",
        ),
        (
            ["--data", "synthetic:abc"],
            "--data: synthetic:abc: synthetic:ROWS needs a positive whole row count",
        ),
        (["--data", f"table:{DATA / 'criteo_sample.csv'}"], "table: sources need label= (--label)"),
        (
            ["--data", f"criteo:{CRITEO_TSV}", "--hash-size", "1000", "--min-count", "2"],
            "min_count (--min-count 2) applies to vocabulary encoding; it cannot be combined with "
            "hash_size (--hash-size 1000)",
        ),
    ],
)
def test_cli_option_errors_are_one_line(
    args: List[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train",
                *args,
                "--out",
                str(tmp_path / "run"),
                "--cache-dir",
                str(tmp_path / "c"),
                "--no-progress",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert (
        err.count("\n") == 1 and err.startswith("torchrec-cowclip: error: ") and expected in err
    ), err
    assert not (tmp_path / "c").exists()  # refused before anything was written


def test_option_of_another_kind(tmp_path: Path) -> None:
    # the trainer passes every kind's options: at their defaults they are not "given"
    assert (
        len(
            open_dataset(
                "synthetic:100",
                tmp_path,
                min_count=1,
                hash_size=None,
                label=None,
                cardinality_scale=0.001,
            )
        )
        == 100
    )
    with pytest.raises(
        DataOptionError,
        match=r"^criteo-npy: does not take min_count \(--min-count\); "
        r"it applies to criteo:, avazu:, table: only$",
    ):
        open_dataset(f"criteo-npy:{tmp_path}", tmp_path, min_count=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'hash_sizes'"):
        open_dataset("synthetic:100", tmp_path, hash_sizes=3)
    with pytest.raises(DataOptionError, match=r"--synthetic-scale"):
        open_dataset("synthetic:100", tmp_path, cardinality_scale=-1.0)


# ---------------------------------------------------------------- dense outliers


def test_huge_dense_value_is_clipped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lines = CRITEO_TSV.read_text().splitlines(keepends=True)
    fields = lines[5].split("\t")
    fields[1] = "1e300"  # I1
    p = tmp_path / "day_0"
    p.write_text("".join(lines[:5] + ["\t".join(fields)] + lines[6:]))
    with caplog.at_level(logging.WARNING):
        ds = open_dataset(f"criteo:{p}", tmp_path / "c", hash_size=1000, dense_transform="minmax")
    assert ds.dense_clipped == {"I1": 1}
    assert "clipped 1 dense values beyond +-1e+30" in caplog.text
    assert caplog.text.count("clipped 1 dense values") == 1  # said once
    i1 = np.array(ds.dense_inputs()[:, 0], dtype=np.float64)
    assert i1[5] == 1.0
    raw = np.array([float(line.split("\t")[1] or 0) for line in lines])
    raw[5] = DENSE_CLIP
    np.testing.assert_allclose(i1, raw / DENSE_CLIP, rtol=1e-6)  # min 0, max the bound
    assert (i1[np.arange(200) != 5] > 0).sum() == (
        raw[np.arange(200) != 5] > 0
    ).sum()  # not flattened
    none = open_dataset(f"criteo:{p}", tmp_path / "c", hash_size=1000, dense_transform="none")
    assert np.isfinite(none.dense_inputs()).all() and none.dense[5, 0] == np.float32(DENSE_CLIP)


# ---------------------------------------------------------------- a new format


@dataclass(frozen=True)
class ArraysOptions(FileSourceOptions):
    """Options of the test-only ``arrays:`` kind (none of its own)."""


class _ArrayRows:
    """``.npz`` files holding ``dense``, ``sparse`` (ids) and ``labels``: one block each."""

    def names(self, path: str) -> Tuple[List[str], List[str]]:
        with np.load(path) as z:
            return [f"d{i}" for i in range(z["dense"].shape[1])], [
                f"s{i}" for i in range(z["sparse"].shape[1])
            ]

    def part_name(self, path: str) -> str:
        return str(path)

    def blocks(
        self, path: str, log: BadRowLog, sparse_check: Optional[SparseCheck] = None
    ) -> Iterator[RowBlock]:
        with np.load(path) as z:
            dense, sparse, raw = (
                z["dense"].astype(np.float64),
                z["sparse"].astype(np.int64),
                z["labels"],
            )
        labels, bad = check_labels(raw)
        block = RowBlock(str(path), np.arange(1, len(raw) + 1), labels, dense, sparse)
        yield validate_block(
            block, log, bad, ~np.isfinite(dense), self.names(path)[0], raw, dense.T, sparse_check
        )


def test_a_new_format_is_one_registered_kind(tmp_path: Path) -> None:
    @register_source
    class ArraysSource(SourceKind, name="arrays", usage="arrays:PATH.npz", options=ArraysOptions):
        def payload(
            self, args: List[str], test_paths: List[str], opts: ArraysOptions
        ) -> Dict[str, Any]:
            return {
                "sources": fingerprint(args),
                "on_bad_row": opts.on_bad_row,
                "dense_transform": opts.dense_transform,
            }

        def conversion(
            self, args: List[str], test_paths: List[str], opts: ArraysOptions
        ) -> Conversion:
            return Conversion(
                _ArrayRows(),
                args,
                test_paths,
                StoredIds(),
                stats_key={"train": fingerprint(args)},
                dense_transform=opts.dense_transform,
                on_bad_row=opts.on_bad_row,
            )

    try:
        p = tmp_path / "a.npz"
        np.savez(
            p,
            dense=np.array([[1.0], [3.0], [7.0]]),
            sparse=np.array([[0, 4], [2, 1], [1, 1]]),
            labels=np.array([1, 0, 2]),
        )
        assert "arrays" in source_kinds()
        with pytest.raises(DataError, match=f"^{p}:3: {BAD_LABEL}: got 2$"):
            open_dataset(f"arrays:{p}", tmp_path / "c")
        ds = open_dataset(f"arrays:{p}", tmp_path / "c", on_bad_row="skip", dense_transform="none")
        assert ds.bad_rows == {BAD_LABEL: 1} and ds.schema.cardinalities == (3, 5)
        np.testing.assert_array_equal(ds.sparse, [[0, 4], [2, 1]])
        np.testing.assert_array_equal(ds.dense, [[1.0], [3.0]])
        assert "sparse.npy" in ds.meta["checks"]
        with pytest.raises(DataOptionError, match="arrays: does not take label"):
            open_dataset(f"arrays:{p}", tmp_path / "c", label="y")
    finally:
        from torchrec_cowclip.data import registry

        registry._KINDS.pop("arrays", None)

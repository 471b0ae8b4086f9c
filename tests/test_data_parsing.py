"""Parsers of the real sample files, encodings checked by hand, bad rows, bad inputs."""

from __future__ import annotations

import csv
import gzip
import json
import logging
import math
import re
from pathlib import Path
from typing import List

import numpy as np
import pytest

from torchrec_cowclip.data import (
    BAD_DENSE,
    BAD_HEX,
    BAD_LABEL,
    CRITEO_DENSE_NAMES,
    CRITEO_SPARSE_NAMES,
    MISSING_ID,
    OOV_ID,
    SPEC_KINDS,
    WRONG_COLUMN_COUNT,
    DataError,
    open_dataset,
    parse_spec,
)
from torchrec_cowclip.data.parsing.hashing import fnv1a64_scalar

DATA = Path(__file__).resolve().parent / "data"
CRITEO_TSV = DATA / "criteo_sample.tsv"
CRITEO_CSV = DATA / "criteo_sample.csv"
AVAZU_CSV = DATA / "avazu_sample.csv"


def tsv_rows(path: Path = CRITEO_TSV) -> List[List[str]]:
    with open(path, newline="") as f:
        return [line.rstrip("\n").split("\t") for line in f]


def csv_rows(path: Path) -> List[List[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def expected_log_dense(rows: List[List[str]]) -> np.ndarray:
    """Criteo's model inputs by hand: missing and negative values 0, then log(1 + x)."""
    return np.array(
        [[math.log1p(max(0.0, float(v or 0))) for v in r[1:14]] for r in rows], dtype=np.float32
    )


def expected_stored_dense(rows: List[List[str]]) -> np.ndarray:
    """What the cache stores under log: a missing value NaN, a negative one 0."""
    return np.array(
        [[math.log1p(max(0.0, float(v))) if v else math.nan for v in r[1:14]] for r in rows],
        dtype=np.float32,
    )


# ---------------------------------------------------------------- real samples


def test_criteo_tsv_sample_shapes_labels_dense(tmp_path: Path) -> None:
    rows = tsv_rows()
    assert len(rows) == 200 and all(len(r) == 40 for r in rows)
    ds = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path)
    assert len(ds) == 200
    assert ds.dense.shape == (200, 13) and ds.dense.dtype == np.float32
    assert ds.sparse.shape == (200, 26)
    assert ds.labels.shape == (200,) and ds.labels.dtype == np.float32
    assert ds.schema.dense_names == CRITEO_DENSE_NAMES
    assert ds.schema.sparse_names == CRITEO_SPARSE_NAMES
    n_pos = sum(r[0] == "1" for r in rows)
    assert int(ds.labels.sum()) == n_pos
    np.testing.assert_array_equal(
        ds.labels, np.array([float(r[0]) for r in rows], dtype=np.float32)
    )
    np.testing.assert_allclose(ds.dense, expected_stored_dense(rows), rtol=1e-6)
    np.testing.assert_allclose(ds.dense_inputs(), expected_log_dense(rows), rtol=1e-6)
    batch = next(iter(ds.batches(np.arange(200), batch_size=200)))
    np.testing.assert_allclose(batch.dense_features.numpy(), expected_log_dense(rows), rtol=1e-6)
    # I2's negative counts cannot take log(1 + x): counted and set to 0, Criteo's convention.
    negative = sum(1 for r in rows if r[2] and float(r[2]) < 0)
    assert negative > 0 and ds.dense_negative_under_log == {"I2": negative}
    assert (ds.sparse >= 0).all() and (ds.sparse < np.array(ds.schema.cardinalities)).all()
    assert ds.bad_rows == {}


def test_criteo_csv_with_header_matches_tsv(tmp_path: Path) -> None:
    rows = csv_rows(CRITEO_CSV)
    assert rows[0][0] == "label" and len(rows) == 201
    tsv = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path)
    via_criteo = open_dataset(f"criteo:{CRITEO_CSV}", tmp_path)
    via_table = open_dataset(
        f"table:{CRITEO_CSV}",
        tmp_path,
        label="label",
        dense=CRITEO_DENSE_NAMES,
        sparse=CRITEO_SPARSE_NAMES,
        dense_transform="log",  # Criteo's; a table's default, signed-log, keeps I2's sign
    )
    assert int(via_table.labels.sum()) == sum(r[0] == "1" for r in rows[1:])
    for ds in (via_criteo, via_table):
        assert ds.sparse.shape == (200, 26)
        np.testing.assert_array_equal(ds.labels, tsv.labels)
        np.testing.assert_array_equal(ds.dense, tsv.dense)  # "260.0" and "260" agree
        np.testing.assert_array_equal(ds.sparse, tsv.sparse)
        assert ds.schema == tsv.schema


def test_avazu_sample(tmp_path: Path) -> None:
    rows = csv_rows(AVAZU_CSV)
    header, body = rows[0], rows[1:]
    ds = open_dataset(f"avazu:{AVAZU_CSV}", tmp_path)
    assert len(ds) == len(body) == 100
    assert ds.dense.shape == (100, 0)
    assert ds.sparse.shape == (100, 22)
    expected_names = tuple(c for c in header if c not in ("id", "click"))
    assert ds.schema.sparse_names == expected_names and len(expected_names) == 22
    assert int(ds.labels.sum()) == sum(r[header.index("click")] == "1" for r in body)
    # vocabulary ids by hand: 2 + rank of the value among the column's sorted values
    for name in ("site_id", "device_model", "C14"):
        col = [r[header.index(name)] for r in body]
        vocab = sorted(set(v.encode() for v in col if v))
        expected = [2 + vocab.index(v.encode()) if v else MISSING_ID for v in col]
        assert ds.sparse[:, expected_names.index(name)].tolist() == expected
        assert ds.schema.cardinality(name) == 2 + len(vocab)


def test_avazu_hashing_by_hand(tmp_path: Path) -> None:
    rows = csv_rows(AVAZU_CSV)
    header, body = rows[0], rows[1:]
    ds = open_dataset(f"avazu:{AVAZU_CSV}", tmp_path, hash_size=1000)
    names = ds.schema.sparse_names
    assert ds.schema.cardinalities == (1000,) * 22
    for i in (0, 17, 99):
        for name in ("hour", "site_id", "C21"):
            v = body[i][header.index(name)].encode()
            assert ds.sparse[i, names.index(name)] == 1 + fnv1a64_scalar(v) % 999


# ---------------------------------------------------------------- encodings by hand


def test_criteo_vocabulary_by_hand(tmp_path: Path) -> None:
    rows = tsv_rows()
    ds = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path)
    for c in (0, 2, 9, 19, 25):  # C1, C3, C10, C20 (has missing), C26 (mostly missing)
        col = [r[14 + c] for r in rows]
        vocab = sorted(set(v for v in col if v))
        assert ds.schema.cardinalities[c] == 2 + len(vocab)
        for i in (0, 1, 2, 57, 199):
            v = col[i]
            assert ds.sparse[i, c] == (2 + vocab.index(v) if v else MISSING_ID)


def test_criteo_hashing_by_hand(tmp_path: Path) -> None:
    rows = tsv_rows()
    size = 10_007
    ds = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, hash_size=size)
    assert ds.schema.cardinalities == (size,) * 26
    for i in (0, 1, 2, 100, 199):
        for c in range(26):
            v = rows[i][14 + c]
            assert ds.sparse[i, c] == (1 + int(v, 16) % (size - 1) if v else 0)


def test_criteo_per_feature_hash_sizes(tmp_path: Path) -> None:
    sizes = {name: 50 + k for k, name in enumerate(CRITEO_SPARSE_NAMES)}
    ds = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, hash_size=sizes)
    assert ds.schema.cardinalities == tuple(sizes.values())
    assert (ds.sparse < np.array(ds.schema.cardinalities)).all()


def test_vocabulary_min_count_maps_rare_values_to_oov(tmp_path: Path) -> None:
    rows = tsv_rows()
    ds = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, min_count=3)
    for c in (0, 1, 2, 5):
        col = [r[14 + c] for r in rows]
        counts = {v: col.count(v) for v in set(col) if v}
        kept = sorted(v for v, n in counts.items() if n >= 3)
        assert ds.schema.cardinalities[c] == 2 + len(kept)
        expected = [
            MISSING_ID if not v else (2 + kept.index(v) if v in kept else OOV_ID) for v in col
        ]
        assert ds.sparse[:, c].tolist() == expected
    # C3 is almost all singletons: nearly every row becomes OOV
    assert (ds.sparse[:, 2] == OOV_ID).mean() > 0.5


def test_minmax_and_none_keep_negative_values(tmp_path: Path) -> None:
    rows = tsv_rows()
    raw = np.array([[float(v) if v else np.nan for v in r[1:14]] for r in rows])
    lo, hi = np.nanmin(raw, 0), np.nanmax(raw, 0)  # of the present values only
    expected = np.nan_to_num((raw - lo) / np.where(hi > lo, hi - lo, 1), nan=0.0)
    ds = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, dense_transform="minmax")
    np.testing.assert_allclose(ds.dense_inputs(), expected.astype(np.float32), atol=1e-6)
    assert ds.dense_negative_under_log == {} and lo[1] < 0  # I2's negatives are kept
    none = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, dense_transform="none")
    np.testing.assert_array_equal(none.dense, raw.astype(np.float32))
    np.testing.assert_array_equal(none.dense_inputs(), np.nan_to_num(raw).astype(np.float32))


def test_explicit_test_files_use_training_vocabulary(tmp_path: Path) -> None:
    lines = CRITEO_TSV.read_text().splitlines(keepends=True)
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("".join(lines[:150]))
    test.write_text("".join(lines[150:]))
    ds = open_dataset(f"criteo:{train}", tmp_path / "cache", test_paths=[test])
    assert len(ds) == 200 and ds.test_start == 150
    tr, val, te = ds.split(val_fraction=0.1)
    assert te.tolist() == list(range(150, 200))
    assert len(tr) + len(val) == 150
    rows = tsv_rows()
    col = [r[14 + 2] for r in rows]  # C3: test values mostly unseen in train -> OOV
    vocab = sorted(set(v for v in col[:150] if v))
    for i in range(150, 200):
        v = col[i]
        expected = MISSING_ID if not v else (2 + vocab.index(v) if v in vocab else OOV_ID)
        assert ds.sparse[i, 2] == expected


def test_multiple_files_and_gzip(tmp_path: Path) -> None:
    lines = CRITEO_TSV.read_text().splitlines(keepends=True)
    a, b = tmp_path / "day_0", tmp_path / "day_1.gz"
    a.write_text("".join(lines[:80]))
    with gzip.open(b, "wt") as f:
        f.write("".join(lines[80:]))
    both = open_dataset(f"criteo:{a},{b}", tmp_path / "c1")
    whole = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path / "c2")
    np.testing.assert_array_equal(both.sparse, whole.sparse)
    np.testing.assert_array_equal(both.dense, whole.dense)
    assert [f["rows"] for f in both.meta["file_rows"]] == [80, 120]


def test_small_blocks_and_missing_trailing_newline(tmp_path: Path) -> None:
    from torchrec_cowclip.data.errors import BadRowLog
    from torchrec_cowclip.data.parsing.delimited import DelimitedFile
    from torchrec_cowclip.data.parsing.rows import TextRowSource
    from torchrec_cowclip.data.sources.criteo import CRITEO_LAYOUT

    text = CRITEO_TSV.read_text().rstrip("\n")  # no final newline
    p = tmp_path / "x.tsv"
    p.write_text(text)
    f = DelimitedFile(
        p, header=False, n_columns=40, block_bytes=1000
    )  # many blocks, lines split across reads
    got = np.concatenate([blk.columns[16] for blk in f.blocks([16])])
    assert got.tolist() == [r[16].encode() for r in tsv_rows()]
    blocks = list(TextRowSource(CRITEO_LAYOUT).blocks(p, BadRowLog("error")))
    assert sum(len(b) for b in blocks) == 200


def test_table_tsv_and_delimiter(tmp_path: Path) -> None:
    p = tmp_path / "t.tsv"
    p.write_text("y\tx1\tx2\tcat\n1\t0.5\t-2\tred\n0\t\t3\tblue\n1\t1e2\t4\t\n")
    ds = open_dataset(
        f"table:{p}",
        tmp_path / "c",
        label="y",
        dense=["x1", "x2"],
        sparse=["cat"],
        dense_transform="none",
    )
    np.testing.assert_array_equal(
        ds.dense, np.array([[0.5, -2], [np.nan, 3], [100, 4]], np.float32)
    )
    np.testing.assert_array_equal(
        ds.dense_inputs(), np.array([[0.5, -2], [0, 3], [100, 4]], np.float32)
    )
    assert ds.sparse[:, 0].tolist() == [3, 2, MISSING_ID]  # blue=2, red=3
    semi = tmp_path / "t.dat"
    semi.write_text("y;a\n1;u\n0;v\n")
    with pytest.raises(ValueError, match="delimiter"):
        open_dataset(f"table:{semi}", tmp_path / "c", label="y", dense=[], sparse=["a"])
    ds2 = open_dataset(
        f"table:{semi}", tmp_path / "c", label="y", dense=[], sparse=["a"], delimiter=";"
    )
    assert ds2.sparse[:, 0].tolist() == [2, 3]


def test_quoted_csv(tmp_path: Path) -> None:
    p = tmp_path / "q.csv"
    p.write_text('label,city,n\n1,"Paris, FR",3\n0,Lyon,4\n')
    ds = open_dataset(f"table:{p}", tmp_path / "c", label="label", dense=["n"], sparse=["city"])
    assert ds.sparse[:, 0].tolist() == [3, 2]  # "Lyon" < "Paris, FR"
    assert ds.labels.tolist() == [1.0, 0.0]


def test_table_missing_columns_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nope"):
        open_dataset(f"table:{CRITEO_CSV}", tmp_path, label="label", dense=["nope"], sparse=["C1"])
    with pytest.raises(ValueError, match="label="):
        open_dataset(f"table:{CRITEO_CSV}", tmp_path)


def test_parquet_table(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = csv_rows(CRITEO_CSV)
    header, body = rows[0], rows[1:]
    cols = {name: [r[k] for r in body] for k, name in enumerate(header)}
    table = pa.table(
        {
            "label": pa.array([int(v) for v in cols["label"]]),
            **{n: pa.array([float(v) if v else None for v in cols[n]]) for n in CRITEO_DENSE_NAMES},
            **{n: pa.array([v if v else None for v in cols[n]]) for n in CRITEO_SPARSE_NAMES},
        }
    )
    p = tmp_path / "c.parquet"
    pq.write_table(table, p)
    ds = open_dataset(
        f"table:{p}",
        tmp_path / "c",
        label="label",
        dense=CRITEO_DENSE_NAMES,
        sparse=CRITEO_SPARSE_NAMES,
    )
    ref = open_dataset(
        f"table:{CRITEO_CSV}",
        tmp_path / "c",
        label="label",
        dense=CRITEO_DENSE_NAMES,
        sparse=CRITEO_SPARSE_NAMES,
    )
    np.testing.assert_array_equal(ds.sparse, ref.sparse)
    np.testing.assert_array_equal(ds.dense, ref.dense)
    np.testing.assert_array_equal(ds.labels, ref.labels)


def test_parquet_bad_rows(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "bad.parquet"
    pq.write_table(
        pa.table({"y": [0, 1, 2, 1], "x": ["1", "a", "2", "3"], "c": ["u", "v", None, "w"]}), p
    )
    with pytest.raises(DataError, match=re.escape(f"{p}:2: {BAD_DENSE}")):
        open_dataset(f"table:{p}", tmp_path / "c", label="y", dense=["x"], sparse=["c"])
    ds = open_dataset(
        f"table:{p}", tmp_path / "c", label="y", dense=["x"], sparse=["c"], on_bad_row="skip"
    )
    assert ds.bad_rows == {BAD_DENSE: 1, BAD_LABEL: 1} and len(ds) == 2


def test_parquet_without_pyarrow_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    for name in ("pyarrow", "pyarrow.parquet", "pyarrow.compute"):
        monkeypatch.setitem(sys.modules, name, None)  # makes "import pyarrow" fail
    p = tmp_path / "x.parquet"
    p.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        open_dataset(f"table:{p}", tmp_path / "c", label="y", dense=[], sparse=["c"])


def test_criteo_custom_delimiter(tmp_path: Path) -> None:
    p = tmp_path / "day.dat"
    p.write_text("".join(";".join(r) + "\n" for r in tsv_rows()[:20]))
    ds = open_dataset(f"criteo:{p}", tmp_path / "c", delimiter=";", hash_size=100)
    ref = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path / "c", hash_size=100)
    np.testing.assert_array_equal(ds.sparse, ref.sparse[:20])


# ---------------------------------------------------------------- bad rows


def _bad_criteo_file(tmp_path: Path) -> Path:
    """Sample rows 0..9 with bad rows planted at known lines."""
    rows = tsv_rows()[:10]
    lines = ["\t".join(r) for r in rows]
    short = rows[3][:-1]  # line 4: 39 columns
    lines[3] = "\t".join(short)
    r = list(rows[5])
    r[3] = "12abc"  # line 6: non-numeric I3
    lines[5] = "\t".join(r)
    r = list(rows[7])
    r[0] = "2"  # line 8: label 2
    lines[7] = "\t".join(r)
    r = list(rows[8])
    r[14] = "zz12ab34"  # line 9: not hex (C1)
    lines[8] = "\t".join(r)
    p = tmp_path / "bad.tsv"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(
    "hash_size, first_line, reason",
    [(None, 4, WRONG_COLUMN_COUNT), (1000, 4, WRONG_COLUMN_COUNT)],
)
def test_bad_rows_error_mode_reports_file_line(
    tmp_path: Path, hash_size, first_line, reason
) -> None:
    p = _bad_criteo_file(tmp_path)
    with pytest.raises(DataError) as e:
        open_dataset(f"criteo:{p}", tmp_path / "c", hash_size=hash_size)
    assert str(e.value).startswith(f"{p}:{first_line}: {reason}")
    assert e.value.line == first_line and e.value.path == str(p)
    assert isinstance(e.value, ValueError)
    # a failed conversion leaves no cache entry and no temp dir behind
    assert [
        x.name
        for x in (tmp_path / "c").iterdir()
        if not x.name.startswith(".") or x.name.startswith(".tmp")
    ] == []


@pytest.mark.parametrize(
    "line, mutate, reason, detail",
    [
        (3, lambda r: r[:-1], WRONG_COLUMN_COUNT, "expected 40 columns, got 39"),
        (3, lambda r: r + ["x"], WRONG_COLUMN_COUNT, "expected 40 columns, got 41"),
        (5, lambda r: [r[0], "1.5.2", *r[2:]], BAD_DENSE, "I1='1.5.2'"),
        (5, lambda r: [r[0], "nan", *r[2:]], BAD_DENSE, "I1='nan'"),
        (2, lambda r: ["2", *r[1:]], BAD_LABEL, "got '2'"),
        (2, lambda r: ["", *r[1:]], BAD_LABEL, "got ''"),
        (7, lambda r: [*r[:20], "0x12", *r[21:]], BAD_HEX, "C7='0x12' is not hex"),
    ],
)
def test_each_bad_row_reason(tmp_path: Path, line, mutate, reason, detail) -> None:
    rows = tsv_rows()[:8]
    rows[line - 1] = mutate(rows[line - 1])
    p = tmp_path / "one_bad.tsv"
    p.write_text("".join("\t".join(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="^" + re.escape(f"{p}:{line}: ")) as e:
        open_dataset(f"criteo:{p}", tmp_path / "c", hash_size=1000)
    assert e.value.reason == reason
    assert detail in str(e.value)


def test_bad_rows_skip_mode_counts_per_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = _bad_criteo_file(tmp_path)
    with caplog.at_level(logging.WARNING):
        ds = open_dataset(f"criteo:{p}", tmp_path / "c", on_bad_row="skip", hash_size=1000)
    assert ds.bad_rows == {WRONG_COLUMN_COUNT: 1, BAD_DENSE: 1, BAD_LABEL: 1, BAD_HEX: 1}
    assert len(ds) == 6
    good = [r for k, r in enumerate(tsv_rows()[:10]) if k not in (3, 5, 7, 8)]
    assert ds.labels.tolist() == [float(r[0]) for r in good]
    assert ds.sparse[:, 0].tolist() == [1 + int(r[14], 16) % 999 for r in good]
    meta = json.loads((ds.path / "meta.json").read_text())
    assert meta["bad_rows"] == ds.bad_rows
    assert any(f"{p}:9: {BAD_HEX}" in x for x in meta["bad_row_examples"])
    assert "skipped 4 bad rows" in caplog.text
    # vocabulary mode does not need hex: only three rows are bad there
    vocab = open_dataset(f"criteo:{p}", tmp_path / "c", on_bad_row="skip")
    assert vocab.bad_rows == {WRONG_COLUMN_COUNT: 1, BAD_DENSE: 1, BAD_LABEL: 1}
    assert len(vocab) == 7


def test_blank_lines_ignored_and_crlf(tmp_path: Path) -> None:
    lines = CRITEO_TSV.read_text().splitlines()[:5]
    p = tmp_path / "crlf.tsv"
    p.write_bytes(("\r\n".join(lines[:2]) + "\r\n\r\n" + "\r\n".join(lines[2:]) + "\r\n").encode())
    ds = open_dataset(f"criteo:{p}", tmp_path / "c", hash_size=100)
    ref = open_dataset(f"criteo:{CRITEO_TSV}", tmp_path / "c", hash_size=100)
    assert len(ds) == 5
    np.testing.assert_array_equal(ds.sparse, ref.sparse[:5])


# ---------------------------------------------------------------- bad inputs


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(DataError, match=f"empty: {empty}"):
        open_dataset(f"criteo:{empty}", tmp_path / "c")
    missing = tmp_path / "nope.tsv"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        open_dataset(f"criteo:{missing}", tmp_path / "c")
    header_only = tmp_path / "h.csv"
    header_only.write_text(AVAZU_CSV.read_text().splitlines()[0] + "\n")
    with pytest.raises(DataError, match=f"no valid data rows in {header_only}"):
        open_dataset(f"avazu:{header_only}", tmp_path / "c")


def test_bad_spec_lists_kinds(tmp_path: Path) -> None:
    for spec in ("parquet:/x", "criteo", "criteo:", "/data/train.txt"):
        with pytest.raises(ValueError) as e:
            open_dataset(spec, tmp_path)
        for kind in SPEC_KINDS:
            assert kind in str(e.value)
    assert parse_spec("criteo:/a, /b") == ("criteo", ["/a", "/b"])


def test_option_misuse(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="synthetic"):
        open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, max_cardinality=10)
    with pytest.raises(ValueError, match="criteo: does not take label"):
        open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, label="label")
    with pytest.raises(ValueError, match="dense_transform"):
        open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, dense_transform="zscore")
    with pytest.raises(ValueError, match="on_bad_row"):
        open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, on_bad_row="ignore")
    with pytest.raises(ValueError, match="hash sizes must be >= 2"):
        open_dataset(f"criteo:{CRITEO_TSV}", tmp_path, hash_size=1)

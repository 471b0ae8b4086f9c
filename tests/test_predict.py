"""``predict`` and ``evaluate``: a run's model scores files and in-memory columns as its
training rows were encoded, reproduces the test AUC that training reported, and
refuses bad input in one line without writing anything."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from serving_cases import (
    CRITEO_TSV,
    cli_json,
    cli_refusal,
    read_rows,
    trained_sample,
    write_rows,
)
from tiny import cli_args

import torchrec_cowclip
import torchrec_cowclip.serve.inputs
from torchrec_cowclip.cli import main
from torchrec_cowclip.data.errors import DataError


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    trained = trained_sample(tmp_path_factory.mktemp("predict"))
    return {**trained, "model": torchrec_cowclip.load_model(trained["run"])}


def _scores(path: Path) -> np.ndarray:
    rows = list(csv.DictReader(open(path, newline="")))
    return np.array([float(r["probability"]) for r in rows], dtype=np.float32)


def test_evaluate_reproduces_the_test_auc_training_reported(trained, capsys):
    metrics = cli_json(capsys, "evaluate", "--run", trained["run"], "--data", trained["test"])
    assert abs(metrics["auc"] - trained["metrics"]["auc"]) <= 1e-6
    assert abs(metrics["logloss"] - trained["metrics"]["logloss"]) <= 1e-6
    labels = [int(r[0]) for r in read_rows(trained["test"])[1:]]
    assert metrics["rows"] == 50 and metrics["positives"] == sum(labels)
    assert metrics["ctr"] == pytest.approx(sum(labels) / 50)
    assert metrics["calibration"] == pytest.approx(metrics["mean_prediction"] / metrics["ctr"])


def test_predict_writes_one_probability_per_row_in_order(trained, capsys, tmp_path):
    out = tmp_path / "scores.csv"
    summary = cli_json(
        capsys, "predict", "--run", trained["run"], "--data", f"table:{trained['test']}",
        "--output", out,
    )  # fmt: skip
    assert summary["rows"] == 50 and out.read_text().splitlines()[0] == "probability"
    scores = _scores(out)
    np.testing.assert_allclose(scores, trained["model"].predict(trained["test"]), rtol=1e-6)
    assert ((scores > 0) & (scores < 1)).all() and len(set(scores.tolist())) > 10
    # Input order: the rows reversed score reversed.
    header, *body = read_rows(trained["test"])
    reversed_file = write_rows(tmp_path / "reversed.csv", [header, *body[::-1]])
    np.testing.assert_allclose(
        trained["model"].predict(reversed_file), scores[::-1], rtol=1e-6, atol=1e-7
    )
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_a_file_without_labels_scores_the_same_with_an_id_column(trained, capsys, tmp_path):
    out = tmp_path / "scores.parquet"
    cli_json(
        capsys, "predict", "--run", trained["run"], "--data", trained["unlabeled"],
        "--output", out, "--id-column", "id",
    )  # fmt: skip
    table = pq.read_table(out)
    assert table.column_names == ["id", "probability"]
    assert table.column("id").to_pylist() == [f"row{i}" for i in range(50)]
    np.testing.assert_allclose(
        table.column("probability").to_numpy(), trained["model"].predict(trained["test"]), rtol=1e-6
    )
    err = cli_refusal(capsys, "evaluate", "--run", trained["run"], "--data", trained["unlabeled"])
    assert "no label column 'label': evaluate needs labels" in err


def test_in_memory_columns_score_as_the_file_does(trained):
    model, expected = trained["model"], trained["model"].predict(trained["test"])
    header, *body = read_rows(trained["test"])
    columns = {name: [r[i] for r in body] for i, name in enumerate(header)}
    np.testing.assert_allclose(model.predict(columns), expected, rtol=1e-6)
    # pyarrow: numbers as numbers, empty fields as nulls, and no label column.
    typed = {
        name: [float(v) if v else None for v in values] if name.startswith("I") else values
        for name, values in columns.items()
        if name != "label"
    }
    np.testing.assert_allclose(model.predict(pa.table(typed)), expected, rtol=1e-6)

    # pandas (a pinned dependency): read_csv as a user would, categoricals as text.
    import pandas as pd

    frame = pd.read_csv(trained["test"], dtype={f"C{i}": str for i in range(1, 27)})
    np.testing.assert_allclose(model.predict(frame), expected, rtol=1e-6)
    with pytest.raises(DataError, match=r"no columns 'C25', 'C26' of the run's schema"):
        model.predict({k: v for k, v in columns.items() if k not in ("C25", "C26")})


def test_unseen_values_score_with_the_out_of_vocabulary_row(trained):
    header, *body = read_rows(trained["test"])
    c3 = header.index("C3")
    unseen = [[*r[:c3], "never-seen-value", *r[c3 + 1 :]] for r in body]
    path = write_rows(trained["root"] / "unseen.csv", [header, *unseen])
    model = trained["model"]
    block = next(model.open(path).blocks())
    assert (block.ids[:, 2] == 0).all()  # C3's OOV id
    assert len(model.predict(path)) == 50


def test_criteo_layout_scores_with_or_without_its_label_column(tmp_path, capsys):
    train_argv = cli_args(
        data=f"criteo:{CRITEO_TSV}", out=tmp_path / "run", cache_dir=tmp_path / "cache",
        hash_size=1000, batch_size=64, hidden=(8,), threads=1, no_progress=True,
    )  # fmt: skip
    assert main(train_argv) == 0
    kaggle_test = tmp_path / "test.txt"  # Kaggle's test.txt: no label column
    kaggle_test.write_text("".join(line.split("\t", 1)[1] for line in open(CRITEO_TSV)))
    model = torchrec_cowclip.load_model(tmp_path / "run")
    np.testing.assert_array_equal(model.predict(kaggle_test), model.predict(CRITEO_TSV))
    out = tmp_path / "s.csv"
    err = cli_refusal(
        capsys, "predict", "--run", tmp_path / "run", "--data", CRITEO_TSV.with_suffix(".csv"),
        "--delimiter", "|", "--output", out,
    )  # fmt: skip
    assert "has 1 fields split on '|'; the run's files had 40 (or 39 without the label)" in err
    assert "wrong delimiter? on ',' it splits into 40: give --delimiter ','" in err
    assert not out.exists()


def test_bad_inputs_are_refused_in_one_line_and_write_nothing(trained, capsys, tmp_path):
    run, test = trained["run"], trained["test"]
    out = tmp_path / "scores.csv"
    header, *body = read_rows(test)
    no_c7 = write_rows(tmp_path / "no_c7.csv", [[c for c in r if c != "C7"] for r in [header]])
    tabbed = write_rows(tmp_path / "tabbed.csv", [header, *body], delimiter="\t")
    bad_row = [list(r) for r in body]
    bad_row[40][header.index("I2")] = "lots"
    late_bad = write_rows(tmp_path / "late_bad.csv", [header, *bad_row])
    cases = [
        (["--data", no_c7], "no column 'C7' (the run's categorical columns); the columns are"),
        (["--data", tabbed], "wrong delimiter? the first line is split on ','; on tab it gives"),
        (["--data", late_bad], "late_bad.csv:42: non-numeric dense value: I2='lots'"),
        (["--data", f"avazu:{test}"], "the run was trained on table: data"),
        (["--data", tmp_path / "missing.csv"], "data file not found"),
        (["--data", test, "--weights", "best"], "no 'best' weights; it has final"),
    ]
    for args, message in cases:
        err = cli_refusal(capsys, "predict", "--run", run, *args, "--output", out)
        assert message in err, err
        assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    out.write_text("precious")
    err = cli_refusal(capsys, "predict", "--run", run, "--data", test, "--output", out)
    assert "exists: add --overwrite" in err and out.read_text() == "precious"
    other = tmp_path / "other.csv"
    err = cli_refusal(capsys, "predict", "--run", tmp_path, "--data", test, "--output", other)
    assert "not a run folder" in err and not other.exists()
    cli_json(capsys, "predict", "--run", run, "--data", test, "--output", out, "--overwrite")
    assert len(_scores(out)) == 50


def test_torchrec_quantized_tables_change_the_auc_little(trained, capsys):
    exact = cli_json(capsys, "evaluate", "--run", trained["run"], "--data", trained["test"])
    for dtype in ("int8", "fp16"):
        metrics = cli_json(
            capsys, "evaluate", "--run", trained["run"], "--data", trained["test"],
            "--quantize", dtype,
        )  # fmt: skip
        assert metrics["tables"] == dtype and abs(metrics["auc"] - exact["auc"]) < 0.02
    scores = torchrec_cowclip.load_model(trained["run"], quantize="int8").predict(trained["test"])
    np.testing.assert_allclose(scores, trained["model"].predict(trained["test"]), atol=0.02)


def test_unseen_values_are_counted_per_column_on_the_console_and_in_json(trained, capsys):
    """The issue's case: wrong input scored silently with out_of_range_ids 0."""
    header, *body = read_rows(trained["test"])
    c3 = header.index("C3")
    unseen = [[*r[:c3], f"never-seen-{i}", *r[c3 + 1 :]] for i, r in enumerate(body)]
    path = write_rows(trained["root"] / "unseen-counted.csv", [header, *unseen])
    out = trained["root"] / "unseen-scores.csv"
    summary = cli_json(capsys, "predict", "--run", trained["run"], "--data", path, "--output", out)
    assert summary["unseen_values"]["C3"] == 50 and set(summary["unseen_values"]) >= {"C1", "C26"}
    metrics = cli_json(capsys, "evaluate", "--run", trained["run"], "--data", path)
    assert metrics["unseen_values"] == summary["unseen_values"]
    model = trained["model"]
    model.predict(path)
    assert model.unseen == summary["unseen_values"] and model.rows == 50
    assert "C3 50 (100.0%)" in model.unseen_summary()


def test_a_text_column_handed_over_as_numbers_is_named(tmp_path, capsys):
    """Zip codes '00501' read by pandas as 501 fall to the unseen row: a warning names
    the column and dtype=str."""
    rng = np.random.default_rng(0)
    zips = np.array(["00501", "00544", "01001", "90210"])
    rows = [["click", "zip"]] + [[str(int(rng.random() < 0.3)), z] for z in rng.choice(zips, 400)]
    data = write_rows(tmp_path / "zips.csv", rows)
    argv = cli_args(data=f"table:{data}", label="click", sparse="zip", batch_size=64, hidden=8,
                    embedding_dim=4, no_progress=True, out=tmp_path / "run",
                    cache_dir=tmp_path / "c")  # fmt: skip
    assert main(argv) == 0
    model = torchrec_cowclip.load_model(tmp_path / "run")
    as_text = model.predict({"zip": [r[1] for r in rows[1:]]})
    assert model.unseen == {"zip": 0}
    with pytest.warns(torchrec_cowclip.serve.inputs.UnseenValuesWarning,
                      match=r"'zip' arrived as numbers \(int64\) .* such as '00501' .* "
                      r"dtype=\{'zip': str\}"):  # fmt: skip
        as_numbers = model.predict({"zip": np.array([int(r[1]) for r in rows[1:]])})
    leading_zero = sum(r[1].startswith("0") for r in rows[1:])
    assert model.unseen == {"zip": leading_zero} and not np.array_equal(as_text, as_numbers)

"""``export`` of a run with ``--time-columns``: the program takes the timestamp and derives
its hour and weekday as training did, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from tiny import cli_args

import torchrec_cowclip
from torchrec_cowclip.cli import main
from torchrec_cowclip.data.parsing.fields import parse_numeric
from torchrec_cowclip.data.parsing.time import DAY_S, seconds_of_numbers
from torchrec_cowclip.run.model_folder import RunFolder
from torchrec_cowclip.serve.export import (
    TimeFeatures,
    export_run,
    parity_timestamps,
    time_ids,
)

START = 1_714_953_600  # 2024-05-06 00:00:00 UTC, a Monday


def _stamps(n: int, seed: int) -> np.ndarray:
    """Unix seconds where the derivation can slip: three weeks of May 2024, a second
    either side of midnight, days before 1970 (negative), and fractional seconds."""
    g = np.random.default_rng(seed)
    ts = START + g.integers(0, 21 * DAY_S, n).astype(np.float64)
    edge = g.random(n) < 0.2
    ts[edge] = (
        START + g.integers(0, 21, int(edge.sum())) * DAY_S + g.choice([-1, 0], int(edge.sum()))
    )
    early = g.random(n) < 0.15
    ts[early] = -g.integers(0, 20_000, int(early.sum())) * DAY_S + g.choice(
        [-1, 0, 1], int(early.sum())
    )
    half = g.random(n) < 0.05
    ts[half] -= 0.5
    return ts


def _write_log(path: Path, n: int, seed: int, text: bool) -> Dict[str, list]:
    """A click log driven by the hour of ``ts`` (numbers: seconds, every fourth in
    milliseconds; or ISO text), with a dense ``x`` and a categorical ``site``; every 40th
    timestamp missing (``NA``)."""
    g = np.random.default_rng(seed)
    ts = _stamps(n, seed)
    hour = (np.floor(ts).astype(np.int64) // 3600) % 24
    click = (g.random(n) < np.where((hour >= 18) & (hour < 22), 0.7, 0.15)).astype(int)
    if text:
        shown = [str(np.datetime64(int(np.floor(t)), "s")).replace("T", " ") for t in ts]
    else:
        shown = [f"{t * 1000:.0f}" if i % 4 == 0 else f"{t:.1f}" if t % 1 else f"{t:.0f}"
                 for i, t in enumerate(ts)]  # fmt: skip
    shown = ["NA" if i % 40 == 0 else s for i, s in enumerate(shown)]
    x = np.round(g.normal(3.0, 1.0, n), 3)
    site = g.choice(["a", "b", "c", "d"], n)
    rows = ["click,ts,x,site"] + [f"{c},{t},{v},{s}" for c, t, v, s in zip(click, shown, x, site)]
    path.write_text("\n".join(rows) + "\n")
    return {"ts": shown, "x": list(x), "site": list(site)}


def _train(root: Path, name: str, text: bool, *flags: str) -> Dict[str, object]:
    columns = _write_log(root / f"{name}.csv", 1200, seed=5, text=text)
    argv = cli_args(
        data=f"table:{root / f'{name}.csv'}", label="click", dense="x", sparse="site",
        batch_size=128, epochs=1, hidden=8, embedding_dim=4, lr_embed="1e-2", threads=1,
        val_fraction=0.0, no_progress=True, out=root / name, cache_dir=root / "cache",
    )  # fmt: skip
    assert main([*argv, "--time-columns", "ts", "--na-values", "NA", *flags]) == 0
    return {"run": root / name, "file": root / f"{name}.csv", "columns": columns}


@pytest.fixture(scope="module")
def numbers(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, object]:
    return _train(tmp_path_factory.mktemp("export-time"), "numbers", False)


def _program_inputs(case: Dict[str, object], seconds: List[float]) -> tuple:
    """The file's rows as a serving stack feeds them, from the contract and vocabulary."""
    run = Path(str(case["run"]))
    columns = case["columns"]
    assert isinstance(columns, dict)
    vocabulary = json.loads((run.parent / f"{run.name}.vocab.json").read_text())
    dense = torch.tensor(np.asarray(columns["x"], dtype=np.float32)[:, None])
    ids = torch.tensor([[vocabulary["site"].get(s, 0)] for s in columns["site"]])
    time = torch.tensor(np.asarray(seconds, dtype=np.float64)[:, None])
    return dense, ids, time


def _exported(case: Dict[str, object]) -> tuple:
    """``(program path, contract)`` of the case's run exported beside it."""
    run = Path(str(case["run"]))
    out = run.parent / f"{run.name}.pt2"
    report = export_run(run, out)
    assert report["max_abs_difference"] <= 1e-6
    return out, json.loads(out.with_name(f"{run.name}.serving.json").read_text())


def _stamps_as_held(case: Dict[str, object]) -> np.ndarray:
    """The case's timestamps as the file holds them, as numbers (NaN: missing)."""
    columns = case["columns"]
    assert isinstance(columns, dict)
    raw = np.array([b"" if s == "NA" else s.encode() for s in columns["ts"]])
    return np.where(raw == b"", np.nan, parse_numeric(raw)[0])


def test_the_program_takes_the_timestamp_and_scores_as_predict(numbers):
    """Seconds, milliseconds, pre-1970 and midnight-edge timestamps as the file holds
    them: the program's scores are predict's on the same rows."""
    run = Path(str(numbers["run"]))
    out, serving = _exported(numbers)
    dense_in, ids_in, time_in = serving["inputs"]
    assert ids_in["columns"] == ["site"] and len(ids_in["rows"]) == 1
    assert (time_in["name"], time_in["dtype"], time_in["columns"]) == ("time", "float64", ["ts"])
    assert time_in["derives"] == {"ts": ["ts_hour", "ts_weekday"]}
    assert "Unix seconds" in time_in["values"] and "milliseconds" in time_in["values"]
    columns = numbers["columns"]
    assert isinstance(columns, dict)
    seconds = _stamps_as_held(numbers)
    assert (seconds < 0).any() and (np.abs(seconds) >= 1e11).any()
    program = torch.export.load(str(out)).module()
    inputs = _program_inputs(numbers, list(seconds))
    served = program(*inputs).numpy()
    predicted = torchrec_cowclip.load_model(run).predict(str(numbers["file"]))
    # The features are the same bits (the last test); the float32 network differs by an
    # ulp at most (one batch of 1200 rows against predict's batches, plain tables).
    np.testing.assert_allclose(served, predicted, rtol=0, atol=1e-6)
    features = TimeFeatures(RunFolder.open(run))(inputs[2]).numpy()
    blocks = torchrec_cowclip.load_model(run).open(str(numbers["file"])).blocks()
    np.testing.assert_array_equal(features, torch.cat([b.ids for b in blocks]).numpy()[:, 1:])
    one = program(*(t[:1] for t in _program_inputs(numbers, list(seconds))))
    assert one.shape == (1,)


def test_a_date_time_text_column_is_given_as_unix_seconds(tmp_path):
    """A column of ISO date-times: the program takes its Unix seconds (as the contract
    says, numpy's datetime64 to seconds) and scores as predict on the text."""
    case = _train(tmp_path, "text", True)
    run = Path(str(case["run"]))
    export_run(run, tmp_path / "text.pt2")
    export_run(run, tmp_path / "scripted.pt", fmt="torchscript")
    columns = case["columns"]
    assert isinstance(columns, dict)
    stamps = np.array(["NaT" if s == "NA" else s.replace(" ", "T") for s in columns["ts"]],
                      dtype="datetime64[s]")  # fmt: skip
    seconds = stamps.astype("datetime64[ms]").astype("int64") / 1000
    seconds[np.isnat(stamps)] = np.nan
    program = torch.export.load(str(tmp_path / "text.pt2")).module()
    served = program(*_program_inputs(case, list(seconds))).numpy()
    predicted = torchrec_cowclip.load_model(run).predict(str(case["file"]))
    np.testing.assert_allclose(served, predicted, rtol=0, atol=1e-6)
    scripted = torch.jit.load(str(tmp_path / "scripted.pt"))
    np.testing.assert_array_equal(scripted(*_program_inputs(case, list(seconds))).numpy(), served)


def test_the_derivation_is_trainings_for_every_kind_of_timestamp(numbers):
    """The program's hour and weekday ids against predict's derivation (numpy, the run's
    encoder) on timestamps from 1906 to 2038 and milliseconds from year 1 to 33658, either
    side of midnight and the hour, fractional, milliseconds either side of 1e11, missing."""
    run = RunFolder.open(str(numbers["run"]))
    stamps = parity_timestamps(20_000, 1, seed=3)
    edges = np.array([0.0, -0.5, -1.0, -1e-9, 86399.999, 86400.0, -86400.0, -86401.0,
                      1e11 - 1, 1e11, -1e11, 1e11 + 999, np.nan, 2**31, -(2**31), 1e15 + 999, -1e15 - 1,
                      253402300799.0, -62135596800.0])  # fmt: skip
    stamps = np.concatenate([stamps[:, 0], edges])[:, None]
    expected = time_ids(run, stamps)
    got = TimeFeatures(run)(torch.from_numpy(stamps)).numpy()
    np.testing.assert_array_equal(got, expected)
    # Every hour and weekday and the missing value get distinct ids.
    assert len(set(expected[:, 0].tolist())) == 25 and len(set(expected[:, 1].tolist())) == 8


@pytest.fixture(scope="module")
def trend(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, object]:
    return _train(tmp_path_factory.mktemp("export-trend"), "trend", False, "--time-trend")


def test_the_trend_is_off_by_default_and_a_minmax_dense_feature_when_asked(numbers, trend):
    """--time-trend adds ts_days after the dense columns, scaled by the training split's
    start and span (min-max), recorded in the run folder; without it there is none."""
    assert RunFolder.open(str(numbers["run"])).schema.dense_names == ("x",)
    run = RunFolder.open(str(trend["run"]))
    assert run.schema.dense_names == ("x", "ts_days") and run.trend_columns() == ("ts_days",)
    plan = run.dense_plan()
    assert plan.transforms[1] == "minmax"
    columns = trend["columns"]
    assert isinstance(columns, dict)
    days = seconds_of_numbers(_stamps_as_held(trend)) / DAY_S
    # The statistics are the training split's (a part of the rows): within the file's.
    assert (
        np.nanmin(days) <= plan.shift[1] < plan.shift[1] + plan.scale[1] <= np.nanmax(days) + 1e-3
    )
    in_memory = {"ts": columns["ts"], "x": columns["x"], "site": columns["site"]}
    model = torchrec_cowclip.load_model(str(trend["run"]))
    na = ["" if s == "NA" else s for s in columns["ts"]]
    np.testing.assert_array_equal(
        model.predict({**in_memory, "ts": na}), model.predict(str(trend["file"]))
    )


def test_next_week_is_outside_the_trend_by_construction_and_said_so(trend, tmp_path, capsys):
    """Rows after the training split's end: every one is outside ts_days' training
    range, in the JSON and on the console, which says why."""
    root = Path(str(trend["file"])).parent
    rows = Path(str(trend["file"])).read_text().splitlines()
    week = [rows[0]] + [
        f"{c},{START + 40 * DAY_S + i * 3600},{x},{s}"
        for i, (c, _, x, s) in enumerate(r.split(",") for r in rows[1:51])
    ]
    (tmp_path / "next.csv").write_text("\n".join(week) + "\n")
    capsys.readouterr()
    argv = ["predict", "--run", str(root / "trend"), "--data", str(tmp_path / "next.csv")]
    assert main([*argv, "--output", str(tmp_path / "scores.csv")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["outside_training_range"]["ts_days"] == 50
    assert "ts_days 50 (100.0%)" in captured.err
    assert "ts_days (--time-trend): time since the training split's start" in captured.err
    assert "by construction" in captured.err, captured.err


def test_the_program_derives_the_trend_as_predict(trend):
    """The exported program takes x and the timestamp; it derives ts_days, its
    hour and weekday, and scores as predict."""
    run = Path(str(trend["run"]))
    out, serving = _exported(trend)
    dense_in, _, time_in = serving["inputs"]
    assert dense_in["columns"] == ["x"] and dense_in["shape"] == ["batch", 1]
    assert time_in["derives"] == {"ts": ["ts_hour", "ts_weekday", "ts_days"]}
    assert "86400" in time_in["trend"]
    columns = trend["columns"]
    assert isinstance(columns, dict)
    seconds = _stamps_as_held(trend)
    program = torch.export.load(str(out)).module()
    served = program(*_program_inputs(trend, list(seconds))).numpy()
    predicted = torchrec_cowclip.load_model(run).predict(str(trend["file"]))
    np.testing.assert_allclose(served, predicted, rtol=0, atol=1e-6)
    transformed = export_run(run, run.parent / "transformed.pt2", raw_dense=False)
    assert transformed["max_abs_difference"] <= 1e-6


def test_a_trend_without_time_columns_is_refused(tmp_path, capsys):
    _write_log(tmp_path / "log.csv", 50, seed=1, text=False)
    argv = ["train", "--data", f"table:{tmp_path / 'log.csv'}", "--label", "click"]
    argv += ["--sparse", "site", "--time-trend", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "--time-trend" in err and "declare them with --time-columns" in err, err


def test_a_parquet_timestamp_gives_the_trend_of_its_seconds(trend, tmp_path):
    """The trend of a parquet timestamp column is that of the Unix seconds (text) it
    stands for: in the cache (training), and scoring the parquet file with a run
    trained on the text."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from torchrec_cowclip.data import open_dataset

    columns = trend["columns"]
    assert isinstance(columns, dict)
    text = Path(str(trend["file"]))
    seconds = seconds_of_numbers(_stamps_as_held(trend))
    stamps = [None if np.isnan(s) else int(round(s * 1000)) for s in seconds]
    table = pa.table(
        {
            "click": [int(r.split(",")[0]) for r in text.read_text().splitlines()[1:]],
            "ts": pa.array(stamps, pa.timestamp("ms", tz="UTC")),
            "x": columns["x"],
            "site": columns["site"],
        }
    )
    parquet = tmp_path / "log.parquet"
    pq.write_table(table, parquet)
    dense = {
        path.suffix: np.asarray(
            open_dataset(
                f"table:{path}", tmp_path / f"c{path.suffix}", label="click", dense=["x"],
                sparse=["site"], time_columns=["ts"], na_values=["NA"], time_trend=True,
            ).dense
        )
        for path in (text, parquet)
    }  # fmt: skip
    assert dense[".csv"].shape == (len(stamps), 2)
    np.testing.assert_array_equal(dense[".csv"], dense[".parquet"])
    model = torchrec_cowclip.load_model(str(trend["run"]))
    np.testing.assert_array_equal(model.predict(str(parquet)), model.predict(str(text)))

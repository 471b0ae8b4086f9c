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
from torchrec_cowclip.data.parsing.time import DAY_S
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
        shown = [f"{t * 1000:.0f}" if i % 4 == 0 else f"{t:g}" if t % 1 else f"{t:.0f}"
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


def test_the_program_takes_the_timestamp_and_scores_as_predict(numbers):
    """Seconds, milliseconds, pre-1970 and midnight-edge timestamps as the file holds
    them: the program's scores are predict's on the same rows."""
    run = Path(str(numbers["run"]))
    out = run.parent / f"{run.name}.pt2"
    report = export_run(run, out)
    assert report["max_abs_difference"] <= 1e-6
    serving = json.loads(out.with_name(f"{run.name}.serving.json").read_text())
    dense_in, ids_in, time_in = serving["inputs"]
    assert ids_in["columns"] == ["site"] and len(ids_in["rows"]) == 1
    assert (time_in["name"], time_in["dtype"], time_in["columns"]) == ("time", "float64", ["ts"])
    assert time_in["derives"] == {"ts": ["ts_hour", "ts_weekday"]}
    assert "Unix seconds" in time_in["values"] and "milliseconds" in time_in["values"]
    columns = numbers["columns"]
    assert isinstance(columns, dict)
    raw = np.array([b"" if s == "NA" else s.encode() for s in columns["ts"]])
    seconds = np.where(raw == b"", np.nan, parse_numeric(raw)[0])
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
    encoder) on timestamps from 1906 to 2038, either side of midnight and the hour,
    fractional, milliseconds either side of 1e11, missing."""
    run = RunFolder.open(str(numbers["run"]))
    stamps = parity_timestamps(20_000, 1, seed=3)
    edges = np.array([0.0, -0.5, -1.0, -1e-9, 86399.999, 86400.0, -86400.0, -86401.0,
                      1e11 - 1, 1e11, -1e11, 1e11 + 999, np.nan, 2**31, -(2**31)])  # fmt: skip
    stamps = np.concatenate([stamps[:, 0], edges])[:, None]
    expected = time_ids(run, stamps)
    got = TimeFeatures(run)(torch.from_numpy(stamps)).numpy()
    np.testing.assert_array_equal(got, expected)
    # Every hour and weekday and the missing value get distinct ids.
    assert len(set(expected[:, 0].tolist())) == 25 and len(set(expected[:, 1].tolist())) == 8

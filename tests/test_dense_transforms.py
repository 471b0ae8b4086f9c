"""Dense transforms that keep information: the spec, the stored values, the statistics of
the training split only, missing values and their indicators, and the JSON plan a run
records (what scoring new rows needs)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from tiny import TINY_FILE_RUN, tiny_config

from torchrec_cowclip.data import (
    DataOptionError,
    DensePlan,
    DenseStats,
    DenseTransformSpec,
    open_dataset,
)
from torchrec_cowclip.data.parsing import dense as dense_module
from torchrec_cowclip.data.parsing.dense import (
    DENSE_CLIP,
    constant_columns,
    quantile_edges,
    stored_values,
)
from torchrec_cowclip.train import train


def _table(path: Path, rows) -> Path:
    """A CSV of ``(click, price, score, site)`` rows; None is an empty field."""
    lines = ["click,price,score,site"]
    lines += [",".join("" if v is None else str(v) for v in r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


COLUMNS = dict(label="click", dense=["price", "score"], sparse=["site"])


# --------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    "text, resolved",
    [
        ("standardize", ("standardize", "standardize")),
        ("price=log", ("log", "signed-log")),  # the kind's default for the rest
        ("standardize, price = log", ("log", "standardize")),  # whitespace stripped
        ("price=none,score=minmax", ("none", "minmax")),
    ],
)
def test_a_spec_chooses_per_column_with_a_bare_default(text, resolved):
    spec = DenseTransformSpec.parse(text, default="signed-log")
    assert spec.resolve(["price", "score"], "table") == resolved
    assert DenseTransformSpec.parse(spec.text(), default="log") == spec  # canonical


@pytest.mark.parametrize(
    "text, message",
    [
        ("zscore", "'zscore' is not a transform; choose one of log, signed-log"),
        ("log,minmax", "two transforms for every column"),
        ("price=log,price=none", "column 'price' is given twice"),
        ("=log", "names no column"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_flag(text, message):
    with pytest.raises(DataOptionError, match="--dense-transform") as e:
        DenseTransformSpec.parse(text, default="log")
    assert message in str(e.value)


def test_a_spec_naming_an_unknown_column_lists_the_real_ones(tmp_path):
    p = _table(tmp_path / "t.csv", [(1, 2.0, 3.0, "a")])
    with pytest.raises(
        DataOptionError, match=r"'weight'.*the dense columns are \['price', 'score'\]"
    ):
        open_dataset(f"table:{p}", tmp_path / "c", dense_transform="weight=log", **COLUMNS)
    with pytest.raises(DataOptionError, match=r"criteo: .*'I14'.*'I1', 'I2'"):
        open_dataset(
            "criteo:tests/data/criteo_sample.tsv", tmp_path / "c", dense_transform="I14=log"
        )


# --------------------------------------------------------------------------- stored values


def test_stored_values_keep_signs_count_what_log_cannot_take_and_clip():
    raw = np.array([[-3.0, -3.0, np.nan], [2.0, 2.0, 5e300], [0.0, -2e300, -1.0]])
    clipped, negative = np.zeros(3, np.int64), np.zeros(3, np.int64)
    v = stored_values(raw, ("log", "signed-log", "none"), clipped, negative)
    assert v.dtype == np.float32
    np.testing.assert_allclose(v[:, 0], np.log1p([0.0, 2.0, 0.0]), rtol=1e-6)  # -3 -> 0
    # The clip comes after the transform: signed-log keeps -2e300 as -log1p(2e300).
    np.testing.assert_allclose(
        v[:, 1], [-np.log1p(3.0), np.log1p(2.0), -np.log1p(2e300)], rtol=1e-6
    )
    assert np.isnan(v[0, 2]) and v[1, 2] == np.float32(DENSE_CLIP) and v[2, 2] == -1.0
    assert negative.tolist() == [1, 0, 0] and clipped.tolist() == [0, 0, 1]


def test_large_values_are_stored_as_they_are_and_legacy_plans_clip_as_they_trained():
    """Unix timestamps (1.7e9 s, 1.7e18 ns) were clipped to 1e9, a constant column."""
    raw = np.array([[1.7e9, 1.7e18], [1.7e9 + 86400, 1.7e18 + 1e12]])
    clipped = np.zeros(2, np.int64)
    v = stored_values(raw, ("standardize", "none"), clipped)
    np.testing.assert_allclose(v, raw.astype(np.float32), rtol=0)
    assert clipped.tolist() == [0, 0] and v[1, 0] - v[0, 0] == 86400.0
    stats = DenseStats(["ts", "ns"])
    stats.update(v)
    plan = DensePlan.fit(stats, ("standardize", "none"))
    np.testing.assert_allclose(plan.apply(v)[:, 0], [-1.0, 1.0])
    # A run folder written before this change clipped raw values at 1e9 first.
    legacy = plan.to_json()
    del legacy["clip_after_transform"]
    legacy["clip"] = 1e9
    old = DensePlan.from_json(legacy)
    assert old.clip_before == 1e9 and DensePlan.from_json(plan.to_json()).clip_before is None
    assert old.transform(raw)[0, 1] == np.float32(1e9)
    np.testing.assert_allclose(plan.transform(raw), plan.apply(v))


def test_a_constant_column_after_its_transform_is_named():
    stats = DenseStats(["flat", "ok"])
    stats.update(np.array([[3.0, 1.0], [3.0, 2.0], [np.nan, 3.0]]))
    lines = constant_columns(stats, ("standardize", "standardize"), stats.names)
    assert lines == [
        "dense column 'flat' is constant after its transform standardize (every training "
        "value 3): it carries nothing into the model"
    ]


def test_statistics_of_blocks_equal_those_of_the_whole_and_survive_json():
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 2.0, (1000, 2))
    values[rng.random((1000, 2)) < 0.2] = np.nan
    whole, blocks = DenseStats(["a", "b"]), DenseStats(["a", "b"])
    whole.update(values)
    for start in range(0, 1000, 137):
        blocks.update(values[start : start + 137])
    np.testing.assert_allclose(blocks.mean, np.nanmean(values, 0), rtol=1e-12)
    np.testing.assert_allclose(blocks.std, np.nanstd(values, 0), rtol=1e-10)
    np.testing.assert_array_equal(blocks.missing, np.isnan(values).sum(0))
    np.testing.assert_allclose(blocks.std, whole.std, rtol=1e-12)
    again = DenseStats.from_json(json.loads(json.dumps(blocks.to_json())))
    np.testing.assert_allclose(again.std, blocks.std, rtol=1e-12)
    assert again.min.tolist() == blocks.min.tolist()


# --------------------------------------------------------------------------- the plan


def test_standardize_and_minmax_take_the_training_split_only(tmp_path):
    """The explicit test file's rows are extreme: they move no statistic."""
    train_rows = [(i % 2, float(i), float(-i), "a") for i in range(10)]
    p = _table(tmp_path / "train.csv", train_rows)
    q = _table(tmp_path / "test.csv", [(1, 1e6, 1e6, "b"), (0, -1e6, -1e6, "a")])
    ds = open_dataset(
        f"table:{p}",
        tmp_path / "c",
        test_paths=[q],
        dense_transform="price=standardize,score=minmax",
        **COLUMNS,
    )
    train_idx, _, test_idx = ds.split(val_fraction=0.2, seed=0)
    plan = ds.fit_dense_plan(train_idx)
    price = np.array([r[1] for r in train_rows])[train_idx]
    score = np.array([r[2] for r in train_rows])[train_idx]
    assert plan.shift[0] == pytest.approx(price.mean()) and plan.scale[0] == pytest.approx(
        price.std()
    )
    assert plan.shift[1] == score.min() and plan.scale[1] == score.max() - score.min()
    inputs = ds.dense_inputs(train_idx)
    np.testing.assert_allclose(inputs[:, 0].mean(), 0.0, atol=1e-6)
    np.testing.assert_allclose(inputs[:, 0].std(), 1.0, rtol=1e-5)
    assert inputs[:, 1].min() == 0.0 and inputs[:, 1].max() == 1.0
    assert ds.dense_inputs(test_idx)[0, 1] > 1.0  # outside the training range: not clipped
    assert plan.fitted_on == f"the {len(train_idx)} rows of the training split"


def test_missing_values_are_the_training_mean_and_get_indicators(tmp_path):
    rows = [(1, 1.0, 4.0, "a"), (0, None, 2.0, "b"), (1, 3.0, 6.0, "a"), (0, 5.0, 8.0, "b")]
    p = _table(tmp_path / "t.csv", rows)
    ds = open_dataset(
        f"table:{p}",
        tmp_path / "c",
        dense_transform="standardize",
        missing_indicator=True,
        **COLUMNS,
    )
    plan = ds.fit_dense_plan(np.arange(4))
    assert plan.output_names == ("price", "score", "price:missing")  # score misses nothing
    inputs = ds.dense_inputs()
    assert inputs.shape == (4, 3) and inputs[1, 0] == 0.0  # missing -> the mean, 0
    assert inputs[:, 2].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert np.isnan(ds.dense[1, 0])  # stored as it came: missing
    batch = next(iter(ds.batches(np.arange(4), batch_size=4)))
    np.testing.assert_array_equal(batch.dense_features.numpy(), inputs)


def test_the_plan_is_json_and_scores_raw_rows_as_training_saw_them(tmp_path):
    rows = [(i % 2, float(i - 5), float(i * i) if i % 3 else None, "a") for i in range(12)]
    p = _table(tmp_path / "t.csv", rows)
    ds = open_dataset(f"table:{p}", tmp_path / "c", dense_transform="score=standardize", **COLUMNS)
    plan = ds.fit_dense_plan(np.arange(8))
    again = DensePlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.transforms == ("signed-log", "standardize")
    raw = np.array([[np.nan if v is None else v for v in r[1:3]] for r in rows])
    np.testing.assert_allclose(again.transform(raw), ds.dense_inputs(), rtol=1e-6)


def test_quantile_buckets_come_from_the_training_split_and_score_new_rows_alike(tmp_path):
    # price 0..19 in the training rows 0..9 and 100.. in the others: the boundaries are the
    # training split's, a held-out row's value lands in the top bucket, a missing one in none.
    rows = [
        (i % 2, float(i if i < 10 else 100 + i), 1.0 if i % 4 else None, "a") for i in range(14)
    ]
    p = _table(tmp_path / "t.csv", rows)
    ds = open_dataset(f"table:{p}", tmp_path / "c", dense_buckets=4, **COLUMNS)
    train_idx = np.arange(10)
    plan = ds.fit_dense_plan(train_idx)
    assert plan.edges[1] == ()  # score: one value, no buckets
    # Halfway between the stored values around each quartile (2.25, 4.5, 6.75): 2|3, 4|5, 6|7.
    stored = np.log1p(np.arange(10.0)).astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(plan.edges[0], (stored[[2, 4, 6]] + stored[[3, 5, 7]]) / 2)
    assert plan.output_names == ("price", "score", "price:q0", "price:q1", "price:q2", "price:q3")
    hot = ds.dense_inputs()[:, 2:]
    assert hot[:10].argmax(axis=1).tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
    assert (hot[10:, 3] == 1).all() and (hot.sum(axis=1) == 1).all()
    again = DensePlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    raw = np.array([[r[1], np.nan if r[2] is None else r[2]] for r in rows] + [[np.nan, 1.0]])
    scored = again.transform(raw)
    np.testing.assert_array_equal(scored[:-1], ds.dense_inputs())
    assert scored[-1, 2:].tolist() == [0.0] * 4  # a missing value: no bucket
    assert "up to 4 quantile buckets (one-hot) of price" in plan.summary()


def test_a_plan_fitted_on_rows_streams_their_statistics_and_samples_its_bucket_edges(
    monkeypatch,
):
    """``DenseStats.of_rows`` reads the rows in blocks and gives the figures of one pass;
    ``DensePlan.fit_rows`` takes the bucket edges from every ``step``-th row once there are
    more than ``BUCKET_SAMPLE_ROWS``, and fits the rest on the statistics it is given."""
    monkeypatch.setattr(dense_module, "FIT_BLOCK_ROWS", 3)
    monkeypatch.setattr(dense_module, "BUCKET_SAMPLE_ROWS", 4)
    stored = np.arange(20.0).reshape(10, 2)
    stored[4, 1] = np.nan
    rows = np.array([0, 2, 3, 4, 5, 7, 8, 9])
    stats = DenseStats.of_rows(stored, rows, ["a", "b"])
    whole = DenseStats(["a", "b"])
    whole.update(stored[rows])
    assert stats.names == whole.names
    for key in ("count", "missing", "mean", "std", "min", "max"):
        np.testing.assert_allclose(getattr(stats, key), getattr(whole, key), rtol=1e-12)
    plan = DensePlan.fit_rows(stats, ("standardize", "none"), stored, rows, True, buckets=2)
    sample = stored[rows[::2]]  # 8 rows, at most 4: every second one
    assert plan == DensePlan.fit(
        stats, ("standardize", "none"), True, edges=quantile_edges(sample, 2)
    )
    # From rows 0, 3, 5, 8 (every second one); all 8 rows would give ((9.0,), (9.0,)).
    assert plan.indicators == ("b",) and plan.edges == ((8.0,), (9.0,))
    assert DensePlan.fit_rows(stats, ("none", "none"), stored, rows).edges == ()


def test_the_notes_of_a_conversion_are_taken_once_at_open(tmp_path):
    """What the conversion changed: a negative value a ``log`` column set to 0 and a
    constant column, named in the notes the dataset keeps from its opening."""
    rows = [(i % 2, -1.0 if i == 0 else float(i), 2.0, "a") for i in range(8)]
    p = _table(tmp_path / "t.csv", rows)
    ds = open_dataset(f"table:{p}", tmp_path / "c", dense_transform="log", **COLUMNS)
    assert ds.notes == [
        "negative values set to 0: log(1 + x) cannot take them (price 1 (12.5%)); "
        "--dense-transform price=signed-log (or standardize, minmax, none) keeps them",
        "dense column 'score' is constant after its transform log (every training value "
        "1.09861): it carries nothing into the model",
    ]
    assert ds.dense_stats.to_json() == ds.meta["dense_stats"]


def test_dense_buckets_one_is_refused_in_one_line(tmp_path):
    p = _table(tmp_path / "t.csv", [(1, 1.0, 2.0, "a"), (0, 2.0, 3.0, "b")])
    with pytest.raises(
        DataOptionError, match=r"--dense-buckets\) must be 0 \(none\) or at least 2, got 1"
    ):
        open_dataset(f"table:{p}", tmp_path / "c", dense_buckets=1, **COLUMNS)


# --------------------------------------------------------------------------- through a run


def test_a_run_records_its_dense_plan_and_what_log_set_to_zero(tmp_path, caplog):
    rng = np.random.default_rng(1)
    rows = [
        (int(rng.random() < 0.3), round(float(rng.normal(0, 2)), 3), 1.0, "a") for _ in range(600)
    ]
    p = _table(tmp_path / "t.csv", rows)
    negative = sum(r[1] < 0 for r in rows)
    with caplog.at_level(logging.WARNING):
        metrics = train(
            tiny_config(
                tmp_path,
                TINY_FILE_RUN,
                data=f"table:{p}",
                label="click",
                dense=["price", "score"],
                sparse=["site"],
                dense_transform="price=log,score=standardize",
                missing_indicator=True,
                batch_size=128,
            )
        )
    dataset = metrics["dataset"]
    assert dataset["dense_negative_under_log"] == {"price": negative}
    notes = [r.getMessage() for r in caplog.records if "negative values set to 0" in r.getMessage()]
    assert len(notes) == 1 and f"price {negative}" in notes[0], notes
    plan = DensePlan.from_json(dataset["dense_plan"])
    assert plan.transforms == ("log", "standardize") and plan.indicators == ()
    assert plan.fitted_on == f"the {dataset['train']} rows of the training split"
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert on_disk["dataset"]["dense_plan"] == dataset["dense_plan"]

"""Synthetic Criteo-like data: reproducibility, layout, skew, planted signal."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from torchrec_cowclip.data import (
    CRITEO_KAGGLE_CARDINALITIES,
    PlantedModel,
    SyntheticConfig,
    open_dataset,
    synthetic_arrays,
)
from torchrec_cowclip.data.sources.synthetic import CHUNK_ROWS, fit_zipf_exponent

OPTS = dict(cardinality_scale=0.01, max_cardinality=20_000)


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Rank-based (Mann-Whitney) AUC; scores are continuous, ties negligible."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    return open_dataset("synthetic:100000", tmp_path_factory.mktemp("syn"), seed=11, **OPTS)


def test_layout_and_ids_within_cardinalities(synthetic) -> None:
    ds = synthetic
    assert len(ds) == 100_000
    assert ds.dense.shape == (100_000, 13) and ds.dense.dtype == np.float32
    assert ds.sparse.shape == (100_000, 26)
    assert ds.labels.dtype == np.float32 and set(np.unique(ds.labels)) == {0.0, 1.0}
    cards = np.array(ds.schema.cardinalities)
    expected = [max(1, min(20_000, round(k * 0.01))) for k in CRITEO_KAGGLE_CARDINALITIES]
    assert cards.tolist() == expected
    assert (ds.sparse >= 0).all() and (ds.sparse < cards).all()
    inputs = ds.dense_inputs()
    assert (inputs >= 0).all() and np.isfinite(inputs).all()  # log(1 + count), missing 0
    missing = np.isnan(ds.dense).mean(axis=0)  # stored as NaN, as a file's missing values
    assert missing[1] == 0 and 0.5 < missing[11] < 0.9  # I2 never missing, I12 mostly
    assert ds.schema.sparse_names[0] == "C1" and ds.schema.dense_names[-1] == "I13"


def test_positive_rate(synthetic) -> None:
    rate = float(synthetic.labels.mean())
    assert 0.2 < rate < 0.3
    assert abs(synthetic.meta["synthetic"]["positive_fraction"] - rate) < 1e-9


def test_reproducible_and_prefix_stable(tmp_path: Path, synthetic) -> None:
    again = open_dataset("synthetic:100000", tmp_path / "other", seed=11, **OPTS)
    assert again.path.name == synthetic.path.name  # same key
    for a, b in (
        (synthetic.dense, again.dense),
        (synthetic.sparse, again.sparse),
        (synthetic.labels, again.labels),
    ):
        np.testing.assert_array_equal(a, b)
    shorter = open_dataset("synthetic:70k", tmp_path / "other", seed=11, **OPTS)
    np.testing.assert_array_equal(shorter.sparse, synthetic.sparse[:70_000])
    np.testing.assert_array_equal(shorter.labels, synthetic.labels[:70_000])
    other_seed = open_dataset("synthetic:70k", tmp_path / "other", seed=12, **OPTS)
    assert not np.array_equal(other_seed.sparse, shorter.sparse)
    dense, sparse, labels, _ = synthetic_arrays(SyntheticConfig(rows=1000, seed=11, **OPTS))
    np.testing.assert_array_equal(sparse, synthetic.sparse[:1000])
    np.testing.assert_array_equal(dense, synthetic.dense_inputs(np.arange(1000)))


def test_ids_are_skewed(synthetic) -> None:
    sparse = np.asarray(synthetic.sparse)
    cards = synthetic.schema.cardinalities
    for f in (2, 3, 9, 23):  # C3, C4, C10, C24: the large tables
        counts = np.sort(np.bincount(sparse[:, f], minlength=cards[f]))[::-1]
        top = max(1, math.ceil(0.01 * cards[f]))
        share = counts[:top].sum() / counts.sum()
        assert share > 0.6, (f, share)  # fitted to 0.70; a uniform law would give 0.01
    model = PlantedModel(SyntheticConfig(rows=1, **OPTS))
    assert all(s > 0.9 for s in model.exponents if s)


def test_zipf_fit() -> None:
    for k in (3, 583, 142_572, 10_131_227):
        s = fit_zipf_exponent(k, 0.7)
        top = max(1, math.ceil(0.01 * k))
        if k <= 1_000_000:
            w = np.arange(1, k + 1, dtype=np.float64) ** -s
            assert abs(w[:top].sum() / w.sum() - 0.7) < 1e-6
    # classic Zipf (s = 1) at Criteo's largest sizes is what the 0.70 target reproduces
    assert 0.95 < fit_zipf_exponent(10_131_227, 0.7) < 1.05


def test_planted_labels_are_learnable(synthetic) -> None:
    labels = np.asarray(synthetic.labels)
    logit = np.asarray(synthetic.planted_logit)
    planted = binary_auroc(torch.from_numpy(logit), torch.from_numpy(labels).long()).item()
    assert planted > 0.7
    assert abs(planted - _auc(labels, logit)) < 1e-4
    assert abs(planted - synthetic.meta["synthetic"]["planted_auc"]) < 1e-4
    # learnable from the data alone: per-id click rates (smoothed log-odds, naive Bayes)
    # estimated on one half score the other half well above chance
    sparse = np.asarray(synthetic.sparse)
    half = len(labels) // 2
    prior = labels[:half].mean()
    score = np.zeros(len(labels) - half)
    for f in range(26):
        k = synthetic.schema.cardinalities[f]
        clicks = np.bincount(sparse[:half, f], weights=labels[:half], minlength=k)
        shows = np.bincount(sparse[:half, f], minlength=k)
        rate = (clicks + 20 * prior) / (shows + 20)
        score += np.log(rate / (1 - rate))[sparse[half:, f]]
    assert _auc(labels[half:], score) > 0.6  # 0.66 for this seed; chance is 0.5


def test_dense_transforms(tmp_path: Path) -> None:
    cfg = dict(seed=3, **OPTS)
    log = open_dataset("synthetic:3000", tmp_path, **cfg)
    none = open_dataset("synthetic:3000", tmp_path, dense_transform="none", **cfg)
    mm = open_dataset("synthetic:3000", tmp_path, dense_transform="minmax", **cfg)
    np.testing.assert_allclose(log.dense, np.log1p(none.dense), rtol=1e-6)
    raw = np.asarray(none.dense, dtype=np.float64)
    lo, hi = np.nanmin(raw, 0), np.nanmax(raw, 0)
    expected = np.nan_to_num((raw - lo) / np.where(hi > lo, hi - lo, 1), nan=0.0)
    np.testing.assert_allclose(mm.dense_inputs(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(log.labels, mm.labels)  # labels do not depend on the transform


def test_a_dataset_of_several_chunks_has_every_row_once(tmp_path: Path) -> None:
    """Four 65,536-row chunks: every row is written, and each chunk draws its own rows
    (its speed is benchmarks/synthetic_generation.py's)."""
    ds = open_dataset("synthetic:262144", tmp_path, seed=1)
    assert len(ds) == 262_144 == 4 * CHUNK_ROWS
    starts = [ds.sparse[k * CHUNK_ROWS : k * CHUNK_ROWS + 64].tobytes() for k in range(4)]
    assert len(set(starts)) == 4


def test_synthetic_option_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="row count"):
        open_dataset("synthetic:lots", tmp_path)
    with pytest.raises(ValueError, match="hash_size"):
        open_dataset("synthetic:100", tmp_path, hash_size=10)
    with pytest.raises(ValueError):
        SyntheticConfig(rows=10, top1_share=1.5)


def test_rank_auc_matches_torchmetrics_and_rejects_swapped_arguments() -> None:
    from torchrec_cowclip.data import rank_auc

    rng = np.random.default_rng(0)
    labels = (rng.random(500) < 0.3).astype(np.float32)
    scores = np.round(rng.normal(size=500) + labels, 1)  # rounded: many ties
    ref = binary_auroc(torch.from_numpy(scores), torch.from_numpy(labels).long()).item()
    assert abs(rank_auc(labels, scores) - ref) < 1e-6
    with pytest.raises(ValueError, match="swapped"):
        rank_auc(scores, labels)


# A draw of the default profile before the hard profile's options existed: sha256 of its
# four arrays, its solved bias and its cache payload (the cache key of every existing
# synthetic: entry depends on the payload).
DEFAULT_DRAW_SHA256 = "c2b193683ff016a2953000cf77c68ab923dd896e1964e415067cf67928420458"
DEFAULT_DRAW_BIAS = -1.9203847206753673


def test_default_profile_is_unchanged() -> None:
    import hashlib

    cfg = SyntheticConfig(rows=3000, seed=5, cardinality_scale=0.01, max_cardinality=20_000)
    digest = hashlib.sha256()
    for a in synthetic_arrays(cfg):
        digest.update(np.ascontiguousarray(a).tobytes())
    assert digest.hexdigest() == DEFAULT_DRAW_SHA256
    assert PlantedModel(cfg).bias == DEFAULT_DRAW_BIAS
    assert cfg.payload() == {
        "rows": 3000,
        "seed": 5,
        "cardinality_scale": 0.01,
        "max_cardinality": 20_000,
        "top1_share": 0.7,
        "positive_rate": 0.25,
        "dense_transform": "log",
    }


@pytest.fixture(scope="module")
def hard(tmp_path_factory: pytest.TempPathFactory):
    return open_dataset("synthetic-hard:50000", tmp_path_factory.mktemp("hard"), seed=11, **OPTS)


def test_hard_profile_is_its_own_reproducible_source(tmp_path: Path, hard, synthetic) -> None:
    from torchrec_cowclip.data.registry import source_kinds
    from torchrec_cowclip.data.sources.synthetic import HARD_PROFILE

    assert "synthetic-hard" in source_kinds()
    assert hard.path.name.startswith("synthetic-hard")
    # Its rows are named by the kind the user gave (progress lines, meta), not "synthetic:".
    assert [r["path"] for r in hard.meta["file_rows"]] == ["synthetic-hard:50000"]
    assert [r["path"] for r in synthetic.meta["file_rows"]] == ["synthetic:100000"]
    assert hard.schema.cardinalities == synthetic.schema.cardinalities
    meta = hard.meta["synthetic"]
    assert meta["top1_share"] == 0.35 and meta["latent_dim"] == 8
    assert [tuple(p) for p in meta["pairs"]] == list(HARD_PROFILE["pairs"])
    assert not np.array_equal(hard.sparse[:1000], synthetic.sparse[:1000])
    again = open_dataset("synthetic-hard:20000", tmp_path, seed=11, **OPTS)
    np.testing.assert_array_equal(again.sparse, hard.sparse[:20_000])
    np.testing.assert_array_equal(again.labels, hard.labels[:20_000])
    # The kind is the profile; its options can still be set one by one.
    cfg = SyntheticConfig(rows=20_000, seed=11, **OPTS, **HARD_PROFILE)
    _, sparse, labels, _ = synthetic_arrays(cfg)
    np.testing.assert_array_equal(sparse, again.sparse)
    np.testing.assert_array_equal(labels, again.labels)


def test_hard_profile_puts_the_signal_in_interactions_and_rare_ids(hard, synthetic) -> None:
    default, tough = synthetic.meta["synthetic"], hard.meta["synthetic"]
    for meta in (default, tough):
        v = meta["logit_variance"]
        parts = v["ids_head"] + v["ids_tail"] + v["dense"] + v["pairs"]
        assert abs(parts - v["total"]) < 0.1 * v["total"]  # the terms are nearly independent
    d, h = default["logit_variance"], tough["logit_variance"]
    assert h["pairs"] / h["total"] > 0.4 and h["pairs"] > 4 * d["pairs"]
    assert h["ids_tail"] / h["total"] > 0.25 and h["ids_tail"] > 2 * d["ids_tail"]
    assert h["dense"] < d["dense"]
    # Bayes limit: sane, and not below the default's (harder to learn, not noisier)
    assert default["planted_auc"] < tough["planted_auc"] < 0.9
    assert abs(tough["planted_auc"] - _auc(np.asarray(hard.labels), hard.planted_logit)) < 1e-4
    # The heavier tail: the top 1% of a large field's ids get about 35% of its rows.
    sparse, k = np.asarray(hard.sparse), hard.schema.cardinalities[2]
    counts = np.sort(np.bincount(sparse[:, 2], minlength=k))[::-1]
    assert 0.25 < counts[: math.ceil(0.01 * k)].sum() / counts.sum() < 0.45


def test_logit_terms_add_up_to_the_planted_logit() -> None:
    from torchrec_cowclip.data.sources.synthetic import HARD_PROFILE

    model = PlantedModel(SyntheticConfig(rows=1, seed=2, **OPTS, **HARD_PROFILE))
    chunk = model.chunk(1)
    terms = model.logit_terms(chunk)
    np.testing.assert_allclose(sum(terms.values()) + model.bias, chunk.logit, atol=1e-4)
    assert all(t.std() > 0 for t in terms.values())


def test_profile_option_errors() -> None:
    with pytest.raises(ValueError, match="pairs"):
        SyntheticConfig(rows=10, pairs=(("C1", "C1"),))
    with pytest.raises(ValueError, match="pairs"):
        SyntheticConfig(rows=10, pairs=(("C1", "C27"),))
    with pytest.raises(ValueError, match="latent_dim"):
        SyntheticConfig(rows=10, latent_dim=0)
    with pytest.raises(ValueError, match="rare_id_sigma"):
        SyntheticConfig(rows=10, rare_id_sigma=float("nan"))

"""benchmarks/scaling.py's machinery on a two-batch study: every method runs, the clip
counters add up, the outputs are written, and CowClip whose clip cannot bind is the
no-clip run to the bit (an exact property, not a statistical one).

Whether the runs learn, and by how much at which batch, is the study's own result
(docs/scaling.md, "The small study", with its ``--min-auc`` check), not asserted here.
"""

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "scaling_benchmark", REPO / "benchmarks" / "scaling.py"
)
scaling = importlib.util.module_from_spec(_spec)
sys.modules["scaling_benchmark"] = scaling
_spec.loader.exec_module(scaling)

SEED = int(os.environ.get("COWCLIP_SCALING_TEST_SEED", "0"))
SMALL, LARGE = 512, 4096
EPOCHS, TRAIN_ROWS = 2, 27_000
# tau_j >= c_j * zeta: with a mean loss no row's gradient norm comes near 1e3 per occurrence.
UNREACHABLE_ZETA = 1e3


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    common = dict(
        model="deepfm",
        data="synthetic:30000",
        seeds=[SEED],
        epochs=EPOCHS,
        out_root=out,
        cache_dir=str(out / "cache"),
        base_batch_size=SMALL,
        base_lr_embed=1e-2,
        base_lr=4e-3,
        extra=dict(
            hidden=(32, 32),
            synthetic_scale=0.01,
            synthetic_max_cardinality=5000,
            eval_batch_size=8192,
            log_every=1000,
            row_clip_stats=True,
        ),
        verbose=False,
    )
    # At the base batch every method has the same lrs; only CowClip is run there.
    records = scaling.run_study(batch_sizes=[SMALL], methods=["cowclip"], **common)
    records += scaling.run_study(batch_sizes=[LARGE], methods=scaling.METHODS, **common)
    # CowClip with the sqrt method's lrs and a threshold floor (zeta) no gradient reaches,
    # so the clip cannot bind: it must then BE that method.
    records += scaling.run_study(
        batch_sizes=[LARGE],
        methods=["cowclip"],
        method_options={
            "rules": {"embedding_lr_scaling": "sqrt"},
            "clip_zeta": UNREACHABLE_ZETA,
            "label": "cowclip-sqrt",
        },
        **common,
    )
    return out, {(r["batch_size"], r["method"]): r for r in records}


def test_method_hyperparameters_follow_the_rule():
    s = 8.0
    base = dict(base_batch_size=1024, base_lr=1e-3, base_lr_embed=1e-4, base_l2=1e-5)
    cc = scaling.method_hyperparameters("cowclip", 8192, **base)
    assert cc["cowclip"] and cc["lr_embed"] == 1e-4
    assert cc["lr"] == pytest.approx(1e-3 * math.sqrt(s)) and cc["l2"] == pytest.approx(8e-5)
    sq = scaling.method_hyperparameters("sqrt", 8192, **base)
    assert not sq["cowclip"] and sq["lr_embed"] == pytest.approx(1e-4 * math.sqrt(s))
    assert sq["lr"] == pytest.approx(1e-3 * math.sqrt(s)) and sq["l2"] == pytest.approx(8e-5)
    li = scaling.method_hyperparameters("linear", 8192, **base)
    assert (li["lr"], li["lr_embed"]) == (pytest.approx(8e-3), pytest.approx(8e-4))
    assert scaling.method_hyperparameters("none", 8192, **base) == {
        "cowclip": False,
        "lr": 1e-3,
        "lr_embed": 1e-4,
        "l2": 1e-5,
    }
    # Without overrides, cowclip is the trainer's own rule (Criteo profile).
    hp = scaling.scale_hyperparameters(8192)
    cc = scaling.method_hyperparameters("cowclip", 8192)
    assert (cc["lr"], cc["lr_embed"], cc["l2"]) == (
        pytest.approx(hp.dense_lr),
        hp.embedding_lr,
        pytest.approx(hp.l2),
    )
    with pytest.raises(ValueError):
        scaling.method_hyperparameters("adamw", 1024)
    # Rule changes (the recipe search) apply to the cowclip method only.
    changed = dict(rules={"embedding_lr_scaling": "sqrt", "l2_scaling": "fixed"}, clip_r=1e-3)
    cc = scaling.method_hyperparameters("cowclip", 8192, **changed, **base)
    assert cc["lr_embed"] == pytest.approx(1e-4 * math.sqrt(s)) and cc["l2"] == 1e-5
    assert cc["lr"] == pytest.approx(1e-3 * math.sqrt(s)) and cc["clip_r"] == 1e-3
    assert scaling.method_hyperparameters("sqrt", 8192, **changed, **base) == sq
    with pytest.raises(ValueError):
        scaling.method_hyperparameters("cowclip", 8192, rules={"l2_scaling": "cubic"})


def test_every_run_is_finite_and_counters_are_consistent(study):
    _, runs = study
    assert len(runs) == 6
    for (b, method), r in runs.items():
        assert math.isfinite(r["auc"]) and math.isfinite(r["logloss"]), (b, method)
        assert 0 < r["auc"] < 1, (b, method, r["auc"])
        assert len(r["epoch_auc"]) == EPOCHS and all(math.isfinite(x) for x in r["epoch_auc"])
        assert r["steps"] == EPOCHS * (TRAIN_ROWS // b)  # the last incomplete batch dropped
        assert 0 <= r["rows_clipped"] <= r["rows_updated"] and r["rows_updated"] > 0
        assert 0 <= r["epoch1_rows_clipped"] <= r["epoch1_rows_updated"] <= r["rows_updated"]
        assert r["epoch1_rows_clipped"] <= r["rows_clipped"]
        for t in r["clipped_per_table"].values():
            assert 0 <= t["rows_clipped"] <= t["rows_updated"]
        if not method.startswith("cowclip"):
            assert r["rows_clipped"] == 0, (b, method)


def test_cowclip_that_never_binds_is_lazy_adam_to_the_bit(study):
    """The robust AUC property: with the same lrs, L2 and seed, a CowClip run in which no
    row was clipped has exactly the AUC of the no-clip run, every epoch (a clip factor of
    1 multiplies by 1.0). It held in every run of the study in docs/scaling.md where the
    clip did not bind; a regression that changes the update when nothing should be
    clipped, or clips without counting it, breaks it."""
    _, runs = study
    cc, sq = runs[(LARGE, "cowclip-sqrt")], runs[(LARGE, "sqrt")]
    assert cc["embedding_lr"] == sq["embedding_lr"] and cc["dense_lr"] == sq["dense_lr"]
    assert cc["clip_zeta"] == UNREACHABLE_ZETA and cc["rows_updated"] == sq["rows_updated"] > 0
    assert cc["rows_clipped"] == 0, "zeta was meant to keep the clip from binding"
    assert cc["epoch_auc"] == sq["epoch_auc"] and cc["epoch_logloss"] == sq["epoch_logloss"]


def test_min_auc_names_every_run_that_did_not_learn(study):
    _, runs = study
    records = list(runs.values())
    assert scaling.auc_shortfalls(records, 0.0) == []
    assert len(scaling.auc_shortfalls(records, 1.0)) == len(records)
    nan = {**records[0], "auc": float("nan")}
    (line,) = scaling.auc_shortfalls([nan], 0.0)
    assert line == (
        f"batch {nan['batch_size']} {nan['method']} seed {SEED}: AUC nan is not above --min-auc 0"
    )


def test_outputs_are_written(study, capsys):
    out, runs = study
    paths = scaling.write_outputs(list(runs.values()), out, {"title": "test"})
    assert paths["csv"].exists() and paths["json"].exists()
    table = scaling.format_table(scaling.summarize(list(runs.values())))
    assert table.count("\n") == 1 + 6 and "| 4096 | cowclip |" in table
    assert "| 4096 | cowclip-sqrt |" in table
    merged = scaling.combine([str(out)], out / "combined")
    assert len(merged) == 6 and (out / "combined" / "scaling.csv").exists()


def test_clip_counts_by_id_frequency_cover_every_clipped_table_update(study):
    """--row-clip-stats: the id-frequency buckets of each run add up to the per-table
    counters of its clipped (D-dim) tables."""
    _, records = study
    for key, r in records.items():
        buckets = r["clip_per_id_frequency_bucket"]
        assert buckets and [b["low"] for b in buckets] == [1, 2, 11, 101, 1001], key
        per_table = {t: v for t, v in r["clipped_per_table"].items() if t.startswith("emb_")}
        assert sum(b["rows_updated"] for b in buckets) == sum(
            v["rows_updated"] for v in per_table.values()
        )
        assert sum(b["rows_clipped"] for b in buckets) == sum(
            v["rows_clipped"] for v in per_table.values()
        )


def test_equal_steps_trains_each_batch_the_base_batch_number_of_steps(monkeypatch, tmp_path):
    """--equal-steps: batch b runs epochs * b / base epochs; the rule's count_lr_power and
    the trainer's early stopping reach the runs."""
    seen = []

    def fake_run_one(**kw):
        seen.append((kw["batch_size"], kw["epochs"], kw["extra"].get("early_stop_patience")))
        return {"auc": 0.5, "logloss": 0.7, "clipped_frac": None, "wall_s": 0.0}

    monkeypatch.setattr(scaling, "run_one", fake_run_one)
    scaling.run_study(
        data="synthetic:10",
        batch_sizes=[512, 2048, 32768],
        methods=["cowclip"],
        epochs=3,
        out_root=tmp_path,
        base_batch_size=512,
        equal_steps=True,
        extra={"early_stop_patience": 2},
        verbose=False,
    )
    assert seen == [(512, 3, 2), (2048, 12, 2), (32768, 192, 2)]
    cc = scaling.method_hyperparameters(
        "cowclip", 8192, base_batch_size=512, rules={"count_lr_power": 0.5}
    )
    assert cc["count_lr_power"] == 0.5
    assert "count_lr_power" not in scaling.method_hyperparameters("none", 8192, base_batch_size=512)


def test_study_methods_adam_helen_and_helen_cowclip():
    """The issue-15 study's methods: adam is none; helen is none plus the Helen fields;
    helen+cowclip is CowClip's fixed-l2 recipe (whatever recipe is asked) plus Helen."""
    base = dict(base_batch_size=64, base_lr=1e-3, base_lr_embed=1e-3, base_l2=1e-5)
    none = scaling.method_hyperparameters("none", 8192, **base)
    assert scaling.method_hyperparameters("adam", 8192, **base) == none
    assert scaling.method_hyperparameters("helen", 8192, **base) == {
        **none,
        "helen_rho": 0.05,
        "helen_bound": 0.3,
    }
    fixed = scaling.method_hyperparameters("cowclip", 8192, recipe="fixed-l2", **base)
    assert fixed["l2"] == 1e-5 and fixed["lr"] == pytest.approx(1e-3 * math.sqrt(128))
    both = scaling.method_hyperparameters(
        "helen+cowclip", 8192, recipe="paper", helen_rho=0.1, helen_bound=0.5, **base
    )
    assert both == {**fixed, "helen_rho": 0.1, "helen_bound": 0.5}
    assert both["cowclip"] and both["recipe"] == "fixed-l2"
    paper = scaling.method_hyperparameters("cowclip", 8192, **base)
    assert paper["l2"] == pytest.approx(1.28e-3)  # the paper's rule scales L2; fixed-l2 not
    assert "helen_rho" not in paper and "helen_rho" not in none


def test_helen_methods_need_the_trainer_fields():
    with pytest.raises(ValueError, match="helen\\+cowclip: .* has no helen_rho, helen_bound"):
        scaling.check_trainer_fields(["adam", "helen+cowclip"], config_fields=["lr", "l2"])
    with pytest.raises(ValueError, match="has no helen_bound"):
        scaling.check_trainer_fields(["helen"], config_fields=["helen_rho"])
    scaling.check_trainer_fields(["helen"], config_fields=["helen_rho", "helen_bound"])
    scaling.check_trainer_fields(["adam", "cowclip"], config_fields=[])
    args = scaling.parse_args(["--methods", "adam,cowclip", "--helen-rho", "0.1"])
    assert args.methods == ["adam", "cowclip"] and args.helen_rho == 0.1


def test_summary_gives_each_seed_its_delta_and_the_step_time():
    def rec(method, batch, seed, auc, step_ms):
        return {
            "method": method,
            "batch_size": batch,
            "seed": seed,
            "auc": auc,
            "logloss": 0.5,
            "val_sel_auc": auc,
            "val_sel_logloss": 0.5,
            "val_epoch": 1,
            "steps": 13360 if batch == 64 else 105,
            "rows_updated": 10,
            "rows_clipped": 0,
            "epoch1_rows_updated": 10,
            "epoch1_rows_clipped": 0,
            "cowclip": False,
            "wall_s": 1.0,
            "step_ms": step_ms,
        }

    runs = [rec("adam", 64, s, 0.74 + 0.01 * s, 4.0) for s in (0, 1, 2)]
    runs += [rec("adam", 8192, s, a, 90.0 + s) for s, a in ((0, 0.745), (1, 0.748), (2, 0.75))]
    rows = {r["batch_size"]: r for r in scaling.summarize(runs)}
    big = rows[8192]
    assert [s for s, _ in big["delta_by_seed"]] == [0, 1, 2]
    assert [d for _, d in big["delta_by_seed"]] == pytest.approx([0.005, -0.002, -0.01])
    assert (big["delta_min"], big["delta_max"]) == (pytest.approx(-0.01), pytest.approx(0.005))
    assert big["step_ms_mean"] == pytest.approx(91.0) and rows[64]["step_ms_mean"] == 4.0
    table = scaling.format_table(scaling.summarize(runs))
    assert "| s0 +0.0050 s1 -0.0020 s2 -0.0100 | -0.0023 | -0.0100..+0.0050 | 91.00 |" in table

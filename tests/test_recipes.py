"""Trainer recipes (``--recipe``): each sets the hyperparameters documented for it in the
README and ``docs/scaling.md``, explicit options still override them, and the trainer
builds its optimizers from the recipe's values."""

import math

import pytest
from tiny import tiny_config

from torchrec_cowclip import Helen
from torchrec_cowclip.cli import build_parser
from torchrec_cowclip.train import TrainConfig
from torchrec_cowclip.train.command import config_from_args
from torchrec_cowclip.train.config import ConfigError
from torchrec_cowclip.train.scaling import RECIPES, get_recipe, scale_hyperparameters
from torchrec_cowclip.train.start import start_run

# What the documentation promises, Criteo profile (base batch 1024: dense lr 8e-4,
# embedding lr 1e-4, L2 lambda 1e-5, bound 1e-5, D = 10), at s = 16 (batch 16384).
S = 16
#: The clipped recipes' values where they agree (CowClip's r 1 and zeta sqrt(D) * bound).
CLIPPED = dict(
    dense_lr=8e-4 * math.sqrt(S),
    embedding_lr=1e-4,
    clip_r=1.0,
    clip_zeta=math.sqrt(10) * 1e-5,
)
FIXED_L2 = dict(CLIPPED, l2=1e-5, warmup_epochs=0.0)
DOCUMENTED = {
    "paper": dict(CLIPPED, l2=1e-5 * S, warmup_epochs=1.0),
    "fixed-l2": FIXED_L2,
    "fixed-l2-count": dict(FIXED_L2, count_lr_power=0.5),
    "helen-fixed-l2": dict(FIXED_L2, helen_rho=0.005 * math.sqrt(S), helen_bound=0.3),
    # The no-clip baselines of the scaling study (docs/scaling.md).
    "sqrt": dict(
        dense_lr=8e-4 * math.sqrt(S),
        embedding_lr=1e-4 * math.sqrt(S),
        l2=1e-5 * S,
        warmup_epochs=1.0,
        cowclip=False,
    ),
    "linear": dict(
        dense_lr=8e-4 * S, embedding_lr=1e-4 * S, l2=1e-5 * S, warmup_epochs=1.0, cowclip=False
    ),
    "none": dict(dense_lr=8e-4, embedding_lr=1e-4, l2=1e-5, warmup_epochs=1.0, cowclip=False),
}


def test_every_recipe_is_documented_here():
    assert set(RECIPES) == set(DOCUMENTED)
    assert get_recipe("paper") is RECIPES["paper"]
    with pytest.raises(ValueError, match="recipe must be one of"):
        get_recipe("nope")


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_recipe_sets_the_documented_hyperparameters(name):
    hp = scale_hyperparameters(1024 * S, dataset="criteo", embedding_dim=10, recipe=name)
    assert hp.recipe == name
    for field, value in DOCUMENTED[name].items():
        assert getattr(hp, field) == pytest.approx(value, rel=1e-9), field
    # At the base batch every rule gives the base values.
    base = scale_hyperparameters(1024, recipe=name)
    assert (base.dense_lr, base.embedding_lr, base.l2) == pytest.approx((8e-4, 1e-4, 1e-5))


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_explicit_options_override_the_recipe(name):
    hp = scale_hyperparameters(
        1024 * S,
        recipe=name,
        dense_lr=1e-3,
        embedding_lr=2e-3,
        l2=0.0,
        clip_r=0.5,
        clip_zeta=1e-6,
        warmup_epochs=0.0,
    )
    assert (hp.dense_lr, hp.embedding_lr, hp.l2, hp.clip_r, hp.clip_zeta, hp.warmup_epochs) == (
        1e-3,
        2e-3,
        0.0,
        0.5,
        1e-6,
        0.0,
    )


def test_cli_recipe_reaches_the_trainer(tmp_path):
    name = sorted(DOCUMENTED)[-1]
    args = build_parser().parse_args(
        [
            "train",
            "--data",
            # 18,000 training rows: one full batch of 16,384 (a run needs one).
            "synthetic:20000",
            "--synthetic-scale",
            "0.001",
            "--synthetic-max-cardinality",
            "500",
            "--hidden",
            "8",
            "--batch-size",
            str(1024 * S),
            "--recipe",
            name,
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "run"),
        ]
    )
    cfg = config_from_args(args)
    assert cfg.recipe == name and cfg.clip_r is None and cfg.warmup_epochs is None
    cfg.validate()
    settings = cfg.resolve()
    trainer = start_run(settings)
    cowclip = settings.optimizers.embedding.cowclip
    for field, value in DOCUMENTED[name].items():
        assert getattr(settings.hp, field) == pytest.approx(value, rel=1e-9), field
    if DOCUMENTED[name].get("cowclip", True):
        assert cowclip.r == pytest.approx(DOCUMENTED[name]["clip_r"])
        assert cowclip.zeta == pytest.approx(DOCUMENTED[name]["clip_zeta"])
    else:
        assert cowclip is None
    power = DOCUMENTED[name].get("count_lr_power", 0.0)
    count_lr = trainer.runtime.model.embedding_collection.fused_optimizer.hyperparameters[
        "count_lr"
    ]
    assert (
        (count_lr is None) if power == 0 else ((count_lr.power, count_lr.cap) == (power, float(S)))
    )
    rho = DOCUMENTED[name].get("helen_rho")
    helen = trainer.runtime.model.embedding_collection.helen
    assert (helen is None) if rho is None else (helen.rho == pytest.approx(rho))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--data", "synthetic:10", "--recipe", "nope"])


def test_config_rejects_an_unknown_recipe():
    with pytest.raises(ConfigError, match="--recipe"):
        TrainConfig(recipe="nope").validate()
    assert TrainConfig().recipe == "paper"


def test_count_lr_power_sets_a_per_row_rule_capped_at_the_batch_scale(tmp_path):
    hp = scale_hyperparameters(1024 * S, count_lr_power=0.5)
    assert hp.count_lr is not None
    assert (hp.count_lr.power, hp.count_lr.cap) == (0.5, float(S))
    assert scale_hyperparameters(1024 * S).count_lr is None  # off in the paper's recipe
    assert scale_hyperparameters(512, count_lr_power=1.0).count_lr.cap == 1.0  # never below 1
    cfg = TrainConfig(
        data="synthetic:20000",
        synthetic_scale=0.001,
        synthetic_max_cardinality=500,
        hidden=(8,),
        batch_size=1024 * S,
        count_lr_power=1.0,
        cache_dir=str(tmp_path / "cache"),
        out=str(tmp_path / "run"),
    )
    cfg.validate()
    trainer = start_run(cfg.resolve())
    hyper = trainer.runtime.model.embedding_collection.fused_optimizer.hyperparameters
    assert hyper["count_lr"].cap == float(S) and hyper["count_lr"].power == 1.0
    with pytest.raises(ConfigError, match="--count-lr-power"):
        TrainConfig(count_lr_power=0.5, embedding_backend="torchrec", cowclip=False).validate()


def test_a_helen_recipe_trains_with_helen_and_the_flags_override_it():
    base = scale_hyperparameters(1024, recipe="helen-fixed-l2")
    assert base.helen() == Helen(rho=0.005, bound=0.3)
    given = scale_hyperparameters(1024 * S, recipe="helen-fixed-l2", helen_rho=0.2, helen_bound=0.5)
    assert given.helen(perturb_dense=True) == Helen(rho=0.2, bound=0.5, perturb_dense=True)
    assert scale_hyperparameters(1024 * S, recipe="fixed-l2").helen() is None
    # --helen-bound / --helen-perturb-dense are refused without Helen, accepted with a
    # recipe that has it.
    for flags in (["--helen-bound", "0.5"], ["--helen-perturb-dense"]):
        args = ["train", "--data", "synthetic:100", "--out", "o"] + flags
        with pytest.raises(ConfigError, match="has no effect without --helen-rho"):
            config_from_args(build_parser().parse_args(args)).validate()
        cfg = config_from_args(build_parser().parse_args(args + ["--recipe", "helen-fixed-l2"]))
        cfg.validate()


def test_the_study_baselines_are_recipes_without_the_clip_and_base_values_can_be_given():
    from torchrec_cowclip.train.scaling import BASELINES

    hp = scale_hyperparameters(
        4096, base_batch_size=1024, recipe=BASELINES["sqrt"], base_dense_lr=1e-3, base_l2=1e-5
    )
    assert not hp.cowclip and hp.recipe == "sqrt"
    assert (hp.dense_lr, hp.embedding_lr, hp.l2) == (2e-3, 2e-4, 4e-5)
    none = scale_hyperparameters(4096, recipe=BASELINES["none"], base_embedding_lr=1e-2)
    assert (none.dense_lr, none.embedding_lr, none.l2) == (8e-4, 1e-2, 1e-5)
    # The baselines are --recipe choices: the only ones without the clip.
    assert {name for name, r in RECIPES.items() if not r.cowclip} == set(BASELINES)
    assert all(RECIPES[name] is recipe for name, recipe in BASELINES.items())


def test_a_baseline_recipe_trains_without_the_clip_and_refuses_clip_options(tmp_path):
    args = ["train", "--data", "synthetic:100", "--out", "o", "--recipe", "none"]
    with pytest.raises(
        ConfigError, match=r"--clip-r 2 has no effect with --recipe none \(no clip\)"
    ):
        config_from_args(build_parser().parse_args(args + ["--clip-r", "2"])).validate()
    # The stock TorchRec tables have no clip: a no-clip recipe needs no --no-cowclip.
    config_from_args(
        build_parser().parse_args(args + ["--embedding-backend", "torchrec"])
    ).validate()
    settings = tiny_config(tmp_path, recipe="linear", batch_size=512, base_batch_size=256).resolve()
    trainer = start_run(settings)
    try:
        assert settings.optimizers.embedding.cowclip is None and settings.hp.recipe == "linear"
        assert settings.hp.embedding_lr == pytest.approx(2e-4)
    finally:
        trainer.run_dir.release()

"""Each training option is declared once (a field of ``TrainConfig`` made by
``train.options.option``); the parser, ``--help``, the checks, the command a config is
written as and what a warm start names are derived from the declarations."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

from torchrec_cowclip.cli import build_parser
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.process_context import ONE_PROCESS
from torchrec_cowclip.run.resume_guard import resume_differences, run_fingerprint, shown_setting
from torchrec_cowclip.train.command import (
    config_from_args,
    given_options,
    group_options,
    train_argv,
    train_flags,
    train_parser,
)
from torchrec_cowclip.train.config import RECORDED_SETTINGS, TrainConfig
from torchrec_cowclip.train.options import GROUPS, declarations, without_none
from torchrec_cowclip.train.warm_start import NOT_INHERITED_SETTINGS, inherited_line

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "torchrec_cowclip"


def test_every_field_is_a_declared_option_with_one_flag_in_a_known_group():
    options = declarations(TrainConfig)
    assert [o.name for o in options] == [f.name for f in fields(TrainConfig)]
    flags = [o.flag for o in options]
    assert len(set(flags)) == len(flags) and flags == train_flags()
    assert {o.option.group for o in options} == set(GROUPS)
    assert all(o.option.help for o in options)


def test_the_package_reads_no_private_part_of_argparse():
    private = re.compile(
        r"\b(_actions|_group_actions|_action_groups|_SubParsersAction|"
        r"_ActionsContainer|_HelpAction|_ArgumentGroup)\b"
    )
    found = [
        str(p.relative_to(PACKAGE_DIR))
        for p in PACKAGE_DIR.rglob("*.py")
        if private.search(p.read_text())
    ]
    assert found == []


def _off_default() -> TrainConfig:
    """A config whose every option differs from its default (a value each takes)."""
    # fmt: off
    return TrainConfig(
        data="table:x.csv", test_data="table:y.csv", test_fraction=0.2, val_fraction=0.05,
        label="click", dense=["a", "b"], sparse=["c"], delimiter=";", no_header=True,
        columns=["click", "a", "b", "c"], na_values=["NA", "-"], time_columns=["ts"],
        dense_transform="-log", missing_indicator=True, on_bad_row="skip", hash_size=1000,
        min_count=2, synthetic_scale=0.5, synthetic_max_cardinality=99, synthetic_seed=7,
        cache_dir="c", model="dcn", embedding_dim=8, cross_layers=2, init_std=0.05,
        hidden=(16, 8), embedding_backend="torchrec", embedding_dtype="bf16",
        batch_size=2048, base_batch_size=512, recipe="sqrt", lr=3.5e-4, lr_embed=1e-3,
        l2=-0.0, clip_r=2.0, clip_zeta=1e-6, warmup_epochs=0.5, count_lr_power=0.25,
        helen_rho=0.05, helen_bound=0.2, cowclip=False, embedding_optimizer="sgd",
        helen_perturb_dense=True, out="o", overwrite=True, resume="auto", epochs=3,
        max_steps=5, seed=3, early_stop_patience=1, checkpoint_every=4, eval_batch_size=64,
        threads=2, log_every=5, keep_checkpoints=3, device="cpu", progress=False,
        row_clip_stats=True, init_from="runs/a", init_optimizer_state=True,
        require_sha256=True, sharding="row_wise", dist_timeout_s=60.0,
    )
    # fmt: on


def test_a_config_is_written_as_the_flags_that_parse_back_to_it():
    config = _off_default()
    argv = train_argv(None, config)
    assert "--dense-transform=-log" in argv and "--l2=-0.0" in argv  # not read as flags
    assert argv[argv.index("--hidden") + 1] == "16,8" and "--no-cowclip" in argv
    assert config_from_args(train_parser().parse_args(argv)) == config
    assert train_argv(None, TrainConfig(data="synthetic:10")) == ["--data", "synthetic:10"]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"dense": ["a,b"]}, "--dense: ['a,b'] cannot be written comma-separated"),
        ({"dense": [" a"]}, "--dense: [' a'] cannot be written comma-separated"),
        ({"cowclip": "no"}, "--no-cowclip: 'no' has no command-line form"),
        ({"embedding_dim": None}, "--embedding-dim: None has no command-line form"),
    ],
)
def test_a_config_no_command_line_gives_is_refused_naming_the_flag(change, words):
    with pytest.raises(
        ConfigError, match=re.escape(f"a cell does not reproduce its settings: {words}")
    ):
        train_argv(None, TrainConfig(**{"data": "synthetic:10", **change}), "a cell")


def test_the_options_given_are_told_from_defaults_without_reparsing():
    given = given_options(["train", "--data", "synthetic:10", "--no-cowclip", "--hidden", "8"])
    assert given == {"data": "synthetic:10", "cowclip": False, "hidden": [8]}
    assert given_options(["--batch-size", "1024"]) == {"batch_size": 1024}  # the default, given


def test_other_commands_take_trains_declarations():
    parser = build_parser()
    plan = parser.parse_args(["plan", "--tables", "criteo-kaggle"])
    sweep = parser.parse_args(["sweep", "--batch-sizes", "8"])
    for option in group_options("data") + group_options("model"):
        assert getattr(plan, option.name) == getattr(sweep, option.name), option.name
    assert plan.batch_size == TrainConfig().batch_size
    assert (plan.embedding_optimizer, sweep.lr_embed) == ("adam", None)
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "--tables", "x", "--optimizer", "nope"])


def test_a_warm_start_inherits_and_names_by_the_declarations():
    assert {"data", "out", "resume", "device", "dist_timeout_s"} <= NOT_INHERITED_SETTINGS
    assert {"model", "batch_size", "hidden"}.isdisjoint(NOT_INHERITED_SETTINGS)
    line = inherited_line("r", {"dist_timeout_s": 60.0, "missing_indicator": True})
    assert line == "from --init-from r (flags not given): --dist-timeout 60.0, --missing-indicator"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"batch_size": 0}, "--batch-size must be > 0, got 0"),
        ({"lr": float("nan")}, "--lr must be a finite number, got nan"),
        ({"model": "nope"}, "--model must be one of deepfm, "),
        ({"hidden": (8, 0)}, "--hidden sizes must be > 0, got [8, 0]"),
        ({"resume": "always"}, "--resume takes no value or 'auto', got 'always'"),
        ({"dist_timeout_s": 0.0}, "--dist-timeout must be > 0, got 0.0"),
    ],
)
def test_each_option_is_checked_by_its_declaration(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(data="synthetic:10", **change).validate()


def test_the_parser_has_no_argparse_namespace_of_its_own():
    args = train_parser().parse_args(["--data", "synthetic:10"])
    assert isinstance(args, argparse.Namespace)
    assert set(vars(args)) == {o.name for o in declarations(TrainConfig)}


def test_the_loops_settings_are_the_declared_options_of_the_same_types():
    from typing import get_type_hints

    from torchrec_cowclip.train.config import RunSettings

    # The run's settings are resolved: an option the data kind fills in is no longer None.
    declared = {o.name: o.value_type for o in declarations(TrainConfig)}
    run = {name: without_none(kind) for name, kind in get_type_hints(RunSettings).items()}
    assert {name: declared.get(name) for name in run} == run
    # ... and exactly the run and distributed groups' options and those declared to be
    # given to them too (the batch): an option added to either group is a field of the
    # loop's settings, or they refuse to be made.
    loops = {"run", "distributed"}
    grouped = {
        o.name
        for o in declarations(TrainConfig)
        if o.option.group in loops or loops & set(o.option.also)
    }
    assert set(run) == grouped and "batch_size" in grouped


def test_the_data_kinds_defaults_are_filled_once_by_resolve(monkeypatch):
    filled = []
    original = TrainConfig.with_data_defaults

    def counted(self):
        filled.append(self.data)
        return original(self)

    monkeypatch.setattr(TrainConfig, "with_data_defaults", counted)
    settings = TrainConfig(data="synthetic:100", epochs=3).resolve(ONE_PROCESS)
    assert filled == ["synthetic:100"]  # the checks, the data and the record take resolve's
    assert (settings.run.epochs, settings.run.early_stop_patience) == (3, 0)
    assert settings.record["val_fraction"] == settings.data.val_fraction == 0.0


def test_the_settings_groups_are_made_from_the_declarations_groups():
    config = TrainConfig(
        data="table:x.csv",
        model="dcn",
        hidden=(8,),
        no_header=True,
        columns=["y", "a"],
        synthetic_scale=0.5,
        seed=7,
    )
    model = config._resolved(None, ONE_PROCESS).model
    assert (model.name, model.hidden, model.init_seed) == ("dcn", (8,), 7)
    listed = replace(config, hidden=[8, 4])._resolved(None, ONE_PROCESS).model
    assert listed.hidden == (8, 4) and hash(listed)  # a caller's list, the spec's tuple
    options = config.data_options()
    # a switch off or an empty list is not given; --no-header is the kind's header=False
    assert (options["header"], options["dense"], options["missing_indicator"]) == (
        False,
        None,
        None,
    )
    assert options["cardinality_scale"] == 0.5  # --synthetic-scale: refused by table: by name
    with pytest.raises(ConfigError, match="--synthetic-scale"):
        config.validate(ONE_PROCESS)
    data_group = {o.option.to or o.name for o in group_options("data")}
    assert set(options) < data_group
    assert {"spec", "test_spec", "cache_dir", "test_fraction", "val_fraction"} < data_group


def test_a_resume_refusal_names_settings_by_their_declarations():
    for option in declarations(TrainConfig):
        assert RECORDED_SETTINGS[option.name].flag.endswith(
            option.flag + (")" if option.option.label else "")
        )
    assert shown_setting("cowclip", False, RECORDED_SETTINGS) == "off"
    saved = {
        "settings": {"cowclip": True, "init_std": 0.01},
        "data": {"rows": 1, "cache_entry": "x"},
    }
    now = {
        "settings": {"cowclip": False, "init_std": 0.02},
        "data": {"rows": 1, "cache_entry": "x"},
    }
    assert resume_differences(saved, now, RECORDED_SETTINGS) == [
        ("CowClip (--no-cowclip)", "on", "off"),
        ("--init-std", "0.01", "0.02"),
    ]


def test_what_a_resume_may_change_is_declared_and_keeps_mains_fingerprints():
    resumable = {name for name, setting in RECORDED_SETTINGS.items() if setting.resumable}
    # The set main's run/resume_guard.py listed: a checkpoint it wrote keeps its fingerprint.
    assert resumable == {
        "epochs", "progress", "log_every", "checkpoint_every", "max_steps", "resume",
        "overwrite", "out", "cache_dir", "dist_timeout_s", "sharding", "keep_checkpoints",
        "require_sha256",
    }  # fmt: skip
    record = {"settings": {"seed": 0, "epochs": 1, "out": "a"}, "data": {"rows": 3}}
    moved = {"settings": {"seed": 0, "epochs": 4, "out": "b"}, "data": {"rows": 3}}
    fingerprint = run_fingerprint(record, RECORDED_SETTINGS)
    assert (
        fingerprint == run_fingerprint(moved, RECORDED_SETTINGS) == "06bb86c058c695f9"
    )  # as main computes it


def test_a_checkpoints_settings_hold_the_recipes_value_of_every_option_left_to_it():
    """Each option of the recipe group without a default is one the recipe fills in: a
    checkpoint's record compares its resolved value (``--lr 8e-4`` and the recipe's 8e-4
    are the same setting), found by the option's ``to``, its name among the recipe's."""
    settings = TrainConfig(data="synthetic:100", batch_size=4096).resolve(ONE_PROCESS)
    left = [
        o.name
        for o in declarations(TrainConfig)
        if o.option.group == "optimizer and recipe" and o.default is None
    ]
    assert {"lr", "lr_embed", "l2", "clip_r", "helen_bound"} <= set(left)
    recorded = settings.record_settings()
    assert all(settings.record[name] is None for name in left)
    assert recorded["lr"] == settings.hp.dense_lr > 0
    assert recorded["lr_embed"] == settings.hp.embedding_lr > 0
    assert [recorded[name] for name in left] == [
        getattr(settings.hp, o.option.to or o.name)
        for o in declarations(TrainConfig)
        if o.name in left
    ]

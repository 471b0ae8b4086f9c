"""TorchRec's own ways in: fused_params, apply_optimizer_in_backward, default sharders,
FBGEMM-compatible optimizer state, Helen in TorchRec's train pipelines.

Each configuration door is honoured exactly or refused in one line naming the key; the
multi-process cases run on 2 CPU ranks with gloo (torchrec_native_cases).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict

import pytest
import torch
import torchrec_native_cases as native
from cowclip_testing import kjt_from_bags
from distributed_harness import load_result, plain, run_ranks
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from tiny import TINY_PROCESSES, bag_config, tiny_config
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection, CowClipOptions, Helen
from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder
from torchrec_cowclip.optim import CowClipAdam, CowClipRowWiseAdagrad, CowClipSGD
from torchrec_cowclip.optim.fbgemm_state import cowclip_state_dict, fbgemm_state_dict

#: The row-wise accumulators may differ from FBGEMM's in the last bit (rsqrt vs sqrt).
STOCK_RTOL = 1e-6


def _tables():
    return [
        bag_config("t0", 4, 10, ["f0"]),
        bag_config("lin", 1, 10, ["f0"]),
    ]


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=_tables(), device=torch.device("meta"))


# --- fused_params ----------------------------------------------------------------------


HONOURED = [
    (
        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.5},
        CowClipOptions(optimizer="rowwise_adagrad", lr=0.5),
    ),
    (
        {"optimizer": EmbOptimType.ROWWISE_ADAGRAD, "learning_rate": 0.5, "cowclip": None},
        CowClipOptions(optimizer="rowwise_adagrad", lr=0.5, cowclip=None),
    ),
    (
        {"optimizer": EmbOptimType.ADAM, "learning_rate": 1e-3, "beta1": 0.8, "eps": 1e-6},
        CowClipOptions(optimizer="adam", lr=1e-3, betas=(0.8, 0.999), eps=1e-6),
    ),
    (
        {
            "optimizer": "exact_sgd",
            "learning_rate": 0.1,
            "weight_decay": 1e-5,
            "weight_decay_mode": WeightDecayMode.L2,
        },
        CowClipOptions(optimizer="sgd", lr=0.1, weight_decay=1e-5),
    ),
    # FBGEMM's defaults for what the optimizer's entry leaves out: lr 0.01, eps 1e-8
    ({"optimizer": EmbOptimType.SGD}, CowClipOptions(optimizer="sgd", lr=0.01)),
    (
        {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.2, "eps": 1e-6},
        CowClipOptions(optimizer="adagrad", lr=0.2, eps=1e-6),
    ),
    (
        {
            "optimizer": EmbOptimType.ADAM,
            "learning_rate": 1e-3,
            "weight_decay": 0.05,
            "weight_decay_mode": WeightDecayMode.DECOUPLE,
        },
        CowClipOptions(optimizer="adamw", lr=1e-3, weight_decay=0.05),
    ),
    (
        {
            "optimizer": EmbOptimType.ADAM,
            "learning_rate": 1e-3,
            "stochastic_rounding": False,
            "output_dtype": SparseType.FP16,
        },
        CowClipOptions(lr=1e-3, stochastic_rounding=False, output_dtype=torch.float16),
    ),
    (
        {
            "optimizer": EmbOptimType.ADAM,
            "learning_rate": 1e-4,
            "cowclip": CowClip(r=0.5, zeta=1e-4),
            "unclipped_tables": ["lin"],
            "helen": Helen(rho=0.01),
        },
        CowClipOptions(
            lr=1e-4,
            cowclip=CowClip(r=0.5, zeta=1e-4),
            unclipped_tables=frozenset({"lin"}),
            helen=Helen(rho=0.01),
        ),
    ),
]


@pytest.mark.parametrize("fused_params, expected", HONOURED)
def test_fused_params_are_honoured(fused_params, expected):
    sharder = CowClipEmbeddingBagCollectionSharder(fused_params=fused_params)
    assert sharder.options == expected
    assert sharder.options_for(_ebc()) == expected


REFUSED = [
    (
        {"optimizer": EmbOptimType.PARTIAL_ROWWISE_ADAM},
        r"\['optimizer'\]=partial_row_wise_adam is refused: Adam with a per-element first and "
        r"a per-row second moment is a third state layout",
    ),
    ({"optimizer": EmbOptimType.LAMB}, r"\['optimizer'\]=lamb is refused: its trust ratio"),
    (
        {"optimizer": EmbOptimType.PARTIAL_ROWWISE_LAMB},
        r"=partial_row_wise_lamb is refused: its trust ratio",
    ),
    ({"optimizer": EmbOptimType.SHAMPOO}, r"=shampoo is not an optimizer the CowClip update has"),
    (
        {"optimizer": EmbOptimType.ADAM, "stochastic_rounding": 1},
        r"\['stochastic_rounding'\]=1: give True or False",
    ),
    (
        {"optimizer": EmbOptimType.ADAM, "output_dtype": SparseType.INT8},
        r"\['output_dtype'\]=int8 is refused: the pooled outputs are SparseType.FP32, FP16 or BF16",
    ),
    (
        {"optimizer": EmbOptimType.ADAM, "cache_load_factor": 0.2},
        r"\['cache_load_factor'\] is not honoured",
    ),
    ({"optimizer": EmbOptimType.SGD, "momentum": 0.9}, r"\['momentum'\] is not honoured"),
    (
        {
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "weight_decay_mode": WeightDecayMode.COWCLIP,
        },
        r"\['weight_decay_mode'\]=COWCLIP is refused: FBGEMM's WeightDecayMode.COWCLIP clips "
        r"against the number of steps each row has appeared in",
    ),
    (
        {
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "weight_decay": 0.1,
            "weight_decay_mode": WeightDecayMode.DECOUPLE,
        },
        r"\['weight_decay_mode'\]=DECOUPLE is honoured with Adam \(AdamW\), not rowwise_adagrad",
    ),
    (
        {"optimizer": EmbOptimType.ADAM, "weight_decay_mode": WeightDecayMode.DECOUPLE_GLOBAL},
        r"\['weight_decay_mode'\]=DECOUPLE_GLOBAL is refused: FBGEMM scales it by the steps",
    ),
    (
        {"optimizer": EmbOptimType.ADAM, "weight_decay_mode": WeightDecayMode.COUNTER},
        r"\['weight_decay_mode'\]=COUNTER is refused",
    ),
    (
        {"optimizer": EmbOptimType.ADAM, "weight_decay": 1e-5},
        r"\['weight_decay'\]=1e-05 would be ignored",
    ),
    ({"learning_rate": 0.5}, r"set \['learning_rate'\] but no 'optimizer'"),
]


@pytest.mark.parametrize("fused_params, message", REFUSED, ids=[str(list(f)) for f, _ in REFUSED])
def test_unsupported_fused_params_are_refused_in_one_line_naming_the_key(fused_params, message):
    with pytest.raises(ValueError, match=message) as error:
        CowClipEmbeddingBagCollectionSharder(fused_params=fused_params)
    assert "\n" not in str(error.value)


def test_disagreements_between_options_fused_params_and_the_module_are_refused():
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.5}
    with pytest.raises(
        ValueError, match=r"options= lr=0.001 and fused_params\['learning_rate'\]=0.5 disagree"
    ):
        CowClipEmbeddingBagCollectionSharder(
            fused_params=fused, options=CowClipOptions(optimizer="rowwise_adagrad", lr=1e-3)
        )
    with pytest.raises(ValueError, match="disagree on the tables' optimizer"):
        CowClipEmbeddingBagCollectionSharder(
            fused_params=fused, options=CowClipOptions(optimizer="sgd")
        )
    # Options that agree are one configuration, said twice.
    same = CowClipEmbeddingBagCollectionSharder(
        fused_params=fused, options=CowClipOptions(optimizer="rowwise_adagrad", lr=0.5)
    )
    assert same.options.lr == 0.5
    # A CowClip collection's own options against the sharder's.
    module = CowClipEmbeddingBagCollection(
        _tables(), device="meta", options=CowClipOptions(optimizer="adam", lr=1e-3)
    )
    sharder = CowClipEmbeddingBagCollectionSharder(
        module_type=CowClipEmbeddingBagCollection, fused_params=fused
    )
    with pytest.raises(ValueError, match="the collection's own optimizer='adam' disagree"):
        sharder.options_for(module)
    quiet = CowClipEmbeddingBagCollectionSharder(module_type=CowClipEmbeddingBagCollection)
    assert quiet.options_for(module) == module.options


# --- apply_optimizer_in_backward ----------------------------------------------------


def test_apply_optimizer_in_backward_marks_are_honoured():
    ebc = _ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.5})
    # TorchRec hands these keywords to FBGEMM: eps is FBGEMM's 1e-8, not the class's 1e-10.
    expected = CowClipOptions(optimizer="rowwise_adagrad", lr=0.5, eps=1e-8)
    assert CowClipEmbeddingBagCollectionSharder().options_for(ebc) == expected

    ebc = _ebc()
    for name, param in ebc.embedding_bags.named_parameters():
        clip = None if name.startswith("lin.") else CowClip(r=1.0, zeta=1e-3)
        apply_optimizer_in_backward(CowClipAdam, [param], {"lr": 1e-3, "cowclip": clip})
    options = CowClipEmbeddingBagCollectionSharder().options_for(ebc)
    assert options == CowClipOptions(
        optimizer="adam",
        lr=1e-3,
        cowclip=CowClip(r=1.0, zeta=1e-3),
        unclipped_tables=frozenset({"lin"}),
    )


@pytest.mark.parametrize(
    "mark, message",
    [
        (
            lambda ebc: apply_optimizer_in_backward(
                torch.optim.RMSprop, ebc.parameters(), {"lr": 0.1}
            ),
            r"apply_optimizer_in_backward\(RMSprop\) on 't0': the CowClip update trains",
        ),
        (
            lambda ebc: apply_optimizer_in_backward(
                CowClipSGD, [next(ebc.parameters())], {"lr": 0.1}
            ),
            r"marks tables \['t0'\] but not \['lin'\]",
        ),
        (
            lambda ebc: [
                apply_optimizer_in_backward(CowClipSGD, [p], {"lr": lr})
                for p, lr in zip(ebc.parameters(), (0.1, 0.2))
            ],
            r"on .lin. lr=0.2 and apply_optimizer_in_backward\(CowClipSGD\) on .t0. lr=0.1 disagree",
        ),
        (
            lambda ebc: apply_optimizer_in_backward(
                torch.optim.SGD, ebc.parameters(), {"lr": 0.1, "momentum": 0.9}
            ),
            r"\['momentum'\] is not honoured",
        ),
        (
            lambda ebc: [
                apply_optimizer_in_backward(cls, [p], {"lr": 0.1})
                for p, cls in zip(ebc.parameters(), (CowClipAdam, torch.optim.Adam))
            ],
            r"^apply_optimizer_in_backward marks table 'lin' with torch.optim.Adam and table "
            r"'t0' with CowClipAdam: one fused update trains every table of a collection alike",
        ),
    ],
    ids=["rmsprop", "some_tables", "two_lrs", "sgd_momentum", "two_classes"],
)
def test_apply_optimizer_in_backward_marks_that_cannot_be_honoured_are_refused(mark, message):
    ebc = _ebc()
    mark(ebc)
    with pytest.raises(ValueError, match=message):
        CowClipEmbeddingBagCollectionSharder().options_for(ebc)


@pytest.mark.parametrize(
    "cls, kwargs, expected",
    [
        (
            torch.optim.Adagrad,
            {"lr": 0.2, "eps": 1e-6},
            CowClipOptions(optimizer="adagrad", lr=0.2, eps=1e-6),
        ),
        (
            torch.optim.AdamW,
            {"lr": 1e-3, "betas": (0.8, 0.99), "weight_decay": 0.05},
            CowClipOptions(optimizer="adamw", lr=1e-3, betas=(0.8, 0.99), weight_decay=0.05),
        ),
    ],
    ids=["adagrad", "adamw"],
)
def test_adagrad_and_adamw_marks_are_honoured(cls, kwargs, expected):
    ebc = _ebc()
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    assert CowClipEmbeddingBagCollectionSharder().options_for(ebc) == expected


def test_cowclip_optimizer_classes_validate_and_refuse_a_dense_step():
    weight = torch.nn.Parameter(torch.zeros(3, 2))
    for cls in (CowClipAdam, CowClipRowWiseAdagrad, CowClipSGD):
        opt = cls([weight], lr=0.1)
        with pytest.raises(RuntimeError, match="get_default_sharders"):
            opt.step()
    with pytest.raises(ValueError, match="lr must be >= 0"):
        CowClipAdam([weight], lr=-1.0)
    # The hyperparameters a rule steps with are its param group; the others are refused.
    assert set(CowClipSGD([weight]).defaults) == {
        "lr",
        "weight_decay",
        "cowclip",
        "count_lr",
        "helen",
    }
    assert CowClipRowWiseAdagrad([weight], eps=1e-6).defaults["eps"] == 1e-6
    for cls, name in ((CowClipSGD, "eps"), (CowClipRowWiseAdagrad, "betas")):
        with pytest.raises(TypeError, match=f"{cls.__name__} takes no '{name}'"):
            cls([weight], **{name: (0.9, 0.99) if name == "betas" else 1e-6})


def _train_alike(marked, native):
    """Three steps of both on one batch: the same options, the same tables."""
    kjt = kjt_from_bags({"f": [[1, 2, 2], [3], []]})
    for ebc in (marked, native):
        for _ in range(3):
            ebc(kjt).values().square().sum().backward()
    assert marked.options == native.options
    torch.testing.assert_close(marked.state_dict(), native.state_dict(), rtol=0, atol=0)


def test_from_ebc_trains_as_the_marks_say_like_the_same_options_given_natively():
    tables = [bag_config("t", 4, 20)]
    stock = EmbeddingBagCollection(tables=tables)
    apply_optimizer_in_backward(RowWiseAdagrad, stock.parameters(), {"lr": 0.5, "eps": 1e-8})
    marked = CowClipEmbeddingBagCollection.from_ebc(stock)
    native = CowClipEmbeddingBagCollection.from_ebc(
        EmbeddingBagCollection(tables=tables),
        options=CowClipOptions(optimizer="rowwise_adagrad", lr=0.5, eps=1e-8),
    )
    native.load_state_dict(marked.state_dict())
    _train_alike(marked, native)
    with pytest.raises(ValueError, match="disagree"):
        CowClipEmbeddingBagCollection.from_ebc(stock, options=CowClipOptions(lr=0.1))


@pytest.mark.parametrize("apply", ["torch", "torchrec"])
def test_marks_on_a_built_collection_train_as_the_same_options_given_natively(apply):
    # torch's mark on the collection's own weights once crashed inside torch
    # ('Parameter' object has no attribute '_optimizer_classes').
    from torch.distributed.optim import _apply_optimizer_in_backward

    mark = _apply_optimizer_in_backward if apply == "torch" else apply_optimizer_in_backward
    tables = [bag_config("t", 4, 20)]
    marked = CowClipEmbeddingBagCollection(tables, CowClipOptions(lr=1e-4), init_seed=3)
    native = CowClipEmbeddingBagCollection(
        tables, CowClipOptions(lr=0.01, betas=(0.8, 0.99)), init_seed=3
    )
    mark(torch.optim.Adam, marked.parameters(), {"lr": 0.01, "betas": (0.8, 0.99)})
    _train_alike(marked, native)
    torch.testing.assert_close(
        marked.fused_optimizer.state_dict(), native.fused_optimizer.state_dict(), rtol=0, atol=0
    )
    # The weights stay out of dense optimizers, and a sharder reads the same mark.
    assert list(in_backward_optimizer_filter(marked.named_parameters())) == []
    assert CowClipEmbeddingBagCollectionSharder().options_for(marked).lr == 0.01


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (
            torch.optim.SGD,
            {"lr": 0.1},
            r"asks for optimizer='sgd' but this .* built with optimizer='adam': build it with CowClipOptions",
        ),
        (torch.optim.RMSprop, {"lr": 0.1}, r"the CowClip update trains"),
        (
            CowClipAdam,
            {"lr": 0.1, "helen": Helen()},
            r"asks for helen=Helen.* built with helen=None",
        ),
    ],
    ids=["other_rule", "unknown_class", "helen"],
)
def test_marks_on_a_built_collection_that_cannot_be_honoured_are_refused_before_a_change(
    cls, kwargs, message
):
    from torch.distributed.optim import _apply_optimizer_in_backward

    ebc = CowClipEmbeddingBagCollection([bag_config("t", 4, 20)], CowClipOptions(lr=1e-4))
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    _apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    kjt = kjt_from_bags({"f": [[1], [2]]})
    with pytest.raises(ValueError, match=message):
        ebc(kjt)
    assert ebc.options.lr == 1e-4
    torch.testing.assert_close(ebc.state_dict(), before, rtol=0, atol=0)


# --- FBGEMM-compatible state, in memory -----------------------------------------------


@pytest.mark.parametrize(
    "optimizer, names, first",
    [
        ("adam", ["exp_avg_sq", "momentum1"], "exp_avg"),
        ("adamw", ["exp_avg_sq", "momentum1"], "exp_avg"),
        # FBGEMM's EXACT_ADAGRAD keeps one state, [rows, D] 'sum', which TorchRec keys
        # 'momentum1' (its only state).
        ("adagrad", ["momentum1"], "sum"),
    ],
)
def test_state_converts_to_fbgemm_names_and_back_sharing_storage(optimizer, names, first):
    module = CowClipEmbeddingBagCollection(_tables(), options=CowClipOptions(optimizer=optimizer))
    module(kjt_from_bags({"f0": [[1, 2], [3]]})).values().sum().backward()
    ours = module.fused_optimizer.state_dict()
    stock = fbgemm_state_dict(ours)
    assert {k: sorted(v) for k, v in stock["state"].items()} == {
        "embedding_bags.t0.weight": [f"t0.{n}" for n in names],
        "embedding_bags.lin.weight": [f"lin.{n}" for n in names],
    }
    moment = stock["state"]["embedding_bags.t0.weight"]["t0.momentum1"]
    assert moment is ours["state"]["embedding_bags.t0.weight"][first]
    assert moment.shape == (10, 4)
    back = cowclip_state_dict(stock, like=ours)
    module.fused_optimizer.load_state_dict(back)
    torch.testing.assert_close(module.fused_optimizer.state_dict(), ours, rtol=0, atol=0)
    if optimizer == "adagrad":
        return
    with pytest.raises(ValueError, match=r"has no 't0.exp_avg_sq'"):
        broken = {"state": {k: dict(v) for k, v in stock["state"].items()}}
        del broken["state"]["embedding_bags.t0.weight"]["t0.exp_avg_sq"]
        cowclip_state_dict(broken, like=ours)


def test_a_combined_optimizers_state_converts_with_its_dense_keys_passed_through():
    """TorchRec's CombinedOptimizer holds the tables' fused optimizer beside a dense one:
    the dense parameters' state (Adam's, like the tables') passes through both ways."""
    module = CowClipEmbeddingBagCollection(_tables(), options=CowClipOptions(optimizer="adam"))
    top = torch.nn.Linear(3, 1)
    module(kjt_from_bags({"f0": [[1, 2], [3]]})).values().sum().backward()
    top(torch.ones(2, 3)).sum().backward()
    dense = KeyedOptimizerWrapper(dict(top.named_parameters(prefix="top")), torch.optim.Adam)
    dense.step()
    combined = CombinedOptimizer([("sparse", module.fused_optimizer), ("dense", dense)])
    ours = combined.state_dict()
    stock = fbgemm_state_dict(ours)
    assert stock["state"]["dense.top.bias"] is ours["state"]["dense.top.bias"]
    assert sorted(stock["state"]["dense.top.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert sorted(stock["state"]["sparse.embedding_bags.t0.weight"]) == [
        "t0.exp_avg_sq",
        "t0.momentum1",
    ]
    back = cowclip_state_dict(stock, like=ours)
    torch.testing.assert_close(back["state"], ours["state"], rtol=0, atol=0)


def test_fbgemm_cowclip_counters_are_named_when_dropped():
    module = CowClipEmbeddingBagCollection(
        _tables(), options=CowClipOptions(optimizer="rowwise_adagrad")
    )
    module(kjt_from_bags({"f0": [[1, 2], [3]]})).values().sum().backward()
    ours = module.fused_optimizer.state_dict()
    stock = fbgemm_state_dict(ours)
    for key, entries in stock["state"].items():
        table = key.split(".")[-2]
        rows = next(iter(entries.values())).shape[0]
        entries[f"{table}.prev_iter"] = torch.zeros(rows)
        entries[f"{table}.row_counter"] = torch.zeros(rows)
    with pytest.warns(UserWarning, match=r"\['lin.prev_iter', 'lin.row_counter', "
                      r"'t0.prev_iter', 't0.row_counter'\] dropped"):  # fmt: skip
        back = cowclip_state_dict(stock, like=ours)
    torch.testing.assert_close(back, ours, rtol=0, atol=0)


# --- on 2 ranks ----------------------------------------------------------------------


def _on_two_ranks(tmp_path_factory, name: str, case: Any) -> Dict[str, Any]:
    """What ``case`` returns on rank 0 of 2 ranks."""
    root = tmp_path_factory.mktemp(name)
    out = str(root / "results.pt")
    run_ranks(case, 2, str(root), out, timeout_s=240)
    return load_result(out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Dict[str, Any]:
    return _on_two_ranks(tmp_path_factory, "native", native.run)


def _assert_equal(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], rtol=0.0):
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    for key, value in expected.items():
        assert not torch.isnan(actual[key]).any(), key
        torch.testing.assert_close(
            actual[key], value, rtol=rtol, atol=rtol and 1e-7, msg=lambda m: f"{key}: {m}"
        )


@pytest.mark.parametrize(
    "way", ["fused_params", "apply_optimizer_in_backward", "cowclip_optimizer_class"]
)
def test_torchrec_config_trains_exactly_like_the_same_options_given_natively(two_ranks, way):
    doors = two_ranks["doors"]
    assert doors[way]["options"] == doors["options"]["options"]
    assert doors[way]["options"]["optimizer"] == "rowwise_adagrad"
    assert doors[way]["options"]["lr"] == 0.5
    _assert_equal(doors[way]["state"], doors["options"]["state"])


def test_in_backward_cowclip_none_makes_a_table_unclipped(two_ranks):
    options = two_ranks["doors"]["unclipped_by_mark"]
    assert options["unclipped_tables"] == ["t1"] and options["cowclip"] == plain(CowClip(1.0, 1e-3))


def test_get_default_sharders_shards_every_module_kind(two_ranks):
    case = two_ranks["default_sharders"]
    assert case["kinds"] == {
        "ebc": "ShardedCowClipEmbeddingBagCollection",
        "cowclip_ebc": "ShardedCowClipEmbeddingBagCollection",
        "ec": "ShardedEmbeddingCollection",
    }
    # The CowClip collection kept its own options and trained.
    assert case["cowclip_options"]["optimizer"] == "sgd" and case["cowclip_options"]["lr"] == 0.1
    assert case["cowclip_updated"] == {"ct0": 2, "ct1": 2}


def test_a_cowclip_collection_without_a_matching_sharder_is_refused_before_allocation(two_ranks):
    case = two_ranks["missing_sharder"]
    for name in ("torchrec_defaults", "ebc_sharder_only"):
        message = case[name]
        assert message is not None and "\n" not in message
        assert "get_default_sharders()" in message and "meta device" in message
        assert case[f"{name}_still_meta"], "its tables were allocated before the error"


def test_a_stock_fbgemm_checkpoint_resumes_with_cowclip_exactly_as_fbgemm_continues(two_ranks):
    case = two_ranks["stock_checkpoints"]
    _assert_equal(case["resumed_by_cowclip_at_2"], case["stock_at_2"])  # loaded exactly
    accumulators = [v for k, v in case["stock_final"].items() if k.endswith("/accumulator")]
    assert len(accumulators) == 3 and all(bool((a > 0).any()) for a in accumulators)
    _assert_equal(case["cowclip_final"], case["stock_final"], rtol=STOCK_RTOL)
    assert case["unconverted_error"] is not None  # the names differ without the conversion
    # and back: a CowClip checkpoint in FBGEMM's layout continues under stock TorchRec
    _assert_equal(case["stock_resumed_final"], case["cowclip_run_final"], rtol=STOCK_RTOL)


def test_unsharded_and_sharded_modules_use_the_same_optimizer_state_keys(two_ranks):
    keys = two_ranks["optimizer_keys"]
    assert keys["sharded"] == keys["unsharded"]
    assert keys["unsharded"]["ebc.embedding_bags.t0.weight"] == ["exp_avg", "exp_avg_sq", "step"]


# --- Helen in TorchRec's pipelines ------------------------------------------------------


@pytest.fixture(scope="module")
def helen_two_ranks(tmp_path_factory) -> Dict[str, Any]:
    return _on_two_ranks(tmp_path_factory, "helen", native.helen_pipeline_case)


@pytest.mark.parametrize("name", ["rowwise", "data_parallel_perturbed"])
def test_helen_through_the_sparse_dist_pipeline_equals_the_manual_two_pass_loop_on_2_ranks(
    helen_two_ranks, name
):
    case = helen_two_ranks[name]
    assert case["pipeline_type"] == "HelenTrainPipelineSparseDist"
    assert case["pipeline_losses"] == case["manual_losses"]
    _assert_equal(case["pipeline"], case["manual"])


def test_helen_through_the_base_pipeline_equals_the_manual_two_pass_loop_on_1_process(tmp_path):
    from torchrec_cowclip.train.start import start_run

    config = tiny_config(tmp_path, TINY_PROCESSES, helen_rho=0.05, out=str(tmp_path / "pipeline"))
    piped = start_run(config.resolve())
    piped.run_dir.release()
    pipeline_type, pipeline_losses = native.pipeline_helen_steps(piped, 4)
    manual = start_run(replace(config, out=str(tmp_path / "manual")).resolve())
    manual.run_dir.release()
    assert pipeline_type == "HelenTrainPipelineBase"
    assert pipeline_losses == native.manual_helen_steps(manual, 4)
    for (key, a), (_, b) in zip(
        piped.runtime.tensors()["model"].items(), manual.runtime.tensors()["model"].items()
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def test_the_pipelines_refuse_a_model_without_helen():
    from torchrec_cowclip.train.helen_pipeline import helen_module

    with pytest.raises(ValueError, match="exactly one embedding collection built with helen"):
        helen_module(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("halflife, counter", [(-1, 3.0), (4, 1 + 2**-0.25 * (1 + 2**-0.25))])
def test_fbgemm_cowclip_counts_the_steps_a_row_appears_in(halflife, counter):
    """docs/torchrec.md, "FBGEMM's COWCLIP": row 1 occurs 3 times in each of 3 batches; its
    row_counter counts 3 steps (cumulative under the default half-life -1, decayed with
    one > 0), and momentum1 holds the unclipped mean g^2 (3^2 per step)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    from fbgemm_gpu.tbe.config.optimizer_config import CounterWeightDecayMode, CowClipDefinition

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.1,
        weight_decay_mode=WeightDecayMode.COWCLIP,
        cowclip_regularization=CowClipDefinition(
            counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE,
            counter_halflife=halflife,
            weight_norm_coefficient=1.0,
            lower_bound=1e-5,
        ),
    )
    for _ in range(3):
        tbe(torch.tensor([1, 1, 1, 2]), torch.tensor([0, 2, 4])).sum().backward()
    momentum1, prev_iter, row_counter = tbe.split_optimizer_states()[0]
    assert momentum1.flatten()[1].item() == pytest.approx(27.0)
    assert prev_iter.flatten()[1].item() == 3.0
    assert row_counter.flatten()[1].item() == pytest.approx(counter, rel=1e-6)


# --- TorchRec's quantization ---------------------------------------------------------


def _quantization_case():
    tables = [bag_config("t0", 8, 20, ["f0"]), bag_config("t1", 4, 10, ["f1"])]
    ours = CowClipEmbeddingBagCollection(tables)
    stock = EmbeddingBagCollection(tables=tables)
    stock.load_state_dict(ours.state_dict())
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 1, 1, 1])
    )
    return ours, stock, kjt


def test_torchrecs_quantize_embeddings_refuses_to_leave_the_collection_in_float32():
    from torchrec.inference.modules import quantize_embeddings

    ours, _, _ = _quantization_case()
    model = torch.nn.Sequential(torch.nn.Identity(), ours)
    with pytest.raises(TypeError, match=r"^quantize_embeddings would leave "
                       r"CowClipEmbeddingBagCollection '1' in float32"):  # fmt: skip
        quantize_embeddings(model, dtype=torch.qint8, inplace=True)
    assert model[1] is ours and not hasattr(ours, "qconfig")
    # A quantization that does not touch embedding collections goes on as before.
    torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, inplace=True)


@pytest.mark.parametrize("how", ["torchrec_cowclip", "torchrec_mapping"])
@pytest.mark.parametrize("dtype", [torch.qint8, torch.half])
def test_the_collection_quantizes_like_a_stock_ebc(how, dtype):
    from torchrec.inference.modules import quantize_embeddings

    import torchrec_cowclip

    ours, stock, kjt = _quantization_case()
    if how == "torchrec_cowclip":
        quantized = torchrec_cowclip.quantize_embeddings(torch.nn.Sequential(ours), dtype)
    else:
        mapping = torchrec_cowclip.quantization_mapping()
        quantized = quantize_embeddings(
            torch.nn.Sequential(ours),
            dtype=dtype,
            inplace=True,
            additional_qconfig_spec_keys=list(mapping),
            additional_mapping=mapping,
        )
    reference = quantize_embeddings(torch.nn.Sequential(stock), dtype=dtype, inplace=True)
    assert type(quantized[0]) is type(reference[0])
    torch.testing.assert_close(
        quantized[0](kjt).values(), reference[0](kjt).values(), rtol=0, atol=0
    )

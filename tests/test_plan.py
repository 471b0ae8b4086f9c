"""Capacity planning before a launch (``torchrec-cowclip plan``, ``torchrec_cowclip.plan``,
``distributed/planning.py``): the optimizer state each rule keeps per row in every storage
type, the planner's shards sized with it, a plan against the sharded run it plans on 2
CPU ranks, the three table sources, fits / does not fit and the smallest world size that
fits, and every refusal in one line."""

from __future__ import annotations

import json
from pathlib import Path

import distributed_cases as cases
import pytest
import torch
from distributed_harness import run_ranks
from tiny import bag_config, tiny_config
from torchrec import DataType
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator

from torchrec_cowclip import CowClipEmbeddingBagCollection
from torchrec_cowclip.cli import main
from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder
from torchrec_cowclip.distributed.planning import CowClipStorageEstimator
from torchrec_cowclip.embedding.table_batch import storage_bytes
from torchrec_cowclip.optim.options import CowClipOptions
from torchrec_cowclip.optim.rules import OPTIMIZERS
from torchrec_cowclip.plan import PRESETS, JobSpec
from torchrec_cowclip.plan.job import JobPlanner
from torchrec_cowclip.train import train

DTYPES = {
    "fp32": (DataType.FP32, torch.float32, 4),
    "fp16": (DataType.FP16, torch.float16, 2),
    "bf16": (DataType.BF16, torch.bfloat16, 2),
}

#: Optimizer-state bytes per table row of ``dim`` columns, by hand: float32 whatever the
#: weights' type (Adam's two moments per weight, row-wise Adagrad one sum per row).
STATE_PER_ROW = {
    "adam": lambda dim: 2 * 4 * dim,
    "rowwise_adagrad": lambda dim: 4,
    "sgd": lambda dim: 0,
    "adagrad": lambda dim: 4 * dim,
    "adamw": lambda dim: 2 * 4 * dim,
}


# --- the state bytes per row: every rule and storage type ------------------------------------


def test_every_registered_rule_has_a_hand_count():
    assert set(OPTIMIZERS) == set(STATE_PER_ROW)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer", list(STATE_PER_ROW))
def test_state_bytes_per_row_are_what_a_table_allocates(optimizer, dtype):
    data_type, torch_dtype, weight_size = DTYPES[dtype]
    rows, dim = 37, 12
    ebc = CowClipEmbeddingBagCollection(
        [bag_config("t", dim, rows, data_type=data_type)],
        options=CowClipOptions(optimizer=optimizer),
    )
    weights, state = storage_bytes(rows, dim, torch_dtype, optimizer)
    assert (weights, state) == (rows * dim * weight_size, rows * STATE_PER_ROW[optimizer](dim))
    assert weights + state == ebc.table_storage_bytes()


def _shard_storage(optimizer: str, data_type: DataType, estimator: type) -> dict:
    """Per sharding type, each shard's (planned DDR bytes, size) of a 1,000 x 256 table
    on 2 CPU ranks (column-wise: 2 shards of 128 columns)."""
    topology = Topology(world_size=2, compute_device="cpu")
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=64, estimator=[estimator(topology=topology)]
    )
    ebc = CowClipEmbeddingBagCollection(
        [bag_config("t", 256, 1000, data_type=data_type)],
        options=CowClipOptions(optimizer=optimizer),
        device="meta",
    )
    sharder = CowClipEmbeddingBagCollectionSharder(module_type=CowClipEmbeddingBagCollection)
    return {
        o.sharding_type: [(s.storage.ddr, tuple(s.size)) for s in o.shards]
        for o in enumerator.enumerate(ebc, [sharder])
    }


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad"])
def test_the_planner_sizes_every_shard_with_the_state_it_will_hold(optimizer, dtype):
    data_type = DTYPES[dtype][0]
    sgd = _shard_storage("sgd", data_type, CowClipStorageEstimator)  # no state
    ours = _shard_storage(optimizer, data_type, CowClipStorageEstimator)
    stock = _shard_storage(optimizer, data_type, EmbeddingStorageEstimator)
    assert len(ours["column_wise"]) == 2 and len(ours["row_wise"]) == 2
    for sharding, shards in ours.items():
        for (planned, (rows, cols)), (without, _), (torchrec, _) in zip(
            shards, sgd[sharding], stock[sharding]
        ):
            # Every column shard keeps its own per-row Adagrad sum.
            assert planned - without == rows * STATE_PER_ROW[optimizer](cols), (sharding, rows)
            if optimizer == "adam" and dtype != "fp32":
                # TorchRec sizes the moments as 2 x the 2-byte weights.
                assert planned - torchrec == 4 * rows * cols, sharding


# --- a plan against the sharded run it plans, on 2 CPU ranks ---------------------------------

#: (model, optimizer, sharding, weights' type, dim, table rows) of the jobs planned and run.
JOBS = [
    # the planner's choice per table (data-parallel and row-wise among them)
    ("deepfm", "adam", "auto", "fp32", 8, [20000, 300, 7, 6000]),
    # column shards of 128 columns, each with its own per-row state; float16 weights
    ("dcn", "rowwise_adagrad", "column_wise", "fp16", 256, [400, 50]),
    ("wdl", "sgd", "row_wise", "bf16", 4, [1001, 77]),
    # float16 weights with float32 moments (TorchRec's own estimate: half of them)
    ("deepfm", "adam", "table_wise", "fp16", 16, [3000, 500, 40]),
]


def _spec(model: str, optimizer: str, sharding: str, dtype: str, dim: int, rows: list) -> JobSpec:
    from torchrec.distributed.planner.constants import DDR_CAP

    return JobSpec(
        model=model,
        model_arguments=dict(
            num_dense=3,
            sparse_names=[f"C{i}" for i in range(len(rows))],
            cardinalities=rows,
            embedding_dim=dim,
            hidden=[8],
            embedding_dtype=dtype,
        ),
        optimizer=optimizer,
        batch_size=64,
        world_size=2,
        local_world_size=2,
        compute_device="cpu",
        hbm_bytes=0,
        ddr_bytes=DDR_CAP,  # what the trainer's planner has on CPU
        sharding=sharding,
    )


def test_the_plan_is_the_sharded_run_it_plans(tmp_path):
    specs = [_spec(*job) for job in JOBS]
    plans = [JobPlanner(spec).plan(spec) for spec in specs]
    out = str(tmp_path / "runs.json")
    run_ranks(cases.planned_job_case, 2, specs, out, timeout_s=150)
    runs = json.loads(Path(out).read_text())
    for job, plan, run in zip(JOBS, plans, runs):
        assert plan.fits, job
        # The trainer's planner made the plan `plan` printed.
        assert {t.name: [t.sharding, t.ranks] for t in plan.tables} == run["plan"], job
        for rank, measured in zip(plan.ranks, run["bytes"]):
            assert abs(rank.bytes - measured) <= 0.10 * measured, (job, rank, measured)
            assert rank.bytes == measured, (job, rank, measured)  # exactly, in fact
    shardings = {t.sharding for plan in plans for t in plan.tables}
    assert {"data_parallel", "table_wise", "row_wise", "column_wise"} <= shardings


# --- the command ---------------------------------------------------------------------------


def _plan(capsys, *argv: str) -> tuple:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


KAGGLE_DLRM = ["--tables", "criteo-kaggle", "--model", "dlrm", "--hidden", "64,16"]


def test_a_job_that_fits_prints_its_plan_and_writes_it_as_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    code, out, err = _plan(
        capsys,
        *KAGGLE_DLRM,
        "--embedding-dim",
        "16",
        "--optimizer",
        "rowwise_adagrad",
        "--world-size",
        "2",
        "--hbm-gb",
        "16",
        "--batch-size",
        "4096",
        "--json",
        str(path),
    )
    assert code == 0, err
    plan = json.loads(path.read_text())
    cards = PRESETS["criteo-kaggle"].schema.cardinalities
    assert plan["fits"] is True and plan["smallest_world_size"] == 2
    assert [(t["name"], t["rows"], t["dim"]) for t in plan["tables"]] == [
        (f"emb_C{i + 1}", c, 16) for i, c in enumerate(cards)
    ]
    assert {r["rank"] for r in plan["ranks"]} == {0, 1}
    copies = {
        t["name"]: len(t["ranks"]) if t["sharding"] == "data_parallel" else 1
        for t in plan["tables"]
    }
    # Row-wise Adagrad: 16 float32 weights and one float32 sum per row.
    assert sum(r["weights_bytes"] for r in plan["ranks"]) == sum(
        c * 16 * 4 * copies[f"emb_C{i + 1}"] for i, c in enumerate(cards)
    )
    assert sum(r["optimizer_bytes"] for r in plan["ranks"]) == sum(
        c * 4 * copies[f"emb_C{i + 1}"] for i, c in enumerate(cards)
    )
    for r in plan["ranks"]:
        assert r["bytes"] == r["weights_bytes"] + r["optimizer_bytes"] <= plan["usable_bytes"]
        assert r["planner_bytes"] >= r["bytes"] and r["perf_ms"]["fwd_compute"] > 0
    for t in plan["tables"]:
        assert t["ranks"] == [s["rank"] for s in t["shards"]]
        assert sum(s["rows"] for s in t["shards"]) == t["rows"] * (
            len(t["ranks"]) if t["sharding"] == "data_parallel" else 1
        ) or t["sharding"] in ("column_wise", "table_column_wise")
    assert plan["launch"]["torchrun"].startswith("torchrun --standalone --nproc_per_node 2 -m ")
    assert "--data criteo:train.txt --model dlrm" in plan["launch"]["torchrun"]
    assert "--embedding-optimizer rowwise_adagrad" in plan["launch"]["torchx"]
    assert plan["launch"]["torchx"].startswith(
        "torchx run -s local_cwd launch/components.py:train -j 1x2 --gpu 2 -- "
    )
    assert "fits: yes, on 2 x 16.00 GiB" in out
    assert "emb_C3   10,131,227   16  " in out  # the table lines: name, rows, dim, ...
    assert plan["launch"]["torchrun"] in out


def test_a_job_that_does_not_fit_exits_3_naming_the_smallest_world_size(tmp_path, capsys):
    args = [*KAGGLE_DLRM, "--embedding-dim", "64", "--hbm-gb", "16", "--batch-size", "4096"]
    code, out, err = _plan(capsys, *args, "--json", str(tmp_path / "no.json"))
    assert code == 3
    plan = json.loads((tmp_path / "no.json").read_text())
    assert plan["fits"] is False and plan["ranks"] == [] and plan["launch"] is None
    smallest = plan["smallest_world_size"]
    assert smallest == 2 and plan["searched_world_sizes"] == [2]
    assert err.strip().splitlines() == [
        "torchrec-cowclip plan: does not fit on 1 x 16.00 GiB: the tables and their state "
        "need 24.15 GiB, 1 x 13.58 GiB usable; the smallest world size that fits is 2 "
        "(--world-size 2 shows its plan)"
    ]
    assert "fits: no; does not fit on 1 x 16.00 GiB" in out
    assert _plan(capsys, *args, "--world-size", str(smallest))[0] == 0
    code, _, err = _plan(capsys, *args, "--world-size", "4", "--sharding", "data_parallel")
    assert code == 3 and err.strip().endswith(
        "--sharding data_parallel puts every table on every device: give auto"
    )


REFUSED = [
    (["--tables", "criteo-kaggle", "--world-size", "0"], "--world-size must be > 0, got 0"),
    (
        ["--tables", "criteo-2tb"],
        "--tables: unknown preset 'criteo-2tb'; known: criteo-kaggle, criteo-1tb",
    ),
    ([], "no tables to plan: give --tables criteo-kaggle|criteo-1tb, --data"),
    (
        ["--tables", "criteo-kaggle", "--data", "synthetic:100"],
        "--tables and --data both name the tables: give one",
    ),
    (
        [
            "--tables",
            "criteo-1tb",
            "--embedding-dim",
            "128",
            "--sharding",
            "table_wise",
            "--hbm-gb",
            "16",
        ],
        "table emb_C1 (45,833,188 rows x 128, fp32 with adam state: 65.56 GiB) is larger than "
        "every device (16.00 GiB) and --sharding table_wise keeps it whole on one",
    ),
    (
        ["--tables", "criteo-kaggle", "--hash-size", "1000"],
        "--hash-size says how --data is read: give --data, or drop --hash-size",
    ),
    (
        ["--tables", "criteo-kaggle", "--world-size", "3"],
        "--batch-size 1024 must be divisible by --world-size 3",
    ),
    (
        ["--tables", "criteo-kaggle", "--compute-device", "tpu"],
        "--compute-device must be cuda or cpu, got 'tpu'",
    ),
    (["--tables", "criteo-kaggle", "--hbm-gb", "0"], "--hbm-gb must be > 0, got 0"),
    (["--tables", "criteo-kaggle", "--hbm-gb", "nan"], "--hbm-gb must be > 0, got nan"),
    (
        ["--tables", "criteo-kaggle", "--world-size", "16", "--nproc-per-node", "6"],
        "--world-size 16 does not fill hosts of --nproc-per-node 6: give a multiple of 6",
    ),
    (["--tables", "criteo-kaggle", "--embedding-dim", "0"], "--embedding-dim must be > 0, got 0"),
    (["--data", "nope:1"], "--data: bad dataset spec 'nope:1'"),
    (["--data", "table:/no/such.csv", "--label", "y", "--sparse", "a"], "/no/such.csv"),
    (["--run", "/no/such/run"], "/no/such/run: not a run folder"),
    (
        ["--tables", "criteo-kaggle", "--embedding-backend", "torchrec"],
        "--embedding-backend torchrec trains on one process without sharding",
    ),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[" ".join(a) or "none" for a, _ in REFUSED])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    code, out, err = _plan(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchrec-cowclip plan: error: "), err
    assert message in lines[0], lines[0]


# --- the tables of a run and of the data it read ---------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("plan-run")
    config = tiny_config(root)
    train(config)
    return root, config


def test_a_run_and_the_data_it_read_plan_the_same_tables(finished_run, tmp_path, capsys):
    root, config = finished_run
    job = ["--world-size", "2", "--compute-device", "cpu", "--batch-size", "256"]
    code, _, err = _plan(
        capsys, "--run", str(root / "run"), *job, "--json", str(tmp_path / "r.json")
    )
    assert code == 0, err
    data = [
        "--data", config.data, "--synthetic-scale", str(config.synthetic_scale),
        "--synthetic-max-cardinality", str(config.synthetic_max_cardinality),
        "--cache-dir", config.cache_dir, "--embedding-dim", str(config.embedding_dim),
        "--hidden", ",".join(map(str, config.hidden)),
    ]  # fmt: skip
    code, _, err = _plan(capsys, *data, *job, "--json", str(tmp_path / "d.json"))
    assert code == 0, err
    from_run, from_data = (json.loads((tmp_path / n).read_text()) for n in ("r.json", "d.json"))
    assert from_run["tables"] and from_run["tables"] == from_data["tables"]
    assert from_run["ranks"] == from_data["ranks"]
    assert from_run["embedding_dim"] == 4 and from_run["model"] == "deepfm"
    assert "--hidden 8,8" in from_run["launch"]["torchrun"]
    # A flag given overrides the run's setting.
    code, _, err = _plan(
        capsys,
        "--run",
        str(root / "run"),
        *job,
        "--embedding-dim",
        "8",
        "--json",
        str(tmp_path / "8.json"),
    )
    assert code == 0, err
    wider = json.loads((tmp_path / "8.json").read_text())
    assert {t["dim"] for t in wider["tables"] if t["name"].startswith("emb_")} == {8}
    assert [t["rows"] for t in wider["tables"]] == [t["rows"] for t in from_run["tables"]]


def test_sharding_constraints_reach_the_planner_and_its_stats_show(capsys, tmp_path):
    code, _, err = _plan(
        capsys, *KAGGLE_DLRM, "--embedding-dim", "16", "--world-size", "2", "--hbm-gb", "16",
        "--sharding", "row_wise", "--json", str(tmp_path / "rw.json"), "--planner-stats",
    )  # fmt: skip
    assert code == 0, err
    assert err.count("--- Planner Statistics ---") == 1  # TorchRec's own table
    plan = json.loads((tmp_path / "rw.json").read_text())
    assert {t["sharding"] for t in plan["tables"]} == {"row_wise"}
    assert "--sharding row_wise" in plan["launch"]["torchrun"]


def test_the_readme_plan_command_prints_what_the_readme_says(capsys):
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("**Plan before you launch.**") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    command = shlex.split(block.group(1).replace("\\\n", " "))
    assert command[:2] == [".venv/bin/torchrec-cowclip", "plan"]
    code, out, err = _plan(capsys, *command[2:])
    assert code == 0, err
    assert "fits: yes, on 8 x 80.00 GiB" in out and "fits: yes, on 8 x 80.00 GiB" in section
    assert "largest rank: 0, 66.01 GiB of tables and state" in out and "66.01 GiB" in section
    code, out, _ = _plan(capsys, *command[2:], "--embedding-optimizer", "rowwise_adagrad")
    assert code == 0 and "largest rank: 0, 24.98 GiB" in out and "rowwise_adagrad` 24.98" in section

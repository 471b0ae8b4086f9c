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
from torchrec_cowclip.plan.job import JobPlanner, format_bytes
from torchrec_cowclip.train import train

REPO = Path(__file__).resolve().parents[1]
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
    # train's option, checked as train checks it: before the devices' memory and the split
    (
        ["--tables", "criteo-kaggle", "--batch-size", "0", "--hbm-gb", "0"],
        "--batch-size must be > 0, got 0",
    ),
    (
        ["--tables", "criteo-kaggle", "--batch-size", "-4", "--world-size", "2"],
        "--batch-size must be > 0, got -4",
    ),
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
    assert err.count("planner statistics (TorchRec's estimates") == 1
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
    # Criteo 1TB with Adam fits 8 x 80 GiB, but rank 0 leaves less than the headroom.
    tight = "fits, tight: on 8 x 80.00 GiB, but rank 0 leaves 1.75 GiB of its 67.96 GiB usable"
    assert tight in out and tight in " ".join(section.split())
    assert "largest rank: 0, 66.01 GiB of tables and state" in out and "66.01 GiB" in section
    code, out, _ = _plan(capsys, *command[2:], "--embedding-optimizer", "rowwise_adagrad")
    assert code == 0 and "largest rank: 0, 24.98 GiB" in out and "rowwise_adagrad` 24.98" in section
    assert "fits: yes, on 8 x 80.00 GiB; every rank leaves at least" in out


# --- your own tables: a file or a list from Python; constraints; headroom --------------------

#: Three tables as a user writes them: one row-wise by its own constraint, one fp16 with a
#: pooling factor, one left to the planner.
OWN_TABLES = [
    {"name": "user", "rows": 3_000_001, "dim": 64, "sharding": "row_wise"},
    {"name": "item", "rows": 250_007, "dim": 32, "dtype": "fp16", "pooling_factor": 12.5},
    {"name": "site", "rows": 97, "dim": 16},
]
OWN_JOB = ["--world-size", "2", "--hbm-gb", "4", "--batch-size", "4096"]


def _table_file(tmp_path: Path, suffix: str, tables=OWN_TABLES) -> Path:
    path = tmp_path / f"tables{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"tables": tables}))
    elif suffix == ".yaml":
        path.write_text("".join(
            "- " + "\n  ".join(f"{k}: {v}" for k, v in t.items()) + "\n" for t in tables
        ))  # fmt: skip
    else:
        fields = ["name", "rows", "dim", "dtype", "pooling_factor", "sharding"]
        lines = [",".join(fields)] + [",".join(str(t.get(f, "")) for f in fields) for t in tables]
        path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".csv"])
def test_a_table_file_is_planned_with_its_rows_as_written(suffix, tmp_path, capsys):
    path = _table_file(tmp_path, suffix)
    out_json = tmp_path / "plan.json"
    code, out, err = _plan(capsys, "--tables", str(path), *OWN_JOB, "--json", str(out_json))
    assert code == 0, err
    plan = json.loads(out_json.read_text())
    tables = {t["name"]: t for t in plan["tables"]}
    # Exactly the rows written (a data file's vocabulary adds 2; a table file adds none).
    assert [(t["name"], t["rows"], t["dim"]) for t in plan["tables"]] == [
        (t["name"], t["rows"], t["dim"]) for t in OWN_TABLES
    ]
    assert tables["user"]["sharding"] == "row_wise" and tables["user"]["ranks"] == [0, 1]
    assert sum(s["rows"] for s in tables["user"]["shards"]) == 3_000_001
    assert plan["constraints"] == {"user": "row_wise"}
    # fp16 weights, float32 Adam moments; float32 for the others.
    assert tables["item"]["dtype"] == "float16"
    assert tables["item"]["weights_bytes"] == 250_007 * 32 * 2
    assert tables["item"]["optimizer_bytes"] == 250_007 * 32 * 8
    assert tables["site"]["weights_bytes"] == 97 * 16 * 4
    assert plan["model"] == "tables" and plan["launch"] is None
    assert "plan: 3 tables of dim 16-64, fp16/fp32 weights, adam state" in out
    assert f"tables from {path} (3 tables, 3,250,105 rows)" in out
    assert "launch: your own training script" in out


def test_a_pooling_factor_reaches_the_planner(tmp_path, capsys):
    """The planner's step estimate of a table grows with the mean ids per bag written."""
    steps = []
    for factor in (1.0, 40.0):
        tables = [{"name": "t", "rows": 100_000, "dim": 64, "pooling_factor": factor}]
        path = _table_file(tmp_path, ".json", tables)
        code, _, err = _plan(capsys, "--tables", str(path), *OWN_JOB, "--json", str(path) + ".out")
        assert code == 0, err
        plan = json.loads(Path(str(path) + ".out").read_text())
        steps.append(plan["planner"]["max_rank_step_ms"])
    assert steps[1] > 5 * steps[0], steps


def test_a_table_list_from_python_plans_as_its_file(tmp_path, capsys):
    from torchrec_cowclip.plan import TableSpec, plan_job, read_table_file

    path = _table_file(tmp_path, ".csv")
    code, _, err = _plan(capsys, "--tables", str(path), *OWN_JOB, "--json", str(tmp_path / "f"))
    assert code == 0, err
    from_file = json.loads((tmp_path / "f").read_text())
    listed = [TableSpec(**t) for t in OWN_TABLES]
    assert read_table_file(path) == listed
    # As a spreadsheet saves it: a byte-order mark before the header.
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert read_table_file(path) == listed
    spec = JobSpec.of_tables(listed, optimizer="adam", batch_size=4096, world_size=2,
                             local_world_size=2, compute_device="cuda", hbm_bytes=4 << 30,
                             ddr_bytes=0)  # fmt: skip
    plan = plan_job(spec, per_host=8).to_json()
    assert plan["tables"] == from_file["tables"] and plan["ranks"] == from_file["ranks"]
    # A TorchRec user's own EmbeddingBagConfigs give the same tables.
    configs = [t.config() for t in listed]
    assert [TableSpec.from_config(c, t.sharding) for c, t in zip(configs, listed)] == [
        TableSpec(t.name, t.rows, t.dim, t.dtype, None, t.sharding) for t in listed
    ]


def test_constrain_makes_a_mixed_plan(tmp_path, capsys):
    """One table row-wise, the rest table-wise: a plan the single --sharding cannot ask."""
    path = tmp_path / "mixed.json"
    code, out, err = _plan(
        capsys, *KAGGLE_DLRM, "--embedding-dim", "16", "--world-size", "2", "--hbm-gb", "16",
        "--sharding", "table_wise", "--constrain", "emb_C3=row_wise",
        "--constrain", "emb_C4=column_wise", "--json", str(path),
    )  # fmt: skip
    assert code == 0, err
    plan = json.loads(path.read_text())
    shardings = {t["name"]: t["sharding"] for t in plan["tables"]}
    assert shardings.pop("emb_C3") == "row_wise" and shardings.pop("emb_C4") == "column_wise"
    assert set(shardings.values()) == {"table_wise"}
    assert plan["constraints"]["emb_C3"] == "row_wise" and len(plan["constraints"]) == 26
    # train takes one --sharding: the plan prints no train command it would not make.
    assert plan["launch"] is None and "torchrun" not in out
    assert (
        "constrained: table_wise emb_C1, emb_C2, emb_C5, emb_C6 and 20 more; row_wise emb_C3; column_wise emb_C4"
        in out
    )


def _tight_tables(tmp_path: Path) -> Path:
    # 2 x 4 GiB devices: 3.40 GiB usable each; 3.2 GiB of a row-wise Adam table on each
    # (64 float32 weights and 128 moments per row).
    rows = int(2 * 3.2 * (1 << 30)) // (3 * 4 * 64)
    return _table_file(tmp_path, ".json", [{"name": "big", "rows": rows, "dim": 64}])


def test_a_rank_under_the_headroom_fits_tight_naming_its_free_bytes(tmp_path, capsys):
    path, out_json = _tight_tables(tmp_path), tmp_path / "tight.json"
    job = [*OWN_JOB, "--constrain", "big=row_wise"]
    code, out, err = _plan(capsys, "--tables", str(path), *job, "--json", str(out_json))
    assert code == 0, err  # still fits: exit 0
    plan = json.loads(out_json.read_text())
    usable = plan["usable_bytes"]
    assert plan["headroom"] == 0.10 and plan["headroom_bytes"] == int(0.10 * usable)
    free = {r["rank"]: usable - r["planner_bytes"] for r in plan["ranks"]}
    assert all(0 < f < plan["headroom_bytes"] for f in free.values()), free
    assert plan["tight"] is True
    assert plan["tight_ranks"] == [
        {"rank": r, "free_bytes": free[r]} for r in sorted(free, key=lambda r: (free[r], r))
    ]
    fullest = plan["tight_ranks"][0]
    line = next(line for line in out.splitlines() if line.startswith("fits"))
    assert line.startswith(
        f"fits, tight: on 2 x 4.00 GiB, but rank {fullest['rank']} (and rank "
    ), line
    assert (
        f"leaves {format_bytes(fullest['free_bytes'])} of its {format_bytes(usable)} usable" in line
    )
    assert f"under the headroom of {format_bytes(plan['headroom_bytes'])} (10% of usable)" in line
    # A smaller headroom accepts the same plan as it is.
    code, out, _ = _plan(capsys, "--tables", str(path), *job, "--headroom", "0.01")
    assert code == 0 and "fits: yes, on 2 x 4.00 GiB; every rank leaves at least" in out
    # And a plan that does not fit still exits 3.
    code, _, _ = _plan(capsys, "--tables", str(path), *job[:-2], "--world-size", "1")
    assert code == 3


def test_planner_stats_read_in_units_that_fit_the_size(tmp_path, capsys):
    path = _table_file(tmp_path, ".json", [{"name": "tiny", "rows": 50, "dim": 8}])
    code, _, err = _plan(capsys, "--tables", str(path), *OWN_JOB, "--planner-stats")
    assert code == 0, err
    stats = err[err.index("planner statistics") :]
    assert " GB" not in stats and "0.0 " not in stats.replace("0.00", "")
    rank0 = next(line.split() for line in stats.splitlines() if line.strip().startswith("0 "))
    # rank, storage (value, unit), of device, of usable, free (value, unit), ...
    assert rank0[2] in ("B", "KiB") and rank0[3] == "<0.01%" and rank0[6] == "GiB"
    shard = next(line.split() for line in stats.splitlines() if line.strip().startswith("tiny"))
    assert shard[1] in ("table_wise", "data_parallel") and shard[4:6] == ["50", "8"], shard


def test_a_data_file_s_tables_say_where_their_two_extra_rows_come_from(tmp_path, capsys):
    """A vocabulary's table has a row per distinct value and two more (ids 0 and 1: out of
    vocabulary, missing); the plan says so next to the sizes."""
    data = REPO / "tests" / "data" / "clicks_sample.csv"
    code, out, err = _plan(
        capsys, "--data", f"table:{data}", "--label", "click", "--sparse", "device",
        "--dense", "age", "--cache-dir", str(tmp_path / "c"), "--world-size", "2",
        "--compute-device", "cpu", "--batch-size", "256", "--json", str(tmp_path / "d.json"),
    )  # fmt: skip
    assert code == 0, err
    distinct = {line.split(",")[5] for line in data.read_text().splitlines()[1:]}
    rows = {t["name"]: t["rows"] for t in json.loads((tmp_path / "d.json").read_text())["tables"]}
    assert rows["emb_device"] == len(distinct) + 2
    assert "each table: its distinct values + 2 rows, ids 0 out of vocabulary and 1 missing" in out


TABLE_REFUSALS = [
    ('[{"name": "a", "rows": 0, "dim": 4}]', "tables.json, table 1: rows must be an integer >= 1, got 0"),
    ('[{"name": "a", "rows": 10}]', "tables.json, table 1: no dim (name, rows and dim are needed)"),
    ('[{"name": "a", "rows": 10, "dim": 4, "shards": 2}]', "tables.json, table 1: unknown field 'shards'"),
    ('[{"name": "a", "rows": 10, "dim": 4, "dtype": "int8"}]', "dtype must be one of fp32, fp16, bf16, got 'int8'"),
    ('[{"name": "a", "rows": 10, "dim": 4, "sharding": "grid"}]', "table 1: sharding must be one of data_parallel"),
    ('[{"name": "a", "rows": 10, "dim": 4, "pooling_factor": -1}]', "pooling_factor must be > 0, got -1"),
    ('[{"name": "a", "rows": 10.5, "dim": 4}]', "rows must be an integer >= 1, got 10.5"),
    ('[{"name": "a", "rows": 1, "dim": 4}, {"name": "a", "rows": 1, "dim": 4}]', "two tables named 'a'"),
    ("[]", "tables.json: no tables"),
    ('{"name": "a"}', 'a list of tables (or an object with one key, "tables") is needed'),
    ("[{", "tables.json: refused: not JSON ("),
]  # fmt: skip


@pytest.mark.parametrize("text, message", TABLE_REFUSALS, ids=[m[:30] for _, m in TABLE_REFUSALS])
def test_a_bad_table_file_is_refused_in_one_line(text, message, tmp_path, capsys):
    (tmp_path / "tables.json").write_text(text)
    code, out, err = _plan(capsys, "--tables", str(tmp_path / "tables.json"))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_table_files_and_constraints_refused_in_one_line(tmp_path, capsys):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("name,rows,dim\na,10,4\nb,x,4\n")
    good = _table_file(tmp_path, ".csv")
    yaml_path = tmp_path / "t.yaml"
    yaml_path.write_text("- name: a\n  rows: [1\n")
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "t.csv")
    cases = [
        (["--tables", str(csv_path)], "t.csv, line 3: rows must be an integer >= 1, got 'x'"),
        (["--tables", str(yaml_path)], "t.yaml: not YAML ("),
        (["--tables", str(link)], "link.json: refused: a symbolic link"),
        (["--tables", str(tmp_path / "none.json")], "none.json: unreadable (No such file"),
        (["--tables", str(good), "--model", "dlrm"], "--model says how train builds its model"),
        (["--tables", "criteo-kaggle", "--constrain", "emb_C1"], "--constrain must be TABLE=SHARDING"),
        (["--tables", "criteo-kaggle", "--constrain", "emb_C1=grid"], "--constrain emb_C1=grid: the sharding must be one of"),
        (["--tables", "criteo-kaggle", "--constrain", "C1=row_wise"], "--constrain C1: no such table; the tables: emb_C1, emb_C2"),
        (["--tables", "criteo-kaggle", "--headroom", "1"], "--headroom must be in [0, 1), got 1"),
        (
            ["--tables", "criteo-1tb", "--embedding-dim", "128", "--hbm-gb", "16", "--constrain", "emb_C1=table_wise"],
            "table emb_C1 (45,833,188 rows x 128, fp32 with adam state: 65.56 GiB) is larger than every device (16.00 GiB) and its constraint table_wise keeps it whole",
        ),
    ]  # fmt: skip
    for argv, message in cases:
        code, out, err = _plan(capsys, *argv)
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1, (argv, err)
        assert message in lines[0], (argv, lines[0])

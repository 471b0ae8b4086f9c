"""One checkpoint format for one process and for N: exact resume under every sharding
type, N -> M resume, and a rank killed in the middle of writing a checkpoint.

Each job runs the real :func:`~torchrec_cowclip.train.start.start_run`'s loop in spawned gloo ranks (``trainer_cases``), with
the environment ``torchrun`` would give it.
"""

from __future__ import annotations

import pytest
import torch
import trainer_cases as cases
from distributed_harness import JobFailed, load_result, run_ranks
from tiny import TINY_PROCESSES, tiny_config
from torch.distributed.checkpoint import state_dict_loader

from torchrec_cowclip.models.task import CTRTrainTask
from torchrec_cowclip.run.checkpoints import CheckpointStore
from torchrec_cowclip.run.model_folder import RunFolder
from torchrec_cowclip.run.resume_guard import ResumeRefused
from torchrec_cowclip.run.safe_load import SafeFileSystemReader, SafeLoadPlanner
from torchrec_cowclip.train.start import start_run

SHARDINGS = ("table_wise", "column_wise", "row_wise", "data_parallel")
#: Helen runs: the second pass under DDP's no_sync (dense keeps the first gradient), and
#: with the dense parameters perturbed (their second gradient is all-reduced).
HELEN_RUNS = {
    "row_wise": {"helen_rho": 0.05},
    "data_parallel": {"helen_rho": 0.05, "helen_perturb_dense": True},
}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Per sharding type, an uninterrupted 2-process run and one stopped mid-epoch 1 and
    resumed (two jobs in all)."""
    root = tmp_path_factory.mktemp("two_process")
    runs = {s: {"sharding": s} for s in SHARDINGS}
    runs.update({f"helen-{s}": {"sharding": s, **o} for s, o in HELEN_RUNS.items()})
    full = [(str(root / f"full-{name}"), o) for name, o in runs.items()]
    part = [(str(root / f"part-{name}"), {**o, "max_steps": 4}) for name, o in runs.items()]
    resumed = [(str(root / f"part-{name}"), {**o, "resume": True}) for name, o in runs.items()]
    run_ranks(cases.train_phases, 2, full, timeout_s=300)
    run_ranks(cases.train_phases, 2, part + resumed, timeout_s=400)
    return root


def test_one_process_resume_is_exact(tmp_path):
    full = start_run(tiny_config(str(tmp_path / "full"), TINY_PROCESSES).resolve()).run()
    start_run(tiny_config(str(tmp_path / "part"), TINY_PROCESSES, max_steps=5).resolve()).run()
    start_run(tiny_config(str(tmp_path / "part"), TINY_PROCESSES, resume=True).resolve()).run()
    resumed = cases.exact_metrics(str(tmp_path / "part" / "run"))
    assert resumed == {k: full[k] for k in cases.EXACT}
    assert full["best_epoch"] is not None and len(full["epoch_auc"]) == 2


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_two_process_resume_is_exact(two_process_runs, sharding):
    resumed = cases.exact_metrics(str(two_process_runs / f"part-{sharding}" / "run"))
    assert resumed == cases.exact_metrics(str(two_process_runs / f"full-{sharding}" / "run"))
    assert resumed["steps"] > 4 and resumed["rows_updated"] > 0


@pytest.mark.parametrize("sharding", list(HELEN_RUNS))
def test_two_process_helen_resume_is_exact(two_process_runs, sharding):
    resumed = cases.exact_metrics(str(two_process_runs / f"part-helen-{sharding}" / "run"))
    full = cases.exact_metrics(str(two_process_runs / f"full-helen-{sharding}" / "run"))
    assert resumed == full
    plain = cases.exact_metrics(str(two_process_runs / f"full-{sharding}" / "run"))
    assert full["epoch_logloss"] != plain["epoch_logloss"]  # Helen changed the training


def test_one_process_helen_resume_is_exact_and_reports_its_cost(tmp_path):
    helen = {"helen_rho": 0.05, "helen_bound": 0.5}
    full = start_run(tiny_config(str(tmp_path / "full"), TINY_PROCESSES, **helen).resolve()).run()
    start_run(
        tiny_config(str(tmp_path / "part"), TINY_PROCESSES, max_steps=5, **helen).resolve()
    ).run()
    with pytest.raises(
        ResumeRefused, match=r"trained with --helen-bound 0.5, this command has 0.3"
    ):
        start_run(
            tiny_config(
                str(tmp_path / "part"), TINY_PROCESSES, resume=True, helen_rho=0.05
            ).resolve()
        ).run()
    start_run(
        tiny_config(str(tmp_path / "part"), TINY_PROCESSES, resume=True, **helen).resolve()
    ).run()
    resumed = cases.exact_metrics(str(tmp_path / "part" / "run"))
    assert resumed == {k: full[k] for k in cases.EXACT}
    cost = full["helen"]
    assert (cost["rho"], cost["bound"], cost["perturb_dense"]) == (0.05, 0.5, False)
    assert cost["extra_s_per_step"] > 0 and cost["first_pass_s_per_step"] > 0
    assert cost["extra_fraction"] == pytest.approx(
        cost["extra_s_per_step"] / cost["first_pass_s_per_step"]
    )


@pytest.mark.parametrize("first,second", [(1, 2), (2, 1), (2, 3)])
def test_checkpoint_of_n_processes_resumes_on_m(tmp_path, first, second):
    root = str(tmp_path)
    opts = {"max_steps": 5, "sharding": "row_wise" if first > 1 else "auto"}
    if first == 1:
        start_run(tiny_config(root, TINY_PROCESSES, **opts).resolve()).run()
    else:
        run_ranks(cases.train_phases, first, [(root, opts)], timeout_s=240)
    reference = cases.local_restored_state(root, {})
    if second == 1:
        restored = reference
    else:
        out = str(tmp_path / "restored.pt")
        run_ranks(
            cases.restored_state, second, root, {"sharding": "table_wise"}, out, timeout_s=240
        )
        restored = load_result(out)
    assert restored["progress"]["global_step"] == 5
    assert set(restored["tensors"]) == set(reference["tensors"])
    for key, value in reference["tensors"].items():
        assert torch.equal(restored["tensors"][key], value), key
    assert {k: v.tolist() for k, v in restored["counters"].items()} == {
        k: v.tolist() for k, v in reference["counters"].items()
    }
    assert sum(int(v[3]) for v in reference["counters"].values()) > 0  # rows were updated
    # Training went on from there at the new world size.
    if second == 1:
        start_run(tiny_config(root, TINY_PROCESSES, resume=True).resolve()).run()
    assert cases.exact_metrics(root + "/run")["steps"] > 5


def test_rank_killed_while_writing_a_checkpoint_resumes_exactly(tmp_path):
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    opts = {"sharding": "column_wise", "checkpoint_every": 4}
    run_ranks(cases.train_phases, 2, [(full, opts)], timeout_s=240)
    with pytest.raises(JobFailed):  # rank 1 died; rank 0 fails at the checkpoint's barrier
        run_ranks(cases.die_in_second_checkpoint, 2, killed, opts, timeout_s=240, pg_timeout_s=15)
    run_ranks(cases.train_phases, 2, [(killed, {**opts, "resume": True})], timeout_s=240)
    assert cases.exact_metrics(killed + "/run") == cases.exact_metrics(full + "/run")
    leftovers = sorted(p.name for p in (tmp_path / "killed" / "run" / "checkpoints").iterdir())
    # The killed write's directory is gone: pointers and the last two complete
    # checkpoints of each name (--keep-checkpoints 2), no temp files.
    assert [n.split("-")[0] for n in leftovers] == ["best"] * 3 + ["latest"] * 3, leftovers
    store = CheckpointStore(tmp_path / "killed" / "run" / "checkpoints")
    assert store.unfinished() == [] and len(store.complete()) == 4


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise"])
def test_a_run_folder_written_by_two_processes_loads_on_one(two_process_runs, sharding):
    run = RunFolder.open(two_process_runs / f"full-{sharding}" / "run")
    assert sorted(run.weights) == ["best", "final"] and run.reported == "best"
    store = CheckpointStore(run.path / "checkpoints")
    for weights, checkpoint in (("best", store.newest("best")), ("final", store.newest("latest"))):
        model = run.build_model(weights)
        task = CTRTrainTask(model).state_dict()
        expected = {"model": {k: torch.zeros_like(v) for k, v in task.items()}}
        # The checkpoint of the same step, written by the same ranks: its model part.
        state_dict_loader.load(
            expected,
            storage_reader=SafeFileSystemReader(str(checkpoint.path)),
            planner=SafeLoadPlanner(allow_partial_load=True),
        )
        for key, value in model.state_dict().items():
            assert torch.equal(expected["model"][f"model.{key}"], value), (weights, key)

"""The launch a process is part of is read from torchrun's variables in one module,
once per command, and handed down (:mod:`torchrec_cowclip.process_context`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.process_context import ProcessContext
from torchrec_cowclip.run.out_dir import new_run_dir
from torchrec_cowclip.train.config import TrainConfig

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "torchrec_cowclip"


def test_one_module_reads_the_launch_variables():
    readers = sorted(
        str(path.relative_to(PACKAGE_DIR))
        for path in PACKAGE_DIR.rglob("*.py")
        if re.search(
            r"environ(\.get)?[\[(]\s*\"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|"
            r"TORCHELASTIC_RUN_ID|TORCHELASTIC_RESTART_COUNT)\"",
            path.read_text(),
        )
        or re.search(r"env\.get\(\"(RANK|WORLD_SIZE)\"", path.read_text())
    )
    assert readers == ["process_context.py"]


def test_the_context_of_a_torchrun_process():
    ctx = ProcessContext.from_environment(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "job7",
            "TORCHELASTIC_RESTART_COUNT": "1",
        }
    )
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (3, 8, 1, 2)
    assert (ctx.is_main, ctx.is_distributed, ctx.nodes, ctx.run_id) == (False, True, 4, "job7")
    # torchrun without LOCAL_WORLD_SIZE (or 0): every process on one machine.
    assert ProcessContext.from_environment({"WORLD_SIZE": "4"}).nodes == 1
    assert ProcessContext.from_environment({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "0"}).nodes == 1


def test_the_settings_carry_the_context_they_were_checked_against(tmp_path):
    two = ProcessContext(rank=1, world_size=2, local_rank=1, local_world_size=2)
    settings = TrainConfig(data="synthetic:1000", batch_size=8, out=str(tmp_path)).resolve(two)
    assert settings.process is two and not settings.process.is_main
    with pytest.raises(Exception, match="divisible by the number of processes \\(2\\)"):
        TrainConfig(data="synthetic:1000", batch_size=7, out=str(tmp_path)).resolve(two)
    TrainConfig(data="synthetic:1000", batch_size=7, out=str(tmp_path)).resolve(ProcessContext())


def test_a_torchrun_job_without_out_is_named_by_its_run_id(tmp_path):
    job = ProcessContext(world_size=2, local_world_size=2, run_id="abc")
    assert new_run_dir(tmp_path, job) == tmp_path / "torchrun-abc"


def test_a_launch_variable_that_is_no_number_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"the environment variable LOCAL_RANK='1x' is not a"):
        ProcessContext.from_environment({"WORLD_SIZE": "2", "LOCAL_RANK": "1x"})

"""What ``torchrec-cowclip plan`` prints: the plan per table and per rank, whether it fits,
the planner's estimates, and the commands that launch the job it planned.

Example::

    >>> rank_ranges([0, 1, 2, 3, 5, 7, 8])
    '0-3,5,7-8'
    >>> print(launch_commands(world_size=16, per_host=8, gpus=True,
    ...                       train_args=["--model", "dlrm", "--out", "runs/x"])["torchrun"])
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD_NODE:29500 --rdzv_id x -m torchrec_cowclip train --model dlrm --out runs/x
"""

from __future__ import annotations

import shlex
from typing import Dict, List, Sequence

from torchrec_cowclip.plan.job import JobPlan, TablePlan, format_bytes

__all__ = ["does_not_fit", "format_plan", "launch_commands", "rank_ranges"]


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (in the order given; runs of consecutive ranks)."""
    parts: List[str] = []
    start = prev = None
    for r in list(ranks) + [None]:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    return ",".join(parts)


def _table(rows: List[List[str]], right: Sequence[int] = ()) -> List[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def launch_commands(
    world_size: int, per_host: int, gpus: bool, train_args: Sequence[str]
) -> Dict[str, str]:
    """The commands that start ``torchrec-cowclip train train_args`` on ``world_size``
    processes, ``per_host`` per host: ``torchrun`` (run on every host; one process needs
    none) and this project's torchx component (``launch/components.py``)."""
    train = " ".join(shlex.quote(a) for a in train_args)
    hosts = max(world_size // per_host, 1) if world_size > per_host else 1
    local = min(world_size, per_host)
    args = list(train_args)
    # The rendezvous id names the job: its run directory's name.
    job = args[args.index("--out") + 1].rstrip("/").rsplit("/", 1)[-1] if "--out" in args else "job"
    if world_size == 1:
        torchrun = f"torchrec-cowclip train {train}"
    elif hosts == 1:
        torchrun = (
            f"torchrun --standalone --nproc_per_node {local} -m torchrec_cowclip train {train}"
        )
    else:
        torchrun = (
            f"torchrun --nnodes {hosts} --nproc_per_node {local} --rdzv_backend c10d "
            f"--rdzv_endpoint $HEAD_NODE:29500 --rdzv_id {job} -m torchrec_cowclip train {train}"
        )
    scheduler = "local_cwd" if hosts == 1 else "slurm"
    gpu = f" --gpu {local}" if gpus else ""
    torchx = (
        f"torchx run -s {scheduler} launch/components.py:train -j {hosts}x{local}{gpu} -- {train}"
    )
    return {"torchrun": torchrun, "torchx": torchx}


def _table_rows(tables: Sequence[TablePlan], optimizer: str) -> List[List[str]]:
    rows = [["table", "rows", "dim", "sharding", "ranks", "weights", f"{optimizer} state"]]
    for t in tables:
        rows.append(
            [
                t.name,
                f"{t.rows:,}",
                str(t.dim),
                t.sharding,
                rank_ranges(t.ranks),
                format_bytes(t.weights_bytes),
                format_bytes(t.optimizer_bytes),
            ]
        )
    return rows


def format_plan(plan: JobPlan, tables_from: str, launch: Dict[str, str]) -> str:
    """The plan as ``plan`` prints it; ``tables_from`` says where the table sizes came
    from, ``launch`` holds the launch commands (:func:`launch_commands`)."""
    spec = plan.spec
    where = "HBM" if spec.compute_device == "cuda" else "DDR"
    dim = spec.model_arguments.get("embedding_dim")
    lines = [
        f"plan: {spec.model} at dim {dim}, {spec.embedding_dtype} weights, {spec.optimizer} "
        f"state; tables from {tables_from}",
        f"job: {spec.world_size} x {spec.compute_device} ({spec.local_world_size} per host) "
        f"of {format_bytes(spec.device_bytes)} {where}, batch {spec.batch_size:,} "
        f"({spec.batch_size // spec.world_size:,} per rank), sharding {spec.sharding}",
        f"tables and optimizer state: {format_bytes(plan.table_bytes)} (one copy of each); "
        f"largest table {plan.largest_table[0]}: {format_bytes(plan.largest_table[1])}",
    ]
    usable = plan.usable_bytes
    if usable is not None:
        lines.append(
            f"usable per device: {format_bytes(usable)} ({format_bytes(spec.device_bytes)} "
            f"less {format_bytes(spec.device_bytes - usable)} TorchRec reserves: "
            + ("15% of HBM, " if spec.compute_device == "cuda" else "")
            + "6x the dense parameters, 20 batches of input ids)"
        )
    if plan.fits:
        lines += ["", *_table(_table_rows(plan.tables, spec.optimizer), right=(1, 2, 5, 6))]
        ranks = [["rank", "weights", f"{spec.optimizer} state", "total", "planner", "step ms"]]
        for r in plan.ranks:
            ranks.append(
                [
                    str(r.rank),
                    format_bytes(r.weights_bytes),
                    format_bytes(r.optimizer_bytes),
                    format_bytes(r.bytes),
                    format_bytes(r.planner_bytes),
                    f"{r.step_ms:.3f}",
                ]
            )
        lines += ["", *_table(ranks, right=(0, 1, 2, 3, 4, 5))]
        largest = plan.largest_rank
        assert largest is not None
        slowest = max(plan.ranks, key=lambda r: r.step_ms)
        perf = slowest.perf_ms
        lines += [
            "",
            "(planner: TorchRec's estimate of the rank's storage, its input and output "
            "buffers included; step ms: its estimate of the embedding forward and backward)",
            f"largest rank: {largest.rank}, {format_bytes(largest.bytes)} of tables and state"
            + ("" if usable is None else f" of {format_bytes(usable)} usable")
            + f" ({largest.bytes / spec.device_bytes:.0%} of the device)",
            f"planner: {plan.proposals} proposals, {plan.plans} plans, {plan.run_time_s:.1f} s; "
            f"slowest rank {slowest.rank}: {slowest.step_ms:.3f} ms per step (forward compute "
            f"{perf['fwd_compute']:.3f}, forward comms {perf['fwd_comms']:.3f}, backward "
            f"compute {perf['bwd_compute']:.3f}, backward comms {perf['bwd_comms']:.3f})",
            f"fits: yes, on {spec.world_size} x {format_bytes(spec.device_bytes)}",
            "",
            _launch_heading(spec.world_size, spec.hosts),
            f"  {launch['torchrun']}",
            "launch (torchx, this project's component; -s kubernetes or slurm on a cluster):",
            f"  {launch['torchx']}",
        ]
    else:
        lines += ["", f"fits: no; {does_not_fit(plan)}"]
        if plan.error:
            lines.append(f"TorchRec's planner: {plan.error}")
    return "\n".join(lines) + "\n"


def _launch_heading(world_size: int, hosts: int) -> str:
    if world_size == 1:
        return "launch (one process: no torchrun needed):"
    if hosts > 1:
        return "launch (torchrun, on every host; HEAD_NODE: the first host's address):"
    return "launch (torchrun):"


def does_not_fit(plan: JobPlan) -> str:
    """One line: why ``plan`` does not fit and the smallest world size that does."""
    spec = plan.spec
    head = (
        f"does not fit on {spec.world_size} x {format_bytes(spec.device_bytes)}: the tables "
        f"and their state need {format_bytes(plan.table_bytes)}"
    )
    if plan.usable_bytes is not None:
        head += f", {spec.world_size} x {format_bytes(plan.usable_bytes)} usable"
    else:
        head += ", and TorchRec's reservation leaves nothing of each device"
    if spec.sharding == "data_parallel":
        return f"{head}; --sharding data_parallel puts every table on every device: give auto"
    if plan.smallest_world_size is not None:
        return (
            f"{head}; the smallest world size that fits is {plan.smallest_world_size} "
            f"(--world-size {plan.smallest_world_size} shows its plan)"
        )
    tried = f" (planned {', '.join(map(str, plan.searched))})" if plan.searched else ""
    return f"{head}; no world size up to {max(plan.searched, default=spec.world_size)} fits{tried}"

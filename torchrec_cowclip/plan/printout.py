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
from typing import Dict, List, Optional, Sequence

from torchrec_cowclip.plan.job import JobPlan, TablePlan, format_bytes

__all__ = [
    "does_not_fit",
    "format_plan",
    "format_planner_stats",
    "launch_commands",
    "rank_ranges",
]


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


def _what(plan: JobPlan) -> str:
    """``dlrm at dim 128`` or, for a table list, ``3 tables of dim 64-128``."""
    spec = plan.spec
    if spec.tables:
        dims = sorted({t.dim for t in spec.tables})
        span = str(dims[0]) if len(dims) == 1 else f"{dims[0]}-{dims[-1]}"
        return f"{len(spec.tables)} tables of dim {span}"
    return f"{spec.model} at dim {spec.model_arguments.get('embedding_dim')}"


def _fits_line(plan: JobPlan) -> str:
    """``fits: yes, ...`` or, with a rank under the headroom, ``fits, tight: ...`` naming
    the bytes that rank leaves free."""
    spec = plan.spec
    on = f"on {spec.world_size} x {format_bytes(spec.device_bytes)}"
    tight, headroom = plan.tight_ranks, plan.headroom_bytes
    if headroom is None:
        return f"fits: yes, {on}"
    share = f"the headroom of {format_bytes(headroom)} ({spec.headroom:.0%} of usable)"
    if not tight:
        least = min(plan.free_bytes(r) for r in plan.ranks)
        return (
            f"fits: yes, {on}; every rank leaves at least {format_bytes(least)} free, over {share}"
        )
    fullest = tight[0]
    others = (
        f" (and rank{'s' if len(tight) > 2 else ''} {rank_ranges(sorted(r.rank for r in tight[1:]))})"
        if len(tight) > 1
        else ""
    )
    return (
        f"fits, tight: {on}, but rank {fullest.rank}{others} leaves "
        f"{format_bytes(plan.free_bytes(fullest))} of its {format_bytes(plan.usable_bytes or 0)} "
        f"usable free, under {share} for activations and the dense optimizer: "
        "more devices, row_wise for the largest tables (--constrain TABLE=row_wise), or "
        "--headroom to accept it"
    )


def format_plan(plan: JobPlan, tables_from: str, launch: Optional[Dict[str, str]]) -> str:
    """The plan as ``plan`` prints it; ``tables_from`` says where the table sizes came
    from, ``launch`` holds the launch commands (:func:`launch_commands`; None: a table
    list or per-table constraints, which ``train`` does not take)."""
    spec = plan.spec
    where = "HBM" if spec.compute_device == "cuda" else "DDR"
    lines = [
        f"plan: {_what(plan)}, {spec.embedding_dtype} weights, {spec.optimizer} "
        f"state; tables from {tables_from}",
        f"job: {spec.world_size} x {spec.compute_device} ({spec.local_world_size} per host) "
        f"of {format_bytes(spec.device_bytes)} {where}, batch {spec.batch_size:,} "
        f"({spec.batch_size // spec.world_size:,} per rank), sharding {spec.sharding}"
        + (f"; constrained: {_constrained(plan.constraints)}" if _mixed(plan) else ""),
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
            + f" ({_share(largest.bytes, spec.device_bytes)} of the device)",
            f"planner: {plan.proposals} proposals, {plan.plans} plans, {plan.run_time_s:.1f} s; "
            f"slowest rank {slowest.rank}: {slowest.step_ms:.3f} ms per step (forward compute "
            f"{perf['fwd_compute']:.3f}, forward comms {perf['fwd_comms']:.3f}, backward "
            f"compute {perf['bwd_compute']:.3f}, backward comms {perf['bwd_comms']:.3f})",
            _fits_line(plan),
            "",
        ]
        if launch is None:
            lines.append(
                "launch: your own training script, its planner given these tables' sharding "
                'types as ParameterConstraints (--json writes them as "constraints"); '
                "train takes one --sharding for every table"
            )
        else:
            lines += [
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


def _mixed(plan: JobPlan) -> bool:
    """Whether tables were constrained one by one (``--constrain``, a table file's own)."""
    spec = plan.spec
    return bool(spec.constraints) or any(t.sharding for t in spec.tables)


def _constrained(constraints: Dict[str, str]) -> str:
    """``row_wise emb_C1, emb_C20; table_wise emb_C3``: the tables of each constraint."""
    by_type: Dict[str, List[str]] = {}
    for table, sharding in constraints.items():
        by_type.setdefault(sharding, []).append(table)
    shown = []
    for sharding, tables in by_type.items():
        names = ", ".join(tables[:4]) + (f" and {len(tables) - 4} more" if len(tables) > 4 else "")
        shown.append(f"{sharding} {names}")
    return "; ".join(shown)


def _share(part: int, whole: int) -> str:
    """``part`` of ``whole`` as a percentage that never reads 0 for a nonzero part."""
    if whole <= 0:
        return "-"
    share = 100.0 * part / whole
    return "<0.01%" if 0 < share < 0.01 else f"{share:.2f}%"


def format_planner_stats(plan: JobPlan) -> str:
    """The planner's statistics (``plan --planner-stats``): per rank its storage estimate
    (tables, state and input/output buffers) and share of the device and of the usable
    memory, its step-time estimates; per table each shard's rank, size and storage. Bytes
    in B/KiB/MiB/GiB (:func:`format_bytes`), so a small plan reads in KiB, not "0.0 GB"."""
    spec = plan.spec
    tier = "HBM" if spec.compute_device == "cuda" else "DDR"
    usable = plan.usable_bytes
    lines = ["planner statistics (TorchRec's estimates; storage: tables, state and "
             f"input/output buffers, in {tier}):"]  # fmt: skip
    if not plan.fits:
        return "\n".join(lines + [f"  no plan: {plan.error or 'it does not fit'}"]) + "\n"
    ranks = [["rank", "storage", "of device", "of usable", "free", "fwd compute ms",
              "fwd comms ms", "bwd compute ms", "bwd comms ms", "input dist ms", "shards"]]  # fmt: skip
    shards_on = {r.rank: 0 for r in plan.ranks}
    for t in plan.tables:
        for s in t.shards:
            shards_on[s.rank] += 1
    for r in plan.ranks:
        perf = r.perf_ms
        ranks.append(
            [
                str(r.rank),
                format_bytes(r.planner_bytes),
                _share(r.planner_bytes, spec.device_bytes),
                "-" if usable is None else _share(r.planner_bytes, usable),
                "-" if usable is None else format_bytes(plan.free_bytes(r)),
                *(
                    f"{perf[k]:.4f}"
                    for k in (
                        "fwd_compute",
                        "fwd_comms",
                        "bwd_compute",
                        "bwd_comms",
                        "input_dist_comms",
                    )
                ),  # fmt: skip
                str(shards_on[r.rank]),
            ]
        )
    lines += _table(ranks, right=tuple(range(11)))
    shards = [["table", "sharding", "kernel", "rank", "rows", "cols", "storage", "step ms"]]
    for t in plan.tables:
        for s in t.shards:
            step = sum(v for k, v in s.perf_ms.items() if k != "input_dist_comms")
            shards.append([t.name, t.sharding, t.compute_kernel, str(s.rank), f"{s.rows:,}",
                           str(s.cols), format_bytes(s.planner_bytes), f"{step:.4f}"])  # fmt: skip
    lines += ["", *_table(shards, right=(3, 4, 5, 6, 7))]
    if usable is not None:
        lines += [
            "",
            f"device {format_bytes(spec.device_bytes)} {tier}: {format_bytes(usable)} usable, "
            f"{format_bytes(spec.device_bytes - usable)} reserved by TorchRec; headroom "
            f"{spec.headroom:.0%} of usable, {format_bytes(plan.headroom_bytes or 0)}",
        ]
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

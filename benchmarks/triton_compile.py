"""Every Triton kernel specialization the project launches, compiled for sm_90a and sm_80
without a GPU: the table of registers, spilled bytes, shared memory and blocks per SM.

Records the launches of :mod:`torchrec_cowclip.embedding.triton_ops` over the dims,
dtypes, rules and options (:func:`~torchrec_cowclip.embedding.triton_build.record_launches`;
nothing runs), compiles each with Triton's compiler for each target and reads ``ptxas
-v`` (:func:`~torchrec_cowclip.embedding.triton_build.compile_launches`). Prints a
Markdown table (``docs/triton.md`` takes it) and a summary; ``--json`` keeps every row.
Exit 1 if a specialization fails to compile, spills, or passes ``--max-registers``.

Usage::

    python benchmarks/triton_compile.py [--dims 1,4,10,...] [--arches sm_90a,sm_80]
        [--jobs 2] [--json out.json] [--every-row]

About 1 s a compile on a 2-core AMD EPYC (Triton caches what it compiled: a second run
with unchanged kernels reads ptxas only).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from typing import Dict, List, Tuple

os.environ.setdefault("TRITON_INTERPRET", "1")  # the recording runs no kernel

import torch  # noqa: E402

from torchrec_cowclip.embedding import triton_build  # noqa: E402

#: The issue's dims: the paper's (1 for the linear part, 10, 16), every alignment class,
#: and the largest row a block takes.
DIMS = (1, 4, 10, 12, 16, 24, 32, 48, 64, 100, 128, 256, 512, 1024, 4096)

#: The constants a row of the table names (the others are the same across a row's group).
SHOWN = ("DIM", "OPTIMIZER", "STORE", "SEGMENTS", "WEIGHTED", "CLIP", "ROW_SUMS", "PADDED")


def _configuration(spec: triton_build.Specialization) -> str:
    constants = dict(spec.constants)
    if spec.kernel == "update":
        rule = ("adam", "rowwise_adagrad", "sgd")[constants["OPTIMIZER"]]
        store = ("fp32", "fp16", "bf16")[constants["STORE"]]
        return f"D={constants['DIM']} {rule} {store}"
    if "DIM" in constants:
        return f"D={constants['DIM']}"
    return ""


def _summary(builds: List[triton_build.Build], max_registers: int) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for arch in sorted({b.arch for b in builds}):
        ours = [b for b in builds if b.arch == arch]
        failed = [b for b in ours if b.error is not None]
        spilled = [b for b in ours if b.spill_bytes]
        heavy = [b for b in ours if b.registers > max_registers]
        out[arch] = {
            "specializations": len(ours),
            "failed": len(failed),
            "spilled": len(spilled),
            "over_registers": len(heavy),
            "max_registers": max((b.registers for b in ours), default=0),
            "min_blocks_per_sm": min((b.blocks_per_sm for b in ours if b.error is None), default=0),
        }
    return out


def _table(builds: List[triton_build.Build], every_row: bool) -> List[str]:
    """Markdown: one row per kernel and configuration (the worst of its variants unless
    ``every_row``), a column group per target."""
    arches = sorted({b.arch for b in builds}, reverse=True)
    groups: Dict[Tuple[str, str], Dict[str, List[triton_build.Build]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for b in builds:
        key = b.specialization.label if every_row else _configuration(b.specialization)
        groups[(b.specialization.kernel, key)][b.arch].append(b)
    head = "| kernel | configuration | variants | " + " | ".join(
        f"{a} regs | {a} spill B | {a} smem B | {a} blocks/SM" for a in arches
    )
    lines = [head + " |", "|" + "---|" * (3 + 4 * len(arches))]
    for (kernel, key), by_arch in groups.items():
        cells = [kernel, key, str(len(next(iter(by_arch.values()))))]
        for arch in arches:
            ours = by_arch.get(arch, [])
            failed = [b for b in ours if b.error is not None]
            if failed:
                cells += ["fails: " + (failed[0].error or "").replace("|", "/")[:80], "", "", ""]
                continue
            cells += [
                str(max(b.registers for b in ours)),
                str(max(b.spill_bytes for b in ours)),
                str(max(b.shared for b in ours)),
                str(min(b.blocks_per_sm for b in ours)),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default=",".join(map(str, DIMS)))
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--rules", default="adam,rowwise_adagrad,sgd")
    parser.add_argument("--arches", default=",".join(triton_build.ARCHES))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--max-registers", type=int, default=triton_build.MAX_REGISTERS)
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--every-row", action="store_true", help="one table row per variant")
    args = parser.parse_args()
    specs = triton_build.record_launches(
        [int(d) for d in args.dims.split(",")],
        [getattr(torch, name) for name in args.dtypes.split(",")],
        args.rules.split(","),
    )
    started = time.perf_counter()
    builds = triton_build.compile_launches(specs, args.arches.split(","), jobs=args.jobs)
    seconds = time.perf_counter() - started
    for line in _table(builds, args.every_row):
        print(line)
    summary = _summary(builds, args.max_registers)
    print(
        f"\n{len(specs)} specializations x {len(args.arches.split(','))} targets in {seconds:.0f} s:"
    )
    print(json.dumps(summary, indent=1))
    problems = [p for b in builds for p in b.problems(args.max_registers)]
    for problem in problems[:40]:
        print(problem)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "summary": summary,
                    "builds": [
                        {**dataclasses.asdict(b), "blocks_per_sm": b.blocks_per_sm} for b in builds
                    ],
                },
                out,
                indent=1,
            )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

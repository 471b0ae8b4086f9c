"""How fast ``synthetic:ROWS`` is generated into the cache, against reading it back.

Builds the dataset into a fresh cache directory each round (generation, encoding and
the cache write: what a first ``train --data synthetic:ROWS`` pays), and in the same
round reads every array of the built entry back into memory (what any later run pays),
interleaved so the box's load falls on both. Reports seconds, rows/s and the paired
ratio build / read-back per round, with the ``--dense-transform minmax`` build (two
generation passes) beside it.

The goal it checks: 1M rows well under a minute on 2 cores (``--goal-s``, exit 1 if a
build of ``--rows`` rows takes longer).

Usage::

    python benchmarks/synthetic_generation.py [--rows 1000000] [--rounds 3] [--goal-s 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
from common import cpu_model

from torchrec_cowclip.data import open_dataset


def _build(spec: str, root: Path, **options: str) -> float:
    start = time.perf_counter()
    open_dataset(spec, root, seed=1, **options)
    return time.perf_counter() - start


def _read_back(spec: str, root: Path) -> float:
    start = time.perf_counter()
    ds = open_dataset(spec, root, seed=1)
    for array in (ds.dense, ds.sparse, ds.labels):
        np.asarray(array).sum()  # touches every page of the memmap
    return time.perf_counter() - start


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--goal-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    spec = f"synthetic:{args.rows}"
    times: Dict[str, List[float]] = {"build": [], "build_minmax": [], "read_back": []}
    with tempfile.TemporaryDirectory() as scratch:
        for k in range(args.rounds):
            root = Path(scratch) / f"round{k}"
            times["build"].append(_build(spec, root / "log"))
            times["read_back"].append(_read_back(spec, root / "log"))
            times["build_minmax"].append(_build(spec, root / "minmax", dense_transform="minmax"))
    print(f"{cpu_model()} ({os.cpu_count()} logical cores)")
    print(f"{spec}, {args.rounds} interleaved rounds")
    print("| what | seconds (min..max) | rows/s (best) |")
    print("| --- | --- | --- |")
    for name, values in times.items():
        print(f"| {name} | {min(values):.2f}..{max(values):.2f} | {args.rows / min(values):,.0f} |")
    ratios = [b / r for b, r in zip(times["build"], times["read_back"])]
    minmax = [m / b for m, b in zip(times["build_minmax"], times["build"])]
    print(f"build / read-back per round: {', '.join(f'{x:.1f}' for x in ratios)}")
    print(f"minmax build / build per round: {', '.join(f'{x:.2f}' for x in minmax)}")
    worst = max(times["build"])
    met = worst < args.goal_s
    print(
        f"goal {args.rows:,} rows in < {args.goal_s:.0f} s: slowest build {worst:.1f} s, "
        f"{'met' if met else 'NOT met'} (median {statistics.median(times['build']):.1f} s)"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

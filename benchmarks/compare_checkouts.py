"""The embedding step of two checkouts of this project, side by side in one run.

For a refactor that must not slow the step down: ``--before`` and ``--after`` are two
checkouts (e.g. a ``git worktree`` of the commit before the change, and this one). Each
gets a worker process that imports ``torchrec_cowclip`` from its checkout and builds the
same collection (:func:`common.make_ours`: 26 tables x 100,000 rows, dim 16, CowClip) and
the same power-law batches (:func:`common.single_hot_batches`); the driver then asks each
worker for one step per round, alternating which goes first, so that both share the
machine's load. Only one worker runs at a time (the other waits on its pipe).

A step is timed in three parts: the forward, ``backward(g)`` (which runs the fused
update), and releasing the step's autograd graph (``del``: a change in what the graph
holds shows here, not in the forward). Reported: medians per checkout and the paired
ratio after / before (median of per-round ratios) of each part and of the whole step.

Usage::

    git worktree add ../before HEAD~1
    python benchmarks/compare_checkouts.py --before ../before [--after .] [--rounds 80]
        [--optimizer adam] [--max-ratio 1.05] [--before-extensions-dir DIR]

Both workers take the update path ``TORCHREC_COWCLIP_COMPILE`` says (default: the native
CPU kernels).

``--max-ratio``: exit 1 if the whole step's paired ratio is above it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
PARTS = ("forward", "backward", "release")
NUM_BATCHES = 4


def _worker(args: argparse.Namespace) -> None:
    """Serves steps: one line in, one line of the three parts' seconds out."""
    import torch

    # The package first, from PYTHONPATH (the worker's checkout): importing common.py
    # first would put the checkout holding this script ahead of it.
    package = importlib.import_module("torchrec_cowclip")
    common = importlib.import_module("common")
    make_ours, single_hot_batches = common.make_ours, common.single_hot_batches

    torch.set_num_threads(args.threads)
    rows = [args.rows] * args.tables
    ebc = make_ours(rows, args.dim, args.optimizer)
    batches = single_hot_batches(rows, args.batch_size, args.zipf, NUM_BATCHES)
    grad = torch.randn(
        args.batch_size, args.tables * args.dim, generator=torch.Generator().manual_seed(1)
    )
    print(json.dumps({"ready": str(Path(package.__file__).parent)}), flush=True)
    for k, _ in enumerate(sys.stdin):
        batch = batches[k % NUM_BATCHES]
        start = time.perf_counter()
        pooled = ebc(batch.kjt).values()
        forward = time.perf_counter()
        pooled.backward(grad)
        backward = time.perf_counter()
        del pooled
        release = time.perf_counter()
        print(f"{forward - start} {backward - forward} {release - backward}", flush=True)


class _Worker:
    def __init__(
        self, checkout: Path, argv: Sequence[str], extensions_dir: Optional[Path] = None
    ) -> None:
        env = dict(os.environ, PYTHONPATH=str(checkout))
        if extensions_dir is not None:
            env["TORCH_EXTENSIONS_DIR"] = str(extensions_dir)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", *argv],
            cwd=str(checkout),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ready(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"compare_checkouts: a worker exited (rc {self.proc.wait()})")
        return str(json.loads(line)["ready"])

    def step(self) -> List[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return [float(x) for x in self.proc.stdout.readline().split()]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=False, help="the checkout to compare with")
    parser.add_argument("--after", type=Path, default=HERE.parent, help="default: this checkout")
    parser.add_argument("--optimizer", default="adam", choices=("adam", "rowwise_adagrad", "sgd"))
    parser.add_argument("--rounds", type=int, default=80, help="timed rounds (one step each)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    parser.add_argument("--max-ratio", type=float, default=None)
    parser.add_argument(
        "--before-extensions-dir",
        type=Path,
        default=None,
        help="TORCH_EXTENSIONS_DIR of the before worker (default: the environment's); give "
        "a checkout older than issue 27, whose native library's cache name does not hash "
        "its source, a directory of its own",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return {}
    if args.before is None:
        parser.error("--before is required")
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    for flag, path in (("--before", args.before), ("--after", args.after)):
        if not (path / "torchrec_cowclip" / "__init__.py").is_file():
            parser.error(f"{flag} {path}: not a checkout of this project (no torchrec_cowclip/)")
    shape = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ("optimizer", "tables", "rows", "dim", "batch_size", "zipf", "threads")
    ]
    workers = {
        "before": _Worker(args.before, shape, args.before_extensions_dir),
        "after": _Worker(args.after, shape),
    }
    try:
        packages = {name: w.ready() for name, w in workers.items()}
        for name, checkout in (("before", args.before), ("after", args.after)):
            if Path(packages[name]) != (checkout / "torchrec_cowclip").resolve():
                raise SystemExit(
                    f"compare_checkouts: the {name} worker imported {packages[name]}, "
                    f"not {checkout}'s torchrec_cowclip"
                )
        times: Dict[str, List[List[float]]] = {"before": [], "after": []}
        for r in range(args.warmup + args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            got = {name: workers[name].step() for name in order}
            if r >= args.warmup:
                for name in times:
                    times[name].append(got[name] + [sum(got[name])])
    finally:
        for w in workers.values():
            w.close()
    result: Dict[str, object] = {"packages": packages, "shape": shape, "rounds": args.rounds}
    print(f"before: {packages['before']}\nafter:  {packages['after']}")
    print(f"{' '.join(shape)}, {args.rounds} rounds, one step of each per round, order alternated")
    print(f"{'part':<10} {'before ms':>10} {'after ms':>10} {'after / before (paired)':>24}")
    for i, part in enumerate((*PARTS, "step")):
        before = statistics.median(t[i] for t in times["before"]) * 1e3
        after = statistics.median(t[i] for t in times["after"]) * 1e3
        paired = statistics.median(
            a[i] / b[i] for a, b in zip(times["after"], times["before"]) if b[i] > 0
        )
        result[part] = {"before_ms": before, "after_ms": after, "paired_ratio": paired}
        print(f"{part:<10} {before:>10.2f} {after:>10.2f} {paired:>24.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    step_ratio = result["step"]["paired_ratio"]  # type: ignore[index]
    if args.max_ratio is not None and step_ratio > args.max_ratio:
        print(f"compare_checkouts: the step's paired ratio {step_ratio:.3f} is above --max-ratio")
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()

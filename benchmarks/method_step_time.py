"""Time per training step of each method of the scaling study, side by side in one run.

The study's own ``ms/step`` (benchmarks/scaling.py) is each run's train seconds over its
steps: runs at different times of a shared machine are not comparable. Here the methods'
steps are interleaved on the same batches in one process (``common.run_interleaved``:
each round runs every method once, order rotated), so a busy stretch slows all of them
alike, and the ratios to ``adam`` are paired per round.

Methods (the step's cost; the recipes ``paper`` and ``fixed-l2`` differ from ``cowclip``
only in learning rates and L2, not in what a step computes):

- ``adam``: DeepFM with the fused tables, Adam, no clip; one forward, one backward, the
  dense Adam;
- ``cowclip``: the same with the CowClip clip;
- ``helen``: Helen's step (two forwards, two backwards, one update), no clip;
- ``helen+cowclip``: Helen's step with the clip.

Model and data as the study's (DeepFM, D 10, DNN 64-64, ``synthetic`` at
``--synthetic-scale 0.05 --synthetic-max-cardinality 50000``). Writes
``method_step_time.json`` / ``.csv`` to ``--out``.

Run (about 3 minutes on 2 cores)::

    .venv/bin/python benchmarks/method_step_time.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by path

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    RESULTS,
    cpu_model,
    format_table,
    paired_ratio,
    run_interleaved,
    write_csv,
    write_json,
)

from torchrec_cowclip import CowClip, Helen  # noqa: E402
from torchrec_cowclip.data import open_dataset  # noqa: E402
from torchrec_cowclip.models import build_model  # noqa: E402
from torchrec_cowclip.models.task import CTRTrainTask  # noqa: E402
from torchrec_cowclip.optim.options import CowClipOptions  # noqa: E402

METHODS = ("adam", "cowclip", "helen", "helen+cowclip")
BATCHES = (64, 256, 1024, 4096, 8192)


def method_step(method: str, schema: Any, seed: int) -> Callable[[Any], None]:
    """One training step of ``method`` on a fresh study-shaped DeepFM."""
    torch.manual_seed(seed)
    clip = CowClip.from_reference(1.0, 1e-5, 10) if "cowclip" in method else None
    helen = Helen(rho=0.05, bound=0.3) if method.startswith("helen") else None
    model = build_model(
        "deepfm",
        sparse_names=list(schema.sparse_names),
        cardinalities=list(schema.cardinalities),
        num_dense=schema.n_dense,
        hidden=(64, 64),
        embedding_options=CowClipOptions(lr=1e-3, weight_decay=2e-5, cowclip=clip, helen=helen),
        init_seed=seed,
    )
    task = CTRTrainTask(model)
    dense = torch.optim.Adam(model.dense_parameters(), lr=8e-4)
    ebc = model.embedding_collection

    def step(batch: Any) -> None:
        dense.zero_grad()
        if helen is None:
            task(batch)[0].backward()
        else:
            ebc.helen_step(lambda: task(batch)[0])
        dense.step()

    return step


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCHES)))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=40.0, help="seconds per batch size")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--cache-dir", default=os.path.join(tempfile.gettempdir(), "cowclip_bench_cache")
    )
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    ds = open_dataset(
        f"synthetic:{2 * max(sizes)}",
        args.cache_dir,
        cardinality_scale=0.05,
        max_cardinality=50_000,
    )
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU: {cpu_model()}")
    steps = {m: method_step(m, ds.schema, seed=0) for m in methods}
    k = max(args.steps_per_round, 1)
    records: List[Dict[str, Any]] = []
    for bs in sizes:
        batches = [b for _, b in zip(range(2), ds.batches(np.arange(2 * bs), bs))]
        blocks = {m: (lambda b, f=f: [f(b) for _ in range(k)]) for m, f in steps.items()}
        timings = run_interleaved(blocks, batches, args.rounds, args.warmup, args.time_limit)
        for m, t in timings.items():
            records.append(
                {
                    "batch_size": bs,
                    "method": m,
                    "ms_per_step_median": t.median / k,
                    "ms_per_step_min": t.minimum / k,
                    "rounds": len(t.samples),
                    "ratio_to_adam": paired_ratio(t, timings["adam"])
                    if "adam" in timings
                    else None,
                }
            )
        print(f"batch {bs:,}: {len(timings[methods[0]].samples)} rounds", flush=True)
    rows = [["batch", "method", "ms/step (median)", "min", "x adam (paired)", "rounds"]]
    for r in records:
        ratio = r["ratio_to_adam"]
        rows.append(
            [
                f"{r['batch_size']:,}",
                r["method"],
                f"{r['ms_per_step_median']:.1f}",
                f"{r['ms_per_step_min']:.1f}",
                "-" if ratio is None else f"{ratio:.2f}",
                str(r["rounds"]),
            ]
        )
    print(format_table(rows))
    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "records": records}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "method_step_time.json"), result)
    write_csv(os.path.join(args.out, "method_step_time.csv"), records)
    return result


if __name__ == "__main__":
    main()

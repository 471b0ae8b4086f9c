"""Where the time of our embedding step goes: torch.profiler over a few steps of
``CowClipEmbeddingBagCollection`` (forward + backward + fused update) at the shape of
``embedding_step.py``, self time per op, grouped by op and input shape.

    .venv/bin/python benchmarks/profile_step.py                 # Adam + CowClip, 2 threads
    .venv/bin/python benchmarks/profile_step.py --eager         # the eager update instead

A step is ``ebc(kjt).values().backward(grad)``, as in embedding_step.py (no loss of the
benchmark's own); ``--eager`` profiles the eager update, ``TORCHREC_COWCLIP_COMPILE=inductor``
the Inductor-compiled one, the default the native CPU kernels.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

import torch
from torch.profiler import profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by path
from common import SEED, Batch, make_ours, single_hot_batches  # noqa: E402

from torchrec_cowclip.optim.row_step import set_compiled_update  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16_384)
    p.add_argument("--optimizer", default="adam", choices=("adam", "rowwise_adagrad", "sgd"))
    p.add_argument("--steps", type=int, default=5, help="profiled steps")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--eager", action="store_true", help="profile the eager update")
    p.add_argument("--rows-shown", type=int, default=25)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [args.rows] * args.tables
    batches = single_hot_batches(rows, args.batch_size, 1.0, 4, SEED)
    # The collection's row kernel is chosen when it is built: eager for --eager, else as
    # TORCHREC_COWCLIP_COMPILE says.
    previous = set_compiled_update("0") if args.eager else None
    ebc = make_ours(rows, args.dim, args.optimizer)
    if args.eager:
        set_compiled_update(previous)
    grad = torch.randn(args.batch_size, args.tables * args.dim)

    def step(batch: Batch) -> None:
        ebc(batch.kjt).values().backward(grad)

    for i in range(5):  # compile and warm up
        step(batches[i % len(batches)])
    start = time.perf_counter()
    for i in range(10):
        step(batches[i % len(batches)])
    ms = (time.perf_counter() - start) / 10 * 1e3
    with profile(record_shapes=True) as prof:
        for i in range(args.steps):
            step(batches[i % len(batches)])
    print(
        prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total",
            row_limit=args.rows_shown,
            max_name_column_width=40,
            max_shapes_column_width=60,
        )
    )
    print(
        f"{args.optimizer}{' (eager update)' if args.eager else ''}: {ms:.1f} ms/step "
        f"unprofiled, {torch.get_num_threads()} threads, {args.tables} x {args.rows:,} rows, "
        f"dim {args.dim}, batch {args.batch_size:,}; table: self CPU over {args.steps} steps"
    )


if __name__ == "__main__":
    main()

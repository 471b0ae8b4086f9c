"""Time per Helen step: TorchRec's sparse-dist pipeline against the two-pass loop, on N ranks.

``two_pass_loop`` is the step as the trainer took it before Helen ran in TorchRec's
pipelines (``train/helen_pipeline.py``'s earlier ``HelenTrainPipeline``): next batch,
``zero_grad``, ``helen_step(closure)`` with both forwards inside, the optimizers' step - no
input distribution ahead of time. ``sparse_dist_pipeline`` is
:class:`~torchrec_cowclip.train.helen_pipeline.HelenTrainPipelineSparseDist`: TorchRec's
``TrainPipelineSparseDist`` with Helen's two passes as its backward, the next batch's input
distribution started before the current forward and waited for after it. Two models (one
per variant, same seed) train interleaved, one step each per round, order rotated
(``common.run_interleaved``); the ratio is paired per round. On CPU with gloo the
all-to-alls are synchronous, so the overlap itself gains little there; on GPUs with NCCL
it hides the input distribution behind the two passes.

Run (about a minute on 2 cores)::

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/helen_pipeline.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import nullcontext
from typing import Any, Callable, Iterator, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import (  # noqa: E402
    RESULTS,
    cpu_model,
    format_table,
    paired_ratio,
    run_interleaved,
    write_json,
)
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402

from torchrec_cowclip.compat import dmp_data_parallel  # noqa: E402
from torchrec_cowclip.train import TrainConfig  # noqa: E402
from torchrec_cowclip.train.loop import TrainingLoop  # noqa: E402
from torchrec_cowclip.train.start import start_run  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="synthetic:400000")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--sharding", default="row_wise")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=300.0)
    p.add_argument("--cache-dir", default="data_cache")
    p.add_argument("--out", default=os.path.join(RESULTS, "helen_pipeline"))
    return p.parse_args()


def endless(make: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    while True:
        yield from make()


def trainer(args: argparse.Namespace, root: str, name: str) -> TrainingLoop:
    config = TrainConfig(
        model="deepfm",
        data=args.data,
        batch_size=args.batch_size,
        hidden=(64, 64),
        synthetic_scale=0.05,
        synthetic_max_cardinality=50_000,
        helen_rho=0.05,
        sharding=args.sharding,
        progress=False,
        threads=1,
        cache_dir=args.cache_dir,
        out=os.path.join(root, name),
    )
    built = start_run(config.resolve())
    built.run_dir.release()  # timed steps only: no run directory is kept
    return built


def pipeline_variant(t: TrainingLoop) -> Callable[[Any], None]:
    runtime = t.runtime
    runtime.train_module.train()
    pipeline = runtime.pipeline()
    batches = endless(lambda: runtime.train_batches(0, 0))
    return lambda _: pipeline.progress(batches)


def loop_variant(t: TrainingLoop) -> Callable[[Any], None]:
    runtime = t.runtime
    module = runtime.embedding_module()
    ddp = dmp_data_parallel(runtime.train_module)
    dense = [p for _, p in in_backward_optimizer_filter(runtime.train_module.named_parameters())]
    batches = endless(lambda: runtime.train_batches(0, 0))

    def step(_: Any) -> None:
        batch = next(batches)
        runtime.optimizer.zero_grad()
        calls: List[int] = []

        def closure() -> torch.Tensor:
            second = bool(calls) and ddp is not None and not module.helen.perturb_dense
            with ddp.no_sync() if second else nullcontext():
                loss, _ = runtime.train_module(batch)
            calls.append(1)
            return loss

        module.helen_step(closure, dense_params=dense if module.helen.perturb_dense else None)
        runtime.optimizer.step()

    return step


def main() -> None:
    args = parse_args()
    root = tempfile.mkdtemp(prefix="helen-pipeline-")
    variants = {
        "two_pass_loop": loop_variant(trainer(args, root, "loop")),
        "sparse_dist_pipeline": pipeline_variant(trainer(args, root, "pipeline")),
    }
    timings = run_interleaved(variants, [None], args.rounds, args.warmup, args.time_limit)
    if dist.get_rank() != 0:
        return
    ratio = paired_ratio(timings["sparse_dist_pipeline"], timings["two_pass_loop"])
    rows = [["variant", "median ms / step", "min ms", "vs two_pass_loop (paired)"]]
    for name, timing in timings.items():
        shown = 1.0 if name == "two_pass_loop" else ratio
        rows.append([name, f"{timing.median:.1f}", f"{timing.minimum:.1f}", f"{shown:.3f}"])
    print(f"{cpu_model()}; {dist.get_world_size()} ranks, {args.sharding}, batch {args.batch_size}")
    print(format_table(rows))
    write_json(
        os.path.join(args.out, "helen_pipeline.json"),
        {
            "cpu": cpu_model(),
            "world_size": dist.get_world_size(),
            "args": vars(args),
            "timings": {name: t.summary() for name, t in timings.items()},
            "pipeline_vs_loop": ratio,
        },
    )


if __name__ == "__main__":
    main()

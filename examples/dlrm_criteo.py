"""DLRM on Criteo with CowClip, written the way TorchRec's own DLRM example is.

TorchRec's idioms, unchanged: ``torchrec.models.dlrm.DLRM`` over a plain
``EmbeddingBagCollection`` built on the meta device, ``apply_optimizer_in_backward`` on
its tables, TorchRec's planner and ``DistributedModelParallel`` with
``torchrec_cowclip.distributed.get_default_sharders()``, ``TrainPipelineSparseDist``, a
``CombinedOptimizer`` of the fused tables and a dense Adam under TorchRec's
``WarmupOptimizer``, ``RecMetricModule``'s AUC, and ``torch.distributed.checkpoint``
to save and resume. What CowClip changes is one line: the optimizer class given to
``apply_optimizer_in_backward`` (``CowClipAdam`` with ``cowclip=CowClip(...)``).

The input is TorchRec's preprocessed Criteo (``--in-memory-binary-criteo-path``: the
``day_N_{dense,sparse,labels}.npy`` files that ``torchrec.datasets.scripts.npy_preproc_criteo``
writes; ids taken modulo ``--num-embeddings``, as TorchRec's in-memory dataset does), read
through this project's ``criteo-npy:`` kind: its last day is the test set. Global batches
are the same on any number of processes (each rank takes its slice).

    torchrun --standalone --nproc_per_node 2 examples/dlrm_criteo.py \\
        --in-memory-binary-criteo-path /data/criteo_npy --batch-size 16384 --epochs 1 \\
        --checkpoint-dir runs/dlrm-ckpt          # add --resume to continue from there
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.metrics.metric_module import RecMetricModule, generate_metric_module
from torchrec.metrics.metrics_config import MetricsConfig, RecMetricDef, RecMetricEnum, RecTaskInfo
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

from torchrec_cowclip import CowClip
from torchrec_cowclip.data import BatchIterator, epoch_order, open_dataset
from torchrec_cowclip.data.sources.criteo_npy import find_npy_days
from torchrec_cowclip.distributed import get_default_sharders
from torchrec_cowclip.optim import CowClipAdam
from torchrec_cowclip.run.safe_load import SafeFileSystemReader, SafeLoadPlanner


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # TorchRec's example spells its flags with underscores; both spellings work here.
    p.add_argument(
        "--in-memory-binary-criteo-path", "--in_memory_binary_criteo_path", required=True
    )
    p.add_argument("--num-embeddings", "--num_embeddings", type=int, default=100_000)
    p.add_argument("--embedding-dim", "--embedding_dim", type=int, default=64)
    p.add_argument("--dense-arch-layer-sizes", "--dense_arch_layer_sizes", default="512,256,64")
    p.add_argument("--over-arch-layer-sizes", "--over_arch_layer_sizes", default="512,512,256,1")
    p.add_argument("--batch-size", "--batch_size", type=int, default=16384, help="global batch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--learning-rate", "--learning_rate", type=float, default=1e-3, help="dense")
    p.add_argument("--embedding-learning-rate", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--clip-r", type=float, default=1.0)
    p.add_argument("--clip-bound", type=float, default=1e-5, help="the TF reference's --bound")
    p.add_argument("--cache-dir", default="data_cache")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    return args


def _sizes(text: str) -> List[int]:
    return [int(n) for n in text.split(",") if n]


def build_model(args: argparse.Namespace, feature_names: List[str]) -> DLRMTrain:
    """TorchRec's DLRM over a meta-device EBC; the tables train with Adam + CowClip."""
    tables = [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=args.embedding_dim,
            num_embeddings=args.num_embeddings,
            feature_names=[name],
        )
        for name in feature_names
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=_sizes(args.dense_arch_layer_sizes),
            over_arch_layer_sizes=_sizes(args.over_arch_layer_sizes),
        )
    )
    apply_optimizer_in_backward(
        CowClipAdam,
        ebc.parameters(),
        {
            "lr": args.embedding_learning_rate,
            "cowclip": CowClip.from_reference(args.clip_r, args.clip_bound, args.embedding_dim),
        },
    )
    return model


def rank_batches(
    dataset: Any, rows: Any, batch_size: int, epoch: Optional[int], seed: int
) -> Iterator[Batch]:
    """This rank's slice of every global batch (``batch_size`` rows), shuffled per epoch
    when ``epoch`` is given; the last incomplete global batch is dropped."""
    order = epoch_order(rows, epoch is not None, seed, epoch or 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = batch_size // world
    full = len(order) // batch_size * batch_size
    mine = order[:full].reshape(-1, world, local)[:, rank].reshape(-1)
    return iter(BatchIterator(dataset, mine, local, prefetch=2))


def auc_module(batch_size: int, device: torch.device) -> RecMetricModule:
    task = RecTaskInfo(
        name="ctr", label_name="label", prediction_name="prediction", weight_name="weight"
    )
    return generate_metric_module(
        RecMetricModule,
        MetricsConfig(
            rec_tasks=[task],
            rec_metrics={RecMetricEnum.AUC: RecMetricDef(rec_tasks=[task])},
            compute_on_all_ranks=True,
        ),
        batch_size=batch_size,
        world_size=dist.get_world_size(),
        my_rank=dist.get_rank(),
        state_metrics_mapping={},
        device=device,
        process_group=dist.group.WORLD,
    )


def evaluate(model: nn.Module, batches: Iterator[Batch], metric: RecMetricModule) -> float:
    model.eval()
    with torch.no_grad():
        for batch in batches:
            _, (_, logits, labels) = model(batch)
            metric.update(
                {
                    "prediction": torch.sigmoid(logits),
                    "label": labels.float(),
                    "weight": torch.ones_like(logits),
                }
            )
    result = metric.compute()
    model.train()
    # One window over the whole test set (RecMetricDef's default: 10M samples).
    return float(result["auc-ctr|window_auc"])


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(
        f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    )
    torch.manual_seed(args.seed)

    directory = Path(args.in_memory_binary_criteo_path)
    days = [str(directory / day.prefix) for day in find_npy_days(directory)]
    # TorchRec's example tests on the last day; one day is split at random instead.
    train_days, test_days = (days[:-1], days[-1:]) if len(days) > 1 else (days, [])
    dataset = open_dataset(
        "criteo-npy:" + ",".join(train_days),
        args.cache_dir,
        test_paths=test_days,
        hash_size=args.num_embeddings,
    )
    train_rows, _, test_rows = dataset.split(
        test_fraction=0.0 if test_days else 0.1, seed=args.seed
    )

    model = build_model(args, list(dataset.schema.sparse_names))
    sharders = get_default_sharders()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device=device.type),
        batch_size=args.batch_size // world,
    )
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders)

    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=args.learning_rate),
    )
    warmed = WarmupOptimizer(
        dense,
        stages=[
            WarmupStage(
                policy=WarmupPolicy.LINEAR,
                max_iters=args.warmup_steps,
                value=1.0 / max(args.warmup_steps, 1),
            )
        ],
        lr=args.learning_rate,
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, warmed])

    start_epoch = 0
    if args.resume:
        latest = max(Path(args.checkpoint_dir).glob("epoch_*"), key=lambda p: int(p.name[6:]))
        optimizer.init_state()  # the dense Adam's state tensors, for DCP to load into
        state = {"model": dmp.state_dict(), "optim": optimizer.state_dict()}
        # Checkpoints travel between people: read back without unpickling code.
        dcp.load(state, storage_reader=SafeFileSystemReader(latest), planner=SafeLoadPlanner())
        dmp.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start_epoch = int(latest.name[6:])

    aucs = []
    for epoch in range(start_epoch, args.epochs):
        pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
        batches = rank_batches(dataset, train_rows, args.batch_size, epoch, args.seed)
        steps = 0
        while True:
            try:
                pipeline.progress(batches)
            except StopIteration:
                break
            steps += 1
        pipeline.detach()
        test = rank_batches(dataset, test_rows, args.batch_size, None, args.seed)
        aucs.append(evaluate(dmp, test, auc_module(args.batch_size // world, device)))
        if rank == 0:
            print(f"epoch {epoch + 1}: {steps} steps, test AUC {aucs[-1]:.4f}", flush=True)
        if args.checkpoint_dir:
            dcp.save(
                {"model": dmp.state_dict(), "optim": optimizer.state_dict()},
                checkpoint_id=os.path.join(args.checkpoint_dir, f"epoch_{epoch + 1}"),
            )
    summary = {"epochs": args.epochs, "world_size": world, "test_auc": aucs}
    if rank == 0:
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()

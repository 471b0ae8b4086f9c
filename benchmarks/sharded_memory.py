"""Peak resident memory per rank of sharded training against one process.

DeepFM-shaped tables (Criteo Kaggle's 26 cardinalities scaled to ``--weights-gb`` of
weights: one ``--dim`` table and one dim-1 first-order table per feature) trained with
Adam + CowClip for a few steps on random single-hot batches, the way the trainer runs:

* ``one process``: the whole model in one process (``LocalRuntime``'s construction);
* ``2 ranks, <sharding>``: under ``torchrun``, the tables built on the meta device and
  ``DistributedModelParallel`` with the CowClip sharder allocating each rank's shards
  (``ShardedRuntime``'s construction).

Each case runs in its own processes, one after the other, and reports every process's
peak RSS (``VmHWM``) and the bytes of table weights plus optimizer state it holds.

Run (about 3 GB of weights, 9 GB with Adam state; a few minutes on 2 cores)::

    .venv/bin/python benchmarks/sharded_memory.py --weights-gb 3
    # a model one process on this machine cannot train with today's trainer:
    .venv/bin/python benchmarks/sharded_memory.py --weights-gb 5.33 --cases table_wise
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from torchrec_cowclip.optim.options import CowClipOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when imported by path
from common import REPO, RESULTS, format_table, vm_hwm_kib, write_json  # noqa: E402


def _cardinalities(weights_gb: float, dim: int) -> List[int]:
    from torchrec_cowclip.data.schema import CRITEO_KAGGLE_CARDINALITIES

    rows = sum(CRITEO_KAGGLE_CARDINALITIES)
    scale = weights_gb * 1e9 / (rows * (dim + 1) * 4)
    return [max(1, int(round(c * scale))) for c in CRITEO_KAGGLE_CARDINALITIES]


def _table_bytes(model: Any) -> int:
    """Bytes of table weights and optimizer state this process holds."""
    return sum(
        m.table_storage_bytes() for m in model.modules() if hasattr(m, "table_storage_bytes")
    )


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torchrec import KeyedJaggedTensor

    from torchrec_cowclip.models import build_model
    from torchrec_cowclip.optim.options import CowClip

    torch.manual_seed(0)
    before = vm_hwm_kib()
    cards = _cardinalities(args.weights_gb, args.dim)
    names = [f"C{i + 1}" for i in range(len(cards))]
    sharded = args.child != "one"
    t0 = time.perf_counter()
    model = build_model(
        "deepfm",
        num_dense=13,
        sparse_names=names,
        cardinalities=cards,
        embedding_dim=args.dim,
        hidden=(64, 64),
        init_seed=0,
        table_device="meta" if sharded else None,
        embedding_options=CowClipOptions(lr=1e-4, cowclip=CowClip(r=1.0, zeta=1e-5)),
    )
    world, rank = 1, 0
    if sharded:
        from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder
        from torchrec_cowclip.train.processes import init_distributed, shard_model

        ctx = init_distributed("cpu", 600)
        assert ctx is not None, "run the sharded cases under torchrun"
        world, rank = ctx.world_size, ctx.rank
        ebc = model.embedding_collection
        module = shard_model(
            model,
            [t.name for t in ebc.embedding_bag_configs()],
            [CowClipEmbeddingBagCollectionSharder(module_type=type(ebc))],
            args.child,
            ctx,
            args.batch_size,
        )
    else:
        module = model
    built_s = time.perf_counter() - t0
    dense = torch.optim.Adam(
        [p for n, p in module.named_parameters() if "embedding_bags" not in n], lr=1e-3
    )
    local = args.batch_size // world
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        ids = torch.cat([torch.randint(0, c, (local,), generator=gen) for c in cards])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=names, values=ids, lengths=torch.ones(len(cards) * local, dtype=torch.int64)
        )
        logits = module(torch.randn(local, 13, generator=gen), kjt)
        loss = F.binary_cross_entropy_with_logits(logits, torch.randint(0, 2, (local,)).float())
        loss.backward()
        dense.step()
        dense.zero_grad()
    print(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "before_kib": before,
                "peak_kib": vm_hwm_kib(),
                "table_bytes": _table_bytes(module),
                "build_s": built_s,
            }
        ),
        flush=True,
    )


def _run(case: str, args: argparse.Namespace) -> List[Dict[str, Any]]:
    common = [
        str(Path(__file__).resolve()),
        "--child",
        case,
        "--weights-gb",
        str(args.weights_gb),
        "--dim",
        str(args.dim),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
    ]
    if case == "one":
        cmd = [sys.executable, *common]
    else:
        cmd = [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            str(args.world),
            *common,
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{case} failed:\n{proc.stderr[-3000:]}")
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--weights-gb", type=float, default=3.0, help="table weights, GB (1e9 bytes)"
    )
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--cases", default="one,table_wise,row_wise", help="one, sharding types")
    parser.add_argument("--out", default=str(RESULTS / "sharded_memory.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows, one_peak = [], None
    for case in args.cases.split(","):
        for r in _run(case, args):
            peak_gib = r["peak_kib"] / 2**20
            if case == "one":
                one_peak = peak_gib
            rows.append(
                {
                    "case": "one process" if case == "one" else f"{r['world']} ranks, {case}",
                    "rank": r["rank"],
                    "peak_rss_gib": round(peak_gib, 2),
                    "tables_and_state_gib": round(r["table_bytes"] / 2**30, 2),
                    "vs_one_process": None if one_peak is None else round(peak_gib / one_peak, 3),
                    "build_s": round(r["build_s"], 1),
                }
            )
    columns = ["case", "rank", "peak_rss_gib", "tables_and_state_gib", "vs_one_process", "build_s"]
    print(format_table([columns] + [[str(r[c]) for c in columns] for r in rows]))
    write_json(args.out, {"weights_gb": args.weights_gb, "dim": args.dim, "rows": rows})


if __name__ == "__main__":
    main()

"""End-to-end DeepFM training throughput (samples/s) on synthetic Criteo-like data.

Variants (same model shape: 26 fields, D 10, DNN 400-400-400, 13 dense; same batches):

i.   ``ours``: ``build_model("deepfm", embedding_backend="cowclip")`` (Adam + CowClip fused
     into backward) plus ``torch.optim.Adam`` on ``model.dense_parameters()``, stepped
     through ``CTRTrainTask`` as the trainer does;
ii.  ``stock``: the same model with ``embedding_backend="torchrec"`` and one
     ``torch.optim.Adam`` over all parameters (dense gradients of the whole tables);
iii. ``dense-only``: ours with the embedding outputs replaced by a fixed precomputed
     tensor: the DNN + FM + linear part and its Adam alone;
iv.  ``deepctr``: deepctr-torch 0.2.9's ``DeepFM`` (if importable) with its own
     ``model.fit`` (its DataLoader included) on the same arrays, and ``deepctr lean``:
     the same model stepped on pre-built tensors, without its DataLoader;
v.   ``torchrec DMP + FBGEMM fused rowwise_adagrad``: TorchRec's production path, the
     stock model under ``DistributedModelParallel`` on one process (gloo) with
     ``EmbeddingBagCollectionSharder(fused_params={"optimizer": EXACT_ROWWISE_ADAGRAD,
     ...})``: the tables table-wise on FBGEMM's fused TBE (updated inside backward), the
     dense part by ``torch.optim.Adam``. FBGEMM's TBE takes only dims that are multiples
     of 4, so these anchors need ``--dim`` 12 (or 8, 16); the dim-1 first-order tables,
     which no TBE takes, are data-parallel dense tables (as TorchRec's planner places
     them), trained by the dense Adam;
vi.  ``... + WeightDecayMode.COWCLIP``: the same with FBGEMM's own CowClip mode.

i-iii and ``deepctr lean`` step on pre-built batches (data loading excluded) and are
interleaved: each round runs every variant once, order rotated per round, so other jobs
on the machine slow all of them alike; ``deepctr fit`` runs once per round on
``--fit-steps`` batches. Reported: median samples/s and paired ratios.

With ``--memory`` (the default) each variant then runs again in its own subprocess at the
largest batch size (data, model, 3 steps) for its peak RSS (``VmHWM``), which also reports
the optimizer-state bytes per embedding id (ours: the fused optimizer's state; stock and
deepctr: Adam's moments of the tables; dense-only: none). Writes ``end_to_end.json``,
``end_to_end.csv``, ``end_to_end_memory.csv`` and ``end_to_end.png`` (with matplotlib) to
``--out``.

deepctr-torch imports TensorFlow only for Keras' ``CallbackList``/``History``; when
TensorFlow is absent this script installs a small stand-in for those two classes
(no effect on the math of a training step).

Run (about 5 minutes on 2 cores)::

    .venv/bin/python benchmarks/end_to_end.py
    .venv/bin/python benchmarks/end_to_end.py --max-cardinality 100000 --batch-sizes 1024,16384 --with-128k
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import sys
import tempfile
import time
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by path
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import (  # noqa: E402
    RESULTS,
    Timing,
    child_memory,
    cpu_model,
    format_table,
    grouped_bars,
    load_average,
    optimizer_state_bytes,
    run_interleaved,
    self_command,
    vm_hwm_kib,
    write_csv,
    write_json,
    write_png,
)

from torchrec_cowclip import CowClip, CowClipOptions, compat  # noqa: E402
from torchrec_cowclip.data import open_dataset  # noqa: E402
from torchrec_cowclip.models import build_model, fm_second_order  # noqa: E402
from torchrec_cowclip.models.task import CTRTrainTask  # noqa: E402

DENSE_LR = 8e-4
EMB_LR = 1e-4
DIM = 10
HIDDEN = (400, 400, 400)


def tf_callbacks_stub() -> None:
    """Minimal ``tensorflow.python.keras.callbacks`` for deepctr-torch's imports."""
    if "tensorflow" in sys.modules:
        return
    try:
        import tensorflow  # noqa: F401

        return
    except ImportError:
        pass

    class Callback:
        def __init__(self, *a: Any, **k: Any) -> None:
            self.model = None

        def set_model(self, model: Any) -> None:
            self.model = model

        def __getattr__(self, name: str) -> Callable[..., None]:
            if name.startswith("on_"):
                return lambda *a, **k: None
            raise AttributeError(name)

    class History(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.history: Dict[str, List[float]] = {}

        def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, float]] = None) -> None:
            for k, v in (logs or {}).items():
                self.history.setdefault(k, []).append(v)

    class CallbackList(Callback):
        def __init__(self, callbacks: Sequence[Any] = ()) -> None:
            super().__init__()
            self.callbacks = list(callbacks)

        def set_model(self, model: Any) -> None:
            self.model = model
            for c in self.callbacks:
                c.set_model(model)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            for c in self.callbacks:
                c.on_epoch_end(epoch, logs)

    mod = types.ModuleType("tensorflow.python.keras.callbacks")
    mod.Callback, mod.History, mod.CallbackList = Callback, History, CallbackList
    mod.EarlyStopping = mod.ModelCheckpoint = Callback
    for name in ("tensorflow", "tensorflow.python", "tensorflow.python.keras"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["tensorflow.python.keras.callbacks"] = mod


def build_deepctr(names: Sequence[str], cards: Sequence[int], n_dense: int) -> Any:
    tf_callbacks_stub()
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import DeepFM

    cols = [
        SparseFeat(f"C{i}", vocabulary_size=int(c), embedding_dim=DIM) for i, c in enumerate(cards)
    ]
    cols += [DenseFeat(f"I{i}", 1) for i in range(n_dense)]
    model = DeepFM(cols, cols, dnn_hidden_units=HIDDEN, task="binary", device="cpu")
    model.compile(torch.optim.Adam(model.parameters(), lr=DENSE_LR), "binary_crossentropy")
    return model


OURS = "ours (cowclip backend)"
STOCK = "stock (torchrec EBC + Adam)"
DENSE = "dense-only (fixed embeddings)"
FIT = "deepctr-torch fit()"
LEAN = "deepctr-torch lean loop"
FBGEMM = "torchrec DMP + FBGEMM fused rowwise_adagrad"
FBGEMM_COWCLIP = "torchrec DMP + FBGEMM rowwise_adagrad COWCLIP"
MODEL_OF = {
    OURS: "ours",
    STOCK: "stock",
    DENSE: "dense",
    FIT: "deepctr",
    LEAN: "deepctr",
    FBGEMM: "fbgemm",
    FBGEMM_COWCLIP: "fbgemm_cowclip",
}
MEMORY_FIELDS = ["variant", "batch_size", "peak_mib", "delta_mib", "state_bytes_per_row", "error"]


def build_dmp_fbgemm(
    names: Sequence[str], cards: Sequence[int], n_dense: int, dim: int, cowclip_mode: bool
) -> Tuple[Any, torch.optim.Optimizer, Any]:
    """The stock model under ``DistributedModelParallel`` (one process, gloo) with
    FBGEMM's fused row-wise Adagrad through ``fused_params`` (and its COWCLIP mode)."""
    import torch.distributed as dist
    from common import ADAGRAD_LR, EPS, fbgemm_cowclip_options
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    if dim % 4:
        raise ValueError(f"FBGEMM's TBE needs a dim that is a multiple of 4, got {dim}")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        compat.import_modules_holding_the_default_group()  # a group that dies with main()
        dist.init_process_group("gloo", rank=0, world_size=1)
    model = build_model(
        "deepfm",
        embedding_backend="torchrec",
        sparse_names=names,
        cardinalities=cards,
        num_dense=n_dense,
        embedding_dim=dim,
        hidden=HIDDEN,
        table_device="meta",
    )
    fused: Dict[str, Any] = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": ADAGRAD_LR,
        "eps": EPS,
    }
    if cowclip_mode:
        fused.update(fbgemm_cowclip_options())
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    constraints = {
        t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
        if t.embedding_dim % 4 == 0
        else ParameterConstraints(sharding_types=["data_parallel"])
        for t in model.fields.collection.embedding_bag_configs()
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=plan,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
    )
    params = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adam(params, lr=DENSE_LR), CTRTrainTask(dmp)


def build_models(
    kinds: Sequence[str],
    names: Sequence[str],
    cards: Sequence[int],
    n_dense: int,
    dim: int = DIM,
) -> Dict[str, Tuple[Any, torch.optim.Optimizer, Any]]:
    """``(model, optimizer, task or None)`` of each of ``kinds`` (ours, stock, dense,
    deepctr, fbgemm, fbgemm_cowclip), built in that order."""
    common = dict(sparse_names=names, cardinalities=cards, num_dense=n_dense, embedding_dim=dim)
    common.update(
        hidden=HIDDEN,
        embedding_options=CowClipOptions(lr=EMB_LR, cowclip=CowClip.from_reference(1.0, 1e-5, dim)),
    )
    built: Dict[str, Tuple[Any, torch.optim.Optimizer, Any]] = {}
    # kind -> (embedding backend, trained as a task, dense parameters only)
    recipes = {
        "ours": ("cowclip", True, True),
        "stock": ("torchrec", True, False),
        "dense": ("cowclip", False, True),
    }
    for kind, (backend, as_task, dense_only) in recipes.items():
        if kind not in kinds:
            continue
        model = build_model("deepfm", embedding_backend=backend, **common)
        params = model.dense_parameters() if dense_only else model.parameters()
        task = CTRTrainTask(model) if as_task else None
        built[kind] = (model, torch.optim.Adam(params, lr=DENSE_LR), task)
    if "deepctr" in kinds:
        deepctr = build_deepctr(names, cards, n_dense)
        built["deepctr"] = (deepctr, deepctr.optim, None)
    for kind in ("fbgemm", "fbgemm_cowclip"):
        if kind in kinds:
            built[kind] = build_dmp_fbgemm(names, cards, n_dense, dim, kind == "fbgemm_cowclip")
    return built


def task_step(task: Any, opt: torch.optim.Optimizer) -> Callable[[Any], None]:
    """A trainer step through ``CTRTrainTask``: loss, backward, the dense optimizer."""

    def step(b: Any) -> None:
        loss, _ = task(b)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def variant_steps(
    built: Dict[str, Tuple[Any, torch.optim.Optimizer, Any]], ds: Any, bs: int, fit_steps: int
) -> Tuple[Dict[str, Callable[[Any], None]], List[Any]]:
    """One training step per variant of the ``built`` models, and the two batches of
    batch size ``bs`` they step on."""
    batches = [b for _, b in zip(range(2), ds.batches(np.arange(2 * bs), bs))]
    by_id = {id(b): k for k, b in enumerate(batches)}
    variants: Dict[str, Callable[[Any], None]] = {}
    for kind, name in (
        ("ours", OURS),
        ("stock", STOCK),
        ("fbgemm", FBGEMM),
        ("fbgemm_cowclip", FBGEMM_COWCLIP),
    ):
        if kind in built:
            _, opt, task = built[kind]
            variants[name] = task_step(task, opt)
    if "dense" in built:
        dense_model, dense_opt, _ = built["dense"]
        fixed = []
        with torch.no_grad():
            for b in batches:
                emb, first = dense_model.fields(b.sparse_features)
                fixed.append((emb.clone(), first.clone()))

        def dense_step(b: Any) -> None:
            emb, first = fixed[by_id[id(b)]]
            dense = b.dense_features
            m = dense_model
            logit = (
                m.linear(first, dense)
                + fm_second_order(emb)
                + m.deep([emb, dense.unsqueeze(2)]).squeeze(1)
            )
            F.binary_cross_entropy_with_logits(logit, b.labels.float()).backward()
            dense_opt.step()
            dense_opt.zero_grad()

        variants[DENSE] = dense_step
    if "deepctr" in built:
        deepctr = built["deepctr"][0]
        n_sparse, n_dense = len(ds.schema.sparse_names), ds.schema.n_dense
        sl = slice(0, fit_steps * bs)
        x_dict = {f"C{i}": np.asarray(ds.sparse[sl, i]).astype(np.int64) for i in range(n_sparse)}
        dense_inputs = ds.dense_inputs(np.arange(sl.start, sl.stop))  # as the trainer's batches
        x_dict.update({f"I{i}": dense_inputs[:, i] for i in range(n_dense)})
        y = np.asarray(ds.labels[sl]).astype(np.float32)
        # deepctr's own input layout, for the lean loop
        order = sorted(deepctr.feature_index, key=lambda k: deepctr.feature_index[k][0])
        lean_x = [
            torch.from_numpy(
                np.stack([x_dict[k][k2 * bs : (k2 + 1) * bs].astype(np.float32) for k in order], 1)
            )
            for k2 in range(2)
        ]
        lean_y = [torch.from_numpy(y[k2 * bs : (k2 + 1) * bs]) for k2 in range(2)]

        def deepctr_fit(b: Any) -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                deepctr.fit(dict(x_dict), y, batch_size=bs, epochs=1, verbose=0, shuffle=True)

        def deepctr_lean(b: Any) -> None:
            k = by_id[id(b)]
            pred = deepctr(lean_x[k]).squeeze()
            loss = (
                F.binary_cross_entropy(pred, lean_y[k], reduction="sum")
                + deepctr.get_regularization_loss()
            )
            deepctr.optim.zero_grad()
            loss.backward()
            deepctr.optim.step()

        variants[FIT] = deepctr_fit
        variants[LEAN] = deepctr_lean
    return variants, batches


def state_bytes_per_row(
    kind: str, model: Any, optimizer: torch.optim.Optimizer, rows: int
) -> float:
    """Optimizer-state bytes of the embedding tables per id (``rows``: ids of all
    fields): its D-dim row and its first-order (dim 1) weight together; the dense
    layers' state is left out."""
    if kind == "ours":
        total = optimizer_state_bytes(model.embedding_collection.fused_optimizer)
    elif kind == "stock":
        total = optimizer_state_bytes(optimizer, model.embedding_collection.parameters())
    elif kind == "deepctr":
        total = optimizer_state_bytes(
            optimizer, [p for n, p in model.named_parameters() if "embedding_dict" in n]
        )
    else:
        total = 0  # dense-only: fixed embeddings, no embedding optimizer
    return total / rows


def memory_child(args: argparse.Namespace) -> None:
    """Peak RSS of one variant at one batch size: data, model, 3 steps; prints JSON."""
    ds = open_dataset(
        f"synthetic:{args.rows}", args.cache_dir, max_cardinality=args.max_cardinality
    )
    names, cards = list(ds.schema.sparse_names), list(ds.schema.cardinalities)
    kind = MODEL_OF[args.memory_child]
    torch.manual_seed(0)
    gc.collect()
    before = vm_hwm_kib()
    built = build_models([kind], names, cards, ds.schema.n_dense, args.dim)
    variants, batches = variant_steps(built, ds, args.batch_sizes[0], args.fit_steps)
    for k in range(3):
        variants[args.memory_child](batches[k % len(batches)])
    peak = vm_hwm_kib()
    model, optimizer, _ = built[kind]
    print(
        json.dumps(
            {
                "before_kib": before,
                "peak_kib": peak,
                "state_bytes_per_row": state_bytes_per_row(kind, model, optimizer, sum(cards)),
            }
        )
    )


def measure_memory(args: argparse.Namespace, variant: str, rows: int, bs: int) -> Dict[str, Any]:
    flags = dict(rows=rows, batch_sizes=bs, max_cardinality=args.max_cardinality)
    flags.update(cache_dir=args.cache_dir, fit_steps=args.fit_steps, dim=args.dim)
    cmd = self_command(__file__, "--memory-child", variant, **flags)
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return {"variant": variant, "batch_size": bs, **child_memory(cmd)}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=300_000, help="synthetic rows generated")
    p.add_argument("--max-cardinality", type=int, default=1_000_000)
    p.add_argument(
        "--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 16384]
    )
    p.add_argument("--with-128k", action="store_true", help="also batch 131072")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--time-limit", type=float, default=120.0, help="seconds of timed rounds per batch size"
    )
    p.add_argument("--fit-steps", type=int, default=2, help="batches per deepctr model.fit call")
    p.add_argument(
        "--steps-per-round",
        type=int,
        default=4,
        help="consecutive steps of one variant per round: training runs one model "
        "step after step, so a variant is timed with warm caches rather than "
        "right after another variant evicted them (1: strict alternation)",
    )
    p.add_argument("--no-deepctr", action="store_true")
    p.add_argument("--dim", type=int, default=DIM, help="embedding dim (the paper's: 10)")
    p.add_argument(
        "--no-stock", action="store_true", help="leave out the stock EBC + dense Adam variant"
    )
    p.add_argument(
        "--anchors",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the TorchRec DMP + FBGEMM fused anchors (default: on when --dim is a multiple "
        "of 4, which FBGEMM's TBE requires)",
    )
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="peak RSS of each variant in its own subprocess at the largest batch "
        "size (data, model, 3 steps) and optimizer-state bytes per embedding row",
    )
    p.add_argument(
        "--cache-dir", default=os.path.join(tempfile.gettempdir(), "cowclip_bench_cache")
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--out",
        default=str(RESULTS),
        help="directory for end_to_end.{json,csv,png} and end_to_end_memory.csv",
    )
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return {}
    sizes = args.batch_sizes + ([131072] if args.with_128k else [])
    torch.manual_seed(0)

    t0 = time.perf_counter()
    rows = max(args.rows, max(sizes) * max(2, args.fit_steps))
    ds = open_dataset(f"synthetic:{rows}", args.cache_dir, max_cardinality=args.max_cardinality)
    names, cards = list(ds.schema.sparse_names), list(ds.schema.cardinalities)
    n_dense = ds.schema.n_dense
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU: {cpu_model()}")
    print(
        f"synthetic:{rows} ({time.perf_counter() - t0:.0f} s), {len(names)} sparse + {n_dense} dense, "
        f"cardinalities capped at {args.max_cardinality:,}: {sum(cards):,} rows per D={args.dim} table set"
    )

    anchors = args.anchors if args.anchors is not None else args.dim % 4 == 0
    if not anchors:
        print(f"no FBGEMM anchors: its TBE needs a dim that is a multiple of 4 (--dim {args.dim})")
    print(f"load average before: {load_average()}")
    kinds = ["ours", "dense"] + ([] if args.no_stock else ["stock"])
    kinds += ["fbgemm", "fbgemm_cowclip"] if anchors else []
    built = build_models(kinds, names, cards, n_dense, args.dim)
    deepctr_error = None
    if not args.no_deepctr:
        try:
            built.update(build_models(["deepctr"], names, cards, n_dense))
        except Exception as e:  # noqa: BLE001
            deepctr_error = f"{type(e).__name__}: {e}"
            print(f"deepctr-torch unavailable: {deepctr_error}")

    results: List[Dict[str, Any]] = []
    for bs in sizes:
        variants, batches = variant_steps(built, ds, bs, args.fit_steps)
        print(
            f"\nbatch {bs:,}: {args.warmup} warm-up + up to {args.rounds} interleaved rounds ...",
            flush=True,
        )
        k = max(args.steps_per_round, 1)
        blocks = {name: (lambda b, f=f: [f(b) for _ in range(k)]) for name, f in variants.items()}
        timings = run_interleaved(blocks, batches, args.rounds, args.warmup, args.time_limit)
        steps_per_call = {name: k * (args.fit_steps if "fit()" in name else 1) for name in variants}
        sps = {
            n: Timing([steps_per_call[n] * bs / (ms / 1e3) for ms in t.samples])
            for n, t in timings.items()
        }
        for name, t in sps.items():
            results.append(
                {
                    "batch_size": bs,
                    "variant": name,
                    "samples_per_s_median": t.median,
                    "ms_per_step_median": statistics.median(timings[name].samples)
                    / steps_per_call[name],
                    "rounds": len(t.samples),
                    "ours_over_this_paired": statistics.median(
                        a / b for a, b in zip(sps[OURS].samples, t.samples)
                    ),
                }
            )

    memory: List[Dict[str, Any]] = []
    if args.memory:
        del batches, variants, blocks
        gc.collect()
        print(f"\npeak RSS per variant, own subprocess, batch {max(sizes):,} ...", flush=True)
        for name in dict.fromkeys(r["variant"] for r in results):
            memory.append(measure_memory(args, name, rows, max(sizes)))
        if "deepctr" not in built:
            print("deepctr-torch not measured: " + (deepctr_error or "--no-deepctr"))

    out = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "max_cardinality": args.max_cardinality,
        "total_rows": sum(cards),
        "results": results,
        "memory": memory,
        "deepctr_error": deepctr_error,
        "dim": args.dim,
        "load_average_after": load_average(),
    }
    write_json(os.path.join(args.out, "end_to_end.json"), out)
    write_csv(os.path.join(args.out, "end_to_end.csv"), results)
    if memory:
        write_csv(
            os.path.join(args.out, "end_to_end_memory.csv"),
            memory,
            MEMORY_FIELDS,
            restval="",
            extrasaction="ignore",
        )
    write_png(
        os.path.join(args.out, "end_to_end.png"),
        grouped_bars(
            results,
            lambda r: r["batch_size"],
            lambda bs: f"batch {bs:,}",
            "samples_per_s_median",
            "samples / s (median)",
            title="DeepFM training throughput",
        ),
    )

    if memory:
        mem = [["variant", "peak RSS MiB", "delta MiB", "state B/row"]]
        for m in memory:
            mem.append(
                [
                    m["variant"],
                    f"{m['peak_mib']:.0f}",
                    f"{m['delta_mib']:.0f}",
                    f"{m['state_bytes_per_row']:.0f}",
                ]
                if "error" not in m
                else [m["variant"], "error", m["error"][:60], ""]
            )
        print(
            f"\npeak RSS (VmHWM) of one variant per subprocess (data, model, 3 steps), batch {max(sizes):,} "
            "(delta: over the peak before the model was built); state B/row: embedding optimizer "
            "state per id (its D-dim row and first-order weight)"
        )
        print(format_table(mem))
    table = [["batch", "variant", "samples/s", "ms/step", "rounds", "ours/this"]]
    for r in results:
        table.append(
            [
                f"{r['batch_size']:,}",
                r["variant"],
                f"{r['samples_per_s_median']:,.0f}",
                f"{r['ms_per_step_median']:.1f}",
                str(r["rounds"]),
                f"{r['ours_over_this_paired']:.2f}",
            ]
        )
    print(
        "\nDeepFM training throughput, median over interleaved rounds; ours/this = paired ratio of "
        "samples/s (>1: ours faster); deepctr fit() includes its DataLoader"
    )
    print(format_table(table))
    for bs in sizes:
        rows_bs = {r["variant"]: r for r in results if r["batch_size"] == bs}
        anchors_bs = [rows_bs[n] for n in (FBGEMM, FBGEMM_COWCLIP) if n in rows_bs]
        line = f"batch {bs:,}:"
        if anchors_bs:
            faster = max(anchors_bs, key=lambda r: r["samples_per_s_median"])
            line += f" ours / faster anchor ({faster['variant']}) = {faster['ours_over_this_paired']:.2f};"
        if DENSE in rows_bs:
            line += (
                f" ours = {rows_bs[DENSE]['ours_over_this_paired']:.0%} of the dense-only ceiling"
            )
        print(line)
    print(f"load average after: {load_average()}")
    if deepctr_error:
        print(f"deepctr-torch FAILED: {deepctr_error}")
    if torch.distributed.is_initialized():  # the DMP variants' group, its threads with it
        torch.distributed.destroy_process_group()
    return out


if __name__ == "__main__":
    main()

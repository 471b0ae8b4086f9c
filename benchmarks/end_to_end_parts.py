"""Where a DeepFM training step's time goes beyond its dense part.

The model and data of ``end_to_end.py`` (DeepFM D 10, DNN 400-400-400, synthetic
Criteo-like data with tables capped at 1M rows), each part timed alone (median of
``--steps`` after 3 warm-up steps, the two batches alternating):

- dense-only: the dense part on fixed embeddings (``end_to_end.py``'s dense-only variant);
- dense + input grads: the same, with the gradient w.r.t. the fixed embeddings that a
  trained embedding needs (through the FM term and the first DNN layer);
- embedding forward: the CowClip collection's pooled lookup alone (no grad);
- embedding fwd+bwd+update: the lookup and a backward that runs the fused update;
- full step: all of it (forward, backward with the fused update, dense Adam),
  with the compiled and with the eager update.

    .venv/bin/python benchmarks/end_to_end_parts.py      # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by path
from common import paper_deepfm  # noqa: E402

from torchrec_cowclip.data import open_dataset  # noqa: E402
from torchrec_cowclip.models.deepfm import fm_second_order  # noqa: E402
from torchrec_cowclip.models.task import CTRTrainTask  # noqa: E402
from torchrec_cowclip.optim.row_step import set_compiled_update  # noqa: E402


def median_ms(step: Callable[[int], None], steps: int) -> float:
    for k in range(3):
        step(k % 2)
    times: List[float] = []
    for k in range(steps):
        start = time.perf_counter()
        step(k % 2)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _parts(model: Any, batches: List[Any], steps: int, label: str, dense: bool) -> Dict[str, float]:
    """The parts of a step of ``model`` (its tables on the ``label`` path), each timed
    alone; the dense ones too when ``dense``."""
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=1e-3)
    task = CTRTrainTask(model)
    with torch.no_grad():
        fixed = [tuple(t.clone() for t in model.fields(b.sparse_features)) for b in batches]

    def dense_step(k: int, input_grads: bool) -> None:
        emb, first = fixed[k]
        if input_grads:
            emb, first = emb.detach().requires_grad_(True), first.detach().requires_grad_(True)
        dense = batches[k].dense_features
        logit = (
            model.linear(first, dense)
            + fm_second_order(emb)
            + model.deep([emb, dense.unsqueeze(2)]).squeeze(1)
        )
        F.binary_cross_entropy_with_logits(logit, batches[k].labels.float()).backward()
        dense_opt.step()
        dense_opt.zero_grad()

    def full_step(k: int) -> None:
        loss, _ = task(batches[k])
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()

    def embedding_forward(k: int) -> None:
        with torch.no_grad():
            model.fields(batches[k].sparse_features)

    def embedding_update(k: int) -> None:
        emb, first = model.fields(batches[k].sparse_features)
        (emb.sum() + first.sum()).backward()

    results: Dict[str, float] = {}
    if dense:
        results["dense-only"] = median_ms(lambda k: dense_step(k, False), steps)
        results["dense + input grads"] = median_ms(lambda k: dense_step(k, True), steps)
    results[f"embedding forward ({label})"] = median_ms(embedding_forward, steps)
    results[f"embedding fwd+bwd+update ({label})"] = median_ms(embedding_update, steps)
    results[f"full step ({label})"] = median_ms(full_step, steps)
    return results


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--rows", type=int, default=270_000)
    p.add_argument("--max-cardinality", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--cache-dir", default=os.path.join(tempfile.gettempdir(), "cowclip_bench_cache")
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bs = args.batch_size
    ds = open_dataset(
        f"synthetic:{max(args.rows, 2 * bs)}", args.cache_dir, max_cardinality=args.max_cardinality
    )
    batches = [b for _, b in zip(range(2), ds.batches(np.arange(2 * bs), bs))]
    results: Dict[str, float] = {}
    for mode, label in (("1", "compiled"), ("0", "eager")):
        # The tables' row kernel is chosen when they are built: one model per path, the
        # same initial weights (the same seed).
        previous = set_compiled_update(mode)
        model = paper_deepfm(ds.schema, embedding_backend="cowclip")
        set_compiled_update(previous)
        results.update(_parts(model, batches, args.steps, label, dense=not results))
    full = results["full step (compiled)"]
    print(
        f"\nDeepFM, batch {bs:,}, {torch.get_num_threads()} threads, median ms of {args.steps} steps"
    )
    width = max(len(k) for k in results)
    for name, ms in results.items():
        print(f"{name:<{width}}  {ms:8.1f}")
    print(
        f"dense-only / full step (compiled) = {results['dense-only'] / full:.2f}; "
        f"with free embeddings it would be {results['dense-only'] / results['dense + input grads']:.2f}"
    )
    return results


if __name__ == "__main__":
    main()

"""What TorchRec's quantized inference tables cost in AUC: one trained model, its test
file scored with the tables as trained (fp32), int8 rowwise and fp16
(``torchrec_cowclip.load_model(..., quantize=...)``: ``torchrec.inference``'s
``quantize_embeddings``, FBGEMM's table-batched lookup), side by side in one run.

The data is a table CSV drawn from the synthetic generator's planted click model (so the
run goes through the vocabulary path of a real file: ``table:`` with an exact
vocabulary), written once under ``--work``; the model is trained there unless ``--run``
names a finished run whose test file is ``--test``.

Example (the figures of docs/serving.md)::

    python benchmarks/quantized_tables.py --rows 300000 --work /tmp/quantized
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path
from typing import Any, Dict

import numpy as np
from common import cpu_model, load_average

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]


def write_table(path: Path, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["label", *DENSE, *SPARSE])
        for d, s, y in zip(dense.tolist(), sparse.tolist(), labels.tolist()):
            values = ["" if v != v else int(v) for v in d]
            writer.writerow([int(y), *values, *[format(v, "x") for v in s]])


def make_files(work: Path, rows: int, scale: float, cap: int, seed: int) -> Dict[str, Path]:
    from torchrec_cowclip.data.sources.synthetic import PlantedModel, SyntheticConfig

    train, test = work / "train.csv", work / "test.csv"
    if train.exists() and test.exists():
        return {"train": train, "test": test}
    config = SyntheticConfig(rows=rows, seed=seed, cardinality_scale=scale, max_cardinality=cap)
    chunks = list(PlantedModel(config).chunks())
    dense = np.concatenate([c.dense_raw for c in chunks])
    sparse = np.concatenate([c.sparse for c in chunks])
    labels = np.concatenate([c.labels for c in chunks])
    cut = int(rows * 0.8)
    write_table(train, dense[:cut], sparse[:cut], labels[:cut])
    write_table(test, dense[cut:], sparse[cut:], labels[cut:])
    return {"train": train, "test": test}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=300_000, help="rows drawn (80%% train, 20%% test)")
    p.add_argument("--scale", type=float, default=0.05, help="--synthetic-scale of the tables")
    p.add_argument("--max-cardinality", type=int, default=50_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, required=True, help="where the files and the run go")
    p.add_argument("--run", type=Path, default=None, help="a finished run to score instead")
    p.add_argument("--test", type=Path, default=None, help="its test file (with --run)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()

    import torch

    import torchrec_cowclip
    from torchrec_cowclip.train import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.run is None:
        files = make_files(args.work, args.rows, args.scale, args.max_cardinality, args.seed)
        run, test = args.work / "run", files["test"]
        if not (run / "model").exists():
            train(
                TrainConfig(
                    model="deepfm",
                    data=f"table:{files['train']}",
                    test_data=f"table:{test}",
                    label="label",
                    dense=DENSE,
                    sparse=SPARSE,
                    batch_size=args.batch_size,
                    epochs=args.epochs,
                    hidden=(64, 64),
                    lr_embed=1e-2,
                    out=str(run),
                    cache_dir=str(args.work / "cache"),
                    seed=args.seed,
                    progress=False,
                )  # fmt: skip
            )
    else:
        run, test = args.run, args.test
    results: Dict[str, Any] = {}
    for tables in (None, "int8", "fp16"):
        model = torchrec_cowclip.load_model(run, quantize=tables)
        start = time.perf_counter()
        metrics = model.evaluate(str(test))
        seconds = time.perf_counter() - start
        results[tables or "fp32"] = {
            "auc": metrics["auc"],
            "logloss": metrics["logloss"],
            "rows": metrics["rows"],
            "score_seconds": round(seconds, 2),
        }
    base = results["fp32"]["auc"]
    for name in ("int8", "fp16"):
        results[name]["auc_change"] = results[name]["auc"] - base
    report = {
        "run": str(run),
        "test": str(test),
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "load_average": load_average(),
        "tables": results,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

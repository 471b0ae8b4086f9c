"""Train DeepFM with CowClip on Criteo files, with the paper's scaling rule.

On the Kaggle ``train.txt`` or the 1TB ``day_N`` files (comma-separate several), at the
batch the paper scales to::

    .venv/bin/python examples/train_deepfm_criteo.py /data/criteo/train.txt --batch-size 16384

The first run converts the files to a memory-mapped cache in ``data_cache/``; later runs
reuse it. Without a path it trains on the 200 sample rows shipped in ``tests/data`` at
batch 64 (180 training rows: two steps), which shows that the pipeline runs and is far
too small for an AUC claim::

    .venv/bin/python examples/train_deepfm_criteo.py

It writes ``runs/deepfm-criteo/`` (``metrics.json``, logs; a re-run replaces it).
"""

import argparse
from pathlib import Path

from torchrec_cowclip.train import TrainConfig, train

OUT = "runs/deepfm-criteo"
SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "criteo_sample.tsv"
BATCH, SAMPLE_BATCH = 16384, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "path", nargs="?", default=None, help="Criteo files (default: the 200 sample rows)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"default: {BATCH:,} ({SAMPLE_BATCH} on the sample rows)",
    )
    parser.add_argument("--epochs", type=int, default=1, help="default: 1")
    parser.add_argument(
        "--out", default=OUT, help=f"run directory, replaced by a re-run (default: {OUT})"
    )
    parser.add_argument("--cache-dir", default="data_cache", help="default: data_cache")
    args = parser.parse_args()
    batch = args.batch_size or (BATCH if args.path else SAMPLE_BATCH)
    metrics = train(
        TrainConfig(
            model="deepfm",
            data=f"criteo:{args.path or SAMPLE}",
            batch_size=batch,  # dense lr, L2 and CowClip's zeta follow the scaling rule
            epochs=args.epochs,
            out=args.out,
            overwrite=True,  # an example re-run replaces its previous run
            cache_dir=args.cache_dir,
        )
    )
    print(
        f"AUC {metrics['auc']:.4f}  log-loss {metrics['logloss']:.4f}  "
        f"{metrics['train_samples_per_s']:,.0f} samples/s  "
        f"clipped {metrics['rows_clipped']} of {metrics['rows_updated']} row updates"
    )


if __name__ == "__main__":
    main()

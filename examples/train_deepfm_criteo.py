"""Train DeepFM with CowClip on Criteo files, with the paper's scaling rule.

    .venv/bin/python examples/train_deepfm_criteo.py /data/criteo/train.txt --batch-size 16384

Works on the Kaggle ``train.txt`` or on 1TB ``day_N`` files (comma-separate several);
the first run converts them to a memory-mapped cache in ``data_cache/``, later runs
reuse it. Without a path it trains on the 200 sample rows shipped in tests/data,
which only shows that the pipeline runs (too small for an AUC claim).
"""

import argparse
from pathlib import Path

from torchrec_cowclip.train import TrainConfig, train

OUT = "runs/deepfm-criteo"
SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "criteo_sample.tsv"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path", nargs="?", default=str(SAMPLE))
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--out", default=OUT, help="run directory (a previous example run there is replaced)"
    )
    parser.add_argument("--cache-dir", default="data_cache")
    args = parser.parse_args()
    metrics = train(
        TrainConfig(
            model="deepfm",
            data=f"criteo:{args.path}",
            batch_size=args.batch_size,  # dense lr, L2 and CowClip's zeta follow the scaling rule
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

"""Train DCN with CowClip on Avazu (``train`` CSV with header, label ``click``).

    .venv/bin/python examples/train_dcn_avazu.py /data/avazu/train --batch-size 16384

The Avazu profile of the scaling rule applies (dense lr 1e-4 * sqrt(batch/1024), L2
1e-5 * batch/1024, CowClip bound 1e-4). Without a path it runs on the 100 sample rows
shipped in tests/data (pipeline check only).
"""

import argparse
from pathlib import Path

from torchrec_cowclip.train import TrainConfig, train

OUT = "runs/dcn-avazu"
SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "avazu_sample.csv"


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
            model="dcn",
            data=f"avazu:{args.path}",
            batch_size=args.batch_size,
            epochs=args.epochs,
            test_fraction=0.2,  # the reference's 80/20 split for Avazu
            out=args.out,
            overwrite=True,  # an example re-run replaces its previous run
            cache_dir=args.cache_dir,
        )
    )
    print(f"AUC {metrics['auc']:.4f}  log-loss {metrics['logloss']:.4f}")


if __name__ == "__main__":
    main()

"""Train DCN with CowClip on Avazu (the ``train`` CSV with its header, label ``click``).

The Avazu profile of the scaling rule applies (dense lr 1e-4 * sqrt(batch/1024), L2
1e-5 * batch/1024, CowClip bound 1e-4), with the reference's 80/20 split::

    .venv/bin/python examples/train_dcn_avazu.py /data/avazu/train --batch-size 16384

Without a path it runs on the 100 sample rows shipped in ``tests/data`` at batch 32 (80
training rows: two steps), a check that the pipeline runs, not an AUC claim::

    .venv/bin/python examples/train_dcn_avazu.py

It writes ``runs/dcn-avazu/`` (a re-run replaces it).
"""

import argparse
from pathlib import Path

from torchrec_cowclip.train import TrainConfig, train

OUT = "runs/dcn-avazu"
SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "avazu_sample.csv"
BATCH, SAMPLE_BATCH = 16384, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "path", nargs="?", default=None, help="Avazu files (default: the 100 sample rows)"
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
    metrics = train(
        TrainConfig(
            model="dcn",
            data=f"avazu:{args.path or SAMPLE}",
            batch_size=args.batch_size or (BATCH if args.path else SAMPLE_BATCH),
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

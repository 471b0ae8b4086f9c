"""Two generated click logs for the README's "your first model on your own data": a small,
dense one and a larger, sparse one, written as CSV files a data scientist would have.

Each row's click is drawn from a planted logistic model: a per-value effect of every
categorical column (values drawn Zipf-like, so a few are frequent and most are rare), a
pairwise effect of two columns (what the embeddings' interactions can find and a
logistic regression on one-hot columns cannot), and two numeric columns (a count and a
signed score). The base rate is about 20% clicks.

- ``small``: 20,000 rows, 5 categorical columns of 10-200 values each (every value
  frequent): what a first export of a week of one campaign looks like.
- ``sparse``: 200,000 rows, 8 categorical columns of 100-50,000 values (most values seen
  a handful of times): a site's log with user and ad ids.

Usage (the README's commands)::

    .venv/bin/python benchmarks/click_logs.py --out runs/logs
    # -> runs/logs/small.csv, runs/logs/sparse.csv

Example::

    >>> import tempfile
    >>> paths = write_logs(Path(tempfile.mkdtemp()), scale=0.01)  # doctest: +ELLIPSIS
    /.../small.csv: the planted model's AUC ...
    >>> sorted(p.name for p in paths), paths[0].read_text().splitlines()[0]
    (['small.csv', 'sparse.csv'], 'click,count,score,c0,c1,c2,c3,c4')
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

#: name -> (rows, categorical cardinalities)
LOGS: Dict[str, tuple] = {
    "small": (20_000, (10, 20, 50, 100, 200)),
    "sparse": (200_000, (100, 500, 2_000, 5_000, 10_000, 20_000, 50_000, 50_000)),
}


def _zipf_values(rng: np.random.Generator, rows: int, cardinality: int) -> np.ndarray:
    """Values 0..cardinality-1 with probabilities proportional to 1 / (rank + 1)."""
    p = 1.0 / np.arange(1, cardinality + 1)
    return rng.choice(cardinality, size=rows, p=p / p.sum())


def write_log(path: Path, rows: int, cardinalities: Sequence[int], seed: int) -> float:
    """Writes one log (see the module docstring) to ``path``; returns the planted model's
    AUC over its rows (the ceiling a model of the log can reach)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([_zipf_values(rng, rows, c) for c in cardinalities], axis=1)
    logit = np.full(rows, -1.6)
    for j, c in enumerate(cardinalities):
        logit += rng.normal(0.0, 0.5, c)[ids[:, j]]
    pair = rng.normal(0.0, 0.6, (cardinalities[0], cardinalities[1]))
    logit += pair[ids[:, 0], ids[:, 1]]
    count = rng.poisson(3.0, rows).astype(float)
    score = rng.normal(0.0, 1.0, rows)
    logit += 0.15 * np.log1p(count) + 0.3 * score
    click = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(int)
    names = [f"c{j}" for j in range(len(cardinalities))]
    lines = ["click,count,score," + ",".join(names)]
    for i in range(rows):
        values = ",".join(f"v{int(v)}" for v in ids[i])
        lines.append(f"{click[i]},{int(count[i])},{score[i]:.4f},{values}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    from torchrec_cowclip.data import rank_auc

    return float(rank_auc(click, logit))


def write_logs(out: Path, scale: float = 1.0, seed: int = 0) -> List[Path]:
    """Both logs in ``out`` (``scale`` multiplies their rows); prints each path with its
    planted model's AUC."""
    paths = []
    for i, (name, (rows, cards)) in enumerate(LOGS.items()):
        path = out / f"{name}.csv"
        ceiling = write_log(path, max(int(rows * scale), 100), cards, seed + i)
        print(f"{path}: the planted model's AUC {ceiling:.4f}")
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/logs", help="where the CSV files go")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed")
    args = parser.parse_args()
    write_logs(Path(args.out), seed=args.seed)


if __name__ == "__main__":
    main()

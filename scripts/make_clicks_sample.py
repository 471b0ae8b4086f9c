"""Writes tests/data/clicks_sample.csv: a small click log shaped like a user's own export.

2,000 rows with a header: ``click`` (0/1), three numeric columns (``price_delta``, signed;
``age``, an integer with missing values; ``score`` in [0, 1]) and three categorical ones
(``site`` with skewed ids, ``device``, ``hour``). The click probability is a planted
logistic function of them, so a model has something to learn; the file is seeded and
regenerated identically::

    .venv/bin/python scripts/make_clicks_sample.py
"""

from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "clicks_sample.csv"
ROWS = 2000


def main() -> None:
    rng = np.random.default_rng(2028)
    price = rng.normal(0.0, 2.0, ROWS)
    age = rng.integers(18, 70, ROWS).astype(float)
    age[rng.random(ROWS) < 0.1] = np.nan
    score = rng.random(ROWS)
    site = np.minimum(rng.zipf(1.6, ROWS), 60) - 1
    site_effect = rng.normal(0.0, 0.8, 60)
    device = rng.choice(["mobile", "desktop", "tablet"], ROWS, p=[0.6, 0.3, 0.1])
    hour = rng.integers(0, 24, ROWS)
    logit = (
        -1.0
        + 0.8 * price
        + 1.2 * (score - 0.5)
        - 0.02 * np.nan_to_num(age - 40.0)
        + site_effect[site]
        + np.where(device == "mobile", 0.3, 0.0)
    )
    click = rng.random(ROWS) < 1.0 / (1.0 + np.exp(-logit))
    lines = ["click,price_delta,age,score,site,device,hour"]
    for i in range(ROWS):
        age_text = "" if np.isnan(age[i]) else str(int(age[i]))
        lines.append(
            f"{int(click[i])},{price[i]:.3f},{age_text},{score[i]:.4f},site{site[i]},"
            f"{device[i]},{hour[i]}"
        )
    OUT.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

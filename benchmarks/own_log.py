"""Your own click log against the baselines a data scientist would try first.

Generates click logs the way a site exports them, then trains on each with the README's
first command (defaults, no tuning) and with the time column declared
(``--time-columns``), and fits scikit-learn's ``LogisticRegression`` (one-hot categoricals,
imputed and standardized numbers) and LightGBM (raw columns; scikit-learn's
``HistGradientBoostingClassifier`` when LightGBM is not installed) on the same rows.
Neither baseline is a dependency of this project: ``pip install scikit-learn lightgbm``.

Two logs of different structure, so that the defaults are not tuned to one generator:

- ``clicks``: a site's log. A Unix-seconds timestamp whose hour of day and day of week
  drive the label, a power-law user id (tens of thousands of values), zip codes with
  leading zeros, a site x ad interaction, numeric columns with ``NA`` and ``?`` for
  missing, a heavy-tailed price, and a campaign column with values that appear only in
  the test files.
- ``sessions``: an app's log with a 5% click rate. An ISO 8601 date-time whose hour
  matters per device (an hour x device interaction) and weekends, few categorical columns
  but a large item id, five numeric columns with threshold effects, missing values as
  ``NA``, and new app versions in the test files.

Each log has ``train.csv`` (weeks 1-3, 85%), ``test.csv`` (weeks 1-3, the other 15%) and
``next_week.csv`` (week 4). Every model trains on ``train.csv`` and is scored on the two
others; this project's runs are scored with ``torchrec-cowclip evaluate``.

Usage::

    nice .venv/bin/python benchmarks/own_log.py --out runs/own --rows 120000 --seed 0

Example::

    >>> import tempfile
    >>> log = write_log(Path(tempfile.mkdtemp()), "clicks", rows=400, seed=0)
    >>> log.columns[:3], (log.folder / "train.csv").read_text().splitlines()[0].split(",")[:3]
    (['user', 'zip', 'site'], ['click', 'ts', 'user'])
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np

WEEK_S = 7 * 86400
START = 1_714_953_600  # Monday 2024-05-06 00:00 UTC
FILES = ("train.csv", "test.csv", "next_week.csv")


@dataclass
class Log:
    """A written log: its folder, label, categorical, numeric and time columns, and the
    planted model's AUC on its test file (the ceiling)."""

    folder: Path
    columns: List[str]
    dense: List[str]
    time: str
    na_values: List[str] = field(default_factory=lambda: ["NA", "?"])
    planted_auc: float = 0.0


def _zipf(rng: np.random.Generator, n: int, k: int, a: float = 1.0) -> np.ndarray:
    p = 1.0 / np.arange(1, k + 1) ** a
    return rng.choice(k, size=n, p=p / p.sum())


def _times(
    rng: np.random.Generator, n: int, weeks: float, peak_hours: Sequence[int]
) -> Dict[str, np.ndarray]:
    """Unix seconds over ``weeks`` weeks, busier at ``peak_hours``, with their hour of day
    and day of week (0 Monday)."""
    day = rng.integers(0, int(weeks * 7), n)
    weights = np.ones(24)
    weights[list(peak_hours)] += 2.0
    hour = rng.choice(24, size=n, p=weights / weights.sum())
    ts = START + day * 86400 + hour * 3600 + rng.integers(0, 3600, n)
    return {"ts": ts, "hour": (ts // 3600) % 24, "weekday": ((ts // 86400) + 3) % 7}


def _auc(y: np.ndarray, p: np.ndarray) -> float:
    order = np.argsort(p, kind="stable")
    ranks = np.empty(len(p))
    ranks[order] = np.arange(1, len(p) + 1)
    pos = y == 1
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum()))


def _clicks(rng: np.random.Generator, n: int, weeks: float, new: bool) -> Dict[str, Any]:
    times = _times(rng, n, weeks, (12, 13, 19, 20, 21))
    user = _zipf(rng, n, 60_000, 1.05)
    zipc = _zipf(rng, n, 1_500)
    site, ad = _zipf(rng, n, 300), _zipf(rng, n, 2_000)
    device = rng.integers(0, 4, n)
    campaign = rng.integers(0, 40 if not new else 60, n)
    price = rng.lognormal(3.0, 1.5, n)
    num_a, num_b = rng.poisson(4.0, n).astype(float), rng.normal(0.0, 1.0, n)
    return dict(
        **times,
        user=user,
        zip=zipc,
        site=site,
        ad=ad,
        device=device,
        campaign=campaign,
        price=price,
        num_a=num_a,
        num_b=num_b,
    )


def _clicks_logit(c: Dict[str, Any], eff: Dict[str, np.ndarray]) -> np.ndarray:
    logit = -1.7 + eff["hour"][c["hour"]] + eff["weekday"][c["weekday"]]
    for k in ("user", "zip", "site", "ad", "device"):
        logit = logit + eff[k][c[k]]
    logit = logit + eff["campaign"][np.minimum(c["campaign"], 39)] * (c["campaign"] < 40)
    logit = logit + eff["pair"][c["site"] % 50, c["ad"] % 50]
    logit = logit - 0.35 * (np.log(c["price"]) - 3.0) + 0.08 * c["num_a"] + 0.3 * c["num_b"]
    return logit


def _sessions(rng: np.random.Generator, n: int, weeks: float, new: bool) -> Dict[str, Any]:
    times = _times(rng, n, weeks, (7, 8, 22, 23))
    item = _zipf(rng, n, 30_000, 0.9)
    device = rng.integers(0, 3, n)
    country = _zipf(rng, n, 80)
    version = rng.integers(0, 12 if not new else 16, n)
    x = rng.normal(0.0, 1.0, (n, 5))
    x[:, 1] = rng.exponential(2.0, n)
    x[:, 3] = rng.poisson(1.0, n)
    return dict(**times, item=item, device=device, country=country, version=version, x=x)


def _sessions_logit(c: Dict[str, Any], eff: Dict[str, np.ndarray]) -> np.ndarray:
    x = c["x"]
    logit = -3.2 + eff["hour_device"][c["hour"], c["device"]]
    logit = (
        logit + 0.5 * (c["weekday"] >= 5) + eff["item"][c["item"]] + eff["country"][c["country"]]
    )
    logit = logit + eff["version"][np.minimum(c["version"], 11)] * (c["version"] < 12)
    logit = logit + 0.6 * (x[:, 0] > 0.5) - 0.25 * x[:, 1] + 0.4 * np.tanh(x[:, 2])
    logit = logit + 0.3 * (x[:, 3] >= 2) + 0.2 * x[:, 4]
    return logit


def _effects(rng: np.random.Generator, name: str) -> Dict[str, np.ndarray]:
    if name == "clicks":
        hour_curve = 0.9 * np.sin((np.arange(24) - 9) / 24 * 2 * np.pi)
        return dict(
            hour=hour_curve,
            weekday=np.array([0, 0.1, 0.1, 0.1, 0.2, 0.6, 0.7]),
            user=rng.normal(0, 0.6, 60_000),
            zip=rng.normal(0, 0.3, 1_500),
            site=rng.normal(0, 0.4, 300),
            ad=rng.normal(0, 0.4, 2_000),
            device=rng.normal(0, 0.3, 4),
            campaign=rng.normal(0, 0.3, 40),
            pair=rng.normal(0, 0.5, (50, 50)),
        )
    hour_device = rng.normal(0, 0.25, (24, 3))
    hour_device[[7, 8], 0] += 1.2
    hour_device[[22, 23], 1] += 1.2
    return dict(
        hour_device=hour_device,
        item=rng.normal(0, 0.5, 30_000),
        country=rng.normal(0, 0.3, 80),
        version=rng.normal(0, 0.3, 12),
    )


def _missing(rng: np.random.Generator, text: List[str], share: float, token: str) -> List[str]:
    out = list(text)
    for i in np.flatnonzero(rng.random(len(out)) < share).tolist():
        out[i] = token
    return out


def _rows(
    name: str, c: Dict[str, Any], label: np.ndarray, rng: np.random.Generator
) -> List[List[str]]:
    n = len(label)
    if name == "clicks":
        cols = [
            label.astype(str).tolist(),
            c["ts"].astype(str).tolist(),
            [f"u{u}" for u in c["user"]],
            [f"{z:05d}" for z in c["zip"]],
            [f"s{s}" for s in c["site"]],
            [f"a{a}" for a in c["ad"]],
            [["mobile", "desktop", "tablet", "tv"][d] for d in c["device"]],
            [f"cmp{k}" for k in c["campaign"]],
            [f"{p:.2f}" for p in c["price"]],
            _missing(rng, [f"{v:g}" for v in c["num_a"]], 0.1, "NA"),
            _missing(rng, [f"{v:.3f}" for v in c["num_b"]], 0.05, "?"),
        ]
    else:
        stamps = np.array(c["ts"], dtype="datetime64[s]").astype(str)
        cols = [
            label.astype(str).tolist(),
            [s.replace("T", " ") for s in stamps.tolist()],
            [f"item{i}" for i in c["item"]],
            [["ios", "android", "web"][d] for d in c["device"]],
            [f"c{k}" for k in c["country"]],
            [f"v{k // 4}.{k % 4}" for k in c["version"]],
        ] + [
            _missing(rng, [f"{v:.4g}" for v in c["x"][:, j]], 0.08 if j in (1, 2) else 0.0, "NA")
            for j in range(5)
        ]
    return [[col[i] for col in cols] for i in range(n)]


HEADERS = {
    "clicks": [
        "click",
        "ts",
        "user",
        "zip",
        "site",
        "ad",
        "device",
        "campaign",
        "price",
        "num_a",
        "num_b",
    ],
    "sessions": [
        "click",
        "ts",
        "item",
        "device",
        "country",
        "version",
        "x0",
        "x1",
        "x2",
        "x3",
        "x4",
    ],
}


def _drift(ts: np.ndarray, drift: float) -> np.ndarray:
    """A logit offset rising by ``drift`` over weeks 1-3 and holding its level in week 4
    (a site that grew, then levelled): what ``--time-trend`` can learn within the weeks
    and must extrapolate after them."""
    return drift * np.clip((ts - START) / (3 * WEEK_S), 0.0, 1.0)


def write_log(out: Path, name: str, rows: int, seed: int, drift: float = 0.0) -> Log:
    """Writes log ``name`` (``clicks`` or ``sessions``) with ``rows`` rows in weeks 1-3
    and a quarter as many in week 4 under ``out / name``; ``drift``: see :func:`_drift`
    (0: none, the logs of docs/results.md's first table)."""
    rng = np.random.default_rng([seed, 0 if name == "clicks" else 1])
    eff = _effects(rng, name)
    draw, logit_of = (_clicks, _clicks_logit) if name == "clicks" else (_sessions, _sessions_logit)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    header = HEADERS[name]
    planted = 0.0
    for part, n, weeks, new in (
        ("weeks", rows, 3.0, False),
        ("next_week.csv", rows // 4, 1.0, True),
    ):
        c = draw(rng, n, weeks, new)
        if part == "next_week.csv":
            c["ts"] = c["ts"] + 3 * WEEK_S
        p = 1.0 / (1.0 + np.exp(-(logit_of(c, eff) + _drift(c["ts"], drift))))
        label = (rng.random(n) < p).astype(int)
        lines = [",".join(r) for r in _rows(name, c, label, rng)]
        if part == "weeks":
            test = rng.random(n) < 0.15
            for fname, keep in (("train.csv", ~test), ("test.csv", test)):
                body = [lines[i] for i in np.flatnonzero(keep).tolist()]
                (folder / fname).write_text("\n".join([",".join(header), *body]) + "\n")
            planted = _auc(label[test], p[test])
        else:
            (folder / part).write_text("\n".join([",".join(header), *lines]) + "\n")
    dense = ["price", "num_a", "num_b"] if name == "clicks" else [f"x{j}" for j in range(5)]
    sparse = [h for h in header[2:] if h not in dense]
    return Log(folder, sparse, dense, "ts", planted_auc=planted)


# --- baselines ----------------------------------------------------------------------------


def _frames(log: Log) -> Dict[str, Any]:
    import pandas as pd

    frames = {}
    for f in FILES:
        df = pd.read_csv(
            log.folder / f,
            dtype={c: str for c in log.columns},
            na_values=log.na_values,
            keep_default_na=False,
        )
        ts = df[log.time]
        seconds = pd.to_numeric(ts, errors="coerce")
        if seconds.isna().all():
            seconds = (pd.to_datetime(ts) - pd.Timestamp(0)) / pd.Timedelta(seconds=1)
        df["ts_seconds"] = seconds.astype(float)
        df["ts_hour"] = ((seconds // 3600) % 24).astype(int).astype(str)
        df["ts_weekday"] = ((seconds // 86400 + 3) % 7).astype(int).astype(str)
        frames[f] = df
    return frames


def _calibration(y: np.ndarray, p: np.ndarray) -> float:
    return float(np.mean(p) / max(np.mean(y), 1e-12))


def baselines(log: Log) -> List[Dict[str, Any]]:
    """LogisticRegression and LightGBM (or HistGradientBoosting) on the log's raw columns,
    and LightGBM with the hour and weekday added by hand."""
    import pandas as pd
    from sklearn.compose import ColumnTransformer
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    frames = _frames(log)
    train = frames["train.csv"]
    y = train["click"].to_numpy()
    numeric = [*log.dense, "ts_seconds"]
    results = []

    def score(name: str, model: Any, columns: List[str], seconds: float) -> None:
        row: Dict[str, Any] = {"model": name, "fit_s": round(seconds, 1)}
        for f in FILES[1:]:
            df = frames[f]
            p = model.predict_proba(df[columns])[:, 1]
            row[f] = {
                "auc": roc_auc_score(df["click"], p),
                "calibration": _calibration(df["click"].to_numpy(), p),
            }
        results.append(row)

    columns = [*log.columns, *numeric]
    logistic = make_pipeline(
        ColumnTransformer(
            [
                (
                    "cat",
                    make_pipeline(
                        SimpleImputer(strategy="constant", fill_value="(missing)"),
                        OneHotEncoder(handle_unknown="ignore", min_frequency=1),
                    ),
                    log.columns,
                ),
                (
                    "num",
                    make_pipeline(SimpleImputer(add_indicator=True), StandardScaler()),
                    numeric,
                ),
            ]
        ),
        LogisticRegression(max_iter=300, C=1.0),
    )
    t = time.perf_counter()
    logistic.fit(train[columns], y)
    score("LogisticRegression, one-hot, raw columns", logistic, columns, time.perf_counter() - t)

    def gbm(extra: List[str]) -> Any:
        cats = [*log.columns, *extra]
        try:
            import lightgbm

            def prep(df: Any) -> Any:
                out = df[[*cats, *numeric]].copy()
                for c in cats:
                    out[c] = pd.Categorical(out[c], categories=sorted(train[c].dropna().unique()))
                return out

            model = lightgbm.LGBMClassifier(
                n_estimators=300, learning_rate=0.05, verbose=-1, n_jobs=1
            )

            class Wrapped:
                def fit(self, df: Any, yy: Any) -> "Wrapped":
                    model.fit(prep(df), yy)
                    return self

                def predict_proba(self, df: Any) -> Any:
                    return model.predict_proba(prep(df))

            return Wrapped(), "LightGBM"
        except ImportError:
            from sklearn.ensemble import HistGradientBoostingClassifier
            from sklearn.preprocessing import OrdinalEncoder

            enc = ColumnTransformer(
                [
                    (
                        "cat",
                        OrdinalEncoder(
                            handle_unknown="use_encoded_value",
                            unknown_value=-1,
                            encoded_missing_value=-1,
                            max_categories=250,
                        ),
                        cats,
                    ),
                    ("num", "passthrough", numeric),
                ]
            )
            return make_pipeline(enc, HistGradientBoostingClassifier()), "HistGradientBoosting"

    for extra, what in (
        ([], "raw columns"),
        (["ts_hour", "ts_weekday"], "hour and weekday added by hand"),
    ):
        model, name = gbm(extra)
        cols = [*log.columns, *extra, *numeric]
        t = time.perf_counter()
        model.fit(train[cols], y)
        score(f"{name}, {what}", model, cols, time.perf_counter() - t)
    return results


# --- this project -------------------------------------------------------------------------


def _cli() -> List[str]:
    return [sys.executable, "-m", "torchrec_cowclip"]


def project_run(
    log: Log, out: Path, time_column: bool, extra: Sequence[str] = ()
) -> Dict[str, Any]:
    """The README's first command on ``log`` (with ``--time-columns`` when ``time_column``,
    ``ts`` as a dense column otherwise), scored by ``evaluate`` on the two test files."""
    sparse = list(log.columns)
    dense = list(log.dense)
    flags = ["--time-columns", log.time] if time_column else []
    numeric_time = log.folder.name == "clicks"  # sessions' time is text: no dense column
    if not time_column and numeric_time:
        dense.append(log.time)
    cmd = [
        *_cli(),
        "train",
        "--data",
        f"table:{log.folder / 'train.csv'}",
        "--label",
        "click",
        "--dense",
        ",".join(dense),
        "--sparse",
        ",".join(sparse),
        "--na-values",
        ",".join(log.na_values),
        *flags,
        *extra,
        "--out",
        str(out),
        "--overwrite",
        "--no-progress",
        "--threads",
        "1",
        "--cache-dir",
        str(out.parent / "cache"),
    ]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t
    metrics = json.loads((out / "metrics.json").read_text())
    row: Dict[str, Any] = {
        "model": "torchrec-cowclip, "
        + (
            "--time-columns ts"
            if time_column
            else f"defaults (ts {'dense' if numeric_time else 'left out: text'})"
        )
        + (" " + " ".join(extra) if extra else ""),
        "fit_s": round(seconds, 1),
        "epochs": metrics.get("epochs"),
        "best_epoch": metrics.get("best_epoch"),
        "command": " ".join(cmd[2:]),
    }
    for f in FILES[1:]:
        got = subprocess.run(
            [*_cli(), "evaluate", "--run", str(out), "--data", str(log.folder / f)],
            check=True,
            capture_output=True,
            text=True,
        )
        m = json.loads(got.stdout)
        row[f] = {
            "auc": m["auc"],
            "calibration": m.get("calibration"),
            "outside": m.get("outside_training_range"),
        }
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/own")
    p.add_argument("--rows", type=int, default=120_000, help="rows of weeks 1-3 per log")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default="clicks,sessions")
    p.add_argument("--skip-baselines", action="store_true")
    p.add_argument("--extra", default="", help="more train flags for both project runs")
    p.add_argument("--drift", type=float, default=0.0, help="logit drift over weeks 1-3")
    p.add_argument(
        "--trend",
        action="store_true",
        help="this project with --time-columns ts, without and with --time-trend (instead "
        "of the defaults and --time-columns)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    extra = args.extra.split() if args.extra else []
    report = []
    for name in args.logs.split(","):
        log = write_log(out / "logs", name, args.rows, args.seed, args.drift)
        print(f"{name}: planted model's test AUC {log.planted_auc:.4f}", flush=True)
        rows = [] if args.skip_baselines else baselines(log)
        if args.trend:
            for more in ([], ["--time-trend"]):
                tag = f"{name}-time{'-trend' if more else ''}"
                rows.append(project_run(log, out / "runs" / tag, True, [*extra, *more]))
        for time_column in () if args.trend else (False, True):
            tag = f"{name}-{'time' if time_column else 'default'}"
            rows.append(project_run(log, out / "runs" / tag, time_column, extra))
        for r in rows:
            r["log"] = name
            print(
                f"{name:9s} {r['model'][:60]:60s} test {r['test.csv']['auc']:.4f} "
                f"(cal {r['test.csv']['calibration']:.3f}) next week {r['next_week.csv']['auc']:.4f} "
                f"(cal {r['next_week.csv']['calibration']:.3f}) {r['fit_s']:6.1f} s",
                flush=True,
            )
        report += [{**r, "planted_auc": log.planted_auc} for r in rows]
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    load = os.getloadavg()
    print(
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; seed {args.seed}; rows "
        f"{args.rows}; drift {args.drift}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

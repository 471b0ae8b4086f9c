"""Every ``train`` flag against every data kind.

Each flag, at a non-default valid value, is accepted by the kinds it applies to and
refused by the others in one line naming the flag, before any data is built or
``--out`` is claimed. The flag list is read from the parser, so a new flag without a
row here fails ``test_every_train_flag_has_a_row``. ``--seed`` then trains on every kind
and changes the result.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import pytest
from cowclip_testing import write_criteo_npy_days
from tiny import cli_args

from torchrec_cowclip.cli import build_parser, main
from torchrec_cowclip.train.command import config_from_args, train_flags
from torchrec_cowclip.train.config import ConfigError

DATA = Path(__file__).parent / "data"
CRITEO_TSV = DATA / "criteo_sample.tsv"
CRITEO_CSV = DATA / "criteo_sample.csv"
AVAZU_CSV = DATA / "avazu_sample.csv"

#: The data kinds of the matrix: ``table`` three times, once per file format.
KINDS = (
    "synthetic",
    "synthetic-hard",
    "criteo",
    "criteo-npy",
    "avazu",
    "table-csv",
    "table-tsv",
    "table-parquet",
)
FILE_KINDS = frozenset({"criteo", "criteo-npy", "avazu", "table"})
TEXT_KINDS = frozenset({"criteo", "avazu", "table"})
GENERATORS = frozenset({"synthetic", "synthetic-hard"})
EVERY_KIND = frozenset({"synthetic", "synthetic-hard", "criteo", "criteo-npy", "avazu", "table"})

TABLE_COLUMNS = ["--label", "label", "--sparse", ",".join(f"C{i}" for i in range(1, 27))]
#: Every column of the Criteo layout, in order: a header-less file's --columns.
ALL_COLUMNS = ",".join(
    ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
)
#: The table kinds of text files (``--delimiter``, ``--no-header``, ``--columns`` apply to
#: them, not to parquet); the README's table writes it "table (text files)".
TABLE_TEXT = "table-text"


class Inputs:
    """The tiny inputs of each kind, all made from the real rows in ``tests/data/``."""

    def __init__(self, root: Path) -> None:
        rows = list(csv.reader(open(CRITEO_CSV, newline="")))
        header, body = rows[0], rows[1:]
        self.tsv_table = root / "criteo_sample_header.tsv"
        with open(self.tsv_table, "w", newline="") as f:
            csv.writer(f, delimiter="\t", lineterminator="\n").writerows(rows)
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {name: [r[i] for r in body] for i, name in enumerate(header)}
        self.parquet = root / "criteo_sample.parquet"
        pq.write_table(
            pa.table(
                {
                    name: (
                        [float(v) if v else None for v in values]
                        if name == "label" or name.startswith("I")
                        else values
                    )
                    for name, values in columns.items()
                }
            ),
            self.parquet,
        )
        self.npy = write_criteo_npy_days(CRITEO_TSV, root / "npy")
        self.headerless_csv = root / "criteo_sample_no_header.csv"
        with open(self.headerless_csv, "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows(body)

    def headerless(self, kind: str) -> List[str]:
        """``--data`` of a header-less file for a table text kind, else ``kind``'s own."""
        path = {"table-csv": self.headerless_csv, "table-tsv": CRITEO_TSV}.get(kind)
        return ["--data", f"table:{path}"] if path else self.data(kind)[:2]

    def data(self, kind: str) -> List[str]:
        """``--data`` (and the columns a table needs) for ``kind``."""
        return {
            "synthetic": ["--data", "synthetic:3000"],
            "synthetic-hard": ["--data", "synthetic-hard:3000"],
            "criteo": ["--data", f"criteo:{CRITEO_TSV}"],
            "criteo-npy": ["--data", f"criteo-npy:{self.npy / 'day_0'}"],
            "avazu": ["--data", f"avazu:{AVAZU_CSV}"],
            "table-csv": ["--data", f"table:{CRITEO_CSV}", *TABLE_COLUMNS],
            "table-tsv": ["--data", f"table:{self.tsv_table}", *TABLE_COLUMNS],
            "table-parquet": ["--data", f"table:{self.parquet}", *TABLE_COLUMNS],
        }[kind]

    def test_data(self, kind: str) -> List[str]:
        """``--test-data`` of ``kind``'s own kind (the synthetic kinds take none)."""
        spec = {
            "synthetic": "synthetic:1000",
            "synthetic-hard": "synthetic-hard:1000",
            "criteo-npy": f"criteo-npy:{self.npy / 'day_1'}",
        }.get(kind)
        return ["--test-data", spec or self.data(kind)[1]]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return Inputs(tmp_path_factory.mktemp("inputs"))


Args = Union[Sequence[str], Callable[[str, Inputs, Path], Sequence[str]]]


def _by_kind(avazu: Sequence[str], table: Sequence[str]) -> Callable[..., Sequence[str]]:
    """Column flags: Avazu's and the Criteo-layout tables' column names differ."""
    return lambda kind, inputs, tmp: avazu if kind == "avazu" else table


def _delimiter(kind: str, inputs: Inputs, tmp: Path) -> Sequence[str]:
    """The delimiter each kind's file has (tab for the Criteo TSV and the TSV table)."""
    return ["--delimiter", "tab" if kind in ("criteo", "table-tsv") else ","]


def _headerless(*flags: str) -> Callable[..., Sequence[str]]:
    """A header-less file with the given flags (for the table text kinds; the others get
    the flags alone, to refuse)."""
    return lambda kind, inputs, tmp: [*inputs.headerless(kind), *flags]


#: flag -> (its arguments at a non-default valid value, the kinds it applies to). Flags
#: that need a companion carry it (``--helen-bound`` needs ``--helen-rho``).
ROWS: Dict[str, tuple] = {
    "--model": (["--model", "dcn"], EVERY_KIND),
    "--data": ([], EVERY_KIND),  # the matrix's axis: every case gives it
    "--test-data": (lambda kind, inputs, tmp: inputs.test_data(kind), FILE_KINDS),
    "--test-fraction": (["--test-fraction", "0.2"], EVERY_KIND),
    "--val-fraction": (["--val-fraction", "0.1"], EVERY_KIND),
    "--cache-dir": (
        lambda kind, inputs, tmp: ["--cache-dir", str(tmp / "other-cache")],
        EVERY_KIND,
    ),
    "--on-bad-row": (["--on-bad-row", "skip"], FILE_KINDS),
    "--hash-size": (["--hash-size", "1000"], FILE_KINDS),
    "--min-count": (["--min-count", "2"], TEXT_KINDS),
    "--dense-transform": (["--dense-transform", "minmax"], EVERY_KIND),
    "--missing-indicator": (["--missing-indicator"], TEXT_KINDS),
    "--dense-buckets": (["--dense-buckets", "4"], TEXT_KINDS),
    "--delimiter": (_delimiter, {"criteo", "avazu", TABLE_TEXT}),
    "--no-header": (_headerless("--no-header", "--columns", ALL_COLUMNS), {TABLE_TEXT}),
    "--columns": (_headerless("--columns", ALL_COLUMNS), {TABLE_TEXT}),
    "--na-values": (["--na-values", "N/A,-"], {"table"}),
    "--time-columns": (["--time-columns", "I1"], {"table"}),
    # With the time column it needs on a table; alone elsewhere, to be refused by name.
    "--time-trend": (
        lambda kind, inputs, tmp: [
            "--time-trend",
            *(["--time-columns", "I1"] * kind.startswith("table")),
        ],
        {"table"},
    ),
    "--label": (_by_kind(["--label", "click"], ["--label", "label"]), {"avazu", "table"}),
    "--dense": (_by_kind(["--dense", "hour"], ["--dense", "I1,I2"]), {"avazu", "table"}),
    "--sparse": (_by_kind(["--sparse", "C1,site_id"], ["--sparse", "C1,C2"]), {"avazu", "table"}),
    "--synthetic-scale": (["--synthetic-scale", "0.01"], GENERATORS),
    "--synthetic-max-cardinality": (["--synthetic-max-cardinality", "500"], GENERATORS),
    "--synthetic-seed": (["--synthetic-seed", "3"], GENERATORS),
    "--embedding-dim": (["--embedding-dim", "4"], EVERY_KIND),
    "--hidden": (["--hidden", "8,8"], EVERY_KIND),
    "--cross-layers": (["--model", "dcn", "--cross-layers", "2"], EVERY_KIND),
    "--init-std": (["--init-std", "1e-3"], EVERY_KIND),
    "--batch-size": (["--batch-size", "64"], EVERY_KIND),
    "--base-batch-size": (["--base-batch-size", "64"], EVERY_KIND),
    "--epochs": (["--epochs", "2"], EVERY_KIND),
    "--recipe": (["--recipe", "fixed-l2"], EVERY_KIND),
    "--lr": (["--lr", "1e-3"], EVERY_KIND),
    "--lr-embed": (["--lr-embed", "1e-3"], EVERY_KIND),
    "--l2": (["--l2", "1e-6"], EVERY_KIND),
    "--clip-r": (["--clip-r", "0.5"], EVERY_KIND),
    "--clip-zeta": (["--clip-zeta", "1e-4"], EVERY_KIND),
    "--warmup-epochs": (["--warmup-epochs", "0.5"], EVERY_KIND),
    "--count-lr-power": (["--count-lr-power", "0.5"], EVERY_KIND),
    "--no-cowclip": (["--no-cowclip"], EVERY_KIND),
    "--embedding-backend": (["--embedding-backend", "torchrec", "--no-cowclip"], EVERY_KIND),
    "--embedding-optimizer": (["--embedding-optimizer", "sgd"], EVERY_KIND),
    "--embedding-dtype": (["--embedding-dtype", "bf16"], EVERY_KIND),
    "--helen-rho": (["--helen-rho", "0.05"], EVERY_KIND),
    "--helen-bound": (["--helen-rho", "0.05", "--helen-bound", "0.5"], EVERY_KIND),
    "--helen-perturb-dense": (["--helen-rho", "0.05", "--helen-perturb-dense"], EVERY_KIND),
    "--out": (lambda kind, inputs, tmp: ["--out", str(tmp / "other-out")], EVERY_KIND),
    "--seed": (["--seed", "1"], EVERY_KIND),
    "--early-stop-patience": (["--val-fraction", "0.1", "--early-stop-patience", "1"], EVERY_KIND),
    "--checkpoint-every": (["--checkpoint-every", "5"], EVERY_KIND),
    "--keep-checkpoints": (["--keep-checkpoints", "3"], EVERY_KIND),
    "--resume": (["--resume", "auto"], EVERY_KIND),
    "--overwrite": (["--overwrite"], EVERY_KIND),
    "--max-steps": (["--max-steps", "3"], EVERY_KIND),
    "--eval-batch-size": (["--eval-batch-size", "128"], EVERY_KIND),
    "--device": (["--device", "cpu"], EVERY_KIND),
    "--threads": (["--threads", "1"], EVERY_KIND),
    "--sharding": (["--sharding", "table_wise"], EVERY_KIND),  # under a 2-process launch
    "--dist-timeout": (["--dist-timeout", "60"], EVERY_KIND),
    "--no-progress": (["--no-progress"], EVERY_KIND),
    "--log-every": (["--log-every", "5"], EVERY_KIND),
    "--row-clip-stats": (["--row-clip-stats"], EVERY_KIND),
    # A warm start's RUN is opened by the trainer, after these checks.
    "--init-from": (["--init-from", "runs/earlier"], EVERY_KIND),
    "--init-optimizer-state": (
        ["--init-from", "runs/earlier", "--init-optimizer-state"],
        EVERY_KIND,
    ),
    "--require-sha256": (["--init-from", "runs/earlier", "--require-sha256"], EVERY_KIND),
}


def _kind_name(kind: str) -> str:
    return kind.split("-")[0] if kind.startswith("table-") else kind


def _applies(flag: str, kind: str) -> bool:
    kinds = ROWS[flag][1]
    text_table = kind in ("table-csv", "table-tsv") and TABLE_TEXT in kinds
    return _kind_name(kind) in kinds or text_table


def _argv(flag: str, kind: str, inputs: Inputs, tmp: Path) -> List[str]:
    args, _ = ROWS[flag]
    extra = list(args(kind, inputs, tmp) if callable(args) else args)
    return [
        "train",
        *inputs.data(kind),
        "--out",
        str(tmp / "out"),
        "--cache-dir",
        str(tmp / "cache"),
        *extra,
    ]


def test_every_train_flag_has_a_row():
    flags = set(train_flags(build_parser()))
    assert flags == set(ROWS), (
        f"flags without a row: {sorted(flags - set(ROWS))}; "
        f"rows of no flag: {sorted(set(ROWS) - flags)}"
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flag", list(ROWS))
def test_flag_is_accepted_where_it_applies_and_refused_naming_it_elsewhere(
    flag: str, kind: str, inputs: Inputs, tmp_path: Path, capsys, monkeypatch
):
    if flag == "--sharding":
        monkeypatch.setenv("WORLD_SIZE", "2")
    argv = _argv(flag, kind, inputs, tmp_path)
    applies = _applies(flag, kind)
    if applies:
        config_from_args(build_parser().parse_args(argv)).validate()
    else:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert re.search(rf"{re.escape(flag)}\b", err), f"{flag} not named: {err}"
    created = [p.name for p in tmp_path.iterdir()]
    assert created == [], f"{created} created before the flags were checked"


def test_refused_config_raises_config_error_naming_the_flag(inputs: Inputs, tmp_path: Path):
    argv = _argv("--synthetic-seed", "criteo", inputs, tmp_path)
    with pytest.raises(ConfigError, match=r"criteo: does not take seed \(--synthetic-seed\)"):
        config_from_args(build_parser().parse_args(argv)).validate()


def _train(kind: str, inputs: Inputs, tmp: Path, name: str, *flags: str) -> Dict:
    out, cache = tmp / name, tmp / "cache"
    argv = cli_args(
        out=out,
        cache_dir=cache,
        batch_size=64,
        embedding_dim=4,
        hidden=8,
        threads=1,
        no_progress=True,
        test_fraction=0.25,
    )
    argv += [*inputs.data(kind), *flags]
    if _kind_name(kind) in GENERATORS:
        argv += ["--synthetic-scale", "0.001", "--synthetic-max-cardinality", "200"]
    assert main(argv) == 0
    return json.loads((out / "metrics.json").read_text())


def _cache_entries(tmp: Path) -> List[str]:
    """The converted datasets in the cache (not the vocabulary statistics entries)."""
    return sorted(
        p.name
        for p in (tmp / "cache").iterdir()
        if (p / "meta.json").exists() and not p.name.startswith("stats-")
    )


@pytest.mark.parametrize("kind", KINDS)
def test_seed_trains_on_every_kind_and_changes_the_result(
    kind: str, inputs: Inputs, tmp_path: Path, capsys
):
    pin: Optional[List[str]] = ["--synthetic-seed", "0"] if _kind_name(kind) in GENERATORS else []
    seed0 = _train(kind, inputs, tmp_path, "seed0", "--seed", "0", *pin)
    seed1 = _train(kind, inputs, tmp_path, "seed1", "--seed", "1", *pin)
    assert seed0["steps"] > 0 and seed1["steps"] > 0
    assert (seed0["auc"], seed0["logloss"]) != (seed1["auc"], seed1["logloss"])
    assert seed1["hyperparameters"]["seed"] == 1
    # The data is the same: one cache entry serves both seeds.
    assert len(_cache_entries(tmp_path)) == 1
    assert seed0["dataset"]["rows"] == seed1["dataset"]["rows"]


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_generators_draw_their_rows_with_the_seed_unless_synthetic_seed_is_given(
    kind: str, inputs: Inputs, tmp_path: Path, capsys
):
    _train(kind, inputs, tmp_path, "a", "--seed", "0", "--max-steps", "1")
    _train(kind, inputs, tmp_path, "b", "--seed", "1", "--max-steps", "1")
    assert len(_cache_entries(tmp_path)) == 2, "--seed alone draws other rows"
    _train(kind, inputs, tmp_path, "c", "--seed", "5", "--synthetic-seed", "1", "--max-steps", "1")
    assert len(_cache_entries(tmp_path)) == 2, "--synthetic-seed 1 draws --seed 1's rows"


def test_readme_flag_table_says_which_flags_belong_to_which_kinds():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = re.search(r"\| flag \| data kinds it applies to \|\n.*?\n((?:\s*\|.*\|\n)+)", readme)
    assert table, "README: the flag table is missing"
    documented: Dict[str, frozenset] = {}
    for line in table.group(1).strip().splitlines():
        flags_cell, kinds_cell = [c.strip() for c in line.strip().strip("|").split("|")]
        if flags_cell.startswith("every other flag"):
            continue
        kinds = frozenset(
            TABLE_TEXT if k.strip() == "table (text files)" else k.strip()
            for k in kinds_cell.split(",")
        )
        for flag in re.findall(r"`(--[a-z-]+)`", flags_cell):
            documented[flag] = kinds
    expected = {flag: frozenset(kinds) for flag, (_, kinds) in ROWS.items() if kinds != EVERY_KIND}
    assert documented == expected

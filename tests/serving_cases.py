"""The small runs the scoring tests (predict, evaluate, export, warm start) train and score.

Every case is built from the real rows of ``tests/data/criteo_sample.csv`` (200 rows,
header ``label, I1..I13, C1..C26``): a training file of its first rows and a test file
of the others, trained as a ``table:`` source (an exact vocabulary, so unseen values
and vocabulary growth occur) in a second or two.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from tiny import cli_args

from torchrec_cowclip.cli import main

DATA = Path(__file__).parent / "data"
CRITEO_CSV = DATA / "criteo_sample.csv"
CRITEO_TSV = DATA / "criteo_sample.tsv"
AVAZU_CSV = DATA / "avazu_sample.csv"
DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]
#: The column flags of a table: run on the Criteo sample.
TABLE_COLUMNS = dict(label="label", dense=DENSE, sparse=SPARSE)
#: A run that trains in about a second on 150 rows.
#: ``val_fraction=0``: the serving tests score a run without a validation split (its
#: final weights), as they were written before ``table:`` data got one by default.
TINY_TRAINING = dict(
    batch_size=32,
    epochs=2,
    hidden=(8,),
    embedding_dim=4,
    threads=1,
    lr_embed=1e-2,
    val_fraction=0.0,
)


def read_rows(path: Path = CRITEO_CSV, delimiter: str = ",") -> List[List[str]]:
    return list(csv.reader(open(path, newline=""), delimiter=delimiter))


def write_rows(path: Path, rows: Sequence[Sequence[Any]], delimiter: str = ",") -> Path:
    with open(path, "w", newline="") as f:
        csv.writer(f, delimiter=delimiter, lineterminator="\n").writerows(rows)
    return path


def split_sample(directory: Path, at: int = 150) -> Dict[str, Path]:
    """``train.csv`` (the sample's first ``at`` rows), ``test.csv`` (the rest) and
    ``test_unlabeled.csv`` (the test rows without their label column, an ``id`` column
    first)."""
    header, *body = read_rows()
    directory.mkdir(parents=True, exist_ok=True)
    unlabeled = [["id", *header[1:]]] + [[f"row{i}", *r[1:]] for i, r in enumerate(body[at:])]
    return {
        "train": write_rows(directory / "train.csv", [header, *body[:at]]),
        "test": write_rows(directory / "test.csv", [header, *body[at:]]),
        "unlabeled": write_rows(directory / "test_unlabeled.csv", unlabeled),
    }


def train_table(
    out: Path, train: Path, test: Optional[Path], cache: Path, **flags: Any
) -> Dict[str, Any]:
    """``torchrec-cowclip train`` on a table file (exit status checked); its metrics."""
    options: Dict[str, Any] = {**TABLE_COLUMNS, **TINY_TRAINING, **flags}
    if test is not None:
        options["test_data"] = f"table:{test}"
    argv = cli_args(data=f"table:{train}", out=out, cache_dir=cache, no_progress=True, **options)
    assert main(argv) == 0
    return json.loads((out / "metrics.json").read_text())


def reseal_run_folder(model_dir: Path) -> None:
    """Re-records every file's size and digest in the run folder's manifest (a forger who
    rewrites the manifest after editing the folder's files)."""
    from torchrec_cowclip.readback import SHA256, file_record

    manifest = json.loads((model_dir / "manifest.json").read_text())
    manifest["files"] = {
        str(p.relative_to(model_dir)): file_record(p, SHA256)
        for p in sorted(model_dir.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != "manifest.json"
    }
    (model_dir / "manifest.json").write_text(json.dumps(manifest))


def trained_sample(root: Path, **flags: Any) -> Dict[str, Any]:
    """The sample split (:func:`split_sample`) and trained as a table (:func:`train_table`):
    ``{"root", "run", "metrics", "train", "test", "unlabeled"}``."""
    files = split_sample(root / "data")
    metrics = train_table(root / "run", files["train"], files["test"], root / "cache", **flags)
    return {"root": root, "run": root / "run", "metrics": metrics, **files}


def copy_run(trained: Dict[str, Any], directory: Path) -> Path:
    """A copy of a trained run to damage, ``directory/run`` (links copied as links)."""
    import shutil

    return Path(shutil.copytree(trained["run"], directory / "run", symlinks=True))


def cli_json(capsys: Any, *argv: Any) -> Dict[str, Any]:
    """Runs a command that succeeds and returns the JSON summary it printed."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


def cli_refusal(capsys: Any, *argv: Any, status: int = 2) -> str:
    """Runs a command that must be refused: its one-line error (no traceback)."""
    import pytest

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    assert exit_info.value.code == status
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err

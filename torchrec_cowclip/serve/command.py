"""``torchrec-cowclip predict | evaluate | export``: a finished run's model, from the shell.

Example::

    torchrec-cowclip predict --run runs/criteo --data criteo:test.txt --output scores.csv
    torchrec-cowclip evaluate --run runs/criteo --data criteo:day_23.tsv
    torchrec-cowclip export --run runs/criteo --out serving/model.pt2

Each refuses a bad input in one line (exit status 2) before anything is written, and
writes its output whole or not at all; each prints a JSON summary on stdout.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict

from torchrec_cowclip.cli_help import HelpFormatter, add_require_sha256

COMMANDS = ("predict", "evaluate", "export")

_DATA_HELP = {
    "predict": "the rows: a path, or KIND:PATH[,PATH...] of the run's data kind (read as its "
    "training files were; a file without the label column is scored as well)",
    "evaluate": "labelled rows: a path, or KIND:PATH[,PATH...] of the run's data kind (read "
    "as its training files were; the label column is needed)",
}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _common(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--run", required=True, help="the run's --out (or its model/ folder); required")
    if command in _DATA_HELP:
        p.add_argument("--data", required=True, help=_DATA_HELP[command] + "; required")
    p.add_argument(
        "--weights",
        choices=("final", "best"),
        default=None,
        help="which weights: final (the last step's) or best (the best validation "
        "epoch's, kept with --val-fraction); default: those the run reported, best under "
        "--early-stop-patience, else final",
    )
    add_require_sha256(p)


def _reading(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--delimiter",
        default=None,
        help="the files' field separator, if not the run's (default: the run's, or the extension's)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive,
        default=None,
        help="rows per forward (default: the run's --eval-batch-size)",
    )
    p.add_argument("--device", default="cpu", help="where to score: cpu or cuda[:N]")
    p.add_argument(
        "--quantize",
        choices=("int8", "fp16"),
        default=None,
        help="score with TorchRec's quantized inference tables (torchrec.inference): int8 "
        "rowwise (fp16 where a row is too narrow) or fp16; default: the tables as trained",
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar (default: one on stderr after a second)",
    )


def add_commands(sub: Any) -> None:
    """Adds the ``predict``, ``evaluate`` and ``export`` sub-commands to ``sub``."""
    fmt = HelpFormatter
    p = sub.add_parser(
        "predict", help="score rows with a finished run's model", formatter_class=fmt
    )
    _common(p, "predict")
    p.add_argument(
        "--output",
        required=True,
        help="scores.csv, .tsv or .parquet (one row per input row); required",
    )
    p.add_argument(
        "--id-column",
        default=None,
        help="an input column carried into the output before the probability (a header "
        "name, or a 0-based column number for a file without header); default: none",
    )
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    _reading(p)

    e = sub.add_parser(
        "evaluate",
        help="AUC, log-loss, calibration of a run's model on labelled rows",
        formatter_class=fmt,
    )
    _common(e, "evaluate")
    _reading(e)

    x = sub.add_parser(
        "export",
        help="write the model as a torch.export program for serving",
        description="The program computes forward(dense, ids) -> probability; a run with "
        "--time-columns forward(dense, ids, time): time float64 [B, n_time], each time "
        "column's timestamp (Unix seconds, or milliseconds from 1e11 on; a date-time text or "
        "parquet timestamp column as its Unix seconds; NaN missing), from which the program "
        "derives the hour and weekday (and --time-trend's days) as training did. "
        "MODEL.serving.json says what each input holds (docs/serving.md).",
        formatter_class=fmt,
    )
    _common(x, "export")
    x.add_argument(
        "--out", required=True, help="the program: model.pt2 (torchscript: model.pt); required"
    )
    x.add_argument(
        "--format",
        dest="fmt",
        choices=("export", "torchscript"),
        default="export",
        help="export: a torch.export program (torch.export.load, no import of this package); "
        "torchscript: a TorchScript module (torch.jit.load)",
    )
    x.add_argument(
        "--table-dtype",
        choices=("fp32", "fp16"),
        default="fp32",
        help="the embedding tables' storage in the program: fp16 halves their bytes "
        "(pooled in float32)",
    )
    x.add_argument(
        "--dense-input",
        choices=("raw", "transformed"),
        default="raw",
        help="raw: the program applies the run's dense transform; transformed: the caller does",
    )
    x.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def _predictor(args: argparse.Namespace) -> Any:
    from torchrec_cowclip.serve.predictor import load_model

    return load_model(
        args.run,
        weights=args.weights,
        device=args.device,
        batch_size=args.batch_size,
        quantize=args.quantize,
        require_sha256=args.require_sha256,
    )


def _predict(args: argparse.Namespace) -> Dict[str, Any]:
    from torchrec_cowclip.serve.outputs import ScoreWriter, check_not_inputs, check_output

    output = check_output(args.output, args.overwrite)
    predictor = _predictor(args)
    source = predictor.open(args.data, delimiter=args.delimiter, keep=args.id_column)
    check_not_inputs("--output", output, getattr(source, "paths", []), predictor.run.model_dir)
    with ScoreWriter(output, keep_name=args.id_column, overwrite=args.overwrite) as writer:
        for scores, keep in predictor.scores(source, progress=args.progress):
            writer.write(scores, keep)
    _say_unseen(predictor)
    return {
        "output": str(output),
        "rows": writer.rows,
        "weights": predictor.weights,
        "out_of_range_ids": predictor.out_of_range,
        "unseen_values": predictor.unseen,
        "outside_training_range": predictor.outside,
    }


def _say_unseen(predictor: Any) -> None:
    import sys

    for line in (predictor.unseen_summary(), predictor.outside_summary()):
        if line is not None:
            print(f"torchrec-cowclip: {line}", file=sys.stderr)


def _evaluate(args: argparse.Namespace) -> Dict[str, Any]:
    predictor = _predictor(args)
    source = predictor.open(args.data, labels=True, delimiter=args.delimiter)
    metrics: Dict[str, Any] = predictor.evaluate(source, progress=args.progress)
    _say_unseen(predictor)
    return metrics


def _export(args: argparse.Namespace) -> Dict[str, Any]:
    from torchrec_cowclip.serve.export import export_run

    report = export_run(
        args.run,
        args.out,
        weights=args.weights,
        table_dtype=args.table_dtype,
        fmt=args.fmt,
        raw_dense=args.dense_input == "raw",
        overwrite=args.overwrite,
        require_sha256=args.require_sha256,
    )
    return {**report, "files": [str(p) for p in report["files"]]}


_RUNNERS: Dict[str, Callable[[argparse.Namespace], Dict[str, Any]]] = {
    "predict": _predict,
    "evaluate": _evaluate,
    "export": _export,
}


def run_command(args: argparse.Namespace) -> Dict[str, Any]:
    """Runs ``args.command`` (one of :data:`COMMANDS`) and returns its summary (the
    command line prints it as JSON; ``train.cli.main`` turns a refusal into one line)."""
    return _RUNNERS[args.command](args)

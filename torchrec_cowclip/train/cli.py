"""``torchrec-cowclip`` / ``python -m torchrec_cowclip``: the command line.

Example::

    torchrec-cowclip train --model deepfm --data criteo:train.txt --batch-size 131072 \\
        --epochs 1 --out runs/criteo-128k
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import List, Optional, Sequence

from torchrec_cowclip.compat import add_fx_tracing_filter
from torchrec_cowclip.models.embeddings import EMBEDDING_BACKENDS
from torchrec_cowclip.train.config import EMBEDDING_OPTIMIZERS, MODELS, ConfigError, TrainConfig
from torchrec_cowclip.train.distributed import SHARDING_CHOICES
from torchrec_cowclip.train.scaling import RECIPES

_DATA_HELP = (
    "training data: criteo:PATH[,PATH...] (raw Criteo TSV: Kaggle train.txt or 1TB "
    "day_N), criteo-npy:DIR (TorchRec's preprocessed day_N_{dense,sparse,labels}.npy), "
    "avazu:PATH, table:PATH (CSV/TSV/parquet with --label/--dense/--sparse), "
    "synthetic:ROWS (built-in Criteo-like data), synthetic-hard:ROWS (the same, harder)"
)


def _csv_list(text: str) -> List[str]:
    return [item for item in text.split(",") if item]


def _int_list(text: str) -> List[int]:
    try:
        return [int(item) for item in text.split(",") if item]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _resume_mode(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"takes no value or 'auto', got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrec-cowclip",
        description="Large-batch CTR training on TorchRec with CowClip (Zheng et al., AAAI 2023).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train a CTR model and write metrics.json",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = TrainConfig()
    g = t.add_argument_group("model and data")
    g.add_argument("--model", choices=MODELS, default=d.model)
    g.add_argument("--data", required=True, help=_DATA_HELP)
    g.add_argument(
        "--test-data",
        default=None,
        help="explicit test set (same kinds as --data); "
        "default: a random --test-fraction of --data",
    )
    g.add_argument("--test-fraction", type=float, default=d.test_fraction)
    g.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="validation split carved from the training rows (for early stopping)",
    )
    g.add_argument("--cache-dir", default=d.cache_dir, help="binary cache of converted data")
    g.add_argument("--on-bad-row", choices=("error", "skip"), default=d.on_bad_row)
    g.add_argument(
        "--hash-size",
        type=int,
        default=None,
        help="hash categorical values into this many ids per feature (default: exact vocabulary)",
    )
    g.add_argument(
        "--min-count",
        type=int,
        default=d.min_count,
        help="vocabulary: values seen fewer times share one OOV id",
    )
    g.add_argument("--dense-transform", choices=("log", "minmax"), default=d.dense_transform)
    g.add_argument("--label", default=None, help="table: label column")
    g.add_argument(
        "--dense", type=_csv_list, default=[], help="table: dense columns, comma-separated"
    )
    g.add_argument(
        "--sparse", type=_csv_list, default=[], help="table: categorical columns, comma-separated"
    )
    g.add_argument(
        "--synthetic-scale",
        type=float,
        default=None,
        help="synthetic: multiply Criteo Kaggle's cardinalities by this (default 1.0)",
    )
    g.add_argument(
        "--synthetic-max-cardinality",
        type=int,
        default=None,
        help="synthetic: cap every table at this many rows (default 1,000,000)",
    )
    g.add_argument(
        "--synthetic-seed",
        type=int,
        default=None,
        help="synthetic: the generator's seed, to draw other rows than --seed's (default: --seed)",
    )
    g.add_argument("--embedding-dim", type=int, default=d.embedding_dim)
    g.add_argument(
        "--hidden", type=_int_list, default=list(d.hidden), help="DNN sizes, e.g. 400,400,400"
    )
    g.add_argument("--cross-layers", type=int, default=d.cross_layers)
    g.add_argument("--init-std", type=float, default=d.init_std, help="embedding init N(0, std)")

    s = t.add_argument_group("scaling rule and optimizers")
    s.add_argument("--batch-size", type=int, default=d.batch_size)
    s.add_argument("--base-batch-size", type=int, default=d.base_batch_size)
    s.add_argument("--epochs", type=int, default=d.epochs)
    s.add_argument(
        "--recipe",
        choices=tuple(RECIPES),
        default=d.recipe,
        help="how every value below scales from --base-batch-size; "
        + "; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values())
        + ". Explicit options override the recipe",
    )
    s.add_argument(
        "--lr",
        type=float,
        default=None,
        help="dense lr (default, recipe paper: 8e-4 * sqrt(batch/base))",
    )
    s.add_argument(
        "--lr-embed",
        type=float,
        default=None,
        help="embedding lr (default, recipe paper: 1e-4, not scaled)",
    )
    s.add_argument(
        "--l2",
        type=float,
        default=None,
        help="embedding L2 lambda (default, recipe paper: 1e-5 * batch/base)",
    )
    s.add_argument("--clip-r", type=float, default=None, help="default: the recipe's (paper: 1)")
    s.add_argument(
        "--clip-zeta",
        type=float,
        default=None,
        help="default: r^2 * sqrt(dim) * bound (1e-5 Criteo, 1e-4 Avazu)",
    )
    s.add_argument(
        "--warmup-epochs",
        type=float,
        default=None,
        help="dense lr warm-up (default: the recipe's; paper: 1 epoch)",
    )
    s.add_argument(
        "--count-lr-power",
        type=float,
        default=None,
        help="per-id-frequency embedding lr: a row seen c times in the batch "
        "steps with lr * min(c, batch/base) ** POWER (not in the paper; "
        "default: the recipe's, paper: 0 = off; docs/scaling.md)",
    )
    s.add_argument(
        "--no-cowclip",
        dest="cowclip",
        action="store_false",
        help="no clipping (lazy optimizer on the same fused tables)",
    )
    s.add_argument(
        "--embedding-backend",
        choices=EMBEDDING_BACKENDS,
        default=d.embedding_backend,
        help="torchrec: stock EmbeddingBagCollection + torch.optim.Adam (needs --no-cowclip)",
    )
    s.add_argument(
        "--embedding-optimizer", choices=EMBEDDING_OPTIMIZERS, default=d.embedding_optimizer
    )
    s.add_argument(
        "--embedding-dtype",
        choices=("fp32", "fp16", "bf16"),
        default=d.embedding_dtype,
        help="storage of the table weights: fp16/bf16 halve their bytes (updated in float32 "
        "with stochastic rounding; optimizer state stays float32)",
    )
    s.add_argument(
        "--helen-rho",
        type=float,
        default=d.helen_rho,
        help="train the tables with Helen (frequency-wise sharpness-aware minimisation, two "
        "passes per step) with this perturbation radius at this batch (reference: 0.05); "
        "default: the recipe's (off but for recipes with Helen; docs/algorithm.md, 'Helen')",
    )
    s.add_argument(
        "--helen-bound",
        type=float,
        default=d.helen_bound,
        help="Helen's lower bound on a row's frequency share n_j / max n (default: the "
        "recipe's, 0.3)",
    )
    s.add_argument(
        "--helen-perturb-dense",
        action="store_true",
        help="Helen also perturbs the dense parameters (SAM with their global gradient "
        "norm); default: they step with the first pass's gradient",
    )

    r = t.add_argument_group("run")
    r.add_argument("--out", default=d.out, help="run directory (metrics.json, logs, checkpoint)")
    r.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="initial weights, batch order and the random splits, for every data kind "
        "(synthetic data is also drawn with it unless --synthetic-seed is given)",
    )
    r.add_argument("--early-stop-patience", type=int, default=d.early_stop_patience)
    r.add_argument(
        "--checkpoint-every", type=int, default=d.checkpoint_every, help="steps; 0: epoch ends only"
    )
    r.add_argument(
        "--keep-checkpoints",
        type=int,
        default=d.keep_checkpoints,
        metavar="K",
        help="keep the last K complete checkpoints (a damaged newest one falls back to "
        "the one before)",
    )
    r.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_mode,
        metavar="auto",
        help="continue from the newest intact checkpoint in --out/checkpoints (any number "
        "of processes); refused if a setting that changes the result differs from the "
        "checkpoint's (README, Reliability). '--resume auto': the same if there is a "
        "checkpoint, else start anew (for torchrun --max-restarts and schedulers' retries)",
    )
    r.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the previous run's files in --out first (without it, or "
        "--resume, an --out holding a run is refused)",
    )
    r.add_argument(
        "--max-steps",
        type=int,
        default=d.max_steps,
        help="stop after this many steps (0: no limit)",
    )
    r.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    r.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N]")
    r.add_argument(
        "--threads", type=int, default=d.threads, help="torch intra-op threads (0: default)"
    )
    r.add_argument(
        "--sharding",
        default=d.sharding,
        choices=SHARDING_CHOICES,
        help="under torchrun/torchx: how the embedding tables are sharded "
        "(auto: TorchRec's planner); refused on one process",
    )
    r.add_argument(
        "--dist-timeout",
        dest="dist_timeout_s",
        type=float,
        default=d.dist_timeout_s,
        help="seconds any collective may wait (a dead rank fails the job after this)",
    )
    r.add_argument("--no-progress", dest="progress", action="store_false")
    r.add_argument("--log-every", type=int, default=d.log_every)
    r.add_argument(
        "--row-clip-stats",
        action="store_true",
        help="count clipped updates per embedding row and report the clip rate by "
        "id frequency in the training split (clip_by_frequency.json; one process)",
    )
    return parser


def train_flags(parser: argparse.ArgumentParser) -> List[str]:
    """The long flags of ``parser``'s ``train`` command, in ``--help`` order (not ``--help``).

    Example::

        >>> flags = train_flags(build_parser())
        >>> flags[:3], "--seed" in flags, "--help" in flags
        (['--model', '--data', '--test-data'], True, False)
    """
    # argparse lists a parser's subcommands and arguments only in these attributes.
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return [
        a.option_strings[-1]
        for a in commands["train"]._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {k: v for k, v in vars(args).items() if k != "command"}
    values["hidden"] = tuple(values["hidden"])
    return TrainConfig(**values)


class _TorchFxTracingNotice(logging.Filter):
    """Drops torch's one-time notice that ``is_fx_tracing()`` is deprecated.

    torch.fx's own ``ProxyableClassMeta`` calls that function whenever a
    ``KeyedJaggedTensor`` or ``KeyedTensor`` is built, so a run cannot avoid it, and it
    advises the user about a call they never made (this package asks
    ``is_fx_symbolic_tracing()``).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("is_fx_tracing will return true")


_FX_TRACING_NOTICE = _TorchFxTracingNotice()

#: Exit statuses (README, "Reliability"): the command, its data or its checkpoint is
#: wrong; the training diverged; the environment failed (a full or read-only disk, a
#: dead or hung peer); a signal stopped the run after its checkpoint (``RunStopped``, 75).
EXIT_USAGE, EXIT_DIVERGED, EXIT_ENVIRONMENT = 2, 3, 4


def _one_line(error: BaseException) -> str:
    """An OS error as ``reason: path``; others as their message's first line."""
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{where}"
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    add_fx_tracing_filter(_FX_TRACING_NOTICE)
    parser = build_parser()
    args = parser.parse_args(argv)
    from torchrec_cowclip.data.errors import DataError  # deferred: keeps --help fast
    from torchrec_cowclip.distributed.comm import CollectiveError
    from torchrec_cowclip.train.checkpoint import CheckpointWriteError, NonFiniteStateError
    from torchrec_cowclip.train.distributed import shutdown_distributed
    from torchrec_cowclip.train.stop import RunStopped
    from torchrec_cowclip.train.trainer import NonFiniteLossError, train

    try:
        config = config_from_args(args)
        config.validate()
        metrics = train(config)
    except (ConfigError, DataError, FileNotFoundError) as e:
        parser.exit(EXIT_USAGE, f"torchrec-cowclip: error: {e}\n")
    except (NonFiniteLossError, NonFiniteStateError) as e:
        parser.exit(EXIT_DIVERGED, f"torchrec-cowclip: {e}\n")
    except (CheckpointWriteError, CollectiveError, OSError) as e:
        parser.exit(EXIT_ENVIRONMENT, f"torchrec-cowclip: error: {_one_line(e)}\n")
    except RunStopped as e:
        parser.exit(e.exit_status, f"torchrec-cowclip: {e}\n")
    shutdown_distributed()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports for a multi-process run
    summary = {
        k: metrics[k]
        for k in (
            "auc",
            "logloss",
            "best_epoch",
            "epochs",
            "steps",
            "train_samples_per_s",
            "rows_updated",
            "rows_clipped",
        )
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

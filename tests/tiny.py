"""The small things every test builds: tables, trainer configs, command lines.

One place for them, so that a test says only how its case differs from the usual one
(``tiny_config(tmp, batch_size=128)``) and a change of the usual case is one edit.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from cowclip_testing import mixed_scale_weights
from torchrec import EmbeddingBagConfig, PoolingType

from torchrec_cowclip.train import TrainConfig

# --- tables ---------------------------------------------------------------------------------

#: The rows of each table of :func:`mixed_tables`.
MIXED_ROWS = {"shared": 40, "small": 30, "mean": 25, "linear": 20}


def bag_config(
    name: str = "t", dim: int = 4, rows: int = 10, features: Sequence[str] = ("f",), **config: Any
) -> EmbeddingBagConfig:
    """One ``EmbeddingBagConfig``: ``bag_config("lin", dim=1)``."""
    return EmbeddingBagConfig(
        name=name,
        embedding_dim=dim,
        num_embeddings=rows,
        feature_names=list(features),
        **config,
    )


def mixed_tables(
    dim: int = 8,
    small_dim: int = 4,
    order: Sequence[str] = ("shared", "small", "mean", "linear"),
) -> List[EmbeddingBagConfig]:
    """The four tables of the collection and Helen tests: ``shared`` (two features, fa
    and fb), ``small`` (``small_dim``), ``mean`` (MEAN pooling) and ``linear`` (dim 1,
    the unclipped first-order table), ``dim`` wide where not said. Features fc, fd, fe
    follow ``order``: the order decides which table's pooled output comes first."""
    features = iter(["fc", "fd", "fe"])
    dims = {"shared": dim, "small": small_dim, "mean": dim, "linear": 1}
    tables = []
    for name in order:
        names = ["fa", "fb"] if name == "shared" else [next(features)]
        pooling = {"pooling": PoolingType.MEAN} if name == "mean" else {}
        tables.append(bag_config(name, dims[name], MIXED_ROWS[name], names, **pooling))
    return tables


#: The table order of the Helen tests (their pooled outputs feed one linear head).
HELEN_ORDER = ("shared", "mean", "small", "linear")

#: The step hyperparameters of the reference tests: large enough that a few steps move
#: every state, none at its default.
HYPER: Dict[str, Any] = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)


def load_mixed_scale_weights(
    module: torch.nn.Module, tables: Sequence[EmbeddingBagConfig], generator: torch.Generator
) -> Dict[str, torch.Tensor]:
    """Draws :func:`cowclip_testing.mixed_scale_weights` for each table, copies them into
    ``module.embedding_bags`` and returns them (for the reference)."""
    weights = {
        t.name: mixed_scale_weights(t.num_embeddings, t.embedding_dim, generator) for t in tables
    }
    with torch.no_grad():
        for name, weight in weights.items():
            module.embedding_bags[name].weight.copy_(weight)
    return weights


# --- trainer runs ---------------------------------------------------------------------------

#: The tiny one-process run (2,700 training rows; TrainConfig fields): 10 steps an epoch
#: at batch 256, the last 140 rows dropped.
TINY_RUN: Dict[str, Any] = dict(
    model="deepfm",
    data="synthetic:3000",
    batch_size=256,
    epochs=1,
    hidden=(8, 8),
    embedding_dim=4,
    synthetic_scale=0.001,
    synthetic_max_cardinality=200,
    progress=False,
    eval_batch_size=4096,
    log_every=1,
    threads=1,
)

#: ``TINY_RUN`` for a data kind read from files (give ``data=``): no generator options.
TINY_FILE_RUN: Dict[str, Any] = {k: v for k, v in TINY_RUN.items() if not k.startswith("synthetic")}

#: The tiny multi-process run (16,000 rows, 1,600 test and 1,440 validation; 12,960
#: training rows at batch 1536: 8 steps an epoch, 2 epochs).
TINY_PROCESSES: Dict[str, Any] = dict(
    model="deepfm",
    data="synthetic:16000",
    batch_size=1536,
    hidden=(16, 16),
    synthetic_scale=0.01,
    synthetic_max_cardinality=3000,
    lr_embed=1e-2,
    epochs=2,
    progress=False,
    dist_timeout_s=60,
    val_fraction=0.1,
    early_stop_patience=3,
    embedding_dim=6,
)

#: The one-process run that learns something (30,000 rows, 27,000 to train).
SMALL_RUN: Dict[str, Any] = dict(
    model="deepfm",
    data="synthetic:30000",
    batch_size=1024,
    epochs=1,
    hidden=(32, 32),
    lr_embed=1e-2,
    synthetic_scale=0.01,
    synthetic_max_cardinality=5000,
    progress=False,
    eval_batch_size=8192,
    log_every=5,
)


def tiny_config(
    root: Optional[os.PathLike] = None, base: Mapping[str, Any] = TINY_RUN, **overrides: Any
) -> TrainConfig:
    """``base`` with ``overrides`` as a TrainConfig; with ``root``, the run writes to
    ``root/run`` and caches in ``root/cache`` (an ``out`` / ``cache_dir`` override wins)."""
    where = (
        {}
        if root is None
        else dict(out=os.path.join(root, "run"), cache_dir=os.path.join(root, "cache"))
    )
    return TrainConfig(**{**base, **where, **overrides})


# --- command lines --------------------------------------------------------------------------


def cli_args(*, command: Optional[str] = "train", **flags: Any) -> List[str]:
    """Command-line arguments for ``flags`` given as TrainConfig-style names:
    ``batch_size=256`` -> ``--batch-size 256``, ``no_progress=True`` -> ``--no-progress``,
    tuples comma-joined; ``command=None`` leaves out the sub-command."""
    argv = [] if command is None else [command]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (tuple, list)):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def tiny_cli(base: Mapping[str, Any] = TINY_RUN, **overrides: Any) -> List[str]:
    """``base`` with ``overrides`` as ``train`` arguments, progress bars off:
    ``tiny_cli(batch_size=128)``."""
    flags = {k: v for k, v in {**base, **overrides}.items() if k != "progress"}
    return cli_args(**flags, no_progress=True)


#: ``TINY_RUN`` as ``train`` arguments.
TINY_CLI = tiny_cli()

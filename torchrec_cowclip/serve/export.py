"""A trained model for serving: one ``torch.export`` program of plain tensors and ops.

``torchrec-cowclip export --run DIR --out model.pt2`` writes three files:

* ``model.pt2``: a ``torch.export`` program (``torch.export.load``, then ``.module()``;
  no import of this package, TorchRec or FBGEMM is needed: the graph holds only aten
  ops) computing ``forward(dense, ids) -> probability``:

  - ``dense``: float32 ``[B, n_dense]``, the raw values (NaN for missing) in the
    schema's order; the run's dense transform (missing and negatives -> 0, clip at
    ``DENSE_CLIP``, then log(1 + x) or the training min-max) runs in the program;
  - ``ids``: int64 ``[B, n_sparse]``, one id per categorical column in the schema's
    order, encoded as training encoded them (the vocabulary shipped beside it, or
    hashing); an id outside its table is read as row 0;
  - ``probability``: float32 ``[B]``; ``B`` is dynamic (1 and up).

  The tables are plain buffers (``index_select``, one row per column: the training
  collection pooled one id per feature by SUM), in float32 or, ``--table-dtype fp16``,
  stored in half and read back as float32. ``--format torchscript`` writes a TorchScript
  module instead (``torch.jit.load``), for stacks without ``torch.export``;
* ``model.serving.json``: the contract: the inputs' columns, order, dtypes and shapes,
  each categorical column's encoding (vocabulary ids with OOV 0 and missing 1, or the
  hash and table size), the dense transform and its statistics, the run's metrics;
* ``model.vocab.npz`` (runs with a vocabulary): per column ``keys_<i>`` (the values
  in id order: id = 2 + position) and ``counts_<i>``, and ``model.vocab.json``
  (``{column: {value: id}}``) when the vocabularies hold at most a million values.

Each file is written through a temporary and renamed. Before anything is written the
program is checked against the run's model as ``predict`` scores with it, on random
rows: the largest difference of the probabilities must be within 1e-6 (fp32 tables);
the check's figure is returned and printed.

Example::

    >>> import tempfile
    >>> from torchrec_cowclip.train import TrainConfig, train
    >>> tmp = tempfile.mkdtemp()
    >>> _ = train(TrainConfig(data="criteo:tests/data/criteo_sample.tsv", hidden=(8,),
    ...                       batch_size=64, progress=False, out=f"{tmp}/run",
    ...                       cache_dir=f"{tmp}/cache"))
    >>> report = export_run(f"{tmp}/run", f"{tmp}/model.pt2")
    >>> report["max_abs_difference"] <= 1e-6, sorted(p.name for p in report["files"])
    (True, ['model.pt2', 'model.serving.json', 'model.vocab.json', 'model.vocab.npz'])
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor, nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_cowclip.data.parsing.dense import DENSE_CLIP, DenseStats, transform_dense
from torchrec_cowclip.data.pipeline.batches import make_batch
from torchrec_cowclip.data.pipeline.run_encoders import IdVocabulary
from torchrec_cowclip.models.base import CTRModel
from torchrec_cowclip.serve.predictor import Predictor
from torchrec_cowclip.train.config import ConfigError
from torchrec_cowclip.train.run_folder import RunFolder

#: The dense transforms the program computes itself.
PROGRAM_TRANSFORMS = ("log", "minmax", "none")
TABLE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
FORMATS = ("export", "torchscript")
PARITY_TOLERANCE = 1e-6
PARITY_ROWS = 512
#: Vocabularies up to this many values in all are also written as JSON.
JSON_VOCABULARY_LIMIT = 1_000_000
CONTRACT_FORMAT = "torchrec_cowclip serving contract"


class ExportError(ConfigError):
    """The model cannot be exported as asked; the message says why."""


class PlainEmbeddings(nn.Module):
    """Stands in for a model's embedding collection: its tables as plain buffers, one row
    per categorical column (the ``ids`` tensor's), output as the collection's
    ``KeyedTensor`` (same keys, order and widths).

    Args:
        collection: the trained collection (CowClip or TorchRec's).
        sparse_names: the ``ids`` columns, in order.
        table_dtype: the tables' storage (read back in the collection's output type).
    """

    def __init__(
        self, collection: nn.Module, sparse_names: Sequence[str], table_dtype: torch.dtype
    ) -> None:
        super().__init__()
        names = list(sparse_names)
        one_row = KeyedJaggedTensor.from_lengths_sync(
            keys=names,
            values=torch.zeros(len(names), dtype=torch.int64),
            lengths=torch.ones(len(names), dtype=torch.int32),
        )
        with torch.no_grad():
            probe = collection(one_row)
        self.keys: List[str] = list(probe.keys())
        self.widths: List[int] = list(probe.length_per_key())
        self.out_dtype = probe.values().dtype
        weights = collection.state_dict()
        lookups = [
            (feature, config.name)
            for config in collection.embedding_bag_configs()  # type: ignore[operator]
            for feature in config.feature_names
        ]
        if len(lookups) != len(self.keys):
            raise ExportError(
                f"the collection's {len(self.keys)} outputs are not one per table feature"
            )
        self.columns: List[int] = [names.index(feature) for feature, _ in lookups]
        self.tables: List[str] = []
        for index, (_, table) in enumerate(lookups):
            weight = weights[f"embedding_bags.{table}.weight"]
            self.register_buffer(f"table_{index}", weight.detach().to(table_dtype).clone())
            self.tables.append(f"table_{index}")

    def forward(self, ids: Tensor) -> KeyedTensor:
        values = torch.cat(
            [
                getattr(self, table).index_select(0, ids[:, column]).to(self.out_dtype)
                for table, column in zip(self.tables, self.columns)
            ],
            dim=1,
        )
        return KeyedTensor(keys=self.keys, length_per_key=self.widths, values=values)


class DenseTransform(nn.Module):
    """The run's dense transform in torch (float64 inside, as ``data.parsing.dense``):
    missing and negatives -> 0, clip at ``DENSE_CLIP``, then log(1 + x), min-max or
    nothing."""

    lo: Tensor
    span: Tensor

    def __init__(self, kind: str, stats: Optional[DenseStats], n_dense: int) -> None:
        super().__init__()
        if kind not in PROGRAM_TRANSFORMS:
            raise ExportError(
                f"the dense transform {kind!r} has no in-program form: export with "
                "raw_dense=False (--dense-input transformed) and feed transformed values"
            )
        # No columns, nothing to scale (and torch.export.save cannot write empty buffers).
        self.kind = kind if n_dense else "none"
        if self.kind == "minmax":
            if stats is None:
                raise ExportError("a minmax run folder without its dense statistics")
            lo = np.where(np.isfinite(stats.min), stats.min, 0.0)
            span = np.where(np.isfinite(stats.max), stats.max, 0.0) - lo
            self.register_buffer("lo", torch.from_numpy(lo.astype(np.float64)))
            self.register_buffer("span", torch.from_numpy(span.astype(np.float64)))

    def forward(self, dense: Tensor) -> Tensor:
        v = torch.nan_to_num(dense.double(), nan=0.0).clamp(0.0, DENSE_CLIP)
        if self.kind == "log":
            v = torch.log1p(v)
        elif self.kind == "minmax":
            safe = torch.where(self.span > 0, self.span, torch.ones_like(self.span))
            v = torch.where(self.span > 0, (v - self.lo) / safe, torch.zeros_like(v))
        return v.float()


class ServingModel(nn.Module):
    """``forward(dense [B, n_dense] float32, ids [B, n_sparse] int64) -> probability [B]``:
    the trained model with :class:`PlainEmbeddings` for its collection (see the module
    docstring)."""

    rows: Tensor

    def __init__(
        self, model: CTRModel, cardinalities: Sequence[int], dense: Optional[nn.Module]
    ) -> None:
        super().__init__()
        self.model = model
        self.dense_transform: nn.Module = dense if dense is not None else nn.Identity()
        self.register_buffer("rows", torch.tensor(list(cardinalities), dtype=torch.int64))

    def forward(self, dense: Tensor, ids: Tensor) -> Tensor:
        inside = (ids >= 0) & (ids < self.rows)
        ids = torch.where(inside, ids, torch.zeros_like(ids))
        logits: Tensor = self.model(self.dense_transform(dense), ids)
        return torch.sigmoid(logits)


def _swap_collection(model: CTRModel, plain: nn.Module) -> None:
    """Puts ``plain`` where ``model``'s embedding collection is (found by identity)."""
    collection = model.embedding_collection
    for owner in model.modules():
        for name, child in owner.named_children():
            if child is collection:
                setattr(owner, name, plain)
                return
    raise ExportError(f"{type(model).__name__}: its embedding collection is not a submodule")


def serving_model(
    run: RunFolder,
    weights: Optional[str] = None,
    table_dtype: str = "fp32",
    raw_dense: bool = True,
) -> ServingModel:
    """The :class:`ServingModel` of ``run``'s ``weights`` (a model of its own: the
    run's model is rebuilt for it)."""
    if table_dtype not in TABLE_DTYPES:
        raise ExportError(f"--table-dtype must be one of {', '.join(TABLE_DTYPES)}")
    model = run.build_model(weights)
    schema = run.schema
    plain = PlainEmbeddings(
        model.embedding_collection, schema.sparse_names, TABLE_DTYPES[table_dtype]
    )
    _swap_collection(model, plain)
    _, stats = run.encoder()
    dense = DenseTransform(run.dense_transform, stats, schema.n_dense) if raw_dense else None
    serving = ServingModel(model, schema.cardinalities, dense).eval()
    for parameter in serving.parameters():  # inference only: outputs that need no grad
        parameter.requires_grad_(False)
    return serving


def _parity_rows(run: RunFolder, rows: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random raw rows: count-like dense values with a few missing and negative ones,
    ids over every table's rows (some outside them)."""
    g = np.random.default_rng(seed)
    schema = run.schema
    dense = np.floor(np.exp(g.normal(1.0, 2.0, size=(rows, schema.n_dense))))
    dense[g.random(dense.shape) < 0.1] = np.nan
    dense[g.random(dense.shape) < 0.02] = -1.0
    cards = np.asarray(schema.cardinalities)
    ids = np.floor(g.random((rows, schema.n_sparse)) * (cards + 1)).astype(np.int64)
    return torch.from_numpy(dense.astype(np.float32)), torch.from_numpy(ids)


def reference_scores(predictor: Predictor, dense: Tensor, ids: Tensor, raw_dense: bool) -> Tensor:
    """What ``predict`` gives for raw rows (its transform, encoder bounds and model)."""
    run = predictor.run
    _, stats = run.encoder()
    x = (
        transform_dense(dense.double().numpy(), run.dense_transform, stats)
        if raw_dense
        else dense.numpy()
    )
    cards = torch.tensor(run.schema.cardinalities)
    ids = torch.where((ids >= 0) & (ids < cards), ids, torch.zeros_like(ids))
    batch = make_batch(x, ids.numpy(), np.zeros(len(ids), np.float32), predictor.keys)
    with torch.no_grad():
        return torch.sigmoid(predictor.model(batch.dense_features, batch.sparse_features))


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    # The suffix stays last: torch.export.save wants a name ending in .pt2.
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


def _encoding_contract(run: RunFolder) -> Dict[str, Any]:
    encoding = dict(run.data_info["encoder"]["encoding"])
    kind = encoding["kind"]
    rules = {
        "id vocabulary": "id = 2 + the value's position in the vocabulary; missing (empty) "
        "1; a value not in it 0",
        "hash": {
            "hex": "id = 1 + int(value, 16) % (rows - 1); missing 0",
            "fnv": "id = 1 + splitmix64_finaliser(fnv1a_64(value bytes)) % (rows - 1); "
            "missing 0 (torchrec_cowclip.data.parsing.hashing)",
            "mod": "id = stored id % rows",
        }.get(encoding.get("method", ""), ""),
        "as stored": "id = the stored id",
        "synthetic ids": "id = the stored id",
    }
    return {**encoding, "rule": rules.get(kind, "")}


def contract(
    run: RunFolder,
    program: str,
    fmt: str,
    table_dtype: str,
    raw_dense: bool,
    vocabulary: Optional[Dict[str, str]],
    parity: float,
) -> Dict[str, Any]:
    """``model.serving.json``: what a serving stack feeds the program and how."""
    schema = run.schema
    _, stats = run.encoder()
    return {
        "format": CONTRACT_FORMAT,
        "version": 1,
        "program": program,
        "loader": "torch.export.load(path).module()" if fmt == "export" else "torch.jit.load(path)",
        "inputs": [
            {
                "name": "dense",
                "dtype": "float32",
                "shape": ["batch", schema.n_dense],
                "columns": list(schema.dense_names),
                "values": "raw (NaN for missing); the program applies the transform"
                if raw_dense
                else "transformed as described below (the program applies none)",
                "transform": run.dense_transform,
                "clip": DENSE_CLIP,
                "statistics": None
                if stats is None
                else {"min": stats.min.tolist(), "max": stats.max.tolist()},
            },
            {
                "name": "ids",
                "dtype": "int64",
                "shape": ["batch", schema.n_sparse],
                "columns": list(schema.sparse_names),
                "rows": list(schema.cardinalities),
                "encoding": _encoding_contract(run),
                "vocabulary": vocabulary,
                "outside_rows": "read as id 0",
            },
        ],
        "output": {"name": "probability", "dtype": "float32", "shape": ["batch"]},
        "tables": table_dtype,
        "parity_max_abs_difference": parity,
        "model": run.model_name,
        "weights": run.reported,
        "metrics": run.metrics,
        "run": str(run.path.resolve()),
    }


def _write_vocabulary(run: RunFolder, out: Path) -> Optional[Dict[str, str]]:
    kept = run.data_info["encoder"].get("vocabulary")
    if not kept:
        return None
    vocab = IdVocabulary.load(run.model_dir / kept)
    npz = out.with_name(out.stem + ".vocab.npz")
    _atomic(npz, lambda tmp: vocab.save(tmp))
    files = {"npz": npz.name}
    if sum(len(k) for k in vocab.keys) <= JSON_VOCABULARY_LIMIT:
        table = {
            name: {k.decode("utf-8", "replace"): 2 + i for i, k in enumerate(keys.tolist())}
            for name, keys in zip(vocab.names, vocab.keys)
        }
        path = out.with_name(out.stem + ".vocab.json")
        _atomic(path, lambda tmp: _write_text(tmp, json.dumps(table)))
        files["json"] = path.name
    return files


def export_run(
    run_dir: Union[str, Path],
    out: Union[str, Path],
    *,
    weights: Optional[str] = None,
    table_dtype: str = "fp32",
    fmt: str = "export",
    raw_dense: bool = True,
    overwrite: bool = False,
) -> Dict[str, Any]:
    """Exports a run folder's model for serving (see the module docstring).

    Returns:
        ``{"files": [paths], "max_abs_difference": float, "rows_checked": int}``.

    Raises:
        ExportError: an unknown format or table dtype, an output that exists (without
            ``overwrite``), a program whose probabilities differ from ``predict``'s by
            more than 1e-6 (fp32 tables).
        RunFolderError: the run folder is not intact.
    """
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out = Path(out).expanduser()
    wanted = ".pt2" if fmt == "export" else ".pt"
    if out.suffix != wanted:
        raise ExportError(f"--out {out}: a {fmt} program is written as {wanted}")
    if out.exists() and not overwrite:
        raise ExportError(f"--out {out} exists: add --overwrite to replace it")
    if not out.parent.is_dir():
        raise ExportError(f"--out {out}: directory {out.parent} does not exist")
    run = RunFolder.open(run_dir)
    predictor = Predictor(run, weights=weights)
    module = serving_model(run, predictor.weights, table_dtype, raw_dense)
    dense, ids = _parity_rows(run, PARITY_ROWS)
    with torch.no_grad():
        if fmt == "export":
            batch = torch.export.Dim("batch", min=1)
            program: Any = torch.export.export(
                module, (dense, ids), dynamic_shapes={"dense": {0: batch}, "ids": {0: batch}}
            )
            got = program.module()(dense, ids)
        else:
            with warnings.catch_warnings():
                # The models' shape checks read the dense width, a constant of the program.
                warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
                program = torch.jit.trace(module, (dense, ids))
            got = program(dense, ids)
    expected = reference_scores(predictor, dense, ids, raw_dense)
    difference = float((got - expected).abs().max())
    if table_dtype == "fp32" and not difference <= PARITY_TOLERANCE:
        raise ExportError(
            f"the exported program's probabilities differ from predict's by {difference:.3g} "
            f"(> {PARITY_TOLERANCE:g}) on {len(ids)} random rows: not written"
        )
    save: Callable[[Path], None] = (
        (lambda tmp: torch.export.save(program, str(tmp)))
        if fmt == "export"
        else (lambda tmp: program.save(str(tmp)))
    )
    _atomic(out, save)
    vocabulary = _write_vocabulary(run, out)
    terms = contract(run, out.name, fmt, table_dtype, raw_dense, vocabulary, difference)
    contract_path = out.with_name(out.stem + ".serving.json")
    _atomic(contract_path, lambda tmp: _write_text(tmp, json.dumps(terms, indent=1)))
    files = [out, contract_path] + [out.with_name(v) for v in (vocabulary or {}).values()]
    return {"files": files, "max_abs_difference": difference, "rows_checked": len(ids)}

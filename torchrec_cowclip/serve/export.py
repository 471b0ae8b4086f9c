"""A trained model for serving: one ``torch.export`` program of plain tensors and ops.

``torchrec-cowclip export --run DIR --out model.pt2`` writes three files:

* ``model.pt2``: a ``torch.export`` program (``torch.export.load``, then ``.module()``;
  no import of this package, TorchRec or FBGEMM is needed: the graph holds only aten
  ops) computing ``forward(dense, ids) -> probability``:

  - ``dense``: float32 ``[B, n_dense]``, the raw values (NaN for missing) in the
    schema's order; the run's dense plan runs in the program (:class:`DensePlanModule`:
    each column's pointwise function and a clip at +-``DENSE_CLIP``, its transform with the training split's
    statistics, missing -> 0, the missing-value indicators, the one-hot quantile
    buckets), or, with
    ``--dense-input transformed``, the caller feeds the plan's outputs;
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
  hash and table size), the dense plan (per column its transform, shift, scale and
  indicator), the run's metrics;
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

from torchrec_cowclip.data.parsing.dense import DENSE_CLIP, DensePlan
from torchrec_cowclip.data.pipeline.batches import make_batch
from torchrec_cowclip.data.pipeline.run_encoders import IdVocabulary
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.models.base import CTRModel
from torchrec_cowclip.run.model_folder import RunFolder
from torchrec_cowclip.run.no_space import space_checked
from torchrec_cowclip.serve.outputs import check_not_inputs, claim_output, publish
from torchrec_cowclip.serve.predictor import Predictor

#: The dense transforms the program computes itself (all of ``data.parsing.dense``'s).
PROGRAM_TRANSFORMS = ("log", "signed-log", "standardize", "minmax", "none")
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


class DensePlanModule(nn.Module):
    """The run's dense plan (``data.parsing.dense.DensePlan.transform``) in torch: raw
    values (NaN for missing) -> the model's dense inputs, with the same float64 stages
    as ``predict``: each column's pointwise function (log with its negatives at 0,
    signed-log), a clip at +-``DENSE_CLIP`` (before the function for a legacy plan's
    ``clip_before``), float32 storage, ``(v - shift) / scale``, missing -> 0, then the
    missing-value indicators and the one-hot quantile buckets."""

    shift: Tensor
    scale: Tensor
    log: Tensor
    signed: Tensor
    indicators: Tensor

    def __init__(self, plan: DensePlan) -> None:
        super().__init__()
        unknown = sorted(set(plan.transforms) - set(PROGRAM_TRANSFORMS))
        if unknown:
            raise ExportError(
                f"the dense transform {unknown[0]!r} has no in-program form: export with "
                "--dense-input transformed and feed the plan's inputs"
            )
        transforms = np.asarray(plan.transforms)
        # No columns: nothing to do (and torch.export.save cannot write empty buffers).
        self.columns = len(plan.names)
        self.clip_before = plan.clip_before
        self.indicated = len(plan.indicators)
        if self.columns:
            self.register_buffer("shift", torch.tensor(plan.shift, dtype=torch.float64))
            self.register_buffer("scale", torch.tensor(plan.scale, dtype=torch.float64))
            self.register_buffer("log", torch.from_numpy(transforms == "log"))
            self.register_buffer("signed", torch.from_numpy(transforms == "signed-log"))
        if self.indicated:
            positions = [plan.names.index(n) for n in plan.indicators]
            self.register_buffer("indicators", torch.tensor(positions, dtype=torch.int64))
        # The bucketed columns' boundaries, as buffers edges_<column>.
        self.bucketed = [j for j, e in enumerate(plan.edges) if e]
        for j in self.bucketed:
            self.register_buffer(f"edges_{j}", torch.tensor(plan.edges[j], dtype=torch.float64))

    def forward(self, dense: Tensor) -> Tensor:
        if not self.columns:
            return dense.float()
        v = dense.double()
        if self.clip_before is not None:
            v = v.clamp(-self.clip_before, self.clip_before)
        v = torch.where(self.log & (v < 0), torch.zeros_like(v), v)
        v = torch.where(self.log, torch.log1p(v), v)
        v = torch.where(self.signed, torch.sign(v) * torch.log1p(v.abs()), v)
        if self.clip_before is None:
            v = v.clamp(-DENSE_CLIP, DENSE_CLIP)
        stored = v.float().double()  # the cache stores float32
        missing = torch.isnan(stored)
        out = torch.where(missing, torch.zeros_like(stored), (stored - self.shift) / self.scale)
        if self.indicated:
            out = torch.cat([out, missing.index_select(1, self.indicators).double()], dim=1)
        for j in self.bucketed:
            edges: Tensor = getattr(self, f"edges_{j}")
            # right=True: the count of boundaries <= v, as numpy's searchsorted side="right".
            bucket = torch.bucketize(stored[:, j].contiguous(), edges, right=True)
            hot = torch.nn.functional.one_hot(bucket, edges.numel() + 1).double()
            out = torch.cat([out, hot * (~missing[:, j : j + 1]).double()], dim=1)
        return out.float()


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
    dense = DensePlanModule(run.dense_plan()) if raw_dense else None
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
    dense[g.random(dense.shape) < 0.02] *= -1.0
    cards = np.asarray(schema.cardinalities)
    ids = np.floor(g.random((rows, schema.n_sparse)) * (cards + 1)).astype(np.int64)
    return torch.from_numpy(dense.astype(np.float32)), torch.from_numpy(ids)


def reference_scores(predictor: Predictor, raw: Tensor, ids: Tensor) -> Tensor:
    """What ``predict`` gives for raw rows (its dense plan, encoder bounds and model)."""
    run = predictor.run
    x = run.dense_plan().transform(raw.double().numpy())
    cards = torch.tensor(run.schema.cardinalities)
    ids = torch.where((ids >= 0) & (ids < cards), ids, torch.zeros_like(ids))
    batch = make_batch(x, ids.numpy(), np.zeros(len(ids), np.float32), predictor.keys)
    with torch.no_grad():
        return torch.sigmoid(predictor.model(batch.dense_features, batch.sparse_features))


class _Staged:
    """The files of one export, each written to a temporary beside its place and put in
    place together once all are written (a failure or a signal leaves none of them
    half-written, and no new program beside an old contract)."""

    def __init__(self, overwrite: bool) -> None:
        self.overwrite = overwrite
        self.files: Dict[Path, Path] = {}

    @staticmethod
    def temporary(path: Path) -> Path:
        # The suffix stays last: torch.export.save wants a name ending in .pt2.
        return path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")

    def write(self, path: Path, write: Callable[[Path], None]) -> None:
        tmp = self.temporary(path)
        self.files[path] = tmp
        write(tmp)

    def discard(self) -> None:
        for tmp in self.files.values():
            tmp.unlink(missing_ok=True)

    def publish(self) -> None:
        """Puts every file in place, the contract (written last) last."""
        for path, tmp in self.files.items():
            publish(tmp, path, self.overwrite)


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
    schema, plan = run.schema, run.dense_plan()
    return {
        "format": CONTRACT_FORMAT,
        "version": 1,
        "program": program,
        "loader": "torch.export.load(path).module()" if fmt == "export" else "torch.jit.load(path)",
        "inputs": [
            {
                "name": "dense",
                "dtype": "float32",
                "shape": ["batch", len(plan.names) if raw_dense else len(plan.output_names)],
                "columns": list(plan.names if raw_dense else plan.output_names),
                "values": "raw (NaN for missing); the program applies the dense plan"
                if raw_dense
                else "the dense plan's outputs, computed by the caller (the program applies "
                "none): per column clip at +-clip, its transform, (v - shift) / scale, "
                "missing -> 0, then a 0/1 input per indicator column",
                "plan": plan.to_json(),
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


def _write_vocabulary(run: RunFolder, out: Path, staged: _Staged) -> Optional[Dict[str, str]]:
    kept = run.vocabulary_file()
    if kept is None:
        return None
    vocab = IdVocabulary.load(kept)
    npz = out.with_name(out.stem + ".vocab.npz")
    staged.write(npz, lambda tmp: vocab.save(tmp))
    files = {"npz": npz.name}
    if sum(len(k) for k in vocab.keys) <= JSON_VOCABULARY_LIMIT:
        table = {
            name: {k.decode("utf-8", "replace"): 2 + i for i, k in enumerate(keys.tolist())}
            for name, keys in zip(vocab.names, vocab.keys)
        }
        path = out.with_name(out.stem + ".vocab.json")
        staged.write(path, lambda tmp: _write_text(tmp, json.dumps(table)))
        files["json"] = path.name
    return files


def export_files(out: Path) -> List[Path]:
    """Every file an export to ``out`` may write: the program, its contract and the
    vocabulary's two forms."""
    return [
        out,
        out.with_name(out.stem + ".serving.json"),
        out.with_name(out.stem + ".vocab.npz"),
        out.with_name(out.stem + ".vocab.json"),
    ]


def export_run(
    run_dir: Union[str, Path],
    out: Union[str, Path],
    *,
    weights: Optional[str] = None,
    table_dtype: str = "fp32",
    fmt: str = "export",
    raw_dense: bool = True,
    overwrite: bool = False,
    require_sha256: bool = False,
) -> Dict[str, Any]:
    """Exports a run folder's model for serving (see the module docstring);
    ``require_sha256`` refuses a format-1 (CRC-32) run folder.

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
    names = export_files(out)
    present = [p for p in names if p.exists()]
    if present and not overwrite:
        raise ExportError(
            f"--out {out}: {present[0]} exists: add --overwrite to replace it (an export "
            f"writes {', '.join(p.name for p in names)})"
        )
    run = RunFolder.open(run_dir, require_sha256=require_sha256)
    check_not_inputs("--out", out, [], run.model_dir)
    predictor = Predictor(run, weights=weights)
    module = serving_model(run, predictor.weights, table_dtype, raw_dense)
    raw, ids = _parity_rows(run, PARITY_ROWS)
    dense = raw if raw_dense else torch.from_numpy(run.dense_plan().transform(raw.double().numpy()))
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
    expected = reference_scores(predictor, raw, ids)
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
    with space_checked(out):
        out.parent.mkdir(parents=True, exist_ok=True)  # as train's --out, made when written
    lock = claim_output("--out", out, [f".{p.name}.tmp-*" for p in names])
    staged = _Staged(overwrite)
    try:
        with space_checked(out, staged.discard):
            staged.write(out, save)
            vocabulary = _write_vocabulary(run, out, staged)
            terms = contract(run, out.name, fmt, table_dtype, raw_dense, vocabulary, difference)
            contract_path = names[1]
            staged.write(contract_path, lambda tmp: _write_text(tmp, json.dumps(terms, indent=1)))
            staged.publish()
        for stale in set(names) - set(staged.files):
            # --overwrite: an earlier export's vocabulary that this one does not write
            # would not describe the new program.
            stale.unlink(missing_ok=True)
    finally:
        staged.discard()
        lock.release()
    files = list(staged.files)
    return {"files": files, "max_abs_difference": difference, "rows_checked": len(ids)}

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
  - ``time`` (runs with ``--time-columns`` only: ``forward(dense, ids, time)``):
    float64 ``[B, n_time]``, each time column's timestamp as a number (Unix seconds,
    or milliseconds from 1e11 on; a date-time text or parquet timestamp column as its
    Unix seconds; NaN missing): the program derives its hour and weekday features as
    training did (:class:`TimeFeatures`), which ``ids`` then leaves out;
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
from torchrec_cowclip.data.parsing.time import (
    DAY_S,
    EPOCH_WEEKDAY,
    HOUR_S,
    MILLISECONDS_FROM,
    TREND_SUFFIX,
    days_of_seconds,
    parts_of_seconds,
    seconds_of_numbers,
)
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


class TimeFeatures(nn.Module):
    """The run's time columns (``--time-columns``) in torch: timestamps float64
    ``[B, n_time]`` -> the ids of their hour and weekday features ``[B, 2 n_time]`` in the
    schema's order, by the steps of ``data.parsing.time`` (milliseconds from
    ``MILLISECONDS_FROM`` on, floor to whole seconds, floor division, a non-negative
    remainder; NaN missing), each part's id looked up in a table the run's encoder
    filled for every hour, weekday and the missing value. :meth:`days` gives the trend
    features' raw values (``--time-trend``: the timestamps in days).

    Args:
        run: the run folder (its schema, time columns and encoder).
    """

    hour_ids: Tensor
    weekday_ids: Tensor
    offsets: Tensor

    def __init__(self, run: RunFolder) -> None:
        super().__init__()
        self.columns = list(run.time_columns())
        self.count = len(self.columns)
        self.register_buffer("hour_ids", torch.from_numpy(time_part_ids(run, 24)))
        self.register_buffer("weekday_ids", torch.from_numpy(time_part_ids(run, 7)))
        # Row j's table starts at j * (values + 1) in the flattened buffers.
        self.register_buffer("offsets", torch.arange(self.count, dtype=torch.int64))

    @staticmethod
    def seconds(time: Tensor) -> Tensor:
        """Unix seconds (float64, NaN missing) of the timestamps as given."""
        t = time.double()
        return torch.where(t.abs() >= MILLISECONDS_FROM, t / 1000.0, t)

    def days(self, time: Tensor) -> Tensor:
        """The trend features' raw values: the timestamps in days (float64)."""
        return self.seconds(time) / DAY_S

    def forward(self, time: Tensor) -> Tensor:
        seconds = self.seconds(time)
        missing = torch.isnan(seconds)
        whole = torch.floor(torch.where(missing, torch.zeros_like(seconds), seconds))
        whole = whole.to(torch.int64)
        hour = torch.remainder(torch.div(whole, HOUR_S, rounding_mode="floor"), 24)
        day = torch.div(whole, DAY_S, rounding_mode="floor") + EPOCH_WEEKDAY
        weekday = torch.remainder(day, 7)
        hour = torch.where(missing, torch.full_like(hour, 24), hour)
        weekday = torch.where(missing, torch.full_like(weekday, 7), weekday)
        hours = self.hour_ids.flatten().index_select(0, (hour + 25 * self.offsets).flatten())
        weekdays = self.weekday_ids.flatten().index_select(
            0, (weekday + 8 * self.offsets).flatten()
        )
        parts = torch.stack([hours.reshape(-1, self.count), weekdays.reshape(-1, self.count)], 2)
        return parts.reshape(-1, 2 * self.count)


def time_part_ids(run: RunFolder, values: int) -> np.ndarray:
    """int64 ``[n_time, values + 1]``: per time column, the ids the run's encoder gives
    its hour (``values=24``) or weekday (``values=7``) parts ``0`` .. ``values - 1`` and,
    last, the missing one."""
    schema, time = run.schema, run.time_columns()
    first = len(run.row_categorical_columns())
    part = 0 if values == 24 else 1
    texts = np.array([str(v).encode() for v in range(values)] + [b""], dtype="S2")
    sparse = [np.full(values + 1, b"", dtype="S2") for _ in range(schema.n_sparse)]
    for j in range(len(time)):
        sparse[first + 2 * j + part] = texts
    ids = np.asarray(run.encoder().encode(sparse), dtype=np.int64)
    return np.ascontiguousarray(ids[:, first + part :: 2].T)


def time_ids(run: RunFolder, time: np.ndarray) -> np.ndarray:
    """The ids of the hour and weekday features of timestamps float64 ``[B, n_time]``
    as ``predict`` derives them (``data.parsing.time``, the run's encoder): the
    reference :class:`TimeFeatures` is checked against."""
    n, first = time.shape[1], len(run.row_categorical_columns())
    sparse: List[np.ndarray] = [np.full(len(time), b"", dtype="S2") for _ in range(first)]
    for j in range(n):
        sparse += parts_of_seconds(seconds_of_numbers(time[:, j]))[0]
    ids = np.asarray(run.encoder().encode(sparse), dtype=np.int64)
    return ids[:, first:]


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


class TimedServingModel(ServingModel):
    """``forward(dense, ids, time float64 [B, n_time]) -> probability [B]``: a
    :class:`ServingModel` of a run with time columns, which takes the timestamps and
    derives their features inside (:class:`TimeFeatures`); ``ids`` holds the other
    categorical columns and, with ``trend`` (raw dense inputs), ``dense`` the other
    dense columns: the trend features' raw values are appended to them."""

    def __init__(
        self,
        model: CTRModel,
        cardinalities: Sequence[int],
        dense: Optional[nn.Module],
        time: TimeFeatures,
        trend: bool,
    ) -> None:
        super().__init__(model, cardinalities, dense)
        self.time = time
        self.trend = trend

    def forward(self, dense: Tensor, ids: Tensor, time: Tensor) -> Tensor:  # type: ignore[override]
        if self.trend:
            dense = torch.cat([dense.double(), self.time.days(time)], dim=1)
        return super().forward(dense, torch.cat([ids, self.time(time)], dim=1))


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
    serving = (
        TimedServingModel(
            model,
            schema.cardinalities,
            dense,
            TimeFeatures(run),
            trend=raw_dense and bool(run.trend_columns()),
        )
        if run.time_columns()
        else ServingModel(model, schema.cardinalities, dense)
    ).eval()
    for parameter in serving.parameters():  # inference only: outputs that need no grad
        parameter.requires_grad_(False)
    return serving


def parity_timestamps(rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """float64 ``[rows, columns]`` timestamps where the derivation can slip: Unix seconds
    of the last 60 years and before 1970, whole and fractional, a second either side of
    midnight and of each hour, milliseconds (from 1e11 on, either side of it), NaN."""
    g = np.random.default_rng(seed)
    days = g.integers(-25_000, 25_000, size=(rows, columns)).astype(np.float64)
    edge = g.choice(
        [-1.0, -0.5, 0.0, 0.25, 1.0, 3599.0, 3600.0, 86399.0, 86399.75], (rows, columns)
    )
    seconds = days * DAY_S + np.where(
        g.random((rows, columns)) < 0.5, edge, g.random((rows, columns)) * DAY_S
    )
    ms = g.random((rows, columns)) < 0.25
    seconds[ms] = np.floor(seconds[ms] * 1000.0)
    near = g.random((rows, columns)) < 0.05
    seconds[near] = MILLISECONDS_FROM + g.integers(-2, 2, size=int(near.sum()))
    seconds[g.random((rows, columns)) < 0.05] = np.nan
    return seconds


def _parity_rows(run: RunFolder, rows: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Random raw rows: count-like dense values with a few missing and negative ones,
    ids over every categorical table's rows (some outside them), timestamps
    (:func:`parity_timestamps`) for the time columns (``[rows, 0]`` without)."""
    g = np.random.default_rng(seed)
    schema, n_time = run.schema, len(run.time_columns())
    n_dense = len(run.row_dense_columns())
    dense = np.floor(np.exp(g.normal(1.0, 2.0, size=(rows, n_dense))))
    dense[g.random(dense.shape) < 0.1] = np.nan
    dense[g.random(dense.shape) < 0.02] *= -1.0
    cards = np.asarray(schema.cardinalities[: len(run.row_categorical_columns())])
    ids = np.floor(g.random((rows, len(cards))) * (cards + 1)).astype(np.int64)
    time = parity_timestamps(rows, n_time, seed)
    return (
        torch.from_numpy(dense.astype(np.float32)),
        torch.from_numpy(ids),
        torch.from_numpy(time),
    )


def raw_dense_values(run: RunFolder, raw: Tensor, time: Optional[Tensor]) -> np.ndarray:
    """The raw dense values float64 ``[B, n_dense]`` of the dense columns ``raw`` and,
    for a run with ``--time-trend``, the trend features of the timestamps ``time``, as
    ``predict`` derives them (``data.parsing.time``)."""
    values = raw.double().numpy()
    if not run.trend_columns() or time is None:
        return values
    days = days_of_seconds(seconds_of_numbers(time.double().numpy()))
    return np.concatenate([values, days], axis=1)


def reference_scores(
    predictor: Predictor, raw: Tensor, ids: Tensor, time: Optional[Tensor] = None
) -> Tensor:
    """What ``predict`` gives for raw rows (its dense plan, encoder bounds, time-column
    derivation and model); ``time``: the time columns' timestamps (float64)."""
    run = predictor.run
    x = run.dense_plan().transform(raw_dense_values(run, raw, time))
    if time is not None and time.shape[1]:
        ids = torch.cat([ids, torch.from_numpy(time_ids(run, time.numpy()))], dim=1)
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


#: What the program's ``time`` input holds, in the contract and the docs.
TIME_INPUT = (
    "per time column the timestamp as a number, NaN for missing: Unix seconds (whole or "
    "fractional), or Unix milliseconds from 1e11 on (1973-03-03 in milliseconds), as the "
    "training files' numbers were read; a column the files held as date-time text "
    "(ISO 8601, UTC) or as a parquet timestamp is given as its Unix seconds (UTC; "
    "numpy: datetime64 values .astype('datetime64[ms]').astype('int64') / 1000). The "
    "program derives each column's hour of day and day of week (0 Monday) in UTC as "
    "training did and looks up their ids"
)


def time_contract(run: RunFolder) -> Dict[str, Any]:
    """The contract's ``time`` input of a run with time columns."""
    time, trend = list(run.time_columns()), bool(run.trend_columns())
    return {
        "name": "time",
        "dtype": "float64",
        "shape": ["batch", len(time)],
        "columns": time,
        "values": TIME_INPUT,
        "derives": {
            c: [f"{c}_hour", f"{c}_weekday", *([f"{c}_{TREND_SUFFIX}"] if trend else [])]
            for c in time
        },
        **(
            {
                "trend": "NAME_days = the timestamp in Unix seconds / 86400, a dense column "
                "after the others, scaled by the dense plan (min-max on the training split: "
                "0 at its start, 1 at its end; later rows lie past 1). With --dense-input "
                "transformed the caller computes it among the plan's outputs"
            }
            if trend
            else {}
        ),
    }


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
    schema, plan, time = run.schema, run.dense_plan(), run.time_columns()
    n_ids = len(run.row_categorical_columns())
    # The trend features (the last dense columns) are the program's to derive from time.
    columns = run.row_dense_columns()
    return {
        "format": CONTRACT_FORMAT,
        "version": 1,
        "program": program,
        "loader": "torch.export.load(path).module()" if fmt == "export" else "torch.jit.load(path)",
        "inputs": [
            {
                "name": "dense",
                "dtype": "float32",
                "shape": ["batch", len(columns) if raw_dense else len(plan.output_names)],
                "columns": list(columns if raw_dense else plan.output_names),
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
                "shape": ["batch", n_ids],
                "columns": list(schema.sparse_names[:n_ids]),
                "rows": list(schema.cardinalities[:n_ids]),
                "encoding": _encoding_contract(run),
                "vocabulary": vocabulary,
                "outside_rows": "read as id 0",
            },
            *([time_contract(run)] if time else []),
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
    raw, ids, time = _parity_rows(run, PARITY_ROWS)
    plan = run.dense_plan()
    dense = raw if raw_dense else torch.from_numpy(plan.transform(raw_dense_values(run, raw, time)))
    inputs = (dense, ids, time) if run.time_columns() else (dense, ids)
    with torch.no_grad():
        if fmt == "export":
            batch = torch.export.Dim("batch", min=1)
            shapes = {name: {0: batch} for name in ("dense", "ids", "time")[: len(inputs)]}
            program: Any = torch.export.export(module, inputs, dynamic_shapes=shapes)
            got = program.module()(*inputs)
        else:
            with warnings.catch_warnings():
                # The models' shape checks read the dense width, a constant of the program.
                warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
                program = torch.jit.trace(module, inputs)
            got = program(*inputs)
    expected = reference_scores(predictor, raw, ids, time)
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

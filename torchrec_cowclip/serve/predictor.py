"""Scoring with a trained model: ``torchrec_cowclip.load_model(run_dir).predict(data)``.

:func:`load_model` opens a run folder (``<out>/model``, verified against its manifest:
:mod:`~torchrec_cowclip.run.model_folder`), rebuilds the model with its weights on CPU
(or ``device``) and returns a :class:`Predictor`:

* :meth:`Predictor.predict`: one click probability per input row, in input order
  (numpy float32), for a file (a path or ``KIND:PATH``: the run's reader and encoders;
  the label column may be absent) or in-memory columns (a mapping, a pandas DataFrame,
  a pyarrow Table);
* :meth:`Predictor.evaluate`: AUC, log-loss, calibration (mean prediction / observed
  click rate) and row counts, computed by the trainer's own evaluation, so on the
  run's test file it gives the test AUC that training reported;
* :meth:`Predictor.scores`: the same stream in batches, for writing large outputs.

Rows are scored in batches of ``batch_size`` (default: the run's ``--eval-batch-size``)
cut from the input stream whatever its blocks, so the batches, and so the scores, are
the same for a file as for training's evaluation of the same rows.

Example::

    >>> import tempfile
    >>> import torchrec_cowclip
    >>> from torchrec_cowclip.train import TrainConfig, train
    >>> tmp = tempfile.mkdtemp()
    >>> _ = train(TrainConfig(data="criteo:tests/data/criteo_sample.tsv", hidden=(8,),
    ...                       batch_size=64, progress=False, out=f"{tmp}/run",
    ...                       cache_dir=f"{tmp}/cache"))
    >>> model = torchrec_cowclip.load_model(f"{tmp}/run")
    >>> scores = model.predict("tests/data/criteo_sample.tsv")
    >>> scores.shape, scores.dtype, bool(((scores > 0) & (scores < 1)).all())
    ((200,), dtype('float32'), True)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information

from torchrec_cowclip import notices
from torchrec_cowclip.data.errors import DataError
from torchrec_cowclip.data.pipeline.batches import make_batch
from torchrec_cowclip.models import build_model
from torchrec_cowclip.models.task import CTRTrainTask
from torchrec_cowclip.run.model_folder import RunFolder
from torchrec_cowclip.serve.inputs import EncodedBlock, Input, open_input
from torchrec_cowclip.train.evaluate import evaluate as evaluate_batches

DEFAULT_BATCH_SIZE = 65536
#: TorchRec inference table types :func:`quantized_model` offers.
QUANTIZED = ("int8", "fp16")


class Predictor:
    """A trained model with its encoders, ready to score (see :func:`load_model`).

    Attributes:
        run: the verified run folder.
        weights: which weights are loaded (``final`` or ``best``).
        model: the ``CTRModel`` (eval mode): ``model(dense, kjt) -> logits``.
        batch_size: rows per forward.
    """

    def __init__(
        self,
        run: RunFolder,
        weights: Optional[str] = None,
        device: Union[str, torch.device] = "cpu",
        batch_size: Optional[int] = None,
        quantize: Optional[str] = None,
    ) -> None:
        notices.install()  # torch's and TorchRec's notices a scoring run cannot act on
        self.run = run
        self.weights = run.reported if weights is None else weights
        self.device = torch.device(device)
        self.quantize = quantize
        self.model: torch.nn.Module = (
            run.build_model(self.weights, self.device)
            if quantize is None
            else quantized_model(run, self.weights, quantize, self.device)
        )
        self.batch_size = int(
            batch_size or run.model_info.get("eval_batch_size") or DEFAULT_BATCH_SIZE
        )
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        self.keys: List[str] = list(run.schema.sparse_names)
        #: Ids outside their table in the last pass (scored as row 0).
        self.out_of_range = 0
        #: Per categorical column, the values of the last pass its vocabulary lacks
        #: (scored with the out-of-vocabulary row); None where ids are hashed.
        self.unseen: Optional[Dict[str, int]] = None
        self.dense_names: List[str] = list(run.schema.dense_names)
        #: Per dense column, the values of the last pass outside the training range after
        #: the transform; None where the run folder records no range (an older run).
        self.outside: Optional[Dict[str, int]] = None
        #: Rows of the last pass.
        self.rows = 0

    def __repr__(self) -> str:
        return (
            f"Predictor({self.run.model_name}, {self.run.path}, weights={self.weights!r}, "
            f"{self.run.schema.n_dense} dense + {self.run.schema.n_sparse} categorical columns)"
        )

    def open(self, data: Any, *, labels: bool = False, **options: Any) -> Input:
        """The :class:`~torchrec_cowclip.serve.inputs.Input` of ``data``."""
        return open_input(self.run, data, labels=labels, **options)

    def _batches(
        self, blocks: Iterator[EncodedBlock]
    ) -> Iterator[Tuple[Batch, Optional[np.ndarray]]]:
        """Fixed-size batches (the last one shorter) cut from a stream of blocks."""
        pending: List[EncodedBlock] = []
        size = 0
        self.out_of_range, self.rows, self.unseen, self.outside = 0, 0, None, None

        def cut(n: int) -> Tuple[Batch, Optional[np.ndarray]]:
            nonlocal pending, size
            dense = torch.cat([b.dense for b in pending])
            ids = torch.cat([b.ids for b in pending])
            labels = torch.cat([b.labels for b in pending])
            keeps = [b.keep for b in pending]
            keep = None if keeps[0] is None else np.concatenate([k for k in keeps if k is not None])
            rest = EncodedBlock(dense[n:], ids[n:], labels[n:], None if keep is None else keep[n:])
            pending, size = ([rest] if len(rest) else []), len(rest)
            batch = make_batch(dense[:n].numpy(), ids[:n].numpy(), labels[:n].numpy(), self.keys)
            return batch, None if keep is None else keep[:n]

        for block in blocks:
            self.out_of_range += block.out_of_range
            self.rows += len(block)
            if block.unseen is not None:
                counts = self.unseen or dict.fromkeys(self.keys, 0)
                for name, n in zip(self.keys, block.unseen.tolist()):
                    counts[name] += int(n)
                self.unseen = counts
            if block.outside is not None:
                outside = self.outside or dict.fromkeys(self.dense_names, 0)
                for name, n in zip(self.dense_names, block.outside.tolist()):
                    outside[name] += int(n)
                self.outside = outside
            pending.append(block)
            size += len(block)
            while size >= self.batch_size:
                yield cut(self.batch_size)
        if size:
            yield cut(size)

    @torch.no_grad()
    def scores(
        self, data: Any, *, progress: bool = False, **options: Any
    ) -> Iterator[Tuple[np.ndarray, Optional[np.ndarray]]]:
        """``(probabilities float32 [n], passthrough values or None)`` batch by batch, in
        input order. ``options``: ``delimiter``, ``keep`` (see :func:`open_input`)."""
        source = data if isinstance(data, Input) else self.open(data, **options)
        bar = _progress_bar(f"scoring {source.name}", progress)
        try:
            for batch, keep in self._batches(source.blocks()):
                batch = batch.to(self.device)
                logits = self.model(batch.dense_features, batch.sparse_features)
                bar.update(len(logits))
                yield torch.sigmoid(logits).float().cpu().numpy(), keep
        finally:
            bar.close()

    def predict(self, data: Any, *, progress: bool = False, **options: Any) -> np.ndarray:
        """One click probability per row of ``data``, in order (float32).

        Args:
            data: a path or ``KIND:PATH[,PATH...]`` (the run's kind), a mapping of column
                name -> values, a pandas ``DataFrame`` or a pyarrow ``Table``: the
                schema's dense and categorical columns (a label column is not needed).
            progress: show a progress bar on stderr.
            **options: ``delimiter`` (the files' separator if not the run's).
        """
        parts = [p for p, _ in self.scores(data, progress=progress, **options)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    def evaluate(self, data: Any, *, progress: bool = False, **options: Any) -> Dict[str, Any]:
        """AUC, log-loss, calibration and row counts of the model on ``data`` (which
        needs its label column), as training evaluates its test set. The AUC is None
        (``auc_note`` says why) where the labels hold one class.

        Raises:
            DataError: no label column, a bad row, or no rows at all.
        """
        source = data if isinstance(data, Input) else self.open(data, labels=True, **options)
        bar = _progress_bar(f"evaluating {source.name}", progress)
        seen = 0

        def batches() -> Iterator[Batch]:
            nonlocal seen
            for batch, _ in self._batches(source.blocks()):
                seen += int(batch.labels.numel())
                bar.update(int(batch.labels.numel()))
                yield batch

        try:
            metrics = evaluate_batches(CTRTrainTask(self.model), batches(), self.device)
        except ValueError:
            if seen:
                raise
            raise DataError(
                f"{source.name}: no rows to evaluate (a header alone, or an empty file)"
            ) from None
        finally:
            bar.close()
        return {
            **metrics,
            "out_of_range_ids": self.out_of_range,
            "unseen_values": self.unseen,
            "outside_training_range": self.outside,
            "weights": self.weights,
            "tables": self.quantize or "as trained",
        }

    def outside_summary(self) -> Optional[str]:
        """One line naming the dense columns of the last pass with values outside the
        training range after the transform (None when there were none): a model
        extrapolates there (a standardized timestamp's next week). A trend feature
        (``--time-trend``) is outside for every row after the training split's end by
        construction: the line says so."""
        line = self._counted(
            self.outside,
            "dense values outside the training range (after the transform), scored as they are",
        )
        trend = [c for c in self.run.trend_columns() if (self.outside or {}).get(c)]
        if line is not None and trend:
            line += (
                f"; {', '.join(trend)} (--time-trend): time since the training split's start, "
                "outside it for every row after the split's end by construction: the model "
                "extrapolates its trend there"
            )
        return line

    def unseen_summary(self) -> Optional[str]:
        """One line naming the columns of the last pass with values the vocabulary lacks
        (None when there were none)."""
        return self._counted(
            self.unseen,
            "categorical values never seen in training, scored with the out-of-vocabulary row",
        )

    def _counted(self, counts: Optional[Dict[str, int]], what: str) -> Optional[str]:
        """``what``, of the last pass's rows, per column with a count (None if none has)."""
        seen = {k: n for k, n in (counts or {}).items() if n}
        if not seen:
            return None
        rows = max(self.rows, 1)
        shown = ", ".join(f"{k} {n:,} ({n / rows:.1%})" for k, n in seen.items())
        return f"{what}, of {self.rows:,} rows: {shown}"


def _progress_bar(desc: str, enabled: bool) -> tqdm:
    # Shown after a second only: a quick run (or a refusal) prints nothing but its result.
    return tqdm(desc=desc, unit=" rows", disable=not enabled, file=sys.stderr, delay=1.0)


def quantized_model(
    run: RunFolder, weights: Optional[str], quantize: str, device: Union[str, torch.device]
) -> torch.nn.Module:
    """The run's model on TorchRec's inference tables (``torchrec.inference``'s
    ``quantize_embeddings``: its quantized ``EmbeddingBagCollection``, FBGEMM's
    table-batched lookup): ``"int8"`` rowwise (a table whose row is too narrow for
    FBGEMM's int8 rows, an odd dim such as the first-order tables', in fp16) or ``"fp16"``.
    """
    from torchrec.inference.modules import quantize_embeddings

    if quantize not in QUANTIZED:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZED)}, got {quantize!r}")
    trained = run.build_model(weights, device)
    arguments = {
        **run.model_arguments(),
        "embedding_backend": "torchrec",
        "embedding_dtype": "fp32",
    }
    model = build_model(run.model_name, **arguments, device=device)
    model.load_state_dict(trained.state_dict())
    per_table = {
        t.name: torch.qint8 if quantize == "int8" and t.embedding_dim % 2 == 0 else torch.half
        for t in model.embedding_collection.embedding_bag_configs()
    }
    dtype = torch.qint8 if quantize == "int8" else torch.half
    quantized: torch.nn.Module = quantize_embeddings(
        model, dtype=dtype, inplace=True, per_table_weight_dtype=per_table
    )
    return quantized.eval()


def load_model(
    run_dir: Union[str, Path],
    *,
    weights: Optional[str] = None,
    device: Union[str, torch.device] = "cpu",
    batch_size: Optional[int] = None,
    quantize: Optional[str] = None,
    require_sha256: bool = False,
) -> Predictor:
    """The trained model of a run folder, ready to score.

    Args:
        run_dir: the run's ``--out`` (or its ``model/``), anywhere it has been moved.
        weights: ``"final"`` or ``"best"`` (default: those the run reported).
        device: where to score.
        batch_size: rows per forward (default: the run's ``--eval-batch-size``).
        quantize: score on TorchRec's quantized inference tables, ``"int8"`` or
            ``"fp16"`` (:func:`quantized_model`); default: the tables as trained.
        require_sha256: refuse a format-1 (CRC-32) run folder.

    Raises:
        RunFolderError: not a run folder, a newer format, or a file changed since it was
            written (named).
    """
    return Predictor(
        RunFolder.open(run_dir, require_sha256=require_sha256),
        weights=weights,
        device=device,
        batch_size=batch_size,
        quantize=quantize,
    )

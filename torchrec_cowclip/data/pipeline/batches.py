"""Mini-batches of a cached dataset as ``torchrec.datasets.utils.Batch``.

Each batch gathers its rows from the memory-mapped arrays with one numpy fancy index
per array and builds the ``KeyedJaggedTensor`` directly in TorchRec's "one id per
feature per sample" layout: keys = the sparse feature names, values feature-major
(all of feature 0's ids for the batch, then feature 1's, ...) as int64, lengths all
ones. Lengths, offsets and per-key sizes are shared by every full batch, so building
a batch costs two gathers, one transpose-and-widen copy and no synchronisation.

Shuffling is a permutation drawn from ``(seed, epoch)`` only: the same pair gives the
same batches on any machine, and ``start_batch=k`` resumes an interrupted epoch at
exactly its k-th batch. Within a batch, rows are read in increasing index order
(better locality for a cache larger than the page cache); the batch's *set* of rows
is what the permutation decides.

``prefetch=2`` overlaps the gathers (which release the GIL) with the consumer's work;
speeds are in docs/performance.md.

Example::

    >>> import numpy as np
    >>> from torchrec_cowclip.data.schema import Schema
    >>> arrays = ArrayDataset(np.zeros((5, 2), np.float32), np.arange(15).reshape(5, 3),
    ...                       np.ones(5, np.float32), Schema(("d0", "d1"), ("a", "b", "c"), (20, 20, 20)))
    >>> batch = next(iter(BatchIterator(arrays, batch_size=2)))
    >>> batch.sparse_features.keys(), batch.sparse_features.values().tolist()
    (['a', 'b', 'c'], [0, 3, 1, 4, 2, 5])
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.data.schema import Schema

_SHUFFLE_STREAM = 0x5EED


class ArraysLike(Protocol):
    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    schema: Schema


class DenseInputs(Protocol):
    """What turns stored dense values into the model's (a ``DensePlan``)."""

    def apply(self, stored: np.ndarray) -> np.ndarray: ...


@dataclass
class ArrayDataset:
    """In-memory arrays with a schema: the minimal thing :class:`BatchIterator` reads."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    schema: Schema

    def __len__(self) -> int:
        return len(self.labels)


class _Layout:
    """KJT lengths/offsets shared by every batch of one size."""

    def __init__(self, keys: Sequence[str], batch_size: int) -> None:
        n_keys = len(keys)
        n = n_keys * batch_size
        self.keys = list(keys)
        self.lengths = torch.ones(n, dtype=torch.int32)
        self.offsets = torch.arange(n + 1, dtype=torch.int32)
        self.length_per_key = [batch_size] * n_keys
        self.offset_per_key = [batch_size * i for i in range(n_keys + 1)]
        self.index_per_key: Dict[str, int] = {k: i for i, k in enumerate(self.keys)}
        self.stride = batch_size


def make_batch(
    dense: np.ndarray,
    sparse: np.ndarray,
    labels: np.ndarray,
    keys: Sequence[str],
    rows: Optional[np.ndarray] = None,
    *,
    dense_plan: Optional[DenseInputs] = None,
    _layout: Optional[_Layout] = None,
) -> Batch:
    """One ``Batch`` from rows ``rows`` (all rows if None) of the three arrays; the dense
    values go through ``dense_plan`` (a ``CTRDataset``'s stored values are not inputs yet)
    if given.

    Example::

        >>> import numpy as np
        >>> b = make_batch(np.zeros((3, 1), np.float32), np.array([[1, 2], [3, 4], [5, 6]]),
        ...                np.array([0, 1, 0], np.float32), ["x", "y"], rows=np.array([0, 2]))
        >>> b.sparse_features.values().tolist(), b.labels.tolist()
        ([1, 5, 2, 6], [0.0, 0.0])
    """
    if rows is None:
        rows = np.arange(len(labels))
    # Fancy indexing copies, so the tensors never alias the read-only memmaps.
    d, s, y = dense[rows], sparse[rows], labels[rows]
    if dense_plan is not None:
        d = dense_plan.apply(d)
    b = len(y)
    layout = _layout if _layout is not None and _layout.stride == b else _Layout(keys, b)
    values = np.ascontiguousarray(s.T, dtype=np.int64).reshape(-1)
    kjt = KeyedJaggedTensor(
        keys=layout.keys,
        values=torch.from_numpy(values),
        lengths=layout.lengths,
        offsets=layout.offsets,
        stride=b,
        length_per_key=layout.length_per_key,
        offset_per_key=layout.offset_per_key,
        index_per_key=layout.index_per_key,
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32).reshape(b)),
    )


def epoch_order(indices: np.ndarray, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The rows of one epoch in visiting order: ``indices`` permuted by ``(seed, epoch)``."""
    indices = np.asarray(indices, dtype=np.int64)
    if not shuffle:
        return indices
    rng = np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([seed, _SHUFFLE_STREAM, epoch]))
    )
    return indices[rng.permutation(len(indices))]


class BatchIterator:
    """Iterate over ``dataset[indices]`` in batches of ``batch_size``.

    Args:
        dataset: anything with ``dense``, ``sparse``, ``labels`` arrays and a ``schema``
            (a ``CTRDataset``, an :class:`ArrayDataset`); a ``dense_plan`` attribute, if
            it has one (a ``CTRDataset``), makes the model inputs of its dense values.
        indices: rows to visit (default: all), e.g. the train split.
        batch_size: rows per batch.
        shuffle: visit the rows in the order of a permutation drawn from ``(seed, epoch)``.
        seed, epoch: the permutation's seed.
        drop_last: skip the final short batch.
        start_batch: first batch to yield (resume mid-epoch); ``len()`` still counts
            the whole epoch.
        prefetch: batches prepared ahead in a background thread (0 = none).
        num_batches: instead of ``batch_size``, cut the rows into exactly this many
            batches whose sizes differ by at most one (each rank's share of a sharded
            evaluation: every rank must run as many batches).

    Example::

        >>> import numpy as np
        >>> from torchrec_cowclip.data.schema import Schema
        >>> ds = ArrayDataset(np.zeros((10, 1), np.float32), np.arange(10).reshape(10, 1),
        ...                   np.zeros(10, np.float32), Schema(("d",), ("s",), (10,)))
        >>> it = BatchIterator(ds, batch_size=4, shuffle=True, seed=3, epoch=1)
        >>> len(it), [b.labels.shape[0] for b in it]
        (3, [4, 4, 2])
        >>> resumed = BatchIterator(ds, batch_size=4, shuffle=True, seed=3, epoch=1, start_batch=1)
        >>> [b.sparse_features.values().tolist() for b in resumed] == [
        ...     b.sparse_features.values().tolist() for b in list(it)[1:]]
        True
    """

    def __init__(
        self,
        dataset: ArraysLike,
        indices: Optional[np.ndarray] = None,
        batch_size: int = 1024,
        *,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = False,
        start_batch: int = 0,
        prefetch: int = 0,
        num_batches: Optional[int] = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if start_batch < 0:
            raise ValueError(f"start_batch must be >= 0, got {start_batch}")
        self.dataset = dataset
        n = len(dataset.labels)
        self.indices = (
            np.arange(n, dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
        )
        if len(self.indices) and (self.indices.min() < 0 or self.indices.max() >= n):
            raise IndexError(f"indices out of range for a dataset of {n} rows")
        if num_batches is not None and not 1 <= num_batches <= max(len(self.indices), 1):
            raise ValueError(
                f"num_batches must be in [1, {len(self.indices)}] for {len(self.indices)} "
                f"rows, got {num_batches}"
            )
        self.num_batches = num_batches
        if num_batches is not None:
            batch_size = max(-(-len(self.indices) // num_batches), 1)
        self.batch_size = int(batch_size)
        self.shuffle, self.seed, self.epoch = shuffle, int(seed), int(epoch)
        self.drop_last, self.start_batch, self.prefetch = drop_last, int(start_batch), int(prefetch)
        self.keys: List[str] = list(dataset.schema.sparse_names)
        self._layout = _Layout(self.keys, self.batch_size)

    def __len__(self) -> int:
        n = len(self.indices)
        if self.num_batches is not None:
            return self.num_batches
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batch_rows(self, order: np.ndarray, k: int) -> np.ndarray:
        """Row indices of batch ``k`` given the epoch's order, sorted for locality."""
        if self.num_batches is not None:
            n, parts = len(order), self.num_batches
            return np.sort(order[k * n // parts : (k + 1) * n // parts])
        return np.sort(order[k * self.batch_size : (k + 1) * self.batch_size])

    def _batch(self, order: np.ndarray, k: int) -> Batch:
        ds = self.dataset
        return make_batch(
            ds.dense,
            ds.sparse,
            ds.labels,
            self.keys,
            self.batch_rows(order, k),
            dense_plan=getattr(ds, "dense_plan", None),
            _layout=self._layout,
        )

    def __iter__(self) -> Iterator[Batch]:
        order = epoch_order(self.indices, self.shuffle, self.seed, self.epoch)
        todo = range(self.start_batch, len(self))
        if self.prefetch <= 0:
            for k in todo:
                yield self._batch(order, k)
            return
        yield from _prefetched(((lambda k=k: self._batch(order, k)) for k in todo), self.prefetch)


#: The name of the thread that builds batches ahead of the consumer.
PREFETCH_THREAD = "torchrec-cowclip-prefetch"


def _prefetched(makers: Iterator[Any], depth: int) -> Iterator[Batch]:
    """Run ``makers`` (batch factories) in a thread, ``depth`` ahead, in order."""
    q: "queue.Queue[Tuple[str, Any]]" = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Tuple[str, Any]) -> bool:
        # Poll so an abandoned iterator (consumer broke out of its loop) frees the thread.
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for make in makers:
                if not put(("batch", make())):
                    return
            put(("end", None))
        except BaseException as e:  # re-raised in the consumer's thread
            put(("error", e))

    t = threading.Thread(target=work, name=PREFETCH_THREAD, daemon=True)
    t.start()
    try:
        while True:
            tag, item = q.get()
            if tag == "end":
                return
            if tag == "error":
                raise item
            yield item
    finally:
        stop.set()
        t.join(timeout=5)

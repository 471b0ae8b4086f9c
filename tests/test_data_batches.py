"""Batches (KJT layout, determinism, resume) and train/val/test splits."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_cowclip.data import (
    ArrayDataset,
    BatchIterator,
    Schema,
    make_batch,
    open_dataset,
    split_indices,
)
from torchrec_cowclip.data.pipeline.batches import PREFETCH_THREAD

DATA = Path(__file__).resolve().parent / "data"


def _toy(n: int = 103, n_dense: int = 3, n_sparse: int = 4) -> ArrayDataset:
    rng = np.random.default_rng(0)
    sparse = rng.integers(0, 50, (n, n_sparse)).astype(np.int32)
    sparse[:, 0] = np.arange(n)  # feature 0 = row id, to track rows through batches
    return ArrayDataset(
        dense=rng.random((n, n_dense), dtype=np.float32),
        sparse=sparse,
        labels=(rng.random(n) < 0.3).astype(np.float32),
        schema=Schema(
            tuple(f"d{i}" for i in range(n_dense)),
            tuple(f"s{i}" for i in range(n_sparse)),
            (max(n, 50),) * n_sparse,
        ),
    )


def _rows(batch: Batch) -> list:
    return batch.sparse_features["s0"].values().tolist()


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and a.sparse_features.keys() == b.sparse_features.keys()
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


def test_kjt_layout_matches_hand_built() -> None:
    ds = _toy()
    rows = np.array([5, 7, 11, 40])
    batch = make_batch(ds.dense, ds.sparse, ds.labels, list(ds.schema.sparse_names), rows)
    keys = list(ds.schema.sparse_names)
    values = [int(ds.sparse[r, f]) for f in range(len(keys)) for r in rows]  # feature-major
    hand = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.ones(len(values), dtype=torch.int32),
    )
    kjt = batch.sparse_features
    assert kjt.keys() == hand.keys()
    assert kjt.values().dtype == torch.int64
    assert torch.equal(kjt.values(), hand.values())
    assert torch.equal(kjt.lengths(), hand.lengths())
    assert torch.equal(kjt.offsets(), hand.offsets())
    assert kjt.stride() == len(rows) == hand.stride()
    assert kjt.length_per_key() == hand.length_per_key()
    for k in keys:
        assert torch.equal(kjt[k].values(), hand[k].values())
    assert batch.dense_features.dtype == torch.float32 and batch.dense_features.shape == (4, 3)
    assert torch.equal(batch.dense_features, torch.from_numpy(ds.dense[rows]))
    assert batch.labels.dtype == torch.float32 and batch.labels.shape == (4,)
    assert torch.equal(batch.labels, torch.from_numpy(ds.labels[rows]))


def test_epoch_covers_indices_once_and_sizes() -> None:
    ds = _toy()
    idx = np.arange(3, 100)
    it = BatchIterator(ds, idx, batch_size=10, shuffle=True, seed=1, epoch=0)
    batches = list(it)
    assert len(it) == len(batches) == 10
    assert [b.labels.shape[0] for b in batches] == [10] * 9 + [7]
    seen = sorted(r for b in batches for r in _rows(b))
    assert seen == idx.tolist()
    # all four KJT keys have one id per sample, also in the short last batch
    last = batches[-1].sparse_features
    assert last.stride() == 7 and last.lengths().tolist() == [1] * 28
    dropped = BatchIterator(ds, idx, batch_size=10, drop_last=True)
    assert len(dropped) == 9 and len(list(dropped)) == 9


def test_shuffle_is_deterministic_per_seed_and_epoch() -> None:
    ds = _toy()

    def order(seed: int, epoch: int) -> list:
        return [
            _rows(b) for b in BatchIterator(ds, batch_size=16, shuffle=True, seed=seed, epoch=epoch)
        ]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    a = list(BatchIterator(ds, batch_size=16, shuffle=True, seed=4, epoch=2))
    b = list(BatchIterator(ds, batch_size=16, shuffle=True, seed=4, epoch=2, prefetch=2))
    assert all(_same(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    plain = [_rows(b) for b in BatchIterator(ds, batch_size=16)]
    assert sum(plain, []) == list(range(103))


@pytest.mark.parametrize("start", [0, 1, 3, 6, 7])
def test_start_batch_resumes_exactly(start: int) -> None:
    ds = _toy()
    full = list(BatchIterator(ds, batch_size=15, shuffle=True, seed=9, epoch=5))
    resumed = list(
        BatchIterator(ds, batch_size=15, shuffle=True, seed=9, epoch=5, start_batch=start)
    )
    assert len(resumed) == len(full) - start
    assert all(_same(x, y) for x, y in zip(full[start:], resumed))


def _prefetch_threads() -> set:
    return {t for t in threading.enumerate() if t.name == PREFETCH_THREAD and t.is_alive()}


def test_prefetch_stops_when_abandoned() -> None:
    """Closing an iterator whose prefetch thread is blocked on a full queue returns within
    the bound and the thread ends (it neither hangs the consumer nor lingers)."""
    ds = _toy()
    before = _prefetch_threads()
    it = iter(BatchIterator(ds, batch_size=5, prefetch=1))
    assert next(it).labels.shape[0] == 5
    (worker,) = _prefetch_threads() - before  # filling the one-slot queue, then waiting on it
    closer = threading.Thread(target=it.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive(), "close() of an abandoned prefetching iterator hung"
    worker.join(timeout=10)
    assert not worker.is_alive(), "the prefetch thread outlived its iterator"


def test_batches_from_cached_criteo(tmp_path: Path) -> None:
    ds = open_dataset(f"criteo:{DATA / 'criteo_sample.tsv'}", tmp_path)
    train, val, test = ds.split(test_fraction=0.1, val_fraction=0.1, seed=0)
    batches = list(ds.batches(train, batch_size=64, shuffle=True, seed=0, epoch=0))
    assert sum(b.labels.shape[0] for b in batches) == len(train) == 162
    b = batches[0]
    assert b.sparse_features.keys() == [f"C{i}" for i in range(1, 27)]
    assert b.dense_features.shape == (64, 13)
    assert b.sparse_features.values().shape == (64 * 26,)


def test_split_indices() -> None:
    train, val, test = split_indices(1000, test_fraction=0.1, val_fraction=0.2, seed=3)
    assert len(test) == 100 and len(val) == 180 and len(train) == 720
    allidx = np.concatenate([train, val, test])
    assert sorted(allidx.tolist()) == list(range(1000))
    for a in (train, val, test):
        assert a.dtype == np.int64 and (np.diff(a) > 0).all()
    again = split_indices(1000, test_fraction=0.1, val_fraction=0.2, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip((train, val, test), again))
    other = split_indices(1000, test_fraction=0.1, val_fraction=0.2, seed=4)
    assert not np.array_equal(test, other[2])
    # the test set does not depend on val_fraction
    assert np.array_equal(split_indices(1000, 0.1, 0.0, seed=3)[2], test)
    tr, va, te = split_indices(50, val_fraction=0.1, test_start=40)
    assert te.tolist() == list(range(40, 50)) and len(va) == 4 and len(tr) == 36
    with pytest.raises(ValueError):
        split_indices(10, test_fraction=1.0)


def test_batch_feeds_a_torchrec_embedding_bag_collection(tmp_path: Path) -> None:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    ds = open_dataset(f"criteo:{DATA / 'criteo_sample.tsv'}", tmp_path)
    tables = [
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=4, num_embeddings=c, feature_names=[n])
        for n, c in zip(ds.schema.sparse_names, ds.schema.cardinalities)
    ]
    ebc = EmbeddingBagCollection(tables=tables)
    batch = next(iter(ds.batches(batch_size=32, shuffle=True)))
    pooled = ebc(batch.sparse_features)
    assert pooled.values().shape == (32, 26 * 4)
    # one id per feature and sample: the pooled vector is that id's embedding row
    row0 = int(batch.sparse_features["C3"].values()[0])
    torch.testing.assert_close(pooled["C3"][0], ebc.embedding_bags["t_C3"].weight[row0])

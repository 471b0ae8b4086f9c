"""The lookup layout shared by the collection and the sharded kernel
(:mod:`torchrec_cowclip.embedding.layout`): slices, row mapping, id checks, column order."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagConfig

from torchrec_cowclip.embedding import layout
from torchrec_cowclip.embedding.row_kernels import TorchKernel
from torchrec_cowclip.embedding.table_batch import TableBatch


def _batch(dim, tables):
    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=rows, feature_names=fs)
        for n, rows, fs in tables
    ]
    return TableBatch(
        configs,
        [c.feature_names for c in configs],
        "sgd",
        [True] * len(configs),
        torch.device("cpu"),
        TorchKernel(compiled=False),
    )


# Config (TorchRec) order t0 (dim 4), t1 (dim 2), t2 (dim 4): batches [t0, t2] and [t1].
WIDE = _batch(4, [("t0", 5, ["a"]), ("t2", 3, ["c"])])
NARROW = _batch(2, [("t1", 7, ["b"])])


def test_each_batch_gets_its_slice_with_ids_mapped_to_its_rows():
    b = 2  # KJT in batch order a, c | b; bags a: [1], [0, 4]; c: [2], []; b: [6], [3]
    values = torch.tensor([1, 0, 4, 2, 6, 3])
    offsets = torch.tensor([0, 1, 3, 4, 4, 5, 6])
    starts = layout.feature_starts([WIDE, NARROW])
    bounds = layout.value_bounds(offsets, starts, b, values.numel())
    assert starts == [0, 2, 3] and bounds == [0, 4, 6]
    weights = torch.arange(6, dtype=torch.float64)
    wide, narrow = layout.prepare_lookups(
        [WIDE, NARROW], values, offsets, b, starts, bounds, weights
    )
    assert wide.row_ids.tolist() == [1, 0, 4, 5 + 2]  # t2's rows follow t0's 5
    assert wide.bag_offsets.tolist() == [0, 1, 3, 4, 4]
    assert narrow.row_ids.tolist() == [6, 3] and narrow.bag_offsets.tolist() == [0, 1, 2]
    assert narrow.weights.dtype == torch.float32 and narrow.weights.tolist() == [4.0, 5.0]
    assert narrow.single_hot and not wide.single_hot


def test_an_id_out_of_range_names_feature_table_id_and_sample():
    values, offsets = torch.tensor([1, 0, 3, 2]), torch.tensor([0, 1, 3, 4, 4])
    with pytest.raises(
        IndexError,
        match=r"feature 'c' \(table 't2', num_embeddings=3\) has id 3 "
        r"in sample 0; ids must be in \[0, 3\)",
    ):
        layout.prepare_lookup(WIDE, torch.tensor([1, 0, 4, 3]), offsets, None, 2)
    assert layout.prepare_lookup(WIDE, values, offsets, None, 2).row_ids.tolist() == [1, 0, 3, 7]


def test_outputs_come_back_in_table_order():
    columns = layout.output_permutation([WIDE, NARROW], ["a", "b", "c"])
    assert columns == [0, 1, 2, 3, 8, 9, 4, 5, 6, 7]
    assert layout.output_permutation([WIDE, NARROW], ["a", "c", "b"]) is None
    outs = [torch.arange(8.0).view(1, 8), torch.tensor([[8.0, 9.0]])]
    pooled = layout.pooled_in_order(outs, layout.as_index(columns, torch.device("cpu")))
    assert pooled.tolist() == [[0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 4.0, 5.0, 6.0, 7.0]]
    assert layout.pooled_in_order(outs, None).tolist() == [list(map(float, range(10)))]

"""Meta-device construction and initialisation that does not depend on the world size.

A ``CowClipEmbeddingBagCollection(device="meta")`` allocates nothing; sharded by
``DistributedModelParallel`` with the CowClip sharder, each rank allocates exactly its own
shards and their optimizer state, filled with exactly the rows the unsharded module starts
from, whatever the plan and the number of processes (TorchRec's own sharded init calls the
table's ``init_fn`` on each local shard, so its start depends on both).
"""

from __future__ import annotations

from dataclasses import replace

import distributed_cases as cases
import pytest
import torch
from distributed_harness import load_result, run_ranks

from torchrec_cowclip import CowClipEmbeddingBagCollection
from torchrec_cowclip.optim.options import CowClipOptions


def _unsharded_start(optimizer: str) -> dict:
    ebc = CowClipEmbeddingBagCollection(
        [replace(t) for t in cases.init_tables()],
        init_seed=17,
        options=CowClipOptions(optimizer=optimizer),
    )
    return {k: v.detach().clone() for k, v in ebc.state_dict().items()}


@pytest.mark.parametrize("world,optimizer", [(1, "adam"), (2, "adam"), (3, "rowwise_adagrad")])
def test_every_world_size_and_sharding_type_starts_from_the_unsharded_weights(
    tmp_path, world, optimizer
):
    out = str(tmp_path / "init.pt")
    run_ranks(cases.init_invariance_case, world, optimizer, out, timeout_s=150)
    result = load_result(out)
    assert result["meta_only"]
    expected = _unsharded_start(optimizer)
    assert set(result["weights"]) == set(expected)
    for key, weight in expected.items():
        # Bit-identical: the same generator draws for the same global rows and columns.
        assert torch.equal(result["weights"][key], weight), key
    whole = CowClipEmbeddingBagCollection(
        [replace(t) for t in cases.init_tables()], options=CowClipOptions(optimizer=optimizer)
    ).table_storage_bytes()
    for rank, (held, shards) in enumerate(result["storage"]):
        assert held == shards > 0, (
            f"rank {rank} holds {held} bytes of tables and state, its shards need {shards}"
        )
        if world > 1:
            assert held < 0.75 * whole, (
                f"rank {rank} holds {held} of the whole model's {whole} bytes"
            )


def test_meta_collection_allocates_nothing_and_materialises_like_a_cpu_one():
    tables = cases.init_tables()
    # 2**40 rows x 64: 256 TiB of weights if anything were allocated.
    huge = [replace(tables[0], name="huge", num_embeddings=1 << 40, embedding_dim=64)]
    meta = CowClipEmbeddingBagCollection(huge, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert all(t.is_meta for b in meta._batches for t in (b.weight, *b.state.values()))

    lazy = CowClipEmbeddingBagCollection([replace(t) for t in tables], device="meta", init_seed=17)
    with pytest.raises(RuntimeError, match="meta device"):
        lazy(None)  # type: ignore[arg-type]
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    eager = _unsharded_start("adam")
    for key, value in lazy.state_dict().items():
        assert torch.equal(value, eager[key]), key
    for batch in lazy._batches:
        assert (
            batch.weight.data_ptr() == lazy.embedding_bags[batch.table_names[0]].weight.data_ptr()
        )
        assert all(float(t.abs().sum()) == 0.0 for t in batch.state.values())
        assert batch.row_offsets.tolist() == batch.row_offsets_list


def test_initial_weights_depend_on_the_seed_and_table_not_the_global_rng():
    tables = cases.init_tables()
    torch.manual_seed(1)
    a = CowClipEmbeddingBagCollection([replace(t) for t in tables], init_seed=3).state_dict()
    torch.manual_seed(2)
    b = CowClipEmbeddingBagCollection([replace(t) for t in tables], init_seed=3).state_dict()
    c = CowClipEmbeddingBagCollection([replace(t) for t in tables], init_seed=4).state_dict()
    for key in a:
        assert torch.equal(a[key], b[key])
        assert not torch.equal(a[key], c[key])
    cw = a["embedding_bags.cw.weight"]
    assert abs(float(cw.std()) - 0.05) < 0.002 and abs(float(cw.mean())) < 0.002
    tw, bound = a["embedding_bags.tw.weight"], (1 / 5000) ** 0.5  # TorchRec's default bounds
    assert float(tw.min()) >= -bound and float(tw.max()) < bound and float(tw.std()) > 0.5 * bound

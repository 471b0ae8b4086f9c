"""Use the CowClip EmbeddingBagCollection inside your own TorchRec model.

Swap ``torchrec.EmbeddingBagCollection`` for ``CowClipEmbeddingBagCollection`` (or
convert an existing one with ``from_ebc``); keep everything else. The tables are updated
inside ``loss.backward()``; give the dense optimizer only the other parameters
(TorchRec's ``in_backward_optimizer_filter`` does that), and checkpoint both optimizers
with TorchRec's ``CombinedOptimizer``.

    .venv/bin/python examples/cowclip_in_your_model.py
"""

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection, CowClipOptions


def main() -> None:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=16, num_embeddings=10_000, feature_names=[f"f{i}"]
        )
        for i in range(4)
    ]
    stock = EmbeddingBagCollection(tables=tables)
    # Same tables, same weights, now trained by CowClip + Adam inside backward.
    options = CowClipOptions(
        optimizer="adam", lr=1e-3, weight_decay=2e-5, cowclip=CowClip(r=1.0, zeta=4e-5)
    )
    ebc = CowClipEmbeddingBagCollection.from_ebc(stock, options=options)
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=8,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[32, 1],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=1e-3),
    )
    optimizer = CombinedOptimizer([("dense", dense), ("sparse", ebc.fused_optimizer)])

    for _ in range(20):
        batch = 512
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(4)],
            values=torch.randint(0, 10_000, (4 * batch,)),
            lengths=torch.ones(4 * batch, dtype=torch.int64),
        )
        dense_x = torch.randn(batch, 8)
        labels = (dense_x[:, 0] > 0).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense_x, kjt).squeeze(1), labels
        )
        optimizer.zero_grad()
        loss.backward()  # embeddings updated here
        optimizer.step()  # dense Adam (the fused part is a no-op)
    stats = ebc.clip_stats()
    print(
        f"loss {loss.item():.4f}; rows clipped so far: "
        f"{sum(s.total_rows_clipped for s in stats.values())} of "
        f"{sum(s.total_rows_updated for s in stats.values())}"
    )
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "/tmp/ckpt.pt")


if __name__ == "__main__":
    main()

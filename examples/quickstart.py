"""Quickstart: a CowClip EmbeddingBagCollection plus a small MLP on generated KJT data.

The embeddings are trained by the fused CowClip+Adam update inside ``loss.backward()``;
the MLP by an ordinary ``torch.optim.Adam``. 100 steps on generated data, a few seconds::

    .venv/bin/python examples/quickstart.py
"""

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.mlp import MLP

from torchrec_cowclip import CowClip, CowClipEmbeddingBagCollection, CowClipOptions

NUM_FEATURES, ROWS, DIM, BATCH = 8, 5_000, 16, 2048


def make_batch(gen: torch.Generator, planted: torch.Tensor):
    """Single-hot power-law ids per feature; the label depends on a planted score per id."""
    u = torch.rand(NUM_FEATURES, BATCH, generator=gen)
    ids = (ROWS * u**3).long().clamp_(max=ROWS - 1)  # skewed: small ids are frequent
    score = planted.gather(1, ids).sum(0)
    labels = (torch.rand(BATCH, generator=gen) < torch.sigmoid(score)).float()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(NUM_FEATURES)],
        values=ids.reshape(-1),
        lengths=torch.ones(NUM_FEATURES * BATCH, dtype=torch.int64),
    )
    return kjt, labels


def main() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    planted = torch.randn(NUM_FEATURES, ROWS, generator=gen)
    ebc = CowClipEmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"]
            )
            for i in range(NUM_FEATURES)
        ],
        options=CowClipOptions(
            optimizer="adam", lr=1e-2, weight_decay=1e-5, cowclip=CowClip(r=1.0, zeta=1e-4)
        ),
    )
    mlp = torch.nn.Sequential(MLP(NUM_FEATURES * DIM, [64, 32]), torch.nn.Linear(32, 1))
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=3e-3)
    for step in range(1, 101):
        kjt, labels = make_batch(gen, planted)
        logits = mlp(ebc(kjt).values()).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        dense_opt.zero_grad()
        loss.backward()  # the embedding tables are updated here
        dense_opt.step()
        if step % 25 == 0 or step == 1:
            stats = ebc.clip_stats()
            updated = sum(s.total_rows_updated for s in stats.values())
            clipped = sum(s.total_rows_clipped for s in stats.values())
            print(
                f"step {step:4d}  loss {loss.item():.4f}  rows updated {updated:8d}  "
                f"clipped {clipped:7d} ({clipped / max(updated, 1):.1%})"
            )


if __name__ == "__main__":
    main()

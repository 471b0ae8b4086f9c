"""Shared helpers for the tests: KJT builders and the dense autograd reference run."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from torchrec_cowclip.optim.options import CowClip
from torchrec_cowclip.optim.reference import (
    init_reference_state,
    occurrence_counts,
    reference_cowclip_step_,
)


def kjt_from_bags(
    bags: Dict[str, List[List[int]]],
    weights: Optional[Dict[str, List[List[float]]]] = None,
) -> KeyedJaggedTensor:
    """A KJT from per-feature lists of bags, keys in the dict's order."""
    keys = list(bags)
    values = [i for k in keys for bag in bags[k] for i in bag]
    lengths = [len(bag) for k in keys for bag in bags[k]]
    w = None
    if weights is not None:
        w = torch.tensor([x for k in keys for bag in weights[k] for x in bag], dtype=torch.float32)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        weights=w,
    )


def random_kjt(
    tables: Sequence[EmbeddingBagConfig],
    batch_size: int,
    generator: torch.Generator,
    max_len: int = 4,
    weighted: bool = False,
    key_order: Optional[List[str]] = None,
    min_len: int = 0,
) -> KeyedJaggedTensor:
    """Multi-hot bags (empty ones and duplicate ids included) for every feature;
    ``min_len=max_len=1`` gives single-hot features."""
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    keys = key_order or list(rows)
    bags: Dict[str, List[List[int]]] = {}
    bag_weights: Dict[str, List[List[float]]] = {}
    for k in keys:
        lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=generator).tolist()
        # Small id range per feature so duplicates inside a bag and across bags occur.
        hi = min(rows[k], 3 * max_len + 3)
        bags[k] = [torch.randint(0, hi, (n,), generator=generator).tolist() for n in lengths]
        bag_weights[k] = [(torch.rand(n, generator=generator) * 2).tolist() for n in lengths]
    return kjt_from_bags(bags, bag_weights if weighted else None)


def mixed_scale_weights(num_rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Rows whose norms span 1e-4..1, so the clip binds on some rows and not others."""
    scale = torch.logspace(-4, 0, num_rows)[torch.randperm(num_rows, generator=generator)]
    return torch.randn(num_rows, dim, generator=generator) * scale[:, None]


class DenseReference:
    """Plain autograd on a ``torchrec.EmbeddingBagCollection`` + the reference step
    (docs/algorithm.md), in float64 on CPU: the reference of the fused collection on every
    device."""

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        weights: Dict[str, torch.Tensor],
        optimizer: str,
        is_weighted: bool = False,
        unclipped_tables: Sequence[str] = (),
        **hyper,
    ) -> None:
        self.tables = [replace(t) for t in tables]
        self.ebc = EmbeddingBagCollection(tables=self.tables, is_weighted=is_weighted).double()
        with torch.no_grad():
            for name, w in weights.items():
                self.ebc.embedding_bags[name].weight.copy_(w)
        self.optimizer = optimizer
        self.unclipped = set(unclipped_tables)
        self.hyper = hyper
        self.state = {
            t.name: init_reference_state(optimizer, self.ebc.embedding_bags[t.name].weight)
            for t in self.tables
        }
        self.clipped_rows: Dict[str, torch.Tensor] = {}

    def output(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """The pooled embeddings of ``kjt`` (a CPU KJT), float64."""
        return self.ebc(_float64_weights(kjt)).values()

    def step(self, kjt: KeyedJaggedTensor, upstream: torch.Tensor) -> None:
        self.ebc.zero_grad(set_to_none=True)
        (self.output(kjt) * upstream.to("cpu", torch.float64)).sum().backward()
        features = kjt.to_dict()
        with torch.no_grad():
            for t in self.tables:
                param = self.ebc.embedding_bags[t.name].weight
                ids = torch.cat([features[f].values() for f in t.feature_names])
                counts = occurrence_counts(ids, t.num_embeddings)
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                self.clipped_rows[t.name] = reference_cowclip_step_(
                    param.data,
                    grad,
                    counts,
                    self.state[t.name],
                    optimizer=self.optimizer,
                    clip_table=t.name not in self.unclipped,
                    **self.hyper,
                )

    def weight(self, name: str) -> torch.Tensor:
        return self.ebc.embedding_bags[name].weight.detach()


def _float64_weights(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    weights = kjt.weights_or_none()
    if weights is None:
        return kjt
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        weights=weights.double(),
        lengths=kjt.lengths(),
        offsets=kjt.offsets(),
    )


def assert_close_to_reference(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6, msg=None
) -> None:
    """float32 on any device against the float64 CPU reference."""
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, check_dtype=False, check_device=False, msg=msg
    )


def to_device(kjt: KeyedJaggedTensor, device: torch.device) -> KeyedJaggedTensor:
    """``kjt`` on ``device``, its offsets computed on CPU first: computed later on CUDA
    they would need fbgemm_gpu's CUDA ``asynchronous_complete_cumsum`` (batches from
    ``BatchIterator`` carry their offsets too)."""
    kjt.offsets()
    return kjt.to(device)


def keys_can_be_reordered(device: torch.device) -> bool:
    """Whether ``KeyedJaggedTensor.permute`` runs on ``device``: the collection calls it
    for a KJT whose keys are not in its tables' order, and it is fbgemm_gpu's
    ``permute_2D_sparse_data``, which a CPU-only fbgemm_gpu build lacks for CUDA."""
    try:
        to_device(kjt_from_bags({"a": [[1]], "b": [[2, 3]]}), device).permute([1, 0]).values()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def default_cowclip() -> CowClip:
    return CowClip(r=1.0, zeta=1e-3)


def curved_loss(pooled: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient in the embeddings changes with them (a loss linear in the
    pooled embeddings would make Helen's second pass equal its first)."""
    logits = head(pooled).squeeze(1) + 0.5 * pooled.square().sum(dim=1)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


class HelenDenseReference(DenseReference):
    """Helen's step re-derived on dense autograd, float64: pass 1 at ``W``, per table
    ``e_j = rho * max(n_j / max n, bound) * g_j / (||dL/dW||_F + 1e-12)`` on the rows the
    batch touches, pass 2 at ``W + e``, restore ``W``, then the reference step with the
    second gradient; the head (dense) keeps the first gradient, or with ``perturb_dense``
    is perturbed by ``rho * g / ||g||`` and takes the second."""

    def __init__(self, *args, helen, head: torch.nn.Linear, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.helen = helen
        self.head = copy.deepcopy(head).double()

    def pooled64(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """``[B, sum of dims]`` pooled embeddings in float64 throughout (TorchRec's EBC casts
        its output to float32), one ``embedding_bag`` per feature, in the tables' order."""
        features = kjt.to_dict()
        pooled = []
        for t in self.tables:
            weight = self.ebc.embedding_bags[t.name].weight
            mode = "mean" if t.pooling == PoolingType.MEAN else "sum"
            for f in t.feature_names:
                jt = features[f]
                offsets = torch.cat([torch.zeros(1, dtype=torch.int64), jt.lengths().cumsum(0)])
                pooled.append(
                    torch.nn.functional.embedding_bag(
                        jt.values(), weight, offsets, mode=mode, include_last_offset=True
                    )
                )
        return torch.cat(pooled, dim=1)

    def helen_step(self, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        tables = [self.ebc.embedding_bags[t.name].weight for t in self.tables]
        dense = list(self.head.parameters())
        labels = labels.double()

        def loss() -> torch.Tensor:
            return curved_loss(self.pooled64(kjt), self.head, labels)

        first = loss()
        first_grads = torch.autograd.grad(first, tables + dense)
        features = kjt.to_dict()
        counts = [
            occurrence_counts(
                torch.cat([features[f].values() for f in t.feature_names]), t.num_embeddings
            )
            for t in self.tables
        ]
        rho, bound = self.helen.rho, self.helen.bound
        originals = [w.detach().clone() for w in tables + dense]
        with torch.no_grad():
            for w, g, n in zip(tables, first_grads, counts):
                share = (n.double() / n.max().double()).clamp(min=bound) * (n > 0)
                w += rho * share[:, None] * g / (g.norm() + 1e-12)
            if self.helen.perturb_dense:
                norm = torch.cat([g.reshape(-1) for g in first_grads[len(tables) :]]).norm()
                for p, g in zip(dense, first_grads[len(tables) :]):
                    p += rho * g / (norm + 1e-12)
        second = loss()
        second_grads = torch.autograd.grad(second, tables + dense)
        with torch.no_grad():
            for w, before in zip(tables + dense, originals):
                w.copy_(before)
            for t, w, g, n in zip(self.tables, tables, second_grads, counts):
                self.clipped_rows[t.name] = reference_cowclip_step_(
                    w.data,
                    g,
                    n,
                    self.state[t.name],
                    optimizer=self.optimizer,
                    clip_table=t.name not in self.unclipped,
                    **self.hyper,
                )
        kept = second_grads if self.helen.perturb_dense else first_grads
        self.dense_grads = list(kept[len(tables) :])
        return first.detach()


def write_criteo_npy_days(tsv_path, directory, split: int = 150):
    """TorchRec's preprocessed Criteo layout (``day_N_{dense,sparse,labels}.npy`` after
    ``npy_preproc_criteo`` and ``contiguous_preproc_criteo``: dense ``log(x - min + 2)``,
    ids ``0..n-1`` per feature) made from the real rows of a raw Criteo TSV: rows before
    ``split`` as ``day_0``, the rest as ``day_1``. Returns ``directory``."""
    import csv
    from pathlib import Path

    import numpy as np

    rows = list(csv.reader(open(tsv_path, newline=""), delimiter="\t"))
    dense = np.array([[float(v) if v else 0.0 for v in r[1:14]] for r in rows], dtype=np.float64)
    dense = np.log(dense - dense.min() + 2).astype(np.float32)
    hashes = np.array([[int(v, 16) if v else 0 for v in r[14:40]] for r in rows], np.int64)
    sparse = np.stack(
        [np.unique(column, return_inverse=True)[1] for column in hashes.T], axis=1
    ).astype(np.int32)
    labels = np.array([[int(r[0])] for r in rows], dtype=np.int32)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for day, part in (("day_0", slice(0, split)), ("day_1", slice(split, None))):
        np.save(directory / f"{day}_dense.npy", dense[part])
        np.save(directory / f"{day}_sparse.npy", sparse[part])
        np.save(directory / f"{day}_labels.npy", labels[part])
    return directory

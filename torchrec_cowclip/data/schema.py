"""The column schema of a CTR dataset: dense names, sparse names, table sizes.

Also the fixed layout of the Criteo logs (``label, I1..I13, C1..C26``) and the
per-feature cardinalities of Criteo Kaggle's ``train.txt`` that the synthetic
generator imitates.

Example::

    >>> s = Schema(dense_names=("I1",), sparse_names=("C1", "C2"), cardinalities=(10, 7))
    >>> s.n_sparse, s.cardinality("C2")
    (2, 7)
    >>> Schema.from_json(s.to_json()) == s
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Sequence, Tuple, Union

CRITEO_DENSE_NAMES: Tuple[str, ...] = tuple(f"I{i}" for i in range(1, 14))
CRITEO_SPARSE_NAMES: Tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))

# Distinct values of C1..C26 over Criteo Kaggle train.txt (45,840,617 rows), as
# published with DLRM's Kaggle benchmark and reused by TorchRec's examples.
CRITEO_KAGGLE_CARDINALITIES: Tuple[int, ...] = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)
CRITEO_KAGGLE_ROWS = 45_840_617

# Distinct values of C1..C26 over the 24 days of the Criteo 1TB click logs (about 4.4
# billion rows), every value kept (TorchRec's contiguous_preproc_criteo.py with
# --frequency_threshold 0), as published with TorchRec's DLRM example
# (github.com/facebookresearch/dlrm, torchrec_dlrm/README.MD: "Collective Size of
# Embedding Tables" 91.10 at dim 128, i.e. 91.1e9 bytes of float32 weights).
CRITEO_1TB_CARDINALITIES: Tuple[int, ...] = (
    45833188,
    36746,
    17245,
    7413,
    20243,
    3,
    7114,
    1441,
    62,
    29275261,
    1572176,
    345138,
    10,
    2209,
    11267,
    128,
    4,
    974,
    14,
    48937457,
    11316796,
    40094537,
    452104,
    12606,
    104,
    35,
)


@dataclass(frozen=True)
class Schema:
    """Names and table sizes of a dataset's features.

    ``cardinalities[i]`` is the number of rows the embedding table of
    ``sparse_names[i]`` needs: every encoded id of that feature lies in
    ``[0, cardinalities[i])``.
    """

    dense_names: Tuple[str, ...]
    sparse_names: Tuple[str, ...]
    cardinalities: Tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_names", tuple(self.dense_names))
        object.__setattr__(self, "sparse_names", tuple(self.sparse_names))
        object.__setattr__(self, "cardinalities", tuple(int(c) for c in self.cardinalities))
        if len(self.sparse_names) != len(self.cardinalities):
            raise ValueError(
                f"{len(self.sparse_names)} sparse names but {len(self.cardinalities)} cardinalities"
            )
        names = list(self.dense_names) + list(self.sparse_names)
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate feature names in {names}")
        if any(c < 1 for c in self.cardinalities):
            raise ValueError(f"cardinalities must be >= 1, got {self.cardinalities}")

    @property
    def n_dense(self) -> int:
        return len(self.dense_names)

    @property
    def n_sparse(self) -> int:
        return len(self.sparse_names)

    def cardinality(self, name: str) -> int:
        """Table size of sparse feature ``name``."""
        return self.cardinalities[self.sparse_names.index(name)]

    def to_json(self) -> Dict[str, Any]:
        return {
            "dense_names": list(self.dense_names),
            "sparse_names": list(self.sparse_names),
            "cardinalities": list(self.cardinalities),
        }

    @classmethod
    def from_json(cls, obj: Dict[str, Any]) -> "Schema":
        return cls(
            dense_names=tuple(obj["dense_names"]),
            sparse_names=tuple(obj["sparse_names"]),
            cardinalities=tuple(obj["cardinalities"]),
        )


def resolve_sizes(
    sizes: Union[int, Sequence[int], Mapping[str, int]],
    names: Sequence[str],
    what: str = "hash_size",
) -> Tuple[int, ...]:
    """Expand an int, a per-feature sequence or a ``{name: size}`` mapping to one size per name.

    Example::

        >>> resolve_sizes({"a": 5, "b": 9}, ["a", "b"])
        (5, 9)
    """
    if isinstance(sizes, bool):
        raise TypeError(f"{what} must be an int, a sequence or a mapping, got a bool")
    if isinstance(sizes, int):
        out = tuple(sizes for _ in names)
    elif isinstance(sizes, Mapping):
        missing = [n for n in names if n not in sizes]
        if missing:
            raise ValueError(f"{what} has no entry for features {missing}")
        extra = [k for k in sizes if k not in names]
        if extra:
            raise ValueError(f"{what} names unknown features {extra}; known: {list(names)}")
        out = tuple(int(sizes[n]) for n in names)
    else:
        out = tuple(int(s) for s in sizes)
        if len(out) != len(names):
            raise ValueError(f"{what} has {len(out)} entries for {len(names)} features")
    return out

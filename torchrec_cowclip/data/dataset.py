"""``open_dataset``: the one entry point from a source spec to a memory-mapped dataset.

Spec kinds:

* ``criteo:PATH[,PATH...]``: raw Criteo (Kaggle ``train.txt``, 1TB ``day_N``[.gz],
  or the same layout as CSV with a header);
* ``criteo-npy:DIR``: TorchRec's preprocessed ``day_N_{dense,sparse,labels}.npy``
  (a directory, or one prefix such as ``DIR/day_23``);
* ``avazu:PATH[,PATH...]``: Avazu CSV;
* ``table:PATH[,PATH...]``: CSV/TSV/parquet with ``label=``, ``dense=``, ``sparse=``;
* ``synthetic:ROWS``: Criteo-like rows with a planted model (``200000``, ``200k``, ``1M``).

The first call converts the source into ``cache_dir`` (see ``cache``); later calls
with the same files and options open the cached arrays without parsing anything.

Example::

    >>> import tempfile
    >>> ds = open_dataset("synthetic:5000", tempfile.mkdtemp(), cardinality_scale=0.001)
    >>> len(ds), ds.dense.dtype, ds.schema.n_sparse
    (5000, dtype('float32'), 26)
    >>> train, val, test = ds.split(test_fraction=0.1, val_fraction=0.1)
    >>> batch = next(iter(ds.batches(train, batch_size=512, shuffle=True)))
    >>> batch.dense_features.shape, batch.sparse_features.keys()[:2]
    (torch.Size([512, 13]), ['C1', 'C2'])
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.avazu import convert_avazu
from torchrec_cowclip.data.batches import BatchIterator
from torchrec_cowclip.data.cache import build_entry, fingerprint, read_meta
from torchrec_cowclip.data.criteo import convert_criteo
from torchrec_cowclip.data.criteo_npy import convert_criteo_npy, npy_source_files
from torchrec_cowclip.data.dense import check_transform
from torchrec_cowclip.data.encode import EncodeOptions, HashSize
from torchrec_cowclip.data.errors import BadRowLog, DataError
from torchrec_cowclip.data.schema import Schema
from torchrec_cowclip.data.splits import split_indices
from torchrec_cowclip.data.synthetic import SyntheticConfig, convert_synthetic
from torchrec_cowclip.data.table import convert_table

logger = logging.getLogger(__name__)

SPEC_KINDS = ("criteo", "criteo-npy", "avazu", "table", "synthetic")
PathLike = Union[str, Path]


class CTRDataset:
    """A converted dataset: memory-mapped arrays plus their description.

    Attributes:
        dense: float32 ``[N, n_dense]`` memmap.
        sparse: int32/int64 ``[N, n_sparse]`` memmap of encoded ids.
        labels: float32 ``[N]`` memmap of 0/1.
        schema: feature names and table sizes.
        source: the spec (and test files) it was built from.
        meta: the cache entry's ``meta.json``.
        path: the cache entry directory.

    Example::

        >>> import tempfile
        >>> ds = open_dataset("criteo:/work/shared/data/criteo_sample.tsv", tempfile.mkdtemp())
        >>> CTRDataset(ds.path).sparse.shape
        (200, 26)
    """

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self.meta: Dict[str, Any] = read_meta(self.path)
        self.dense: np.ndarray = np.load(self.path / "dense.npy", mmap_mode="r")
        self.sparse: np.ndarray = np.load(self.path / "sparse.npy", mmap_mode="r")
        self.labels: np.ndarray = np.load(self.path / "labels.npy", mmap_mode="r")
        self.schema = Schema.from_json(self.meta["schema"])
        self.source: str = self.meta.get("source", str(self.path))
        rows = int(self.meta["rows"])
        shapes = (self.dense.shape, self.sparse.shape, self.labels.shape)
        if shapes != ((rows, self.schema.n_dense), (rows, self.schema.n_sparse), (rows,)):
            raise DataError(
                f"cache entry {self.path} is inconsistent: shapes {shapes}, meta rows {rows}",
                path=self.path,
            )

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return (
            f"CTRDataset({self.source!r}, rows={len(self)}, dense={self.schema.n_dense}, "
            f"sparse={self.schema.n_sparse}, path={str(self.path)!r})"
        )

    @property
    def bad_rows(self) -> Dict[str, int]:
        """Rows skipped per reason (empty unless ``on_bad_row="skip"`` found some)."""
        return dict(self.meta.get("bad_rows", {}))

    @property
    def test_start(self) -> Optional[int]:
        """First row of the explicit test files, or None for a random split."""
        return self.meta.get("test_start")

    @property
    def planted_logit(self) -> Optional[np.ndarray]:
        """Synthetic data only: the planted model's logit per row (float32 memmap)."""
        p = self.path / "planted_logit.npy"
        return np.load(p, mmap_mode="r") if p.exists() else None

    def split(
        self, test_fraction: float = 0.1, val_fraction: float = 0.0, seed: Optional[int] = None
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(train, val, test)`` row indices: explicit test files if there were any,
        else a random split (``seed`` defaults to the one given to ``open_dataset``)."""
        seed = int(self.meta.get("seed", 0)) if seed is None else seed
        return split_indices(len(self), test_fraction, val_fraction, seed, test_start=self.test_start)

    def batches(
        self, indices: Optional[np.ndarray] = None, batch_size: int = 1024, **kwargs: Any
    ) -> BatchIterator:
        """A :class:`~torchrec_cowclip.data.batches.BatchIterator` over ``indices``."""
        return BatchIterator(self, indices, batch_size, **kwargs)


def _parse_rows(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise ValueError(f"synthetic:ROWS needs a row count such as 200000, 200k or 1M; got {text!r}")
    value = float(m.group(1).replace("_", "")) * {"": 1, "k": 1e3, "m": 1e6}[m.group(2).lower()]
    if value != int(value) or value < 1:
        raise ValueError(f"synthetic row count must be a positive integer, got {text!r}")
    return int(value)


def parse_spec(spec: str) -> Tuple[str, List[str]]:
    """``"criteo:a,b"`` -> ``("criteo", ["a", "b"])``; raises ValueError listing the kinds."""
    kind, sep, rest = spec.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in SPEC_KINDS or not rest.strip():
        raise ValueError(
            f"bad dataset spec {spec!r}: expected KIND:ARG with KIND one of {', '.join(SPEC_KINDS)} "
            "(criteo:PATH[,PATH...], criteo-npy:DIR, avazu:PATH, table:PATH, synthetic:ROWS)"
        )
    return kind, [p.strip() for p in rest.split(",") if p.strip()]


def _json_sizes(hash_size: HashSize) -> Any:
    if hash_size is None or isinstance(hash_size, int):
        return hash_size
    if isinstance(hash_size, Mapping):
        return dict(sorted((str(k), int(v)) for k, v in hash_size.items()))
    return [int(x) for x in hash_size]


def open_dataset(
    spec: str,
    cache_dir: PathLike,
    *,
    on_bad_row: str = "error",
    min_count: int = 1,
    hash_size: HashSize = None,
    dense_transform: str = "log",
    label: Optional[str] = None,
    dense: Optional[Sequence[str]] = None,
    sparse: Optional[Sequence[str]] = None,
    delimiter: Optional[str] = None,
    test_paths: Optional[Sequence[PathLike]] = None,
    seed: int = 0,
    cardinality_scale: Optional[float] = None,
    max_cardinality: Optional[int] = None,
    top1_share: Optional[float] = None,
    positive_rate: Optional[float] = None,
    rebuild: bool = False,
) -> CTRDataset:
    """Convert (once) and open a CTR dataset.

    Args:
        spec: ``criteo:PATH[,PATH...]``, ``criteo-npy:DIR``, ``avazu:PATH``,
            ``table:PATH`` or ``synthetic:ROWS``.
        cache_dir: where converted datasets (and vocabularies) are kept.
        on_bad_row: ``"error"`` raises ``DataError`` (``file:line: reason``) at the first
            bad row; ``"skip"`` drops bad rows and counts them per reason
            (``dataset.bad_rows``, ``meta.json``, and a logged summary).
        min_count: vocabulary encoding: values seen fewer times share one OOV id.
        hash_size: hash categoricals into this many rows per feature (int, sequence,
            or ``{name: size}``) instead of building a vocabulary.
        dense_transform: ``"log"`` (log(1+x), default), ``"minmax"`` or ``"none"``.
        label, dense, sparse: column names (``table:``; ``avazu:`` overrides).
        delimiter: field separator for text tables (default: from the extension).
        test_paths: explicit test files (same kind as the spec); otherwise
            :meth:`CTRDataset.split` splits at random.
        seed: synthetic data's seed, and the default seed of ``CTRDataset.split``.
        cardinality_scale, max_cardinality, top1_share, positive_rate: synthetic
            options (see ``synthetic.SyntheticConfig``).
        rebuild: convert again even if a cache entry exists.

    Raises:
        ValueError: a bad spec (the message lists the valid kinds) or option.
        FileNotFoundError: a source path that does not exist (named in the message).
        DataError: an empty file, a bad row in ``"error"`` mode, inconsistent files.
    """
    kind, args = parse_spec(spec)
    check_transform(dense_transform)
    BadRowLog(on_bad_row)  # type: ignore[arg-type]  # validates the mode for every kind
    synthetic_opts = {
        "cardinality_scale": cardinality_scale,
        "max_cardinality": max_cardinality,
        "top1_share": top1_share,
        "positive_rate": positive_rate,
    }
    synthetic_opts = {k: v for k, v in synthetic_opts.items() if v is not None}
    if kind != "synthetic" and synthetic_opts:
        raise ValueError(f"{sorted(synthetic_opts)} apply to synthetic: specs only")
    if kind in ("criteo", "criteo-npy", "synthetic") and (
        label is not None or dense is not None or sparse is not None
    ):
        raise ValueError(f"{kind}: has a fixed layout; use table: to choose label/dense/sparse columns")
    if kind in ("criteo-npy", "synthetic") and min_count != 1:
        raise ValueError(f"min_count applies to vocabulary encoding, not to {kind}:")
    if kind == "synthetic" and (hash_size is not None or test_paths):
        raise ValueError("synthetic: takes neither hash_size nor test_paths")
    if kind in ("criteo-npy", "synthetic") and delimiter is not None:
        raise ValueError(f"{kind}: is not delimited text; delimiter= does not apply")
    tests = [str(p) for p in (test_paths or [])]
    source = spec + (f" (test: {','.join(tests)})" if tests else "")
    common = {"on_bad_row": on_bad_row, "dense_transform": dense_transform}

    def finish(meta: Dict[str, Any]) -> Dict[str, Any]:
        meta["source"] = source
        meta["seed"] = seed
        return meta

    if kind == "synthetic":
        if len(args) != 1:
            raise ValueError(f"synthetic:ROWS takes one row count, got {args}")
        config = SyntheticConfig(
            rows=_parse_rows(args[0]), seed=seed, dense_transform=dense_transform, **synthetic_opts
        )
        payload: Dict[str, Any] = {"synthetic": config.payload()}
        entry = build_entry(
            cache_dir,
            "synthetic",
            payload,
            lambda tmp: finish(convert_synthetic(config, tmp)),
            rebuild=rebuild,
        )
    elif kind == "criteo-npy":
        payload = {
            "sources": fingerprint(npy_source_files(args)),
            "test": fingerprint(npy_source_files(tests)) if tests else [],
            "hash_size": _json_sizes(hash_size),
            **common,
        }
        entry = build_entry(
            cache_dir,
            "criteo-npy",
            payload,
            lambda tmp: finish(
                convert_criteo_npy(
                    args,
                    tests,
                    tmp,
                    on_bad_row=on_bad_row,
                    hash_size=hash_size,
                    dense_transform=dense_transform,
                )
            ),
            rebuild=rebuild,
        )
    else:
        opts = EncodeOptions(
            on_bad_row=on_bad_row,
            min_count=min_count,
            hash_size=hash_size,
            hash_method="hex" if kind == "criteo" else "fnv",
            dense_transform=dense_transform,
        )
        columns = {
            "label": label,
            "dense": list(dense) if dense is not None else None,
            "sparse": list(sparse) if sparse is not None else None,
            "delimiter": delimiter,
        }
        payload = {
            "sources": fingerprint(args),
            "test": fingerprint(tests),
            "options": {**opts.payload(), "hash_size": _json_sizes(hash_size)},
            "columns": columns,
        }
        root = Path(cache_dir)

        def build(tmp: Path) -> Dict[str, Any]:
            if kind == "criteo":
                return finish(convert_criteo(args, tests, tmp, opts, root, delimiter=delimiter))
            # Avazu is a table with its own default columns.
            convert = convert_avazu if kind == "avazu" else convert_table
            return finish(
                convert(args, tests, tmp, opts, root, label=label, dense=dense, sparse=sparse,
                        delimiter=delimiter)
            )

        entry = build_entry(cache_dir, kind, payload, build, rebuild=rebuild)
    ds = CTRDataset(entry)
    if ds.bad_rows:
        logger.warning("%s: %s", source, ds.meta.get("bad_row_summary"))
    return ds

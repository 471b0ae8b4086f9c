"""The data a run reads, resolved once: ``--data``, ``--test-data``, the kind's options,
the binary cache and the splits - what the trainer opens and splits, what a checkpoint's
run record and a run folder's ``data.json`` describe, and what a sweep converts once.

Example::

    >>> import tempfile
    >>> data = DataSettings("criteo:tests/data/criteo_sample.tsv", None, tempfile.mkdtemp(),
    ...                     {"hash_size": 100_000}, test_fraction=0.1, val_fraction=0.0,
    ...                     split_seed=0)
    >>> data.kind().name, type(data.source_options()).__name__
    ('criteo', 'CriteoOptions')
    >>> [len(rows) for rows in data.split(data.open())]
    [180, 0, 20]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

import numpy as np

from torchrec_cowclip.data.registry import SourceKind
from torchrec_cowclip.data.source_options import SourceOptions

if TYPE_CHECKING:
    from torchrec_cowclip.data.pipeline.dataset import CTRDataset


@dataclass(frozen=True)
class DataSettings:
    """What a run reads and how it splits it.

    Attributes:
        spec: ``--data`` (``KIND:ARG``).
        test_spec: ``--test-data``, explicit test files of the same kind (None: a random
            ``test_fraction`` of ``spec``'s rows).
        cache_dir: where the converted data (a verified binary cache entry) is kept.
        options: ``open_dataset``'s keyword options: the kind's own (None where not
            given, as a run record lists them) and any other that was set (which the kind
            then refuses, naming its flag).
        test_fraction, val_fraction, split_seed: the random splits.
    """

    spec: str
    test_spec: Optional[str]
    cache_dir: str
    options: Mapping[str, Any]
    test_fraction: float = 0.1
    val_fraction: float = 0.0
    split_seed: int = 0

    def kind(self) -> SourceKind:
        """The registered source kind of :attr:`spec`."""
        from torchrec_cowclip.data.pipeline.dataset import parse_spec
        from torchrec_cowclip.data.registry import source_kind

        return source_kind(parse_spec(self.spec)[0])

    def source_options(self) -> SourceOptions:
        """The kind's options dataclass (another kind's option set is refused, naming it)."""
        from torchrec_cowclip.data.pipeline.dataset import kind_options

        return kind_options(self.kind(), self.options)

    def open(self, encoders: Any = None) -> "CTRDataset":
        """:attr:`spec` converted once into :attr:`cache_dir` (a verified cache entry,
        reused after) and opened with the options, as every command that reads a run's data
        reads it; explicit test files are converted with the training files' vocabulary and
        scaling, as the last rows of the same entry. ``encoders``: a warm start's."""
        from torchrec_cowclip.data.pipeline.dataset import open_dataset, parse_spec

        test_paths = parse_spec(self.test_spec)[1] if self.test_spec else None
        return open_dataset(
            self.spec, self.cache_dir, test_paths=test_paths, encoders=encoders, **self.options
        )

    def split(self, dataset: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(train, validation, test)`` row indices of ``dataset``."""
        splits: Tuple[np.ndarray, np.ndarray, np.ndarray] = dataset.split(
            self.test_fraction, self.val_fraction, self.split_seed
        )
        return splits

    def record(self, dataset: Any) -> Dict[str, Any]:
        """What a run record keeps of its data: the source, the options, the row count and
        the binary-cache entry (plain JSON types)."""
        meta = getattr(dataset, "meta", {}) or {}
        entry = f"{meta['kind']}-{meta['key']}" if "kind" in meta and "key" in meta else None
        return {
            "source": str(getattr(dataset, "source", self.spec)),
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in self.options.items()},
            "rows": len(dataset),
            "cache_entry": entry,
        }

"""The one writer of a cache entry's arrays, for every source kind.

``dense.npy`` (float32 ``[N, n_dense]``), ``sparse.npy`` (``[N, n_sparse]`` ids) and
``labels.npy`` (float32 ``[N]``), plus any extra per-row vectors a source keeps (the
synthetic planted logit), are appended block by block, part (file) by part. The
writer marks where the test parts start, counts each part's rows (a part left with
none is an error), and records every array's shape, size and checksum as computed
while writing (:meth:`CacheWriter.arrays`), which the cache verifies when it opens
the entry.

Example::

    >>> import tempfile, pathlib
    >>> import numpy as np
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> with CacheWriter(out, n_dense=1, n_sparse=2, sparse_dtype=np.int32) as w:
    ...     w.begin("a.tsv")
    ...     w.append(np.ones((3, 1)), np.zeros((3, 2)), np.ones(3))
    ...     _ = w.end("a.tsv")
    ...     w.begin("b.tsv", test=True)
    ...     w.append(np.ones((1, 1)), np.zeros((1, 2)), np.zeros(1))
    ...     _ = w.end("b.tsv")
    >>> w.rows, w.test_start, [r["rows"] for r in w.file_rows]
    (4, 3, [3, 1])
    >>> sorted(w.arrays()), w.arrays()["sparse.npy"]["shape"]
    (['dense.npy', 'labels.npy', 'sparse.npy'], [4, 2])
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from numpy.typing import DTypeLike

from torchrec_cowclip.data.errors import DataError
from torchrec_cowclip.data.pipeline.npyfile import Closing, NpyAppender


class CacheWriter(Closing):
    """Append the rows of a source's parts to a cache entry's arrays.

    Args:
        out_dir: the entry's (temporary) directory.
        n_dense, n_sparse: columns of ``dense.npy`` and ``sparse.npy``.
        sparse_dtype: dtype of the encoded ids.
        extra: names of extra float32 per-row vectors (``<name>.npy``).
    """

    def __init__(
        self,
        out_dir: Path,
        n_dense: int,
        n_sparse: int,
        sparse_dtype: DTypeLike,
        extra: Sequence[str] = (),
    ) -> None:
        self._stack = ExitStack()
        specs: List[Tuple[str, DTypeLike, Tuple[int, ...]]] = [
            ("dense", np.float32, (n_dense,)),
            ("sparse", sparse_dtype, (n_sparse,)),
        ]
        specs += [(name, np.float32, ()) for name in ("labels", *extra)]
        self._arrays: Dict[str, NpyAppender] = {
            name: self._stack.enter_context(
                NpyAppender(Path(out_dir) / f"{name}.npy", dtype, shape)
            )
            for name, dtype, shape in specs
        }
        self.test_start: Optional[int] = None
        self.file_rows: List[Dict[str, Any]] = []
        self._part_start = (0, 0.0)

    @property
    def rows(self) -> int:
        return self._arrays["labels"].rows

    def begin(self, name: str, test: bool = False) -> None:
        """Start part ``name``; the first test part marks ``test_start``."""
        if test and self.test_start is None:
            self.test_start = self.rows
        self._part_start = (self.rows, time.time())

    def append(
        self,
        dense: np.ndarray,
        sparse: np.ndarray,
        labels: np.ndarray,
        extra: Optional[Mapping[str, np.ndarray]] = None,
    ) -> None:
        """Append one block of rows (cast to each array's dtype)."""
        self._arrays["dense"].append(dense)
        self._arrays["sparse"].append(sparse)
        self._arrays["labels"].append(labels)
        for name, values in (extra or {}).items():
            self._arrays[name].append(values)

    def end(self, name: str, why_empty: str = "") -> int:
        """Finish part ``name`` and return its row count.

        Raises:
            DataError: the part has no rows (``why_empty`` says why, e.g. the bad-row summary).
        """
        first, start = self._part_start
        rows = self.rows - first
        if rows == 0:
            raise DataError(
                f"no valid data rows in {name}" + (f" ({why_empty})" if why_empty else ""),
                path=name,
            )
        secs = max(time.time() - start, 1e-9)
        self.file_rows.append({"path": name, "rows": rows, "seconds": round(secs, 3)})
        return rows

    def arrays(self) -> Dict[str, Dict[str, Any]]:
        """``{file name: shape, dtype, bytes, checksum}`` of every array written."""
        return {w.path.name: w.record() for w in self._arrays.values()}

    def close(self) -> None:
        self._stack.close()

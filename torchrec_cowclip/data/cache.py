"""The binary, memory-mapped cache that every source is converted into once.

A cache entry is a directory ``<cache_dir>/<kind>-<key>/`` holding

* ``dense.npy``  float32 ``[N, n_dense]``
* ``sparse.npy`` int32 (int64 if a table has >= 2**31 rows) ``[N, n_sparse]``, ids
  already encoded into ``[0, cardinality)``
* ``labels.npy`` float32 ``[N]``
* ``meta.json``  schema, source, row count, bad-row counts, options, format version.

``key`` is a hash of everything that determines the arrays: the format version, the
source files' absolute paths, sizes and modification times, and every option. A
touched file or a changed option therefore lands in a new directory and nothing
stale is ever read. An entry is built in a temporary directory next to its final
place and renamed into place, so a crash leaves no half-written entry; a lock file
makes concurrent processes (e.g. one per rank) wait for the first builder instead of
all converting.

Example::

    >>> import tempfile
    >>> import numpy as np
    >>> root = tempfile.mkdtemp()
    >>> def build(tmp):
    ...     np.save(tmp / "x.npy", np.arange(3))
    ...     return {"rows": 3}
    >>> entry = build_entry(root, "demo", {"opt": 1}, build)
    >>> read_meta(entry)["rows"], build_entry(root, "demo", {"opt": 1}, build) == entry
    (3, True)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Sequence, Union

CACHE_VERSION = 1
META_FILE = "meta.json"
ARRAY_FILES = ("dense.npy", "sparse.npy", "labels.npy")


def fingerprint(paths: Sequence[Union[str, Path]]) -> List[Dict[str, Any]]:
    """``{path, size, mtime_ns}`` of each file, in order.

    A directory is fingerprinted by its files (non-recursive), so adding a day file
    to a ``criteo-npy`` directory also changes the key.

    Raises:
        FileNotFoundError: naming the first path that does not exist.
    """
    out: List[Dict[str, Any]] = []
    for p in paths:
        path = Path(p).expanduser().resolve()
        if not path.exists():
            raise FileNotFoundError(f"data file not found: {path}")
        if path.is_dir():
            files = sorted(x for x in path.iterdir() if x.is_file())
            out.append({"path": str(path), "files": fingerprint(files)})
            continue
        st = path.stat()
        out.append({"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def cache_key(payload: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit key of a JSON-serialisable payload."""
    text = json.dumps({"version": CACHE_VERSION, **payload}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_meta(entry: Union[str, Path]) -> Dict[str, Any]:
    """The ``meta.json`` of a cache entry."""
    with open(Path(entry) / META_FILE) as f:
        return json.load(f)


def _complete(entry: Path) -> bool:
    try:
        meta = read_meta(entry)
    except (OSError, ValueError):
        return False
    return meta.get("version") == CACHE_VERSION and all(
        (entry / f).exists() for f in meta.get("files", ())
    )


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_entry(
    cache_dir: Union[str, Path],
    kind: str,
    payload: Mapping[str, Any],
    build: Callable[[Path], Dict[str, Any]],
    *,
    rebuild: bool = False,
) -> Path:
    """Return the entry for ``payload``, building it with ``build(tmp_dir)`` if absent.

    ``build`` writes its files into ``tmp_dir`` and returns the meta dict; this
    function adds ``version``, ``kind``, ``key``, ``files`` (the files written),
    ``payload`` and timing, writes ``meta.json`` and renames the directory into place.

    Args:
        cache_dir: root of the cache (created if missing).
        kind: entry name prefix (``"criteo"``, ``"synthetic"``, ...).
        payload: everything the entry's content depends on.
        build: the conversion.
        rebuild: discard an existing entry and build again.
    """
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key({"kind": kind, **payload})
    entry = root / f"{kind}-{key}"
    with _locked(root / f".{kind}-{key}.lock"):
        if rebuild and entry.exists():
            shutil.rmtree(entry)
        if _complete(entry):
            return entry
        if entry.exists():
            shutil.rmtree(entry)  # left incomplete by an older, interrupted writer
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{kind}-{key}-", dir=root))
        try:
            start = time.time()
            meta = dict(build(tmp))
            meta.update(
                version=CACHE_VERSION,
                kind=kind,
                key=key,
                files=sorted(p.name for p in tmp.iterdir()),
                payload=json.loads(json.dumps(payload, default=str)),
                build_seconds=round(time.time() - start, 3),
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            )
            with open(tmp / META_FILE, "w") as f:
                json.dump(meta, f, indent=1)
            os.replace(tmp, entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return entry

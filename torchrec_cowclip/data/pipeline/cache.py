"""The binary, memory-mapped cache that every source is converted into once.

A cache entry is a directory ``<cache_dir>/<kind>-<key>/`` holding

* ``dense.npy``  float32 ``[N, n_dense]``
* ``sparse.npy`` int32 (int64 if a table has >= 2**31 rows) ``[N, n_sparse]``, ids
  already encoded into ``[0, cardinality)``
* ``labels.npy`` float32 ``[N]``
* ``meta.json``  schema, source, row count, bad-row counts, options, format version,
  and ``checks``: each file's size and CRC-32 (for the arrays: also shape and dtype,
  and a checksum computed while the array was written).

``key`` is a hash of everything that determines the arrays: the source files'
absolute paths, sizes and contents (their SHA-256, :func:`source_digest`: computed once
and read again whenever a file's size, mtime or ctime changes, so an edit that keeps the
size and puts the mtime back is caught too), and every option. An edited file or a
changed option therefore lands in a new directory and nothing stale is ever read. An
entry is built in a temporary directory next to its final place and renamed into
place, so a crash leaves no half-written entry; a lock file makes concurrent
processes (e.g. one per rank) wait for the first builder instead of all converting,
and the next builder removes what a killed one left in its temporary directory.

Opening an entry verifies it: every file's size and header on every open (a ``stat``
and a 128-byte read per file), the checksums on the first open in a process and
again whenever a file's size or modification time has changed since (the full check
reads every byte; its cost: docs/performance.md, "Cache verification"). A
mismatch (a truncated or overwritten array) makes :func:`build_entry` log a warning
naming the file and rebuild the entry from its source; :class:`CacheCorrupt` is
raised where no rebuild is possible. An entry written by an older format version is
rebuilt in place (its key is unchanged).

Example::

    >>> import tempfile
    >>> import numpy as np
    >>> root = tempfile.mkdtemp()
    >>> def build(tmp):
    ...     np.save(tmp / "x.npy", np.arange(3))
    ...     return {"rows": 3}
    >>> entry = build_entry(root, "demo", {"opt": 1}, build)
    >>> read_entry(entry)["rows"], build_entry(root, "demo", {"opt": 1}, build) == entry
    (3, True)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Optional, Union

from torchrec_cowclip.data.errors import DataError
from torchrec_cowclip.readback import (
    SHA256,
    RefusedFileError,
    check_file,
    file_record,
    read_json,
    sha256_of,
)

logger = logging.getLogger(__name__)

# The entry format (2: meta.json records every file's size and checksum; 3: dense.npy
# holds each column's pointwise transform with NaN for missing, meta.json its statistics;
# 4: an entry keeps its encoder, meta["encoder"], for run folders; 5: dense values are
# clipped at +-1e30 after their pointwise transform, not at +-1e9 before it).
CACHE_VERSION = 5
# Part of every key; bumped only when a payload's meaning changes, so that a new
# entry format rebuilds old entries in place instead of leaving them behind.
_KEY_VERSION = 1
META_FILE = "meta.json"
# Entries whose checksums this process has verified, with the (name, size, mtime)
# of their files at the time (_stamp): a file changed since is checked again.
_VERIFIED: set[tuple[str, tuple[tuple[str, int, int], ...]]] = set()


class CacheCorrupt(DataError):
    """A cache entry's file does not match what its ``meta.json`` recorded."""


#: The source-digest memo of a cache directory (see :func:`source_digest`).
DIGEST_MEMO = ".source-digests.json"
_MEMO_DIR: ContextVar[Optional[Path]] = ContextVar("source_digest_memo", default=None)
# (path, size, mtime_ns, ctime_ns, inode, device) -> SHA-256, for this process.
_SOURCE_DIGESTS: dict[tuple[str, int, int, int, int, int], str] = {}


@contextmanager
def source_digest_memo(cache_dir: Union[str, Path]) -> Iterator[None]:
    """Inside the block, :func:`source_digest` keeps the digests it computes in
    ``cache_dir/source-digests.json`` and reuses them in later processes."""
    token = _MEMO_DIR.set(Path(cache_dir).expanduser())
    try:
        yield
    finally:
        _MEMO_DIR.reset(token)


def _stat_key(path: Path, st: os.stat_result) -> tuple[str, int, int, int, int, int]:
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _read_memo(memo: Path) -> dict[str, Any]:
    try:
        return read_json(memo)
    except (OSError, ValueError):
        return {}  # absent, damaged, a link or a FIFO: the digests are computed again


def _write_memo(memo: Path, path: str, record: dict[str, Any]) -> None:
    """Adds ``record`` to the memo (a lost race loses an entry, which costs a re-read)."""
    entries = _read_memo(memo)
    entries[path] = record
    tmp = memo.with_name(f"{memo.name}.tmp-{os.getpid()}")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries, indent=0))
        os.replace(tmp, memo)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only or full cache: only the reuse is lost


def source_digest(path: Path) -> str:
    """The SHA-256 of a source file's content.

    Computed by reading the whole file (:func:`sha256_of`), then reused while the file's
    size, mtime, ctime, inode and device stay those it was computed at: in this process,
    and in later ones through the memo of :func:`source_digest_memo`. The kernel sets a
    file's ctime on every write, and a ``touch -r`` or ``os.utime`` that puts the mtime
    back sets it too (only a change of the system clock can set it back), so an edited
    file is always read again, whatever its size and mtime say.

    Raises:
        DataError: the file changed while it was read.
    """
    path = Path(path)
    before = path.stat()
    key = _stat_key(path, before)
    if key in _SOURCE_DIGESTS:
        return _seen(key, _SOURCE_DIGESTS[key])
    memo_dir = _MEMO_DIR.get()
    memo = None if memo_dir is None else memo_dir / DIGEST_MEMO
    stamp = list(key[1:])
    if memo is not None:
        known = _read_memo(memo).get(str(path))
        if isinstance(known, dict) and known.get("stat") == stamp and known.get(SHA256):
            _SOURCE_DIGESTS[key] = str(known[SHA256])
            return _seen(key, _SOURCE_DIGESTS[key])
    _, digest = sha256_of(path)
    if _stat_key(path, path.stat()) != key:
        raise DataError(
            f"{path} changed while it was read: run again once it is written", path=path
        )
    _SOURCE_DIGESTS[key] = digest
    if memo is not None:
        _write_memo(memo, str(path), {"stat": stamp, SHA256: digest})
    return _seen(key, digest)


#: The sources whose digests the innermost :func:`sources_seen` block used.
_SEEN: ContextVar[Optional[dict[str, list[Any]]]] = ContextVar("sources_seen", default=None)


def _seen(key: tuple[str, int, int, int, int, int], digest: str) -> str:
    seen = _SEEN.get()
    if seen is not None:
        seen[key[0]] = [*key[1:], digest]
    return digest


@contextmanager
def sources_seen() -> Iterator[dict[str, list[Any]]]:
    """Inside the block, every source file whose digest :func:`source_digest` returns is
    recorded in the dict yielded: ``path -> [size, mtime_ns, ctime_ns, inode, device,
    sha256]``, what a run keeps of its sources (:func:`changed_sources` reads it back)."""
    seen: dict[str, list[Any]] = {}
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def changed_sources(recorded: Mapping[str, Sequence[Any]]) -> list[tuple[str, str, str]]:
    """``(path, recorded SHA-256, now)`` for each source of ``recorded`` (as
    :func:`sources_seen` kept it) whose content is no longer the recorded one. A file whose
    size, mtime, ctime, inode and device are the recorded ones is unchanged (the kernel sets
    the ctime on every write); any other is read again here, whatever the digest memo says
    (a memo record written by hand can name the file's new stamp with its old digest)."""
    changed: list[tuple[str, str, str]] = []
    for path, record in recorded.items():
        if not isinstance(record, (list, tuple)) or len(record) != 6:
            changed.append((str(path), "an unreadable record", "unknown"))
            continue
        stamp, digest = list(record[:5]), str(record[5])
        try:
            st = os.stat(path)
        except FileNotFoundError:
            changed.append((path, digest, "missing"))
            continue
        if list(_stat_key(Path(path), st)[1:]) != stamp:
            now = sha256_of(path)[1]
            if now != digest:
                changed.append((path, digest, now))
    return changed


def fingerprint(paths: Sequence[Union[str, Path]]) -> list[dict[str, Any]]:
    """``{path, size, sha256}`` of each file, in order: what a cache key depends on, so
    an edited file lands in a new entry whatever its size and mtime (:func:`source_digest`;
    a touched file whose content is the same keeps its entry).

    A directory is fingerprinted by its files (non-recursive), so adding a day file
    to a ``criteo-npy`` directory also changes the key.

    Raises:
        FileNotFoundError: naming the first path that does not exist.
    """
    out: list[dict[str, Any]] = []
    for p in paths:
        path = Path(p).expanduser().resolve()
        if not path.exists():
            raise FileNotFoundError(f"data file not found: {path}")
        if path.is_dir():
            files = sorted(x for x in path.iterdir() if x.is_file())
            out.append({"path": str(path), "files": fingerprint(files)})
            continue
        out.append({"path": str(path), "size": path.stat().st_size, SHA256: source_digest(path)})
    return out


def cache_key(payload: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit key of a JSON-serialisable payload."""
    text = json.dumps({"version": _KEY_VERSION, **payload}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_meta(entry: Union[str, Path]) -> dict[str, Any]:
    """The ``meta.json`` of a cache entry (:func:`~torchrec_cowclip.readback.read_json`).

    Raises:
        FileNotFoundError: the entry has none.
        RefusedFileError: it is not the JSON object the cache writes.
    """
    return read_json(Path(entry) / META_FILE)


def _stamp(entry: Path) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    """What :data:`_VERIFIED` knows an entry by: its place, and the name, size and
    modification time of each of its files (none if it is absent)."""
    stamp = []
    for path in sorted(entry.iterdir()) if entry.is_dir() else ():
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # gone since the listing: its check says so
        stamp.append((path.name, st.st_size, st.st_mtime_ns))
    return str(entry.resolve()), tuple(stamp)


def read_entry(entry: Union[str, Path]) -> dict[str, Any]:
    """The ``meta.json`` of an intact entry, as opening a dataset reads it: the entry's
    files stamped first (a file changed from then on is checked in full next time), its
    ``meta.json`` read (:func:`read_meta`), then each file checked against its record
    (see the module docstring).

    Raises:
        FileNotFoundError, RefusedFileError: as :func:`read_meta`.
        CacheCorrupt: naming the entry, the file and what is wrong with it.
    """
    entry = Path(entry)
    seen = _stamp(entry)
    meta = read_meta(entry)
    if meta.get("version") != CACHE_VERSION:
        raise CacheCorrupt(
            f"cache entry {entry}: format version {meta.get('version')}, expected {CACHE_VERSION}",
            path=entry,
        )
    checks: Mapping[str, Mapping[str, Any]] = meta.get("checks", {})
    full = seen not in _VERIFIED
    for name in sorted(checks):
        why = check_file(entry / name, checks[name], full)
        if why is not None:
            raise CacheCorrupt(f"cache entry {entry}: {name} is corrupt ({why})", path=entry / name)
    _VERIFIED.add(seen)
    return meta


def _usable(entry: Path) -> Optional[str]:
    """None if ``entry`` is complete and intact, else why not ("" if it is simply absent)."""
    try:
        read_entry(entry)
    except CacheCorrupt as e:
        return str(e)
    except (FileNotFoundError, RefusedFileError):  # meta.json's (check_file says the others')
        return "" if not entry.exists() else f"cache entry {entry}: {META_FILE} unreadable"
    return None


@contextmanager
def _locked(lock_path: Path, shared: bool = False) -> Iterator[None]:
    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_entry(
    cache_dir: Union[str, Path],
    kind: str,
    payload: Mapping[str, Any],
    build: Callable[[Path], dict[str, Any]],
    *,
    rebuild: bool = False,
) -> Path:
    """Return the intact entry for ``payload``, building it with ``build(tmp_dir)`` if
    absent, incomplete, of an older format or corrupt (the latter with a warning).

    ``build`` writes its files into ``tmp_dir`` and returns the meta dict (with
    ``checks`` for the arrays it wrote, see ``writer``); this function adds
    ``version``, ``kind``, ``key``, ``files``, the ``checks`` of the other files,
    ``payload`` and timing, writes ``meta.json`` and renames the directory into place.

    Args:
        cache_dir: root of the cache (created if missing).
        kind: entry name prefix (``"criteo"``, ``"synthetic"``, ...).
        payload: everything the entry's content depends on.
        build: the conversion.
        rebuild: discard an existing entry and build again.

    Raises:
        CacheCorrupt: the entry is corrupt and its source is gone (the message says so).
    """
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key({"kind": kind, **payload})
    entry = root / f"{kind}-{key}"
    lock = root / f".{kind}-{key}.lock"
    if not rebuild:
        # Readers verify side by side; only a (re)build takes the lock exclusively.
        with _locked(lock, shared=True):
            if _usable(entry) is None:
                return entry
    with _locked(lock):
        why = None if rebuild else _usable(entry)
        if why is None and not rebuild:
            return entry  # another process rebuilt it meanwhile
        if why:
            logger.warning("%s; rebuilding it from its source", why)
        if entry.exists():
            shutil.rmtree(entry)
        for stale in root.glob(f".tmp-{kind}-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)  # a killed builder's (this lock is held)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{kind}-{key}-", dir=root))
        try:
            start = time.time()
            try:
                meta = dict(build(tmp))
            except FileNotFoundError as e:
                if why:
                    raise CacheCorrupt(f"{why}, and its source is gone: {e}", path=entry) from None
                raise
            checks = dict(meta.pop("checks", {}))
            for p in sorted(tmp.iterdir()):
                if p.name not in checks:
                    checks[p.name] = file_record(p)
            meta.update(
                version=CACHE_VERSION,
                kind=kind,
                key=key,
                files=sorted(checks),
                checks=checks,
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
    _VERIFIED.add(_stamp(entry))  # just written: its checksums are the files'
    return entry

"""What the cache's content check of a source file costs: its streaming SHA-256 next to a
plain read of the same bytes, and to converting the file.

Writes a Criteo-like TSV of about ``--mb`` MB (a label, 13 counts, 26 hex ids per line),
then times in interleaved rounds, with the file in the page cache (round 0 warms it and
is not recorded):

* ``read``: every byte read in 8 MiB blocks and dropped (the floor of any full read);
* ``sha256``: :func:`~torchrec_cowclip.readback.sha256_of`, what a cache key
  reads when the file is new or has changed (size, mtime or ctime);
* ``crc32``: zlib's CRC-32 over the same bytes, for scale (the cache's own files use it);
* ``fingerprint (memo hit)``: the cache key's fingerprint of the file in a new process
  whose cache directory remembers the digest (the stat compared, no byte read).

With ``--convert``, also the file's conversion into the cache once (``open_dataset``),
which the digest is paid against.

Usage::

    python benchmarks/source_digest.py [--mb 150] [--rounds 5] [--convert]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
from common import cpu_model, digest_files

from torchrec_cowclip.data import open_dataset
from torchrec_cowclip.data.pipeline import cache


def write_tsv(path: Path, mb: float, seed: int = 0) -> int:
    """A Criteo-like TSV of about ``mb`` MB; returns its rows."""
    g = np.random.default_rng(seed)
    rows = 0
    with open(path, "w") as f:
        while f.tell() < mb * 1e6:
            n = 20_000
            labels = g.integers(0, 2, n)
            dense = g.integers(0, 1000, (n, 13))
            sparse = g.integers(0, 1 << 20, (n, 26))
            lines = [
                "\t".join([str(labels[i]), *map(str, dense[i]), *(f"{v:08x}" for v in sparse[i])])
                for i in range(n)
            ]
            f.write("\n".join(lines) + "\n")
            rows += n
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=150.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--convert", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "train.tsv"
        rows = write_tsv(path, args.mb)
        size = path.stat().st_size
        memo_dir = Path(root) / "cache"
        with cache.source_digest_memo(memo_dir):
            cache.fingerprint([path])  # the memo now holds the digest

        def memo_hit() -> None:
            cache._SOURCE_DIGESTS.clear()  # as a new process
            with cache.source_digest_memo(memo_dir):
                cache.fingerprint([path])

        crc = [0]
        variants: Dict[str, Callable[[], object]] = {
            "read (8 MiB blocks)": lambda: digest_files([path], lambda b: None),
            "sha256 (streaming)": lambda: cache.sha256_of(path),
            "crc32": lambda: digest_files([path], lambda b: crc.__setitem__(0, zlib.crc32(b))),
            "fingerprint (memo hit)": memo_hit,
        }
        times: Dict[str, List[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.rounds + 1):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                variants[name]()
                if r:
                    times[name].append(time.perf_counter() - start)
        converted = None
        if args.convert:
            start = time.perf_counter()
            open_dataset(f"criteo:{path}", memo_dir / "entries", hash_size=1 << 20)
            converted = time.perf_counter() - start
    mb = size / 1e6
    print(f"{cpu_model()}; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}")
    print(f"source: {mb:.0f} MB, {rows:,} rows; {args.rounds} rounds, page cache warm")
    read = statistics.median(times["read (8 MiB blocks)"])
    for name, samples in times.items():
        median = statistics.median(samples)
        rate = "no byte read" if "memo" in name else f"{mb / median:7.0f} MB/s"
        print(
            f"{name:24s} median {median * 1e3:8.1f} ms  (min {min(samples) * 1e3:.1f}, "
            f"max {max(samples) * 1e3:.1f}; {rate}; {median / read:5.2f} x read)"
        )
    if converted is not None:
        digest = statistics.median(times["sha256 (streaming)"])
        print(
            f"conversion (open_dataset, criteo:, hashed): {converted:.1f} s; the digest is "
            f"{100 * digest / converted:.1f}% of it"
        )


if __name__ == "__main__":
    main()

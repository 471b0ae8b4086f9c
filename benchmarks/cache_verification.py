"""What verifying the binary cache costs: size-only vs full checksum checks on open.

Builds ``synthetic:ROWS`` into a temporary cache (2M rows: about 330 MB of arrays),
then times, with the files in the page cache:

* opening the entry as a process that has verified it already (sizes and headers);
* opening it as a new process would (every file's CRC-32 read back);
* the two checksums considered, CRC-32 (zlib) and BLAKE2b, over the same bytes.

Usage::

    python benchmarks/cache_verification.py [--rows 2000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
import zlib
from typing import Callable, List

from common import digest_files

from torchrec_cowclip.data import open_dataset
from torchrec_cowclip.data.pipeline import cache as cache_module


def _best(fn: Callable[[], object], repeat: int) -> float:
    times: List[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        spec = f"synthetic:{args.rows}"
        opts = dict(cardinality_scale=0.01)
        start = time.perf_counter()
        ds = open_dataset(spec, root, **opts)
        build = time.perf_counter() - start
        files = [ds.path / name for name in ds.meta["checks"]]
        size = sum(p.stat().st_size for p in files)
        sizes_only = _best(lambda: open_dataset(spec, root, **opts), args.repeat)

        def fresh_process_open() -> None:
            cache_module._VERIFIED.clear()
            open_dataset(spec, root, **opts)

        full = _best(fresh_process_open, args.repeat)
        crc_state = [0]
        crc = _best(
            lambda: digest_files(
                files, lambda b: crc_state.__setitem__(0, zlib.crc32(b, crc_state[0]))
            ),
            args.repeat,
        )
        blake = _best(lambda: digest_files(files, hashlib.blake2b().update), args.repeat)
    mb = size / 1e6
    print(
        f"cache entry: {args.rows} rows, {len(files)} files, {mb:.0f} MB (built in {build:.1f} s)"
    )
    print(f"open, sizes and headers only:  {sizes_only * 1e3:8.1f} ms")
    print(f"open, full CRC-32 check:       {full * 1e3:8.1f} ms  ({mb / full:.0f} MB/s)")
    print(f"CRC-32 of the files alone:     {crc * 1e3:8.1f} ms  ({mb / crc:.0f} MB/s)")
    print(f"BLAKE2b of the files alone:    {blake * 1e3:8.1f} ms  ({mb / blake:.0f} MB/s)")


if __name__ == "__main__":
    main()

"""What verifying a checkpoint against its manifest costs, next to loading it.

Trains DeepFM one step on ``synthetic:ROWS`` with tables scaled by ``--scale`` (Criteo
Kaggle's cardinalities times it: 0.05 gives 1.7M rows in all, about 230 MB of weights
and Adam state), writes a checkpoint, then times in interleaved rounds, with the files
in the page cache:

* ``verify``: every file's size and CRC-32 against the manifest (what ``--resume`` does
  first);
* ``load``: the rest of a resume's read: the trainer state, the fit check and DCP's
  load into the live tensors (safe reader and planner);
* ``save``: a whole checkpoint write (DCP, trainer state, the checksums read back for
  the manifest, fsyncs, pruning);
* the two checksums considered, CRC-32 (zlib) and BLAKE2b, over the same bytes.

Usage::

    python benchmarks/checkpoint_verification.py [--scale 0.05] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
import zlib
from typing import Callable, Dict, List

from common import cpu_model, digest_files

from torchrec_cowclip.train import TrainConfig
from torchrec_cowclip.train.start import start_run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--scale", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        trainer = start_run(
            TrainConfig(
                data=f"synthetic:{args.rows}",
                synthetic_scale=args.scale,
                hidden=(64, 64),
                batch_size=1024,
                max_steps=1,
                progress=False,
                out=f"{root}/run",
                cache_dir=f"{root}/cache",
            ).resolve()
        )
        trainer.run()
        store = trainer.checkpoints
        store.keep = args.rounds + 2  # the timed saves must not prune the timed checkpoint
        checkpoint = store.newest("latest")
        assert checkpoint is not None
        files = [checkpoint.path / name for name in checkpoint.manifest["files"]]
        size = sum(p.stat().st_size for p in files)
        tensors = trainer.runtime.tensors()

        def verify() -> None:
            assert store.verify(checkpoint) == []

        def load() -> None:
            store.load(checkpoint, tensors)

        crc = [0]
        variants: Dict[str, Callable[[], None]] = {
            "save (DCP, state, manifest)": trainer.save,
            "verify (sizes + CRC-32)": verify,
            "load (state, fit check, DCP)": load,
            "CRC-32 of the files": lambda: digest_files(
                files, lambda b: crc.__setitem__(0, zlib.crc32(b, crc[0]))
            ),
            "BLAKE2b of the files": lambda: digest_files(files, hashlib.blake2b().update),
        }
        times: Dict[str, List[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.rounds + 1):  # round 0 warms the page cache, not recorded
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                variants[name]()
                if r:
                    times[name].append(time.perf_counter() - start)
    mb = size / 1e6
    print(f"{cpu_model()}; checkpoint: {len(files)} files, {mb:.0f} MB")
    load_median = statistics.median(times["load (state, fit check, DCP)"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(
            f"{name:32s} median {median * 1e3:8.1f} ms  (min {min(samples) * 1e3:.1f}, "
            f"max {max(samples) * 1e3:.1f}; {mb / median:6.0f} MB/s; "
            f"{median / load_median:.2f} x load)"
        )


if __name__ == "__main__":
    main()

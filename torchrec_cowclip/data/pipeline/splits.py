"""Train / validation / test index splits.

The default is the reference's random split (90/10 on Criteo), seeded; with explicit
test files the test rows are the ones after ``test_start``. A validation set is
carved out of the training indices either way (``val_fraction`` of them).

Example::

    >>> train, val, test = split_indices(1000, test_fraction=0.1, val_fraction=0.1, seed=0)
    >>> len(train), len(val), len(test)
    (810, 90, 100)
    >>> train, val, test = split_indices(1000, test_start=900)
    >>> test[:3].tolist(), len(train)
    ([900, 901, 902], 900)
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

_SPLIT_STREAM = 0x5B1
_VAL_STREAM = 0x7A1


def split_indices(
    n: int,
    test_fraction: float = 0.1,
    val_fraction: float = 0.0,
    seed: int = 0,
    *,
    test_start: Optional[int] = None,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint, sorted int64 index arrays ``(train, val, test)`` covering ``range(n)``.

    Args:
        n: number of rows.
        test_fraction: share of all rows drawn at random for test (ignored when
            ``test_start`` is given).
        val_fraction: share of the *training* rows moved to validation.
        seed: the split is a function of ``(n, fractions, seed)`` only.
        test_start: rows ``[test_start, n)`` are the test set (explicit test files).
    """
    if not 0.0 <= test_fraction < 1.0 or not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"fractions must be in [0, 1), got test={test_fraction}, val={val_fraction}"
        )
    all_rows = np.arange(n, dtype=np.int64)
    if test_start is not None:
        if not 0 <= test_start <= n:
            raise ValueError(f"test_start {test_start} outside [0, {n}]")
        pool, test = all_rows[:test_start], all_rows[test_start:]
    else:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _SPLIT_STREAM])))
        n_test = int(round(n * test_fraction))
        perm = rng.permutation(n)
        test = np.sort(perm[:n_test]).astype(np.int64)
        pool = np.sort(perm[n_test:]).astype(np.int64)
    n_val = int(round(len(pool) * val_fraction))
    rng_val = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _VAL_STREAM])))
    pick = rng_val.permutation(len(pool))[:n_val]
    is_val = np.zeros(len(pool), dtype=bool)
    is_val[pick] = True
    return pool[~is_val], pool[is_val], test

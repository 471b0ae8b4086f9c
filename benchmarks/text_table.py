"""The plain-text tables every benchmark prints last (no torch, fbgemm or torchrec import,
so the GPU check can use it on a machine without them)."""

from __future__ import annotations

from typing import List


def format_table(rows: List[List[str]]) -> str:
    """Left-aligned first column, right-aligned others, a rule under the header.

    Example::

        >>> print(format_table([["variant", "ms"], ["ours", "1.0"]]))
        variant   ms
        -------  ---
        ours     1.0
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)

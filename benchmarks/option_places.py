"""The places an option is stated in the command-line half of the package (issue 45's
count, docs/architecture.md).

A place is, read with Python's :mod:`tokenize`:

* a string that is the option's name (``"batch_size"``) or its flag (``"--batch-size"``);
* an annotated field of its name (``batch_size: int``, at the start of a line);
* a keyword argument of its name (``batch_size=...`` inside brackets, not ``==``).

A use (``settings.batch_size``) is not a place. Counted in the files the issue names
(:data:`FILES`). ``--where`` lists each place as ``file:line``.

Usage::

    python benchmarks/option_places.py [--root .] [--where] [name ...]
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from collections import Counter
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

#: The files the count reads, under the package.
FILES = (
    "train/config.py",
    "train/options.py",
    "train/command.py",
    "train/warm_start.py",
    "train/run_state.py",
    # The trainer's module until it became the start, the loop, its report and its finish
    # (a tree is counted in the files of these it has: before and after, side by side).
    "train/trainer.py",
    "train/start.py",
    "train/loop.py",
    "train/report.py",
    "train/finish.py",
    "run/resume_guard.py",
    "sweep/command.py",
    "sweep/grid.py",
    "sweep/runner.py",
    "plan/command.py",
    "cli.py",
)

#: The five options issue 45's note follows.
OPTIONS = ("batch_size", "lr_embed", "val_fraction", "time_columns", "sharding")


def places(source: str, name: str) -> Iterator[Tuple[int, str]]:
    """(line, kind) of each place ``source`` states the option ``name``.

    Example::

        >>> src = 'f(batch_size=1)\\nclass C:\\n    batch_size: int\\nx = "--batch-size"\\n'
        >>> list(places(src, "batch_size"))
        [(1, 'keyword'), (3, 'field'), (4, 'string')]
        >>> list(places("a.batch_size == b.batch_size\\n", "batch_size"))
        []
    """
    flag = "--" + name.replace("_", "-")
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.COMMENT, tokenize.NL)
    ]
    depth = 0
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.STRING:
            try:
                text = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if text in (name, flag):
                yield tok.start[0], "string"
        elif tok.type == tokenize.NAME and tok.string == name:
            after = tokens[i + 1].string if i + 1 < len(tokens) else ""
            before = tokens[i - 1] if i else None
            if after == "=" and depth > 0:
                yield tok.start[0], "keyword"
            elif (
                after == ":"
                and depth == 0
                and (
                    before is None
                    or before.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
                )
            ):
                yield tok.start[0], "field"


def count(root: Path, names: Sequence[str]) -> Dict[str, List[Tuple[str, int, str]]]:
    """Each option's places under ``root`` (the repository): (file, line, kind). Of
    :data:`FILES`, those the tree has are read; a tree with none is refused."""
    found: Dict[str, List[Tuple[str, int, str]]] = {n: [] for n in names}
    package = root / "torchrec_cowclip"
    present = [rel for rel in FILES if (package / rel).is_file()]
    if not present:
        raise SystemExit(f"{package}: none of the counted files is there")
    for rel in present:
        source = (package / rel).read_text()
        for name in names:
            found[name].extend((rel, line, kind) for line, kind in places(source, name))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(OPTIONS))
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--where", action="store_true", help="list each place")
    args = parser.parse_args()
    found = count(args.root, args.names)
    print(" / ".join(args.names))
    print(" / ".join(str(len(found[n])) for n in args.names))
    if args.where:
        for name in args.names:
            kinds = Counter(kind for _, _, kind in found[name])
            print(f"\n{name}: {len(found[name])} ({dict(kinds)})")
            for rel, line, kind in found[name]:
                print(f"  {rel}:{line} {kind}")


if __name__ == "__main__":
    main()

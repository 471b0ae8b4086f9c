"""How ``torchrec-cowclip``'s commands show their flags in ``--help`` (standard library
only: ``--help`` must stay fast).

Example::

    >>> import argparse
    >>> p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    >>> _ = p.add_argument("--epochs", type=int, default=2, help="passes over the data")
    >>> _ = p.add_argument("--overwrite", action="store_true", help="replace the run")
    >>> text = p.format_help()
    >>> "(default: 2)" in text, "(default: off)" in text
    (True, True)
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["HelpFormatter", "RawDescriptionHelpFormatter", "add_require_sha256"]


#: What ``--require-sha256`` does (``train``'s with ``--init-from``, and the serving
#: commands').
REQUIRE_SHA256_HELP = (
    "refuse a run folder whose manifest records CRC-32s (format 1, which a crafted edit "
    "can keep) rather than SHA-256s (format 2)"
)


def add_require_sha256(parser: Any, context: str = "") -> None:
    """``--require-sha256``, declared once for every command that reads a run folder
    (``predict``, ``evaluate``, ``export``; ``train`` with ``--init-from``)."""
    parser.add_argument(
        "--require-sha256",
        action="store_true",
        help=context + REQUIRE_SHA256_HELP,
    )


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default once: appended as ``(default: X)`` unless the help says
    it; a switch (``--overwrite``) is off by default, and a ``--no-x`` switch's help says
    in its own words what happens without it (``(default: True)`` would read backwards)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0 and action.default is False:  # a store_true switch
            return f"{text} (default: off)"
        if action.default is None or isinstance(action.default, bool):
            return text  # a test requires such a help to state its default itself
        return f"{text} (default: %(default)s)"


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """:class:`HelpFormatter` whose description keeps its lines (a command's example)."""

"""``torchrec-cowclip`` / ``python -m torchrec_cowclip``: the program's command line.

One parser, one command per job - ``train`` (:mod:`torchrec_cowclip.train.command`),
``sweep`` (:mod:`torchrec_cowclip.sweep.command`), ``plan``
(:mod:`torchrec_cowclip.plan.command`), ``predict`` / ``evaluate`` / ``export``
(:mod:`torchrec_cowclip.serve.command`) - each defined by its own package; this module
dispatches to them, shows the package's log on stderr, and turns a failure into one line
and an exit status (:data:`~torchrec_cowclip.failures.EXIT_USAGE` and its siblings).
Nothing in the package imports it.

Example::

    torchrec-cowclip train --model deepfm --data criteo:train.txt --batch-size 131072 \\
        --epochs 1 --out runs/criteo-128k
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from torchrec_cowclip.failures import (
    EXIT_DIVERGED,
    EXIT_ENVIRONMENT,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    EXIT_USAGE,
    ConfigError,
)
from torchrec_cowclip.plan.command import add_plan_parser
from torchrec_cowclip.process_context import ProcessContext
from torchrec_cowclip.serve.command import COMMANDS as SERVING_COMMANDS
from torchrec_cowclip.serve.command import add_commands, run_command
from torchrec_cowclip.stderr_log import package_log_shown
from torchrec_cowclip.sweep.command import add_sweep_parser
from torchrec_cowclip.train.command import (
    add_train_parser,
    command_settings,
    exiting_on_failure,
    run_train,
)

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_ENVIRONMENT",
    "EXIT_INTERRUPTED",
    "EXIT_STOPPED",
    "EXIT_USAGE",
    "build_parser",
    "main",
]


def build_parser() -> argparse.ArgumentParser:
    """The program's parser: every command, each with its own arguments."""
    parser = argparse.ArgumentParser(
        prog="torchrec-cowclip",
        description="Large-batch CTR training on TorchRec with CowClip (Zheng et al., AAAI 2023).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_sweep_parser(sub)
    add_plan_parser(sub)
    add_commands(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    # The launch this process is part of, read once and handed to the command (a
    # launcher's variable that is no whole number: one line, before any command runs).
    try:
        process = ProcessContext.from_environment()
    except ConfigError as e:
        sys.stderr.write(f"torchrec-cowclip: error: {e}\n")
        raise SystemExit(EXIT_USAGE) from None
    with package_log_shown(process.rank):
        return _main(argv, process)


def _main(argv: Optional[Sequence[str]], process: ProcessContext) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "sweep":
        return int(args.run_sweep(args))
    if args.command == "plan":
        return int(args.run_plan(args, argv))
    if args.command in SERVING_COMMANDS:
        from torchrec_cowclip.run.stop import raising_on_sigterm  # deferred: keeps --help fast

        with exiting_on_failure(f"{args.command}: nothing was written"):
            with raising_on_sigterm(f"{args.command}: nothing was written; run it again"):
                summary = run_command(args)
            print(json.dumps(summary, indent=2, default=str))
        return 0
    with exiting_on_failure(args.command):
        settings, said = command_settings(args, argv, process)
    return run_train(settings, said)


if __name__ == "__main__":
    sys.exit(main())

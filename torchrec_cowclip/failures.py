"""How a command of the package fails: the refusal every command shares,
:class:`ConfigError` (a bad option or combination, named in one line), and the exit
statuses of ``torchrec-cowclip`` (README, "Reliability")."""

#: The command, its data or its checkpoint is wrong (a refusal in one line).
EXIT_USAGE = 2
#: The training diverged (a NaN or infinite loss or state); the last good checkpoint is kept.
EXIT_DIVERGED = 3
#: The environment failed: a full or read-only disk, a dead or hung peer.
EXIT_ENVIRONMENT = 4
#: A signal stopped the run after its checkpoint (``EX_TEMPFAIL``: run it again later).
EXIT_STOPPED = 75
#: Ctrl-C (SIGINT) where no step is in flight: 128 + SIGINT, as a shell reports it.
EXIT_INTERRUPTED = 130


class ConfigError(ValueError):
    """A bad combination of options; the message names the option."""

"""Keyword options of data sources: the bases every source kind's options dataclass extends.

Each field may name the training CLI flag that sets it (:func:`option_field`, in the
field's ``metadata["flag"]``), so an error about an option can name both
(``min_count (--min-count)``). :class:`SourceOptions` holds what every kind takes;
:class:`FileSourceOptions` adds what only kinds that read rows from files take (a
generator has no bad rows to skip).

Example::

    >>> from dataclasses import fields
    >>> FileSourceOptions(on_bad_row="skip").on_bad_row
    'skip'
    >>> fields(FileSourceOptions)[-1].metadata["flag"]
    '--on-bad-row'
    >>> FileSourceOptions(on_bad_row="ignore")
    Traceback (most recent call last):
    ...
    torchrec_cowclip.data.errors.DataOptionError: on_bad_row (--on-bad-row) must be 'error' or 'skip', got 'ignore'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torchrec_cowclip.data.errors import BadRowLog
from torchrec_cowclip.data.parsing.dense import check_transform


def option_field(default: Any, flag: Optional[str] = None) -> Any:
    """A dataclass field with a default and, if given, the CLI flag that sets it."""
    return field(default=default, metadata={"flag": flag} if flag else {})


@dataclass(frozen=True)
class SourceOptions:
    """Options every source kind takes.

    Args:
        dense_transform: ``"log"`` (log(1+x)), ``"minmax"`` or ``"none"``; see ``dense``.
    """

    dense_transform: str = option_field("log", "--dense-transform")

    def __post_init__(self) -> None:
        check_transform(self.dense_transform)


@dataclass(frozen=True)
class FileSourceOptions(SourceOptions):
    """Options of the kinds that read rows from files (everything but the generators).

    Args:
        on_bad_row: ``"error"`` raises ``DataError`` (``file:line: reason``) at the
            first bad row; ``"skip"`` drops bad rows and counts them per reason.
    """

    on_bad_row: str = option_field("error", "--on-bad-row")

    def __post_init__(self) -> None:
        super().__post_init__()
        BadRowLog(self.on_bad_row)  # type: ignore[arg-type]  # validates the mode

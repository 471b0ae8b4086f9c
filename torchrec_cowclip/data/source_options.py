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

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional, Tuple

from torchrec_cowclip.data.errors import BadRowLog
from torchrec_cowclip.data.parsing.dense import DenseTransformSpec


def option_field(default: Any, flag: Optional[str] = None) -> Any:
    """A dataclass field with a default and, if given, the CLI flag that sets it."""
    return field(default=default, metadata={"flag": flag} if flag else {})


@dataclass(frozen=True)
class SourceOptions:
    """Options every source kind takes.

    Args:
        dense_transform: the dense columns' transforms: one for every column (``"log"``,
            ``"signed-log"``, ``"standardize"``, ``"minmax"``, ``"none"``), columns by name
            (``"price=log,score=standardize"``) or both; a column not named takes the bare
            one, else the kind's default (this field's default). See ``parsing.dense``.
    """

    #: How messages name the kind.
    where: ClassVar[str] = "data"
    #: The dense columns of a kind whose columns are fixed (Criteo's I1..I13), against
    #: which a spec's column names are checked at once.
    fixed_dense_names: ClassVar[Optional[Tuple[str, ...]]] = None

    dense_transform: str = option_field("log", "--dense-transform")

    def __post_init__(self) -> None:
        spec = self.dense_spec()  # validates the spec
        if self.fixed_dense_names is not None:
            spec.check_names(self.fixed_dense_names, self.where)

    @classmethod
    def default_dense_transform(cls) -> str:
        """The transform of the columns a spec does not name (this kind's default)."""
        return str(next(f.default for f in fields(cls) if f.name == "dense_transform"))

    def dense_spec(self) -> DenseTransformSpec:
        """:attr:`dense_transform` parsed, with the kind's default filled in."""
        return DenseTransformSpec.parse(self.dense_transform, self.default_dense_transform())


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

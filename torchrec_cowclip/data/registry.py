"""The registry of source kinds behind ``open_dataset``'s ``KIND:ARG`` specs.

A source kind is a :class:`SourceKind` subclass registered with
:func:`register_source`. It names its spec prefix and usage, its options dataclass
(a :class:`~torchrec_cowclip.data.source_options.SourceOptions` subclass: the keyword
options it takes), the cache payload of a spec (everything the converted arrays
depend on) and the :class:`~torchrec_cowclip.data.pipeline.encode.Conversion` of its rows,
which the one pipeline in ``encode`` runs. Adding a format is one module defining
and registering its kind, plus its test; the built-in kinds (``BUILTIN_MODULES``)
are imported on the first lookup, and a kind registered from outside the package
works the same way.

Example::

    >>> source_kinds()
    ('criteo', 'criteo-npy', 'avazu', 'table', 'synthetic', 'synthetic-hard')
    >>> kind = source_kind("synthetic")
    >>> kind.usage, kind.options.__name__
    ('synthetic:ROWS', 'SyntheticOptions')
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

from torchrec_cowclip.data.pipeline.encode import Conversion
from torchrec_cowclip.data.schema import Schema
from torchrec_cowclip.data.source_options import SourceOptions

BUILTIN_MODULES = (
    "torchrec_cowclip.data.sources.criteo",
    "torchrec_cowclip.data.sources.criteo_npy",
    "torchrec_cowclip.data.sources.avazu",
    "torchrec_cowclip.data.sources.table",
    "torchrec_cowclip.data.sources.synthetic",
)

_KINDS: Dict[str, "SourceKind"] = {}
_builtins_loaded = False


class SourceKind(ABC):
    """One kind of data source (one ``KIND:`` spec prefix).

    A subclass states, as class keywords: ``name``, the spec prefix (``"criteo"``);
    ``usage``, how its spec reads (``"criteo:PATH[,PATH...]"``, for error messages);
    ``options``, its options dataclass.
    """

    name: ClassVar[str]
    usage: ClassVar[str]
    options: ClassVar[Type[SourceOptions]]

    def __init_subclass__(
        cls, *, name: str, usage: str, options: Type[SourceOptions], **kw: Any
    ) -> None:
        super().__init_subclass__(**kw)
        cls.name, cls.usage, cls.options = name, usage, options

    def check_args(self, spec: str, args: List[str]) -> None:
        """Refuse a spec whose arguments cannot be right (before anything is read)."""

    def check_test_paths(self, test_paths: Sequence[str]) -> None:
        """Refuse explicit test parts the kind cannot take."""

    def check_sources(self, args: List[str], test_paths: List[str], opts: Any) -> None:
        """Refuse, before any row is read (reading at most each file's first line or
        schema), sources whose columns do not fit ``opts`` (a chosen column missing, a
        file the delimiter or header setting does not fit)."""

    def planned_sizes(self, args: List[str], opts: Any) -> Optional[Tuple[Schema, int, int]]:
        """``(schema, dense inputs, rows)`` from the options alone, for a source whose rows
        are generated (``plan`` computes from them instead of writing the rows); None:
        ``plan`` reads the rows (files, already on disk, bound what it converts)."""
        return None

    @abstractmethod
    def payload(self, args: List[str], test_paths: List[str], opts: Any) -> Dict[str, Any]:
        """Everything the converted arrays depend on (source fingerprints, options)."""

    @abstractmethod
    def conversion(self, args: List[str], test_paths: List[str], opts: Any) -> Conversion:
        """How the rows of ``args`` (then ``test_paths``) become cache arrays."""


K = TypeVar("K", bound=Type[SourceKind])


def register_source(cls: K) -> K:
    """Class decorator: register a :class:`SourceKind` under its ``name``.

    Raises:
        ValueError: another kind has that name already.
    """
    if cls.name in _KINDS and type(_KINDS[cls.name]) is not cls:
        raise ValueError(
            f"source kind {cls.name!r} is registered already ({type(_KINDS[cls.name])})"
        )
    _KINDS[cls.name] = cls()
    return cls


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def source_kinds() -> Tuple[str, ...]:
    """The registered kind names: built-in kinds first, in ``BUILTIN_MODULES`` order."""
    _load_builtins()

    def rank(name: str) -> int:
        module = type(_KINDS[name]).__module__
        return BUILTIN_MODULES.index(module) if module in BUILTIN_MODULES else len(BUILTIN_MODULES)

    return tuple(sorted(_KINDS, key=rank))


def source_kind(name: str) -> SourceKind:
    """The kind registered as ``name`` (KeyError if none)."""
    _load_builtins()
    return _KINDS[name]

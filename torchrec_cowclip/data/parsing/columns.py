"""Choosing columns by name: the checks a choice must pass and the hints when it fails.

A source whose columns are chosen by name (``table:``, ``avazu:``) is checked twice,
both times before any row is read. First the choice itself (:func:`check_choice`): no
empty or duplicate name, no column among both dense and categorical features, and never
the label among the features (a label read as a feature leaks it: a test AUC of 1.0).
Then against each file's first line (:func:`check_file_columns`): every chosen column
must exist, and a failure says what the evidence points to: a first line that splits
into more names on another delimiter (``wrong delimiter?``), or one that reads as data
rather than names (``no header?``), or, for a file declared header-less, one that reads
as names (``a header?``).

Example::

    >>> check_choice("click", ["price"], ["site", "click"], where="table")
    Traceback (most recent call last):
    ...
    torchrec_cowclip.data.errors.DataOptionError: table: the label column 'click' is also a categorical feature (--sparse): a label among the features leaks it (a test AUC of 1.0); remove it from --sparse
    >>> parse_delimiter("\\\\t"), parse_delimiter("semicolon"), parse_delimiter("|")
    ('\\t', ';', '|')
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from torchrec_cowclip.data.errors import DataError, DataOptionError
from torchrec_cowclip.data.parsing.delimited import (
    damaged_gzip_as_data_error,
    open_binary,
    read_line,
)
from torchrec_cowclip.data.parsing.fields import parse_numeric

#: Delimiters tried when a first line suggests another one, in order of preference.
CANDIDATE_DELIMITERS = (",", "\t", ";", "|", " ")
_NAMED_DELIMITERS = {
    "tab": "\t",
    "\\t": "\t",
    "comma": ",",
    "semicolon": ";",
    "pipe": "|",
    "space": " ",
}
_SHOWN = {"\t": "tab", " ": "space"}


def shown_delimiter(delimiter: str) -> str:
    """How a delimiter is written in a message (``';'``, ``tab``)."""
    return _SHOWN.get(delimiter, repr(delimiter))


def parse_delimiter(text: str) -> str:
    """A delimiter as given on the command line: one character, or ``tab`` / ``\\t``,
    ``comma``, ``semicolon``, ``pipe``, ``space``.

    Raises:
        DataOptionError: several characters, a newline or a quote.
    """
    value = _NAMED_DELIMITERS.get(text.lower() if len(text) > 1 else text, text)
    if len(value) != 1 or value in '\r\n"':
        raise DataOptionError(
            f"delimiter (--delimiter) must be one character other than a newline or a quote "
            f"(or tab, comma, semicolon, pipe, space), got {text!r}"
        )
    return value


def normalize_names(names: Optional[Sequence[str]], flag: str) -> Optional[Tuple[str, ...]]:
    """Column names with surrounding whitespace stripped (``"price, age"`` means
    ``price`` and ``age``); an empty name or one given twice is refused naming ``flag``."""
    if names is None:
        return None
    if isinstance(names, str):
        names = names.split(",")
    out = tuple(str(n).strip() for n in names)
    if any(not n for n in out):
        raise DataOptionError(f"{flag} has an empty column name: {list(names)}")
    twice = sorted({n for n in out if out.count(n) > 1})
    if twice:
        raise DataOptionError(f"{flag} names {', '.join(map(repr, twice))} twice")
    return out


def check_choice(
    label: Optional[str],
    dense: Sequence[str],
    sparse: Sequence[str],
    where: str,
    columns: Optional[Sequence[str]] = None,
) -> None:
    """Refuse a column choice that cannot be right, before anything is read: the label
    among the features, a column both dense and categorical, and (when the file's
    ``columns`` are known) a name that is not one of them."""
    for flag, kind, names in (("--dense", "dense", dense), ("--sparse", "categorical", sparse)):
        if label is not None and label in names:
            raise DataOptionError(
                f"{where}: the label column {label!r} is also a {kind} feature ({flag}): a "
                f"label among the features leaks it (a test AUC of 1.0); remove it from {flag}"
            )
    both = [n for n in dense if n in sparse]
    if both:
        raise DataOptionError(
            f"{where}: {', '.join(map(repr, both))} {'is' if len(both) == 1 else 'are'} in "
            "both --dense and --sparse: a column is a dense or a categorical feature, not both"
        )
    if columns is not None:
        wanted = {
            "--label": [label] if label is not None else [],
            "--dense": dense,
            "--sparse": sparse,
        }
        _check_known(where, columns, wanted, hint="")


def _check_known(
    where: str, columns: Sequence[str], wanted: Dict[str, Sequence[str]], hint: str
) -> None:
    for flag, names in wanted.items():
        unknown = [n for n in names if n not in columns]
        if unknown:
            raise DataOptionError(
                f"{where}: no column {', '.join(map(repr, unknown))} ({flag}); the columns "
                f"are {list(columns)}{hint}"
            )


def split_line(line: str, delimiter: str) -> List[str]:
    """The fields of one text line (CSV quoting honoured for a comma), stripped."""
    if delimiter == "," and '"' in line:
        return [f.strip() for f in next(csv.reader([line]))]
    return [f.strip() for f in line.split(delimiter)]


def first_line(path: Union[str, Path]) -> str:
    """The first line of a text file (gzip and a byte-order mark handled), decoded."""
    with open_binary(path) as f, damaged_gzip_as_data_error(path):
        line = read_line(f, path, 1)
    if not line:
        raise DataError(f"data file is empty: {path}", path=path)
    return line.rstrip(b"\r\n").decode("utf-8", "replace")


def guess_delimiter(line: str, current: Optional[str] = None) -> Optional[str]:
    """The candidate delimiter that splits ``line`` into the most fields (at least two
    and more than ``current`` gives), or None."""
    best, best_count = None, len(split_line(line, current)) if current else 1
    for d in CANDIDATE_DELIMITERS:
        if d == current:
            continue
        count = len(split_line(line, d))
        if count > best_count:
            best, best_count = d, count
    return best


def looks_like_data(fields: Sequence[str]) -> bool:
    """Whether a first line's fields read as values rather than column names: most of
    them numbers or empty, as a data row's are and a header's never are."""
    if not fields:
        return False
    _, bad = parse_numeric(np.array([f.encode() for f in fields]))
    return int((~bad).sum()) * 2 > len(fields)


def check_file_columns(
    path: Union[str, Path],
    delimiter: str,
    wanted: Dict[str, Sequence[str]],
    *,
    header: bool = True,
    columns: Optional[Sequence[str]] = None,
    where: str = "table",
) -> List[str]:
    """Check the chosen columns (``{flag: names}``) against ``path``'s first line, before
    any row is read; return the file's column names.

    With ``header`` the first line names the columns; without, ``columns`` does (or the
    field positions ``0, 1, ...``), and the first line must have as many fields.

    Raises:
        DataOptionError: a chosen column is not in the file, or the first line does not
            fit the declared layout; the message lists the file's columns and says
            ``wrong delimiter?``, ``no header?`` or ``a header?`` when the first line
            points there.
    """
    line = first_line(path)
    fields = split_line(line, delimiter)
    shown = shown_delimiter(delimiter)
    if not header:
        names = list(columns) if columns is not None else [str(i) for i in range(len(fields))]
        if len(fields) != len(names):
            other = guess_delimiter(line, delimiter)
            hint = (
                f" (wrong delimiter? it splits on {shown_delimiter(other)} into "
                f"{len(split_line(line, other))}: give --delimiter {shown_delimiter(other)})"
                if other
                else ""
            )
            raise DataOptionError(
                f"{path}:1 has {len(fields)} fields split on {shown}, --columns names "
                f"{len(names)}{hint}"
            )
        chosen = [n for flag_names in wanted.values() for n in flag_names]
        if fields and not looks_like_data(fields) and any(f in chosen for f in fields):
            raise DataOptionError(
                f"{path}:1 reads as a header ({fields[:6]}{' ...' if len(fields) > 6 else ''}), "
                "but the file was declared header-less (--no-header / --columns): a header? "
                "drop --no-header and --columns"
            )
        _check_known(f"{where}: {path}", names, wanted, hint="")
        return names
    hint = ""
    missing = [n for flag_names in wanted.values() for n in flag_names if n not in fields]
    if missing:
        other = guess_delimiter(line, delimiter)
        if other is not None and any(n in split_line(line, other) for n in missing):
            hint = (
                f" (wrong delimiter? the first line is split on {shown}; on "
                f"{shown_delimiter(other)} it gives {split_line(line, other)[:8]}: give "
                f"--delimiter {shown_delimiter(other)})"
            )
        elif looks_like_data(fields):
            hint = (
                " (no header? the first line reads as data, not column names: give "
                "--no-header, and --columns a,b,c to name the columns)"
            )
        elif len(fields) == 1 and other is not None:
            hint = (
                f" (wrong delimiter? the first line has one field on {shown}; "
                f"{shown_delimiter(other)} splits it: give --delimiter {shown_delimiter(other)})"
            )
    _check_known(f"{where}: {path}", fields, wanted, hint)
    refuse_repeated_columns(path, fields, [n for names in wanted.values() for n in names])
    return fields


def refuse_repeated_columns(
    path: Union[str, Path], header: Sequence[str], read: Sequence[Optional[str]]
) -> None:
    """Refuses a header that names a column to be ``read`` more than once: which of the
    two holds the values is anybody's guess, so neither is read silently.

    Raises:
        DataOptionError: naming the column and its positions (1-based).
    """
    for name in dict.fromkeys(n for n in read if n is not None):
        at = [i + 1 for i, field in enumerate(header) if field == name]
        if len(at) > 1:
            raise DataOptionError(
                f"{path}:1 names the column {name!r} {len(at)} times (fields "
                f"{', '.join(map(str, at))}): rename all but one, so the column read is the "
                "one meant"
            )

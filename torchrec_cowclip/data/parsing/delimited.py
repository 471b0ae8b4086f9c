"""Streaming reader of delimited text (TSV/CSV, plain or gzip) into per-column byte arrays.

A file is read in blocks of whole lines (16 MiB by default), so memory stays flat
whatever the file size. Within a block, field boundaries are found with numpy on the
raw bytes and each wanted column is gathered into a fixed-width ``S`` array: no
Python object per field, which is what makes a 45M-row ``train.txt`` convertible in
minutes. Lines with the wrong number of fields are returned, with their line number,
for the caller's bad-row policy. Blank lines carry no data and are ignored. A UTF-8
byte-order mark at the start of a file is dropped (editors and Excel write one), so
it can neither hide the first row's label nor rename the first header column.

CSV quoting (``"a,b"``) is honoured through the ``csv`` module, block by block, for
blocks that contain a quote; a quoted field cannot span lines.

Example::

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.csv"
    >>> _ = p.write_text("label,a,b\\n1,x,7\\n0,y\\n")
    >>> f = DelimitedFile(p, header=True)
    >>> f.header
    ['label', 'a', 'b']
    >>> block = next(f.blocks(wanted=[0, 2]))
    >>> block.columns[2].tolist(), block.lines.tolist(), block.bad_lines
    ([b'7'], [2], [(3, 'expected 3 columns, got 2')])
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union, cast

import numpy as np

from torchrec_cowclip.data.errors import DataError, DataOptionError

HeaderRule = Union[bool, Callable[[List[bytes]], bool]]

DEFAULT_BLOCK_BYTES = 16 << 20
_BOM = b"\xef\xbb\xbf"
# Guard against a pathological field turning one block into a huge fixed-width array.
_MAX_COLUMN_BYTES = 512 << 20
_GATHER_PAD = 64
_LINE_END = re.compile(rb"\r+\n")
#: The longest line a reader takes (bytes, its newline included): a line longer than
#: this is refused as soon as it is seen, so a file without newlines (the wrong file,
#: a binary) costs a bounded read and bounded memory, not the whole file.
MAX_LINE_BYTES = 1 << 20


def infer_delimiter(path: Union[str, Path]) -> Optional[bytes]:
    """Delimiter implied by a file name: ``.tsv``/``.txt``/none -> tab, ``.csv`` -> comma.

    ``.gz`` is looked through. Returns None for other extensions.
    """
    name = Path(path).name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    suffix = Path(name).suffix
    if suffix == ".csv":
        return b","
    if suffix in (".tsv", ".txt", ""):
        return b"\t"
    return None


def open_binary(path: Union[str, Path]) -> BinaryIO:
    """Open ``path`` for reading bytes, decompressing gzip (detected by magic bytes),
    positioned after a UTF-8 byte-order mark if the text starts with one."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file not found: {p}")
    if p.is_dir():
        raise DataError(f"expected a file, got a directory: {p}", path=p)
    with open(p, "rb") as head:
        magic = head.read(2)
    # A GzipFile reads bytes as a BinaryIO does; typeshed does not derive it from one.
    f: BinaryIO = cast(BinaryIO, gzip.open(p, "rb")) if magic == b"\x1f\x8b" else open(p, "rb")
    if f.read(len(_BOM)) != _BOM:
        f.seek(0)
    return f


def long_line(path: Union[str, Path], line: int) -> DataError:
    """The refusal of a line longer than :data:`MAX_LINE_BYTES`."""
    return DataError(
        f"{path}:{line}: a line longer than {MAX_LINE_BYTES >> 20} MiB: not delimited text "
        "with one row per line (a binary file, or one without newlines?)",
        path=path,
        line=line,
    )


def read_line(f: BinaryIO, path: Union[str, Path], line: int) -> bytes:
    """The next line of ``f`` (its newline included), read no further than
    :data:`MAX_LINE_BYTES`.

    Raises:
        DataError: the line is longer (:func:`long_line`).
    """
    text = f.readline(MAX_LINE_BYTES + 1)
    if len(text) > MAX_LINE_BYTES:
        raise long_line(path, line)
    return text


@contextlib.contextmanager
def damaged_gzip_as_data_error(path: Union[str, Path]) -> Iterator[None]:
    """Turns a compressed file that ends early or is corrupt (``EOFError``,
    ``gzip.BadGzipFile``, ``zlib.error`` from inside ``gzip``) into one
    :class:`~torchrec_cowclip.data.errors.DataError` naming the file."""
    try:
        yield
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        reason = str(e) or type(e).__name__
        raise DataError(
            f"{path}: damaged compressed file ({reason}): re-download or re-compress it",
            path=path,
        ) from None


@dataclass
class RawBlock:
    """Fields of the well-formed lines of one block.

    ``columns[c]`` is an ``S`` array with column ``c`` of every well-formed line;
    ``lines`` their 1-based line numbers; ``bad_lines`` ``(line, detail)`` of the
    lines whose field count was wrong; ``fraction`` the share of the file read once
    this block is (None for a compressed file).
    """

    columns: Dict[int, np.ndarray]
    lines: np.ndarray
    bad_lines: List[Tuple[int, str]] = field(default_factory=list)
    fraction: Optional[float] = None


class DelimitedFile:
    """One delimited text file, read block by block.

    Args:
        path: file to read (gzip is detected).
        delimiter: field separator; None infers it from the extension.
        header: True if the first line holds column names, False if not, or a
            function of the first line's fields deciding it.
        n_columns: expected fields per line; None takes the header's length.
        block_bytes: approximate bytes per block.
    """

    def __init__(
        self,
        path: Union[str, Path],
        delimiter: Union[bytes, str, None] = None,
        header: HeaderRule = False,
        n_columns: Optional[int] = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> None:
        self.path = Path(path)
        if isinstance(delimiter, str):
            delimiter = delimiter.encode()
        if delimiter is None:
            delimiter = infer_delimiter(self.path)
            if delimiter is None:
                raise DataOptionError(
                    f"cannot infer the delimiter of {self.path} from its extension; pass "
                    "delimiter= (--delimiter)"
                )
        if len(delimiter) != 1 or delimiter in (b"\n", b"\r", b'"'):
            raise ValueError(
                f"delimiter must be one byte other than newline or quote, got {delimiter!r}"
            )
        self.delimiter: bytes = delimiter
        self.block_bytes = int(block_bytes)
        with open_binary(self.path) as f, damaged_gzip_as_data_error(self.path):
            first = read_line(f, self.path, 1)
        if not first:
            raise DataError(f"data file is empty: {self.path}", path=self.path)
        first_fields = self._split_line(first.rstrip(b"\r\n"))
        has_header = header(first_fields) if callable(header) else bool(header)
        self.has_header: bool = has_header
        self.header: Optional[List[str]] = (
            [x.decode("utf-8", "replace").strip() for x in first_fields] if has_header else None
        )
        if n_columns is None:
            if self.header is None:
                raise ValueError(f"{self.path}: n_columns is required for a file without header")
            n_columns = len(self.header)
        self.n_columns: int = int(n_columns)
        if self.header is not None and len(self.header) != self.n_columns:
            raise DataError(
                f"{self.path}:1: header has {len(self.header)} columns, expected {self.n_columns}",
                path=self.path,
                line=1,
            )

    def _split_line(self, line: bytes) -> List[bytes]:
        if self.delimiter == b"," and b'"' in line:
            row = next(csv.reader([line.decode("utf-8", "replace")]))
            return [x.encode() for x in row]
        return line.split(self.delimiter)

    def blocks(self, wanted: Sequence[int]) -> Iterator[RawBlock]:
        """Yield the wanted columns of every line, block by block."""
        wanted = list(wanted)
        if any(not 0 <= c < self.n_columns for c in wanted):
            raise ValueError(f"column indices {wanted} out of range for {self.n_columns} columns")
        with open_binary(self.path) as f, damaged_gzip_as_data_error(self.path):
            # A plain file's position tells how much of it is read; a gzip stream's does not.
            size = None if isinstance(f, gzip.GzipFile) else self.path.stat().st_size
            line_no = 1
            if self.has_header:
                read_line(f, self.path, 1)
                line_no = 2
            rest = b""
            while True:
                data = f.read(self.block_bytes)
                if not data:
                    if rest:
                        yield self._parse(rest + b"\n", line_no, wanted, 1.0 if size else None)
                    return
                data = rest + data if rest else data
                cut = data.rfind(b"\n")
                if cut < 0:
                    if len(data) > MAX_LINE_BYTES:
                        raise long_line(self.path, line_no)
                    rest = data
                    continue
                rest = data[cut + 1 :]
                if len(rest) > MAX_LINE_BYTES:
                    raise long_line(self.path, line_no + data.count(b"\n", 0, cut + 1))
                block = data[: cut + 1]
                done = (f.tell() - len(rest)) / size if size else None
                yield self._parse(block, line_no, wanted, done)
                line_no += block.count(b"\n")

    def _parse(
        self, block: bytes, first_line: int, wanted: List[int], fraction: Optional[float] = None
    ) -> RawBlock:
        parsed = self._parse_block(block, first_line, wanted)
        parsed.fraction = fraction
        return parsed

    def _parse_block(self, block: bytes, first_line: int, wanted: List[int]) -> RawBlock:
        if b"\r" in block:
            # CRLF, and a file converted to CRLF twice (CR CR LF): no CR stays in a field.
            block = _LINE_END.sub(b"\n", block)
        if self.delimiter == b"," and b'"' in block:
            return self._parse_quoted(block, first_line, wanted)
        # The zero padding lets _gather read a fixed-width window past the last field.
        padded = np.frombuffer(block + bytes(_GATHER_PAD), dtype=np.uint8)
        buf = padded[: len(block)]
        is_nl = buf == 10
        newlines = np.flatnonzero(is_nl)
        n_lines = len(newlines)
        _check_line_lengths(newlines, first_line, self.path)
        line_start = np.empty(n_lines, dtype=np.int64)
        line_start[0] = 0
        line_start[1:] = newlines[:-1] + 1
        seps = np.flatnonzero(is_nl | (buf == self.delimiter[0]))
        # Every line ends at a newline separator, so the gaps between newline
        # separators count each line's fields.
        nl_in_seps = np.flatnonzero(is_nl[seps])
        fields_per_line = np.diff(nl_in_seps, prepend=-1)
        blank = newlines == line_start
        good = fields_per_line == self.n_columns
        bad_lines: List[Tuple[int, str]] = []
        if not good.all():
            for i in np.flatnonzero(~good & ~blank).tolist():
                bad_lines.append(
                    (
                        first_line + i,
                        f"expected {self.n_columns} columns, got {int(fields_per_line[i])}",
                    )
                )
            seps = seps[np.repeat(good, fields_per_line)]
        ends = seps.reshape(-1, self.n_columns)
        starts = np.empty_like(ends)
        starts[:, 0] = line_start[good]
        starts[:, 1:] = ends[:, :-1] + 1
        columns = {c: _gather(padded, starts[:, c], ends[:, c], self.path) for c in wanted}
        lines = first_line + np.flatnonzero(good)
        return RawBlock(columns=columns, lines=lines, bad_lines=bad_lines)

    def _parse_quoted(self, block: bytes, first_line: int, wanted: List[int]) -> RawBlock:
        buf = np.frombuffer(block, dtype=np.uint8)
        _check_line_lengths(np.flatnonzero(buf == 10), first_line, self.path)
        text_lines = block.decode("utf-8", "replace").split("\n")[:-1]
        rows: List[List[str]] = []
        lines: List[int] = []
        bad_lines: List[Tuple[int, str]] = []
        for i, row in enumerate(csv.reader(text_lines)):
            if not row and not text_lines[i]:
                continue
            if len(row) != self.n_columns:
                bad_lines.append(
                    (first_line + i, f"expected {self.n_columns} columns, got {len(row)}")
                )
                continue
            rows.append(row)
            lines.append(first_line + i)
        columns = {
            c: np.array([r[c].encode() for r in rows], dtype=np.bytes_)
            if rows
            else np.zeros(0, "S1")
            for c in wanted
        }
        return RawBlock(
            columns=columns, lines=np.asarray(lines, dtype=np.int64), bad_lines=bad_lines
        )


def _check_line_lengths(newlines: np.ndarray, first_line: int, path: Path) -> None:
    """Refuses a block's line longer than :data:`MAX_LINE_BYTES` (``newlines``: the
    positions of its newlines), naming it."""
    lengths = np.diff(newlines, prepend=-1)
    if len(lengths) and int(lengths.max()) > MAX_LINE_BYTES:
        raise long_line(path, first_line + int(np.argmax(lengths > MAX_LINE_BYTES)))


def _gather(padded: np.ndarray, starts: np.ndarray, ends: np.ndarray, path: Path) -> np.ndarray:
    """Copy the byte ranges ``[starts, ends)`` into one NUL-padded ``S`` array.

    ``padded`` ends with ``_GATHER_PAD`` zero bytes beyond the data.
    """
    n = len(starts)
    lengths = ends - starts
    width = int(lengths.max()) if n else 0
    if width == 0:
        return np.zeros(n, dtype="S1")
    if n * width > _MAX_COLUMN_BYTES:
        raise DataError(
            f"{path}: a field is {width} bytes long; fields this long are not supported", path=path
        )
    offsets = np.arange(width)
    if width <= _GATHER_PAD:
        # Row gather from a sliding-window view: one copy, no (n, width) index array.
        out = np.lib.stride_tricks.sliding_window_view(padded, width)[starts]
    else:
        idx = starts[:, None] + offsets[None, :]
        np.minimum(idx, len(padded) - 1, out=idx)
        out = padded[idx]
    out *= offsets[None, :] < lengths[:, None]
    fields: np.ndarray = out.view(f"S{width}").reshape(n)
    return fields


def read_header(path: Union[str, Path], delimiter: Union[bytes, str, None] = None) -> List[str]:
    """Column names from the first line of ``path``."""
    return DelimitedFile(path, delimiter=delimiter, header=True).header or []


__all__ = [
    "MAX_LINE_BYTES",
    "DelimitedFile",
    "RawBlock",
    "infer_delimiter",
    "open_binary",
    "read_header",
    "read_line",
]

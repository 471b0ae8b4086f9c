"""A user's own tables for ``torchrec-cowclip plan --tables FILE`` and :class:`~torchrec_cowclip.plan.job.JobSpec`:
per table its name, rows (exactly as written), dim, and optionally its storage type, its
pooling factor (the mean ids per bag the planner sizes communication and compute by) and a
sharding constraint; from a JSON, YAML or CSV file, or a list built in Python.

A file is a list of tables: JSON/YAML a list of objects (or an object whose ``"tables"``
is one), CSV one table per line under a header naming the columns::

    name,rows,dim,dtype,pooling_factor,sharding
    user,40000000,128,fp16,1,row_wise
    item,2000000,128,,,

Example::

    >>> t = TableSpec.from_mapping({"name": "user", "rows": 40_000_000, "dim": 128,
    ...                             "sharding": "row_wise"}, "tables.json, table 1")
    >>> t.rows, t.dtype, t.sharding, t.config().num_embeddings
    (40000000, 'fp32', 'row_wise', 40000000)
    >>> parse_constraint("user=table_wise")
    ('user', 'table_wise')
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.readback import RefusedFileError, parse_json, read_bytes

__all__ = [
    "MAX_TABLE_FILE_BYTES",
    "SHARDING_TYPES",
    "TABLE_FILE_SUFFIXES",
    "TableSpec",
    "parse_constraint",
    "read_table_file",
]

#: The largest table file read (a list of tables, not data).
MAX_TABLE_FILE_BYTES = 16 << 20
#: The sharding types a table can be constrained to (TorchRec's ``ShardingType`` values
#: the CowClip sharder takes).
SHARDING_TYPES: Tuple[str, ...] = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
)
TABLE_FILE_SUFFIXES: Tuple[str, ...] = (".json", ".yaml", ".yml", ".csv")
_DTYPES = ("fp32", "fp16", "bf16")
_FIELDS = ("name", "rows", "dim", "dtype", "pooling_factor", "sharding")


class TableFileError(ConfigError):
    """A table list that cannot be planned (one line naming the file, the table and field)."""


def _check(values: Mapping[str, Any], where: str) -> None:
    """Refuses (:class:`TableFileError`, naming ``where`` and the field) a bad value."""
    name = values["name"]
    if not isinstance(name, str) or not name.strip():
        raise TableFileError(f"{where}: name must be a non-empty text, got {name!r}")
    for field in ("rows", "dim"):
        value = values[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TableFileError(f"{where}: {field} must be an integer >= 1, got {value!r}")
    if values["dtype"] not in _DTYPES:
        raise TableFileError(
            f"{where}: dtype must be one of {', '.join(_DTYPES)}, got {values['dtype']!r}"
        )
    pf = values["pooling_factor"]
    if pf is not None and (
        isinstance(pf, bool)
        or not isinstance(pf, (int, float))
        or not (math.isfinite(pf) and pf > 0)
    ):
        raise TableFileError(f"{where}: pooling_factor must be > 0, got {pf!r}")
    sharding = values["sharding"]
    if sharding is not None and sharding not in SHARDING_TYPES:
        raise TableFileError(
            f"{where}: sharding must be one of {', '.join(SHARDING_TYPES)}, got {sharding!r}"
        )


@dataclass(frozen=True)
class TableSpec:
    """One table to plan.

    Attributes:
        name: the table's (and its one feature's) name.
        rows: its rows, exactly as planned.
        dim: its columns.
        dtype: its weights' storage, ``fp32``, ``fp16`` or ``bf16`` (the optimizer state
            is float32 whatever it is).
        pooling_factor: the mean ids per bag of its feature (None: TorchRec's 1.0).
        sharding: the one sharding type the planner may give it (None: the planner's
            choice, or ``plan``'s ``--sharding``).
    """

    name: str
    rows: int
    dim: int
    dtype: str = "fp32"
    pooling_factor: Optional[float] = None
    sharding: Optional[str] = None

    def __post_init__(self) -> None:
        _check(vars(self), f"table {self.name!r}")

    @classmethod
    def from_mapping(cls, entry: Mapping[str, Any], where: str) -> "TableSpec":
        """The table ``entry`` describes (``where``: the file and table, for a refusal)."""
        if not isinstance(entry, Mapping):
            raise TableFileError(f"{where}: a table is an object of {', '.join(_FIELDS)}")
        unknown = sorted(set(entry) - set(_FIELDS))
        if unknown:
            raise TableFileError(
                f"{where}: unknown field {unknown[0]!r}; a table has {', '.join(_FIELDS)}"
            )
        missing = [f for f in ("name", "rows", "dim") if entry.get(f) in (None, "")]
        if missing:
            raise TableFileError(f"{where}: no {missing[0]} (name, rows and dim are needed)")
        values = {
            "name": entry["name"],
            "rows": entry["rows"],
            "dim": entry["dim"],
            "dtype": entry.get("dtype") or "fp32",
            "pooling_factor": entry.get("pooling_factor"),
            "sharding": entry.get("sharding") or None,
        }
        _check(values, where)
        return cls(**values)

    @classmethod
    def from_config(cls, config: Any, sharding: Optional[str] = None) -> "TableSpec":
        """The table of a TorchRec ``EmbeddingBagConfig`` (its name, rows, dim, storage)."""
        dtype = str(config.data_type.value).lower()
        return cls(config.name, int(config.num_embeddings), int(config.embedding_dim), dtype,
                   None, sharding)  # fmt: skip

    def config(self) -> Any:
        """The ``EmbeddingBagConfig`` planned: one feature, named as the table."""
        from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig

        return EmbeddingBagConfig(
            name=self.name,
            embedding_dim=self.dim,
            num_embeddings=self.rows,
            feature_names=[self.name],
            data_type=DataType(self.dtype.upper()),
        )


def parse_constraint(text: str) -> Tuple[str, str]:
    """``TABLE=SHARDING`` (``--constrain``) as ``(table, sharding)``."""
    table, sep, sharding = text.partition("=")
    if not sep or not table.strip():
        raise TableFileError(f"--constrain must be TABLE=SHARDING, got {text!r}")
    if sharding not in SHARDING_TYPES:
        raise TableFileError(
            f"--constrain {text}: the sharding must be one of {', '.join(SHARDING_TYPES)}"
        )
    return table.strip(), sharding


def _read_text(path: Path) -> str:
    """The text of ``path``: a plain file (no link, device or FIFO) of at most
    :data:`MAX_TABLE_FILE_BYTES`, UTF-8, opened once (:func:`~torchrec_cowclip.readback.read_bytes`)."""
    try:
        data = read_bytes(path, MAX_TABLE_FILE_BYTES)
    except RefusedFileError as e:
        raise TableFileError(str(e)) from None
    except OSError as e:
        raise TableFileError(f"{path}: unreadable ({e.strerror or e})") from None
    try:
        return data.decode("utf-8-sig")  # a spreadsheet's BOM is no field name
    except UnicodeDecodeError:
        raise TableFileError(f"{path}: not UTF-8 text") from None


def _entries(path: Path, text: str) -> Tuple[List[Any], str]:
    """The file's table entries and how each is named in a refusal (``table N`` or
    ``line N``)."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        header = reader.fieldnames or []
        if not header:
            raise TableFileError(f"{path}: empty; the first line names the columns")
        rows: List[Any] = []
        for row in reader:
            if None in row:
                raise TableFileError(
                    f"{path}, line {reader.line_num}: more fields than the header's {len(header)}"
                )
            rows.append({k.strip(): _csv_value(k.strip(), v) for k, v in row.items()})
        return rows, "line"
    try:
        if suffix == ".json":
            document: Any = parse_json(path, text)  # bounded depth, each key once
        else:
            import yaml  # PyYAML: torchx's dependency; safe_load builds plain values only

            document = yaml.safe_load(text)
    except ImportError:
        raise TableFileError(
            f"{path}: YAML needs PyYAML (torchx's dependency), not installed: give .json or .csv"
        ) from None
    except RefusedFileError as e:
        raise TableFileError(str(e)) from None
    except Exception as e:  # yaml's YAMLError
        kind = "JSON" if suffix == ".json" else "YAML"
        raise TableFileError(f"{path}: not {kind} ({_first_line(e)})") from None
    if isinstance(document, Mapping) and set(document) == {"tables"}:
        document = document["tables"]
    if not isinstance(document, list):
        raise TableFileError(
            f'{path}: a list of tables (or an object with one key, "tables") is needed'
        )
    return document, "table"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _csv_value(field: str, value: Optional[str]) -> Any:
    """A CSV cell as the JSON value it stands for: numbers for rows, dim and pooling
    factor (left as text when they are not, for the check to name), None when empty."""
    text = (value or "").strip()
    if not text:
        return None
    if field in ("rows", "dim"):
        return int(text) if text.lstrip("-").isdigit() else text
    if field == "pooling_factor":
        try:
            return float(text)
        except ValueError:
            return text
    return text


def read_table_file(path: Path) -> List[TableSpec]:
    """The tables ``path`` (``.json``, ``.yaml``/``.yml`` or ``.csv``) lists, in its order.

    Raises:
        TableFileError: one line naming the file, the table (or line) and the field.
    """
    path = Path(path)
    if path.suffix.lower() not in TABLE_FILE_SUFFIXES:
        raise TableFileError(
            f"{path}: a table list is a {', '.join(TABLE_FILE_SUFFIXES)} file (or give a "
            "preset: criteo-kaggle, criteo-1tb)"
        )
    entries, unit = _entries(path, _read_text(path))
    if not entries:
        raise TableFileError(f"{path}: no tables")
    # CSV rows are numbered as lines (the header is line 1); JSON/YAML tables from 1.
    first = 2 if unit == "line" else 1
    tables = [
        TableSpec.from_mapping(e, f"{path}, {unit} {i}") for i, e in enumerate(entries, first)
    ]
    check_names(tables, str(path))
    return tables


def check_names(tables: Sequence[TableSpec], where: str) -> None:
    """Refuses two tables of one name (a table is planned, and constrained, by name)."""
    seen: Dict[str, int] = {}
    for i, t in enumerate(tables):
        if t.name in seen:
            raise TableFileError(f"{where}: two tables named {t.name!r}")
        seen[t.name] = i

"""Time columns as time: a timestamp becomes its hour of day and day of week.

A click log's timestamp enters a model badly as a number: its values grow by the hour, so
under ``signed-log`` they are nearly constant and under ``standardize`` a linear trend that
next week's rows sit far outside of. What drives clicks is the cycle: the hour of day and
the day of week (Avazu's ``hour`` column is split so). A column declared a time column
(``--time-columns ts``) is read as a timestamp and becomes two categorical features,
``ts_hour`` (``0``-``23``) and ``ts_weekday`` (``0`` Monday - ``6`` Sunday), in UTC.

A value is read as:

* a number: Unix seconds, or milliseconds when its magnitude is 1e11 or more (1e11
  seconds is the year 5138; milliseconds reach 1e11 in 1973);
* text: an ISO 8601 date or date-time (``2024-05-03``, ``2024-05-03 14:05:00``,
  ``2024-05-03T14:05:00``), as numpy's ``datetime64`` reads it; a trailing ``Z`` is UTC;
* a parquet timestamp or date column: as it is (its instant in UTC).

An empty field (or one of ``--na-values``) is missing: both parts take the missing id.
Anything else is a bad row (``bad timestamp``), refused or skipped as ``--on-bad-row``
says.

With ``--time-trend`` (never by default) each time column also becomes a dense feature,
``ts_days``: the timestamp in days (Unix seconds / 86400), which the dense plan scales
with the training split's minimum and range (``minmax``): the time since the training
split's start, 0 there and 1 at its end. Rows after the training split's end (next
week's) lie outside the training range by construction, and scoring says so.

Example::

    >>> raw = np.array([b"1714744800", b"1714744800000", b"2024-05-03 14:00", b"", b"noon"])
    >>> (hour, weekday), bad = time_parts(raw)
    >>> hour.tolist(), weekday.tolist(), bad.tolist()
    ([b'14', b'14', b'14', b'', b''], [b'4', b'4', b'4', b'', b''], [False, False, False, False, True])
    >>> time_feature_names(["ts"]), trend_feature_names(["ts"])
    (['ts_hour', 'ts_weekday'], ['ts_days'])
    >>> days_of_seconds(np.array([86400.0 * 19846.5, np.nan])).tolist()
    [19846.5, nan]
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

from torchrec_cowclip.data.parsing.fields import parse_numeric

#: The categorical features a time column becomes, by suffix.
TIME_PARTS = ("hour", "weekday")
#: A number at least this large is Unix milliseconds (see the module docstring).
MILLISECONDS_FROM = 1e11
DAY_S = 86400
HOUR_S = 3600
#: 1970-01-01 was a Thursday: day 0 is weekday 3 (Monday 0).
EPOCH_WEEKDAY = 3
_HOURS = np.array([str(h).encode() for h in range(24)], dtype="S2")
_WEEKDAYS = np.array([str(d).encode() for d in range(7)], dtype="S1")


#: The dense feature a time column's trend becomes (``--time-trend``), by suffix.
TREND_SUFFIX = "days"
#: The dense transform of a trend feature: the training split's start and span.
TREND_TRANSFORM = "minmax"


def time_feature_names(columns: Sequence[str]) -> List[str]:
    """The categorical features of the time ``columns``, in block order."""
    return [f"{c}_{part}" for c in columns for part in TIME_PARTS]


def trend_feature_names(columns: Sequence[str]) -> List[str]:
    """The dense trend features of the time ``columns`` (``--time-trend``), after the
    other dense columns."""
    return [f"{c}_{TREND_SUFFIX}" for c in columns]


def days_of_seconds(seconds: np.ndarray) -> np.ndarray:
    """The trend's raw value: Unix seconds in days (float64; NaN stays missing)."""
    return np.asarray(seconds, dtype=np.float64) / DAY_S


def parts_of_seconds(seconds: np.ndarray) -> Tuple[List[np.ndarray], np.ndarray]:
    """``([hour, weekday], missing)`` of Unix seconds (NaN: missing, both parts ``b""``)."""
    missing = np.isnan(seconds)
    whole = np.floor(np.where(missing, 0.0, seconds)).astype(np.int64)
    hour = _HOURS[(whole // HOUR_S) % 24].astype("S2")
    weekday = _WEEKDAYS[(whole // DAY_S + EPOCH_WEEKDAY) % 7].astype("S2")
    hour[missing] = b""
    weekday[missing] = b""
    return [hour, weekday], missing


def seconds_of_numbers(values: np.ndarray) -> np.ndarray:
    """Unix seconds of float64 timestamps: seconds, or milliseconds from
    :data:`MILLISECONDS_FROM` on (NaN stays NaN)."""
    return np.where(np.abs(values) >= MILLISECONDS_FROM, values / 1000.0, values)


def seconds_of_text(raw: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Unix seconds (NaN: missing) of an ``S`` array of fields, and the bad-value mask."""
    values, bad = parse_numeric(raw)
    values = seconds_of_numbers(values)
    if bad.any():
        texts, inverse = np.unique(raw[bad], return_inverse=True)
        parsed = np.array([_iso_seconds(t) for t in texts.tolist()], dtype=np.float64)
        values[bad] = parsed[inverse]
        bad[bad] = np.isnan(parsed[inverse])
    return values, bad


def _iso_seconds(text: bytes) -> float:
    s = text.decode("utf-8", "replace").strip()
    if s.endswith("Z"):
        s = s[:-1]
    try:
        return float(np.datetime64(s, "s").astype(np.int64))
    except ValueError:
        return float("nan")


def time_parts(raw: np.ndarray) -> Tuple[List[np.ndarray], np.ndarray]:
    """``([hour, weekday], bad)`` of one time column's fields (an ``S`` array; ``b""``
    missing): the parts as text, ``b""`` where missing or bad."""
    parts, _, bad = time_features(raw)
    return parts, bad


def time_features(raw: np.ndarray) -> Tuple[List[np.ndarray], np.ndarray, np.ndarray]:
    """``([hour, weekday], days, bad)`` of one time column's fields: :func:`time_parts`
    and the trend's raw value (:func:`days_of_seconds`; NaN where missing or bad)."""
    seconds, bad = seconds_of_text(raw)
    seconds = np.where(bad, np.nan, seconds)
    parts, _ = parts_of_seconds(seconds)
    return parts, days_of_seconds(seconds), bad


def seconds_of_arrow(pa: Any, col: Any) -> np.ndarray | None:
    """Unix seconds (NaN: null) of a parquet timestamp or date column, else None (the
    column is read as text or numbers: :func:`time_parts`)."""
    if pa.types.is_timestamp(col.type) or pa.types.is_date(col.type):
        values = np.asarray(
            pa.compute.cast(col, pa.timestamp("ms"))
            .cast(pa.int64())
            .to_numpy(zero_copy_only=False),
            dtype=np.float64,
        )
        return values / 1000.0
    return None

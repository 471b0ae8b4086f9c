"""What a checkpoint was trained with, and the check that ``--resume`` continues the
same run.

A checkpoint carries a *run record*: the run's settings with every recipe default
resolved (so ``--lr 8e-4`` and the recipe's 8e-4 are the same setting) and a fingerprint
of its data (source spec, data options, row count and binary-cache entry). On
``--resume`` the record of the new command must match, except for the settings a resume
may change (their declarations say which: :class:`Setting`); every other difference is named with both values in one
:class:`ResumeRefused` line, raised before any state is loaded or written.

Example::

    >>> data = {"rows": 30000, "cache_entry": "synthetic-5f1c"}
    >>> saved = {"settings": {"batch_size": 1024, "seed": 0, "epochs": 2}, "data": data}
    >>> now = {"settings": {"batch_size": 2048, "seed": 1, "epochs": 3}, "data": data}
    >>> names = {"seed": Setting("--seed"), "epochs": Setting("--epochs", resumable=True)}
    >>> resume_differences(saved, now, names)  # more --epochs is allowed
    [('--batch-size', '1024', '2048'), ('--seed', '0', '1')]
    >>> check_resume({"run_record": saved}, now, "runs/x", names)
    Traceback (most recent call last):
    ...
    torchrec_cowclip.run.resume_guard.ResumeRefused: --resume refused: the checkpoint in runs/x was trained with --batch-size 1024, this command has 2048; --seed 0 vs 1
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

from torchrec_cowclip.data.pipeline.cache import DIGEST_MEMO, changed_sources
from torchrec_cowclip.failures import ConfigError


class Setting(NamedTuple):
    """What the guard knows of a setting, from its option's declaration (the caller's
    map, ``train.config.RECORDED_SETTINGS``): how a message names it, its ``flag``
    (``--dist-timeout`` for ``dist_timeout_s``, ``CowClip (--no-cowclip)``); whether its
    values read on/off (a switch that is on by default); whether a resumed run may change
    it (``resumable``: it changes no number the run produces, see ``Option.resumable``)."""

    flag: str
    on_off: bool = False
    resumable: bool = False


#: Setting -> what the guard knows of it (a setting not in it: named ``--`` and its name
#: with dashes, and compared).
Settings = Mapping[str, Setting]


def _resumable(field: str, settings: Settings) -> bool:
    known = settings.get(field)
    return known is not None and known.resumable


class ResumeRefused(ConfigError):
    """``--resume`` with settings or data that differ from the checkpoint's."""


def run_record(
    settings: Mapping[str, Any],
    data: Mapping[str, Any],
    sources: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """The record a checkpoint keeps of its run: ``{"settings", "data", "sources"}``,
    plain JSON types only (so it loads without unpickling classes).

    Args:
        settings: the run's options with every recipe default resolved
            (``TrainSettings.record_settings``).
        data: what the run read: its source, options, row count and binary-cache entry
            (:meth:`DataSettings.record <torchrec_cowclip.data.settings.DataSettings.record>`).
        sources: each source file's stamp and SHA-256 as the run read them
            (:func:`~torchrec_cowclip.data.pipeline.cache.sources_seen`): a resume reads a
            file whose stamp changed again (:func:`check_sources`), not fingerprinted.
    """
    return {"settings": dict(settings), "data": dict(data), "sources": dict(sources or {})}


def run_fingerprint(record: Mapping[str, Any], names: Settings) -> str:
    """16 hex digits naming a run: a hash of its record without the settings a resume may
    change (``names``' resumable ones), so every checkpoint of one run carries the same
    fingerprint and another run's differs (checkpoint manifests record it).

    Example::

        >>> a = {"settings": {"seed": 0, "epochs": 1}, "data": {"rows": 3}}
        >>> b = {"settings": {"seed": 0, "epochs": 5}, "data": {"rows": 3}}
        >>> names = {"epochs": Setting("--epochs", resumable=True)}
        >>> run_fingerprint(a, names) == run_fingerprint(b, names), len(run_fingerprint(a, names))
        (True, 16)
    """
    settings = {k: v for k, v in record["settings"].items() if not _resumable(k, names)}
    text = json.dumps({"settings": settings, "data": record["data"]}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def setting_flag(field: str, names: Settings) -> str:
    """How a message names the setting ``field`` (``batch_size`` -> ``--batch-size``)."""
    named = names.get(field)
    return named.flag if named is not None else "--" + field.replace("_", "-")


def shown_setting(field: str, value: Any, names: Settings) -> str:
    """A setting's value as a message shows it (an on-by-default switch as on/off, lists
    comma-joined)."""
    named = names.get(field)
    if named is not None and named.on_off:
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def resume_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], names: Settings
) -> List[Tuple[str, str, str]]:
    """``(setting, checkpoint's value, this command's value)`` for every difference
    between two run records that a resume may not make (``names``), in the
    config's field order, then the data's content; ``names``: how each setting is named."""
    old, new = saved["settings"], current["settings"]
    found: List[Tuple[str, str, str]] = []
    for field, value in new.items():
        if field not in old:
            continue  # a setting newer than the checkpoint: nothing recorded to compare
        if field == "epochs":
            if value < old[field]:  # a resumed run may only add epochs
                found.append(
                    (
                        setting_flag(field, names),
                        shown_setting(field, old[field], names),
                        f"{shown_setting(field, value, names)} (a resumed run may only add epochs)",
                    )
                )
            continue
        if not _resumable(field, names) and old[field] != value:
            found.append(
                (
                    setting_flag(field, names),
                    shown_setting(field, old[field], names),
                    shown_setting(field, value, names),
                )
            )
    old_data, new_data = saved["data"], current["data"]
    if (old_data["rows"], old_data["cache_entry"]) != (new_data["rows"], new_data["cache_entry"]):

        def content(d: Mapping[str, Any]) -> str:
            return f"{d['rows']} rows in cache entry {d['cache_entry']}"

        found.append(("--data content", content(old_data), content(new_data)))
    return found


def check_resume(
    checkpoint: Mapping[str, Any],
    current: Mapping[str, Any],
    out: Union[str, Path],
    names: Settings,
) -> None:
    """Raises :class:`ResumeRefused` naming each setting (with both values, ``names``
    naming it) in which the command ``current`` differs from the run that wrote
    ``checkpoint`` (a loaded checkpoint payload with its ``"run_record"``); ``out`` names
    the run directory."""
    saved = checkpoint.get("run_record")
    if saved is None:
        raise ResumeRefused(
            f"--resume refused: the checkpoint in {out} has no run record (written by an "
            "older version), so its settings cannot be checked; start anew with --overwrite"
        )
    diffs = resume_differences(saved, current, names)
    if not diffs:
        return
    (flag, old, new), rest = diffs[0], diffs[1:]
    message = f"--resume refused: the checkpoint in {out} was trained with {flag} {old}, this command has {new}"
    message += "".join(f"; {f} {o} vs {n}" for f, o, n in rest)
    raise ResumeRefused(message)


def check_sources(checkpoint: Mapping[str, Any], out: Union[str, Path]) -> None:
    """Raises :class:`ResumeRefused` where a source file the checkpoint's run read
    (its record's ``sources``) holds other bytes now, although the cache entry the data
    opened from says it does not (the cache directory's digest record edited since; an
    honest edit lands in a new entry, which :func:`check_resume` refuses first)."""
    recorded = (checkpoint.get("run_record") or {}).get("sources") or {}
    changed = changed_sources(recorded)
    if changed:
        path, old, new = changed[0]
        raise ResumeRefused(
            f"--resume refused: {path} is not the file the checkpoint in {out} was trained "
            f"on (SHA-256 {old[:16]}... then, {new[:16]}... now), though the cache's digest "
            f"record ({DIGEST_MEMO}) says it is: remove that record and the stale cache "
            "entry, or start anew with --overwrite"
        )


def resumed_message(
    global_step: int, epoch: int, batch_in_epoch: int, steps_per_epoch: int, path: Union[str, Path]
) -> str:
    """The line a resumed run logs at start (``epoch`` counts finished epochs, as in the
    trainer's progress; the message numbers epochs from 1)."""
    return (
        f"resumed from step {global_step} of epoch {epoch + 1} (batch {batch_in_epoch} of "
        f"{steps_per_epoch}) from {path}"
    )

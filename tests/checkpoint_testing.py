"""Helpers of the checkpoint tests: hostile payloads, and re-sealing a checkpoint whose
files a test changed (what an attacker who edits a checkpoint does to its manifest)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any, Dict

from torchrec_cowclip.readback import file_record
from torchrec_cowclip.run.checkpoints import MANIFEST


class CreatesAFile:
    """Unpickling this runs ``os.system("touch <path>")``: a real code-execution payload
    whose only effect, if it ever runs, is a file the test looks for."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def write_payload(target: Path, created: Path) -> None:
    """Replaces ``target`` with a pickle whose loading would create ``created``."""
    target.write_bytes(pickle.dumps({"progress": CreatesAFile(created)}, protocol=2))


def reseal(checkpoint: Path) -> None:
    """Rewrites the manifest's size and checksum of every file in ``checkpoint``, so the
    files pass verification whatever a test put in them."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"] = {
        p.name: file_record(p)
        for p in sorted(checkpoint.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def snapshot(directory: Path) -> Dict[str, str]:
    """Every file under ``directory`` with its content hash: what 'untouched' means."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }

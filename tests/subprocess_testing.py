"""Running a snippet in a fresh Python process (imports nothing of the package itself, so
the tests collected without torchrec can use it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional


def python_c(
    code: str, cwd: Path, env: Optional[Dict[str, str]] = None
) -> "subprocess.CompletedProcess[str]":
    """``python -c code`` in ``cwd`` (with ``env``, else this process's), its output kept."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )

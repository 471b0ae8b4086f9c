"""The wheels benchmarks/gpu.sh installs offline on a GPU machine that has torch (a CUDA
build) and Triton but not TorchRec: ``download`` fetches them with their whole dependency
closure (``pip download --no-deps`` one package at a time, following each wheel's
Requires-Dist for the GPU machine's Python and platform), leaving out torch, Triton, the
nvidia-*/cuda-* wheels and torch's own requirements, which the machine has; ``check``
installs a folder of them into an empty ``--target`` beside this interpreter's torch
alone (its other site-packages hidden), imports torchrec and fbgemm_gpu and collects the
``gpu``-marked tests - what gpu.sh will need, proven without a GPU.

Usage (benchmarks/gpu_wheels.sh wraps both)::

    python benchmarks/gpu_wheels.py download FOLDER --python 3.12 REQUIREMENT...
    python benchmarks/gpu_wheels.py check FOLDER
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, List, Set

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent

#: On the GPU machine already: torch and what it brings (its CUDA libraries, Triton and
#: its own requirements); carrying them could replace the machine's builds.
ON_THE_MACHINE = re.compile(
    r"^(torch|triton|nvidia-.*|cuda-.*|filelock|typing-extensions|setuptools|sympy|mpmath|"
    r"networkx|jinja2|markupsafe|fsspec)$"
)

#: Requirements another carried wheel satisfies: torchrec requires ``fbgemm-gpu``, the
#: CUDA build (about 500 MB); its CPU build provides the same module, which is all our
#: Triton path imports (FBGEMM's TBE baseline runs on CUDA when the machine has it).
PROVIDED = {"fbgemm-gpu": "fbgemm-gpu-cpu"}

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(wheel: Path, python: str) -> List[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
    environment = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": "",
    }
    wanted = []
    for line in message.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(environment):
            wanted.append(requirement)
    return wanted


def download(folder: Path, python: str, requirements: List[str]) -> None:
    """Downloads ``requirements`` and their closure into ``folder`` (one wheel each)."""
    folder.mkdir(parents=True, exist_ok=True)
    queue = [Requirement(r) for r in requirements]
    seen: Set[str] = set()
    while queue:
        requirement = queue.pop(0)
        name = _canonical(requirement.name)
        if name in seen or ON_THE_MACHINE.match(name) or PROVIDED.get(name) in seen:
            continue
        seen.add(name)
        before = set(folder.glob("*.whl"))
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        command += ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        subprocess.run(command + ["-d", str(folder), str(requirement)], check=True)
        found = [
            w
            for w in set(folder.glob("*.whl")) - before or folder.glob("*.whl")
            if _canonical(w.name.split("-")[0]) == name
        ]
        if not found:
            raise SystemExit(f"gpu_wheels: no wheel of {requirement} in {folder}")
        queue += _requirements(sorted(found)[-1], python)


def _torch_alone(into: Path) -> None:
    """Links this interpreter's torch and its requirements' distributions (nothing else
    of its site-packages) into ``into``: a plain torch, as on the GPU machine."""
    into.mkdir()
    names = ["torch"]
    done: Set[str] = set()
    while names:
        name = names.pop()
        if _canonical(name) in done:
            continue
        done.add(_canonical(name))
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        site = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = site / top
            if source.exists() and not (into / top).exists() and top != "__pycache__":
                (into / top).symlink_to(source)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                names.append(requirement.name)


def check(folder: Path) -> int:
    """Installs ``folder``'s wheels into an empty target beside torch alone; imports
    torchrec and fbgemm_gpu and collects ``pytest -m gpu`` there. 0 when all work."""
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    with tempfile.TemporaryDirectory() as scratch:
        target, torch_only = Path(scratch) / "target", Path(scratch) / "torch"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
            + ["--find-links", str(folder), "--target", str(target), *wheels],
            check=True,
        )
        _torch_alone(torch_only)
        path = os.pathsep.join([str(target), str(torch_only), str(HERE.parent)])
        probe = (
            "import sys; sys.path[:0] = sys.argv[1].split(':'); "
            "import torchrec, fbgemm_gpu; "
            "print('gpu_wheels check: torchrec', torchrec.__version__, 'fbgemm_gpu', "
            "fbgemm_gpu.__version__); "
            "import pytest; sys.exit(pytest.main(['--collect-only', '-q', '-m', 'gpu', "
            "'-p', 'no:cacheprovider', 'tests']))"
        )
        env: Dict[str, str] = {
            k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))
        }
        # -S -s: none of this interpreter's site-packages, only the target and torch.
        result = subprocess.run(
            [sys.executable, "-S", "-s", "-c", probe, path], cwd=HERE.parent, env=env
        )
        return result.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("download")
    get.add_argument("folder", type=Path)
    get.add_argument("--python", default="3.12")
    get.add_argument("requirements", nargs="+")
    test = sub.add_parser("check")
    test.add_argument("folder", type=Path)
    args = parser.parse_args()
    if args.command == "download":
        download(args.folder, args.python, args.requirements)
        return 0
    return check(args.folder)


if __name__ == "__main__":
    sys.exit(main())

"""The registry of update rules is complete whatever imports first: ``optim/rules.py``
builds the built-in rules from the functional core's row steps (rules imports functional,
never the reverse), and ``DEFAULT_OPTIONS`` is built after both."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

from subprocess_testing import python_c

REPO = Path(__file__).resolve().parents[1]

#: Each module of the core imported first, in a fresh set of ``torchrec_cowclip``
#: modules (torch stays loaded), then the package; the registry must be whole each time.
EVERY_MODULE_FIRST = textwrap.dedent("""
    import importlib, sys
    import torch

    ORDERS = [
        ["torchrec_cowclip.optim.functional"],
        ["torchrec_cowclip.optim.rules"],
        ["torchrec_cowclip.optim.options"],
        ["torchrec_cowclip.optim.row_step"],
        ["torchrec_cowclip.optim.in_backward"],
        ["torchrec_cowclip.optim.reference"],
        ["torchrec_cowclip.optim.options", "torchrec_cowclip.optim.functional"],
        ["torchrec_cowclip"],
    ]
    for order in ORDERS:
        for name in [m for m in sys.modules if m.split(".")[0] == "torchrec_cowclip"]:
            del sys.modules[name]
        for name in order:
            importlib.import_module(name)
        import torchrec_cowclip
        from torchrec_cowclip.optim.options import DEFAULT_OPTIONS
        from torchrec_cowclip.optim.rules import OPTIMIZERS, UPDATE_RULES
        assert tuple(OPTIMIZERS) == ("adam", "rowwise_adagrad", "sgd", "adagrad", "adamw"), (
            order,
            OPTIMIZERS,
        )
        assert DEFAULT_OPTIONS.rule is UPDATE_RULES["adam"], order
    print("ok", len(ORDERS))
""")


def _run(code: str, path: Path) -> str:
    run = python_c(code, path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(path)})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run.stdout.strip().splitlines()[-1]


def test_the_rule_registry_does_not_depend_on_import_order():
    assert _run(EVERY_MODULE_FIRST, REPO) == "ok 8"


def test_the_package_imports_with_its_optim_imports_in_reverse_order(tmp_path):
    """The issue's probe: the import lines of ``optim/__init__.py`` swapped (here:
    reversed) in a copy of the package, which must still import and train-configure."""
    shutil.copytree(
        REPO / "torchrec_cowclip",
        tmp_path / "torchrec_cowclip",
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    init = tmp_path / "torchrec_cowclip" / "optim" / "__init__.py"
    lines = init.read_text().splitlines()
    imports = [i for i, line in enumerate(lines) if line.startswith("from torchrec_cowclip.")]
    assert len(imports) >= 4
    reordered = [lines[i] for i in reversed(imports)]
    for i, line in zip(imports, reordered):
        lines[i] = line
    init.write_text("\n".join(lines) + "\n")
    code = (
        "import torchrec_cowclip\n"
        "from torchrec_cowclip import CowClipOptions\n"
        "print(CowClipOptions(optimizer='sgd').rule.name)\n"
    )
    assert _run(code, tmp_path) == "sgd"

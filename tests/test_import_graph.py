"""The package has no import cycle, not even one hidden under ``TYPE_CHECKING`` or in a
function-local import (a deferred import that only breaks a cycle still is one); its
parts import only downward (:data:`LAYERS`: nothing below ``run/`` imports ``train/``,
nothing below the commands imports them); and nothing imports the command line
(``torchrec_cowclip.cli``) but ``python -m torchrec_cowclip``.

The graph is read from the source with ``ast``: every ``import torchrec_cowclip...``
and ``from ... import ...`` (absolute or relative) anywhere in a module is an edge, and
importing ``a.b.c`` also runs package ``a.b``'s ``__init__`` (an edge to it, unless
``a.b`` contains the importing module: its ``__init__`` is already running, and
``from a.b import submodule`` needs no more of it; ``from a.b import name`` does).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

PACKAGE = "torchrec_cowclip"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE


def _module_names(package_dir: Path) -> Dict[str, Path]:
    """Dotted module name -> file, packages named by their ``__init__.py``."""
    modules: Dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The package's modules that module ``name`` (at ``path``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    edges: Set[str] = set()

    def runs(module: str) -> None:
        # Importing a.b.c runs a, a.b (those not already running: ours) and a.b.c.
        parts = module.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts))]
        edges.update(p for p in prefixes if p not in own_packages)
        edges.add(module)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                runs(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    runs(f"{source}.{alias.name}")  # `from pkg import module`
                else:
                    # A name defined by `source`: it must have run to the end, even
                    # when it is a package of ours that is still running.
                    runs(source)
                    edges.add(source)
    return {m for m in edges if m in known and m != name}


def import_graph(package_dir: Path) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (see the module docstring)."""
    modules = _module_names(package_dir)
    return {name: _imported(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle ``[a, b, ..., a]`` of ``graph``, or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


#: The package's parts from the ground up: a module may import its own part and the parts
#: of lower layers, never a part of its own layer or above (``<root>`` is the package's
#: ``__init__``, whose public names load the serving API on first use).
LAYERS = (
    ("_lazy", "_version", "compat", "failures", "cli_help", "stderr_log"),
    ("readback", "process_context"),
    ("notices", "data", "optim"),
    ("embedding",),
    ("distributed", "models"),
    ("run",),
    ("train",),
    ("serve", "sweep", "plan"),
    ("cli", "<root>"),
    ("__main__",),
)


def _part(module: str) -> str:
    """``torchrec_cowclip.run.checkpoints`` -> ``run``; the package itself -> ``<root>``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """``a -> b`` for every import of ``graph`` into a part of the same or a higher layer
    of :data:`LAYERS` (a part missing from them is reported too)."""
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    found = []
    for module, imported in sorted(graph.items()):
        if _part(module) not in layer:
            found.append(f"{module}: its part {_part(module)!r} is in no layer")
            continue
        for target in sorted(imported):
            a, b = _part(module), _part(target)
            if a != b and layer.get(b, len(LAYERS)) >= layer[a]:
                found.append(f"{module} -> {target}")
    return found


def test_the_parts_import_only_downward():
    graph = import_graph(PACKAGE_DIR)
    assert upward_imports(graph) == []
    # run/ holds what a run leaves on disk and knows nothing of the loop above it.
    assert not any(
        t.startswith(f"{PACKAGE}.train")
        for m, targets in graph.items()
        if _part(m) in ("run", "distributed", "models", "embedding", "optim", "data")
        for t in targets
    )


def test_nothing_imports_the_command_line():
    graph = import_graph(PACKAGE_DIR)
    importers = sorted(m for m, targets in graph.items() if f"{PACKAGE}.cli" in targets)
    assert importers == [f"{PACKAGE}.__main__"]


def test_an_upward_import_is_found(tmp_path):
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "run/__init__.py": "",
            "train/__init__.py": "",
            "run/x.py": "def f():\n    from torchrec_cowclip.train import y\n",
            "train/y.py": "from torchrec_cowclip.run import x\n",
            "cli.py": "",
            "elsewhere/z.py": "",
        },
    )
    assert upward_imports(import_graph(package)) == [
        f"{PACKAGE}.elsewhere.z: its part 'elsewhere' is in no layer",
        f"{PACKAGE}.run.x -> {PACKAGE}.train",
        f"{PACKAGE}.run.x -> {PACKAGE}.train.y",
    ]


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) > 50 and f"{PACKAGE}.embedding.collection" in graph
    assert f"{PACKAGE}.embedding.layout" in graph[f"{PACKAGE}.distributed.sharded_kernel"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _write(root: Path, files: Dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / PACKAGE / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / PACKAGE


BASE = {"__init__.py": "", "a/__init__.py": "", "b/__init__.py": ""}


def test_a_cycle_hidden_under_type_checking_is_found(tmp_path):
    package = _write(
        tmp_path,
        {
            **BASE,
            "a/x.py": "from torchrec_cowclip.b.y import Y\n",
            "b/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from torchrec_cowclip.a.x import X\n",
        },
    )
    assert find_cycle(import_graph(package)) == [
        f"{PACKAGE}.a.x",
        f"{PACKAGE}.b.y",
        f"{PACKAGE}.a.x",
    ]


def test_a_cycle_through_a_function_local_relative_import_is_found(tmp_path):
    package = _write(
        tmp_path,
        {
            **BASE,
            "a/x.py": "def f():\n    from ..b import y\n",
            "b/y.py": "from . import z\n",
            "b/z.py": "import torchrec_cowclip.a.x\n",
        },
    )
    cycle = find_cycle(import_graph(package))
    assert cycle is not None and set(cycle) == {
        f"{PACKAGE}.a.x",
        f"{PACKAGE}.b.y",
        f"{PACKAGE}.b.z",
    }


def test_a_name_from_a_running_package_init_is_a_cycle_a_submodule_is_not(tmp_path):
    files = {**BASE, "a/__init__.py": "from torchrec_cowclip.a.x import X\n"}
    package = _write(
        tmp_path, {**files, "a/x.py": "from torchrec_cowclip.a import y\nX = 1\n", "a/y.py": ""}
    )
    assert find_cycle(import_graph(package)) is None
    package = _write(tmp_path, {**files, "a/x.py": "from torchrec_cowclip.a import Z\nX = 1\n"})
    assert find_cycle(import_graph(package)) == [f"{PACKAGE}.a", f"{PACKAGE}.a.x", f"{PACKAGE}.a"]


def test_a_cycle_through_a_package_init_is_found_and_none_without_it(tmp_path):
    files = {**BASE, "a/x.py": "from torchrec_cowclip.b.y import Y\n", "b/y.py": "Y = 1\n"}
    # Importing b.y runs b/__init__.py, which imports a.x.
    package = _write(tmp_path, {**files, "b/__init__.py": "from torchrec_cowclip.a.x import *\n"})
    assert find_cycle(import_graph(package)) == [f"{PACKAGE}.a.x", f"{PACKAGE}.b", f"{PACKAGE}.a.x"]
    package = _write(tmp_path, {**files, "b/__init__.py": ""})
    assert find_cycle(import_graph(package)) is None

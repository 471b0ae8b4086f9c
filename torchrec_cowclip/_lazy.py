"""Names a package exports but imports on first use (PEP 562 module ``__getattr__``).

The package's members built on torchrec types load this way, so that its torch-only core
(``optim.functional``, ``optim.reference``, ``optim.row_step``) imports on a machine
without torchrec or fbgemm_gpu.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Mapping, Tuple


def lazy_exports(
    package: str, names: Mapping[str, str], namespace: Dict[str, Any]
) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """The ``(__getattr__, __dir__)`` pair of ``package``: ``names`` maps each lazy
    public name to the module that defines it; ``namespace`` is the package's
    ``globals()``. A loaded name is cached in ``namespace``, so it is imported once."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__

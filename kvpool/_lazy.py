"""Names a module exports without importing them until first use (PEP 562 ``__getattr__`` and ``__dir__``),
so that ``import kvpool`` stays cheap and pulls in no optional dependency, while ``dir()``, tab completion
and ``from kvpool import *`` still see every exported name. Imports only the standard library."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(module: str, table: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``module``, whose names in ``table`` (name -> the module defining it)
    are imported on first use: ``__getattr__`` imports the defining module and returns the name (an unknown
    name is an ``AttributeError``, as for any module), ``__dir__`` lists the module's own names and the
    table's."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(table))

    return __getattr__, __dir__

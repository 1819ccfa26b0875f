"""Names a module exports without importing them until first use (PEP 562 ``__getattr__`` and ``__dir__``),
so that ``import kvpool`` stays cheap and pulls in no optional dependency, while ``dir()``, tab completion
and ``from kvpool import *`` still see every exported name. Imports only the standard library."""

from __future__ import annotations

import importlib
import sys
import warnings
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


def lazy_values(module: str, table: Mapping[str, Callable[[], Any]]) -> Callable[[str], Any]:
    """``__getattr__`` for ``module``, whose constants in ``table`` (name -> a function making the value,
    called on each read; cache it there) are made on first use, e.g. tables of torch dtypes, so that
    importing ``module`` imports no torch. Any other name is an ``AttributeError``, as for any module."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return table[name]()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def moved_module(module: str, new: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a deprecated module ``module`` whose contents moved to ``new``: every
    name is ``new``'s (imported on first use), and reading one warns with a ``DeprecationWarning`` that
    names the new import path, at the caller's line."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # import machinery and tools probing the module (__path__, __wrapped__)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module} moved to {new}: import {name} from {new}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(dir(importlib.import_module(new))))

    return __getattr__, __dir__

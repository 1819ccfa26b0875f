"""Stand-ins for packages a peer imports at module load but the CPU benchmark never calls (Triton, for
SGLang's CUDA kernels): ``stub_modules("triton")`` makes ``import triton`` and ``import triton.language``
give modules whose every attribute is :class:`Anything` (a decorator, a class, a constant: whatever the
importing code does with it at definition time)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _AnythingMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __or__(cls, other: object) -> type:  # ``tl.constexpr | None`` in annotations
        return cls

    __ror__ = __or__


class Anything(metaclass=_AnythingMeta):
    """Callable, subscriptable, any attribute: ``triton.jit(fn)``, ``@triton.autotune(...)``, ``tl.int32``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args = args

    def __call__(self, *args: object, **kwargs: object) -> object:
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else Anything()

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()

    def __getitem__(self, key: object) -> object:
        return Anything()


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - importlib's signature
        if name.partition(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001, ANN201
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001
        return None


def stub_modules(*roots: str) -> None:
    """Serve ``roots`` (and their submodules) from stand-ins, ahead of anything installed."""
    sys.meta_path.insert(0, _Finder(set(roots)))

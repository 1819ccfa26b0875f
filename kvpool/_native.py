"""Which of kvpool's hot modules run compiled and which interpreted, decided once, when kvpool is imported.

The modules of :data:`COMPILED_MODULES` are ordinary typed Python, the one source of truth. ``setup.py``
compiles them with mypyc at install time (``pip install -e .``, ``scripts/setup.sh``) into extension
modules beside the sources, plus ``kvpool._native_manifest``: the SHA-256 of every source it compiled, built
into the same shared library as the compiled code (so the digests cannot drift from the code they describe).

CPython prefers an extension module over a ``.py`` of the same name in one folder, so the choice is made by
an import hook, not by the file layout: :func:`activate` (run by ``kvpool/__init__.py``, before any
submodule is imported) puts a finder at the head of ``sys.meta_path`` that loads the ``.py`` source of every
kvpool module whose extension must not run. The compiled modules run only when all of these hold:

* ``KVPOOL_PURE_PYTHON`` is unset or ``0`` (``KVPOOL_PURE_PYTHON=1`` forces the interpreted code);
* the manifest imports from this package folder (a build finished here, for this Python; a manifest an
  import hook finds in another tree, such as an editable install's, is not this tree's build);
* every source it lists still has the digest it was compiled from, and every listed module has its
  extension. Otherwise the interpreted code runs for all of them (never a mix of two builds) and a
  ``RuntimeWarning`` says which source changed: a compiled module built from an older source is never used.

An extension whose module is not in the manifest (left over from an older build) is never used either.
:func:`status` tells which case holds (``kvpool --version`` prints it). This module imports only the
standard library: it runs before everything else.

The compiled modules get their sources' docstrings and ``__init__`` signatures back as they are imported
(:mod:`kvpool._native_docs`).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from kvpool._native_docs import copy_docstrings, copy_init_signatures

#: The modules setup.py compiles (read there with ``ast``, without importing kvpool).
COMPILED_MODULES = (
    "kvpool.events.buffer",
    "kvpool.allocators.arrays",
    "kvpool.allocators.prefix_index",
    "kvpool.spec.kinds",
    "kvpool.allocators.policy_base",
    "kvpool.allocators.policies",
    "kvpool.allocators.arc",
    "kvpool.allocators.block_lists",
    "kvpool.allocators.queue_policies",
    "kvpool.allocators.prefix_policies",
    "kvpool.allocators.pool_core",
    "kvpool.allocators.pool_alloc",
    "kvpool.allocators.pool_prefix",
    "kvpool.allocators.block_pool",
    "kvpool.allocators.group_tables",
    "kvpool.allocators.groups",
    "kvpool.allocators.token",
    "kvpool.allocators.partial_index",
)
#: Set to 1 (or true / yes) to run the interpreted code even where compiled modules exist.
PURE_ENV = "KVPOOL_PURE_PYTHON"
MANIFEST = "kvpool._native_manifest"
PACKAGE_DIR = Path(__file__).resolve().parent

_state: dict[str, object] = {}


class _DocLoader(importlib.abc.Loader):
    """The extension loader of a compiled module, which then gives it, and every other compiled module its
    code imported meanwhile, their sources' docstrings and ``__init__`` signatures (mypyc imports a module
    of the same build itself, past the import system's finders)."""

    def __init__(self, loader: importlib.abc.Loader, names: frozenset[str]) -> None:
        self.loader, self.names = loader, names

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for name in sorted(self.names - _DOCUMENTED):
            loaded = sys.modules.get(name)
            if loaded is not None and is_compiled(loaded):
                _DOCUMENTED.add(name)
                copy_docstrings(loaded, module_source(name))
                copy_init_signatures(loaded, module_source(name))


#: Compiled modules whose docstrings and signatures were copied from their sources.
_DOCUMENTED: set[str] = set()


class _DocFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules as the path search does, with a :class:`_DocLoader`."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            spec.loader = _DocLoader(spec.loader, self.names)
        return spec


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Loads the ``.py`` source of the named modules, ahead of the extension that shadows it."""

    def __init__(self, sources: dict[str, Path]) -> None:
        self.sources = sources

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        source = self.sources.get(fullname)
        return None if source is None else importlib.util.spec_from_file_location(fullname, source)


def pure_requested(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether ``KVPOOL_PURE_PYTHON`` asks for the interpreted code (anything but unset, '', '0', 'false',
    'no')."""
    return environ.get(PURE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def source_digest(path: Path) -> str:
    """SHA-256 (hex) of a source file's bytes: what the manifest records for it."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def module_source(name: str) -> Path:
    """The ``.py`` file of kvpool module ``name`` (``kvpool.allocators.token``: ``allocators/token.py``)."""
    return PACKAGE_DIR.joinpath(*name.split(".")[1:]).with_suffix(".py")


def _extensions() -> dict[str, Path]:
    """kvpool modules with an extension file beside a ``.py`` of the same name: module -> the ``.py``."""
    found: dict[str, Path] = {}
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for folder, _dirs, files in os.walk(PACKAGE_DIR):
        names = set(files)
        for file in files:
            if file.endswith(suffixes):
                stem = file.split(".", 1)[0]
                if f"{stem}.py" in names:
                    rel = Path(folder, stem).relative_to(PACKAGE_DIR)
                    found[".".join(("kvpool", *rel.parts))] = Path(folder, f"{stem}.py")
    return found


def _load_manifest() -> dict[str, str] | None:
    try:
        manifest = importlib.import_module(MANIFEST)
    except ImportError:  # no build here (or one for another Python): nothing compiled can run
        return None
    if not is_compiled(manifest):  # the generated source, seen mid-build: only the build's own counts
        return None
    if Path(manifest.__file__).resolve().parent != PACKAGE_DIR:
        # another tree's build, found by a finder after the path search (an editable install's: setuptools
        # maps every kvpool.* name to the installed tree): it says nothing about the sources here
        return None
    return dict(manifest.SOURCES)


def _stale(sources: dict[str, str], shadowing: dict[str, Path]) -> str | None:
    """Why the build cannot run (a changed source, a missing extension), or None."""
    for name, digest in sources.items():
        path = module_source(name)
        if name not in shadowing:
            return f"{name} has no compiled module"
        if path.exists() and source_digest(path) != digest:
            return f"{path.relative_to(PACKAGE_DIR.parent)} changed since it was compiled"
    return None


def activate() -> None:
    """Decide compiled or interpreted once per process and install the finder (idempotent)."""
    if _state:
        return
    shadowing = _extensions()
    compiled: tuple[str, ...] = ()
    if pure_requested():
        reason = f"{PURE_ENV}=1"
    else:
        sources = _load_manifest()
        if sources is None:
            reason = "not compiled (no build for this Python here)"
        elif (stale := _stale(sources, shadowing)) is not None:
            reason = f"stale compiled modules ({stale}): rebuild with `pip install -e .`"
            warnings.warn(f"kvpool: {reason}; running the interpreted code", RuntimeWarning, stacklevel=3)
        else:
            compiled, reason = tuple(sorted(sources)), "mypyc"
    interpreted = {name: path for name, path in shadowing.items() if name not in compiled}
    if interpreted:
        sys.meta_path.insert(0, _SourceFinder(interpreted))
    if compiled:
        sys.meta_path.insert(0, _DocFinder(compiled))
    _state.update(compiled=compiled, reason=reason)


def status() -> dict[str, object]:
    """``{"compiled": bool, "modules": [compiled module names], "reason": str}``: how this process runs."""
    activate()
    modules = list(_state["compiled"])  # type: ignore[call-overload]
    return {"compiled": bool(modules), "modules": modules, "reason": _state["reason"]}


def describe() -> str:
    """One line for people: ``compiled (mypyc): 2 modules`` or ``interpreted (KVPOOL_PURE_PYTHON=1)``."""
    s = status()
    if s["compiled"]:
        return f"compiled ({s['reason']}): {len(s['modules'])} modules"  # type: ignore[arg-type]
    return f"interpreted ({s['reason']})"


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from an extension (not from its ``.py``)."""
    return not str(getattr(module, "__file__", "") or "").endswith(".py")


def interpreted(name: str, bases: Sequence[str] = ()) -> ModuleType:
    """An interpreted copy of kvpool module ``name``, run from its source as ``name + "__interpreted"``
    (cached), for benchmarks that time both ways in one process. Its own imports resolve as usual (compiled
    where this process runs compiled), but for ``bases``: the compiled modules whose classes ``name``'s
    classes derive from, each outermost first (an interpreted class cannot derive from a compiled one):
    their interpreted copies stand in for them while ``name``'s source runs."""
    alias = f"{name}__interpreted"
    if alias in sys.modules:
        return sys.modules[alias]
    saved = {base: sys.modules.get(base) for base in bases}
    try:
        for i, base in enumerate(bases):  # each base's source may import the ones before it
            sys.modules[base] = interpreted(base, bases[:i])
        spec = importlib.util.spec_from_file_location(alias, module_source(name))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    finally:
        for base, original in saved.items():
            if original is None:
                sys.modules.pop(base, None)
            else:
                sys.modules[base] = original
    return module

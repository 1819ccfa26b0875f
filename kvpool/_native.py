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

mypyc keeps no docstring: a compiled class's ``__doc__`` is empty and a compiled method's is None (its C
doc string holds only the text signature). So each compiled module, as it is imported, gets the
docstrings of its own source back (:func:`copy_docstrings`, read with ``ast``, which the digests tie to
the build): the module's, each public class's, method's, property's and function's, at no cost per call
(the C method and property tables' doc pointers are re-pointed; nothing is wrapped). For IDEs and type
checkers the typed sources stay beside the extensions, and ``py.typed`` (PEP 561) says they are typed:
they read the compiled API, docstrings included, from the ``.py`` files (a ``.pyi`` would only repeat
them, and shadow them for mypy).

A compiled class's ``__init__`` is CPython's slot wrapper, whose signature is the generic ``(self, /,
*args, **kwargs)`` of every C type's ``__init__``; so each compiled class that defines ``__init__`` gets a
thin one with its source's signature, annotations included (:func:`copy_init_signatures`), which calls the
compiled one. ``inspect.signature(BlockPool.__init__)`` and ``inspect.signature(BlockPool)`` then read as
in the interpreted build. Interpreted code constructing such a class pays one Python call more (about a
microsecond, per pool, not per block); compiled code constructs it natively, as before. (mypyc's methods
keep their own text signatures: parameter names and defaults, no annotations.)
"""

from __future__ import annotations
import __future__

import ast
import ctypes
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

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
                copy_docstrings(loaded)
                copy_init_signatures(loaded)


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


# ---- docstrings of the compiled modules ------------------------------------------------------------------


def source_docstrings(path: Path) -> dict[str, str]:
    """``{qualified name: docstring}`` of a module's source, as the interpreter would set ``__doc__``:
    ``""`` for the module, ``"Class"``, ``"Class.method"``, ``"function"`` (top-level and class-body
    definitions; of a name defined twice, such as a property and its setter, the first)."""
    docs: dict[str, str] = {}
    clean = sys.version_info >= (3, 13)  # the compiler strips docstrings' indentation from 3.13 on
    pending: list[tuple[str, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]] = [
        ("", ast.parse(path.read_text(encoding="utf-8")))]
    while pending:
        name, node = pending.pop(0)
        doc = ast.get_docstring(node, clean=clean)
        if doc is not None:
            docs.setdefault(name, doc)
        if isinstance(node, (ast.Module, ast.ClassDef)):
            pending += [(f"{name}.{child.name}".lstrip("."), child) for child in node.body
                        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return docs


def copy_docstrings(module: ModuleType) -> int:
    """Give compiled ``module`` (and its classes, methods, properties and functions) the docstrings of
    its source (:func:`source_docstrings`) where theirs are missing; returns how many were set. Objects
    whose doc cannot be set (an unknown layout) keep theirs."""
    source = module_source(module.__name__)
    if not source.exists():
        return 0
    done = 0
    for qualname, doc in source_docstrings(source).items():
        owner, name = _owner(module, qualname)
        if owner is None:
            continue
        obj = module if not qualname else vars(owner).get(name)
        if obj is not None and getattr(obj, "__doc__", None) != doc:
            done += _set_doc(obj, doc)
    return done


def _owner(module: ModuleType, qualname: str) -> tuple[object | None, str]:
    """(the object holding ``qualname``'s last part, that part), or (None, "") when it is not there."""
    *path, name = qualname.split(".")
    owner: object = module
    for part in path:
        owner = vars(owner).get(part)
        if not isinstance(owner, type):
            return None, ""
    return owner, name


#: The C doc strings given to compiled methods and properties (kept alive: the tables point at them).
_DOC_BUFFERS: list[ctypes.Array[ctypes.c_char]] = []
_PTR = ctypes.sizeof(ctypes.c_void_p)
_HEAD = object.__basicsize__  # PyObject_HEAD


def _set_doc(obj: object, doc: str) -> int:
    """Set ``obj``'s docstring; 1 if it was set, else 0."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, (types.MethodDescriptorType, types.ClassMethodDescriptorType)):
        # PyMethodDescrObject: head, d_type, d_name, d_qualname, then PyMethodDef *d_method
        return _set_c_doc(id(obj) + _HEAD + 3 * _PTR, obj.__name__, 3, doc)  # type: ignore[attr-defined]
    if isinstance(obj, types.GetSetDescriptorType):  # PyGetSetDescrObject: the same, PyGetSetDef *d_getset
        return _set_c_doc(id(obj) + _HEAD + 3 * _PTR, obj.__name__, 3, doc, signature=False)
    if isinstance(obj, types.BuiltinFunctionType):  # PyCFunctionObject: head, then PyMethodDef *m_ml
        return _set_c_doc(id(obj) + _HEAD, obj.__name__, 3, doc)
    try:
        obj.__doc__ = doc  # classes (compiled ones too), functions, properties
    except (AttributeError, TypeError):
        return 0
    return 1


def _set_c_doc(table_field: int, name: str, doc_slot: int, doc: str, *, signature: bool = True) -> int:
    """Point the doc of the C table entry (PyMethodDef or PyGetSetDef: name at slot 0, doc at
    ``doc_slot``) whose address is stored at ``table_field`` at ``doc``, after the entry's text signature
    (``name(...)\n--\n\n``) when it has one; only when the entry's name is ``name`` (a layout check)."""
    entry = ctypes.c_void_p.from_address(table_field).value
    if not entry:
        return 0
    if ctypes.c_char_p.from_address(entry).value != name.encode():
        return 0
    slot = ctypes.c_char_p.from_address(entry + doc_slot * _PTR)
    old = slot.value or b""
    head = old[:old.index(b"\n--\n\n") + 5] if signature and b"\n--\n\n" in old else b""
    buffer = ctypes.create_string_buffer(head + doc.encode("utf-8"))
    _DOC_BUFFERS.append(buffer)
    ctypes.c_void_p.from_address(entry + doc_slot * _PTR).value = ctypes.addressof(buffer)
    return 1


# ---- __init__ signatures of the compiled classes -----------------------------------------------------------


def source_init_signatures(path: Path, namespace: dict[str, object]) -> dict[str, inspect.Signature]:
    """``{class name: signature of its __init__}`` for the top-level classes of a module's source that
    define ``__init__``, as the interpreter makes it: annotations as the source writes them (strings, under
    ``from __future__ import annotations``), defaults evaluated in ``namespace`` (the module's)."""
    out = {}
    for cls in ast.parse(path.read_text(encoding="utf-8")).body:
        init = next((f for f in getattr(cls, "body", ()) if isinstance(f, ast.FunctionDef)
                     and f.name == "__init__"), None) if isinstance(cls, ast.ClassDef) else None
        if init is None:
            continue
        stub = ast.FunctionDef(name="__init__", args=init.args, body=[ast.Pass()], decorator_list=[],
                               returns=init.returns, type_params=[])
        code = compile(ast.fix_missing_locations(ast.Module(body=[stub], type_ignores=[])), str(path), "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        scope = dict(namespace)
        exec(code, scope)  # a def of the source's own header (its digest is the build's), body ``pass``
        out[cls.name] = inspect.signature(scope["__init__"])  # type: ignore[arg-type]
    return out


def copy_init_signatures(module: ModuleType) -> int:
    """Give each class of compiled ``module`` whose ``__init__`` is mypyc's slot wrapper an ``__init__``
    with its source's signature that calls the compiled one; returns how many were given."""
    source = module_source(module.__name__)
    if not source.exists():
        return 0
    done = 0
    for name, signature in source_init_signatures(source, vars(module)).items():
        cls = vars(module).get(name)
        native = vars(cls).get("__init__") if isinstance(cls, type) else None
        if isinstance(native, types.WrapperDescriptorType):
            setattr(cls, "__init__", _calling(native, signature, cls))  # noqa: B010 (a type's slot)
            done += 1
    return done


def _calling(native: types.WrapperDescriptorType, signature: inspect.Signature, cls: type) -> object:
    """An ``__init__`` that calls ``native`` and shows ``signature``."""
    def __init__(self: object, *args: object, **kwargs: object) -> None:
        native(self, *args, **kwargs)

    __init__.__signature__ = signature  # type: ignore[attr-defined]
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    __init__.__doc__ = native.__doc__
    return __init__

"""The compiled modules' docstrings and ``__init__`` signatures, given back from their sources.

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

This module imports only the standard library, as :mod:`kvpool._native`, which uses it.
"""

from __future__ import annotations
import __future__

import ast
import ctypes
import inspect
import sys
import types
from pathlib import Path
from types import ModuleType


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


def copy_docstrings(module: ModuleType, source: Path) -> int:
    """Give compiled ``module`` (and its classes, methods, properties and functions) the docstrings of
    its source file ``source`` (:func:`source_docstrings`) where theirs are missing; returns how many were
    set. Objects whose doc cannot be set (an unknown layout) keep theirs."""
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


def copy_init_signatures(module: ModuleType, source: Path) -> int:
    """Give each class of compiled ``module`` whose ``__init__`` is mypyc's slot wrapper an ``__init__``
    with the signature in its source file ``source`` that calls the compiled one; returns how many were
    given."""
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

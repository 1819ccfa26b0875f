"""Every kvpool name that a docstring or a documentation page cites exists (issue 30: ``bench/groups.py``
cited ``kvpool.trace.group_replay``, a module deleted long before). Checked statically, from the sources
(nothing is imported, so optional dependencies need not be installed):

* in docstrings, the cross-references ``:mod:``, ``:class:``, ``:func:``, ``:meth:``, ``:attr:``, ``:data:``
  and ``:exc:``, and every ````kvpool.x.y```` dotted name;
* on the README and the pages under docs/, every ```kvpool.x.y``` dotted name.

A dotted name resolves through packages and modules, then a module's names (definitions, assignments,
imports, the tables of lazily imported names), then a class's members (methods, class attributes, the
attributes its methods set on ``self``, its kvpool bases' members; a class built on another project's class
may have members of that class). A bare name resolves in the docstring's class, its module, its package,
then as a definition anywhere in kvpool (docstrings name the one kvpool name of that spelling)."""

from __future__ import annotations

import ast
import builtins
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: Modules the build writes (setup.py): no source in the repository.
GENERATED = {"kvpool._native_manifest"}
ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):`~?\.?([^`<]+?)(?:\s*<([^>]+)>)?`")
DOTTED_IN_DOCSTRING = re.compile(r"``(kvpool(?:\.\w+)+)")
DOTTED_ON_PAGE = re.compile(r"`(kvpool(?:\.\w+)+)")


class Module:
    """One kvpool module's names, read from its source."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path
        self.tree = ast.parse(path.read_text())
        self.package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        self.defined: dict[str, ast.AST] = {}  # functions, classes, assigned names
        self.imported: dict[str, str] = {}  # local name -> dotted name it stands for
        for node in self.tree.body:
            for sub in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
                self._read(sub)

    def _read(self, node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            self.defined[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for name in (n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                self.defined[name.id] = node
            if isinstance(node.value, ast.Dict):  # a lazy-import table: {"Name": "kvpool.module"}
                for key, value in zip(node.value.keys, node.value.values, strict=True):
                    if isinstance(key, ast.Constant) and isinstance(value, ast.Constant) \
                            and str(value.value).startswith("kvpool."):
                        self.imported[key.value] = f"{value.value}.{key.value}"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = self.package.split(".")[:len(self.package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                self.imported[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                self.imported[local] = alias.name if alias.asname else local


@cache
def modules() -> dict[str, Module]:
    out = {}
    for path in sorted((ROOT / "kvpool").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name not in GENERATED:
            out[name] = Module(name, path)
    return out


def _members(cls: ast.ClassDef, module: Module, depth: int = 0) -> set[str] | None:
    """A class's member names; None when it has a base outside kvpool (any member may be that base's)."""
    out = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    for node in cls.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    out |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    for base in cls.bases:
        found = _resolve_in_module(module, ast.unparse(base).split("[")[0].split(".")) if depth < 10 else None
        if not (isinstance(found, tuple) and isinstance(found[0], ast.ClassDef)):
            if ast.unparse(base) in ("object", "Generic"):
                continue
            return None
        inherited = _members(found[0], found[1], depth + 1)
        if inherited is None:
            return None
        out |= inherited
    return out


def _attribute(node: ast.AST, module: Module, rest: list[str]) -> bool:
    """Whether ``rest`` names something inside ``node`` (a class's members; nothing inside anything else)."""
    if not rest:
        return True
    if not isinstance(node, ast.ClassDef):
        return False
    members = _members(node, module)
    if members is None:
        return True
    if rest[0] not in members:
        return False
    inner = next((n for n in node.body if isinstance(n, ast.ClassDef) and n.name == rest[0]), None)
    return len(rest) == 1 or (inner is not None and _attribute(inner, module, rest[1:]))


def _resolve_in_module(module: Module, parts: list[str]) -> tuple[ast.AST, Module] | bool:
    """What ``parts`` names from ``module``'s namespace: (node, module) for a definition, True for
    something real but not a definition (a module, an attribute, another project's name), False if
    nothing."""
    head, rest = parts[0], parts[1:]
    if f"{module.name}.{head}" in modules():  # a submodule
        return resolve(f"{module.name}.{head}".split(".") + rest)
    if head in module.defined:
        node = module.defined[head]
        if not rest:
            return (node, module)
        return _attribute(node, module, rest)
    if head in module.imported:
        return resolve(module.imported[head].split(".") + rest)
    return False


def resolve(parts: list[str]) -> tuple[ast.AST, Module] | bool:
    """What the dotted name ``parts`` names (see :func:`_resolve_in_module`); names outside kvpool are
    taken as real."""
    if parts[0] != "kvpool":
        return True
    if ".".join(parts) in GENERATED:
        return True
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in modules():
            return True if i == len(parts) else _resolve_in_module(modules()[name], parts[i:])
    return False


def resolves_from(module: Module, owner: ast.ClassDef | None, target: str) -> bool:
    """Whether a docstring of ``module`` (inside class ``owner``, if any) names something real by
    ``target``."""
    parts = target.split(".")
    if parts[0] == "kvpool":
        return bool(resolve(parts))
    if owner is not None and len(parts) == 1 and _attribute(owner, module, parts):
        return True
    if _resolve_in_module(module, parts) or hasattr(builtins, parts[0]):
        return True
    if f"{module.package}.{parts[0]}" in modules():
        return bool(resolve(f"{module.package}.{target}".split(".")))
    if len(parts) == 1 and owner is None and any(  # a module docstring naming one of its classes' members
            _attribute(c, module, parts) for c in module.defined.values() if isinstance(c, ast.ClassDef)):
        return True
    return any(bool(_resolve_in_module(other, parts)) for other in modules().values()
               if parts[0] in other.defined)


def _docstrings(module: Module) -> list[tuple[int, ast.ClassDef | None, str]]:
    """``(line, enclosing class, docstring)`` of a module, its classes and functions."""
    out = []

    def visit(node: ast.AST, owner: ast.ClassDef | None) -> None:
        for sub in ast.iter_child_nodes(node):
            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                here = sub if isinstance(sub, ast.ClassDef) else owner
                if (doc := ast.get_docstring(sub)) is not None:
                    out.append((sub.lineno, here, doc))
                visit(sub, here)

    if (doc := ast.get_docstring(module.tree)) is not None:
        out.append((1, None, doc))
    visit(module.tree, None)
    return out


def docstring_citations(module: Module) -> list[tuple[int, ast.ClassDef | None, str]]:
    """Every name a module's docstrings cite: ``(line, enclosing class, target)``."""
    out = []
    for line, owner, doc in _docstrings(module):
        for target, link in ROLE.findall(doc):
            out.append((line, owner, re.sub(r"\s+", "", link or target).rstrip("()")))
        out += [(line, owner, name) for name in DOTTED_IN_DOCSTRING.findall(doc)]
    return out


def _real(dotted: str) -> bool:
    return bool(resolve(dotted.split(".")))


def test_the_resolver_tells_real_names_from_stale_ones() -> None:
    assert _real("kvpool.trace.replay.compare_all_full")
    assert _real("kvpool.allocators.BlockPool.allocate")  # through the lazy table
    assert _real("kvpool.storage.paged.PagedKVCache.copy_blocks")  # a method of the class
    assert not _real("kvpool.trace.group_replay.compare_all_full")
    assert not _real("kvpool.storage.paged.PagedKVCache.copy_blocks_to")
    assert not _real("kvpool.allocators.block_pool.no_such_function")
    paged = modules()["kvpool.storage.paged"]
    assert resolves_from(paged, None, "BlockStore") and resolves_from(paged, None, "torch.Tensor")
    assert not resolves_from(paged, None, "NoSuchClass")


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_name_a_docstring_cites_exists(name: str) -> None:
    module = modules()[name]
    missing = [f"{module.path.relative_to(ROOT)}:{line}: {target}"
               for line, owner, target in docstring_citations(module)
               if not resolves_from(module, owner, target)]
    assert not missing, "docstrings cite names kvpool does not have:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_kvpool_name_a_page_cites_exists(page: Path) -> None:
    lines = enumerate(page.read_text().splitlines(), 1)
    missing = [f"{page.relative_to(ROOT)}:{i}: {name}" for i, line in lines
               for name in DOTTED_ON_PAGE.findall(line) if not _real(name)]
    assert not missing, "the page cites names kvpool does not have:\n" + "\n".join(missing)

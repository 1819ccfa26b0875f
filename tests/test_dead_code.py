"""No dead code (issue 30): every function, method and class of kvpool has a caller. A name counts as called
when it is read somewhere in kvpool, the tests, the benchmarks or the scripts (a name, an attribute, an
import, a string such as a lazy-import table's or ``getattr``'s, never a docstring), or in a documentation
page's example, which users copy. Methods of a class built on another project's class (vLLM's, SGLang's,
argparse's) are that project's hooks, called by it; a class that follows another project's protocol without
subclassing it is listed in ``PROTOCOL_CLASSES``. The check is by name, so it misses a dead method that shares
its name with a live one; it catches the definitions nothing names at all."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("kvpool", "tests", "benchmarks", "scripts")
#: Classes that follow another project's protocol without subclassing it: their methods are its hooks.
PROTOCOL_CLASSES = {
    "kvpool/engine/recurrent.py:SlotStateCache",  # transformers' cache, as the recurrent mixers call it
}
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
EXAMPLE = re.compile(r"```(?:python|bash)\n(.*?)```", re.S)


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, kinds) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _names_read(tree: ast.AST) -> Counter[str]:
    docs, out = _docstrings(tree), Counter[str]()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out[node.id] += 1
        elif isinstance(node, ast.Attribute):
            out[node.attr] += 1
        elif isinstance(node, ast.alias):
            out[node.name.split(".")[-1]] += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.update(WORD.findall(node.value))
    return out


def _files() -> list[Path]:
    return sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py")) + [ROOT / "setup.py"]


def references() -> Counter[str]:
    """Every name read in the code, and every word of the documentation's examples and entry points."""
    out = Counter[str]()
    for path in _files():
        out += _names_read(ast.parse(path.read_text()))
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for example in EXAMPLE.findall(page.read_text()):
            out.update(WORD.findall(example))
    out.update(WORD.findall((ROOT / "pyproject.toml").read_text()))
    return out


def _own_classes(tree: ast.Module) -> set[str]:
    """The names a module's classes may name a kvpool base by: its own classes, and those it imports from
    kvpool."""
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    return own | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  and (n.module or "").startswith("kvpool") for a in n.names}


def _is_hook_class(node: ast.ClassDef, kvpool_names: set[str]) -> bool:
    """Built on a class of another project (its methods are that class's hooks)."""
    bases = [b.value if isinstance(b, ast.Subscript) else b for b in node.bases]
    return any(not (isinstance(b, ast.Name) and (b.id in kvpool_names or b.id in ("object", "Generic")))
               for b in bases)


def _defined(node: ast.AST, rel: str, owner: str | None, kvpool_names: set[str]) -> list[tuple[str, str]]:
    """``(where, name)`` of the functions and classes defined in ``node`` (a module or a class ``owner``),
    nested ones included, but for a foreign class's hooks."""
    out = []
    for sub in ast.iter_child_nodes(node):
        if not isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if not (sub.name.startswith("__") and sub.name.endswith("__")) \
                and f"{rel}:{owner}" not in PROTOCOL_CLASSES:
            out.append((f"{rel}:{sub.lineno}", sub.name))
        if isinstance(sub, ast.ClassDef) and not _is_hook_class(sub, kvpool_names):
            out += _defined(sub, rel, sub.name, kvpool_names)
    return out


def definitions() -> list[tuple[str, str]]:
    """``(where, name)`` of every function, method and class of kvpool that could be dead."""
    out = []
    for path in sorted((ROOT / "kvpool").rglob("*.py")):
        tree = ast.parse(path.read_text())
        out += _defined(tree, path.relative_to(ROOT).as_posix(), None, _own_classes(tree))
    return out


def test_the_check_finds_a_name_nothing_reads() -> None:
    tree = ast.parse('"""docstring naming unused"""\nimport os\nx = os.path\ngetattr(x, "by_string")\n')
    assert {"os", "path", "x", "by_string", "getattr"} <= set(_names_read(tree))
    assert "unused" not in _names_read(tree) and "docstring" not in _names_read(tree)


def test_every_definition_has_a_caller() -> None:
    read = references()
    dead = [f"{where}: {name}" for where, name in definitions() if not read[name]]
    assert not dead, "defined and never called (remove it, or name a foreign protocol's class in " \
        "PROTOCOL_CLASSES):\n" \
        + "\n".join(dead)

"""Count the places under kvpool/ that branch on a memory kind or on "is this model a hybrid?".

Two counts, each read from the code's syntax tree (comments and docstrings never count):

* **kind branch sites**: every use of ``LayerKind.FULL`` / ``SLIDING`` / ``CHUNKED`` (an attention kind
  named in code) and every comparison (``is``, ``is not``, ``==``, ``!=``) of a name or attribute against a
  member of ``LayerKind`` or ``RecurrentKind``: code that picks a behaviour by naming a kind instead of
  asking the kind's class (:mod:`kvpool.spec.kinds`). (A comparison with a ``LayerKind`` member counts
  once, not again for the member.)
* **hybrid branches**: every condition (``if`` / ``elif`` / ``while`` test, conditional expression,
  comprehension filter, ``assert``) whose test asks whether a model keeps a recurrent state: a name or
  attribute whose last part is one of :data:`HYBRID_NAMES` compared ``is None`` / ``is not None`` or
  tested for truth (alone, under ``not``, or as an operand of ``and`` / ``or``), a call of one of
  :data:`HYBRID_CALLS`, or a membership test of one of :data:`HYBRID_KEYS` (a stats dict holding a state
  part). One condition counts once however many such parts it has.

Usage: ``python scripts/count_branches.py [--list]``: prints both counts (and, with ``--list``, each site as
``path:line``). ``tests/test_branch_counts.py`` runs it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvpool"
#: Names whose presence (or None) says "this model keeps a recurrent state".
HYBRID_NAMES = frozenset({"hybrid", "recurrent", "states", "state_spec", "is_hybrid", "has_state",
                          "state_save"})
#: Calls that classify a config as recurrent.
HYBRID_CALLS = frozenset({"is_recurrent_config", "is_hybrid"})
#: Keys of a stats / report dict that only a hybrid's holds.
HYBRID_KEYS = frozenset({"recurrent_state"})
KIND_MEMBERS = frozenset({"FULL", "SLIDING", "CHUNKED"})
#: The enums whose members name a kind of memory.
KIND_ENUMS = frozenset({"LayerKind", "RecurrentKind"})


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _asks_hybrid(test: ast.expr) -> bool:
    """Whether a condition's test asks whether the model keeps a recurrent state (see the module doc)."""
    if isinstance(test, ast.BoolOp):
        return any(_asks_hybrid(v) for v in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _asks_hybrid(test.operand)
    if _last_name(test) in HYBRID_NAMES:
        return True
    if isinstance(test, ast.Call):
        return _last_name(test.func) in HYBRID_CALLS
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], test.comparators[0]
        if isinstance(op, (ast.Is, ast.IsNot)) and isinstance(right, ast.Constant) and right.value is None:
            return _last_name(test.left) in HYBRID_NAMES
        if isinstance(op, (ast.In, ast.NotIn)):
            return isinstance(test.left, ast.Constant) and test.left.value in HYBRID_KEYS
    return False


def _tests(tree: ast.AST) -> list[ast.expr]:
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            found.append(node.test)
        elif isinstance(node, ast.comprehension):
            found.extend(node.ifs)
    return found


def _enum_member(node: ast.AST, enums: frozenset[str]) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in enums


def _kind_sites(tree: ast.AST) -> set[int]:
    """Line numbers of the kind branch sites of one module (see the module doc)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        compared = isinstance(node, ast.Compare) and \
            any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for op in node.ops) and \
            any(_enum_member(n, KIND_ENUMS) for n in (node.left, *node.comparators))
        named = isinstance(node, ast.Attribute) and node.attr in KIND_MEMBERS and \
            _enum_member(node, frozenset({"LayerKind"}))
        if compared or named:
            lines.add(node.lineno)
    return lines


def sites(root: Path = PACKAGE) -> tuple[list[str], list[str]]:
    """``(kind branch sites, hybrid branches)`` under ``root``, each as ``path:line`` (path relative to
    ``root``'s parent), in file order; a line counts once per list."""
    kinds: list[str] = []
    hybrid: list[str] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        name = path.relative_to(root.parent).as_posix()
        kinds += [f"{name}:{line}" for line in sorted(_kind_sites(tree))]
        hybrid += sorted({f"{name}:{t.lineno}" for t in _tests(tree) if _asks_hybrid(t)},
                         key=lambda s: int(s.rsplit(":", 1)[1]))
    return kinds, hybrid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print each site as path:line")
    args = parser.parse_args(argv)
    kinds, hybrid = sites()
    print(f"kind branch sites: {len(kinds)}")
    if args.list:
        print("".join(f"  {s}\n" for s in kinds), end="")
    print(f"hybrid branches: {len(hybrid)}")
    if args.list:
        print("".join(f"  {s}\n" for s in hybrid), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

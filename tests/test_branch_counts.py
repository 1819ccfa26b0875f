"""The kind and hybrid branch counts of ``scripts/count_branches.py`` (issue 31): code asks a memory kind
for its rules instead of naming the kind, and asks the state side instead of testing "is this a hybrid?"."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "count_branches.py"
_spec = importlib.util.spec_from_file_location("count_branches", SCRIPT)
count_branches = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["count_branches"] = count_branches
_spec.loader.exec_module(count_branches)  # type: ignore[union-attr]

#: The most of each the code may have (issue 31: kind sites <= 5, hybrid branches <= 10; the hybrid count is a
#: ratchet, lowered as callers move to asking the state kind: ModelMemory.state_kind, the engine's
#: RecurrentStates / NoRecurrentStates, the request path's StateSide, the replay's ReplayConfig.state).
MAX_KIND_SITES = 5
MAX_HYBRID_BRANCHES = 8


def test_kind_branch_sites_stay_few() -> None:
    kinds, _ = count_branches.sites()
    assert len(kinds) <= MAX_KIND_SITES, kinds


def test_hybrid_branches_stay_few() -> None:
    _, hybrid = count_branches.sites()
    assert len(hybrid) <= MAX_HYBRID_BRANCHES, hybrid


def _count(tmp_path: Path, source: str) -> tuple[int, int]:
    pkg = tmp_path / "kvpool"
    pkg.mkdir()
    (pkg / "m.py").write_text(source)
    kinds, hybrid = count_branches.sites(pkg)
    return len(kinds), len(hybrid)


def test_the_counter_sees_each_form(tmp_path: Path) -> None:
    # counted by hand: 3 kind sites (two comparisons on two lines, one bare member; a line counts once),
    # 6 hybrid conditions (the `and` line
    # counts once, the docstring and comment none, `self.states.has_free_slot` asks a slot, not "hybrid?")
    source = '''
"""if hybrid is None: not code"""
def f(g, spec, self, stats, config):
    if g.kind is LayerKind.SLIDING or \\
            g.kind == RecurrentKind.MAMBA1:
        pass
    k = LayerKind.FULL
    x = 1 if spec.hybrid is None else 2
    if self.states is not None and self.recurrent:
        pass
    while not self.state_spec:
        pass
    assert "recurrent_state" in stats
    y = [c for c in config if is_recurrent_config(c)]
    if self.states.has_free_slot:  # if hybrid is None
        pass
    if hybrid:
        pass
'''
    assert ast.parse(source)
    assert _count(tmp_path, source) == (3, 6)

"""The layering rule of DESIGN.md: data flows up, and no module imports one from a layer above it."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvpool"

# Rank of each layer (first path component under kvpool/); equal ranks may not import each other either,
# except within the same layer.
RANKS = {
    # numeric (the one rule for ids, counts and numbers) and units (counts and bytes for people): the ground
    # _native (compiled or interpreted modules) runs before everything and imports only the standard library
    "_native": -1,
    "_native_docs": -2,  # what _native gives the compiled modules: their docstrings and signatures
    # _lazy (names a package exports, imported on first use) imports only the standard library too
    "_lazy": -1,
    "errors": 0, "numeric": 0.5, "units": 0.7, "events": 1,
    # the one vocabulary of command-line options: in the cli package, at the ground (the bench suites,
    # beneath the command line, declare their options with it)
    "cli.options": 0.8,
    # the old import paths of the events package's modules and of the vocabulary: deprecation shims
    "event_buffer": 1.1, "events_subscriber": 1.1, "options": 1.1,
    # what memory a model needs and how much a device gives (the config, the kinds, KV and state, the plans)
    "spec": 2,
    # the old import paths of the spec package's modules: deprecation shims over it
    "hf_config": 2.9, "state_spec": 2.9, "planner": 2.9, "state_planner": 2.9,
    "allocators": 4, "storage": 5, "tiers": 5.5, "requests": 5.8, "engine": 6, "trace": 6, "metrics": 6,
    "integrations": 6,
    "bench": 7, "cli": 8,
    "__main__": 9,
}


def _layer(module: str) -> str:
    """The layer of a module: the first name under kvpool (a module of a package that RANKS ranks apart,
    such as ``cli.options``, is its own layer)."""
    parts = module.split(".")
    if ".".join(parts[1:3]) in RANKS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.startswith("kvpool.")}


# (kvpool/_native_manifest.py is no source: setup.py writes it for the build and removes it)
MODULES = sorted(p for p in PACKAGE.rglob("*.py")
                 if (p.name != "__init__.py" or p.parent != PACKAGE) and p.name != "_native_manifest.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_downward(path: Path) -> None:
    here = _layer(".".join(("kvpool", *path.relative_to(PACKAGE).with_suffix("").parts)))
    assert here in RANKS, f"{here} has no layer in RANKS"
    for name in _imports(path):
        there = _layer(name)
        if there == here:
            continue
        assert RANKS[there] < RANKS[here], f"{path.name} ({here}) imports {name} ({there}): not downward"


#: The packages whose modules import bottom up, each only the ones before it, so the layer has no circle
#: inside (the package's face, ``__init__``, comes last). ``spec.kinds`` imports nothing of kvpool but the
#: ground (it is compiled with the allocators' hot path).
PACKAGE_ORDERS = {
    "events": ("wire", "buffer", "publishers", "sink", "transport", "subscriber", "__init__"),
    "spec": ("config_sizes", "hf_layers", "hf_config", "kinds", "kv_dtypes", "kv_groups", "kv",
             "state_families", "state", "state_planner", "device_memory", "planner", "state_kind", "memory",
             "__init__"),
}


@pytest.mark.parametrize(("package", "name"), [(p, n) for p, order in PACKAGE_ORDERS.items() for n in order])
def test_a_package_imports_in_order(package: str, name: str) -> None:
    order = PACKAGE_ORDERS[package]
    for imported in _imports(PACKAGE / package / f"{name}.py"):
        parts = imported.split(".")
        if parts[1] != package:
            continue
        there = parts[2] if len(parts) > 2 else "__init__"
        assert order.index(there) < order.index(name), f"{package}/{name}.py imports {imported}"


@pytest.mark.parametrize("package", PACKAGE_ORDERS)
def test_the_order_names_every_module(package: str) -> None:
    assert sorted(PACKAGE_ORDERS[package]) == sorted(p.stem for p in (PACKAGE / package).glob("*.py"))


def test_the_kinds_stand_on_the_ground() -> None:
    assert {_layer(m) for m in _imports(PACKAGE / "spec" / "kinds.py")} <= {"errors", "numeric"}


def _design_ranks() -> dict[str, float]:
    """The layers table of docs/DESIGN.md: each module or package it names (``spec.py``, ``kvpool/tiers/``)
    with the rank of its row."""
    text = (PACKAGE.parent / "docs" / "DESIGN.md").read_text()
    table = text[text.index("| rank | layer | modules | job |"):].split("\n\n")[0]
    out = {}
    for row in table.splitlines()[2:]:
        rank, _layer, modules, _job = row.strip("|").split(" | ")[:4]
        for name in re.findall(r"`(?:kvpool/)?(\w+(?:/\w+)?)(?:\.py|/)`", modules):
            out[name.replace("/", ".")] = float(rank)
    return out


def test_the_design_page_gives_every_layer_its_rank() -> None:
    """docs/DESIGN.md's layers table names every module and package of RANKS with the same rank (issue 30:
    the map had lost the modules added since it was written)."""
    assert _design_ranks() == {name: float(rank) for name, rank in RANKS.items()}

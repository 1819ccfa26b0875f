"""``kvpool bench alloc --against PATH``: this tree's BlockPool beside another kvpool source tree's (an older
commit, say), timed in the same run, so a change's cost on the allocator's hot path is a ratio of two
figures the same machine gave under the same load.

Each tree runs in a subprocess of this interpreter with ``PYTHONPATH`` set to that tree (its build, compiled
in place or not, is used as it is), both on the same loops: this tree's :mod:`kvpool.bench.pool_ops`,
loaded from this tree's folder, timing the pool class the subprocess imports
(``kvpool.allocators.block_pool.BlockPool``) under the policies both trees have. The two are started once
each (their imports paid once) and asked for rounds in turn, this tree first, ``rounds`` times over
(:class:`kvpool.bench.peers.Side`); a row's figures are the medians of its rounds and its ratio the median
of the rounds' ratios this / against (each round's figures are themselves medians of ``repeat`` runs). A
ratio above 1 is a slowdown of this tree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from kvpool.bench.peers import Side
from kvpool.bench.timing import print_table
from kvpool.errors import ConfigError

#: What a tree's subprocess runs (``python -P -c``; argv: this tree's bench folder, the sizes, ops,
#: policies): the bench folder becomes a package of its own, so that :mod:`kvpool.bench.pool_ops` is this
#: tree's while ``kvpool`` is the tree under test; then one JSON line per round asked for on stdin.
SIDE = """
import gc, json, sys, types
pkg = types.ModuleType("_kvpool_bench_side")
pkg.__path__ = [sys.argv[1]]
sys.modules[pkg.__name__] = pkg
from _kvpool_bench_side import pool_ops
import kvpool
from kvpool import _native
from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.policies import POLICIES
sizes, ops = [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
policies = tuple(p for p in sys.argv[4].split(",") if p in POLICIES)
repeat = int(__import__("os").environ["PEER_REPEAT"])
version = f"{kvpool.__version__} at {kvpool.__file__.rsplit('/kvpool/', 1)[0]}, {_native.describe()}"
for _ in sys.stdin:
    gc.collect()
    gc.disable()
    try:
        ns = pool_ops.rows(BlockPool, policies, sizes, ops, repeat)
    finally:
        gc.enable()
    print(json.dumps({"version": version, "ns": ns}), flush=True)
"""
#: The ratio every row is held to (this tree / the tree it is timed against).
TARGET_RATIO = 1.1


def tree_root(path: str | Path) -> Path:
    """The source tree at ``path``: a folder holding ``kvpool/__init__.py``. Raises ConfigError otherwise."""
    root = Path(path).expanduser().resolve()
    if not (root / "kvpool" / "__init__.py").is_file():
        raise ConfigError(f"--against {path}: not a kvpool source tree (no kvpool/__init__.py there)")
    return root


def compare(against: str | Path, sizes: list[int], ops: int, repeat: int, rounds: int,
            policies: tuple[str, ...]) -> dict[str, Any]:
    """Time both trees' rows in alternating rounds (see the module docstring); the JSON-ready result.

    Raises:
        ConfigError: ``against`` is not a kvpool source tree, or a tree's subprocess failed (its last line).
    """
    bench = Path(__file__).resolve().parent
    here, there = bench.parents[1], tree_root(against)
    argv = ["-P", "-c", SIDE, str(bench), ",".join(map(str, sizes)), str(ops), ",".join(policies)]
    sides = [Side(name, Path(sys.executable), "", repeat, env={"PYTHONPATH": str(root)}, argv=argv)
             for name, root in (("this tree", here), ("against", there))]
    try:
        for _ in range(max(1, rounds)):
            for side in sides:
                side.round()
    finally:
        for side in sides:
            side.close()
    for side in sides:
        if side.error or not side.rounds:
            raise ConfigError(f"kvpool bench alloc --against: the {side.name}'s run failed: "
                              f"{side.error or 'no rounds'}")
    ours, theirs = sides
    rows = [_row(key, ours.rounds, theirs.rounds) for key in ours.rounds[0]]
    return {"suite": "alloc --against", "unit": "ns per block", "this": ours.version, "against":
            theirs.version, "rounds": len(ours.rounds), "target_ratio": TARGET_RATIO, "rows": rows}


def _row(key: str, ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> dict[str, Any]:
    op, size = key.rsplit(" @ ", 1)
    mine = [r[key] for r in ours]
    paired = [(a[key], b[key]) for a, b in zip(ours, theirs, strict=False) if key in b]
    other = [b for _, b in paired]
    return {"op": op, "pool_blocks": int(size), "this_ns": round(statistics.median(mine), 1),
            "against_ns": round(statistics.median(other), 1) if other else None,
            "ratio": round(statistics.median(a / b for a, b in paired), 3) if paired else None}


def run(args: argparse.Namespace, policies: tuple[str, ...]) -> dict[str, Any]:
    """``kvpool bench alloc --against``: time, print the table unless ``args.json``, return the result."""
    result = compare(args.against, args.sizes, args.ops, args.repeat, args.rounds, policies)
    if not args.json:
        table = [[r["op"], r["pool_blocks"], r["this_ns"], r["against_ns"], r["ratio"],
                  "-" if r["ratio"] is None else ("ok" if r["ratio"] <= TARGET_RATIO else "OVER")]
                 for r in result["rows"]]
        print(f"this tree: {result['this']}\nagainst:   {result['against']}")
        print_table(f"\nkvpool bench alloc --against: ns per block, {result['rounds']} alternated rounds "
                    f"(ratio = median of the rounds' this / against; target <= {TARGET_RATIO})",
                    ["op", "pool", "this ns", "against ns", "ratio", "target"], table)
    return result

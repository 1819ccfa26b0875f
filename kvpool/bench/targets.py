"""``kvpool bench targets``: every speed target of the project in one run, each as a ratio to its baseline,
read from the suites that measure it (each suite times its baseline in the same run; this module only runs
them in turn and collects their ratios).

One row per target, from issue 24 ("Speed, second round") and the allocator's peer comparison:

* ``replay``: block ops/s of the shipped Mooncake trace at block size 16 (instant timing) / 10M;
* ``tiers``: disk and Redis store / load GB/s / raw file I/O and redis-py pipelines (>= 0.9) for each block
  shape; the 300-request replay over host + disk + Redis, block ops/s / 360k (10x the first one's 36k);
* ``alloc``: with a KV event sink, evicting allocate and ``cache_blocks`` with token ids, cost / sink-less
  cost (<= 1.3); the peers' published ns / kvpool ns (no bound: context);
* ``groups``: the two-group coordinator (sliding 128 + full) per decode step / one plain pool (<= 1.1);
* ``attention``: paged attention in place, speed / SDPA over contiguous KV (>= 0.8) per phase and context;
* ``engine``: ``kvpool generate`` tokens/s / transformers' ``generate_batch`` (>= 1.5), gather and paged.

``met`` is None for a row without a bound. ``--skip`` leaves suites out (the engine loads SmolLM2; tiers
start a ``redis-server`` if installed). Each suite runs with its own defaults except: alloc at one pool size
(32,768 blocks, the size the peers were measured at), groups without its replay rows and tiers without its
host-only replay row.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from kvpool.bench.timing import print_table
from kvpool.cli.options import CommaList
from kvpool.errors import ConfigError

REPLAY_OPS_PER_S = 10_000_000  # issue 24, target 1
TIER_REPLAY_OPS_PER_S = 360_000  # issue 24, target 2: 10x the first tier replay's 36k block ops/s

#: suite -> the arguments it runs with here (besides --json and --threads)
SUITE_ARGS: dict[str, list[str]] = {
    "replay": ["--block-sizes", "16"],
    "tiers": ["--max-requests", "0"],
    "alloc": ["--sizes", "32768"],
    "groups": ["--max-requests", "0"],
    "attention": [],
    "engine": ["--skip-padded"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip", action=CommaList, allowed=list(SUITE_ARGS), default=[], metavar="SUITE,...",
                        help=f"suites to leave out, of {', '.join(SUITE_ARGS)}")


def run(args: argparse.Namespace) -> dict:
    rows: list[dict[str, Any]] = []
    for name in SUITE_ARGS:
        if name not in args.skip:
            rows += ROWS[name](run_suite(name, SUITE_ARGS[name], args.threads))
    if not args.json:
        print_table("targets: each ratio against its baseline timed in the same run (met: within the bound)",
                    ["suite", "measure", "ratio", "bound", "met"],
                    [[r["suite"], r["measure"], r["ratio"], _bound(r), _met(r)] for r in rows])
    return {"suite": "targets", "skipped": list(args.skip), "rows": rows,
            "met": sum(r["met"] is True for r in rows), "missed": sum(r["met"] is False for r in rows)}


def run_suite(name: str, argv: list[str], threads: int) -> dict[str, Any]:
    """Run ``kvpool bench NAME ARGV --json`` in this process and return its result (nothing printed by the
    suite itself). Raises :class:`ConfigError` for arguments the suite refuses."""
    module = importlib.import_module(f"kvpool.bench.{name}")
    parser = argparse.ArgumentParser(prog=f"kvpool bench {name}", allow_abbrev=False)  # as the CLI
    module.add_arguments(parser)
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:
        raise ConfigError(f"kvpool bench {name} refused {argv}") from exc
    ns.json, ns.threads = True, threads  # the options `kvpool bench` adds to every suite (threads applied)
    return module.run(ns)


def _row(suite: str, measure: str, ratio: float | None, bound: float | None, higher: bool = True
         ) -> dict[str, Any]:
    """A row; ``higher``: the ratio must be >= ``bound`` (else <=)."""
    met = None if ratio is None or bound is None else (ratio >= bound if higher else ratio <= bound)
    return {"suite": suite, "measure": measure, "ratio": ratio, "bound": bound,
            "higher_is_better": higher, "met": met}


def _bound(row: dict[str, Any]) -> str:
    return "-" if row["bound"] is None else f"{'>=' if row['higher_is_better'] else '<='} {row['bound']}"


def _met(row: dict[str, Any]) -> str:
    return {True: "yes", False: "no", None: "-"}[row["met"]]


def _replay_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    r = out["results"]["block_size_16"]
    return [_row("replay", f"Mooncake B16 block ops/s / 10M ({r['block_ops_per_s'] / 1e6:.2f}M ops/s)",
                 r["block_ops_per_s"] / REPLAY_OPS_PER_S, 1.0)]


def _tiers_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [_row("tiers", f"{r['tier']} {r['op']} {r['block']} / {r['baseline']}", r["ratio"], 0.9)
            for r in out["rows"] if r["tier"] != "host"]
    chain = out.get("chain_replay")
    if chain:
        rows.append(_row("tiers", f"host + disk + Redis replay block ops/s / 360k "
                                  f"({chain['block_ops_per_s'] / 1e3:,.0f}k)",
                         chain["block_ops_per_s"] / TIER_REPLAY_OPS_PER_S, 1.0))
    return rows


def _alloc_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [_row("alloc", f"{r['op']} / events off", r["ratio"], r["target_ratio"], higher=False)
            for r in out["rows"] if r.get("target_ratio") is not None]
    rows += [_row("alloc", f"{p['peer']} {p['op']} ns / kvpool ns", p["peer_over_kvpool"], None)
             for p in out["peers_measured_earlier"]]
    return rows


def _groups_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [_row("groups", f"{r['layout']} / plain pool per decode step", r["ratio"], r["target_ratio"],
                 higher=False) for r in out["rows"] if r["target_ratio"] is not None]


def _attention_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [_row("attention", f"{r['phase']} R={r['requests']} C={r['context']}: paged / contiguous SDPA",
                 r["paged_vs_contiguous"], 0.8) for r in out["rows"]]


def _engine_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [_row("engine", f"{name} / generate_batch ({out['model']}, {out['prompts']} x "
                           f"{out['max_new_tokens']} tokens)", r["speedup_vs_generate_batch"], 1.5)
            for name, r in out["results"].items() if name.startswith("kvpool generate")]


ROWS: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {
    "replay": _replay_rows, "tiers": _tiers_rows, "alloc": _alloc_rows, "groups": _groups_rows,
    "attention": _attention_rows, "engine": _engine_rows}

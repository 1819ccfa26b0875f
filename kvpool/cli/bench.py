"""``kvpool bench SUITE [--json]``: benchmarks that print ratios against a baseline timed in the same run.

Each suite lives in ``kvpool.bench.<suite>`` with ``add_arguments(parser)`` and ``run(args) -> dict``.
"""

from __future__ import annotations

import argparse
import importlib
import json

SUITES = {
    "alloc": "BlockPool, hashing and the token allocator against a naive deque allocator",
    "storage": "store_kv bandwidth against a contiguous copy_ of the same bytes",
    "engine": "kvpool generate tokens/s against transformers' generate_batch and padded generate",
    "replay": "trace replay block operations per second",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark suite")
    suites = parser.add_subparsers(dest="suite", required=True)
    for name, help_text in SUITES.items():
        sub = suites.add_parser(name, help=help_text)
        sub.add_argument("--json", action="store_true", help="print one JSON object")
        sub.set_defaults(func=_run)
        importlib.import_module(f"kvpool.bench.{name}").add_arguments(sub)


def _run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"kvpool.bench.{args.suite}")
    result = module.run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0

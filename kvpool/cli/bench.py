"""``kvpool bench SUITE [--json] [--threads N]``: benchmarks that print ratios against a baseline timed in
the same run.

Each suite lives in ``kvpool.bench.<suite>`` with ``add_arguments(parser)`` and ``run(args) -> dict``; every
suite takes ``--json`` and the ``--threads`` convention of :func:`kvpool.cli._args.add_threads_argument`
(applied before the suite runs).
"""

from __future__ import annotations

import argparse
import importlib
import json

from kvpool.cli._args import add_json_argument, add_threads_argument, apply_threads

SUITES = {
    "alloc": "BlockPool, hashing and the token allocator against a naive deque allocator",
    "storage": "store_kv bandwidth against a contiguous copy_ of the same bytes",
    "attention": "attention over the paged pool in place and gather + SDPA against SDPA over contiguous KV",
    "engine": "kvpool generate tokens/s against transformers' generate_batch and padded generate",
    "replay": "trace replay block operations per second",
    "groups": "KV cache group coordinator per decode step against one plain pool; replay memory per group",
    "tiers": "host / disk / Redis store and load GB/s against raw copy_, file, redis-py and raw + MAC",
    "memory": "page arena commit / release per page against fresh-tensor faults and frees; RSS of an elastic "
              "pool against a fixed one; strips against block-major; page-aware eviction against LRU",
    "targets": "every speed target's ratio from the suites above, in one run",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark suite",
                                   description="Benchmarks that print ratios against a baseline timed in the "
                                               "same run.")
    parser.set_defaults(func=lambda _args: _usage(parser))
    suites = parser.add_subparsers(dest="suite", metavar="SUITE", title="suites")
    for name, help_text in SUITES.items():
        sub = suites.add_parser(name, help=help_text, description=_sentence(help_text))
        add_json_argument(sub)
        add_threads_argument(sub)
        sub.set_defaults(func=_run)
        importlib.import_module(f"kvpool.bench.{name}").add_arguments(sub)


def _sentence(help_text: str) -> str:
    """A suite's help as its description: capitalized, unless it starts with a name that is spelled in lower
    case (``kvpool generate``, ``store_kv``)."""
    first = help_text.split(" ", 1)[0]
    keep = first == "kvpool" or "_" in first
    return f"{help_text if keep else help_text[0].upper() + help_text[1:]}."


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _run(args: argparse.Namespace) -> int:
    apply_threads(args)
    module = importlib.import_module(f"kvpool.bench.{args.suite}")
    result = module.run(args)
    if args.json:
        print(json.dumps(result))
    return 0

"""The ``kvpool`` command line: one module per subcommand, each with ``register(subparsers)``.

Every subcommand sets ``func(args) -> int``. Bad input (any :class:`KVPoolError`, or a missing optional
dependency) prints one line on stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvpool.cli._args import OneLineErrorParser
from kvpool.errors import KVPoolError

SUBCOMMANDS = ("plan", "generate", "replay", "events", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="kvpool", description="The KV cache memory pool for LLM inference.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"kvpool.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (KVPoolError, ImportError, OSError) as exc:
        print(f"kvpool {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

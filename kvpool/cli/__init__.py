"""The ``kvpool`` command line: one module per subcommand, each with ``register(subparsers)``.

Every subcommand sets ``func(args) -> int``. Bad input (any :class:`KVPoolError`, or a missing optional
dependency) prints one line on stderr and exits with status 2, without a traceback. ``kvpool`` alone prints
the usage and the subcommands; ``kvpool --version`` the version and whether the hot path runs compiled.
When stdout is closed early (``kvpool ... | head``) the command ends quietly, with the status a pipe-killed
program has (141).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvpool import __version__, _native
from kvpool.errors import KVPoolError

SUBCOMMANDS = ("plan", "generate", "replay", "events", "bench")
#: Exit status after a closed stdout: 128 + SIGPIPE, what the shell reports for a program a pipe killed.
BROKEN_PIPE_STATUS = 141


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or (``only``, one of :data:`SUBCOMMANDS`) of that one alone, so
    that a command imports only its own modules (``kvpool replay`` imports neither the engine nor torch)."""
    from kvpool.cli._args import OneLineErrorParser  # (importing kvpool.cli imports only the ground)

    parser = OneLineErrorParser(prog="kvpool", description="The KV cache memory pool for LLM inference.")
    parser.add_argument("--version", action=_Version, help="show the version and the hot path, and exit")
    parser.set_defaults(func=lambda _args: _usage(parser))
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in SUBCOMMANDS if only is None else (only,):
        importlib.import_module(f"kvpool.cli.{name}").register(subparsers)
    return parser


class _Version(argparse.Action):
    """``--version``: one line on stdout, never wrapped (argparse's own version action wraps its text at the
    terminal's width, so a long hot-path description broke the line in two)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kwargs.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"kvpool {__version__} (hot path {_native.describe()})")
        parser.exit(0)


def _usage(parser: argparse.ArgumentParser) -> int:
    """``kvpool`` (or ``kvpool bench``) with no subcommand: the help, on stdout, and status 2."""
    parser.print_help()
    return 2


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            args = build_parser(_subcommand(sys.argv[1:] if argv is None else argv)).parse_args(argv)
        except SystemExit as exc:  # --help, --version, or a bad argument (argparse's one-line error)
            return exc.code if isinstance(exc.code, int) else 2
        try:
            code = args.func(args)
        except (KVPoolError, ImportError, OSError) as exc:
            if isinstance(exc, BrokenPipeError):
                raise
            print(f"kvpool {args.command}: error: {exc}", file=sys.stderr)
            return 2
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_STATUS


def _subcommand(argv: list[str]) -> str | None:
    """The subcommand ``argv`` starts with, or None (no subcommand, an option such as ``--help``, or a
    misspelt name: then every subcommand is registered, for the usage and the suggestion)."""
    return argv[0] if argv and argv[0] in SUBCOMMANDS else None


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's final flush does not report the broken pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (captured by a test)
        pass


if __name__ == "__main__":
    sys.exit(main())

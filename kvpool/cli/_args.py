"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any, NoReturn

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"4GiB"`` -> 4294967296. An integer, or a number with a binary suffix B, KiB, MiB, GiB, TiB."""
    match = _BYTES.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 80GiB, 512MiB, 1073741824)")
    value = float(match.group(1)) * _UNITS[unit]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _number(text: str, in_range: Callable[[float], bool], rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not in_range(value):  # NaN fails every range
        raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1], e.g. ``--gpu-memory-utilization 0.9``."""
    return _number(text, lambda v: 0 < v <= 1, "in (0, 1]")


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds)."""
    return _number(text, lambda v: 0 < v < float("inf"), "a finite number > 0")


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (seconds, a temperature)."""
    return _number(text, lambda v: 0 <= v < float("inf"), "a finite number >= 0")


def add_hash_arguments(parser: argparse.ArgumentParser) -> None:
    """``--hash-algorithm`` and ``--hash-shared``, read back by :func:`hasher_from_args`. The root seed is
    never an option (it would show in the process list and the shell history): ``$KVPOOL_HASH_SEED``."""
    from kvpool.allocators.hashing import ALGORITHMS

    parser.add_argument("--hash-algorithm", choices=ALGORITHMS, default="auto",
                        help="block hash digest (auto: sha256 when shared, else xxh3_128 if installed)")
    parser.add_argument("--hash-shared", action="store_true",
                        help="hashes leave the process (a shared tier, events): root from $KVPOOL_HASH_SEED")


def hasher_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~kvpool.allocators.hashing.BlockHasher` the :func:`add_hash_arguments` options ask for."""
    from kvpool.allocators.hashing import BlockHasher

    return BlockHasher(args.hash_algorithm, shared=args.hash_shared)


def describe_hasher(info: dict[str, Any]) -> str:
    """One line for a human: ``sha256, root seeded (KVPOOL_HASH_SEED), shared``."""
    seeded = f"root seeded ({info['seed_source']})" if info["seeded"] else "public root (no seed)"
    return f"{info['algorithm']}, {seeded}, {'shared' if info['shared'] else 'process-local'}"


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse without the usage block on errors: bad input gives one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

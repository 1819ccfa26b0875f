"""Argument types shared by the subcommands (the conventions of their flags: :mod:`kvpool.cli.options`)."""

from __future__ import annotations

import argparse
import difflib
import itertools
import os
import re
import sys
import textwrap
from collections.abc import Callable
from typing import Any, NoReturn

from kvpool import units
from kvpool.cli.options import (  # noqa: F401 - the vocabulary, re-exported for the subcommands
    JSON_HELP,
    CommaList,
    DeprecatedAlias,
    add_deprecated_alias,
    add_json_argument,
    bounded_int,
    non_negative_int,
    positive_int,
)
from kvpool.numeric import SEED_MAX


def parse_bytes(text: str) -> int:
    """``"4GiB"`` -> 4294967296: :func:`kvpool.units.parse_bytes` as an argparse type."""
    try:
        return units.parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: A size option's value that asks for a measurement instead (``--kv-memory auto``).
AUTO = "auto"


def bytes_or_auto(text: str) -> int | str:
    """:func:`parse_bytes`, or :data:`AUTO` as written (a size measured at run time)."""
    return AUTO if text == AUTO else parse_bytes(text)


#: A device memory size written as a bare number below this many bytes is refused (1 MiB: no GPU, and no
#: model's weights, is that small, so ``--gpu-memory 80`` means 80 GiB, not the 80 bytes it says).
UNITLESS_MEMORY_MIN = 2**20


def memory_bytes(text: str) -> int:
    """A device memory size (:func:`parse_bytes`); a bare number from 1 to :data:`UNITLESS_MEMORY_MIN` - 1
    (``80``) is refused as a missing unit. ``0`` and ``80B`` (bytes written out) are taken as written."""
    value = parse_bytes(text)
    if text.strip().isdigit() and 0 < value < UNITLESS_MEMORY_MIN:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit, so it is {units.plural(value, 'byte')}, less than any GPU or model; "
            f"write {text.strip()}GiB (binary units: KiB, MiB, GiB, TiB), or {text.strip()}B for bytes")
    return value


def seed(text: str) -> int:
    """A seed: an integer in [0, 2**64 - 1] (what ``torch.manual_seed`` takes)."""
    return bounded_int(text, 0, SEED_MAX)


def positive_int_list(text: str) -> list[int]:
    """``"5000,10000"`` -> [5000, 10000]: integers >= 1, comma-separated, none repeated."""
    values = [positive_int(part.strip()) for part in text.split(",")]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
    return values


def id_list(text: str) -> list[int]:
    """``"0,7"`` -> [0, 7]: integers >= 0, comma-separated."""
    return [non_negative_int(part.strip()) for part in text.split(",")]


def word_list(text: str) -> list[str]:
    """``"lru,lfu"`` -> ["lru", "lfu"]: non-empty names, comma-separated, none repeated."""
    values = [part.strip() for part in text.split(",")]
    if not all(values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} must be distinct names separated by commas")
    return values


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
    """argparse without the usage block on errors: bad input gives one line on stderr and exit status 2.
    Its subcommand parsers are OneLineErrorParsers too, and every parser shows defaults in ``--help``.

    * Options are written out in full: an abbreviation (``--max-new-token``) is an unknown option, as if
      argparse were built with ``allow_abbrev=False``, and the error names the option meant. (argparse, and so
      vLLM's and SGLang's servers, take any unambiguous prefix; kvpool does not, so that a script's option
      never changes meaning when a later release adds an option with the same prefix.)
    * A value that starts with a minus sign and a digit is the option's value (``--gpu-memory -5GiB`` as
      ``--gpu-memory=-5GiB``), so the option's own check says what is wrong with it; argparse reads such a
      word as an unknown option unless it is a plain number, and says ``expected one argument``.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def add_subparsers(self, **kwargs: Any) -> Any:
        self._commands = True  # the words from the command on are its parser's to judge
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        argv = _attach_negative_values(sys.argv[1:] if args is None else list(args))
        mine = argv
        if getattr(self, "_commands", False):  # up to the command (these parsers' options take no value)
            mine = list(itertools.takewhile(lambda word: word.startswith("-"), argv))
        self._refuse_unknown(mine)  # before argparse's own errors (a missing positional), which it causes
        namespace, extras = super().parse_known_args(argv, namespace)
        self._refuse_unknown(extras)
        return namespace, extras

    def _refuse_unknown(self, words: list[str]) -> None:
        """Exit 2 naming the first word of ``words`` (up to ``--``) that is an option this parser lacks: a
        word argparse reads as an option (a leading ``-``; not ``-`` alone, a negative value or words with a
        space), whose name before any ``=`` is not in argparse's table of this parser's option strings."""
        known = self._option_string_actions
        for word in words:
            if word == "--":
                return
            if word.startswith("-") and word != "-" and " " not in word and not NEGATIVE.match(word) \
                    and word.split("=")[0] not in known:
                option = word.split("=")[0]
                close = difflib.get_close_matches(option, [s for s in known if s.startswith("--")], n=1)
                hint = f" (did you mean {close[0]}? options are never abbreviated)" if close else ""
                self.error(f"unknown option {option}{hint}")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


#: A word that is a value, not an option, though it starts with a minus sign: ``-5``, ``-5GiB``, ``-.5``.
NEGATIVE = re.compile(r"-\.?\d")


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``["--gpu-memory", "-5GiB"]`` -> ``["--gpu-memory=-5GiB"]``: a negative-looking word after an option
    (that has no ``=value`` already) becomes its value; nothing changes after ``--``."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        last = out[-1] if out else ""
        if NEGATIVE.match(arg) and last.startswith("-") and "=" not in last and not NEGATIVE.match(last):
            out[-1] = f"{last}={arg}"
        else:
            out.append(arg)
    return out


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` that shows every option's default: ``(default: X)`` is appended to a help text that does
    not name its default already, unless the default is None, False, an empty list or suppressed."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or any(default is x for x in (None, False, argparse.SUPPRESS)) \
                or not action.option_strings or default in ([], ()):  # identity: 0 and 0.0 are shown
            return text  # an empty list (no ids given) says no more than None
        shown = " ".join(map(str, default)) if isinstance(default, list) else "%(default)s"
        return f"{text} (default: {shown})"

    def _split_lines(self, text: str, width: int) -> list[str]:
        """argparse's wrapping, without breaking a word at a hyphen: a name (``tiny-granite-4.0-h``,
        ``--max-new-tokens``) stays whole on one line, as a reader searching the help types it."""
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False)

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, CommaList):  # one comma list (a space list only parses, for old scripts)
            return str(self._metavar_formatter(action, default_metavar)(1)[0])
        return super()._format_args(action, default_metavar)


#: The torch CPU threads every command that runs torch uses unless told otherwise (see add_threads_argument).
DEFAULT_THREADS = 1


def threads(text: str) -> int:
    """A torch thread count: 0 (torch's own) up to 4 x this machine's CPUs (``torch.set_num_threads`` of a
    huge count starts that many OpenMP threads at the first parallel op: the machine runs out of memory)."""
    return bounded_int(text, 0, 4 * (os.cpu_count() or 1))


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``, the one convention of every command that runs torch: N >= 1 threads (at most 4 per
    CPU), or 0 for torch's own default (one per core). The default is 1: on a small machine busy with other
    work, more intra-op threads wait for the busy cores and run several times slower (docs/benchmarks.md)."""
    parser.add_argument("--threads", type=threads, default=DEFAULT_THREADS, metavar="N",
                        help="torch CPU threads, at most 4 per CPU; 0 = torch's own (one per core)")


def apply_threads(args: argparse.Namespace) -> int:
    """Set torch's CPU threads from ``--threads`` (0 leaves torch's setting); returns the count in use."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.get_num_threads()

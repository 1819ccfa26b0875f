"""The one vocabulary of kvpool's command-line options, shared by :mod:`kvpool.cli` and the
:mod:`kvpool.bench` suites (argparse actions and types; standard library and :mod:`kvpool.numeric`).

It lives with the command line but sits at the ground (``tests/test_layers.py`` ranks it apart from the rest
of :mod:`kvpool.cli`): the bench suites, beneath the command line, declare their options with it, and
:mod:`kvpool.cli` itself imports nothing above the ground when it is imported.

Conventions every subcommand keeps (``tests/test_cli.py`` walks every parser and checks them):

* a list is one comma-separated value (``--sweep 5000,10000``, ``--sizes 1024,32768``), its metavar
  ``X,...`` (:class:`CommaList`; a space list of the older bench options still parses, with a warning);
* every option that takes a value names it in capitals: ``N`` a count, ``BYTES`` a size with a binary
  unit (``4GiB``; :func:`kvpool.cli._args.parse_bytes`), ``S`` seconds, ``B`` a block size, ``NAME``,
  ``PATH``, ``DIR``, ``URL``, ``ENDPOINT`` (or the choices); a count of blocks is ``--...-blocks N``, a
  size in memory ``--...-memory BYTES`` or ``--...-bytes BYTES``;
* a default is shown as ``(default: X)`` (:class:`kvpool.cli._args.HelpFormatter` adds it where the help
  does not);
* ``--json`` prints one JSON object on one line (``kvpool events``: one per event, one a line);
* one concept has one name in every command (vLLM's replay socket is ``--kv-events-replay``); an older
  spelling keeps working as a hidden alias that says on stderr what to write instead
  (:func:`add_deprecated_alias`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.numeric import INT64_MAX, SEED_MAX


def bounded_int(text: str, minimum: int, maximum: int) -> int:
    """``text`` as an integer in [minimum, maximum] (an argparse type, given its bounds).

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of range (the message names the range).
    """
    try:
        value = int(text) if len(text) <= 40 else None  # int() of thousands of digits raises anyway
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value is None or not minimum <= value <= maximum:
        shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"
        named = {INT64_MAX: "2**63 - 1", SEED_MAX: "2**64 - 1"}.get(maximum)
        raise argparse.ArgumentTypeError(f"{shown!r} must be an integer in [{minimum}, {maximum}]"
                                         if named is None else f"{shown!r} must be an integer >= "
                                         f"{minimum} (at most {named})")
    return value


def positive_int(text: str) -> int:
    """An integer in [1, 2**63 - 1]."""
    return bounded_int(text, 1, INT64_MAX)


def non_negative_int(text: str) -> int:
    """An integer in [0, 2**63 - 1]."""
    return bounded_int(text, 0, INT64_MAX)


# ---- the vocabulary: JSON, lists, old spellings ------------------------------------------------------------

JSON_HELP = "print one JSON object on one line"


def add_json_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, per_event: bool = False
                      ) -> None:
    """``--json``: one JSON object on one line (``per_event``: one per event, one a line)."""
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per event, one a line" if per_event else JSON_HELP)


def _warn(parser: argparse.ArgumentParser, message: str) -> None:
    print(f"{parser.prog}: warning: {message}", file=sys.stderr)


class DeprecatedAlias(argparse.Action):
    """A hidden older spelling of an option: stores into the current option's ``dest`` (converted by its
    ``type``) and says on stderr which spelling to use."""

    def __init__(self, option_strings: list[str], dest: str, *, current: str, **kwargs: Any) -> None:
        self.current = current
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _warn(parser, f"{option_string} is deprecated: use {self.current}")
        setattr(namespace, self.dest, values)


def add_deprecated_alias(parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str,
                         current: argparse.Action) -> None:
    """Keep ``old`` working for the option ``current`` (an action ``add_argument`` returned): hidden from
    ``--help``, same destination, type and value count, with a deprecation line on stderr."""
    if isinstance(current, CommaList):
        parser.add_argument(old, dest=current.dest, action=_DeprecatedList, current=current,
                            help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        return
    same: dict[str, Any] = {k: v for k, v in (("type", current.type), ("choices", current.choices)) if v}
    parser.add_argument(old, dest=current.dest, action=DeprecatedAlias, current=current.option_strings[0],
                        nargs=current.nargs, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **same)


class CommaList(argparse.Action):
    """A list option: one comma-separated value (``--sizes 1024,32768``), each item converted by ``item``
    (an argparse type) and, with ``allowed``, one of those. A space list (``--sizes 1024 32768``, the older
    spelling of the bench options) still parses, with a deprecation line on stderr."""

    def __init__(self, option_strings: list[str], dest: str, *, item: Callable[[str], Any] = str,
                 allowed: Sequence[Any] | None = None, **kwargs: Any) -> None:
        self.item, self.allowed = item, allowed
        kwargs["nargs"] = "+"
        super().__init__(option_strings, dest, **kwargs)

    def parse(self, values: list[str]) -> list[Any]:
        items = []
        for text in (part.strip() for value in values for part in value.split(",")):
            try:
                item = self.item(text)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise argparse.ArgumentError(self, f"{text!r}: {exc}") from None
            if self.allowed is not None and item not in self.allowed:
                names = ", ".join(map(str, self.allowed))
                raise argparse.ArgumentError(self, f"{text!r} is not one of {names}")
            items.append(item)
        return items

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if len(values) > 1:
            _warn(parser, f"{option_string} {' '.join(values)} (a space list) is deprecated: write "
                          f"{option_string} {','.join(values)}")
        setattr(namespace, self.dest, self.parse(values))


class _DeprecatedList(argparse.Action):
    """The older spelling of a :class:`CommaList` option."""

    def __init__(self, option_strings: list[str], dest: str, *, current: CommaList, **kwargs: Any) -> None:
        self.current = current
        kwargs["nargs"] = "+"
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _warn(parser, f"{option_string} is deprecated: use {self.current.option_strings[0]}")
        setattr(namespace, self.dest, self.current.parse(values))

"""How kvpool reads and writes quantities for people: counts with their noun, byte sizes with binary units.

* :func:`plural`: ``plural(1, "head") == "1 head"``, ``plural(8, "head") == "8 heads"`` (thousands separated).
* :func:`human_bytes`: ``1181116006`` -> ``"1.10 GiB"`` (binary units, 2 decimals; exact below 1 KiB); a
  negative count keeps its sign, and sizes past the float range are written as a power of two.
* :func:`parse_bytes`: ``"80GiB"`` -> ``85899345920``: an integer, or a decimal number with a binary suffix
  B, KiB, MiB, GiB, TiB (case-insensitive), giving a whole number of bytes within int64. Decimal units
  (``80GB``), exponents, hex, underscores and signs are rejected (:class:`ValueError` saying why).
"""

from __future__ import annotations

import re
from fractions import Fraction

from kvpool.numeric import INT64_MAX

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_NAMES = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, with an ``s`` unless ``n`` is 1 (nouns whose plural is not ``+s`` are not used)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def human_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps the number >= 1: ``"512 B"``, ``"1.10 GiB"``."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    if n < 1024:
        return f"{sign}{n} B"
    exponent = min((n.bit_length() - 1) // 10, len(_NAMES) - 1)
    if n >> (10 * exponent) >= 2**50:  # past EiB by far: no float needed to say how big
        return f"{sign}~2^{n.bit_length() - 1} B"
    return f"{sign}{n / 1024**exponent:.2f} {_NAMES[exponent]}"


def parse_bytes(text: str) -> int:
    """``text`` as a whole number of bytes (the module docstring's format); ValueError saying why not."""
    match = _BYTES.match(text)
    unit = match.group(2).lower() if match else None
    if match is None and _BYTES.match(text.strip().removeprefix("-")):
        raise ValueError(f"{text!r} is negative: a byte count is 0 or more")
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a byte count (e.g. 80GiB, 512MiB, 1073741824)")
    if len(match.group(1)) > 40:  # past int64 whatever the unit (and past Python's int-parsing limit)
        raise ValueError(f"{text[:20]!r}... ({len(text)} characters) is more bytes than int64 holds")
    value = Fraction(match.group(1)) * _UNITS[unit]
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    if value > INT64_MAX:
        raise ValueError(f"{text!r} is more bytes than int64 holds")
    return int(value)

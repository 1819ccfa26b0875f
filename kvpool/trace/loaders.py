"""Load real serving traces: Mooncake JSONL (with prefix-block hash ids) and Azure LLM inference CSV.

Both loaders return a :class:`Trace` of :class:`TraceRequest` rows in file order, arrival times in seconds
from the first row. A malformed row raises :class:`TraceFormatError` naming the file and line, or is skipped
and counted (``Trace.skipped``) with ``skip_malformed=True``. The two traces kvpool ships as package data
(see ``kvpool/trace/data/README.md`` for sources, licenses and attribution) load with ``load_trace()``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib import resources
from itertools import chain
from pathlib import Path
from typing import Any, TextIO

from kvpool.errors import ConfigError, TraceFormatError
from kvpool.numeric import INT64_MAX, as_int, as_optional_int

#: Tokens per Mooncake hash block: one ``hash_ids`` entry per 512 prompt tokens.
MOONCAKE_BLOCK_SIZE = 512
FORMATS = ("mooncake", "azure")
#: The trace file shipped for each format (package data in ``kvpool/trace/data``).
SHIPPED = {"mooncake": "conversation_trace.jsonl", "azure": "AzureLLMInferenceTrace_code.csv"}
_AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
_EPOCH = datetime(1970, 1, 1)
_chain = chain.from_iterable
_AZURE_TICKS = 10**7  # TIMESTAMP has 7 fractional digits
#: A parsed row: (timestamp in the format's ticks, input tokens, output tokens, hash ids or None[, session]).
_Row = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: arrival time (seconds), prompt and output lengths (tokens), and Mooncake hash ids.

    ``hash_ids`` holds one chained prefix-block id per 512-token prompt block (the last usually partial),
    or None when the trace has no prefix information (Azure). ``session_id``: the conversation or agent
    loop it is a turn of (a Mooncake row's optional ``session_id``, an integer or a string), or None.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None
    session_id: int | str | None = None

    def block_hashes(self, block_size: int) -> list[int]:
        """Hashes of the full ``block_size``-token prompt blocks ([] without hash ids).

        Hash block ``i`` expands into ``k = 512 // block_size`` sub-blocks; sub-block ``j`` gets the packed id
        ``hash_ids[i] * k + j`` (unique per (hash id, j), and the hash id itself at block size 512). Only full
        sub-blocks are returned, so a partial tail is never shared. ``block_size`` must divide 512
        (:class:`ConfigError` otherwise).
        """
        if self.hash_ids is None:
            return []
        k = sub_blocks_per_hash_block(block_size)
        full = self.input_tokens // block_size
        if k == 1:
            return list(self.hash_ids[:full])
        # each hash id's run of sub-block ids is a range, chained in C (no Python loop per sub-block)
        out = list(_chain([range(h * k, h * k + k) for h in self.hash_ids[: -(-full // k)]]))
        del out[full:]
        return out


def sub_blocks_per_hash_block(block_size: int) -> int:
    """``512 // block_size``; raises :class:`ConfigError` unless ``block_size`` divides 512."""
    if block_size < 1 or MOONCAKE_BLOCK_SIZE % block_size:
        raise ConfigError(f"block_size must divide {MOONCAKE_BLOCK_SIZE} for a hash trace, got {block_size}")
    return MOONCAKE_BLOCK_SIZE // block_size


@dataclass(frozen=True)
class Trace:
    """A loaded trace: requests in file order, its source, and how many malformed rows were skipped."""

    requests: list[TraceRequest]
    path: str
    format: str
    skipped: int = 0


def shipped_trace_path(fmt: str = "mooncake") -> Path:
    """Path of the trace kvpool ships for ``fmt`` (Mooncake conversation, or Azure code)."""
    if fmt not in SHIPPED:
        raise ConfigError(f"unknown trace format {fmt!r}; accepted: {', '.join(FORMATS)}")
    return Path(str(resources.files("kvpool.trace").joinpath("data").joinpath(SHIPPED[fmt])))


def detect_format(path: str | Path) -> str:
    """``"mooncake"`` for ``.jsonl`` / ``.json``, ``"azure"`` for ``.csv``; :class:`ConfigError` otherwise."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    if suffix == ".csv":
        return "azure"
    raise ConfigError(f"cannot tell the format of {path} from its suffix; pass --format mooncake|azure")


def load_trace(path: str | Path | None = None, fmt: str | None = None, *, skip_malformed: bool = False,
               max_requests: int | None = None) -> Trace:
    """Load ``path`` (default: the shipped trace of ``fmt``, Mooncake when both are None).

    ``fmt`` defaults to :func:`detect_format`. ``max_requests`` (an int >= 1) keeps the first N valid rows.
    Raises :class:`TraceFormatError` for a malformed row (unless skipped), :class:`ConfigError` for a bad
    format or ``max_requests``, ``OSError`` for an unreadable file.
    """
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"unknown trace format {fmt!r}; accepted: {', '.join(FORMATS)}")
    max_requests = as_optional_int(max_requests, "max_requests", minimum=1, error=ConfigError)
    if path is None:
        path = shipped_trace_path(fmt or "mooncake")
    fmt = fmt or detect_format(path)
    parsed, skipped = _read_rows(path, fmt, skip_malformed, max_requests)
    ticks_per_s = _PARSERS[fmt][2]
    t0 = parsed[0][0] if parsed else 0
    requests = [TraceRequest((t - t0) / ticks_per_s, *rest) for t, *rest in parsed]
    return Trace(requests, str(path), fmt, skipped)


def _read_rows(path: str | Path, fmt: str, skip_malformed: bool, max_requests: int | None
               ) -> tuple[list[_Row], int]:
    """Parsed rows (at most ``max_requests``) and the number of malformed rows skipped."""
    rows, parse, _ = _PARSERS[fmt]
    parsed: list[_Row] = []
    skipped = 0
    # newline="\n": only \n ends a row (\r\n reaches the parser whole, and a lone \r stays inside its row
    # instead of splitting it in two, so line numbers count the file's lines)
    with open(path, newline="\n", encoding="utf-8") as handle:
        try:
            for lineno, raw in rows(handle):
                if max_requests is not None and len(parsed) >= max_requests:
                    break
                try:
                    parsed.append(parse(raw))
                except (ValueError, TypeError, KeyError) as exc:
                    if not skip_malformed:
                        why = f"missing field {exc}" if isinstance(exc, KeyError) else exc
                        raise TraceFormatError(f"{path}:{lineno}: {why}", skippable=True) from None
                    skipped += 1
        except UnicodeDecodeError as exc:
            raise TraceFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parsed, skipped


def _count(value: object, name: str, minimum: int) -> int:
    """A token count or id of a row: an integer in ``[minimum, 2**63 - 1]`` (int64, as everything the pool
    counts); ValueError (the row is malformed) otherwise."""
    return as_int(value, name, minimum=minimum, maximum=INT64_MAX, error=ValueError)


def _mooncake_rows(handle: TextIO) -> Iterator[tuple[int, str]]:
    """(line number, text) per non-blank line."""
    for lineno, line in enumerate(handle, 1):
        if line.strip():
            yield lineno, line


def _mooncake_request(line: str) -> _Row:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a JSON object ({exc.msg})") from None
    except RecursionError:
        raise ValueError("not a JSON object (nested too deeply)") from None
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    stamp = row["timestamp"]
    if not isinstance(stamp, int | float) or isinstance(stamp, bool) or not 0 <= stamp < math.inf:
        raise ValueError(f"timestamp must be a finite number of ms >= 0, got {stamp!r}")
    input_tokens = _count(row["input_length"], "input_length", 1)
    hash_ids = row["hash_ids"]
    if not isinstance(hash_ids, list) or len(hash_ids) != -(-input_tokens // MOONCAKE_BLOCK_SIZE):
        raise ValueError(f"hash_ids must be a list of ceil(input_length / {MOONCAKE_BLOCK_SIZE}) ids")
    for h in hash_ids:
        _count(h, "hash id", 0)
    if len(set(hash_ids)) != len(hash_ids):
        raise ValueError("hash_ids repeat an id (a chained prefix id cannot appear twice in one prompt)")
    session = row.get("session_id")
    if session is not None and not isinstance(session, str):
        session = _count(session, "session_id", 0)
    return stamp, input_tokens, _count(row["output_length"], "output_length", 0), tuple(hash_ids), session


def _azure_rows(handle: TextIO) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) per non-empty data row, after checking the header."""
    reader = csv.reader(handle)
    header = next(reader, None)
    if header != _AZURE_HEADER:
        expected = ",".join(_AZURE_HEADER)
        raise TraceFormatError(f"{handle.name}:1: expected the header {expected}, got {header}")
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:  # a field over csv.field_size_limit(), a NUL byte: this row is malformed
            yield reader.line_num, exc
            continue
        if row:
            yield reader.line_num, row


def _azure_request(row: list[str] | csv.Error) -> _Row:
    if isinstance(row, csv.Error):
        raise ValueError(f"not a CSV row ({row})")
    if len(row) != 3:
        raise ValueError(f"expected 3 fields, got {len(row)}")
    stamp, _, fraction = row[0].strip().partition(".")
    if fraction and not fraction.isdigit():
        raise ValueError(f"bad TIMESTAMP {row[0]!r}")
    whole = (datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S") - _EPOCH) // timedelta(seconds=1)
    ticks = whole * _AZURE_TICKS + int(fraction[:7].ljust(7, "0"))  # exact integer 100 ns ticks
    return ticks, _count(int(row[1]), "ContextTokens", 1), _count(int(row[2]), "GeneratedTokens", 0), None


#: Per format: row reader, row parser, and timestamp ticks per second (Mooncake ms, Azure 100 ns).
_PARSERS: dict[str, tuple[Any, Any, int]] = {
    "mooncake": (_mooncake_rows, _mooncake_request, 1000),
    "azure": (_azure_rows, _azure_request, _AZURE_TICKS),
}

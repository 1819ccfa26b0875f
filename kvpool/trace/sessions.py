"""Sessions in a trace replay: the trace's ``session_id`` on each request, a session opened at its first
turn and closed once its last turn in the trace finishes (as a client that ends the conversation would),
under the replay's session policy (:class:`~kvpool.requests.sessions.SessionPolicy`: ``session`` keeps every
turn while the session is open, ``last=N`` the last N); and the cached-token accounting of the run
(:mod:`kvpool.requests.accounting`) for its report.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError
from kvpool.requests.sessions import SessionPolicy

if TYPE_CHECKING:
    from kvpool.requests.kv_manager import KVCacheManager
    from kvpool.requests.request import Request
    from kvpool.trace.loaders import TraceRequest
    from kvpool.trace.replay_result import ReplayResult

#: A sweep's session mode that keeps no session (the trace's session ids ignored).
NO_SESSIONS = "none"


class ReplaySessions:
    """The sessions of one replay of ``requests`` on ``kv`` (``policy``: a
    :meth:`SessionPolicy.parse` text, or None: the trace's session ids are ignored)."""

    def __init__(self, requests: Sequence[TraceRequest], policy: str | None, kv: KVCacheManager) -> None:
        self.policy = None if policy is None else SessionPolicy.parse(policy)
        self.kv = kv
        kv.sessions.auto_open = self.policy
        self.last: dict[Hashable, int] = {}  # session -> the index of its last turn (latest arrival)
        if self.policy is not None:
            for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival_s):
                if requests[i].session_id is not None:
                    self.last[requests[i].session_id] = i

    def arrive(self, req: Request, trace_req: TraceRequest) -> None:
        """Name ``req``'s session (under a policy)."""
        if self.policy is not None:
            req.session_id = trace_req.session_id

    def finished(self, reqs: Sequence[Request]) -> None:
        """Close the sessions whose last turn is among ``reqs``."""
        sessions = self.kv.sessions
        for req in reqs:
            sid = req.session_id
            if sid is not None and self.last.get(sid) == req.request_id and sessions.is_open(sid):
                sessions.close(sid)

    def end(self) -> dict[str, Any]:
        """Close every session still open (one whose last turn was rejected) and report: ``usage`` (the
        cached-token sums of every admitted request: :meth:`UsageTotals.to_dict`), ``session_policy`` and,
        under one, ``sessions`` (:meth:`SessionCache.report`)."""
        sessions = self.kv.sessions
        for sid in list(self.last):
            if sessions.is_open(sid):
                sessions.close(sid)
        out: dict[str, Any] = {"usage": self.kv.usage.to_dict(), "session_policy": str(self.policy or "")}
        if self.policy is not None:
            out["sessions"] = sessions.report()
        return out


def usage_lines(cache: dict[str, Any]) -> list[str]:
    """:meth:`ReplaySessions.end`'s report as lines of ``kvpool replay``'s text report ([] when empty)."""
    usage = cache.get("usage")
    if not usage:
        return []
    tiers = ", ".join(f"{where} {n:,}" for where, n in usage["cache_read_tokens_by_tier"].items())
    lines = [f"{'cache_read_tokens':<20} {usage['cache_read_tokens']:,} ({tiers})",
             f"{'cache_creation_tokens':<20} {usage['cache_creation_tokens']:,}",
             f"{'uncached_tokens':<20} {usage['uncached_tokens']:,}"]
    sessions = cache.get("sessions")
    if sessions:
        lines.append(f"{'sessions':<20} {cache['session_policy']}: {sessions['opened']:,} opened, "
                     f"{sessions['turns_kept']:,} turns kept, peak {sessions['peak_kept_blocks']:,} blocks "
                     f"kept, {sessions['released_for_room']:,} released for room")
    return lines


def parse_session_modes(names: Sequence[str] | None) -> list[str | None]:
    """``--sessions``: one or more session policies (``session``, ``last=N``) or ``none`` (no sessions), each
    a row of a sweep, in their canonical spelling (``last=01`` is ``last=1``); ``[None]`` when not given.
    ConfigError for a bad or repeated one."""
    if names is None:
        return [None]
    modes = [None if name.strip() == NO_SESSIONS else str(SessionPolicy.parse(name)) for name in names]
    if len(set(modes)) < len(modes):
        raise ConfigError(f"--sessions names a session policy twice: {','.join(names)}")
    return modes


def run_label(policy: str, session_policy: str | None) -> str:
    """A sweep's row for a run: ``policy``, with ``+`` and the run's session policy where it kept sessions
    (``lru+last=1``); the offline bound (``belady``) always by its name."""
    return policy if not session_policy or policy == "belady" else f"{policy}+{session_policy}"


#: :func:`session_rows`' columns.
SESSION_COLUMNS = ("run", "pool blocks", "block hit ratio", "cache read tokens", "cache creation tokens",
                   "uncached tokens", "sessions opened", "turns kept", "peak kept blocks",
                   "released for room")


def session_rows(results: Sequence[ReplayResult]) -> tuple[tuple[str, ...], list[list[object]]]:
    """The report's table of sessions and cached tokens: one row per run (:data:`SESSION_COLUMNS`), its
    accounting sums and, under a session policy, its session counters ("-" without one)."""
    rows: list[list[object]] = []
    for r in results:
        usage, sessions = r.cache.get("usage", {}), r.cache.get("sessions")
        counters = ([sessions["opened"], sessions["turns_kept"], sessions["peak_kept_blocks"],
                     sessions["released_for_room"]] if sessions else ["-"] * 4)
        rows.append([run_label(r.policy, r.cache.get("session_policy")), r.num_blocks, r.block_hit_ratio,
                     usage.get("cache_read_tokens", 0), usage.get("cache_creation_tokens", 0),
                     usage.get("uncached_tokens", 0), *counters])
    return SESSION_COLUMNS, rows

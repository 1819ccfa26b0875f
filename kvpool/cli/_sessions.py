"""``kvpool generate``'s sessions: the prompts run as the turns of one session (a conversation), and the
cached-token accounting of the run.

With ``--session-id ID`` the prompts are the turns of one session, run one after another: turn ``i``'s prompt
is turn ``i - 1``'s prompt and answer followed by prompt ``i``'s tokens (a chat whose every prompt extends
the last), each a request of the session (:mod:`kvpool.requests.sessions`: its full blocks kept pinned while
the session is open, the last ``--keep-turns N`` only where given); the session is closed after the last
turn. Every request reports its ``cache_usage`` (tokens read from the cache by tier, created, uncached), and
the run their sums and, with a session, its counters (:func:`cache_report`, printed as ``kvpool replay``
prints its own: :func:`kvpool.trace.sessions.usage_lines`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvpool.cli.options import non_negative_int
from kvpool.errors import ConfigError
from kvpool.requests.sessions import SessionPolicy

#: ``run(prompt, i)``: the one request of turn ``i`` (prompt token ids), run to completion.
TurnRunner = Callable[[list[int], int], Any]


def add_session_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sessions")
    group.add_argument("--session-id", metavar="ID",
                       help="run the prompts as the turns of one session, one after another: turn i's prompt "
                            "is turn i-1's prompt and answer, then prompt i; every turn's blocks are kept "
                            "pinned while the session is open (closed after the last turn)")
    group.add_argument("--keep-turns", type=non_negative_int, metavar="N",
                       help="with --session-id: keep the last N turns only (default: every turn)")


def check_session_arguments(args: argparse.Namespace) -> None:
    """ConfigError for ``--keep-turns`` without ``--session-id`` (before the model loads)."""
    if args.keep_turns is not None and args.session_id is None:
        raise ConfigError("--keep-turns keeps a session's last turns: give --session-id with it")


def session_policy(args: argparse.Namespace) -> SessionPolicy | None:
    """The session's :class:`SessionPolicy` (``session`` or ``last=N``), None without ``--session-id``."""
    return None if args.session_id is None else SessionPolicy(args.keep_turns)


def run_turns(engine: Any, session_id: str, keep_turns: int | None, prompts: list[list[int]],
              run: TurnRunner) -> list[Any]:
    """Open ``session_id`` on ``engine``, run each of ``prompts`` as a turn (``run(context + prompt, i)``,
    where ``context`` is the previous turn's prompt and output tokens), close the session; returns the
    turns' requests in order."""
    engine.sessions.open(session_id, keep_turns=keep_turns)
    done: list[Any] = []
    context: list[int] = []
    for i, prompt in enumerate(prompts):
        req = run(context + prompt, i)
        done.append(req)
        context = list(req.prompt_token_ids) + list(req.output_token_ids)
    engine.sessions.close(session_id)
    return done


def cache_report(engine: Any, policy: SessionPolicy | None) -> dict[str, Any]:
    """The run's accounting in :meth:`kvpool.trace.sessions.ReplaySessions.end`'s shape: ``usage`` (the sums
    over the admitted requests), ``session_policy`` and, with a session, ``sessions`` (its counters)."""
    out: dict[str, Any] = {"usage": engine.kv_manager.usage.to_dict(), "session_policy": str(policy or "")}
    if policy is not None:
        out["sessions"] = engine.sessions.report()
    return out


def request_usage_line(usage: dict[str, Any]) -> str:
    """One request's :meth:`~kvpool.requests.request.CacheUsage.to_dict` as a line, e.g. ``cache: 16 read
    (device 16), 4 created, 1 uncached``."""
    tiers = ", ".join(f"{where} {n:,}" for where, n in usage["cache_read_tokens_by_tier"].items())
    return (f"cache: {usage['cache_read_tokens']:,} read ({tiers}), "
            f"{usage['cache_creation_tokens']:,} created, {usage['uncached_tokens']:,} uncached")

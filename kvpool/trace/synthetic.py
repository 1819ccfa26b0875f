"""A seeded trace of multi-turn chat and agentic tool loops with shared system prompts, in the Mooncake JSONL
format (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``: one chained id per 512-token
block), for replaying policies on a second workload shape beside the shipped conversation trace (so they
are not judged on one trace only).

The workload: ``system_prompts`` shared system prompts (1 to 8 blocks each, picked by Zipf popularity,
exponent 1.1); sessions arrive as a Poisson process (``sessions_per_s``); a session is a **chat** (turns
geometric with mean ``chat_turns``, a user message of 50-1,500 tokens and an answer of 50-800 tokens per
turn, think time exponential with mean 30 s) or, with probability ``agent_share``, an **agent loop** (a task
of 200-3,000 tokens, then 3-29 steps, each appending a tool result of 100-2,000 tokens and a 20-300 token
call, 1-8 s apart). Each row names its ``session_id`` (0, 1, ... in the order sessions start). Every turn's
prompt is the session's previous prompt, its answer and the new text: its full 512-token blocks keep their
ids, the rest get fresh ones (so a follow-up hits everything the previous turn computed, as a prefix cache
would see it). With ``one_off_share`` > 0 (default 0), that share of the arrivals is instead a request of
no session: a document of 2,000-16,000 tokens that nothing else shares (a scan through the cache).
Requests are written in arrival order until ``requests``.

``python -m kvpool.trace.synthetic OUT.jsonl [--seed N] [--requests N]`` writes one; ``kvpool replay
OUT.jsonl`` replays it.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.trace.loaders import MOONCAKE_BLOCK_SIZE

BLOCK = MOONCAKE_BLOCK_SIZE


@dataclass(frozen=True)
class WorkloadShape:
    """The knobs of :func:`generate` (defaults: the shape described in the module docstring)."""

    requests: int = 10_000
    system_prompts: int = 6
    sessions_per_s: float = 0.5
    agent_share: float = 0.4
    chat_turns: float = 4.0
    one_off_share: float = 0.0


@dataclass
class _Session:
    """A session's state: its prompt so far as full-block ids plus a partial tail of ``tail`` tokens."""

    sid: int
    blocks: list[int]
    tokens: int
    agent: bool
    left: int
    ids: Iterator[int] = field(repr=False)
    started: bool = False

    def prompt(self, added: int) -> tuple[int, list[int]]:
        """Append ``added`` tokens: the new prompt's length and hash ids (full blocks kept, fresh ids for
        the new full blocks and for the partial tail)."""
        self.tokens += added
        full = self.tokens // BLOCK
        while len(self.blocks) < full:
            self.blocks.append(next(self.ids))
        tail = [next(self.ids)] if self.tokens % BLOCK else []
        return self.tokens, self.blocks + tail


def generate(seed: int = 0, shape: WorkloadShape = WorkloadShape()) -> list[dict[str, object]]:
    """The trace's rows (Mooncake JSON objects) in arrival order."""
    rng, ids = random.Random(seed), itertools.count()
    systems = [[next(ids) for _ in range(rng.randrange(1, 9))] for _ in range(shape.system_prompts)]
    weights = [1 / (k + 1) ** 1.1 for k in range(shape.system_prompts)]
    events: list[tuple[float, int, _Session]] = []  # (time s, tie-break, session): the next turn's arrival
    order, sessions = itertools.count(), itertools.count()
    t = 0.0
    rows: list[dict[str, object]] = []
    while len(rows) < shape.requests:
        t_next_session = t + rng.expovariate(shape.sessions_per_s)
        while events and events[0][0] <= t_next_session and len(rows) < shape.requests:
            now, _, session = heapq.heappop(events)
            rows.append(_turn(rng, session, now))
            if session.left > 0:
                think = rng.uniform(1, 8) if session.agent else rng.expovariate(1 / 30)
                heapq.heappush(events, (now + think, next(order), session))
        t = t_next_session
        if len(rows) >= shape.requests:
            break
        if shape.one_off_share and rng.random() < shape.one_off_share:
            rows.append(_one_off(rng, ids, t))
            continue
        system = rng.choices(systems, weights)[0]
        agent = rng.random() < shape.agent_share
        extra_turns = rng.expovariate(1 / max(shape.chat_turns - 1, 1e-9))  # geometric-like, mean chat_turns
        turns = rng.randrange(4, 31) if agent else 1 + int(extra_turns)
        session = _Session(next(sessions), list(system), len(system) * BLOCK, agent, turns, ids)
        heapq.heappush(events, (t, next(order), session))
    return rows


def _one_off(rng: random.Random, ids: Iterator[int], now: float) -> dict[str, object]:
    """A request of no session at ``now``: a document of 2,000-16,000 tokens no other request shares."""
    length = rng.randrange(2000, 16001)
    return {"timestamp": round(now * 1000), "input_length": length, "output_length": rng.randrange(50, 301),
            "hash_ids": [next(ids) for _ in range(-(-length // BLOCK))]}


def _turn(rng: random.Random, session: _Session, now: float) -> dict[str, object]:
    """The session's next request at ``now``: the new text appended, an answer drawn."""
    if session.agent:  # the task first, then a tool result per step
        added = rng.randrange(100, 2001) if session.started else rng.randrange(200, 3001)
        output = rng.randrange(20, 301)
    else:
        added, output = rng.randrange(50, 1501), rng.randrange(50, 801)
    length, hash_ids = session.prompt(added)
    session.started = True
    session.left -= 1
    session.tokens += output  # the answer joins the next prompt
    return {"timestamp": round(now * 1000), "input_length": length, "output_length": output,
            "hash_ids": hash_ids, "session_id": session.sid}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.trace.synthetic",
                                     description="Write a seeded chat + agent-loop trace (Mooncake JSONL).")
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--requests", type=int, default=WorkloadShape.requests,
                        help=f"requests to write (default: {WorkloadShape.requests})")
    parser.add_argument("--one-off-share", type=float, default=0.0, metavar="P",
                        help="share of arrivals that are one-off documents of no session (default: 0)")
    args = parser.parse_args(argv)
    if args.requests < 1 or not 0 <= args.one_off_share <= 1:
        print("error: --requests must be >= 1 and --one-off-share in [0, 1]", file=sys.stderr)
        return 2
    rows = generate(args.seed, WorkloadShape(requests=args.requests, one_off_share=args.one_off_share))
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows):,} requests to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sessions and cache control on the request path: what a request asks the pool to keep after it ends.

Two requests' handles, both built on the pool's pins (:meth:`BlockPool.pin`: a pin is a reference the pool
holds, so a pinned block is never evicted and is never freed while pinned):

* **Sessions** (a multi-turn conversation, an agent's loop): a request names its ``session_id``, a session
  opened first (:meth:`SessionCache.open`). When a request of an open session finishes, its **turn** is kept:
  the full blocks it published (its whole prefix: a later hit needs it from the first block) are pinned for
  the session. So while a session is open its blocks rank above the blocks of no session: those are
  evicted first, by the pool's policy. ``keep_turns=N`` keeps the last N turns only: the blocks that only
  older turns held (a context an agent rewrote or cut) drop back to normal priority (cached free, the
  policy decides). In a conversation whose every prompt extends the last, the last turn holds everything,
  so ``N = 1`` keeps as much as every turn does. :meth:`SessionCache.close` drops every pin the session
  holds (a dereference: a block another request or session also holds stays in use, and the released blocks
  stay cached until the policy evicts them), as SGLang's session-scoped radix cache does
  (``--enable-session-radix-cache``, PR #27058) and TensorRT-LLM's ``per_conversation`` reuse with
  ``max_num_turns``.
* **Retention with a duration** (a cache breakpoint with a time to live, like Anthropic's
  ``cache_control`` ttl): a request's ``retain`` (:class:`Retention`) keeps the full blocks of a token
  range of its prompt and outputs, pinned through the ``steps`` scheduler steps that follow the one it
  finished in (one :meth:`Scheduler.schedule` is one step; a replay's batched decode steps count one
  each), then they drop back to normal priority. The duration is in steps, not seconds, so that the
  engine and a replay (whatever its clock) keep a range alike.

What is kept is a priority, not a promise: the pins share the pool's pin cap (``pin_cap``), and when the
pool runs short (a request cannot be admitted or cannot grow) kept turns and ranges are released, before any
request is preempted or left waiting (:meth:`SessionCache.make_room`): the oldest range, or the turns of
the session whose last turn ended longest ago, newest turn first (a hit needs the head of the prefix). A
turn that does not fit under the pin cap releases kept ones so, or is kept in part (its first blocks).
Without prefix caching nothing is kept (sessions still open and close).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.errors import ConfigError, InvalidIdError, PinLimitError
from kvpool.numeric import as_optional_int
from kvpool.requests.request import Request, Retention

__all__ = ["Retention", "SessionCache", "SessionPolicy", "SessionStats"]


class KVManagerLike(Protocol):
    """What a :class:`SessionCache` reads of its :class:`~kvpool.requests.kv_manager.KVCacheManager`."""

    @property
    def caching(self) -> bool: ...

    @property
    def block_size(self) -> int: ...

    @property
    def pool(self) -> Any: ...

    @property
    def coordinator(self) -> Any: ...


@dataclass(frozen=True)
class SessionPolicy:
    """How a replay keeps sessions: every turn while open (``keep_turns`` None: ``"session"``) or the last
    N turns (``"last=N"``). :meth:`parse` reads the command line's form."""

    keep_turns: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_turns", as_optional_int(self.keep_turns, "keep_turns", minimum=0,
                                                               error=ConfigError))

    @classmethod
    def parse(cls, text: str) -> SessionPolicy:
        """``"session"`` or ``"last=N"`` (N >= 0); ConfigError otherwise."""
        text = str(text).strip()
        if text == "session":
            return cls()
        name, _, n = text.partition("=")
        if name != "last" or not n.strip().isdigit():
            raise ConfigError(f"session policy must be 'session' or 'last=N' with N >= 0, got {text!r}")
        return cls(int(n))

    def __str__(self) -> str:
        return "session" if self.keep_turns is None else f"last={self.keep_turns}"


@dataclass
class _Holding:
    """Blocks pinned for one kept turn or range: their ids, the hash each held when pinned (a block that
    lost it was unpinned by the pool already), the session (None: a range), when it expires (None: never)."""

    ids: list[int]
    hashes: list[Hashable]
    session: Hashable | None
    expires: int | None = None


@dataclass
class _Session:
    keep_turns: int | None
    turns: deque[int] = field(default_factory=deque)  # holding keys, oldest first


@dataclass
class SessionStats:
    """Counters: sessions ``opened`` and ``closed``, ``turns`` and ``ranges`` kept, holdings ``released``
    to make room (or for the pin cap), ``expired`` ranges, ``dropped_turns`` (past ``keep_turns``), and
    ``peak_blocks`` (the most distinct blocks kept at once)."""

    opened: int = 0
    closed: int = 0
    turns: int = 0
    ranges: int = 0
    released: int = 0
    expired: int = 0
    dropped_turns: int = 0
    peak_blocks: int = 0


class SessionCache:
    """The sessions and retained ranges of one :class:`~kvpool.requests.kv_manager.KVCacheManager` (its
    ``sessions``). See the module docstring."""

    def __init__(self, kv: KVManagerLike) -> None:
        self._kv = kv
        self._sessions: dict[Hashable, _Session] = {}
        self._holdings: OrderedDict[int, _Holding] = OrderedDict()  # oldest first
        self._pins: dict[int, int] = {}  # block -> pins this cache holds on it
        self._expiry: list[tuple[int, int]] = []  # heap of (step, holding key)
        self._next = 0
        self.step = 0
        #: A replay's policy for sessions it opens on a request's first use (None: a request must name an
        #: open session).
        self.auto_open: SessionPolicy | None = None
        self.stats = SessionStats()

    # ---- sessions ------------------------------------------------------------------------------------

    def open(self, session_id: Hashable, *, keep_turns: int | None = None) -> None:
        """Open ``session_id``, keeping every turn (None) or the last ``keep_turns``.

        Raises:
            InvalidIdError: the session is open already, or the id is not hashable.
            InvalidArgumentError: ``keep_turns`` not an integer >= 0.
        """
        keep = as_optional_int(keep_turns, "keep_turns", minimum=0)
        if not isinstance(session_id, Hashable) or session_id is None:
            raise InvalidIdError(f"a session id must be hashable and not None, got {session_id!r}")
        if session_id in self._sessions:
            raise InvalidIdError(f"session {session_id!r} is open already")
        self._sessions[session_id] = _Session(keep)
        self.stats.opened += 1

    def close(self, session_id: Hashable) -> int:
        """Close ``session_id``: every pin it holds is dropped (its blocks stay cached, at normal priority;
        a running request of it keeps its own blocks). Returns the pins dropped (a block that k kept turns
        hold counts k times).

        Raises:
            InvalidIdError: no such open session (nothing changes).
        """
        session = self._session(session_id)
        del self._sessions[session_id]
        self.stats.closed += 1
        return sum(self._release(key) for key in session.turns)

    def check(self, req: Request) -> None:
        """At a request's arrival: its ``session_id`` must name an open session (one is opened under
        :attr:`auto_open`). Raises InvalidIdError (nothing changes) otherwise."""
        sid = req.session_id
        if sid is None or sid in self._sessions:
            return
        if self.auto_open is None:
            raise InvalidIdError(f"request {req.request_id!r} names session {sid!r}, which is not open")
        self.open(sid, keep_turns=self.auto_open.keep_turns)

    def is_open(self, session_id: Hashable) -> bool:
        return session_id in self._sessions

    @property
    def num_open(self) -> int:
        return len(self._sessions)

    @property
    def num_kept_blocks(self) -> int:
        """Distinct blocks the sessions and ranges pin now."""
        return len(self._pins)

    def _session(self, session_id: Hashable) -> _Session:
        try:
            return self._sessions[session_id]
        except (KeyError, TypeError):
            raise InvalidIdError(f"no open session {session_id!r}") from None

    # ---- a request's end -------------------------------------------------------------------------------

    def finished(self, req: Request) -> None:
        """``req`` finished and still holds its blocks: keep its session's turn and its retained range."""
        kv = self._kv
        if not kv.caching or (req.session_id is None and req.retain is None):
            return
        n = kv.coordinator.num_published_blocks(req.request_id)
        hashes = req.block_hashes[:n]
        session = self._sessions.get(req.session_id) if req.session_id is not None else None
        if session is not None:
            for key in session.turns:  # the session was active last: its turns are released last
                self._holdings.move_to_end(key)
            if n and session.keep_turns != 0:
                key = self._hold(hashes, 0, n, req.session_id, None)
                if key is not None:
                    session.turns.append(key)
                    self.stats.turns += 1
            while session.keep_turns is not None and len(session.turns) > session.keep_turns:
                self._release(session.turns.popleft())
                self.stats.dropped_turns += 1
        r = req.retain
        if r is not None and r.steps > 0:
            bs = kv.block_size
            first, last = -(-r.start // bs), min(r.end // bs, n)
            if first < last and self._hold(hashes, first, last, None, self.step + r.steps) is not None:
                self.stats.ranges += 1

    def _hold(self, hashes: Sequence[Hashable], start: int, end: int, session: Hashable | None,
              expires: int | None) -> int | None:
        """Pin the blocks of positions ``[start, end)`` of the prefix ``hashes`` (every group's); the
        holding's key, or None when nothing could be pinned."""
        ids = self._positions(hashes, start, end)
        pool = self._kv.pool
        while ids:
            try:
                pool.pin(ids)
                break
            except PinLimitError:
                if not self._release_oldest():
                    ids = ids[:max(pool.max_pinned_blocks - pool.num_pinned_blocks, 0)]  # the first that fit
        if not ids:
            return None
        for b in ids:
            self._pins[b] = self._pins.get(b, 0) + 1
        self.stats.peak_blocks = max(self.stats.peak_blocks, len(self._pins))
        key, self._next = self._next, self._next + 1
        self._holdings[key] = _Holding(ids, pool.block_hashes_of(ids), session, expires)
        if expires is not None:
            heapq.heappush(self._expiry, (expires, key))
        return key

    def _positions(self, hashes: Sequence[Hashable], start: int, end: int) -> list[int]:
        """The non-null blocks at prefix positions ``[start, end)`` of a hit of ``hashes[:end]``."""
        coord = self._kv.coordinator
        hit = coord.find_longest_cache_hit(list(hashes[:end]), count=False)
        null = coord.null_block
        return [b for blocks in hit.blocks for b in blocks[start:hit.num_blocks] if b != null]

    def _release(self, key: int) -> int:
        """Drop one holding's pins (the blocks that still hold the hash they were pinned with); returns
        how many."""
        holding = self._holdings.pop(key, None)
        if holding is None:
            return 0
        pool = self._kv.pool
        now = pool.block_hashes_of(holding.ids)
        ids = [b for b, h, h2 in zip(holding.ids, holding.hashes, now, strict=True)
               if h is not None and h == h2]
        for b in holding.ids:
            left = self._pins[b] - 1
            if left:
                self._pins[b] = left
            else:
                del self._pins[b]
        if ids:
            pool.unpin(ids)
        return len(ids)

    def _release_oldest(self) -> bool:
        """Release the oldest holding: a range, or the newest turn of the session active longest ago (its
        first turns, the head of its prefix, go last); False when none is left."""
        if not self._holdings:
            return False
        key, holding = next(iter(self._holdings.items()))
        session = self._sessions.get(holding.session) if holding.session is not None else None
        if session is not None and session.turns:
            key = session.turns.pop()
        self._release(key)
        self.stats.released += 1
        return True

    # ---- pressure and time --------------------------------------------------------------------------

    def make_room(self, need: int) -> bool:
        """Whether ``need`` blocks are free, after releasing the oldest holdings when the pool is short and
        releasing them all would make enough room (they are not released for nothing)."""
        pool = self._kv.pool
        short = need - pool.num_free_blocks
        if short <= 0:
            return True
        if not self._holdings:
            return False
        gain = sum(1 for b, n in self._pins.items() if pool.ref_count(b) == n)
        if gain < short:
            return False
        while pool.num_free_blocks < need and self._release_oldest():
            pass
        return pool.num_free_blocks >= need

    def release_all(self) -> int:
        """Release every kept turn and range (the sessions stay open); returns the holdings released."""
        n = 0
        while self._release_oldest():
            n += 1
        return n

    @property
    def num_holdings(self) -> int:
        """Kept turns and ranges now."""
        return len(self._holdings)

    def tick(self, steps: int = 1) -> None:
        """``steps`` scheduler steps passed: ranges whose time is up drop back to normal priority."""
        self.step += steps
        expiry = self._expiry
        while expiry and expiry[0][0] < self.step:
            _, key = heapq.heappop(expiry)
            if key in self._holdings:
                self._release(key)
                self.stats.expired += 1

    def report(self) -> dict[str, Any]:
        """JSON-ready: the counters, the sessions open and the blocks kept now."""
        s = self.stats
        return {"opened": s.opened, "closed": s.closed, "open": self.num_open, "turns_kept": s.turns,
                "ranges_kept": s.ranges, "released_for_room": s.released, "expired": s.expired,
                "dropped_turns": s.dropped_turns, "kept_blocks": self.num_kept_blocks,
                "peak_kept_blocks": s.peak_blocks}


"""``Request``: one request's state on the request path, the same object for the engine and the replay.

A request is its prompt, what it has generated, its chained block hashes and how far its KV is computed.
The engine gives token ids (``prompt_token_ids``; outputs are appended as they are sampled and hashed as
their blocks fill); a trace replay knows only counts and the trace's prefix hashes (``prompt_token_ids``
None, ``num_prompt_tokens`` and ``block_hashes`` given, outputs counted). Everything else is the same, so
the scheduler and the KV cache manager never ask which one they hold.

Counts are tokens unless named otherwise. The last sampled token is never written into the KV cache: a
request that ends with ``max_tokens`` outputs holds KV for ``num_prompt_tokens + max_tokens - 1`` tokens
at most (:attr:`Request.max_kv_tokens`).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import InvalidArgumentError
from kvpool.numeric import as_id_list, as_int


@dataclass(frozen=True)
class CacheUsage:
    """One request's prompt tokens by what the cache did for them (:mod:`kvpool.requests.accounting`).

    ``read_tokens``: place -> tokens read from the cache there (``device`` always present).
    """

    read_tokens: Mapping[str, int]
    creation_tokens: int
    uncached_tokens: int

    @property
    def cache_read_tokens(self) -> int:
        """Prompt tokens served from the cache, every place together."""
        return sum(self.read_tokens.values())

    @property
    def cache_creation_tokens(self) -> int:
        """Prompt tokens computed and written to the prefix cache."""
        return self.creation_tokens

    @property
    def prompt_tokens(self) -> int:
        """read + creation + uncached: the request's prompt tokens."""
        return self.cache_read_tokens + self.creation_tokens + self.uncached_tokens

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``cache_read_tokens``, ``cache_read_tokens_by_tier``, ``cache_creation_tokens``,
        ``uncached_tokens``."""
        return {"cache_read_tokens": self.cache_read_tokens,
                "cache_read_tokens_by_tier": dict(self.read_tokens),
                "cache_creation_tokens": self.creation_tokens, "uncached_tokens": self.uncached_tokens}


@dataclass(frozen=True)
class Retention:
    """Keep the full blocks of tokens ``[start, end)`` of a request (prompt, then outputs) through the
    ``steps`` scheduler steps after the one it finished in. Only the blocks it published count (a block is
    kept when the range covers it whole); a range is worth keeping from token 0: a later hit needs the
    prefix.

    Raises:
        InvalidArgumentError: a bound or duration that is not an integer >= 0, or ``end <= start``.
    """

    end: int
    steps: int
    start: int = 0

    def __post_init__(self) -> None:
        for name in ("end", "steps", "start"):
            object.__setattr__(self, name, as_int(getattr(self, name), f"retention {name}", minimum=0))
        if self.end <= self.start:
            raise InvalidArgumentError(f"retention range [{self.start}, {self.end}) is empty")


class RequestStatus(enum.Enum):
    """WAITING (queued, holds no blocks) -> RUNNING (holds blocks) -> FINISHED or ABORTED; a preempted
    request goes back to WAITING."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """One request (compared by identity).

    Args:
        request_id: its id: the key of its block tables in the KV cache manager (any hashable).
        prompt_token_ids: the prompt's token ids, or None for a request known by counts only (a trace's).
        max_tokens: output tokens to generate (>= 0; 0: a prefill-only request, which samples nothing).
        num_prompt_tokens: the prompt's length when ``prompt_token_ids`` is None (derived otherwise).
        block_hashes: the chained hashes of its full blocks known so far (the KV cache manager extends
            them as token ids arrive; a trace gives its prompt's).
        unit_hashes: the chained hashes of its full match units, for hits finer than a block
            (:mod:`kvpool.requests.partial_hits`: extended from token ids as needed; a trace gives its
            prompt's); empty without a match unit.
        arrival_s: when it arrived (seconds, the caller's clock).
        priority: its retention priority for the ``priority`` eviction policy (higher = kept longer).
        stop_token_ids: tokens that end it before ``max_tokens`` (the engine's EOS).
        params: the engine's sampling parameters (opaque here).
        generator: the engine's random generator (opaque here).
        keep_logits: keep the logits row ``[V]`` of every sampled token in :attr:`logits` (tests).
        session_id: the open session it belongs to, or None (:mod:`kvpool.requests.sessions`).
        retain: a :class:`Retention` (a token range kept for some steps after it finishes), or None.

    After its first admission, :attr:`cache_usage` holds its prompt tokens read from the cache by tier,
    written to it, and neither (:class:`CacheUsage`).

    Raises:
        InvalidArgumentError: a count that is not an integer >= 0 (``num_prompt_tokens`` >= 1), token ids
            that are not integers, an unhashable ``session_id``, or a ``retain`` that is not a Retention.
    """

    request_id: Hashable
    prompt_token_ids: list[int] | None
    max_tokens: int
    num_prompt_tokens: int = -1
    block_hashes: list[Hashable] = field(default_factory=list)
    arrival_s: float = 0.0
    priority: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    params: Any = None
    generator: Any = None
    keep_logits: bool = False
    unit_hashes: list[Hashable] = field(default_factory=list)
    session_id: Hashable | None = None
    retain: Retention | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # tokens of the prefix hit at its first admission; -1 until admitted
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    logits: list[Any] | None = None
    cache_usage: CacheUsage | None = None

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            self.prompt_token_ids = as_id_list(self.prompt_token_ids, "token ids", error=InvalidArgumentError)
            self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_prompt_tokens = as_int(self.num_prompt_tokens, "num_prompt_tokens", minimum=1)
        self.max_tokens = as_int(self.max_tokens, "max_tokens", minimum=0)
        self.priority = as_int(self.priority, "priority")
        if not isinstance(self.session_id, Hashable):
            raise InvalidArgumentError(f"a session id must be hashable, got {self.session_id!r}")
        if self.retain is not None and not isinstance(self.retain, Retention):
            raise InvalidArgumentError(f"retain must be a Retention, got {self.retain!r}")
        if self.keep_logits and self.logits is None:
            self.logits = []

    @property
    def has_token_ids(self) -> bool:
        """Whether the request carries token ids (the engine's) rather than counts only (a trace's)."""
        return self.prompt_token_ids is not None

    @property
    def token_ids(self) -> list[int]:
        """Prompt then outputs (only for a request with token ids)."""
        if self.prompt_token_ids is None:
            raise InvalidArgumentError(f"request {self.request_id!r} is known by counts only: no token ids")
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus the outputs so far: what a (re)prefill computes."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens whose KV it ever holds: prompt + ``max_tokens - 1`` (the last sampled token is
        never written), the prompt alone for a prefill-only request."""
        return self.num_prompt_tokens + max(self.max_tokens - 1, 0)

    def append_output(self, token: int | None, logits: Any = None) -> bool:
        """Record one sampled token (None: a counted token, for a request without token ids) and its
        logits row (kept with ``keep_logits``); returns whether the request is done (``max_tokens`` outputs,
        or a stop token)."""
        self.num_output_tokens += 1
        if token is not None:
            self.output_token_ids.append(token)
        if self.logits is not None and logits is not None:
            self.logits.append(logits)
        stopped = token is not None and token in self.stop_token_ids
        return self.num_output_tokens >= self.max_tokens or stopped

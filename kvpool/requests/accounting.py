"""Cached-token accounting per request: how many prompt tokens were read from the cache (by tier), how many
were computed and written to it, and how many were computed and not cached.

The split follows the usage fields of the hosted APIs (Anthropic's ``cache_read_input_tokens`` and
``cache_creation_input_tokens``, OpenAI's ``cached_tokens``) and what vLLM reports as
``num_cached_tokens`` (vllm#8333, #44775), taken once, at a request's first admission, in tokens:

* ``read_tokens[place]``: the prefix hit, by where its blocks were found (``device``, then each tier's
  medium: ``host``, ``disk``, ``remote``...); at most the full blocks of the first ``prompt - 1`` tokens
  (the last prompt token is always computed, for its logits);
* ``creation_tokens``: the prompt tokens past the hit that lie in full blocks with a hash (with prefix
  caching): they are computed, then published to the prefix cache;
* ``uncached_tokens``: the rest of the prompt, computed and never cached (the partial last block, or the
  whole prompt without prefix caching or without hashes).

So ``cache_read_tokens + creation_tokens + uncached_tokens == prompt tokens`` for every request (by
construction, and checked by the tests on the engine and on replays). Output tokens are not counted here.
A recomputation after a preemption does not change a request's figures (they describe the first
admission, as ``num_cached_tokens`` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.requests.hit_places import DEVICE
from kvpool.requests.request import CacheUsage, Request

__all__ = ["DEVICE", "CacheUsage", "UsageTotals", "cache_usage"]


def cache_usage(num_prompt_tokens: int, num_hashed_blocks: int, block_size: int, hit_tokens: int,
                hit_blocks_by_place: Mapping[str, int], caching: bool) -> CacheUsage:
    """A request's :class:`CacheUsage` at its first admission.

    Args:
        num_prompt_tokens: its prompt's tokens.
        num_hashed_blocks: the full blocks it has hashes for (its prompt's, at admission).
        block_size: tokens per block.
        hit_tokens: the prefix hit in tokens (``num_computed_tokens`` after admission).
        hit_blocks_by_place: the hit's blocks by where they were found; a tier's share is its blocks x
            ``block_size``, the device gets the rest of ``hit_tokens`` (so the places sum to the hit).
        caching: whether prefix caching is on (off: nothing is created).
    """
    read = {DEVICE: 0}
    for place, blocks in hit_blocks_by_place.items():
        if place != DEVICE:
            read[place] = blocks * block_size
    read[DEVICE] = hit_tokens - sum(read.values())
    cacheable = min(num_hashed_blocks * block_size, num_prompt_tokens) if caching else 0
    creation = max(cacheable - hit_tokens, 0)
    return CacheUsage(read, creation, num_prompt_tokens - hit_tokens - creation)


@dataclass
class UsageTotals:
    """The sums of every request's :class:`CacheUsage` (what the Prometheus counters and a replay's report
    read): ``requests`` accounted, ``read_tokens`` by place, ``creation_tokens``, ``uncached_tokens``."""

    requests: int = 0
    read_tokens: dict[str, int] = field(default_factory=lambda: {DEVICE: 0})
    creation_tokens: int = 0
    uncached_tokens: int = 0

    def account(self, req: Request, block_size: int, hit_tokens: int, hit_blocks_by_place: Mapping[str, int],
                caching: bool) -> None:
        """Set ``req.cache_usage`` at its first admission (:func:`cache_usage` of its prompt and the hashes
        of its full prompt blocks) and add it."""
        hashed = min(len(req.block_hashes), req.num_prompt_tokens // block_size)
        req.cache_usage = cache_usage(req.num_prompt_tokens, hashed, block_size, hit_tokens,
                                      hit_blocks_by_place, caching)
        self.add(req.cache_usage)

    def add(self, usage: CacheUsage) -> None:
        self.requests += 1
        for place, n in usage.read_tokens.items():
            self.read_tokens[place] = self.read_tokens.get(place, 0) + n
        self.creation_tokens += usage.creation_tokens
        self.uncached_tokens += usage.uncached_tokens

    @property
    def usage(self) -> CacheUsage:
        """The sums as one :class:`CacheUsage` (its totals and dict are the per-request ones' formulas)."""
        return CacheUsage(self.read_tokens, self.creation_tokens, self.uncached_tokens)

    @property
    def cache_read_tokens(self) -> int:
        return self.usage.cache_read_tokens

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready sums (the keys of :meth:`CacheUsage.to_dict`, plus ``requests``)."""
        return {"requests": self.requests, **self.usage.to_dict()}

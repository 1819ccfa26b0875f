"""A kvpool eviction policy holding the chunks of an engine's offload tier, keyed by the engine's keys.

vLLM's CPU offload tier (``CPUOffloadingManager``) owns a fixed pool of ``capacity`` chunks and asks a
``CachePolicy`` which ones to evict. :class:`OffloadPolicy` answers with a kvpool
:class:`~kvpool.allocators.policies.EvictionPolicy` (``lru``, ``fifo``, ``lfu``, ``slru``, ``priority``,
``arc``, ``arc-vllm``), whose block ids are the chunk ids, calling it exactly as a kvpool
:class:`~kvpool.allocators.block_pool.BlockPool` does for the same events:

========================================  ==========================================================
engine event                              what the pool does (the policy calls it makes)
========================================  ==========================================================
``on_store_miss`` (keys to be stored)     ``missed``: ``missed(key)`` of each, tail first, before
                                          the eviction that makes room for them
``insert`` (a store allocated a chunk)    ``cache_blocks``: ``published(chunk, key)``
``mark_evictable`` (ref count -> 0)       ``free``: ``insert(chunk, priority)``
``mark_non_evictable`` (a load began)     ``pin``: ``remove(chunk)`` (no hit)
``access`` (a ``touch``, a request's end)  ``touch`` then ``free`` of each key, tail first: ``hit`` (for
                                          a reuse, not for a key the request only stored), and for an
                                          evictable chunk ``remove`` + ``insert``
``remove`` (a failed store)               ``evict_blocks``: ``dropped(chunk)``
``evict(n, protected)``                   ``pin`` the protected evictable chunks, ``allocate`` (``pop`` n
                                          times), ``unpin`` them in the order they became evictable
``clear``                                 a fresh policy (ghost lists and counts forgotten)
========================================  ==========================================================

So kvpool's pins are the engine's ``mark_non_evictable``: a chunk being read is out of the eviction order
until it is evictable again. ``priority`` is the retention priority the last storing or accessing request
gave the chunk (only the ``priority`` policy reads it). Every call is O(1) or O(log n) in the chunks, as the
policy's own calls; ``evict`` adds O(p log p) for the p protected chunks it holds aside. ``evict`` is atomic:
when fewer than ``n`` unprotected chunks are evictable it returns None and changes nothing.

Chunk ids come from the engine's own chunk pool (``0 <= chunk_id < capacity``) and are not checked again on
this hot path; a chunk is any object with a ``chunk_id`` (vLLM's ``ChunkStatus``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

from kvpool.allocators.policies import EvictionPolicy
from kvpool.numeric import as_int


class OffloadPolicy:
    """``capacity`` chunks of an offload tier in the order of the policy ``make()`` builds.

    Args:
        capacity: the tier's chunks (vLLM's ``num_chunks``).
        make: builds a fresh, unbound policy (called again by :meth:`clear`).

    Raises:
        InvalidArgumentError: ``capacity`` not an integer >= 0; the policy's own errors from ``make``.
    """

    def __init__(self, capacity: int, make: Callable[[], EvictionPolicy]) -> None:
        self.capacity = as_int(capacity, "capacity", minimum=0)
        self._make = make
        self.clear()

    def clear(self) -> None:
        """Forget every chunk and start a fresh policy."""
        n = self.capacity
        self.policy = self._make()
        self.policy.bind(n)
        self.chunks: dict[Hashable, Any] = {}
        self._key: list[Hashable | None] = [None] * n
        self._evictable = bytearray(n)
        self._priority = [0] * n
        self._freed = [0] * n  # when each chunk last became evictable (orders the held-aside ones)
        self._clock = 0

    def __len__(self) -> int:
        """Chunks held (evictable or not)."""
        return len(self.chunks)

    @property
    def num_evictable(self) -> int:
        return len(self.policy)

    def get(self, key: Hashable) -> Any | None:
        return self.chunks.get(key)

    def insert(self, key: Hashable, chunk: Any, priority: int = 0) -> None:
        """A store allocated ``chunk`` for ``key``: the key is published (evictable at once only when the
        chunk's ``ref_cnt`` is already 0)."""
        block = chunk.chunk_id
        self.chunks[key] = chunk
        self._key[block] = key
        self._priority[block] = priority
        self.policy.published(block, key)
        if getattr(chunk, "ref_cnt", -1) == 0:
            self._release(block)

    def remove(self, key: Hashable) -> None:
        """Drop ``key`` without an eviction (a failed store); an absent key is ignored."""
        chunk = self.chunks.pop(key, None)
        if chunk is None:
            return
        block = chunk.chunk_id
        self._evictable[block] = 0
        self._key[block] = None
        self.policy.dropped(block)

    def mark_evictable(self, key: Hashable) -> None:
        """``key``'s chunk is no longer read or written (its ref count reached 0)."""
        self._release(self.chunks[key].chunk_id)

    def mark_non_evictable(self, key: Hashable) -> None:
        """``key``'s chunk is being read: out of the eviction order (a pin)."""
        block = self.chunks[key].chunk_id
        self._evictable[block] = 0
        self.policy.remove(block)

    def access(self, keys: Sequence[Hashable], priority: int | None = None,
               hits: Collection[Hashable] | None = None) -> None:
        """A request used ``keys`` (head first): each present one that is evictable rejoins the order as if
        freed again, tail first (so the head is evicted last, as a request frees its blocks), and each in
        ``hits`` (None: every key) is a hit first. ``priority`` (None: keep) becomes the chunks' retention
        priority."""
        chunks, policy, evictable = self.chunks, self.policy, self._evictable
        for key in reversed(keys):
            chunk = chunks.get(key)
            if chunk is None:
                continue
            block = chunk.chunk_id
            if priority is not None:
                self._priority[block] = priority
            if hits is None or key in hits:
                policy.hit(block)
            if evictable[block]:
                policy.remove(block)
                self._release(block)

    def missed(self, keys: Sequence[Hashable]) -> None:
        """``keys`` (head first) missed and are about to be stored: the policy observes each absent one,
        tail first, before the eviction that makes room (ARC adapts its target to a ghost)."""
        chunks, policy = self.chunks, self.policy
        for key in reversed(keys):
            if key not in chunks:
                policy.missed(key)

    def set_priority(self, keys: Collection[Hashable], priority: int) -> None:
        """Give the present ``keys`` retention priority ``priority`` (applied when next made evictable)."""
        for key in keys:
            chunk = self.chunks.get(key)
            if chunk is not None:
                self._priority[chunk.chunk_id] = priority

    def evict(self, n: int, protected: Collection[Hashable]) -> list[tuple[Hashable, Any]] | None:
        """Remove and return ``n`` evictable chunks ``(key, chunk)`` in the policy's order, none of them in
        ``protected``; None (nothing changed) when fewer than ``n`` unprotected chunks are evictable."""
        if n <= 0:
            return []
        chunks, evictable = self.chunks, self._evictable
        held = [c.chunk_id for key in protected
                if (c := chunks.get(key)) is not None and evictable[c.chunk_id]]
        if len(self.policy) - len(held) < n:
            return None
        held.sort(key=self._freed.__getitem__)
        policy = self.policy
        for block in held:
            policy.remove(block)
        victims = [policy.pop() for _ in range(n)]
        for block in held:
            self._release(block)
        out = []
        for block in victims:
            key = self._key[block]
            self._key[block] = None
            evictable[block] = 0
            out.append((key, chunks.pop(key)))
        return out

    def order(self) -> list[Hashable]:
        """The evictable keys, next victim first (O(n log n); for tests and inspection)."""
        return [self._key[b] for b in self.policy.order()]

    def _release(self, block: int) -> None:
        self._clock += 1
        self._freed[block] = self._clock
        self._evictable[block] = 1
        self.policy.insert(block, self._priority[block])

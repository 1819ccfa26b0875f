"""Policies that read the prefix tree or the waiting queue, on the pool's
:class:`~kvpool.allocators.policies.EvictionPolicy` interface:

* :class:`TLRUPolicy` (``tlru``): Tail-Optimized LRU (arXiv 2510.15152), as SGLang 0.5.23's ``tlru``
  orders its radix tree's nodes, a block for a node;
* :class:`LineagePolicy` (``lineage``): kvpool's own, for conversations and agent loops: a block is worth
  the number of requests its prefix has already carried (its generation), aged by recency;
* :class:`QueueInformedPolicy` (``queue-lru``, ``queue-lineage``): any policy, keeping the blocks that a
  waiting request will hit (vLLM RFC #48485).

``tlru`` and ``lineage`` read a request's sequence from its ``free`` call (:meth:`EvictionPolicy.released`:
the request's block table, tail first, as the KV manager frees it): the position of a block in that call is
its depth in the tree. A pool whose caller frees blocks otherwise (one at a time, or several KV cache groups
interleaved) gives them shallower trees: ``tlru`` then treats every block as a tail, ``lineage`` every
call as a request of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Final

from librt.vecs import vec
from mypy_extensions import u8

from kvpool.allocators.arrays import extend_to, grown_u8
from kvpool.allocators.block_lists import BlockLists, LevelQueues
from kvpool.allocators.policy_base import SEQ_SPAN, EvictionPolicy, LRUPolicy
from kvpool.errors import InvalidArgumentError
from kvpool.numeric import IntArg, RealArg, as_int, as_real

_SAFE: Final = 0
_UNSAFE: Final = 1


class TLRUPolicy(EvictionPolicy):
    """Tail-Optimized LRU (Zhang, Li, Moallemi and Peng, "Tail-Optimized Caching for LLM Inference",
    arXiv 2510.15152), as SGLang 0.5.23's ``TLRUStrategy`` (``sglang/srt/mem_cache/evict_policy.py``)
    ranks its radix tree's nodes, with one block for a node. A conversation whose branch reached ``L``
    blocks (its high-water depth: the deepest block ever published below, never lowered when the tail is
    evicted) and whose next prompt adds ``next_prompt_estimate`` blocks needs only its first ``L +
    next_prompt_estimate - threshold`` blocks cached to prefill its next turn within the TTFT budget of
    ``threshold`` blocks; a block at depth ``d`` (0 for a sequence's first) is "TEL-safe" when ``d >= max(L +
    next_prompt_estimate - threshold, 0)``. TEL-safe blocks are evicted first, least recently freed first;
    then the others, least recently freed first (the paper's two phases; SGLang's priority ``(-1 if safe
    else 0, last access)``). With ``threshold <= next_prompt_estimate`` nothing is ever TEL-safe and it is
    LRU, which SGLang refuses; here too.

    Units are blocks, as in the paper (SGLang takes tokens: multiply by its page size). Depths come from a
    request's ``free`` call (see the module docstring). O(1) per block.

    Raises:
        InvalidArgumentError: a negative count, or ``threshold <= next_prompt_estimate``.
    """

    name = "tlru"

    def __init__(self, threshold: IntArg = 64, next_prompt_estimate: IntArg = 16) -> None:
        super().__init__()
        self.threshold = as_int(threshold, "threshold", minimum=0)
        self.next_prompt_estimate = as_int(next_prompt_estimate, "next_prompt_estimate", minimum=0)
        if self.threshold <= self.next_prompt_estimate:
            raise InvalidArgumentError(f"tlru needs threshold > next_prompt_estimate (else nothing is ever "
                                       f"TEL-safe and it is LRU), got {threshold} <= {next_prompt_estimate}")
        self._lists = BlockLists(0, 2)
        self._unsafe: vec[u8] = vec[u8]()
        self._cached: vec[u8] = vec[u8]()

    def grow(self, capacity: int) -> None:
        self._lists.grow(capacity)
        self._unsafe = grown_u8(self._unsafe, capacity)
        self._cached = grown_u8(self._cached, capacity)

    def published(self, block: int, block_hash: Hashable) -> None:
        self._cached[block] = 1
        self._unsafe[block] = 0

    def released(self, blocks: list[int], evictable: list[int], priority: int) -> None:
        """Mark the request's blocks that its depth makes not TEL-safe (a mark is never lifted: ``L`` only
        grows), then queue the evictable ones."""
        cached, n = self._cached, len(blocks)
        deepest = 0  # blocks up to the deepest published one: this request's part of L
        for i in range(n):
            if cached[blocks[i]]:
                deepest = n - i
                break
        budget = deepest + self.next_prompt_estimate - self.threshold  # blocks at depth < budget keep
        unsafe = self._unsafe
        for i in range(max(0, n - budget), n):  # positions n-1-i < budget
            unsafe[blocks[i]] = 1
        for block in evictable:
            self.insert(block, priority)

    def insert(self, block: int, priority: int) -> None:
        self._lists.append(_UNSAFE if self._unsafe[block] else _SAFE, block)

    def remove(self, block: int) -> None:
        self._lists.unlink(block)

    def pop(self) -> int:
        lists = self._lists
        block = lists.head(_SAFE) if lists.sizes[_SAFE] else lists.head(_UNSAFE)
        lists.unlink(block)
        self._cached[block] = 0
        return block

    def dropped(self, block: int) -> None:
        if self._lists.linked[block]:
            self._lists.unlink(block)
        self._cached[block] = 0

    def is_safe(self, block: int) -> bool:
        """Whether ``block`` is TEL-safe now (for inspection)."""
        return not self._unsafe[block]

    def order(self) -> list[int]:
        return self._lists.items(_SAFE) + self._lists.items(_UNSAFE)

    def __len__(self) -> int:
        return self._lists.sizes[_SAFE] + self._lists.sizes[_UNSAFE]


class LineagePolicy(EvictionPolicy):
    """Evict the blocks whose prefix has carried the fewest requests, aged by recency: kvpool's policy for
    conversations and agent loops, where a prefix that one more turn extended is likely to be extended
    again (on the shipped Mooncake trace a request is followed up with probability 0.31 after its first
    turn and 0.5-0.8 after its third and later), while one-off prompts are evicted before they push out
    those prefixes.

    Each cached block has a **generation**: a request's generation is 1 + the largest generation among the
    blocks it reuses (its prefix hits, and blocks it recomputes whose hash the policy remembers), and the
    blocks it publishes get it. A shared system prompt has generation 1, a conversation's first turn 2, its
    k-th turn k + 1. When a request frees its blocks (:meth:`released`), each evictable one is queued at
    level ``min(generation, max_level)`` and keyed ``level x span + freed``, ``freed`` counting blocks
    freed so far: the lowest key goes first, so one level is worth ``span`` freed blocks of recency, and an
    old, long prefix nobody extends any more does not stay forever. The cap keeps a finished agent loop
    (dozens of generations) from outliving everything else by dozens of spans.

    ``span`` follows the trace (``reuse_aging`` > 0): ``reuse_aging`` x (the running mean of how many
    blocks were freed between a lineage block's (generation >= 2) free and its reuse, less LRU's reach),
    at least 0 (every level at offset 0: the order is LRU's). The distance is sampled once a request at
    its deepest reused lineage block (a hit, or a hash the ghost remembers with the free it left at);
    LRU's reach is how many frees a block outlives under recency alone, ``num_blocks x frees /
    evictions`` (each eviction makes room for one free; the others are frees of blocks a hit revived),
    counted over about the last ``num_blocks`` evictions. So a level buys only the recency LRU would not
    give: where conversations come back long after (the shipped Mooncake trace: 90% of follow-ups 141 or
    more requests later, far past the pool) a level protects for that long; where turns follow within
    what the pool holds anyway (agent loops, chats answered in seconds) the levels shrink to LRU. Until
    the first eviction and sample the span is ``aging x num_blocks``. ``reuse_aging=0``: a fixed span of
    ``aging x num_blocks``.

    A conversation's next turn often comes after its blocks were evicted, so the policy remembers the
    generation of evicted blocks (the **ghost**, a FIFO of at most ``ghost_ratio x num_blocks`` hashes): not
    of all of them, but of a few per request that any continuation of the request holds, the blocks at
    depth 0, 1, 3, 7, ..., 2^j - 1 of its sequence and its deepest block (about ``log2(length) + 1`` a
    request, so the ghost covers as many requests whatever their length; ``ghost_sample`` k > 0 also
    remembers 1 in k hashes, picked from the hash's value). A request that recomputes an evicted prefix
    learns its generation from the deepest of those it holds. O(levels in use) per evicted block (a FIFO per
    level, :class:`~kvpool.allocators.block_lists.LevelQueues`: the smallest head of the levels), O(1) per
    ghost entry, O(log length) per free call for the marks. :meth:`valued`: the block was reused (hit, or
    recomputed from a remembered hash) since it was published.

    Raises:
        InvalidArgumentError: ``aging`` not a number > 0, ``ghost_ratio`` or ``reuse_aging`` < 0,
            ``ghost_sample`` < 0, ``max_level`` < 1.
    """

    name = "lineage"

    def __init__(self, aging: RealArg = 4.0, ghost_ratio: RealArg = 1.0, ghost_sample: IntArg = 0,
                 max_level: IntArg = 16, reuse_aging: RealArg = 1.0) -> None:
        super().__init__()
        self.aging = as_real(aging, "aging", minimum=0.0, open_min=True, finite=True)
        self.ghost_ratio = as_real(ghost_ratio, "ghost_ratio", minimum=0.0, finite=True)
        self.ghost_sample = as_int(ghost_sample, "ghost_sample", minimum=0)
        self.max_level = as_int(max_level, "max_level", minimum=1)
        self.reuse_aging = as_real(reuse_aging, "reuse_aging", minimum=0.0, finite=True)
        self._distance = 0.0
        self._queues = LevelQueues(False)
        self._gen: list[int] = []
        self._reused: vec[u8] = vec[u8]()
        self._mark: vec[u8] = vec[u8]()  # 1: remembered in the ghost when evicted
        self._hash: list[Hashable | None] = []
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost_cap = 0
        self._span = 1
        self._freed = 0
        self._frees = 0.0  # over about the last num_blocks evictions: LRU's reach
        self._evictions = 0.0

    def _bound(self, num_blocks: int) -> None:
        self._ghost_cap = int(self.ghost_ratio * num_blocks)
        self._span = max(1, int(self.aging * num_blocks))
        levels = self.max_level + 1
        self._queues.offsets = [level * self._span for level in range(levels)]
        self._distance = self._span / self.reuse_aging if self.reuse_aging > 0.0 else 0.0  # reuses move it

    def grow(self, capacity: int) -> None:
        self._queues.grow(capacity)
        extend_to(self._gen, capacity, 0)
        self._reused = grown_u8(self._reused, capacity)
        self._mark = grown_u8(self._mark, capacity)
        extend_to(self._hash, capacity, None)

    def _sampled(self, block_hash: Hashable) -> bool:
        if not self.ghost_sample:
            return False
        key = block_hash[-1] if type(block_hash) is tuple else block_hash  # a KV cache group's (g, hash)
        if type(key) is int:
            return key % self.ghost_sample == 0
        if type(key) is bytes:
            return int.from_bytes(key[-4:], "little") % self.ghost_sample == 0
        return hash(key) % self.ghost_sample == 0

    def published(self, block: int, block_hash: Hashable) -> None:
        remembered = self._ghost.pop(block_hash, 0) if self._ghost else 0
        gen = remembered // SEQ_SPAN
        if gen:
            self._queues.stamp[block] = remembered % SEQ_SPAN  # when it was last freed
        self._gen[block] = gen
        self._reused[block] = 1 if gen else 0
        self._hash[block] = block_hash

    def hit(self, block: int) -> None:
        self._reused[block] = 1

    def released(self, blocks: list[int], evictable: list[int], priority: int) -> None:
        """The call is a request: its generation is 1 + the largest it reused; its new blocks take it, and
        every evictable block is keyed by it. Its blocks at depth 2^j - 1 and its deepest are marked for the
        ghost."""
        gen, top, n, mark = self._gen, 0, len(blocks), self._mark
        if n:
            mark[blocks[0]] = 1  # the deepest (the call is tail first)
        depth = 0
        while depth < n:
            mark[blocks[n - 1 - depth]] = 1
            depth = 2 * depth + 1
        sampled = False
        for block in blocks:
            g = gen[block]
            if g > top:
                top = g
            if g >= 2 and not sampled:  # the deepest reused lineage block: how long ago it was freed
                sampled = True
                self._reused_after(self._freed - self._queues.stamp[block])
        generation, stamps = top + 1, self._queues.stamp
        for block in blocks:
            if gen[block] == 0 and self._hash[block] is not None:
                gen[block] = generation
                stamps[block] = self._freed
        level, queues = min(generation, self.max_level), self._queues
        for block in evictable:
            self._freed += 1
            queues.push(block, level, self._freed)
        self._frees += len(evictable)

    def _reused_after(self, freed: int) -> None:
        """A lineage block was reused ``freed`` blocks after its free: with ``reuse_aging``, one level is
        worth ``reuse_aging`` x (the running mean of those distances, the last 32 or so, less LRU's reach
        ``num_blocks x frees / evictions``), at least 0; unchanged until the first eviction."""
        if self.reuse_aging <= 0.0 or freed <= 0:
            return
        self._distance += (freed - self._distance) / 32.0
        if self._evictions <= 0.0:
            return  # nothing evicted yet: LRU's reach is not known
        reach = self._n * self._frees / self._evictions
        self._span = span = max(0, int(self.reuse_aging * (self._distance - reach)))
        offsets = self._queues.offsets
        for level in range(len(offsets)):
            offsets[level] = level * span

    def insert(self, block: int, priority: int) -> None:
        self._freed += 1
        self._frees += 1.0
        self._queues.push(block, min(max(self._gen[block], 1), self.max_level), self._freed)

    def remove(self, block: int) -> None:
        self._queues.discard(block)

    def pop(self) -> int:
        block = self._queues.pop()
        self._evictions += 1.0
        if self._evictions > self._n:  # a window of about num_blocks evictions
            self._evictions *= 0.5
            self._frees *= 0.5
        key = self._hash[block]
        if self._ghost_cap and key is not None and (self._mark[block] or self._sampled(key)):
            ghost = self._ghost
            ghost[key] = self._gen[block] * SEQ_SPAN + self._queues.stamp[block]
            ghost.move_to_end(key)
            if len(ghost) > self._ghost_cap:
                ghost.popitem(False)
        self._forget(block)
        return block

    def dropped(self, block: int) -> None:
        self._queues.discard(block)
        self._forget(block)

    def _forget(self, block: int) -> None:
        self._gen[block] = 0
        self._mark[block] = 0
        self._hash[block] = None

    def generation(self, block: int) -> int:
        """The generation of cached ``block`` (0: published, not freed yet)."""
        return self._gen[block]

    def valued(self, block: int) -> bool:
        return bool(self._reused[block])

    def order(self) -> list[int]:
        return self._queues.order()

    def __len__(self) -> int:
        return len(self._queues)


class QueueInformedPolicy(EvictionPolicy):
    """``base``'s order, except that a cached block whose hash a waiting request will look up is kept
    from eviction while the request waits (vLLM RFC #48485, queue-informed eviction): it leaves ``base`` and
    waits aside, evicted only when ``base`` has nothing left (oldest aside first), and rejoins ``base`` as
    freed now when no waiting request wants it any more. The scheduler tells the pool what waits
    (:meth:`BlockPool.waiting`, which the KV manager calls as requests join and leave the queue). Under
    ``instant`` replay timing nothing ever waits while blocks are evicted, so it evicts as ``base``. O(1)
    per call besides ``base``'s; O(1) per hash a joining or leaving request names.
    """

    reads_waiting = True

    def __init__(self, base: EvictionPolicy) -> None:
        super().__init__()
        if not isinstance(base, EvictionPolicy) or isinstance(base, QueueInformedPolicy):
            raise InvalidArgumentError(f"queue-informed eviction needs a plain policy to wrap, got {base!r}")
        self.base = base
        self.name = f"queue-{base.name}"
        self._wanted: dict[Hashable, int] = {}
        self._holder: dict[Hashable, int] = {}  # hash -> the block the pool published it on first
        self._aside: OrderedDict[int, int] = OrderedDict()  # wanted evictable blocks -> their priority
        self._evictable: vec[u8] = vec[u8]()
        self._hash: list[Hashable | None] = []

    def _bound(self, num_blocks: int) -> None:
        self.base.bind(num_blocks, 0)  # its per-block state grows with this one's

    def grow(self, capacity: int) -> None:
        self.base.grow(capacity)
        self._evictable = grown_u8(self._evictable, capacity)
        extend_to(self._hash, capacity, None)

    def published(self, block: int, block_hash: Hashable) -> None:
        self._hash[block] = block_hash
        self._holder.setdefault(block_hash, block)
        self.base.published(block, block_hash)

    def hit(self, block: int) -> None:
        self.base.hit(block)

    def missed(self, block_hash: Hashable) -> None:
        self.base.missed(block_hash)

    def waiting(self, block_hash: Hashable, count: int) -> None:
        wanted = self._wanted
        before = wanted.get(block_hash, 0)
        now = max(0, before + count)
        if now:
            wanted[block_hash] = now
        elif before:
            del wanted[block_hash]
        block = self._holder.get(block_hash, -1)
        if block < 0 or not self._evictable[block] or (before > 0) == (now > 0):
            return
        if now:  # now wanted: aside
            self.base.remove(block)
            self._aside[block] = 0
        else:  # no longer wanted: back into base, as freed now
            priority = self._aside.pop(block)
            self.base.insert(block, priority)

    def _wanted_block(self, block: int) -> bool:
        h = self._hash[block]
        return h is not None and h in self._wanted and self._holder.get(h) == block

    def released(self, blocks: list[int], evictable: list[int], priority: int) -> None:
        mine = [b for b in evictable if self._wanted_block(b)] if self._wanted else []
        for block in evictable:
            self._evictable[block] = 1
        if mine:
            for block in mine:
                self._aside[block] = priority
            evictable = [b for b in evictable if b not in self._aside]
        self.base.released(blocks, evictable, priority)

    def insert(self, block: int, priority: int) -> None:
        self._evictable[block] = 1
        if self._wanted and self._wanted_block(block):
            self._aside[block] = priority
        else:
            self.base.insert(block, priority)

    def remove(self, block: int) -> None:
        self._evictable[block] = 0
        if self._aside.pop(block, None) is None:
            self.base.remove(block)

    def pop(self) -> int:
        block = self.base.pop() if len(self.base) else self._aside.popitem(False)[0]
        self._evictable[block] = 0
        self._forget(block)
        return block

    def dropped(self, block: int) -> None:
        if self._aside.pop(block, None) is not None:
            self._evictable[block] = 0
        else:
            self._evictable[block] = 0
            self.base.dropped(block)
        self._forget(block)

    def _forget(self, block: int) -> None:
        h = self._hash[block]
        self._hash[block] = None
        if h is not None and self._holder.get(h) == block:
            del self._holder[h]

    def valued(self, block: int) -> bool:
        return self.base.valued(block)

    def order(self) -> list[int]:
        return self.base.order() + list(self._aside)

    def __len__(self) -> int:
        return len(self.base) + len(self._aside)


def prefix_policy(name: str) -> EvictionPolicy:
    """A fresh ``tlru``, ``lineage``, ``queue-lru`` or ``queue-lineage`` (defaults); InvalidArgumentError
    for another name."""
    if name == "tlru":
        return TLRUPolicy()
    if name == "lineage":
        return LineagePolicy()
    if name == "queue-lru":
        return QueueInformedPolicy(_PlainLRU())
    if name == "queue-lineage":
        return QueueInformedPolicy(LineagePolicy())
    raise InvalidArgumentError(f"unknown prefix-tree policy {name!r}")


class _PlainLRU(LRUPolicy):
    """LRU called through the policy interface (the pool's fast path serves only a bare LRUPolicy)."""

    name = "lru"

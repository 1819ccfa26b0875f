"""Block pool with prefix caching: free stack, ref counts, a hash index and an eviction order of the cached
free blocks.

Bookkeeping only (block ids, no KV tensors): every call costs O(1) per block it names (O(log n) under the
heap-ordered eviction policies), independent of the pool size. The per-block state (ref counts, the hash each
block holds, its place in the eviction order) lives in flat vectors of 32- and 64-bit integers that cover
the ids handed out so far and grow in chunks as that high-water mark rises (:mod:`kvpool.allocators.arrays`):
about 32 bytes per block handed out with LRU, nothing for the ids never handed out, so a pool of hundreds of
millions of blocks that holds ten requests costs what those hold; the prefix index is a table of 4-byte slots
over the blocks' hash keys (:mod:`kvpool.allocators.prefix_index`), with no Python object per block for
integer hashes. A pool whose bookkeeping could not fit the machine's available memory once every block is
handed out is refused when it is built. Every block is in exactly one of three sets:

* **uncached free**: ref count 0, no hash; a stack, handed out first. Its bottom, the ids never handed
  out yet, is kept implicit (``[fresh, num_blocks)``, handed out in ascending order once the freed blocks
  above them are gone; below them only the blocks ``reset_prefix_cache`` uncached), so building a pool of
  millions of blocks creates no per-block id;
* **cached free** (evictable): ref count 0, holds a published hash, ordered by the eviction policy
  (:mod:`kvpool.allocators.policies`). The default, ``lru``, is called directly on the fast paths
  (``free`` appends the call's blocks to its tail as one chunk, eviction pops from the head, ``touch``
  revives in place); every other policy is called through its interface;
* **in use**: ref count > 0, with or without a published hash.

**Pins.** ``pin`` keeps cached blocks from eviction: a pin is a reference the pool holds for the caller,
so a pinned block is in use (never free, never evicted) until ``unpin``. At most ``pin_cap`` of the pool's
blocks are pinned at once; a pin past that is refused with :class:`PinLimitError`.

With ``reserve_null_block=True`` block 0 is the **null block**, in none of the three: the id that stands for
"no block" in a block table (a sliding-window table's skipped blocks, vLLM's ``null_block``). It is never
handed out, never counted free, holds no hash, reports ref count 0, and is skipped wherever it appears in
``free``, ``touch``, ``cache_blocks`` or ``evict_blocks`` (repeats of it included).

A block's hash is in the prefix index exactly while the block holds it. Several blocks may hold one hash
(two requests computed the same block at once): each is published and findable, the index maps the hash to
the one published first (what ``lookup`` and ``get_cached_block`` return), and the others wait in publish
order; when that block's hash goes (evicted, ``evict_blocks``), the next one takes its place (vLLM's
``BlockHashToBlockMap``). Every method validates its whole argument before it changes anything, so a call
that raises leaves the pool as it was.

**KV events.** A pool given an ``event_sink`` (:class:`kvpool.events.sink.KVEventSink`) tells it every
change of the prefix index, block by block as vLLM does: each block ``cache_blocks`` publishes
(``BlockStored``; a second block of a hash too), each block whose hash eviction or ``evict_blocks`` drops
(``BlockRemoved``), a ``reset_prefix_cache`` (``AllBlocksCleared``); so a consumer counts each hash's
holders, and a hash is cached while it counts more ``BlockStored`` than ``BlockRemoved``. The sink checks a
call's hashes before anything changes. A pool without a sink records nothing and pays one ``is None`` test
per ``cache_blocks``, eviction, ``evict_blocks`` or reset; ``allocate`` from the free stack and ``free``
pay nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvpool.allocators.pool_core import (
    BLOCK_STATES,
    BYTES_PER_BLOCK,
    CACHED,
    FREE,
    IN_USE,
    NULL,
    PINNED,
    BlockPoolStats,
    EvictionListener,
    _hash_list,
    _head,
    _ints,
    _recorder,
    _require,
)
from kvpool.allocators.pool_prefix import PoolPrefix
from kvpool.allocators.prefix_index import NO_HASH
from kvpool.errors import (
    InvalidArgumentError,
    InvalidIdError,
    PinLimitError,
)
from kvpool.numeric import IntArg, as_id_list, as_int

if TYPE_CHECKING:
    from kvpool.events.sink import KVEventSink

#: The pool and the names of :mod:`kvpool.allocators.pool_core` its users read (the state codes, the stats).
__all__ = ["BLOCK_STATES", "BYTES_PER_BLOCK", "CACHED", "FREE", "IN_USE", "NULL", "PINNED", "BlockPool",
           "BlockPoolStats", "EvictionListener"]


class BlockPool(PoolPrefix):
    """``num_blocks`` KV blocks with ref counts and (when ``enable_caching``) a prefix cache.

    Typical request life: ``lookup`` its block hashes, ``touch`` the hit blocks, ``allocate`` the rest,
    ``cache_blocks`` each block once it is full and its KV is written, and at the end ``free`` all of them
    **tail first** (see :meth:`free`). With ``enable_caching=False`` ``cache_blocks`` and ``lookup`` do
    nothing (``lookup`` returns ``[]``) and freed blocks go straight back to the free stack.

    ``reserve_null_block=True`` reserves block 0 as the null block (see the module docstring):
    ``num_blocks`` still counts it, ``num_free_blocks`` and ``num_used_blocks`` never do, and ``usage`` is
    over the ``num_blocks - 1`` others (as vLLM's ``get_usage``). ``event_sink`` receives the prefix
    index's changes as KV events (see the module docstring).

    ``policy``: the eviction order of cached free blocks, a name of
    :data:`~kvpool.allocators.policies.POLICIES` or a fresh :class:`EvictionPolicy` (default ``"lru"``).
    ``pin_cap``: the largest fraction of the pool (null block aside) that may be pinned at once.
    ``admission``: a :class:`FrequencyAdmission` that ``cache_blocks`` asks before it publishes a new hash
    (None: publish every full block, as vLLM does).

    Ids and counts follow :mod:`kvpool.numeric`: Python ints, numpy ints and 0-d int tensors (converted to
    the int they hold), or a 1-D int tensor / array of ids; never bools.

    Memory: the bookkeeping grows with the blocks handed out (:attr:`capacity` ids are covered: the
    :attr:`high_water_mark` rounded up by chunks of at least ``growth_chunk`` blocks and an eighth,
    :func:`~kvpool.allocators.arrays.next_capacity`), so it is taken as the pool fills, not when it is
    built. A smaller ``growth_chunk`` than the default (16,384) trades more copies for less slack.

    Raises:
        InvalidArgumentError: ``num_blocks`` not an integer, < 1, < 2 with a null block, or past
            :data:`~kvpool.allocators.arrays.MAX_BLOCKS` (block ids are 32-bit); an unknown policy
            (``belady`` included: it needs a trace's future, see :mod:`kvpool.trace.belady`) or one that
            already serves a pool; ``pin_cap`` not in (0, 1]; ``admission`` not a FrequencyAdmission;
            ``growth_chunk`` not an integer >= 1.
        InsufficientMemoryError: the bookkeeping of ``num_blocks`` blocks all in use
            (:data:`BYTES_PER_BLOCK` each) is more than the machine's available memory (one line naming
            both).
    """

    # ---- pins -------------------------------------------------------------------------------------------

    def pin(self, block_ids: Iterable[int]) -> None:
        """Keep cached blocks from eviction: each pin holds one reference on the block until ``unpin``.
        A block may be pinned more than once (each pin is undone by one ``unpin``); a pinned block can still
        be touched, shared and freed by requests as usual. The pin's reference is like a sharer's: a caller
        that frees a block more often than it holds it takes that reference, which the pool cannot tell
        apart (as with any shared block); ``check_integrity`` then reports a pinned block with fewer
        references than pins.

        Raises:
            InvalidIdError: a bad or repeated id, or a block that holds no published hash (only cached
                blocks, in use or cached free, can be pinned).
            PinLimitError: the call would pin more than :attr:`max_pinned_blocks` distinct blocks.
        """
        ids = _ints(block_ids if type(block_ids) is list else as_id_list(block_ids, "block ids"))
        self._check_ids(ids)
        for block in ids:
            if not self._holds(block):
                raise InvalidIdError(f"block {block} holds no cached hash: only cached blocks can be pinned")
        new = sum(1 for block in ids if block not in self._pins)
        if len(self._pins) + new > self._max_pinned:
            raise PinLimitError(
                f"pinning {new} more blocks would pin {len(self._pins) + new}, over the cap of "
                f"{self._max_pinned} (pin_cap {self._pin_cap} of {self._n - self._reserved} blocks)")
        ref, lru, pins = self._ref, self._lru, self._pins
        for block in ids:
            if ref[block] == 0:
                if lru is None:
                    self._policy.remove(block)
                else:
                    lru.remove(block)
            ref[block] += 1
            pins[block] = pins.get(block, 0) + 1

    def pin_prefix(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """Pin the blocks holding ``block_hashes`` (a prefix, e.g. a system prompt's) and return their ids.
        Counts no lookup stats.

        Raises:
            InvalidArgumentError: an unhashable hash.
            InvalidIdError: not every hash of the prefix is cached (nothing is pinned).
            PinLimitError: as :meth:`pin`.
        """
        hashes = block_hashes if isinstance(block_hashes, (list, tuple)) else _hash_list(block_hashes)
        ids = self._match(hashes)
        if len(ids) < len(hashes):
            raise InvalidIdError(f"only {len(ids)} of the prefix's {len(hashes)} blocks are cached: a pin "
                                 "needs every block of the prefix cached")
        self.pin(ids)
        return ids

    def can_pin_prefix(self, block_hashes: Sequence[Hashable]) -> bool:
        """Whether :meth:`pin_prefix` would succeed now: every hash cached and room under the cap."""
        ids = self._match(block_hashes)
        new = sum(1 for block in ids if block not in self._pins)
        return len(ids) == len(block_hashes) and len(set(ids)) == len(ids) and \
            len(self._pins) + new <= self._max_pinned

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Undo one pin of each block (dropping the pin's reference, as :meth:`free` does).

        Raises:
            InvalidIdError: a bad or repeated id, or a block that is not pinned.
        """
        ids = _ints(block_ids if type(block_ids) is list else as_id_list(block_ids, "block ids"))
        self._check_ids(ids)
        pins = self._pins
        for block in ids:
            if block not in pins:
                raise InvalidIdError(f"block {block} is not pinned")
        for block in ids:
            if pins[block] == 1:
                del pins[block]
            else:
                pins[block] -= 1
        self.free(ids)

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks pinned now (each also counted in use)."""
        return len(self._pins)

    @property
    def max_pinned_blocks(self) -> int:
        """The pin cap in blocks: ``int(pin_cap * (num_blocks, null block aside))``."""
        return self._max_pinned

    def pinned_blocks(self) -> dict[int, int]:
        """Pinned block id -> number of pins on it."""
        return dict(self._pins)

    def get_cached_block(self, block_hash: Hashable) -> int | None:
        """The block holding ``block_hash`` (in use or cached free), or None; counts no stats (vLLM's
        ``get_cached_block``). Raises InvalidArgumentError for an unhashable hash."""
        if not self._caching:
            return None
        try:
            block = self._idx.find(block_hash)
        except TypeError:
            raise InvalidArgumentError("block hashes must be hashable") from None
        return block if block >= 0 else None

    # ---- admission --------------------------------------------------------------------------------------

    def num_blocks_to_allocate(self, block_hashes: Sequence[Hashable], num_blocks: IntArg) -> int:
        """Free blocks a request of ``num_blocks`` blocks (prefix hashes ``block_hashes``) would consume:
        ``num_blocks`` minus its cached-prefix blocks that are **in use**. A hit on a cached *free* block
        still consumes a free block (it leaves the free set when touched), as in nano-vllm's ``can_allocate``.
        Does not count stats.

        Raises:
            InvalidArgumentError: ``num_blocks`` negative, or fewer than ``len(block_hashes)``.
        """
        num_blocks = as_int(num_blocks, "num_blocks", minimum=len(block_hashes))
        ref = self._ref
        return num_blocks - sum(1 for block in self._match(block_hashes) if ref[block] > 0)

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` hold no reference: cached free blocks, each of which a ``touch`` takes
        off the free list (a repeated id counts each time). Raises InvalidIdError for an id that is not an
        integer in ``[0, num_blocks)``."""
        ids = _ints(list(block_ids))  # a bool or another type: InvalidIdError
        n, count = self._n, 0
        for b in ids:
            if not 0 <= b < n:
                raise InvalidIdError(f"block ids must be integers in [0, {n}), got {_head(ids)}")
            if self._ref_of(b) == 0:
                count += 1
        return count

    def can_allocate(self, block_hashes: Sequence[Hashable], num_blocks: IntArg) -> bool:
        """Whether :meth:`num_blocks_to_allocate` fits in :attr:`num_free_blocks` right now."""
        return self.num_blocks_to_allocate(block_hashes, num_blocks) <= self.num_free_blocks

    # ---- state ------------------------------------------------------------------------------------------

    def ref_count(self, block_id: IntArg) -> int:
        """References held on ``block_id`` (0 = free). Raises InvalidIdError for a bad id."""
        ids = _ints([block_id])
        self._check_ids(ids)
        return self._ref_of(ids[0])

    def block_hash(self, block_id: IntArg) -> Hashable | None:
        """The published hash ``block_id`` holds, or None. Raises InvalidIdError for a bad id."""
        ids = _ints([block_id])
        self._check_ids(ids)
        return self._idx.hash_of(ids[0]) if self._holds(ids[0]) else None

    def block_hashes_of(self, block_ids: Sequence[int]) -> list[Hashable | None]:
        """The published hash each of ``block_ids`` holds (None where it holds none), in one call; ids may
        repeat. Raises InvalidIdError for an id that is not an integer in ``[0, num_blocks)``."""
        ids = _ints(block_ids if type(block_ids) is list else list(block_ids))
        n, idx = self._n, self._idx
        for b in ids:
            if not 0 <= b < n:
                raise InvalidIdError(f"block ids must be integers in [0, {n}), got {_head(ids)}")
        return [idx.hash_of(b) if self._holds(b) else None for b in ids]

    def attach_event_sink(self, sink: KVEventSink) -> None:
        """Give a pool built without one a KV event sink: a tier's own pool, say. A pool whose prefix index
        holds hashes already announces them first, so the stream describes the index from the start: one
        ``BlockStored`` per hash, in the order of the blocks lookups find for them, with parent None and no
        token ids (the pool keeps neither; a duplicate block under a hash is not a second event).

        Raises:
            InvalidArgumentError: the pool has a sink already, or a hash of its index has no wire form in
                ``sink`` (nothing is recorded and the pool keeps no sink).
        """
        if self._sink is not None:
            raise InvalidArgumentError("this pool has an event sink already")
        held = [self._idx.hash_of(b) for b in self._idx.first_holders()]
        sink.check_publish(held, None, len(held), None, None)
        for block_hash in held:
            sink.stored([block_hash], [0], None, None, None, None)
        self._sink = sink
        self._rec = _recorder(sink)

    def block_states(self) -> bytes:
        """One byte per block, its state now: an index into :data:`BLOCK_STATES` (``FREE`` = 0, ``IN_USE``,
        ``CACHED`` (cached free), ``PINNED``, ``NULL``). O(num_blocks); for pictures of the pool."""
        states = bytearray(map(bool, self._ref))  # IN_USE = 1 where referenced, else FREE = 0
        states += bytes(self._n - len(states))  # the ids past the arrays: never handed out
        for block in self.evictable_blocks():
            states[block] = CACHED
        for block in self._pins:
            states[block] = PINNED
        if self._reserved:
            states[0] = NULL
        return bytes(states)

    def check_integrity(self) -> None:
        """Verify the DESIGN.md invariants in O(high-water mark); raises IntegrityError naming the broken one.

        Free stack, evictable set, in-use set and the null block partition the ids with no id twice; ref
        counts >= 0; free-stack blocks hold no hash; evictable blocks have ref 0 and a hash; the index and the
        per-block hashes agree; the null block has ref 0 and no hash; pinned blocks hold a hash and at
        least one reference per pin, and no more than the cap are pinned; the ids never handed out (past the
        high-water mark: free by construction, never listed) hold nothing. Takes about one byte per block
        besides (the eviction order is walked as a vector of 4-byte ids under LRU).
        """
        ref, idx, fresh, reserved = self._ref, self._idx, self._fresh, self._reserved
        key, capacity = idx.key, len(ref)
        _require(reserved <= fresh <= capacity <= self._n and len(idx.key) == capacity,
                 "the high-water mark or the per-block arrays' length is off")
        _require(all(r >= 0 for r in ref), "a ref count is negative")
        null_ok = ref[0] == 0 and not idx.holds(0) and 0 not in self._free and 0 not in self._tail
        _require(not reserved or null_ok, "the null block is referenced, hashed or free")
        _require(not any(ref[b] or key[b] != NO_HASH for b in range(fresh, capacity)),
                 "an id never handed out is referenced or hashed")
        seen = bytearray(capacity)  # 1: in the free stack, 2: evictable
        free = 0
        for stack in (self._tail, self._free):  # the free stack but for the ids never handed out
            for b in stack:
                _require(reserved <= b < fresh, "a free-stack id is out of range, referenced, or hashed")
                _require(not seen[b], "an id is twice in the free stack")
                seen[b] = 1
                free += 1
                _require(ref[b] == 0 and key[b] == NO_HASH,
                         "a free-stack id is out of range, referenced, or hashed")
        evictable = 0
        for b in (self._lru.live() if self._lru is not None else self._policy.order()):
            _require(reserved <= b < fresh and ref[b] == 0 and key[b] != NO_HASH,
                     "an evictable id is out of range, referenced, or unhashed")
            _require(seen[b] != 1, "an id is both in the free stack and evictable")
            _require(not seen[b], "an id is twice in the eviction order, or its count is off")
            seen[b] = 2
            evictable += 1
        _require(evictable == self.num_evictable_blocks,
                 "an id is twice in the eviction order, or its count is off")
        used = sum(1 for r in ref if r > 0)
        _require(used + free + evictable + reserved == fresh,
                 "free + evictable + in use (+ the null block) != total")
        _require(all(0 <= b < fresh and c >= 1 and ref[b] >= c and idx.holds(b)
                     for b, c in self._pins.items()), "a pinned block is unhashed or has fewer refs than pins"
                 )
        _require(len(self._pins) <= self._max_pinned, "more blocks are pinned than the cap")
        problem = idx.problems()
        _require(not problem, problem)
        _require(self._caching or not len(idx), "caching is off but the index is not empty")

    def __repr__(self) -> str:
        null = ", null_block=0" if self._reserved else ""
        pins = f", pinned={len(self._pins)}" if self._pins else ""
        return (f"BlockPool(num_blocks={self._n}, policy={self._policy.name}, "
                f"free={self._num_uncached_free}, evictable={self.num_evictable_blocks}, "
                f"used={self.num_used_blocks}, cached={self.num_cached_blocks}{pins}{null})")

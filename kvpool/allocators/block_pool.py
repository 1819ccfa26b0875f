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

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from librt.vecs import vec
from mypy_extensions import i32

from kvpool.allocators.arrays import (
    GROWTH_CHUNK,
    MAX_BLOCKS,
    check_fits_memory,
    grown_i32,
    next_capacity,
    release_freed_memory,
)
from kvpool.allocators.policies import EvictionPolicy, FrequencyAdmission, LRUPolicy, make_policy
from kvpool.allocators.prefix_index import NO_HASH, PrefixIndex
from kvpool.errors import (
    DoubleFreeError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    OutOfBlocksError,
    PinLimitError,
)
from kvpool.events.buffer import EventRecorder
from kvpool.numeric import IntArg, RealArg, as_id_list, as_int, as_real
from kvpool.units import plural

#: ``listener(block_ids, block_hashes)``: see :meth:`BlockPool.set_eviction_listener`.
EvictionListener = Callable[[list[int], list[Hashable]], None]

#: What :meth:`BlockPool.block_states` reports per block, by code: ``BLOCK_STATES[code]``.
BLOCK_STATES = ("free", "in use", "cached", "pinned", "null")
FREE, IN_USE, CACHED, PINNED, NULL = range(5)
#: Bookkeeping bytes of one block once handed out, with LRU and prefix caching, what the memory check of
#: :class:`BlockPool` counts for every block of the pool: its ref count (4), the hash key it holds (8), its
#: place in the eviction order (4, and a 4-byte entry of its log) and its share of the prefix index's table
#: (4-byte slots at most 3/4 full, half full on average: 8), plus the arrays' growth margin.
BYTES_PER_BLOCK = 32

if TYPE_CHECKING:
    from kvpool.events.sink import KVEventSink


@dataclass(frozen=True)
class BlockPoolStats:
    """Prefix-cache counters, in blocks. ``hits``/``misses`` are counted by :meth:`BlockPool.lookup` only:
    a lookup of ``k`` hashes whose cached prefix is ``h`` blocks adds ``h`` hits and ``k - h`` misses.
    ``evictions`` counts cached free blocks that ``allocate`` recycled (each lost its hash)."""

    hits: int
    misses: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class BlockPool:
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

    def __init__(self, num_blocks: IntArg, *, enable_caching: bool = True, reserve_null_block: bool = False,
                 event_sink: KVEventSink | None = None, policy: str | EvictionPolicy | object = "lru",
                 pin_cap: RealArg = 0.5, admission: FrequencyAdmission | object = None,
                 growth_chunk: IntArg = GROWTH_CHUNK) -> None:
        num_blocks = as_int(num_blocks, "num_blocks", minimum=2 if reserve_null_block else 1)
        chunk = as_int(growth_chunk, "growth_chunk", minimum=1)
        if num_blocks > MAX_BLOCKS:
            raise InvalidArgumentError(f"num_blocks={num_blocks:,} is past the largest pool, {MAX_BLOCKS:,} "
                                       "blocks (block ids are 32-bit, as kernels' block tables are)")
        pin_cap = as_real(pin_cap, "pin_cap", minimum=0.0, maximum=1.0, open_min=True)
        if admission is not None and not isinstance(admission, FrequencyAdmission):
            raise InvalidArgumentError(f"admission must be a FrequencyAdmission or None, got {admission!r}")
        order = make_policy(policy) if isinstance(policy, str) else policy
        if not isinstance(order, EvictionPolicy):
            raise InvalidArgumentError(f"policy must be a policy name or an EvictionPolicy, got {policy!r}")
        check_fits_memory("a BlockPool", num_blocks, BYTES_PER_BLOCK)
        self._n = num_blocks
        self._caching = enable_caching
        self._reserved = 1 if reserve_null_block else 0  # 1: block 0 is the null block
        self._chunk = chunk
        capacity = min(num_blocks, chunk)  # ids the per-block arrays cover (see _grow)
        self._ref: vec[i32] = grown_i32(vec[i32](), capacity, 0)  # per block: its ref count
        self._idx = PrefixIndex()  # per block: the hash it holds; the prefix index
        self._idx.grow(capacity)
        self._free: list[int] = []  # the stack's top: freed blocks (pop() hands out the last freed)
        self._fresh = self._reserved  # then ids [_fresh, _n), never handed out, 0, 1.. first
        self._tail: list[int] = []  # then these: blocks reset_prefix_cache uncached (pop() first)
        order.bind(num_blocks, capacity)
        if admission is not None:
            admission.bind(num_blocks)
        self._policy = order
        # LRU stays on the fast paths, called directly (its chunk queue: head = evict first); None for any
        # other policy, called through the policy interface
        self._lru: LRUPolicy | None = order if isinstance(order, LRUPolicy) else None
        self._insert_each = _inserts_each(order)  # its released() is the default: insert() called here
        self._admission = admission
        self._pins: dict[int, int] = {}  # pinned block -> pin count (each pin holds one reference)
        self._pin_cap = pin_cap
        self._max_pinned = int(pin_cap * (num_blocks - self._reserved))
        self._hits = self._misses = self._evictions = 0
        self._sink = event_sink
        self._rec = _recorder(event_sink)
        self._on_evict: EvictionListener | None = None
        self._on_publish: EvictionListener | None = None

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        """Call ``listener(block_ids, block_hashes)`` each time ``allocate`` evicts cached free blocks whose
        hashes leave the index with them: the ids and the hashes they held, in eviction order, after the
        hashes left the index and before the blocks are handed out (their KV is still intact until the
        caller writes them). A block evicted while another block still holds its hash is not named (its
        KV is still on the device). The offload manager
        (:mod:`kvpool.tiers.manager`) copies that KV to a lower tier here. The listener must not call this
        pool and must not raise. None removes it.

        Raises:
            InvalidArgumentError: a listener is set already (remove it first), or ``listener`` is not
                callable.
        """
        self._on_evict = _new_listener(self._on_evict, listener, "an eviction listener")

    def set_publish_listener(self, listener: EvictionListener | None) -> None:
        """Call ``listener(block_ids, block_hashes)`` after each ``cache_blocks`` with the blocks whose hashes
        entered the prefix index in that call (in call order; not the ones already published, those whose hash
        another block holds already, or those refused by the admission filter). A write-through tier chain
        stores them here. The listener must not call this pool and must not raise. None removes it.

        Raises:
            InvalidArgumentError: a listener is set already (remove it first), or ``listener`` is not
                callable.
        """
        self._on_publish = _new_listener(self._on_publish, listener, "a publish listener")

    # ---- allocation -------------------------------------------------------------------------------------

    def allocate(self, n: IntArg) -> list[int]:
        """Hand out ``n`` blocks, each with ref count 1: uncached free blocks first, then cached free blocks
        in the policy's eviction order (each loses its hash before it is handed out, so a stale entry never
        matches).

        Raises:
            InvalidArgumentError: ``n`` is negative or not an integer.
            OutOfBlocksError: fewer than ``n`` free blocks (cached free included); nothing is handed out.
        """
        free = self._free
        if type(n) is int and n == 1:  # fast path: one block
            if free:
                block = free.pop()
            elif self._fresh < self._n:
                block = self._fresh
                if block >= len(self._ref):
                    self._grow(block + 1)
                self._fresh = block + 1
            elif self._tail:
                block = self._tail.pop()
            elif len(self._lru) if self._lru is not None else len(self._policy):
                block = self._evict(1)[0]
            else:
                block = -1
            if block >= 0:
                self._ref[block] = 1
                return [block]
        n = self._check_count(n)
        k = len(free)
        if n <= k:
            ids = free[k - n:]
            del free[k - n:]
            ids.reverse()
        else:
            ids = free[::-1]
            free.clear()
            if self._fresh < self._n:
                ids += self._take_fresh(n - k)
            if n > len(ids) and self._tail:
                ids += self._take_tail(n - len(ids))
            if n > len(ids):
                ids += self._evict(n - len(ids))
        ref = self._ref
        for block in ids:
            ref[block] = 1
        return ids

    def _take_fresh(self, m: int) -> range:
        """Up to ``m`` ids never handed out, ascending (the per-block arrays grown to cover them)."""
        fresh = self._fresh
        end = min(fresh + m, self._n)
        if end > len(self._ref):
            self._grow(end)
        self._fresh = end
        return range(fresh, end)

    def _take_tail(self, m: int) -> list[int]:
        """Up to ``m`` blocks of the bottom of the free stack, below the ids never handed out."""
        tail = self._tail
        k = max(0, len(tail) - m)
        ids = tail[k:]
        del tail[k:]
        ids.reverse()
        return ids

    def _grow(self, needed: int) -> None:
        """Extend the per-block arrays (the pool's, its index's and its policy's) to cover ids below
        ``needed``: by a chunk, at least an eighth (:func:`~kvpool.allocators.arrays.next_capacity`)."""
        capacity = next_capacity(len(self._ref), needed, self._n, self._chunk)
        self._ref = grown_i32(self._ref, capacity, 0)
        self._idx.grow(capacity)
        self._policy.grow(capacity)
        release_freed_memory(8 * capacity)  # the old arrays' pages

    def allocate_tensor(self, n: IntArg, dtype: Any = None) -> Any:
        """:meth:`allocate` as a 1-D CPU tensor: ``[n]`` block ids of ``dtype`` (``torch.int32``, the
        default, as kernels' block tables are, or ``torch.int64``), for a block table row; the ids are
        converted in one C-level call, no Python loop over them. ``free``, ``touch`` and ``cache_blocks``
        take such tensors (any integer dtype) back.

        Raises:
            InvalidArgumentError: ``dtype`` is neither int32 nor int64, or as :meth:`allocate`.
            OutOfBlocksError: as :meth:`allocate`.
        """
        import torch  # here, not at the top: a pool without tensors (a replay) imports no torch

        dtype = torch.int32 if dtype is None else dtype
        if dtype is not torch.int32 and dtype is not torch.int64:
            raise InvalidArgumentError(f"block id tensors are torch.int32 or torch.int64, got {dtype!r}")
        return torch.tensor(self.allocate(n), dtype=dtype)

    def _check_count(self, n: IntArg) -> int:
        if type(n) is not int or n < 0:
            n = as_int(n, "block count", minimum=0)
        if n > self._num_uncached_free + self.num_evictable_blocks:
            raise OutOfBlocksError(f"asked for {plural(n, 'block')}, {self.num_free_blocks} free of "
                                   f"{self._n}")
        return n

    def _evict(self, m: int) -> list[int]:
        """Take ``m`` blocks from the LRU head, dropping their hashes from the index first."""
        lru, idx = self._lru, self._idx
        if lru is None or self._on_evict is not None or idx.dups:
            return self._evict_and_tell(m)
        if self._sink is not None:
            return self._evict_recorded(m, self._sink)
        out = []
        for _ in range(m):
            block = lru.pop()
            idx.remove(block)
            out.append(block)
        self._evictions += m
        return out

    def _evict_recorded(self, m: int, sink: KVEventSink) -> list[int]:
        """:meth:`_evict` (LRU, every hash held by one block) telling ``sink`` the hashes that left."""
        lru = self._lru
        assert lru is not None
        idx, out, gone = self._idx, [], []
        for _ in range(m):
            block = lru.pop()
            gone.append(idx.hash_of(block))
            idx.remove(block)
            out.append(block)
        self._evictions += m
        rec = self._rec
        if rec is None or not rec.removed(gone):
            sink.removed(gone)
        return out

    def _evict_and_tell(self, m: int) -> list[int]:
        """:meth:`_evict` for any policy and with duplicate holders, then tell the event sink the hash of
        every evicted block, and the eviction listener the ids and hashes of those whose hash left the index
        (no other block holds it)."""
        idx, lru, out, gone = self._idx, self._lru, [], []
        if lru is not None:
            out = [lru.pop() for _ in range(m)]
        else:
            pop = self._policy.pop  # bound once: a policy may be an interpreted subclass
            out = [pop() for _ in range(m)]
        self._evictions += m
        if self._sink is None and self._on_evict is None:  # nobody to tell: no hash read back
            for block in out:
                idx.remove(block)
            return out
        last = []  # positions of the blocks that held the last copy of their hash
        for i, block in enumerate(out):
            gone.append(idx.hash_of(block))
            if idx.remove(block):
                last.append(i)
        if self._sink is not None:
            self._sink.removed(gone)
        if self._on_evict is not None and last:
            if len(last) < m:
                self._on_evict([out[i] for i in last], [gone[i] for i in last])
            else:
                self._on_evict(out, gone)
        return out

    def free(self, block_ids: Iterable[int], priority: IntArg = 0) -> None:
        """Drop one reference from each block; a block that reaches 0 becomes free.

        Pass ids in **eviction order, first to evict first**: a request frees its blocks tail first
        (``reversed(block_table)``), so the shared head of a prefix becomes evictable last and, by recency,
        is evicted last. Blocks without a hash go to the free stack (reused first); hashed ones join the
        policy's order (LRU: the tail). ``priority`` is the freeing request's retention priority: only the
        ``priority`` policy reads it (higher = kept longer).

        Raises:
            InvalidArgumentError: ``priority`` not an integer.
            InvalidIdError: an id out of range, not an integer, or repeated in the call (the null block
                aside).
            DoubleFreeError: an id whose ref count is already 0.
        """
        ids = block_ids if type(block_ids) is list else as_id_list(block_ids, "block ids")
        ref = self._ref
        marked = False  # whether the ids' ref counts are complemented (checked, release to restore them)
        if len(ids) != 1 or type(ids[0]) is not int or not 0 <= ids[0] < len(ref) or ref[ids[0]] <= 0:
            ids = _ints(ids)  # general path; a single valid id skips it (the null block never does)
            if self._reserved:
                ids = _without_null(ids)
            unreferenced = self._check_ids(ids, True)
            marked = unreferenced < 0 and type(priority) is int
            if not marked:
                self._restore(ids, len(ids))
            if unreferenced >= 0:
                raise DoubleFreeError(f"block {ids[unreferenced]} is not allocated (ref count 0)")
        level = priority if type(priority) is int else as_int(priority, "priority")  # the priority policy's:
        # checked before anything changes (a falsy None or 0.0 too)
        self._release(ids, level, marked)

    def _release(self, ids: list[int], level: int, marked: bool = False) -> None:
        """:meth:`free` of ids known valid: distinct ints in range, each referenced, none the null block
        (what :meth:`free` checks first; a :class:`~kvpool.allocators.groups.KVCacheCoordinator` frees its
        own tables, which hold such ids, through here). ``marked``: their ref counts are complemented, as
        :meth:`_check_ids` left them (restored here, in the same pass)."""
        free, key, ref = self._free, self._idx.key, self._ref
        chunk: list[int] = []  # the call's newly evictable blocks, in order (LRU: one chunk of its queue)
        for block in ids:
            r = ref[block]
            r = (~r if marked else r) - 1
            ref[block] = r
            if r == 0:
                if key[block] == NO_HASH:
                    free.append(block)
                else:
                    chunk.append(block)
        if not chunk:
            return
        if self._lru is not None:
            self._lru.insert_chunk(chunk)
            return
        policy = self._policy  # any policy but LRU, through its interface
        if self._insert_each:
            for block in chunk:
                policy.insert(block, level)
        else:
            policy.released(ids, chunk, level)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix hit). A cached free block leaves the LRU and is
        revived in place with its hash; an in-use block is simply shared.

        Raises:
            InvalidIdError: an id out of range, not an integer, repeated (the null block aside), or free
                without a cached hash.
        """
        ids = block_ids if type(block_ids) is list else as_id_list(block_ids, "block ids")
        ref, lru, key = self._ref, self._lru, self._idx.key
        single_ok = len(ids) == 1 and type(ids[0]) is int and 0 <= ids[0] < len(ref) and (
            ref[ids[0]] > 0 or key[ids[0]] != NO_HASH)
        if not single_ok:  # general path; a single valid id skips it (the null block never does)
            ids = self._checked_touch(ids)
        if lru is None:
            self._revive(ids)
            return
        where, revived = lru.where, 0
        for block in ids:
            if ref[block] == 0:
                where[block] = 0
                revived += 1
            ref[block] += 1
        if revived:
            lru.removed(revived)

    def _revive(self, ids: list[int]) -> None:
        """``touch`` of valid ids through the policy interface: a hit on each hashed block, and each
        cached free one leaves the eviction order."""
        ref, idx, policy = self._ref, self._idx, self._policy
        for block in ids:
            if idx.holds(block):
                policy.hit(block)
                if ref[block] == 0:
                    policy.remove(block)
            ref[block] += 1

    def _checked_touch(self, ids: list[int]) -> list[int]:
        """The ids of a touch call as Python ints without the null block, once every one of them is valid."""
        ids = _ints(ids)
        if self._reserved:
            ids = _without_null(ids)
        if self._check_ids(ids) >= 0:
            for block in ids:
                if self._ref_of(block) == 0 and not self._holds(block):
                    raise InvalidIdError(f"block {block} is free and holds no cached hash: allocate it")
        return ids

    def _check_ids(self, ids: list[int], keep_marks: bool = False) -> int:
        """Validate a whole call's ids (Python ints, as :func:`_ints` makes them; in range; none repeated):
        InvalidIdError otherwise. Returns the position of the first id whose ref count is 0, or -1. A repeat
        is found without a set of the ids: each id's ref count is complemented as it is seen (negative:
        seen in this call), then every one is restored, before anything is raised or returned; with
        ``keep_marks`` a call that returns leaves them complemented, for the caller to restore
        (:meth:`_restore`, or :meth:`_release` as it frees them). Ids past the arrays (never handed out: ref
        count 0) are few and checked in a set."""
        ref, n = self._ref, self._n
        capacity = len(ref)
        if len(ids) == 1 and 0 <= ids[0] < n and not keep_marks:
            return 0 if ids[0] >= capacity or ref[ids[0]] == 0 else -1
        unreferenced = -1
        far: set[int] | None = None
        for pos in range(len(ids)):
            b = ids[pos]
            problem = ""
            if not 0 <= b < n:
                problem = f"block ids must be integers in [0, {n}), got {_head(ids)}"
            elif b < capacity:
                r = ref[b]
                if r < 0:
                    problem = f"block ids repeated in one call: {_head(ids)}"
                else:
                    ref[b] = ~r
                    if r == 0 and unreferenced < 0:
                        unreferenced = pos
            else:
                far = set() if far is None else far
                if b in far:
                    problem = f"block ids repeated in one call: {_head(ids)}"
                far.add(b)
                if unreferenced < 0:
                    unreferenced = pos
            if problem:
                self._restore(ids, pos)
                raise InvalidIdError(problem)
        if not keep_marks:
            self._restore(ids, len(ids))
        return unreferenced

    def _restore(self, ids: list[int], end: int) -> None:
        """Undo :meth:`_check_ids`'s complements of ``ids[:end]`` (valid, distinct ids)."""
        ref = self._ref
        capacity = len(ref)
        for i in range(end):
            b = ids[i]
            if b < capacity:
                ref[b] = ~ref[b]

    def _ref_of(self, block: int) -> int:
        """``block``'s ref count (0 for an id past the arrays: never handed out)."""
        return int(self._ref[block]) if block < len(self._ref) else 0

    def _holds(self, block: int) -> bool:
        """Whether ``block`` holds a published hash (never for an id past the arrays)."""
        return block < len(self._ref) and self._idx.holds(block)

    # ---- prefix cache -----------------------------------------------------------------------------------

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[Hashable], *,
                     parent_hash: Hashable | None = None, token_ids: Sequence[int] | None = None,
                     extra_keys: Sequence[tuple | None] | None = None, lora_name: str | None = None
                     ) -> None:
        """Publish full blocks whose KV has been written: ``block_hashes[i]`` names ``block_ids[i]``.

        Publishing the hash a block already holds is a no-op. If a *different* block already holds the hash
        (two requests computed the same block), this block is published too, as a further holder: lookups
        keep finding the first until its hash goes, then this one (see the module docstring). Never publish
        a partial block. With an ``admission`` filter, a hash no block holds is published only once the
        filter admits it (otherwise the block stays private: it is freed to the free stack, not the
        eviction order); a further holder of an admitted hash is not offered again.

        The null block is skipped with its hash (as vLLM's ``cache_full_blocks`` skips it).

        The keyword arguments describe the blocks for KV events (``BlockStored``) and only a pool with an
        event sink reads them: ``parent_hash``, the hash of the block before ``block_ids[0]`` (None: it is
        a sequence's first block); ``token_ids``, the tokens of all the blocks (block_size each);
        ``extra_keys``, one per block (``kvpool.allocators.hashing.block_extra_keys``); ``lora_name``, the
        LoRA adapter's name. Every block published in the call is reported (a further holder too).

        Raises:
            InvalidArgumentError: lengths differ, or a hash is None or unhashable; with an event sink, a
                hash that cannot be sent, or token ids or extra keys of the wrong length.
            InvalidIdError: a bad or repeated id, a block that is not allocated, or a block that already
                holds a different hash.
        """
        ids = _ints(block_ids if type(block_ids) is list else as_id_list(block_ids, "block ids"))
        try:
            num_hashes = len(block_hashes)
        except TypeError:
            raise InvalidArgumentError(f"block hashes must be a sequence, got {block_hashes!r}") from None
        if len(ids) != num_hashes:
            raise InvalidArgumentError(f"{len(ids)} block ids but {num_hashes} hashes")
        if self._sink is not None and self._caching:
            self._cache_recorded(ids, block_hashes, self._sink, parent_hash, token_ids, extra_keys, lora_name)
            return
        if self._reserved and 0 in ids:
            keep = _non_null_positions(ids)
            ids, block_hashes = [ids[i] for i in keep], [block_hashes[i] for i in keep]
        self._check_publish(ids, block_hashes)
        if not self._caching:
            return
        idx = self._idx
        if self._on_publish is not None:
            entered = [i for i, (block, h) in enumerate(zip(ids, block_hashes, strict=True))
                       if not idx.holds(block) and self._enter(block, h) == 1]
            if entered:
                self._on_publish([ids[i] for i in entered], [block_hashes[i] for i in entered])
            return
        if self._lru is None or self._admission is not None:
            for block, h in zip(ids, block_hashes, strict=True):
                if not idx.holds(block):
                    self._enter(block, h)
            return
        key = idx.key
        for i in range(len(ids)):  # (lengths checked equal; a zip would build a tuple per block)
            block = ids[i]
            if key[block] == NO_HASH:
                idx.publish(block, block_hashes[i])

    def _enter(self, block: int, block_hash: Hashable) -> int:
        """Publish ``block_hash`` on ``block`` (which holds none), telling the policy: 1 when the hash
        entered the index, 2 when ``block`` joined another holder of it, 0 when the admission filter (if
        any) refused a new hash."""
        idx = self._idx
        if self._admission is not None and idx.find(block_hash) < 0 and not self._admission.admit(block_hash):
            return 0
        entered = 1 if idx.publish(block, block_hash) else 2
        if self._lru is None:
            self._policy.published(block, block_hash)
        return entered

    def _cache_recorded(self, ids: list[int], block_hashes: Sequence[Hashable], sink: KVEventSink,
                        parent_hash: Hashable | None, token_ids: Sequence[int] | None,
                        extra_keys: Sequence[tuple | None] | None, lora_name: str | None) -> None:
        """:meth:`cache_blocks` telling ``sink`` which positions of the call entered the index: in one call
        made before anything changes (``check_and_store``), where the positions are known then (LRU, no
        admission filter), else checked first and told after."""
        keep: list[int] | None = None  # positions of the blocks that are not the null block (None: all)
        kept_ids, kept_hashes = ids, block_hashes
        if self._reserved and 0 in ids:
            keep = _non_null_positions(ids)
            kept_ids, kept_hashes = [ids[i] for i in keep], [block_hashes[i] for i in keep]
        self._check_publish(kept_ids, kept_hashes)
        if self._lru is None or self._admission is not None:
            self._cache_entered(ids, block_hashes, range(len(ids)) if keep is None else keep, kept_ids,
                                kept_hashes, sink, parent_hash, token_ids, extra_keys, lora_name)
            return
        idx = self._idx
        key = idx.key
        new: list[int] = []
        for j in range(len(kept_ids)):  # an index loop: compiled, no zip or range object
            if key[kept_ids[j]] == NO_HASH:
                new.append(j if keep is None else keep[j])
        if not new:
            sink.check_publish(kept_hashes, parent_hash, len(ids), token_ids, extra_keys)
            return
        rec = self._rec
        if len(new) < len(ids) or extra_keys is not None or rec is None or not rec.store(
                block_hashes, parent_hash, token_ids, lora_name):  # (the recorder took a plain call)
            sink.check_and_store(block_hashes, None if len(new) == len(ids) else new, parent_hash, token_ids,
                                 extra_keys, lora_name, kept_hashes)
        entered = []
        for i in new:
            if idx.publish(ids[i], block_hashes[i]):
                entered.append(i)
        if self._on_publish is not None and entered:
            self._on_publish([ids[i] for i in entered], [block_hashes[i] for i in entered])

    def _cache_entered(self, ids: list[int], block_hashes: Sequence[Hashable], keep: Sequence[int],
                       kept_ids: list[int], kept_hashes: Sequence[Hashable], sink: KVEventSink,
                       parent_hash: Hashable | None, token_ids: Sequence[int] | None,
                       extra_keys: Sequence[tuple | None] | None, lora_name: str | None) -> None:
        """:meth:`_cache_recorded` through the policy interface and the admission filter (which decides
        which positions enter): the sink checks the call first and is told the positions after."""
        sink.check_publish(kept_hashes, parent_hash, len(ids), token_ids, extra_keys)
        idx, new, entered = self._idx, [], []
        for i, block, h in zip(keep, kept_ids, kept_hashes, strict=True):
            if not idx.holds(block):
                how = self._enter(block, h)
                if not how:
                    continue
                if how == 1:
                    entered.append(i)
                new.append(i)
        if new:
            sink.stored(block_hashes, new, parent_hash, token_ids, extra_keys, lora_name)
            if self._on_publish is not None and entered:
                self._on_publish([ids[i] for i in entered], [block_hashes[i] for i in entered])

    def _check_publish(self, block_ids: list[int], block_hashes: Sequence[Hashable]) -> None:
        unreferenced = self._check_ids(block_ids)
        if unreferenced >= 0:
            raise InvalidIdError(f"block {block_ids[unreferenced]} is not allocated: only in-use blocks can "
                                 "be published")
        idx = self._idx
        key = idx.key
        for i in range(len(block_ids)):  # (lengths checked equal; a zip would build a tuple per block)
            block, h = block_ids[i], block_hashes[i]
            if type(h) is not int and type(h) is not bytes and (h is None or not _hashable(h)):
                raise InvalidArgumentError(f"block hash must be hashable and not None, got {h!r}")
            if key[block] != NO_HASH and not idx.holds_hash(block, h):
                raise InvalidIdError(f"block {block} already holds hash {idx.hash_of(block)!r}, cannot "
                                     f"publish {h!r}")

    def lookup(self, block_hashes: Iterable[Hashable]) -> list[int]:
        """Block ids of the longest prefix of ``block_hashes`` that is cached (in use or cached free).
        Ref counts do not change: ``touch`` the result to keep it. Counts stats (see :class:`BlockPoolStats`).

        Raises:
            InvalidArgumentError: an unhashable hash.
        """
        hashes = block_hashes if isinstance(block_hashes, (list, tuple)) else _hash_list(block_hashes)
        hit = self._match(hashes)
        self._hits += len(hit)
        self._misses += len(hashes) - len(hit)
        return hit

    def missed(self, block_hashes: Sequence[Hashable]) -> None:
        """Tell the policy that ``block_hashes`` (a list or tuple, head first) missed and are about to be
        stored, before the ``allocate`` that makes room for them: it observes them tail first. Only ARC
        reads it (a miss on a ghost moves its target before the eviction, as the paper and vLLM's
        ``on_store_miss`` do); no stats change. Cached hashes are skipped.

        Raises:
            InvalidArgumentError: an unhashable hash (nothing observed).
        """
        hashes = list(block_hashes)
        try:
            absent = [h for h in hashes if self._idx.find(h) < 0]
        except TypeError:
            raise InvalidArgumentError("block hashes must be hashable") from None
        policy = self._policy
        for h in reversed(absent):
            policy.missed(h)

    def waiting(self, block_hashes: Sequence[Hashable], count: int = 1) -> None:
        """Tell the policy that ``count`` more (negative: fewer) waiting requests will look ``block_hashes``
        (a request's prompt, head first) up: a queue-informed policy (``queue-lru``, ``queue-lineage``)
        keeps their cached blocks from eviction while the requests wait (vLLM RFC #48485). A scheduler calls
        it with +1 when a request joins the waiting queue and -1 when it leaves (admitted or aborted). Other
        policies ignore it (the call returns at once). Changes no stats and no ref count.

        Raises:
            InvalidArgumentError: ``count`` not an integer.
        """
        policy = self._policy
        if not policy.reads_waiting:
            return
        delta = as_int(count, "count")
        for h in block_hashes:
            policy.waiting(h, delta)

    def match_prefix(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """:meth:`lookup` without counting stats: the block ids of the longest cached prefix of
        ``block_hashes`` (a list or tuple). Raises InvalidArgumentError for an unhashable hash."""
        return self._match(block_hashes)

    def _match(self, hashes: Sequence[Hashable]) -> list[int]:
        if not self._caching:
            return []
        idx, hit = self._idx, []
        try:
            for h in hashes:
                block = idx.find(h)
                if block < 0:
                    break
                hit.append(block)
        except TypeError:
            raise InvalidArgumentError("block hashes must be hashable") from None
        return hit

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Unpublish the named blocks: each one's entry leaves the prefix index, so it never matches again
        (another block holding the same hash stays published: lookups find it instead).
        What a KV connector or a tier calls when the KV stored in those blocks is invalidated (vLLM's
        ``evict_blocks``). An in-use block keeps its ref count and stays in use, now private; a cached free
        block becomes uncached free (it joins the free stack, handed out before any cached block); a block
        without a hash, and the null block, are left alone. A pinned block loses its pins with its hash
        (the pool drops the pins' references; nothing is left to keep). ``stats.evictions`` does not count
        these.

        Raises:
            InvalidIdError: an id out of range, not an integer, or repeated in the call (nothing is
                unpublished).
        """
        ids = _ints(block_ids if type(block_ids) is list else as_id_list(block_ids, "block ids"))
        if self._reserved:
            ids = _without_null(ids)
        self._check_ids(ids)
        idx, lru, free, ref, gone = self._idx, self._lru, self._free, self._ref, []
        for block in ids:
            if self._holds(block):
                r = ref[block]
                gone.append(idx.hash_of(block))
                idx.remove(block)
                if lru is None:
                    self._policy.dropped(block)
                elif r == 0:
                    lru.remove(block)
                r -= self._pins.pop(block, 0)
                ref[block] = r
                if r == 0:
                    free.append(block)
        if self._sink is not None:
            self._sink.removed(gone)

    def reset_prefix_cache(self) -> bool:
        """Forget every published hash, when no block is in use (the null block aside); vLLM's contract.

        Returns True after dropping the whole prefix index: every cached free block becomes uncached free
        and the free order is kept (``allocate`` hands out the same ids in the same order as it would have
        before the reset). Returns False, changing nothing, while any block is in use (a pinned block is:
        unpin it first). Use it after the weights change (RLHF), or to start a benchmark cold. The stats
        counters keep counting (they are cumulative).
        """
        if self.num_used_blocks:
            return False
        order = self.evictable_blocks()  # nothing is in use, so every hashed block is evictable
        if self._lru is None:
            for block in order:
                self._policy.dropped(block)
        self._idx.clear()
        # the next victim is handed out right after the free stack and the ids never handed out
        self._tail[:0] = reversed(order)
        if self._lru is not None:
            self._lru.clear()
        if self._sink is not None:
            self._sink.cleared()
        return True

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

    @property
    def enable_caching(self) -> bool:
        """Whether prefix caching is on (fixed at construction)."""
        return self._caching

    @property
    def event_sink(self) -> KVEventSink | None:
        """The KV event sink (given at construction or attached), or None (then nothing is recorded)."""
        return self._sink

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

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool, the null block included."""
        return self._n

    @property
    def null_block(self) -> int | None:
        """The null block's id (0) with ``reserve_null_block=True``, else None."""
        return 0 if self._reserved else None

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (its ``name``: ``"lru"``, ...)."""
        return self._policy

    @property
    def admission(self) -> FrequencyAdmission | None:
        """The frequency admission filter of the publish step (``admission=``), or None."""
        return self._admission

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: uncached free plus cached free (evictable)."""
        lru = self._lru
        return self._num_uncached_free + (len(lru) if lru is not None else len(self._policy))

    @property
    def _num_uncached_free(self) -> int:
        """Blocks of the free stack: the freed ones, those never handed out and those below them."""
        return len(self._free) + self._n - self._fresh + len(self._tail)

    @property
    def high_water_mark(self) -> int:
        """Block ids handed out at least once so far (ids below it; the null block counts): what the
        per-block bookkeeping covers, up to a growth chunk."""
        return self._fresh

    @property
    def capacity(self) -> int:
        """Block ids the per-block arrays cover now: at least :attr:`high_water_mark`, grown in chunks
        (:func:`~kvpool.allocators.arrays.next_capacity`), at most :attr:`num_blocks`."""
        return len(self._ref)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a published hash (in the prefix index), in use or free; several blocks of one
        hash count each."""
        return self._idx.num_holders

    @property
    def num_evictable_blocks(self) -> int:
        """Cached free blocks: ref count 0, hash still published (not pinned)."""
        lru = self._lru
        return len(lru) if lru is not None else len(self._policy)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0 (never the null block; pinned blocks included)."""
        lru = self._lru
        return self._fresh - self._reserved - len(self._free) - len(self._tail) - (
            len(lru) if lru is not None else len(self._policy))

    @property
    def usage(self) -> float:
        """num_used_blocks / (num_blocks - 1 if a null block is reserved, else num_blocks), in [0, 1]."""
        return self.num_used_blocks / (self._n - self._reserved)

    @property
    def stats(self) -> BlockPoolStats:
        """A snapshot of the prefix-cache counters."""
        return BlockPoolStats(self._hits, self._misses, self._evictions)

    def reorder_free(self, key: Callable[[int], Any]) -> None:
        """Reorder the free stack (freed blocks without a hash, handed out before the ids never handed
        out) so that ``allocate`` hands out the block with the smallest ``key(block)`` first. Not on the
        hot path: O(F log F) for F such blocks; an elastic pool's page-aware order
        (:mod:`kvpool.requests.page_aware`) calls it when blocks are freed."""
        self._free.sort(key=key, reverse=True)  # pop() takes the end

    def evictable_blocks(self) -> list[int]:
        """Cached free block ids in eviction order, next victim first. O(number of cached free blocks)
        for LRU, O(n log n) for the heap-ordered policies."""
        lru = self._lru
        return lru.order() if lru is not None else self._policy.order()

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




def _inserts_each(policy: EvictionPolicy) -> bool:
    """Whether ``policy``'s ``released`` is :class:`EvictionPolicy`'s (each evictable block inserted in turn),
    so that the pool calls ``insert`` itself and saves a call per ``free``."""
    for cls in type(policy).__mro__:
        if cls is EvictionPolicy:
            return True
        if "released" in cls.__dict__:
            return False
    return False


def _recorder(sink: object) -> EventRecorder | None:
    """The recorder of ``sink`` (a :class:`kvpool.events.sink.KVEventSink`) that plain calls go through, or
    None (no sink, or one of another kind: every call goes to the sink)."""
    rec = getattr(sink, "recorder", None)
    return rec if isinstance(rec, EventRecorder) else None


def _new_listener(current: EvictionListener | None, listener: EvictionListener | None,
                  what: str) -> EvictionListener | None:
    """``listener`` to replace ``current`` (None removes it); InvalidArgumentError while ``current`` is set
    or when ``listener`` is not callable."""
    if listener is not None and (current is not None or not callable(listener)):
        raise InvalidArgumentError(f"this pool has {what} already, or it is not callable")
    return listener


def _ints(ids: list[Any]) -> list[int]:
    """``ids`` as Python ints (the same list when they already are): a numpy int or a 0-d tensor is the id
    it holds, a bool or anything else is an InvalidIdError (:mod:`kvpool.numeric`)."""
    for b in ids:
        if type(b) is not int:
            return as_id_list(list(ids), "block ids")
    return ids


def _hash_list(values: Iterable) -> list:
    """A list of block hashes (a tensor or numpy array via ``tolist()``)."""
    try:
        return values.tolist() if hasattr(values, "tolist") else list(values)
    except (TypeError, NotImplementedError, RuntimeError):  # not iterable, or a meta tensor
        raise InvalidArgumentError(f"expected an iterable of block hashes, got {values!r}") from None


def _non_null_positions(ids: list[int]) -> list[int]:
    """Positions of ``ids`` (Python ints, from :func:`_ints`) that are not the null block (id 0)."""
    return [i for i, b in enumerate(ids) if b != 0]


def _without_null(ids: list[int]) -> list[int]:
    """``ids`` (Python ints, from :func:`_ints`) without the null block (id 0)."""
    if 0 not in ids:
        return ids
    return [b for b in ids if b != 0]


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _head(ids: Sequence[int]) -> str:
    return repr(list(ids[:8])) + ("..." if len(ids) > 8 else "")


def _require(ok: bool, invariant: str) -> None:
    if not ok:
        raise IntegrityError(f"BlockPool invariant broken: {invariant}")

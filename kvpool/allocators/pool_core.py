"""The state of a :class:`~kvpool.allocators.block_pool.BlockPool` and what reads it: the per-block arrays,
the free stack, the prefix index and the eviction policy it holds (built by :class:`PoolCore`), the checks
of the ids a call names, and the counts (free, evictable, in use, cached, the high-water mark).

The pool is one compiled class built in layers, one module each, every layer a native subclass of the one
below (attribute reads and method calls stay native across them): :class:`PoolCore` (here),
:class:`~kvpool.allocators.pool_alloc.PoolAlloc` (allocate, free, touch, eviction),
:class:`~kvpool.allocators.pool_prefix.PoolPrefix` (publishing, lookups, evict_blocks, reset) and
:class:`~kvpool.allocators.block_pool.BlockPool` (pins, admission counts, per-block readers, integrity).
Its behaviour is documented there, in :mod:`kvpool.allocators.block_pool`.
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
)
from kvpool.allocators.policies import EvictionPolicy, FrequencyAdmission, LRUPolicy, make_policy
from kvpool.allocators.prefix_index import PrefixIndex
from kvpool.errors import (
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
)
from kvpool.events.buffer import EventRecorder
from kvpool.numeric import IntArg, RealArg, as_id_list, as_int, as_real

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


class PoolCore:
    """The state of a block pool and its counts: see :class:`~kvpool.allocators.block_pool.BlockPool`, the
    class to build (its docstring gives the constructor's arguments and errors)."""

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

    def _check_ids(self, ids: list[int], keep_marks: bool = False) -> int:
        """Validate a whole call's ids (Python ints, as :func:`_ints` makes them; in range; none repeated):
        InvalidIdError otherwise. Returns the position of the first id whose ref count is 0, or -1. A repeat
        is found without a set of the ids: each id's ref count is complemented as it is seen (negative:
        seen in this call), then every one is restored, before anything is raised or returned; with
        ``keep_marks`` a call that returns leaves them complemented, for the caller to restore
        (:meth:`_restore`, or :meth:`PoolAlloc._release <kvpool.allocators.pool_alloc.PoolAlloc._release>`
        as it frees them). Ids past the arrays (never handed out: ref count 0) are few and checked in a
        set."""
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

    @property
    def enable_caching(self) -> bool:
        """Whether prefix caching is on (fixed at construction)."""
        return self._caching

    @property
    def event_sink(self) -> KVEventSink | None:
        """The KV event sink (given at construction or attached), or None (then nothing is recorded)."""
        return self._sink

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

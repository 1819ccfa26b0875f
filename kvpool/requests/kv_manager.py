"""``KVCacheManager``: a request's KV life on the pool, written once for every consumer.

The engine and the trace replay both drive requests through this one class (their scheduler is
:class:`kvpool.requests.scheduler.Scheduler`), so whatever composes here composes everywhere: any model
(one full-attention group, sliding-window or chunked groups), any eviction policy, pins, admission,
KV events, a tier chain below the device, tensor parallelism. The life of a request:

1. **Admission** (:meth:`KVCacheManager.admit`): the longest prefix of its block hashes that every KV cache
   group can restore, on the device or in a lower tier (at most the blocks of its first ``num_tokens - 1``
   tokens: the last token is always computed, for its logits, as vLLM does); blocks found below are
   restored into device blocks first (:meth:`kvpool.tiers.manager.OffloadManager.restore`); then the hit
   is touched and blocks are allocated for the first chunk. Refused (``None``, nothing allocated) when the
   pool is short.
2. **Each step** (:meth:`reserve`): blocks that left a window are freed, blocks for the step's tokens are
   allocated; ``False`` (nothing allocated) when the pool is short: the scheduler then preempts.
3. **After the forward** (:meth:`publish`): the full blocks whose KV is now written enter the prefix
   index, in every group (write-through tiers store them as the pool publishes them).
4. **The end** (:meth:`free`) or a **preemption** (:meth:`preempt`): every block is freed tail first, so
   the prefix's head is evicted last; a preempted request is recomputed from scratch later.

**Memory that follows the blocks.** Built with ``memory=`` (a store on a page arena), the manager commits
the pages under each block as it is handed out and releases a block once it holds no KV, through one
:class:`~kvpool.requests.block_memory.PoolMemory` (see :mod:`kvpool.requests.block_memory`): a refused commit
makes admission wait and a running request be preempted, as a short pool does.

A request's recurrent state goes through one state side, :attr:`KVCacheManager.state`, whatever the model:
a recurrent hybrid's :class:`~kvpool.requests.state_checkpoints.RequestStates` (also
:attr:`KVCacheManager.states`: a state slot per running request, taken at admission, zeroed or restored
from a checkpoint, freed with the blocks; a hit cut back to the longest prefix that ends at a state
checkpoint; saves planned as steps are scheduled and committed as they publish), or, for any other model,
:class:`~kvpool.requests.no_state.NoRecurrentState`, whose answers change nothing. The request path asks
the state side; it never asks whether the model is a hybrid.

Prefix hits are counted once per admission that succeeded (:attr:`stats`; :attr:`first_stats` for first
admissions only: what a replay's hit ratio counts), by where each hit block was found
(:mod:`kvpool.requests.hit_places`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.allocators.block_pool import BlockPool, BlockPoolStats
from kvpool.allocators.groups import CacheHit, KVCacheCoordinator, group_key
from kvpool.allocators.hashing import BlockHasher, hasher_for
from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError
from kvpool.requests.accounting import UsageTotals
from kvpool.requests.block_memory import BlockMemory, PoolMemory
from kvpool.requests.hit_places import DEVICE as DEVICE  # the name of the device place, re-exported
from kvpool.requests.hit_places import PrefixCacheStats, held_below, hit_places, restore_plan
from kvpool.requests.no_state import NO_STATE, StateSide
from kvpool.requests.partial_hits import PartialHit
from kvpool.requests.request import Request
from kvpool.requests.sessions import SessionCache
from kvpool.requests.unit_states import partial_hits
from kvpool.spec import KVCacheGroup
from kvpool.spec.kv import needs_null_block

if TYPE_CHECKING:
    from kvpool.allocators.policies import FrequencyAdmission
    from kvpool.events.sink import KVEventSink
    from kvpool.requests.state_checkpoints import RequestStates
    from kvpool.storage.block_store import BlockStore
    from kvpool.tiers.backend import TierBackend
    from kvpool.tiers.manager import OffloadManager

def blocks_needed(groups: Sequence[KVCacheGroup], num_tokens: int, chunk_tokens: int) -> int:
    """Pool blocks a request holding KV for ``num_tokens`` tokens needs at its peak alone, prefilled in
    chunks of at most ``chunk_tokens``: every group's :meth:`~kvpool.spec.KVCacheGroup.max_blocks`, plus the
    null block a pool reserves when a group has a window. A request needing more than the pool never runs."""
    chunk = max(1, min(chunk_tokens, num_tokens))
    need = sum(g.max_blocks(num_tokens, chunk) for g in groups)
    return need + needs_null_block(groups)


class KVCacheManager:
    """The KV cache of ``groups`` (``KVCacheSpec.groups``) over one pool of ``num_blocks`` blocks.

    Args:
        groups: the model's KV cache groups (one full group for a plain model).
        num_blocks: pool blocks (the null block included where a group has a window).
        enable_caching: prefix caching.
        hasher: hashes the full blocks of requests that carry token ids (None: requests bring their own
            ``block_hashes``, as a trace's do; a request with token ids then gets none).
        policy: the pool's eviction policy (see :class:`BlockPool`).
        pin_cap: the pool's pin cap (see :class:`BlockPool`).
        admission: the pool's publish-step :class:`~kvpool.allocators.policies.FrequencyAdmission` (see
            :class:`BlockPool`).
        event_sink: the pool's KV events (:class:`kvpool.events.sink.KVEventSink`); :meth:`flush_events`
            once per step publishes them.
        pool: an all-free :class:`BlockPool` to use (see :class:`KVCacheCoordinator`).
        states: a recurrent hybrid's :class:`~kvpool.requests.state_checkpoints.RequestStates` (state slots
            and checkpoints, with the attention groups' block size), or None.
        memory: the KV store whose pages follow the blocks
            (:class:`~kvpool.requests.block_memory.BlockMemory`, e.g. an elastic
            :class:`~kvpool.storage.paged.PagedKVCache` with every block free), or None.
        match_unit: tokens per prefix-match unit, a divisor of the block size, for hits that end inside a
            block (:mod:`kvpool.requests.partial_hits`: :attr:`partial`); None: whole blocks only.

    Raises:
        InvalidArgumentError: as :class:`KVCacheCoordinator`.
        ConfigError: a process-local ``hasher`` with an ``event_sink`` (the events carry its hashes out of
            the process: :func:`~kvpool.allocators.hashing.hasher_for`); a bad ``match_unit``, or one
            without caching.
    """

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: int, *, enable_caching: bool = True,
                 hasher: BlockHasher | None = None, policy: Any = "lru", pin_cap: float = 0.5,
                 admission: FrequencyAdmission | None = None, event_sink: KVEventSink | None = None,
                 pool: BlockPool | None = None, states: RequestStates | None = None,
                 memory: BlockMemory | None = None, match_unit: int | None = None) -> None:
        self.coordinator = KVCacheCoordinator(groups, num_blocks, enable_caching=enable_caching,
                                              event_sink=event_sink, policy=policy, pin_cap=pin_cap,
                                              admission=admission, pool=pool)
        self.groups, self.block_size = self.coordinator.groups, self.coordinator.block_size
        self._block_pool: BlockPool = self.coordinator.pool
        self.caching = enable_caching
        self.hasher = None if hasher is None else hasher_for(hasher, events=event_sink is not None)
        #: The recurrent hybrid's ``states``, else None.
        self.states = states
        #: The state side every request goes through: ``states``, or
        #: :data:`~kvpool.requests.no_state.NO_STATE` for a model without recurrent layers.
        self.state: StateSide = NO_STATE if states is None else states
        self.state.check_block_size(self.block_size)
        self.state.join(len(self.groups), self._block_pool.event_sink, admission)
        self.partial = None if match_unit is None else partial_hits(match_unit, self, num_blocks)
        #: The hook that keeps ``memory``'s committed blocks equal to the used and cached ones (None: none).
        self.memory = None if memory is None else PoolMemory(memory, lambda: self.pool, self.null_block)
        self._uncommitted: set[Hashable] = set()  # requests holding blocks a refused commit left uncommitted
        #: Whether a commit was refused by a memory limit since the scheduler cleared it at the start of its
        #: step: a step that comes up empty then waits instead of raising (another pool under the same
        #: budget may give memory back).
        self.memory_refused = False
        self._windowed = needs_null_block(self.groups)
        self.tiers: OffloadManager | None = None
        self.stats, self.first_stats = PrefixCacheStats(), PrefixCacheStats()
        #: Sessions and kept ranges (:mod:`kvpool.requests.sessions`); cached-token sums (first admissions).
        self.sessions, self.usage = SessionCache(self), UsageTotals()
        self.ops = 0  # block ids and hashes handled by pool calls (a replay reports block ops per second)
        self._wanted_pins: list[list[Hashable]] = []
        self._waiting: dict[Hashable, list[Hashable]] = {}  # request id -> the hashes announced waiting
        self.pins: list[list[int]] = []  # block ids of each prefix pinned, in pin order
        #: Called with each request :meth:`admit` is about to touch or allocate for (its blocks fit), before
        #: anything changes: a replay's offline eviction bound learns the admission order here.
        self.on_admit: Callable[[Request], None] | None = None

    # ---- the pool -----------------------------------------------------------------------------------

    @property
    def pool(self) -> Any:
        """What the request path calls: the coordinator's :class:`BlockPool`, or the wrapper
        :meth:`wrap_pool` put in front of it."""
        return self.coordinator.pool

    @property
    def block_pool(self) -> BlockPool:
        """The :class:`BlockPool` itself, under any wrapper :meth:`wrap_pool` put in front of it (the tiers
        attach to it)."""
        return self._block_pool

    def wrap_pool(self, wrap: Callable[[BlockPool], Any]) -> Any:
        """Put ``wrap(pool)`` in front of the :class:`BlockPool`: every later call of the request path (the
        coordinator's allocate, free, cache and lookup) goes through it, and it is :attr:`pool`; returns it.
        The seam a tensor-parallel leader records the pool's calls through, to replay them on its followers
        (:class:`kvpool.engine.distributed.RecordingPool`): the wrapper takes every call a BlockPool takes
        and must pass each on to it. Once per manager.

        Raises:
            InvalidArgumentError: a wrapper is in front already.
        """
        if self.coordinator.pool is not self._block_pool:
            raise InvalidArgumentError("the pool has a wrapper in front of it already")
        self.coordinator.pool = wrapper = wrap(self._block_pool)
        return wrapper

    @property
    def null_block(self) -> int:
        return self.coordinator.null_block

    @property
    def num_free_blocks(self) -> int:
        return self.coordinator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.coordinator.num_used_blocks

    @property
    def event_sink(self) -> KVEventSink | None:
        return self.pool.event_sink

    def flush_events(self) -> None:
        """Publish the KV events recorded since the last call as one batch (once per step)."""
        if self.pool.event_sink is not None:
            self.pool.event_sink.flush()

    # ---- tiers --------------------------------------------------------------------------------------

    def attach_tiers(self, tiers: Sequence[TierBackend], *, cache: BlockStore | None = None,
                     write_through: bool = False, asynchronous: bool = True,
                     admission: FrequencyAdmission | None = None, staging_blocks: int = 64,
                     state_tiers: Sequence[TierBackend] | None = None) -> OffloadManager:
        """Chain ``tiers`` (a host tier first, then disk, remote) under the device pool, for every KV cache
        group: evicted (or, with ``write_through``, published) blocks go down keyed by group and hash, and
        :meth:`admit` finds prefixes in every tier. ``cache``: the device KV store whose blocks move (None:
        hashes only, a replay). A hybrid's state checkpoints go down too
        (:class:`~kvpool.requests.state_offload.CheckpointTiers`): into ``state_tiers`` (rows of one state
        slot), or without data into ``tiers`` themselves. Returns the
        :class:`~kvpool.tiers.manager.OffloadManager`.

        Raises:
            ConfigError: prefix caching is off, or tiers are attached already; a disk or Redis tier under a
                process-local hasher (:func:`~kvpool.allocators.hashing.hasher_for`); with KV events, a
                host tier whose pool has an event sink already. (A host tier that holds blocks already
                announces them first: :meth:`~kvpool.allocators.block_pool.BlockPool.attach_event_sink`.)
            InvalidArgumentError: as :class:`~kvpool.tiers.manager.OffloadManager`.
        """
        from kvpool.tiers.host import HostTier
        from kvpool.tiers.manager import OffloadManager

        if not self.caching or self.tiers is not None:
            raise ConfigError("tiers need prefix caching and no tiers attached already")
        if self.hasher is not None:
            hasher_for(self.hasher, media=[t.medium for t in tiers])
        sink = self.pool.event_sink
        hosts = [t for t in tiers if isinstance(t, HostTier)] if sink is not None else []
        if any(t.pool.event_sink is not None for t in hosts):
            raise ConfigError("with KV events, the host tier must not publish events elsewhere already")
        self.tiers = OffloadManager(self.block_pool, tiers, cache=cache, write_through=write_through,
                                    asynchronous=asynchronous, admission=admission,
                                    staging_blocks=staging_blocks)
        for host in hosts:  # its stores and evictions go out in the same batches, medium CPU
            host.pool.attach_event_sink(sink.for_medium("CPU"))
        self.tiers.memory = self.memory  # restores commit the blocks they load into
        if state_tiers is not None or cache is None:
            self.state.tiers_under(tiers if state_tiers is None else state_tiers, data=cache is not None)
        return self.tiers

    def detach_tiers(self) -> None:
        """Finish every store in flight and stop the tiers listening (the tiers stay open)."""
        if self.tiers is not None:
            self.tiers.detach()

    # ---- a request's life ---------------------------------------------------------------------------

    def blocks_needed(self, req: Request, chunk: int) -> int:
        """:func:`blocks_needed` of ``req``'s :attr:`~Request.max_kv_tokens` in this manager's groups."""
        return blocks_needed(self.groups, req.max_kv_tokens, chunk)

    def hash_blocks(self, req: Request) -> None:
        """Hash the full blocks of ``req``'s token ids not hashed yet (chained on the last one); a request
        without token ids, or a manager without a hasher, keeps its hashes."""
        if self.hasher is None or not self.caching or req.prompt_token_ids is None:
            return
        done = len(req.block_hashes) * self.block_size
        if req.num_tokens - done >= self.block_size:
            parent = req.block_hashes[-1] if req.block_hashes else None
            tokens = req.token_ids[done:]
            req.block_hashes += self.hasher.block_hashes(tokens, self.block_size, parent=parent)

    def announce_waiting(self, req: Request, waiting: bool) -> None:
        """Tell a queue-informed policy (:meth:`BlockPool.waiting`) that ``req`` joined (``waiting``) or left
        the waiting queue, with the hashes of its cached prefix now (what it would hit if nothing were
        evicted; cached blocks past a break in its prefix it would not hit), in every group; leaving withdraws
        what joining announced. Nothing for other policies."""
        pool = self.pool
        if not self.caching or not getattr(getattr(pool, "policy", None), "reads_waiting", False):
            return
        if waiting:
            hashes = req.block_hashes[:len(pool.match_prefix(req.block_hashes))]
            self._waiting[req.request_id] = hashes
        else:
            gone = self._waiting.pop(req.request_id, None)
            if gone is None:
                return
            hashes = gone
        for g in range(len(self.groups)):
            pool.waiting(hashes if g == 0 else [group_key(g, h) for h in hashes], 1 if waiting else -1)

    def admit(self, req: Request, budget: int) -> int | None:
        """Admit ``req`` (holding no blocks) with its cached prefix and a first chunk of at most ``budget``
        tokens; returns the chunk's tokens, or None (no block allocated) when the pool is short (or, for a
        hybrid, no state slot is free). Sets ``req.num_computed_tokens`` to the prefix hit (and
        ``num_cached_tokens`` at a first admission)."""
        coord, bs, hashes, state = self.coordinator, self.block_size, req.block_hashes, self.state
        if not state.has_free_slot:
            return None
        limit = min(len(hashes), (req.num_tokens - 1) // bs) if self.caching else 0
        if not self.sessions.make_room(self._fewest_new_blocks(req, limit, budget)):
            return None  # short even with the longest hit it could find: no lookup needed
        probe = self.tiers.probe() if self.tiers is not None else None
        hit = coord.find_longest_cache_hit(hashes, limit, count=False, probe=probe)
        kv_blocks = hit.num_blocks
        hit = self._joint_hit(req, hit, probe)
        loaded: dict[Hashable, int] = {}
        if self.tiers is not None and held_below(hit):
            if not self._fits(req, hit, budget):
                return None
            if self.on_admit is not None:
                self.on_admit(req)
            loaded = self.tiers.restore(*restore_plan(hit, self.null_block, len(self.groups)))
            hit = coord.find_longest_cache_hit(hashes, hit.num_blocks, count=False)
            hit = self._joint_hit(req, hit, None)
        part = None if self.partial is None else self.partial.hold(
            req, hit.num_blocks, self.pool, lambda p: self._fits(req, hit, budget, p))
        if part is None and self.partial is not None and self.partial.refused(req):
            hit = self._joint_hit(req, hit, None, units=False)  # back to a block checkpoint
        if part is None and not self._fits(req, hit, budget):
            return None
        if self.on_admit is not None:
            self.on_admit(req)
        computed = hit.num_blocks * bs + (part.tokens if part is not None else 0)
        chunk = min(req.num_tokens - computed, budget)
        coord.allocate(req.request_id, computed + chunk, hit)
        if self.memory is not None and not self._committed(req):
            self._free_blocks(req)  # the memory is short: as with a short pool, nothing stays allocated
            self.memory_refused = True
            return None if part is None else self.partial.release(self.pool, part)  # type: ignore[union-attr]
        if part is not None:
            self.partial.copy_into(part, coord.block_tables(req.request_id), self.pool,  # type: ignore[union-attr]
                                   first=req.num_cached_tokens < 0)
        self.ops += min(hit.num_blocks + 1, limit) + coord.num_blocks_held(req.request_id)
        req.num_computed_tokens = computed
        places = hit_places(hit, loaded, self.null_block, len(self.groups), self.tiers)
        self.stats.record(limit, places)
        first = req.num_cached_tokens < 0
        if first:
            req.num_cached_tokens = computed
            self.first_stats.record(limit, places)
            self.usage.account(req, self.block_size, computed, places, self.caching)
        state.admit(req, hit.num_blocks, kv_blocks, first=first)
        if self.caching:
            state.plan(req, computed, computed + chunk)
        return chunk

    def _joint_hit(self, req: Request, hit: CacheHit, probe: Any, units: bool = True) -> CacheHit:
        """``hit`` cut back to the longest prefix that every group restores and whose state the state side
        restores (a recurrent hybrid's: one that ends at a state checkpoint, or is empty; with ``units``
        and a match unit, one whose partial hit ends at a unit checkpoint: :meth:`PartialHits.joint`)."""
        while True:
            j = self.state.joint_blocks(req, hit.num_blocks)
            if units and self.partial is not None:
                j = self.partial.joint(req, hit.num_blocks, j)
            if j == hit.num_blocks:
                return hit
            hit = self.coordinator.find_longest_cache_hit(req.block_hashes, j, count=False, probe=probe)

    def _fewest_new_blocks(self, req: Request, limit: int, budget: int) -> int:
        """A lower bound of the free blocks admitting ``req`` takes, whatever its hit: with a hit of k blocks
        every group allocates ``cdiv(k * B + min(num_tokens - k * B, budget), B) - k`` new blocks (and
        touches or loads the hit's blocks besides), which never grows with k, so k = ``limit`` gives the
        fewest."""
        computed = limit * self.block_size
        return self.coordinator.num_new_blocks(computed + min(req.num_tokens - computed, budget), limit)

    def _fits(self, req: Request, hit: CacheHit, budget: int, part: PartialHit | None = None) -> bool:
        """Whether the pool has the blocks to admit ``req`` from ``hit`` (and ``part``, a partial hit past
        it) with a first chunk of ``budget``."""
        computed = hit.num_blocks * self.block_size + (part.tokens if part is not None else 0)
        chunk = min(req.num_tokens - computed, budget)
        coord, rid, tokens = self.coordinator, req.request_id, computed + chunk
        fits, sessions = coord.can_allocate(rid, tokens, hit), self.sessions
        while not fits and sessions.num_holdings and \
                sessions.make_room(coord.num_blocks_to_allocate(rid, tokens, hit)):  # kept ones give way
            fits = coord.can_allocate(rid, tokens, hit)  # (a released hit block is now needed too)
        return fits

    def reserve(self, req: Request, num_new_tokens: int) -> bool:
        """Blocks for ``num_new_tokens`` more tokens of running ``req`` (after freeing what its windows left
        behind); False, nothing allocated, when the pool is short. With ``memory``, also False when their
        commit is refused: the blocks allocated then stay with ``req``, not committed, until a later
        ``reserve`` commits them (or ``free`` gives them back)."""
        coord, rid, computed, memory = self.coordinator, req.request_id, req.num_computed_tokens, self.memory
        before = coord.block_tables(rid) if memory is not None and self._windowed else None
        freed = coord.remove_skipped_blocks(rid, computed)
        if freed and before is not None:
            memory.emptied(b for table in before for b in table)  # type: ignore[union-attr]
        need = coord.num_blocks_to_allocate(rid, computed + num_new_tokens)
        if not self.sessions.make_room(need):
            self.ops += freed
            return False
        if need:
            coord.allocate(rid, computed + num_new_tokens)
        if memory is not None and (need or rid in self._uncommitted) and not self._committed(req):
            self._uncommitted.add(rid)  # allocated but not committed: the next reserve (or a free) sees to it
            self.memory_refused = True
            self.ops += freed + need
            return False
        self.ops += freed + need
        if self.caching:
            self.state.plan(req, computed, computed + num_new_tokens)
        return True

    def publish(self, req: Request) -> None:
        """Publish ``req``'s full blocks whose KV is written (its first ``num_computed_tokens`` tokens) and
        that have a hash (a trace's request hashes only its prompt), in every group, and pin any prefix
        waiting for it (:meth:`pin_when_cached`)."""
        if not self.caching:
            return
        written = min(req.num_computed_tokens, len(req.block_hashes) * self.block_size)  # hashed blocks only
        coord = self.coordinator
        before = coord.num_published_blocks(req.request_id)
        if written // self.block_size <= before and not (self.state.follows_each_step or self._wanted_pins):
            return  # fast path: no block filled since the last publish (a decode step, mid-block)
        tokens = req.token_ids if self.pool.event_sink is not None and req.has_token_ids else None
        coord.cache_blocks(req.request_id, req.block_hashes, written, token_ids=tokens)
        after = coord.num_published_blocks(req.request_id)
        self.ops += (after - before) * len(self.groups)
        if self.partial is not None:
            self.partial.published(req, before, after, self.pool)
        self.state.commit(req)
        if self._wanted_pins:
            self._pin_what_is_cached()

    def _committed(self, req: Request) -> bool:
        """Commit the blocks ``req`` holds (:meth:`PoolMemory.handed_out`); False when that is refused."""
        if self.memory.handed_out(self.coordinator.block_tables(req.request_id)):  # type: ignore[union-attr]
            self._uncommitted.discard(req.request_id)
            return True
        return False

    def free(self, req: Request) -> None:
        """Free every block of ``req``, tail first (a no-op for a request that holds none); with ``memory``,
        the blocks left holding no KV are released."""
        self.ops += self.coordinator.num_blocks_held(req.request_id)
        self._free_blocks(req)
        self.state.free(req)

    def _free_blocks(self, req: Request) -> None:
        """The coordinator's free of ``req``, then (with ``memory``) the release of what holds no KV now."""
        coord, rid = self.coordinator, req.request_id
        tables = coord.block_tables(rid) if self.memory is not None and coord.num_blocks_held(rid) else ()
        coord.free(rid, req.priority)
        if tables:
            self.memory.emptied(b for table in tables for b in table)  # type: ignore[union-attr]
        self._uncommitted.discard(rid)

    def finish(self, req: Request) -> None:
        """Free finished ``req``'s blocks once its session and retained range kept theirs."""
        self.sessions.finished(req)
        self.free(req)

    def preempt(self, req: Request) -> None:
        """Free ``req``'s blocks (its published blocks stay cached) so it is recomputed from scratch."""
        self.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def reserve_decode(self, req: Request, steps: int) -> bool:
        """The KV side of ``steps`` decode steps of running ``req`` at once (one token a step, from
        ``req.num_computed_tokens`` on): allocate the blocks that ``steps`` calls of ``reserve(req, 1)``,
        one after the other with a :meth:`publish` after each, would allocate, in one pool call, where that
        is the same: one full-attention group (its table grows block by block either way), nothing to
        publish (every hashed block of ``req`` computed already), no recurrent state, no pin waiting, and
        free blocks enough without evicting one (so no KV event and no tier store falls between the
        steps). False, nothing changed, where that is not so. The caller counts the steps' tokens."""
        coord, computed = self.coordinator, req.num_computed_tokens
        if steps <= 0 or self.state.follows_each_step or self._wanted_pins or len(self.groups) != 1 or \
                self.groups[0].memory_kind.frees_blocks or \
                (self.caching and len(req.block_hashes) * self.block_size > computed):
            return False
        pool = self.pool
        if coord.num_blocks_to_allocate(req.request_id, computed + steps) > \
                pool.num_free_blocks - pool.num_evictable_blocks:
            return False
        return self.reserve(req, steps)

    def decode_room(self, req: Request) -> int:
        """Tokens running ``req`` can compute from now on without a pool call changing anything: up to the
        end of its blocks, before a window moves past a block, and (when its hashes cover the block being
        filled) short of the block's last slot, which publishes it."""
        room = self.coordinator.num_tokens_without_change(req.request_id, req.num_computed_tokens)
        filling = req.num_computed_tokens // self.block_size
        return room - 1 if self.caching and len(req.block_hashes) > filling else room

    def block_tables(self, req: Request) -> tuple[list[int], ...]:
        """Every group's block table of ``req`` (copies)."""
        return self.coordinator.block_tables(req.request_id)

    # ---- pins ---------------------------------------------------------------------------------------

    def pin_when_cached(self, block_hashes: Sequence[Hashable]) -> bool:
        """Pin the prefix ``block_hashes`` (a system prompt's) in every group as soon as all of it is cached
        (now, or after the publish that completes it); it stays pinned until :meth:`unpin_all`. Returns
        whether it is pinned now.

        Raises:
            ConfigError: the prefix is longer than the pool's pin cap.
        """
        hashes = list(block_hashes)
        if len(hashes) > self.pool.max_pinned_blocks:
            raise ConfigError(f"the prefix to pin is {len(hashes)} blocks, over the pool's pin cap of "
                              f"{self.pool.max_pinned_blocks}")
        self.state.pin(hashes)
        if self.coordinator.can_pin_prefix(hashes):
            self.pins.append(self.coordinator.pin_prefix(hashes))
            return True
        self._wanted_pins.append(hashes)
        return False

    def _pin_what_is_cached(self) -> None:
        coord = self.coordinator
        for hashes in list(self._wanted_pins):
            if coord.can_pin_prefix(hashes):
                self.pins.append(coord.pin_prefix(hashes))
                self._wanted_pins.remove(hashes)

    def unpin_all(self) -> int:
        """Undo every pin (and forget the prefixes still waiting); returns the blocks unpinned."""
        unpinned = sum(map(len, self.pins))
        for ids in self.pins:
            self.coordinator.unpin(ids)
        self.pins, self._wanted_pins = [], []
        self.state.unpin_all()
        return unpinned

    def empty(self) -> bool:
        """Empty the device cache while no request holds blocks (an engine going to sleep): every pinned
        prefix is unpinned and waits to be pinned again once cached (:meth:`pin_when_cached`), the prefix
        index is dropped (``BlockPool.reset_prefix_cache``: an ``AllBlocksCleared`` event), so are a
        hybrid's state checkpoints, and with ``memory`` every block is released. The tiers keep what they
        hold. Returns False, changing nothing, while a request holds blocks."""
        if self.coordinator.requests:
            return False
        pool = self.pool
        self.sessions.release_all()  # the sessions stay open, holding nothing
        waiting = [[pool.block_hash(b) for b in ids] for ids in self.pins] + self._wanted_pins
        self.unpin_all()
        pool.reset_prefix_cache()
        self._wanted_pins = waiting
        self.state.clear()
        if self.memory is not None:
            self.memory.release_all()
        return True

    # ---- state --------------------------------------------------------------------------------------

    def hits_by_place(self, *, first_admissions: bool = False) -> dict[str, int]:
        """Prefix-hit blocks by where they were found: ``device``, then each tier's medium (0 where none),
        over every admission (or only first admissions: a replay's hit ratio)."""
        return (self.first_stats if first_admissions else self.stats).places(self.tiers)

    def prefix_cache_stats(self) -> BlockPoolStats:
        """:attr:`stats` as the metrics read them: hits and misses in blocks over every admission (device
        and tier hits alike), and the pool's evictions."""
        s = self.stats
        return BlockPoolStats(s.hit_blocks, s.queried_blocks - s.hit_blocks, self.pool.stats.evictions)

    def num_token_slots_used(self, requests: Sequence[Request]) -> int:
        """Token slots holding KV now: the tokens written in each block the ``requests`` hold, a shared block
        counted once (a partly filled block counts its tokens). O(blocks they hold)."""
        filled: dict[int, int] = {}
        bs, null = self.block_size, self.null_block
        for req in list(requests):
            try:
                tables = self.coordinator.block_tables(req.request_id)
            except InvalidIdError:  # released since the list was copied
                continue
            for table in tables:
                for i, block in enumerate(table):
                    n = min(bs, req.num_computed_tokens - i * bs)
                    if block != null and n > filled.get(block, 0):
                        filled[block] = n
        return sum(filled.values())

    def check_integrity(self) -> None:
        """The coordinator's and the pool's invariants, and every tier's (IntegrityError)."""
        self.coordinator.check_integrity()
        if self.memory is not None:
            self.memory.check()
        if self.tiers is not None:
            self.tiers.check_integrity()
        self.state.check_integrity()

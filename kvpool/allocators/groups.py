"""KV cache groups over one :class:`BlockPool`: a block table per group per request (vLLM's hybrid manager).

A model's layers form KV cache groups (:func:`kvpool.spec.kv_cache_groups`); every group of a request has
its own block table, and all of them draw blocks from one pool (a block holds one group's layers). The
contract, per request:

* **Tables.** ``block_tables(r)[g][i]`` is the block holding tokens ``i*B .. i*B + B - 1`` of group g, or
  the pool's null block where the group will never read those tokens again. Full groups never hold the
  null block; in a sliding or chunked group the null entries are a prefix of the table.
* **Freeing out of the window.** ``remove_skipped_blocks(r, n)`` frees, in every windowed group, the blocks
  that no query at position ``>= n`` reads (:meth:`KVCacheGroup.skipped_blocks`) and puts the null block in
  their place. Call it before allocating a step's blocks, with the tokens already computed.
* **Prefix caching.** A block is keyed by its chained hash *and* its group: group 0 uses the hash itself (so
  a uniform model keys exactly as a plain ``BlockPool``), group ``g > 0`` the tuple ``(g, hash)``
  (:func:`~kvpool.allocators.group_tables.group_key`). A prefix of k blocks is a hit when every group can
  restore it: full groups need all k blocks cached, a windowed group only the blocks from
  ``skipped_blocks(k * B)`` to k (sliding: the blocks covering the last W - 1 tokens).
  :meth:`find_longest_cache_hit` returns the longest such prefix.
* **Atomicity.** ``allocate`` checks every group before it changes anything: it raises and hands out
  nothing when the pool is short. ``free`` releases every group's blocks, tail first across groups.

Bookkeeping only, like the pool below it: block ids, no tensors. ``check_integrity()`` checks the pool and
every group's tables against it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.allocators.block_pool import BlockPool, BlockPoolStats
from kvpool.allocators.group_tables import CacheHit, RequestTables, check_tables, group_key, tokens_arg
from kvpool.allocators.group_tables import split_group_key as split_group_key  # also its old import path
from kvpool.errors import InvalidArgumentError, InvalidIdError, OutOfBlocksError
from kvpool.numeric import IntArg, RealArg, as_int, as_optional_int
from kvpool.spec.kinds import MemoryKind, cdiv
from kvpool.spec.kv import KVCacheGroup, needs_null_block
from kvpool.units import plural

if TYPE_CHECKING:
    from kvpool.events.sink import KVEventSink


class KVCacheCoordinator:
    """Block tables of every KV cache group of ``groups`` over one :class:`BlockPool` of ``num_blocks``.

    Typical request life: ``hit = find_longest_cache_hit(hashes[:max_hit])``, ``allocate(r, tokens, hit)``;
    then each step ``reserve(r, computed, computed + new)`` (``remove_skipped_blocks`` then ``allocate``),
    run the model, ``cache_blocks(r, hashes, computed + new)``; at the end (or on preemption) ``free(r)``.

    ``pool`` is the :class:`BlockPool` (typed loosely: a wrapper with its methods may replace it, as the
    tensor-parallel leader's recording pool does).

    Args:
        groups: the model's groups (``KVCacheSpec.groups``), indexed 0, 1, ... with one block size.
        num_blocks: pool blocks, the null block included (reserved when a group has a window).
        enable_caching: prefix caching (as ``BlockPool``).
        event_sink: KV events of the pool (:class:`kvpool.events.sink.KVEventSink`): told how to read group
            keys, so each event names its group, its kind and its window.
        policy: the pool's eviction policy (a name or a fresh
            :class:`~kvpool.allocators.policies.EvictionPolicy`), as :class:`BlockPool` takes it. One policy
            orders the cached free blocks of every group (they share one pool); a windowed group's blocks
            that left the window are freed to it as they leave.
        pin_cap: the pool's pin cap, as :class:`BlockPool` takes it.
        admission: the pool's publish-step admission filter, as :class:`BlockPool` takes it.
        pool: an existing all-free :class:`BlockPool` to use instead of building one (``num_blocks`` must
            then be its size and it must reserve the null block exactly when a group has a window; the other
            pool options must be left at their defaults).

    Raises:
        InvalidArgumentError: no groups, groups not indexed in order, mixed block sizes, or a ``pool`` that
            does not fit these rules; as :class:`BlockPool` for the pool options.
    """

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: IntArg, *,
                 enable_caching: bool = True, event_sink: KVEventSink | None = None,
                 policy: str | object = "lru", pin_cap: RealArg = 0.5, admission: object = None,
                 pool: BlockPool | None = None) -> None:
        groups = tuple(groups)
        if not groups or [g.index for g in groups] != list(range(len(groups))):
            raise InvalidArgumentError("groups must be a non-empty sequence indexed 0, 1, ...")
        if len({g.block_size for g in groups}) != 1:
            raise InvalidArgumentError("every KV cache group must have the same block size")
        self.groups = groups
        self.block_size = groups[0].block_size
        windowed = needs_null_block(groups)
        if pool is not None:
            self._check_pool(pool, num_blocks, windowed, event_sink)
            event_sink = pool.event_sink
        if event_sink is not None:
            kinds = [(g.index, g.memory_kind) for g in groups]  # each event names its group's kind and window
            event_sink.use_groups(split_group_key, {i: (k.event_name, k.event_window) for i, k in kinds})
        self.pool: Any = pool if pool is not None else BlockPool(
            num_blocks, enable_caching=enable_caching, reserve_null_block=windowed,  # type: ignore[arg-type]
            event_sink=event_sink, policy=policy, pin_cap=pin_cap, admission=admission)
        self.null_block: int = self.pool.null_block if windowed else -1  # type: ignore[assignment]
        # groups needing a whole prefix first: their hit is a prefix scan, and it bounds the others' scans
        self._hit_order = sorted(groups, key=lambda g: not g.memory_kind.needs_whole_prefix)
        self._one_full_group = len(groups) == 1 and groups[0].memory_kind.needs_whole_prefix
        self._windowed = [g for g in groups if g.memory_kind.frees_blocks]
        # each group that frees blocks, with its kind: the kind's rules, called natively
        self._windows: list[tuple[int, MemoryKind]] = [(g.index, g.memory_kind) for g in self._windowed]
        self._reqs: dict[Hashable, RequestTables] = {}
        self._hits = self._misses = 0

    @staticmethod
    def _check_pool(pool: BlockPool, num_blocks: IntArg, windowed: bool, sink: KVEventSink | None) -> None:
        if not isinstance(pool, BlockPool) or pool.num_used_blocks or pool.num_blocks != num_blocks or \
                (pool.null_block is not None) != windowed or sink is not None:
            raise InvalidArgumentError(f"pool must be an all-free BlockPool of {num_blocks} blocks that "
                                       f"{'reserves' if windowed else 'does not reserve'} the null block "
                                       f"(and no event_sink beside it), got {pool!r}")

    # ---- prefix cache -----------------------------------------------------------------------------------

    def find_longest_cache_hit(self, block_hashes: Sequence[Hashable], max_blocks: IntArg | None = None, *,
                               probe: Callable[[int, Sequence[Hashable], int], int | None] | None = None,
                               count: bool = True) -> CacheHit:
        """The longest prefix of ``block_hashes`` (at most ``max_blocks`` blocks) every group can restore.

        Each group's hit is the longest prefix not longer than the current bound that the group can restore
        (full: a prefix scan; windowed: a scan down from the bound, skipping past each miss, O(bound)); the
        bound shrinks to the minimum until no group lowers it. Every group's hit set is closed under that
        scan, so the fixed point is the longest common hit. With ``count``, counts ``stats`` (hits = k,
        misses = bound - k). Changes no ref count: pass the hit to :meth:`allocate` at once.

        ``probe(g, block_hashes, i)`` says where block ``i`` of group ``g`` (its key ``group_key(g,
        block_hashes[i])``) is held, in place of the pool's ``get_cached_block``: a block id of this pool, an
        int below -1 for a block held outside the pool (the offload manager's tiers: see
        :meth:`kvpool.tiers.manager.OffloadManager.probe`), or None; it is asked at most once per (g, i).
        Such a hit is a plan, not a device hit: its tables hold those codes, and :meth:`allocate` refuses
        it.

        Raises:
            InvalidArgumentError: ``max_blocks`` not None or an integer >= 0.
        """
        max_blocks = as_optional_int(max_blocks, "max_blocks", minimum=0)
        limit = len(block_hashes) if max_blocks is None else min(max_blocks, len(block_hashes))
        if probe is None and self._one_full_group:  # a uniform model: the pool's own prefix match
            keys = block_hashes[:limit] if limit < len(block_hashes) else block_hashes
            blocks = self.pool.match_prefix(keys)
            if count:
                self._hits += len(blocks)
                self._misses += limit - len(blocks)
            return CacheHit(len(blocks), (blocks,), tuple(block_hashes[:len(blocks)]))
        probes: list[dict[int, int | None]] = [{} for _ in self.groups]
        k = limit if self.pool.enable_caching else 0
        changed = True
        while changed and k:
            changed = False
            for group in self._hit_order:
                hit = self._group_hit(group, block_hashes, k, probes[group.index], probe)
                if hit < k:
                    k, changed = hit, True
        if count:
            self._hits += k
            self._misses += limit - k
        return CacheHit(k, tuple(self._hit_table(g, k, probes[g.index]) for g in self.groups),
                        tuple(block_hashes[:k]))

    def _probe(self, group: KVCacheGroup, hashes: Sequence[Hashable], i: int, memo: dict[int, int | None],
               probe: Callable[[int, Sequence[Hashable], int], int | None] | None) -> int | None:
        if i not in memo:
            memo[i] = self.pool.get_cached_block(group_key(group.index, hashes[i])) if probe is None \
                else probe(group.index, hashes, i)
        return memo[i]

    def _group_hit(self, group: KVCacheGroup, hashes: Sequence[Hashable], bound: int,
                   memo: dict[int, int | None],
                   probe: Callable[[int, Sequence[Hashable], int], int | None] | None) -> int:
        """The longest k <= bound that ``group`` can restore: its kind's
        :meth:`~kvpool.spec.kinds.MemoryKind.longest_hit` over the blocks cached in it."""

        def cached(i: int) -> bool:
            return self._probe(group, hashes, i, memo, probe) is not None

        return group.memory_kind.longest_hit(bound, self.block_size, cached)

    def _hit_table(self, group: KVCacheGroup, k: int, memo: dict[int, int | None]) -> list[int]:
        start = group.memory_kind.hit_start(k, self.block_size) if k else 0
        return [self.null_block] * start + [memo[i] for i in range(start, k)]  # type: ignore[misc]

    # ---- allocation -------------------------------------------------------------------------------------

    def num_blocks_to_allocate(self, request_id: Hashable, num_tokens: IntArg, hit: CacheHit | None = None
                               ) -> int:
        """Free blocks that :meth:`allocate` would consume: new blocks for every group to cover
        ``num_tokens`` tokens, plus hit blocks that are cached free (touching them takes them off the free
        list; as ``BlockPool.num_blocks_to_allocate``), plus one per entry a probed hit found outside the
        pool (a block to load it into). Raises InvalidArgumentError for a ``num_tokens`` that is not an
        integer >= 0."""
        req = self._reqs.get(request_id)
        if req is not None:
            target = cdiv(tokens_arg(num_tokens), self.block_size)
            return sum(max(0, target - len(t)) for t in req.tables)
        new = self.num_new_blocks(num_tokens, 0 if hit is None else hit.num_blocks)
        if hit is None:
            return new
        null, revived = self.null_block, 0
        for blocks in hit.blocks:  # pool blocks, null entries, and codes of blocks held in a tier (< -1)
            held = [b for b in blocks if b >= 0 and b != null]
            revived += self.pool.num_unreferenced(held) + len(blocks) - len(held) - blocks.count(null)
        return new + revived

    def num_new_blocks(self, num_tokens: IntArg, num_hit_blocks: int = 0) -> int:
        """Blocks a new request of ``num_tokens`` tokens allocates besides a hit of ``num_hit_blocks`` blocks:
        ``max(0, cdiv(num_tokens, B) - num_hit_blocks)`` in every group (a hit's table covers its k
        positions, null entries included). Raises InvalidArgumentError for a ``num_tokens`` that is not an
        integer >= 0."""
        target = cdiv(tokens_arg(num_tokens), self.block_size)
        return max(0, target - num_hit_blocks) * len(self.groups)

    def can_allocate(self, request_id: Hashable, num_tokens: IntArg, hit: CacheHit | None = None) -> bool:
        """Whether :meth:`num_blocks_to_allocate` fits in :attr:`num_free_blocks` now; the hit's cached free
        blocks are counted only when its new blocks fit (a short pool answers in O(groups)). Raises as
        :meth:`num_blocks_to_allocate`."""
        free = self.pool.num_free_blocks
        if hit is not None and request_id not in self._reqs \
                and self.num_new_blocks(num_tokens, hit.num_blocks) > free:
            return False
        return self.num_blocks_to_allocate(request_id, num_tokens, hit) <= free

    def allocate(self, request_id: Hashable, num_tokens: IntArg, hit: CacheHit | None = None) -> None:
        """Give every group of ``request_id`` blocks for its first ``num_tokens`` tokens.

        A new request may start from ``hit`` (from :meth:`find_longest_cache_hit`, just before): its blocks
        are touched and its k blocks count as computed and published. A running request only grows.

        Raises:
            InvalidArgumentError: ``num_tokens`` not an int >= 0, a hit for a running request, or a stale
                hit (one of its blocks lost its hash since, or holds another one now: evicted and reused).
            OutOfBlocksError: the pool has fewer free blocks than :meth:`num_blocks_to_allocate`; nothing
                changed.
        """
        req = self._reqs.get(request_id)
        if req is not None and hit is None and type(num_tokens) is int and num_tokens >= 0:
            grow = -(-num_tokens // self.block_size) - len(req.tables[0])
            if grow > 0:  # a running request: every group's table has one length, so all grow alike
                self._grow(request_id, req.tables, grow)
            return
        num_tokens = as_int(num_tokens, "num_tokens", minimum=0)
        if hit is not None:
            if req is not None:
                raise InvalidArgumentError(f"request {request_id!r} is running: a cache hit is for a new one")
            self._check_hit(hit)
        need = self.num_blocks_to_allocate(request_id, num_tokens, hit)
        if need > self.pool.num_free_blocks:
            raise OutOfBlocksError(f"request {request_id!r} needs {plural(need, 'block')} for "
                                   f"{plural(num_tokens, 'token')} over {plural(len(self.groups), 'group')}, "
                                   f"{self.pool.num_free_blocks} free")
        tables = self._admit(request_id, hit) if req is None else req.tables
        target, allocate = cdiv(num_tokens, self.block_size), self.pool.allocate
        for table in tables:
            if len(table) < target:
                table += allocate(target - len(table))

    def reserve(self, request_id: Hashable, num_computed_tokens: IntArg, num_tokens: IntArg) -> bool:
        """One step of a running request: :meth:`remove_skipped_blocks` for its ``num_computed_tokens``,
        then :meth:`allocate` for ``num_tokens``. Returns False, with no block handed out (the windows'
        blocks are freed all the same), when the pool is short; what an engine's scheduler calls.

        Raises:
            InvalidIdError: an unknown request.
            InvalidArgumentError: ``num_computed_tokens`` or ``num_tokens`` not an int >= 0 (whether or not
                a group has a window).
        """
        req = self._reqs.get(request_id)
        if req is None:
            raise InvalidIdError(f"no request {request_id!r} holds blocks")
        if type(num_tokens) is not int or num_tokens < 0:
            num_tokens = as_int(num_tokens, "num_tokens", minimum=0)
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            num_computed_tokens = as_int(num_computed_tokens, "num_computed_tokens", minimum=0)
        if self._windowed and num_computed_tokens >= req.next_skip:
            self._remove_skipped(req, num_computed_tokens)
        grow = -(-num_tokens // self.block_size) - len(req.tables[0])
        if grow > 0:
            try:
                self._grow(request_id, req.tables, grow)
            except OutOfBlocksError:
                return False
        return True

    def _grow(self, request_id: Hashable, tables: list[list[int]], grow: int) -> None:
        """Add ``grow`` > 0 blocks to every table of a running request, in one pool call."""
        need, pool = grow * len(tables), self.pool
        try:  # hands out nothing when it raises; made natively where the pool is compiled
            blocks = pool.allocate(need) if isinstance(pool, BlockPool) else pool.allocate(need)
        except OutOfBlocksError:
            free = self.pool.num_free_blocks
            raise OutOfBlocksError(f"request {request_id!r} needs {plural(need, 'block')} over "
                                   f"{plural(len(tables), 'group')}, {free} free") from None
        if len(tables) == 1:
            tables[0] += blocks
            return
        for i, table in enumerate(tables):
            table += blocks[i * grow:(i + 1) * grow]

    def _check_hit(self, hit: CacheHit) -> None:
        """Every hit block still holds a hash (with ``hit.block_hashes``: its own group's key of the hash at
        its position), so a block evicted and handed to another request since the lookup is never shared."""
        hashes = hit.block_hashes
        if len(hit.blocks) != len(self.groups) or any(len(b) != hit.num_blocks for b in hit.blocks) or (
                hashes and len(hashes) != hit.num_blocks):
            raise InvalidArgumentError("the cache hit does not match these groups")
        pool, null = self.pool, self.null_block
        for g, blocks in enumerate(hit.blocks):  # one pool read per group
            pos = [i for i, b in enumerate(blocks) if b != null] if self._windowed else range(len(blocks))
            ids = [blocks[i] for i in pos] if self._windowed else blocks
            if ids and min(ids) < 0:
                raise InvalidArgumentError("the cache hit names blocks held outside the pool (a probed "
                                           "plan): load them first, then look the prefix up again")
            held = pool.block_hashes_of(ids)
            if not hashes:
                stale = [j for j, h in enumerate(held) if h is None]
            elif g == 0 and not self._windowed:
                stale = [] if held == list(hashes) else [j for j, h in enumerate(held) if h != hashes[j]]
            else:
                stale = [j for j, i in enumerate(pos) if held[j] != group_key(g, hashes[i])]
            if stale:
                raise InvalidArgumentError(f"stale cache hit: block {ids[stale[0]]} no longer holds the hash "
                                           "it was found under; look it up again")

    def _admit(self, request_id: Hashable, hit: CacheHit | None) -> list[list[int]]:
        if hit is None:
            tables: list[list[int]] = [[] for _ in self.groups]
            skipped = [0] * len(self.groups)
        else:
            tables = [list(blocks) for blocks in hit.blocks]
            skipped = [b.count(self.null_block) for b in tables]
            null = self.null_block
            for table in tables:
                self.pool.touch([b for b in table if b != null] if self._windowed else table)
        self._reqs[request_id] = RequestTables(tables, skipped, hit.num_blocks if hit is not None else 0)
        return tables

    def remove_skipped_blocks(self, request_id: Hashable, num_computed_tokens: IntArg) -> int:
        """Free, in every windowed group, the blocks no query at position ``>= num_computed_tokens`` reads,
        oldest first (they were published when full, so they stay cached until evicted), and put the null
        block in their place. Returns how many blocks were freed. O(blocks freed) per group.

        Raises:
            InvalidArgumentError: ``num_computed_tokens`` not an integer >= 0.
            InvalidIdError: an unknown request.
        """
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            num_computed_tokens = as_int(num_computed_tokens, "num_computed_tokens", minimum=0)
        if not self._windowed:
            return 0  # fast path: no window
        req = self._reqs.get(request_id)
        if req is None:
            raise InvalidIdError(f"no request {request_id!r} holds blocks")
        if num_computed_tokens < req.next_skip:
            return 0  # fast path: no window has moved past a block since the last call
        return self._remove_skipped(req, num_computed_tokens)

    def _remove_skipped(self, req: RequestTables, num_computed_tokens: int) -> int:
        tables, skipped, freed, next_skip = req.tables, req.skipped, 0, 2**62
        pool, null, bs = self.pool, self.null_block, self.block_size
        for g, kind in self._windows:
            table = tables[g]
            dead = kind.skipped_blocks(num_computed_tokens, bs)
            end, first = min(dead, len(table)), skipped[g]
            if end > first:
                ids = table[first:end]
                if isinstance(pool, BlockPool):  # the same call, made natively where the pool is compiled
                    pool.free(ids)
                else:
                    pool.free(ids)
                table[first:end] = [null] * (end - first)
                freed += end - first
                skipped[g] = end
            next_skip = min(next_skip, kind.skip_moves_at(dead, bs) if end == dead else 0)
        req.next_skip = next_skip
        return freed

    def cache_blocks(self, request_id: Hashable, block_hashes: Sequence[Hashable], num_tokens: IntArg, *,
                     token_ids: Sequence[int] | None = None) -> None:
        """Publish, in every group, the full blocks of the first ``num_tokens`` tokens whose KV is now
        written (the blocks not published yet; ``block_hashes`` are the request's chained hashes, one per
        full block). Null entries are skipped. ``token_ids``, the request's tokens (at least
        ``num_tokens``), are what the pool's KV events carry, with each group's parent hash; only a pool
        with an event sink reads them.

        Raises:
            InvalidIdError: an unknown request.
            InvalidArgumentError: ``num_tokens`` not an integer >= 0, fewer hashes than full blocks, a table
                that does not cover them, or fewer token ids than ``num_tokens``.
        """
        req = self._reqs.get(request_id)
        if type(num_tokens) is not int or num_tokens < 0:
            num_tokens = as_int(num_tokens, "num_tokens", minimum=0)
        full = num_tokens // self.block_size
        if req is not None and full <= req.published:
            return  # fast path: no block filled since the last call
        tables = self._tables_of(request_id)
        start = req.published  # type: ignore[union-attr]  # _tables_of raised when req is None
        if len(block_hashes) < full or len(tables[0]) < full:  # every group's table has one length
            raise InvalidArgumentError(f"{num_tokens} tokens need {full} hashes and blocks in every group, "
                                       f"got {len(block_hashes)} hashes")
        pool = self.pool
        hashes = list(block_hashes[start:full])
        if pool.event_sink is None:  # one pool call for every group (the pool skips null entries)
            ids, keys = tables[0][start:full], hashes
            for g in range(1, len(tables)):
                ids += tables[g][start:full]
                keys = keys + [(g, h) for h in hashes]
            if isinstance(pool, BlockPool):  # the same call, made natively where the pool is compiled
                pool.cache_blocks(ids, keys)
            else:
                pool.cache_blocks(ids, keys)
            req.published = full  # type: ignore[union-attr]
            return
        if token_ids is not None and len(token_ids) < full * self.block_size:
            raise InvalidArgumentError(f"{num_tokens} tokens published but {len(token_ids)} token ids given")
        tokens = token_ids[start * self.block_size:full * self.block_size] if token_ids else None
        for g, table in enumerate(tables):  # per group: each group's events name its own parent
            keys = hashes if g == 0 else [(g, h) for h in hashes]
            parent = group_key(g, block_hashes[start - 1]) if start else None
            self.pool.cache_blocks(table[start:full], keys, parent_hash=parent, token_ids=tokens)
        req.published = full  # type: ignore[union-attr]

    def free(self, request_id: Hashable, priority: IntArg = 0) -> None:
        """Release every block of ``request_id``: position by position from the tail, every group's block at
        a position together, so a prefix's head is evicted last in all groups. ``priority``: the request's
        retention priority, as :meth:`BlockPool.free` takes it (only the ``priority`` policy reads it).
        No-op for an unknown id. Raises InvalidArgumentError (nothing freed) for a ``priority`` that is not
        an integer."""
        if type(priority) is not int:
            priority = as_int(priority, "priority")
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        tables = req.tables
        longest, null = max(len(t) for t in tables), self.null_block
        if len(tables) == 1:
            order = tables[0][::-1]
        else:
            order = [t[i] for i in range(longest - 1, -1, -1) for t in tables if i < len(t)]
        ids = [b for b in order if b != null] if self._windowed else order
        pool = self.pool
        if isinstance(pool, BlockPool):  # its own table: distinct held ids, no null block (no checks needed)
            pool._release(ids, priority)
        elif priority:
            pool.free(ids, priority)
        else:
            pool.free(ids)

    # ---- pins -------------------------------------------------------------------------------------------

    def pin_prefix(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """Pin what every group needs to restore the prefix ``block_hashes`` (a system prompt's: full groups
        every block, a windowed group the blocks of its window at the prefix's end) and return those block
        ids (pass them to :meth:`unpin`). Counts no stats.

        Raises:
            InvalidIdError: some group cannot restore the whole prefix now (nothing is pinned).
            PinLimitError: as :meth:`BlockPool.pin`.
        """
        ids = self._prefix_blocks(block_hashes)
        if ids is None:
            raise InvalidIdError(f"the prefix of {plural(len(block_hashes), 'block')} is not cached in every "
                                 "KV cache group: a pin needs all of it")
        self.pool.pin(ids)
        return ids

    def can_pin_prefix(self, block_hashes: Sequence[Hashable]) -> bool:
        """Whether :meth:`pin_prefix` would succeed now (every group restores the prefix, room under the
        pin cap). Counts no stats."""
        ids = self._prefix_blocks(block_hashes)
        if ids is None:
            return False
        pinned = self.pool.pinned_blocks()
        return self.pool.num_pinned_blocks + sum(1 for b in ids if b not in pinned) <= \
            self.pool.max_pinned_blocks

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Undo :meth:`pin_prefix` (as :meth:`BlockPool.unpin`)."""
        self.pool.unpin(block_ids)

    def _prefix_blocks(self, block_hashes: Sequence[Hashable]) -> list[int] | None:
        """The distinct non-null blocks a hit of all of ``block_hashes`` uses, or None when shorter."""
        hit = self.find_longest_cache_hit(block_hashes, count=False)
        if hit.num_blocks < len(block_hashes):
            return None
        null = self.null_block
        return [b for blocks in hit.blocks for b in blocks if b != null]

    def num_tokens_without_change(self, request_id: Hashable, num_computed_tokens: IntArg) -> int:
        """Tokens ``request_id`` can compute from ``num_computed_tokens`` on (one per decode step) with no
        block allocated or freed: up to the end of its tables and, with windows, until a block leaves a
        window (``reserve`` then frees it). A replay runs that many decode steps in one go.

        Raises:
            InvalidIdError: an unknown request.
            InvalidArgumentError: ``num_computed_tokens`` not an integer >= 0.
        """
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            num_computed_tokens = as_int(num_computed_tokens, "num_computed_tokens", minimum=0)
        req = self._reqs.get(request_id)
        if req is None:
            raise InvalidIdError(f"no request {request_id!r} holds blocks")
        end = len(req.tables[0]) * self.block_size
        if self._windowed:
            end = min(end, req.next_skip)
        return max(0, end - num_computed_tokens)

    # ---- state ------------------------------------------------------------------------------------------

    def _tables_of(self, request_id: Hashable) -> list[list[int]]:
        req = self._reqs.get(request_id)
        if req is None:
            raise InvalidIdError(f"no request {request_id!r} holds blocks")
        return req.tables

    def rename_blocks(self, moved: dict[int, int]) -> None:
        """Name ``moved[b]`` instead of ``b`` in every request's tables (a compaction moved those blocks:
        :meth:`BlockPool.move_block`, :mod:`kvpool.requests.compaction`). O(blocks in tables)."""
        for req in self._reqs.values():
            for table in req.tables:
                for i in range(len(table)):
                    table[i] = moved.get(table[i], table[i])

    def block_tables(self, request_id: Hashable) -> tuple[list[int], ...]:
        """Every group's block table of ``request_id`` (copies). Raises InvalidIdError for an unknown id."""
        return tuple(list(t) for t in self._tables_of(request_id))

    def num_published_blocks(self, request_id: Hashable) -> int:
        """Leading full blocks of ``request_id`` published in every group (its hit included); 0 for an
        unknown id."""
        req = self._reqs.get(request_id)
        return 0 if req is None else req.published

    def num_blocks_held(self, request_id: Hashable) -> int:
        """Blocks ``request_id`` holds over all groups (null entries not counted)."""
        req = self._reqs.get(request_id)
        return 0 if req is None else sum(map(len, req.tables)) - sum(req.skipped)

    @property
    def requests(self) -> list[Hashable]:
        """Ids of the requests that hold blocks."""
        return list(self._reqs)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def stats(self) -> BlockPoolStats:
        """Hits and misses of :meth:`find_longest_cache_hit` (in blocks of the common prefix), and the
        pool's evictions."""
        return BlockPoolStats(self._hits, self._misses, self.pool.stats.evictions)

    def check_integrity(self) -> None:
        """The pool's invariants, and every group's tables against it: ref counts equal the table entries
        naming each block plus its pins; a block appears in one group only; full groups hold no null entry
        and windowed groups only a prefix of them; a published block holds its own group's key. O(blocks in
        tables + num_blocks). Raises IntegrityError naming what broke."""
        self.pool.check_integrity()
        check_tables(self.pool, self.groups, self.null_block, self._reqs)

    def __repr__(self) -> str:
        return (f"KVCacheCoordinator(groups={len(self.groups)}, requests={len(self._reqs)}, "
                f"pool={self.pool!r})")

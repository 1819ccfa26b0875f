"""The prefix cache of a block pool: publishing full blocks (``cache_blocks``), lookups, ``evict_blocks`` and
``reset_prefix_cache``, with their KV events (a layer of :class:`~kvpool.allocators.block_pool.BlockPool`,
:class:`PoolPrefix`; see :mod:`kvpool.allocators.pool_core`)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvpool.allocators.pool_alloc import PoolAlloc
from kvpool.allocators.pool_core import (
    _hash_list,
    _hashable,
    _ints,
    _non_null_positions,
    _without_null,
)
from kvpool.allocators.prefix_index import NO_HASH
from kvpool.errors import (
    InvalidArgumentError,
    InvalidIdError,
)
from kvpool.numeric import IntArg, as_id_list, as_int

if TYPE_CHECKING:
    from kvpool.events.sink import KVEventSink


class PoolPrefix(PoolAlloc):
    """The prefix cache of a block pool: see :class:`~kvpool.allocators.block_pool.BlockPool`."""

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

    def move_block(self, src: IntArg, dst: IntArg) -> None:
        """Give what block ``src`` holds to the free, unhashed block ``dst``: its ref count, its hash (the
        prefix index names ``dst`` from now on; a lookup may find another holder of the same hash first)
        and, for a cached free block, its place in the eviction order (exact under LRU; other policies take
        it as newly released: :meth:`EvictionPolicy.moved`). ``src`` becomes free (top of the free stack).
        For compaction (:mod:`kvpool.requests.compaction`): the caller copies the KV first and renames
        ``src`` in every block table. No KV event: events name hashes, and the hash stays on the device.

        Raises:
            InvalidIdError: an id out of range or not an integer, the null block, ``src == dst``, a ``src``
                that is free without a hash or pinned (its pins' holders name it by id), or a ``dst`` that is
                referenced or holds a hash. Nothing changes then.
        """
        s, d = _ints([src, dst])
        low, n = self._reserved, self._n
        if not (low <= s < n and low <= d < n) or s == d:
            raise InvalidIdError(f"move_block needs two distinct ids in [{low}, {n}), got {s} -> {d}")
        if not (self._ref_of(s) or self._holds(s)) or s in self._pins:
            raise InvalidIdError(f"block {s} holds nothing to move, or is pinned")
        if self._ref_of(d) or self._holds(d):
            raise InvalidIdError(f"block {d} is not a free block without a hash")
        if d >= self._fresh:  # ids never handed out, up to d: d is taken, those below it join the free stack
            self._free.extend([b for b in self._take_fresh(d + 1 - self._fresh) if b != d])
        else:
            (self._tail if d in self._tail else self._free).remove(d)
        ref, idx = self._ref, self._idx
        r = ref[s]
        held = idx.hash_of(s)
        if held is not None:
            idx.remove(s)
            idx.publish(d, held)
            self._policy.moved(s, d, held, r == 0)
        ref[d], ref[s] = r, 0
        self._free.append(s)

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

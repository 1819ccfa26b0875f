"""``HostTier``: the host (CPU) tier, a :class:`HostKVCache` whose own :class:`BlockPool` indexes its blocks
by block hash, in LRU order. The memory, the copies and the copies in flight are the host cache's
(:mod:`kvpool.storage.host`); this module adds the tier contract (:class:`TierBackend`) over it.

A host block holding a hash is a *cached free* block of the host pool while idle (evictable, LRU order; a
read or a refresh moves it to the tail) and *in use* while a copy into it is still landing (CUDA), so it is
never overwritten or evicted mid-copy. Evictions are the host pool's own: a store into a full host tier
recycles the LRU head, and the pool's eviction listener (set by the offload manager) sees those blocks
before they are reused, to cascade their KV down.

Besides the generic batched ``get``/``set`` of tier rows, the tier swaps directly with the device cache
(:meth:`store_from_device`, :meth:`load_to_device`: one batched copy each, through HostKVCache's swap_out
and swap_in, streams and events on CUDA). Built without a device cache (``like=None``) it holds hashes
only, for a replay that moves no data.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from kvpool.allocators.block_pool import BlockPool
from kvpool.errors import IntegrityError
from kvpool.storage.arena import ElasticConfig
from kvpool.storage.block_copy import gather_rows, scatter_rows
from kvpool.storage.host import HostKVCache
from kvpool.storage.paged import BlockStore
from kvpool.tiers.backend import Namespace, TierBackend, TierStats


class HostTier(TierBackend):
    """``num_blocks`` host blocks shaped like the device cache ``like`` (pinned on CUDA), or hash-only.

    Keys are the block hashes themselves (they never leave the process, so no :func:`block_key` form).
    ``elastic``: the host memory sits on a page arena (:class:`~kvpool.storage.host.HostKVCache`): it grows
    with the blocks stored and shrinks as :meth:`delete` drops them.

    Raises:
        InvalidArgumentError: ``num_blocks`` < 1; ConfigError: the host buffer cannot be allocated.
    """

    medium = "host"

    def __init__(self, num_blocks: int, namespace: Namespace, *, like: BlockStore | None = None,
                 pin_memory: bool | None = None, elastic: bool | ElasticConfig = False) -> None:
        super().__init__(namespace, like.bytes_per_block if like is not None else 0)
        if like is not None:
            self.host: HostKVCache | None = HostKVCache.like(like, num_blocks, pin_memory=pin_memory,
                                                             enable_caching=True, elastic=elastic)
            self.pool = self.host.pool
        else:
            self.host, self.pool = None, BlockPool(num_blocks)
        self._overflow = 0  # blocks a store left out for want of room (evicted at once)
        self.ops = 0  # block ids and hashes handled by calls of the host pool (as a replay counts them)

    # ---- the generic interface (tier rows) ----------------------------------------------------------

    def exists(self, keys: Sequence[Hashable]) -> int:
        with self._lock:
            return self._prefix_len(keys)

    def _prefix_len(self, keys: Sequence[Hashable]) -> int:
        get, n = self.pool.get_cached_block, 0
        for key in keys:
            if get(key) is None:
                break
            n += 1
        return n

    def get(self, keys: Sequence[Hashable], out: torch.Tensor | None) -> int:
        if self.host is not None:
            self._check_rows(keys, out, "out")
        with self._lock:
            ids = self._hold_prefix(keys)
            if ids and self.host is not None:
                if self.host.num_in_flight:  # a copy may still be landing in one of them (CUDA)
                    self.host.synchronize()
                gather_rows(self.host.cache, ids, out)
            return self._release_loaded(ids, len(keys))

    def set(self, keys: Sequence[Hashable], blocks: torch.Tensor | None) -> int:
        """As :meth:`store_from_device`, from tier rows; the blocks that do not fit are counted as
        evictions (a one-at-a-time store would evict them at once)."""
        holds_data = self._holds_data
        if holds_data:
            self._check_rows(keys, blocks, "blocks")
        with self._lock:
            new = self._refresh(keys)
            held = len(keys) - len(new)
            left_out, new = self._fit(new)
            ids = self._allocate(len(new)) if new else []
            if ids and holds_data:
                self._write_rows(ids, new, blocks)  # type: ignore[arg-type]
            self._publish(ids, [keys[i] for i in new])
            self._overflow += len(left_out)
            return held + len(ids)

    @property
    def _holds_data(self) -> bool:
        """Whether blocks carry bytes here (False: a hash-only tier of a replay, ``host`` None)."""
        return self.host is not None

    def _write_rows(self, ids: list[int], new: list[int], blocks: torch.Tensor) -> None:
        """Write rows ``blocks[new]`` into this tier's blocks ``ids`` (the lock held)."""
        assert self.host is not None
        scatter_rows(self.host.cache, ids, blocks if new == list(range(len(new))) else blocks[new])

    def delete(self, keys: Sequence[Hashable]) -> int:
        with self._lock:
            ids = [b for b in map(self.pool.get_cached_block, keys) if b is not None]
            idle = [b for b in ids if self.pool.ref_count(b) == 0]
            self.pool.touch(idle)
            self.pool.evict_blocks(idle)
            self.pool.free(idle)
            if self.host is not None:
                self.host.release_free(idle)
            return len(idle)

    def clear(self) -> int:
        with self._lock:
            self.synchronize()
            return self.delete([self.pool.block_hash(b) for b in self.pool.evictable_blocks()])

    # ---- the device path ------------------------------------------------------------------------------

    def store_from_device(self, cache: BlockStore | None, block_ids: Sequence[int], keys: Sequence[Hashable],
                          *, hold: BlockPool | None = None) -> list[int]:
        """Copy device blocks ``block_ids`` of ``cache`` into host blocks published under ``keys`` (one
        batched swap-out), in order, as if one at a time into an LRU: keys held already are refreshed, not
        copied. Returns the indices (into ``keys``) of the blocks that did not fit: when fewer host blocks
        can be had (free, or idle and evictable) than there are new keys, the first ones, which a
        one-at-a-time store would have evicted again at once, are left out. Evicting host blocks for room
        tells the host pool's eviction listener first (the cascade down). ``hold``: the device pool, whose
        blocks keep an extra reference until their copy completes (CUDA; on the CPU it is done on return).
        """
        with self._lock:
            self._poll()
            left_out, new = self._fit(self._refresh(keys))
            if not new:
                return left_out
            new_keys = [keys[i] for i in new]
            if self.host is None or cache is None:
                self._publish(self._allocate(len(new)), new_keys)
                return left_out
            # published now, in use until the copy lands (on the CPU: at once), never evicted half-written
            ids = self.host.swap_out(cache, [block_ids[i] for i in new], pool=hold, publish=new_keys)
            self.ops += 3 * len(ids)  # allocated, published, freed
            self._count_stored(len(ids))
            return left_out

    def load_to_device(self, cache: BlockStore | None, keys: Sequence[Hashable], block_ids: Sequence[int]
                       ) -> int:
        """Copy the leading held blocks of ``keys`` into device blocks ``block_ids`` of ``cache`` (one
        batched swap-in; on CUDA the current stream waits for it); returns how many. A read refreshes them."""
        with self._lock:
            ids = self._hold_prefix(keys)
            if ids and self.host is not None and cache is not None:
                self.host.swap_in(cache, ids, list(block_ids[:len(ids)]))
            return self._release_loaded(ids, len(keys))

    def fence(self, device: torch.device) -> None:
        """Order ``device``'s current stream after every swap queued so far (CUDA; no-op on the CPU)."""
        if self.host is not None:
            self.host.fence(device)

    def poll(self) -> None:
        """Complete finished copies (CUDA): their host blocks become idle (evictable) cached blocks."""
        with self._lock:
            self._poll()

    def synchronize(self) -> None:
        """Wait for every copy in flight and complete it."""
        with self._lock:
            if self.host is not None:
                self.host.synchronize()
            self._poll()

    # ---- bookkeeping ----------------------------------------------------------------------------------

    def _poll(self) -> None:
        if self.host is not None:
            self.host.poll()  # landed copies free their host blocks: idle cached blocks now

    def _refresh(self, keys: Sequence[Hashable]) -> list[int]:
        """Move the held ones of ``keys`` to the LRU tail, in order (touched and freed together: a block in
        use, landing or being read, keeps its reference and its place); return the indices of the others
        (first occurrence only)."""
        get, new, held, seen = self.pool.get_cached_block, [], [], set()
        for i, key in enumerate(keys):
            block = get(key)
            if block is not None:
                if block not in seen:
                    held.append(block)
                    seen.add(block)
            elif key not in seen:
                seen.add(key)
                new.append(i)
        if held:
            self.pool.touch(held)
            self.pool.free(held)
        self.ops += len(keys) + 2 * len(held)
        return new

    def _allocate(self, n: int) -> list[int]:
        """``n`` host blocks (their pages committed on an elastic host store)."""
        return self.pool.allocate(n) if self.host is None else self.host.allocate(n)

    def _fit(self, new: list[int]) -> tuple[list[int], list[int]]:
        """Split ``new`` into (the first ones that do not fit, the last ones that do)."""
        skip = max(0, len(new) - self.pool.num_free_blocks)
        return new[:skip], new[skip:]

    def _hold_prefix(self, keys: Sequence[Hashable]) -> list[int]:
        """Host blocks of the leading held keys, each touched (held while it is read)."""
        ids = self.pool.lookup(keys)
        self.pool.touch(ids)
        self.ops += min(len(ids) + 1, len(keys)) + len(ids)
        return ids

    def _release_loaded(self, ids: list[int], asked: int) -> int:
        """Free the blocks a read held (tail first: the head of a chain ends most recently used) and count
        the load; a read that stopped early is one miss."""
        self.pool.free(ids[::-1])
        self.ops += len(ids)
        stats = self._stats
        stats.loaded += len(ids)
        stats.loaded_bytes += len(ids) * self.block_bytes
        if len(ids) < asked:
            stats.missing += 1
        return len(ids)

    def _publish(self, ids: list[int], keys: list[Hashable]) -> None:
        """Publish freshly written host blocks ``ids`` under ``keys`` and make them idle, the last one most
        recently used; count the store."""
        if ids:
            self.pool.cache_blocks(ids, keys)
            self.pool.free(ids)
        self.ops += 3 * len(ids)  # allocated, published, freed
        self._count_stored(len(ids))

    def _count_stored(self, n: int) -> None:
        self._stats.stored += n
        self._stats.stored_bytes += n * self.block_bytes

    def stats(self) -> TierStats:
        """The counters; ``evictions`` are the host pool's, plus blocks a store left out."""
        out = super().stats()
        out.evictions = self.pool.stats.evictions + self._overflow
        return out

    @property
    def capacity_bytes(self) -> int | None:
        return self.pool.num_blocks * self.block_bytes

    @property
    def capacity_blocks(self) -> int:
        return self.pool.num_blocks  # (its values may be empty: a hash-only tier)

    @property
    def used_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_blocks(self) -> int:
        """Blocks holding a hash (idle or landing)."""
        return self.pool.num_cached_blocks

    @property
    def value_bytes(self) -> int:
        return self.block_bytes  # held in memory, no header

    def check_integrity(self) -> None:
        """The host pool's invariants, and every block is either idle (cached free, holding a hash), free
        without a hash, or in use only while a copy into it lands."""
        with self._lock:
            self.pool.check_integrity()
            landing = self.host.num_landing_blocks if self.host is not None else 0
            if self.pool.num_used_blocks != landing:
                raise IntegrityError(f"host tier: {self.pool.num_used_blocks} host blocks in use but "
                                     f"{landing} copies landing")

    def close(self) -> None:
        self.synchronize()


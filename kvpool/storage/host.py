"""``HostKVCache``: host (CPU) memory with the device cache's layout, its own ``BlockPool``, and block
swapping; the one place kvpool keeps host KV and the copies in flight into and out of it (the host tier,
:class:`kvpool.tiers.host.HostTier`, indexes these blocks by hash and adds nothing to the memory).

Swap out: allocate host blocks, then copy the device blocks (every layer, K and V) into them in one batched
copy per call. Swap in: copy host blocks back into given device blocks. On CUDA the copies run on a dedicated
stream per device (an ``index_select`` into a staging tensor, one ``non_blocking`` copy, an event per call);
on CPU they are synchronous. While a swap-out is in flight its in-use source device blocks hold an extra
reference in the device ``BlockPool`` (when one is passed), so a request that frees them meanwhile only
defers their reuse; the reference is dropped when the copy completes (:meth:`HostKVCache.poll` or
:meth:`HostKVCache.synchronize`). A cached free source block (an eviction victim being offloaded) is never
referenced, so its LRU position does not change: a swap-out that reads one waits for its copy before it
returns. A swap-out may publish its host blocks under keys at once (the host tier's stores): those blocks
stay in use until their copy lands, then become idle cached blocks of the host pool, so a block is never
read, overwritten or evicted half-written. The CUDA path is untested on the CPU-only build machine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.allocators.block_pool import BlockPool
from kvpool.errors import InvalidArgumentError, InvalidIdError
from kvpool.spec import AttentionKind, KVCacheSpec
from kvpool.storage.arena import ElasticConfig, elastic_config
from kvpool.storage.block_copy import BlockIds, check_block_ids, copy_blocks
from kvpool.storage.mla import MLAKVCache
from kvpool.storage.paged import BlockStore, PagedKVCache


@dataclass
class _InFlight:
    """One asynchronous copy: done when ``event`` is; then ``finish``, ``release`` and ``landed`` run, in
    that order (``landed``: the host blocks of a publishing swap-out become idle; ``landing`` counts them)."""

    event: Any
    host_ids: frozenset[int]
    finish: Callable[[], None] | None = None
    release: Callable[[], None] | None = None
    keep: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    landed: Callable[[], None] | None = None
    landing: int = 0


class HostKVCache:
    """A host (CPU) copy of a device KV cache's layout, with its own :class:`BlockPool` (caching off).

    Args:
        spec: the model's spec (MHA/GQA gives a :class:`PagedKVCache`, MLA an :class:`MLAKVCache`).
        num_blocks: host blocks.
        enable_caching: prefix caching in the host pool (off by default): the offload tier
            (:class:`kvpool.tiers.host.HostTier`) publishes swapped-out blocks under their hashes there.
        pin_memory: page-locked memory (needed for async copies); default: when CUDA is available and the
            cache is not elastic. Pinned memory is committed at once; unpinned memory is ``torch.empty`` and
            lazily committed.
        elastic: True or an :class:`~kvpool.storage.arena.ElasticConfig`: the host store sits on a CPU
            page arena (:class:`~kvpool.storage.elastic.ElasticMemory`), unpinned (the swaps stage through
            pinned buffers of their own). A block's pages are committed when :meth:`allocate` hands it out
            and given back once it is free and holds no hash (:meth:`free`, :meth:`release_free`).
        **cache_kwargs: passed to the store (``dtype``, ``layout``, fp8 scales, ``packed``): must match the
            device cache's layout.

    Attributes: ``cache`` (the host store), ``pool`` (its ``BlockPool``). Blocks given out by
    :meth:`swap_out` stay allocated until :meth:`free`.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, *, pin_memory: bool | None = None,
                 enable_caching: bool = False, elastic: bool | ElasticConfig = False,
                 **cache_kwargs: Any) -> None:
        is_elastic = elastic_config(elastic) is not None
        pin = torch.cuda.is_available() and not is_elastic if pin_memory is None else pin_memory
        store = MLAKVCache if spec.attention is AttentionKind.MLA else PagedKVCache
        self.cache: BlockStore = store(spec, num_blocks, device="cpu", pin_memory=pin, elastic=elastic,
                                       **cache_kwargs)
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self._in_flight: deque[_InFlight] = deque()
        self._streams: dict[torch.device, Any] = {}

    @classmethod
    def like(cls, cache: PagedKVCache | MLAKVCache, num_blocks: int, *, pin_memory: bool | None = None,
             enable_caching: bool = False, elastic: bool | ElasticConfig = False) -> HostKVCache:
        """A host tier of ``num_blocks`` blocks matching ``cache``'s spec, dtype, layout and scales."""
        if isinstance(cache, MLAKVCache):
            kwargs: dict[str, Any] = {"scale": cache.scale}
        else:
            kwargs = {"layout": cache.layout, "k_scale": cache.k_scale, "v_scale": cache.v_scale,
                      "packed": cache.packed}
        return cls(cache.spec, num_blocks, pin_memory=pin_memory, enable_caching=enable_caching,
                   elastic=elastic, dtype=cache.dtype, **kwargs)

    @property
    def num_blocks(self) -> int:
        """Host blocks in total."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Host blocks not holding swapped-out KV."""
        return self.pool.num_free_blocks

    @property
    def num_in_flight(self) -> int:
        """Asynchronous copies not yet known to be complete (always 0 on CPU)."""
        return len(self._in_flight)

    @property
    def num_landing_blocks(self) -> int:
        """Host blocks of publishing swap-outs whose copy has not landed yet (in use until it has)."""
        return sum(item.landing for item in self._in_flight)

    def swap_out(self, cache: BlockStore, block_ids: BlockIds, *, pool: BlockPool | None = None,
                 publish: Sequence[Hashable] | None = None) -> list[int]:
        """Copy device blocks ``block_ids`` (every layer) into newly allocated host blocks; return their ids
        (``host_ids[i]`` holds ``block_ids[i]``).

        ``publish``: keys (one per block) to publish the host blocks under in the host pool at once (it must
        cache): they stay in use while the copy lands and are then freed, as idle cached blocks; without it
        the blocks stay allocated until :meth:`free`.

        ``pool``: the device :class:`BlockPool`. Every source block must be in use or cached free there (a
        free block without a hash holds no KV). On CUDA its in-use source blocks get an extra reference
        until the copy completes; cached free ones are not touched (their LRU order stays as it was) and
        the call waits for the copy instead. Raises :class:`InvalidArgumentError` for a cache of another
        shape or dtype, :class:`InvalidIdError` for ids out of range, repeated or free in ``pool``,
        :class:`OutOfBlocksError` when the host is full; nothing changes then.
        """
        self._check_peer(cache)
        src = check_block_ids(block_ids, cache.num_blocks, distinct=True)
        ids = src.tolist()
        if publish is not None and len(publish) != len(ids):
            raise InvalidArgumentError(f"{len(ids)} blocks to swap out but {len(publish)} keys to publish")
        in_use, cached_free = _source_states(pool, ids)
        host_ids = self.allocate(len(ids))
        if publish is not None:
            self.pool.cache_blocks(host_ids, list(publish))
        dst = torch.tensor(host_ids, dtype=torch.int64)
        if cache.device.type == "cuda":
            if pool is not None and in_use:
                pool.touch(in_use)
            release = (lambda: pool.free(in_use[::-1])) if pool is not None and in_use else None
            landed = (lambda: self.pool.free(host_ids)) if publish is not None else None
            self._swap_out_cuda(cache, src, dst, release, landed)
            if cached_free:  # its block may be handed out as soon as this returns: finish the copy first
                self._wait_for(host_ids)
        else:
            copy_blocks(cache, ids, self.cache, host_ids)
            if publish is not None:
                self.pool.free(host_ids)
        return host_ids

    def swap_in(self, cache: BlockStore, host_ids: BlockIds, block_ids: BlockIds) -> None:
        """Copy host blocks ``host_ids`` into device blocks ``block_ids`` (same length; every layer).

        The host blocks stay allocated (call :meth:`free` when done). A swap-out still landing in them is
        completed first. On CUDA the copy is queued on the swap stream and the current stream waits for it.
        Raises :class:`InvalidArgumentError` / :class:`InvalidIdError` (a host id not allocated, ids out of
        range, device ids repeated, lengths differ); nothing is copied then.
        """
        self._check_peer(cache)
        src = check_block_ids(host_ids, self.num_blocks)
        dst = check_block_ids(block_ids, cache.num_blocks, distinct=True)
        if len(src) != len(dst):
            raise InvalidArgumentError(f"{len(src)} host blocks for {len(dst)} device blocks")
        unallocated = [h for h in src.tolist() if self.pool.ref_count(h) == 0]
        if unallocated:
            raise InvalidIdError(f"host blocks {unallocated} hold no swapped-out KV (not allocated)")
        self._wait_for(src.tolist())
        if cache.device.type == "cuda":
            self._swap_in_cuda(cache, src, dst)
        else:
            copy_blocks(self.cache, src.tolist(), cache, dst.tolist())

    def allocate(self, n: int) -> list[int]:
        """``n`` host blocks from the host pool (:meth:`BlockPool.allocate`), their pages committed when the
        store is elastic. Raises OutOfBlocksError, or MemoryLimitError / InsufficientMemoryError when the
        pages cannot be committed (the blocks go back to the pool; cached blocks the allocation evicted
        stay evicted)."""
        ids = self.pool.allocate(n)
        if self.cache.pages is not None and ids:
            try:
                self.cache.commit_blocks(ids)
            except BaseException:
                self.pool.free(ids[::-1])
                self.release_free(ids)
                raise
        return ids

    def free(self, host_ids: BlockIds) -> None:
        """Return host blocks to the host pool (after completing a swap-out still landing in them); on an
        elastic store, give back the pages of those now free and holding no hash (:meth:`release_free`).
        Raises as :meth:`BlockPool.free` does (InvalidIdError, DoubleFreeError); nothing is freed then."""
        ids = check_block_ids(host_ids, self.num_blocks).tolist()  # a tensor too, as Python ints
        self._wait_for(ids)
        self.pool.free(ids)
        self.release_free(ids)

    def release_free(self, host_ids: Sequence[int]) -> int:
        """On an elastic store, release those of ``host_ids`` that are free in the host pool and hold no
        hash (their KV is worth nothing now): a page is given back once no live block is on it. Return
        the bytes given back (0 for a fixed store)."""
        pages = self.cache.pages
        if pages is None:
            return 0
        pool = self.pool
        gone = [b for b in dict.fromkeys(host_ids)
                if pool.ref_count(b) == 0 and pool.block_hash(b) is None and pages.is_live(b)]
        return pages.release_blocks(gone) if gone else 0

    def poll(self) -> int:
        """Complete every finished asynchronous copy (dropping its source blocks' extra references); return
        how many are still in flight."""
        while self._in_flight and self._in_flight[0].event.query():
            self._complete(self._in_flight.popleft())
        return len(self._in_flight)

    def synchronize(self) -> None:
        """Wait for every copy in flight and complete it."""
        while self._in_flight:
            item = self._in_flight.popleft()
            item.event.synchronize()
            self._complete(item)

    def fence(self, device: torch.device) -> None:
        """Make ``device``'s current CUDA stream wait for every copy queued so far on its swap stream, without
        a host sync (before a kernel overwrites blocks a swap-out is still reading). A no-op off CUDA."""
        if device.type == "cuda" and device in self._streams:
            torch.cuda.current_stream(device).wait_stream(self._streams[device])

    def stats(self) -> dict[str, Any]:
        """The host store's ``stats()`` (``elastic``: its page arena's) plus ``free_blocks``,
        ``used_blocks``, ``in_flight``, ``pinned``."""
        return {**self.cache.stats(), "free_blocks": self.pool.num_free_blocks,
                "used_blocks": self.pool.num_used_blocks, "in_flight": len(self._in_flight),
                "pinned": self.cache.buffer.is_pinned()}

    def _check_peer(self, cache: BlockStore) -> None:
        """A device cache swaps with this tier only with the same class, dtype and per-block shape."""
        if not isinstance(cache, BlockStore):
            raise InvalidArgumentError(f"cache must be a PagedKVCache or MLAKVCache, "
                                       f"got {type(cache).__name__}")
        mine, theirs = self.cache, cache
        same = (type(theirs) is type(mine) and theirs.dtype == mine.dtype
                and getattr(theirs, "layout", None) == getattr(mine, "layout", None)
                and _block_shape(theirs) == _block_shape(mine))
        if not same:
            raise InvalidArgumentError(f"cannot swap between {type(theirs).__name__} {theirs.dtype} "
                                       f"{list(theirs.buffer.shape)} and host {type(mine).__name__} "
                                       f"{mine.dtype} {list(mine.buffer.shape)}")

    def _wait_for(self, host_ids: Sequence[int]) -> None:
        """Complete the copies in flight into any of ``host_ids`` (and those queued before them)."""
        if self._in_flight and self.poll():
            wanted = set(host_ids)
            while any(wanted & item.host_ids for item in self._in_flight):
                item = self._in_flight.popleft()
                item.event.synchronize()
                self._complete(item)

    @staticmethod
    def _complete(item: _InFlight) -> None:
        for step in (item.finish, item.release, item.landed):
            if step is not None:
                step()

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _swap_out_cuda(self, cache: BlockStore, src: torch.Tensor, dst: torch.Tensor,
                       release: Callable[[], None] | None, landed: Callable[[], None] | None) -> None:
        """index_select on the swap stream (after the compute stream's writes), one non_blocking D2H copy
        into pinned staging; the scatter into the host buffer runs on completion."""
        stream, src_dev = self._stream(cache.device), src.to(cache.device)
        stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(stream):
            staging = self.cache.empty_blocks(len(src), pin_memory=True)
            staging.copy_(cache.read_blocks(src_dev), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        src_dev.record_stream(stream)
        finish = lambda: self.cache.write_blocks(dst, staging)  # noqa: E731
        self._in_flight.append(_InFlight(event, frozenset(dst.tolist()), finish, release, (staging,), landed,
                                         len(dst) if landed is not None else 0))

    def _swap_in_cuda(self, cache: BlockStore, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Gather into pinned staging on the host, one non_blocking H2D copy and the scatter on the swap
        stream; the compute stream waits on the event before it reads the blocks."""
        staging = self.cache.read_blocks(src, out=self.cache.empty_blocks(len(src), pin_memory=True))
        stream, dst_dev = self._stream(cache.device), dst.to(cache.device)
        current = torch.cuda.current_stream(cache.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            cache.write_blocks(dst_dev, staging.to(cache.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(stream)
        dst_dev.record_stream(stream)
        current.wait_event(event)
        self._in_flight.append(_InFlight(event, frozenset(), keep=(staging,)))


def _source_states(pool: BlockPool | None, ids: list[int]) -> tuple[list[int], bool]:
    """The source blocks in use in ``pool``, and whether any is cached free; InvalidIdError (nothing
    changed) for a block that ``pool`` holds free without a hash, or an id outside it."""
    if pool is None:
        return [], False
    if not isinstance(pool, BlockPool):
        raise InvalidArgumentError(f"pool must be the device BlockPool or None, got {type(pool).__name__}")
    in_use, cached_free = [], False
    for block in ids:
        if pool.ref_count(block):
            in_use.append(block)
        elif pool.block_hash(block) is None:
            raise InvalidIdError(f"device block {block} is free in the pool and holds no KV to swap out")
        else:
            cached_free = True
    return in_use, cached_free


def _block_shape(store: BlockStore) -> tuple[int, ...]:
    shape = list(store.buffer.shape)
    del shape[store.block_dim]
    return tuple(shape)

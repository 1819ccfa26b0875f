"""``OffloadManager``: the tier chain under a device :class:`BlockPool`: device -> host -> disk -> remote.

Keys are the device pool's keys: a block hash for KV cache group 0, ``(g, hash)`` for group ``g``
(:func:`~kvpool.allocators.groups.group_key`); a tier stores a group's block under a key that names the
group (:func:`~kvpool.tiers.backend.block_key`, as vLLM's offload keys are the block hash plus the group
index), so one chain serves every group of a hybrid model.

**Stores.** In the default *eviction* mode a cached block's KV goes down when the device pool evicts it
(the pool's eviction listener, called before the block is reused): into the host tier, whose own
evictions cascade to the next tier (disk, else remote), and the disk tier's evictions to the remote one.
With ``write_through=True`` every block is stored in every tier as soon as the device pool publishes it
(the pool's publish listener), so a shared remote tier sees each block at once. A key a tier holds
already is refreshed, not copied again. With ``admission`` (a
:class:`~kvpool.allocators.policies.FrequencyAdmission`) a block enters the chain only once its hash has
been offered ``min_count`` times (each device eviction of it, or each publish with write-through, is one
offer): the others are dropped, counted in ``stats()["not_admitted"]`` (a key held below already is then
not refreshed either). What enters the chain then moves down it unfiltered.

**Lookups.** :meth:`OffloadManager.probe` tells where each key of a request's prefix is held (the device
first, then the tiers in order); the KV cache coordinator's longest-hit search runs on it, so a prefix
found below is restored for exactly the blocks each group's hit rule needs (a sliding group only its
window). :meth:`OffloadManager.restore` then loads those blocks into freshly allocated device blocks
(one batched copy per run of blocks from the same tier) and publishes them in the device pool, so the
request runs on them and later requests hit them on the device. Loaded blocks stay in their tier (the
chain is inclusive). A block whose load fails (a fault below) ends the restore there: the request
computes the rest, and the failure is counted (a miss, never wrong KV). Loads: :mod:`kvpool.tiers.loader`;
the deprecated single-group API (``lookup``, ``acquire``): :mod:`kvpool.tiers.single_group`.

**Copies and references.** Device <-> host copies are one batched swap each (:class:`HostTier`; on CUDA
on a side stream with events, the device blocks of a write-through store holding a reference until the
copy completes, and the compute stream ordered after an eviction's copy). Stores into disk and remote go
through the :class:`~kvpool.tiers.writer.Writer`: a memcpy into a staging row, then a worker thread; until
written they are served from staging. A host block never leaves the host pool while a copy into it lands.

Built without a device cache (``cache=None``) the manager moves no data, only hashes (a trace replay).
Everything here runs on the consumer's thread except the writer's worker; the pools are not thread-safe
and only this thread touches them. Every pool call the manager makes goes to the pool it was built with,
on every tensor-parallel rank alike (:mod:`kvpool.engine.distributed` runs :meth:`restore` on each rank).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.groups import group_key
from kvpool.allocators.policies import FrequencyAdmission, ValuedAdmission
from kvpool.errors import IntegrityError, InvalidArgumentError, OutOfBlocksError
from kvpool.storage.block_copy import gather_rows
from kvpool.storage.paged import BlockStore
from kvpool.tiers.backend import TierBackend
from kvpool.tiers.host import HostTier
from kvpool.tiers.loader import (  # noqa: F401 (LOAD_BATCH re-exported)
    LOAD_BATCH,
    ChainReader,
    restored_calls,
    tier_code,
    tier_of,
)
from kvpool.tiers.single_group import (  # noqa: F401 (the deprecated single-group API's names, re-exported)
    DEVICE,
    SINGLE_GROUP_DEPRECATED,
    PrefixHit,
    SingleGroupAPI,
)
from kvpool.tiers.writer import Writer
from kvpool.units import plural

PROBE_WINDOW = 64  # keys of a probe's first question to a tier (then 4x while the run goes on)


class OffloadManager(SingleGroupAPI):
    """Chains ``tiers`` (a :class:`HostTier` first if any, then byte tiers: disk, remote) under ``pool``.

    Args:
        pool: the device pool; the manager becomes its eviction listener.
        tiers: the lower tiers, fastest first; at most one host tier, in first place.
        cache: the device KV cache (data mode: every tier's ``block_bytes`` equals its
            ``bytes_per_block`` and a host tier is built ``like`` it); None moves hashes only.
        write_through: store each published block in every tier at once (else: on eviction, cascading).
        asynchronous: run the byte tiers' stores on a worker thread (else inline: deterministic).
        staging_blocks: staging rows for those stores (blocks in flight at most).
        admission: frequency admission into the tiers (bound to the chain's size: it tracks at most 4 x
            the blocks of the device pool and the tiers that bound their size, unless built with
            ``max_tracked``: a block offered again after more offers than that finds its count forgotten,
            as it would find an admitted copy evicted), or a ``ValuedAdmission`` (the device policy's
            signal: only blocks it values go down); None stores every block. Give the pool its own
            instance if it filters its publish step too (one filter counts one stream).

    Raises:
        InvalidArgumentError: a host tier not in first place, tiers whose ``block_bytes`` does not match
            the cache (or 0 without one), a pool that has an eviction listener already, ``admission`` not a
            FrequencyAdmission or the pool's own.
    """

    def __init__(self, pool: BlockPool, tiers: Sequence[TierBackend], *, cache: BlockStore | None = None,
                 write_through: bool = False, asynchronous: bool = True, staging_blocks: int = 64,
                 admission: FrequencyAdmission | None = None) -> None:
        self.pool, self.cache, self.tiers = pool, cache, list(tiers)
        self.write_through = write_through
        self._check_tiers()
        if admission is not None and (not isinstance(admission, FrequencyAdmission)
                                      or admission is pool.admission):
            raise InvalidArgumentError(f"admission must be a FrequencyAdmission of the tiers' own (not the "
                                       f"pool's) or None, got {admission!r}")
        if admission is not None:
            admission.bind(pool.num_blocks + sum(t.capacity_blocks or 0 for t in self.tiers))
        self.admission = admission
        self.host = self.tiers[0] if self.tiers and isinstance(self.tiers[0], HostTier) else None
        self.lower = self.tiers[1:] if self.host is not None else self.tiers
        self.writer = Writer(self.lower, staging_blocks=staging_blocks, asynchronous=asynchronous)
        self._reader = ChainReader(self.tiers, self.host, self.writer, cache)
        self.device_hits = self.not_admitted = self._ops = 0
        self._restoring = False
        #: The request path's :class:`~kvpool.requests.block_memory.PoolMemory` when the device store's
        #: memory follows its blocks (set by the manager): a restore commits the blocks it loads into, and
        #: releases those it did not load (a refused commit loads none: a miss).
        self.memory: Any = None
        pool.set_eviction_listener(self._device_evicted)
        if write_through:
            pool.set_publish_listener(self._device_published)
        if self.host is not None and self.lower:  # with nothing below, a host eviction just drops the block
            self.host.pool.set_eviction_listener(self._host_evicted)
        if not write_through:
            for upper, below in zip(self.lower, self.lower[1:], strict=False):
                if hasattr(upper, "set_eviction_listener"):
                    upper.set_eviction_listener(self._cascade_to(below))

    @property
    def ops(self) -> int:
        """Block ids and hashes handled by pool calls of the manager and of the host tier's pool (a trace
        replay adds them to its ``block_ops``)."""
        return self._ops + (self.host.ops if self.host is not None else 0)

    @property
    def load_failures(self) -> int:
        """Restores that ended before their plan did: a block no tier gave intact (a miss)."""
        return self._reader.load_failures

    def _check_tiers(self) -> None:
        bytes_per_block = self.cache.bytes_per_block if self.cache is not None else 0
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, HostTier) and i:
                raise InvalidArgumentError("the host tier must come first in the chain")
            if tier.block_bytes != bytes_per_block:
                raise InvalidArgumentError(f"the {tier.medium} tier stores {tier.block_bytes} B blocks, the "
                                           f"device {bytes_per_block} B")
            if isinstance(tier, HostTier) and (tier.host is None) != (self.cache is None):
                raise InvalidArgumentError("a host tier holds data exactly when the manager has a cache")

    # ---- where a key is held ------------------------------------------------------------------------

    def probe(self) -> Callable[[int, Sequence[Hashable], int], int | None]:
        """A fresh locator for one admission, the ``probe`` a
        :meth:`~kvpool.allocators.groups.KVCacheCoordinator.find_longest_cache_hit` takes:
        ``probe(g, hashes, i)`` is the device block holding ``hashes[i]`` in KV cache group ``g`` (its key
        :func:`~kvpool.allocators.group_tables.group_key`), else ``tier_code(t)`` for the first tier ``t``
        holding it, else None. A tier is asked for the run of keys it holds from a position on (one ``exists``
        call per run and tier, reused while the run lasts), so a prefix found below costs one round trip per
        tier and run, not one per block. A tier is asked about a window of keys at a time (``PROBE_WINDOW``
        first, four times the last window after a window held all of its keys), so the keys of a long prompt
        past the end of its hit are never converted nor sent. Changes nothing, counts nothing."""
        runs: dict[tuple[int, int], tuple[int, int, int]] = {}  # (group, tier) -> (start, held, window)
        cached = self.pool.get_cached_block

        def locate(g: int, hashes: Sequence[Hashable], i: int) -> int | None:
            block = cached(group_key(g, hashes[i]))
            if block is not None:
                return block
            for t in range(len(self.tiers)):
                start, n, window = runs.get((g, t), (0, 0, 0))
                if not start <= i < start + n:
                    window = 4 * window if n and n == window and i == start + n else PROBE_WINDOW
                    part = hashes[i:i + window]
                    n = self._reader.exists(t, part if g == 0 else [group_key(g, h) for h in part])
                    runs[(g, t)] = (i, n, window)
                if n:
                    return tier_code(t)
            return None

        return locate

    # ---- restoring from the tiers -------------------------------------------------------------------

    def restore(self, plan: Sequence[tuple[Hashable, int]], parent_hash: Hashable | None = None
                ) -> dict[Hashable, int]:
        """Bring a prefix found by :meth:`probe` onto the device: ``plan`` lists, position by position of
        the prefix (a position's groups together), ``(key, where)`` for every block the hit needs, ``where``
        a device block id or a :func:`tier_code`. The
        device blocks are held while fresh blocks are allocated for the others; those are loaded (one
        batched copy per run of one tier; a block a tier no longer gives is looked for in the tiers below
        it) and published under their keys; then everything is released again, so the loaded blocks are
        cached free device blocks that the caller's next device lookup finds and touches (published group
        by group with their chain's parents, for a KV event sink; ``parent_hash``: the hash of the block
        before the plan's first position, None when it starts the sequence). Loading stops at
        the first block no tier gives intact (a miss, counted in ``load_failures``: the caller's prefix
        then ends before it, never on wrong KV). Returns the keys loaded, each with the index of the tier
        it came from (in :attr:`tiers`).

        Under tensor parallelism every rank runs the same ``restore`` on its own pool and tiers, and
        :attr:`agree` (set by the leader and the followers) makes the ranks keep only what every rank
        loaded: no rank restores a block another lacks.

        Raises:
            OutOfBlocksError: the pool has fewer free blocks than the plan's tier blocks plus its cached
                free device blocks (nothing changed): check with the coordinator's
                ``num_blocks_to_allocate`` first.
        """
        below = [(key, where) for key, where in plan if where < -1]
        if not below:
            return {}
        device = list(dict.fromkeys(where for _, where in plan if where >= 0))
        revived = sum(1 for b in device if self.pool.ref_count(b) == 0)
        if len(below) + revived > self.pool.num_free_blocks:
            raise OutOfBlocksError(f"restoring {plural(len(below), 'block')} from the tiers needs "
                                   f"{plural(len(below) + revived, 'free device block')}, "
                                   f"{self.pool.num_free_blocks} free")
        self.pool.touch(device)
        held = self._hold_below(below)
        fresh = self.pool.allocate(len(below))
        keys, where = [k for k, _ in below], [w for _, w in below]
        memory = self.memory
        committed = memory is None or memory.handed_out([fresh])
        loaded = self.agree(self._reader.load(keys, where, fresh) if committed else 0)
        if loaded:
            self._restoring = True  # blocks that came from the tiers are not offered to them again
            try:
                for ids, published, parent in restored_calls(plan, fresh, loaded, parent_hash):
                    self.pool.cache_blocks(ids, published, parent_hash=parent)
            finally:
                self._restoring = False
            self._reader.count_loaded(where[:loaded])
        self._release_host(held)
        self.pool.free(fresh[::-1] + device[::-1])
        if memory is not None:
            memory.emptied(fresh[loaded:])
        self._ops += len(plan) + 2 * len(below)
        return {key: tier_of(w) for key, w in zip(keys[:loaded], where[:loaded], strict=True)}

    def agree(self, loaded: int) -> int:
        """How many leading blocks of a restore every rank loaded: ``loaded`` in one process; tensor
        parallelism replaces it with the minimum over the ranks (:mod:`kvpool.engine.distributed`)."""
        return loaded

    def _hold_below(self, below: list[tuple[Hashable, int]]) -> list[int]:
        """Keep the blocks about to be loaded where they are while the device allocation's evictions
        cascade down: host blocks are touched (returned, to release), byte-tier blocks refreshed."""
        keys: list[list[Hashable]] = [[] for _ in self.tiers]
        for key, where in below:
            keys[tier_of(where)].append(key)
        for t, mine in enumerate(keys):
            if mine and self.tiers[t] is not self.host:
                self.writer.refresh(t - (self.host is not None), mine)
        if self.host is None or not keys[0]:
            return []
        ids = [b for b in map(self.host.pool.get_cached_block, keys[0]) if b is not None]
        self.host.pool.touch(ids)
        return ids

    def _release_host(self, held: list[int]) -> None:
        if held:
            self.host.pool.free(held[::-1])  # type: ignore[union-attr]

    # ---- stores -------------------------------------------------------------------------------------

    def _device_published(self, block_ids: list[int], keys: list[Hashable]) -> None:
        """The device pool published ``block_ids`` under ``keys`` (their KV written): with write-through,
        store them in every tier now (not the blocks :meth:`restore` brought up from the tiers)."""
        if not self._restoring:
            self._store(block_ids, keys, range(len(self.lower)), hold=self.pool)

    def _device_evicted(self, block_ids: list[int], hashes: list[Hashable]) -> None:
        """The device pool is about to reuse ``block_ids``: copy their KV down first (eviction mode)."""
        if not self.write_through and self.tiers:
            self._store(block_ids, hashes, range(min(1, len(self.lower))), hold=None)
            if self.host is not None and self.cache is not None:
                self.host.fence(self.cache.device)  # the compute stream waits for the copy (CUDA)

    def _store(self, block_ids: list[int], hashes: list[Hashable], lower: range, *,
               hold: BlockPool | None) -> None:
        """Device blocks into the host tier (if any; in eviction mode the blocks that do not fit there go
        on to the first byte tier), else into the byte tiers ``lower``; with write-through into every byte
        tier as well, staged from the device blocks."""
        self._ops += len(block_ids)
        if self.admission is not None:
            block_ids, hashes = self._admitted(block_ids, hashes)
        if self.host is not None and block_ids:
            left_out = self.host.store_from_device(self.cache, block_ids, hashes, hold=hold)
            if not self.write_through:
                block_ids, hashes = [block_ids[i] for i in left_out], [hashes[i] for i in left_out]
        if lower and block_ids:
            self._stage(lambda ids, out: gather_rows(self.cache, ids, out), block_ids, hashes, lower)

    def _admitted(self, block_ids: list[int], hashes: list[Hashable]) -> tuple[list[int], list[Hashable]]:
        """The blocks whose offer the admission filter accepts (one offer each, in order; a
        :class:`ValuedAdmission` asks the device policy instead)."""
        if isinstance(self.admission, ValuedAdmission):
            valued = self.pool.policy.valued
            keep = [i for i, b in enumerate(block_ids) if valued(b)]
        else:
            admit = self.admission.admit  # type: ignore[union-attr]
            keep = [i for i, h in enumerate(hashes) if admit(h)]
        self.not_admitted += len(hashes) - len(keep)
        return [block_ids[i] for i in keep], [hashes[i] for i in keep]

    def _host_evicted(self, host_ids: list[int], hashes: list[Hashable]) -> None:
        """The host pool is about to reuse ``host_ids``: stage their KV for the next tier (eviction mode;
        with write-through the byte tiers have it already)."""
        if self.write_through or not self.lower:
            return
        self._ops += len(host_ids)
        cache = self.host.host.cache if self.host.host is not None else None  # type: ignore[union-attr]
        self._stage(lambda ids, out: gather_rows(cache, ids, out), host_ids, hashes, range(1))

    def _stage(self, gather: Any, block_ids: list[int], hashes: list[Hashable], lower: range) -> None:
        """Copy blocks into staging rows (``gather(ids, rows)``) in ring-sized batches and submit them."""
        step = self.writer.capacity
        for start in range(0, len(block_ids), step):
            ids, keys = block_ids[start:start + step], hashes[start:start + step]
            row, rows = self.writer.stage(len(ids))
            if rows is not None:
                gather(ids, rows)
            self.writer.submit(lower, keys, row)

    def _cascade_to(self, below: TierBackend) -> Any:
        """A byte tier's eviction listener: store what it evicts into ``below`` (on the writer's thread)."""
        bpb = below.block_bytes

        def cascade(keys: list[bytes], payloads: list[bytes]) -> None:
            rows = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(keys), bpb) \
                if bpb else None
            below.set(keys, rows)

        return cascade

    # ---- lifetime and state -------------------------------------------------------------------------

    def poll(self) -> None:
        """Complete finished device <-> host copies (CUDA); cheap, call it once per step."""
        if self.host is not None:
            self.host.poll()

    def synchronize(self) -> None:
        """Wait for every copy and store in flight."""
        self.writer.synchronize()
        if self.host is not None:
            self.host.synchronize()

    def detach(self) -> None:
        """Finish every store, stop the writer and stop listening to the pools (the tiers stay open)."""
        self.synchronize()
        self.writer.close()
        self.pool.set_eviction_listener(None)
        if self.write_through:
            self.pool.set_publish_listener(None)
        if self.host is not None and self.lower:
            self.host.pool.set_eviction_listener(None)
        for tier in self.lower:
            if hasattr(tier, "set_eviction_listener"):
                tier.set_eviction_listener(None)

    def close(self) -> None:
        """:meth:`detach`, then close the tiers."""
        self.detach()
        for tier in self.tiers:
            tier.close()

    def tier_hits(self) -> dict[str, int]:
        """Blocks :meth:`acquire` took from each place (``device`` and each tier's medium), and the blocks
        :meth:`restore` loaded from each tier. (The request path counts the hits of its admissions by
        place itself: :meth:`kvpool.requests.kv_manager.KVCacheManager.hits_by_place`.)"""
        out = {"device": self.device_hits}
        for tier in self.tiers:
            out[tier.medium] = out.get(tier.medium, 0) + tier.stats().hits
        return out

    def stats(self) -> dict[str, Any]:
        """Per tier (by medium): its :class:`TierStats` plus ``blocks``, ``used_bytes`` and
        ``capacity_bytes``; and ``device_hits``, ``load_failures``, ``not_admitted`` (blocks the admission
        filter kept out of the tiers), ``pending_stores``."""
        out: dict[str, Any] = {"device_hits": self.device_hits, "load_failures": self.load_failures,
                               "not_admitted": self.not_admitted,
                               "pending_stores": self.writer.num_pending,
                               "writer_errors": self.writer.job_errors}
        for tier in self.tiers:
            out[tier.medium] = {**tier.stats().to_dict(), "blocks": tier.num_blocks,
                                "used_bytes": tier.used_bytes, "capacity_bytes": tier.capacity_bytes}
        return out

    def check_integrity(self) -> None:
        """The device pool's, every tier's and the writer's invariants."""
        self.pool.check_integrity()
        for tier in self.tiers:
            tier.check_integrity()
        self.writer.check_integrity()
        if self.writer.job_errors:
            raise IntegrityError(f"{self.writer.job_errors} tier stores raised instead of counting a fault")

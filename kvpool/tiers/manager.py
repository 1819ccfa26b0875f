"""``OffloadManager``: the tier chain under a device :class:`BlockPool`: device -> host -> disk -> remote.

**Stores.** In the default *eviction* mode a cached block's KV goes down when the device pool evicts it
(the pool's eviction listener, called before the block is reused): into the host tier, whose own
evictions cascade to the next tier (disk, else remote), and the disk tier's evictions to the remote one.
With ``write_through=True`` every block is stored in every tier as soon as the consumer publishes it
(:meth:`OffloadManager.on_published`), so a shared remote tier sees each block at once. A key a tier
holds already is refreshed, not copied again. With ``admission`` (a
:class:`~kvpool.allocators.policies.FrequencyAdmission`) a block enters the chain only once its hash has
been offered ``min_count`` times (each device eviction of it, or each publish with write-through, is one
offer): the others are dropped, counted in ``stats()["not_admitted"]`` (a key held below already is then
not refreshed either). What enters the chain then moves down it unfiltered.

**Lookups.** :meth:`lookup` finds the longest prefix of a request's block hashes held anywhere: at each
position the device first, then the tiers in order. :meth:`acquire` turns it into device blocks, each with
a reference: device hits are touched; blocks found below are loaded into freshly allocated device blocks
(grouped into one batched copy per run of blocks from the same tier) and published in the device pool, so
the request runs on them and later requests hit them on the device. Loaded blocks stay in their tier (the
chain is inclusive). A block whose load fails (a fault below) ends the prefix there: the request computes
the rest, and the failure is counted (a miss, never wrong KV).

**Copies and references.** Device <-> host copies are one batched swap each (:class:`HostTier`; on CUDA
on a side stream with events, the device blocks of a write-through store holding a reference until the
copy completes, and the compute stream ordered after an eviction's copy). Stores into disk and remote go
through the :class:`~kvpool.tiers.writer.Writer`: a memcpy into a staging row, then a worker thread; until
written they are served from staging. A host block never leaves the host pool while a copy into it lands.

Built without a device cache (``cache=None``) the manager moves no data, only hashes (a trace replay).
Everything here runs on the consumer's thread except the writer's worker; the pools are not thread-safe
and only this thread touches them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.policies import FrequencyAdmission
from kvpool.errors import IntegrityError, InvalidArgumentError, OutOfBlocksError
from kvpool.storage.paged import BlockStore
from kvpool.tiers.backend import TierBackend, gather_rows, scatter_rows
from kvpool.tiers.host import HostTier
from kvpool.tiers.writer import Writer
from kvpool.units import plural

DEVICE = 0  # PrefixHit.where value of a device block; tier i of the manager is where == i + 1
LOAD_BATCH = 64  # blocks per load from a byte tier (the load buffer's rows)


@dataclass
class PrefixHit:
    """The longest prefix of ``hashes`` held somewhere: ``where[i]`` is 0 for the device (block
    ``device_ids[i]``) or ``t + 1`` for ``manager.tiers[t]`` (``device_ids[i]`` None)."""

    hashes: list[Hashable]
    where: list[int] = field(default_factory=list)
    device_ids: list[int | None] = field(default_factory=list)
    device_prefix: int = 0  # the leading blocks all on the device

    def __len__(self) -> int:
        return len(self.where)


class OffloadManager:
    """Chains ``tiers`` (a :class:`HostTier` first if any, then byte tiers: disk, remote) under ``pool``.

    Args:
        pool: the device pool; the manager becomes its eviction listener.
        tiers: the lower tiers, fastest first; at most one host tier, in first place.
        cache: the device KV cache (data mode: every tier's ``block_bytes`` equals its
            ``bytes_per_block`` and a host tier is built ``like`` it); None moves hashes only.
        write_through: store each published block in every tier at once (else: on eviction, cascading).
        asynchronous: run the byte tiers' stores on a worker thread (else inline: deterministic).
        staging_blocks: staging rows for those stores (blocks in flight at most).
        admission: frequency admission into the tiers (bound to the device pool's size: it tracks at most
            4 x ``pool.num_blocks`` hashes unless built with ``max_tracked``); None stores every block. Give
            the pool its own instance if it filters its publish step too (one filter counts one stream).

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
            admission.bind(pool.num_blocks)
        self.admission = admission
        self.host = self.tiers[0] if self.tiers and isinstance(self.tiers[0], HostTier) else None
        self.lower = self.tiers[1:] if self.host is not None else self.tiers
        self.writer = Writer(self.lower, staging_blocks=staging_blocks, asynchronous=asynchronous)
        self._load_buf = torch.empty(0, dtype=torch.uint8)
        self.device_hits = self.load_failures = self.not_admitted = self._ops = 0
        pool.set_eviction_listener(self._device_evicted)
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

    # ---- lookups ------------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[Hashable]) -> PrefixHit:
        """The longest prefix of ``hashes`` held on the device or in any tier. Counts the device pool's
        lookup stats; changes nothing else (tier hits are counted by :meth:`acquire`)."""
        hashes = list(hashes)
        device = self.pool.lookup(hashes)
        hit = PrefixHit(hashes, [DEVICE] * len(device), list(device), len(device))
        if len(device) < len(hashes) and self.tiers:
            self._walk(hit, len(device))
        self._ops += min(len(hit) + 1, len(hashes))
        return hit

    def _walk(self, hit: PrefixHit, p: int) -> None:
        """Extend ``hit`` from position ``p``: per block the device, else the first tier holding it (a
        tier's run from a position, once asked, is reused while it lasts; a run of the chain's first tier
        is taken whole, since no faster tier could be preferred inside it)."""
        hashes, cached, where, ids = hit.hashes, self.pool.get_cached_block, hit.where, hit.device_ids
        left: list[int | None] = [None] * len(self.tiers)  # blocks known held by tier t from p on
        while p < len(hashes):
            block = cached(hashes[p])
            tier = DEVICE if block is not None else self._first_tier(hashes, p, left)
            if tier is None:
                return
            run = left[0] if tier == 1 else 1
            for q in range(p, p + run):  # the device first, even inside the run
                block = cached(hashes[q]) if q > p else block
                where.append(DEVICE if block is not None else tier)
                ids.append(block)
            left = [None if n is None or n <= run else n - run for n in left]
            p += run

    def _first_tier(self, hashes: list[Hashable], p: int, left: list[int | None], first: int = 0
                    ) -> int | None:
        """``t + 1`` for the first tier from ``first`` on that holds ``hashes[p]`` (``left[t]``: how many
        blocks from ``p`` on tier ``t`` is known to hold, asked when None), or None."""
        for t in range(first, len(self.tiers)):
            tier = self.tiers[t]
            if left[t] is None:
                left[t] = tier.exists(hashes[p:]) if tier is self.host else self.writer.exists(
                    t - (self.host is not None), hashes[p:])
            if left[t]:
                return t + 1
        return None

    def num_blocks_to_allocate(self, hit: PrefixHit, num_blocks: int) -> int:
        """Free device blocks taking ``hit`` plus ``num_blocks - len(hit)`` new blocks consumes: all but
        the device hits that are in use already (as :meth:`BlockPool.num_blocks_to_allocate`)."""
        return num_blocks - self._device_hits_in_use(hit)

    def _device_hits_in_use(self, hit: PrefixHit) -> int:
        """Device hits with a reference already: the leading device prefix counted by the pool in one call,
        the device hits after a gap one by one (rare)."""
        d = hit.device_prefix
        in_use = d - self.pool.num_blocks_to_allocate(hit.hashes[:d], d)
        ref = self.pool.ref_count
        return in_use + sum(1 for b in hit.device_ids[d:] if b is not None and ref(b) > 0)

    def acquire(self, hit: PrefixHit) -> list[int]:
        """Device blocks for ``hit``'s prefix, each with a reference held for the caller: device hits
        touched, the others loaded into new device blocks and published. Returns the block ids of the
        prefix actually available (shorter than ``hit`` when a load failed; the blocks past it are
        released). Raises :class:`OutOfBlocksError` (nothing changed) when the pool cannot give the new
        blocks: check :meth:`num_blocks_to_allocate` first; :class:`InvalidArgumentError` (nothing changed)
        for a stale hit, a device block of which no longer holds its hash (evicted, maybe handed to another
        request, since the lookup: look up again)."""
        cached = self.pool.get_cached_block
        for i, b in enumerate(hit.device_ids):
            if b is not None and cached(hit.hashes[i]) != b:
                raise InvalidArgumentError(f"stale prefix hit: device block {b} no longer holds the hash it "
                                           "was found under; look it up again")
        on_device = [b for b in hit.device_ids if b is not None]
        below = [i for i, w in enumerate(hit.where) if w != DEVICE]
        revived = len(on_device) - self._device_hits_in_use(hit)
        if len(below) + revived > self.pool.num_free_blocks:
            raise OutOfBlocksError(f"taking a prefix of {plural(len(hit), 'block')} needs "
                                   f"{plural(len(below) + revived, 'free device block')}, "
                                   f"{self.pool.num_free_blocks} free")
        self.pool.touch(on_device)
        held = self._hold_below(hit, below)
        fresh = self.pool.allocate(len(below)) if below else []
        ids = list(hit.device_ids)
        for i, block in zip(below, fresh, strict=True):
            ids[i] = block
        loaded = self._load(hit, below, fresh)
        self._release_host(held)
        end = below[loaded] if loaded < len(below) else len(hit)
        good = [ids[i] for i in below[:loaded]]
        if good:
            self.pool.cache_blocks(good, [hit.hashes[i] for i in below[:loaded]])
        self._count_hits(hit, end)
        self.pool.free(ids[end:][::-1])  # past a failed load: back to the pool
        self._ops += len(hit) + len(below)
        return ids[:end]  # type: ignore[return-value]

    def _hold_below(self, hit: PrefixHit, below: list[int]) -> list[int]:
        """Keep the blocks about to be loaded where they are while the device allocation's evictions
        cascade down: host blocks are touched (returned, to release), byte-tier blocks refreshed."""
        keys: list[list[Hashable]] = [[] for _ in self.tiers]
        for i in below:
            keys[hit.where[i] - 1].append(hit.hashes[i])
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

    def _load(self, hit: PrefixHit, below: list[int], fresh: list[int]) -> int:
        """Load the blocks at positions ``below`` into ``fresh``, one run of same-tier positions at a time;
        returns how many leading ones loaded."""
        done = 0
        while done < len(below):
            where = hit.where[below[done]]
            run = 1
            while done + run < len(below) and hit.where[below[done + run]] == where:
                run += 1
            keys = [hit.hashes[i] for i in below[done:done + run]]
            got = self._load_run(where - 1, keys, fresh[done:done + run])
            if got < run:  # the rest may have moved down since the lookup (evictions cascading meanwhile)
                rest = slice(done + got, done + run)
                got += self._reload(hit, below[rest], where - 1, fresh[rest])
            done += got
            if got < run:
                self.load_failures += 1
                break
        return done

    def _reload(self, hit: PrefixHit, positions: list[int], first: int, fresh: list[int]) -> int:
        """The blocks at ``positions`` that tier ``first`` no longer gave: look for them again in it and the
        tiers below, and load them; returns how many leading ones loaded (``hit.where`` updated)."""
        keys = [hit.hashes[i] for i in positions]
        left: list[int | None] = [None] * len(self.tiers)
        done = 0
        while done < len(keys):
            t = self._first_tier(keys, done, left, first)
            if t is None:
                break
            run = left[t - 1] or 1
            got = self._load_run(t - 1, keys[done:done + run], fresh[done:done + run])
            for i in positions[done:done + got]:
                hit.where[i] = t
            done += got
            if got < run:
                break
            left = [None] * len(self.tiers)
        return done

    def _load_run(self, t: int, keys: list[Hashable], blocks: list[int]) -> int:
        tier = self.tiers[t]
        if tier is self.host:
            return self.host.load_to_device(self.cache, keys, blocks)
        lower, done = t - (self.host is not None), 0
        while done < len(keys):
            n = min(LOAD_BATCH, len(keys) - done)
            out = self._load_rows(n)
            got = self.writer.get(lower, keys[done:done + n], out)
            if got and self.cache is not None:
                scatter_rows(self.cache, blocks[done:done + got], out)
            done += got
            if got < n:
                break
        return done

    def _load_rows(self, n: int) -> torch.Tensor | None:
        if self.cache is None:
            return None
        bpb = self.cache.bytes_per_block
        if self._load_buf.numel() < n * bpb:
            self._load_buf = torch.empty(n * bpb, dtype=torch.uint8)
        return self._load_buf[:n * bpb].view(n, bpb)

    def _count_hits(self, hit: PrefixHit, end: int) -> None:
        where = hit.where[:end] if end < len(hit) else hit.where
        self.device_hits += where.count(DEVICE)
        for t, tier in enumerate(self.tiers):
            n = where.count(t + 1)
            if n:
                tier.count_hits(n)

    # ---- stores -------------------------------------------------------------------------------------

    def on_published(self, block_ids: Sequence[int], hashes: Sequence[Hashable]) -> None:
        """The consumer published ``block_ids`` under ``hashes`` (their KV written): with write-through,
        store them in every tier now. A no-op in eviction mode."""
        if self.write_through and block_ids:
            self._store(list(block_ids), list(hashes), range(len(self.lower)), hold=self.pool)

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
        """The blocks whose offer the admission filter accepts (one offer each, in order)."""
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
        """Blocks :meth:`acquire` took from each place: ``device`` and each tier's medium."""
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

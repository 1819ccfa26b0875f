"""Reading blocks from the tier chain under a device pool (:class:`~kvpool.tiers.manager.OffloadManager`):
where a run of keys is held, and loading runs of them into device blocks.

A key the chain holds is named by the code of its tier (:func:`tier_code`: below -1, so it never names a
device block, nor the null block's -1 of a pool without one). Loads go one batched copy per run of keys
from one tier (``LOAD_BATCH`` rows at a time from a byte tier); a block a tier no longer gives (moved down
by evictions cascading since the probe) is looked for again in the tiers below it. :func:`restored_calls`
says how a restore publishes the loaded blocks in the device pool.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from kvpool.allocators.groups import group_key, split_group_key
from kvpool.storage.block_copy import scatter_rows
from kvpool.storage.paged import BlockStore
from kvpool.tiers.backend import TierBackend
from kvpool.tiers.host import HostTier
from kvpool.tiers.writer import Writer

LOAD_BATCH = 64  # blocks per load from a byte tier (the load buffer's rows)


def tier_code(t: int) -> int:
    """The code :meth:`OffloadManager.probe` gives a key held in tier ``t`` (``-2 - t``: below -1, so it
    never names a device block, nor the null block's -1 of a pool without one)."""
    return -2 - t


def tier_of(code: int) -> int:
    """The tier index a :func:`tier_code` names."""
    return -2 - code


def restored_calls(plan: Sequence[tuple[Hashable, int]], fresh: list[int], loaded: int,
                   parent_hash: Hashable | None) -> list[tuple[list[int], list[Hashable], Any]]:
    """How a restore publishes: per group (in the order the groups first appear in ``plan``), its
    blocks in the plan's order up to the last of the ``loaded`` tier blocks (in ``fresh``), the device
    blocks among them too, with the key of the block before the group's first one as the parent (the
    plan is position by position, so that is the previous position's hash; ``parent_hash`` before the
    plan's first position). Publishing the key a block holds is a no-op, so only the loaded blocks
    enter the index, and a KV event sink gives each run of them its group and, as its parent, the block
    before it in the request's chain. Returns ``(block ids, keys, parent key)`` per call."""
    calls: dict[int, tuple[list[int], list[Hashable], Any]] = {}
    seen: set[int] = set()
    position, before, n = None, parent_hash, 0
    for key, where in plan:
        if where < -1:
            if n == loaded:
                break
            where, n = fresh[n], n + 1
        elif where in seen:
            continue
        seen.add(where)
        g, h = split_group_key(key)
        if h != position:
            before, position = (before if position is None else position), h
        if g not in calls:
            calls[g] = ([], [], None if before is None else group_key(g, before))
        calls[g][0].append(where)
        calls[g][1].append(key)
    return list(calls.values())


class ChainReader:
    """Reads ``tiers`` (a :class:`HostTier` first if ``host`` is it, then the byte tiers behind ``writer``)
    into the device ``cache`` (None: hashes only, nothing is copied).

    Attributes:
        load_failures: loads that ended before their run did (a block no tier gave intact).
    """

    def __init__(self, tiers: list[TierBackend], host: HostTier | None, writer: Writer,
                 cache: BlockStore | None) -> None:
        self.tiers, self.host, self.writer, self.cache = tiers, host, writer, cache
        self.load_failures = 0
        self._load_buf = torch.empty(0, dtype=torch.uint8)

    def exists(self, t: int, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` tier ``t`` holds (pending stores included)."""
        tier = self.tiers[t]
        if tier is self.host:
            return tier.exists(keys)
        return self.writer.exists(t - (self.host is not None), keys)

    def load(self, keys: list[Hashable], where: list[int], fresh: list[int]) -> int:
        """Load ``keys`` into device blocks ``fresh``, one run of same-tier keys at a time (``where``: the
        tier codes the probe found); returns how many leading ones loaded. ``where`` is updated to the tier
        each block finally came from."""
        done = 0
        while done < len(keys):
            t = tier_of(where[done])
            run = 1
            while done + run < len(keys) and where[done + run] == where[done]:
                run += 1
            got = self._load_run(t, keys[done:done + run], fresh[done:done + run])
            if got < run:  # the rest may have moved down since the probe (evictions cascading meanwhile)
                got += self._reload(keys, where, done + got, done + run, t, fresh)
            done += got
            if got < run:
                self.load_failures += 1
                break
        return done

    def count_loaded(self, where: list[int]) -> None:
        """Count, in each tier's stats, the hits of the blocks loaded from it (``where``: their codes)."""
        for t, tier in enumerate(self.tiers):
            n = where.count(tier_code(t))
            if n:
                tier.count_hits(n)

    def _reload(self, keys: list[Hashable], where: list[int], start: int, stop: int, first: int,
                fresh: list[int]) -> int:
        """The blocks ``start .. stop - 1`` that tier ``first`` no longer gave: look for them again in it and
        the tiers below, and load them; returns how many leading ones loaded (``where`` updated)."""
        done = start
        while done < stop:
            t = next((t for t in range(first, len(self.tiers)) if self.exists(t, keys[done:stop])), None)
            if t is None:
                break
            run = self.exists(t, keys[done:stop])
            got = self._load_run(t, keys[done:done + run], fresh[done:done + run])
            where[done:done + got] = [tier_code(t)] * got
            done += got
            if got < run:
                break
        return done - start

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

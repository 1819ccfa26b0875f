"""Which blocks live on which page of a :class:`~kvpool.storage.arena.PageArena`, and the pages a store keeps
committed under its live blocks.

**The page map.** A store's buffer indexes blocks along one dimension; every index of the dimensions before
it picks a *strip* (K or V of one layer in the ``[2, L, N, B, H, D]`` layout: 2 x L strips; one strip in
the block-major ``[N, E]`` layout), and within a strip block ``b`` is one contiguous run of bytes at
``offset + b * stride``. So block ``b`` touches, in each strip, the pages from ``(offset + b * stride) //
page_size`` to ``(offset + b * stride + length - 1) // page_size``: :class:`PageMap` computes that (and the
inverse, the blocks on a page) from the tensors' own shapes and strides, whatever the layout (NHD, HND,
packed, MLA, the recurrent state's conv and SSM buffers side by side). ``tests/test_page_map.py`` checks it
against a brute force over every element's byte address for each layout.

**Live blocks.** :class:`BlockPages` counts, per page, the live blocks on it (a block the caller handed
out, or that still holds KV it may reuse). ``commit_blocks`` commits the pages a block needs before it
is used; ``release_blocks`` releases a page once no live block is on it, keeping up to ``reserve_pages``
such empty pages committed against churn (kvcached's reserve); ``trim`` releases those too.

In the ``[2, L, N, ...]`` layout a block touches at least 2 x L pages, each shared with the blocks beside
it in that strip, so the smallest unit of memory that can follow use is ``2 x L x page_size`` (128 MiB for
32 layers and 2 MiB pages); block-major it is one page. The KV caches take the block-major layout when they
are elastic (see ``docs/storage.md``, "Elastic memory", for the measurements).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError, DoubleFreeError, IntegrityError, InvalidIdError
from kvpool.numeric import as_id_list, as_int
from kvpool.storage.arena import PageArena
from kvpool.units import plural

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Strip:
    """Blocks laid out at a fixed stride: block ``b``'s bytes here are ``[offset + b * stride, ... +
    length)``, counted from the arena's start."""

    offset: int
    stride: int
    length: int


class PageMap:
    """The pages each of ``num_blocks`` blocks touches, over ``strips`` (byte ranges from the arena's
    start), in pages of ``page_size`` bytes.

    Use :meth:`of` to build it from a store's tensors.
    """

    def __init__(self, strips: Sequence[Strip], num_blocks: int, page_size: int) -> None:
        self.strips = tuple(strips)
        self.num_blocks = num_blocks
        self.page_size = page_size
        #: True where every block is one run of bytes (a single strip): a block touches 1 or 2 pages
        self.block_major = len(self.strips) == 1

    @classmethod
    def of(cls, tensors: Sequence[tuple[torch.Tensor, int]], base: int, page_size: int) -> PageMap:
        """The page map of the blocks along dimension ``dim`` of each ``(tensor, dim)`` (all with the same
        block count), for an arena starting at address ``base``. The dimensions after ``dim`` must be
        contiguous (a block is one run of bytes in each strip); ConfigError otherwise."""
        strips: list[Strip] = []
        counts = {t.shape[dim] for t, dim in tensors}
        if len(counts) != 1:
            raise ConfigError(f"the tensors of one page map must index as many blocks, got {sorted(counts)}")
        for tensor, dim in tensors:
            strips.extend(_strips(tensor, dim, base))
        return cls(strips, counts.pop(), page_size)

    def pages_of(self, block: int) -> list[int]:
        """The pages block ``block`` touches, ascending, distinct."""
        size = self.page_size
        pages: set[int] = set()
        for s in self.strips:
            start = s.offset + block * s.stride
            pages.update(range(start // size, (start + s.length - 1) // size + 1))
        return sorted(pages)

    def pages_of_blocks(self, blocks: Iterable[int]) -> list[int]:
        """The pages any of ``blocks`` touches, ascending, distinct."""
        pages: set[int] = set()
        for block in blocks:
            pages.update(self.pages_of(block))
        return sorted(pages)

    def blocks_on(self, page: int) -> list[int]:
        """The blocks with a byte on page ``page``, ascending, distinct."""
        lo_byte, hi_byte = page * self.page_size, (page + 1) * self.page_size
        blocks: set[int] = set()
        for s in self.strips:
            # block b intersects [lo, hi) iff offset + b*stride < hi and offset + b*stride + length > lo
            first = max(0, (lo_byte - s.offset - s.length) // s.stride + 1)
            last = (hi_byte - s.offset - 1) // s.stride if hi_byte > s.offset else -1
            last = min(self.num_blocks - 1, last)
            blocks.update(range(first, last + 1))
        return sorted(blocks)

    def unit_bytes(self) -> int:
        """Bytes committed for block 0 alone: the smallest step in which this layout's memory follows
        use."""
        return len(self.pages_of(0)) * self.page_size


def _strips(tensor: torch.Tensor, dim: int, base: int) -> list[Strip]:
    """The strips of ``tensor``'s blocks along ``dim``: one per index of the dimensions before it."""
    item = tensor.element_size()
    inner = tensor.shape[dim + 1:]
    expected = 1
    for size, stride in reversed(list(zip(inner, tensor.stride()[dim + 1:], strict=True))):
        if size > 1 and stride != expected:
            raise ConfigError(f"the dimensions after {dim} of a {list(tensor.shape)} tensor with strides "
                              f"{list(tensor.stride())} are not contiguous: a block is not one run of bytes")
        expected *= size
    length, stride = expected * item, tensor.stride(dim) * item
    offsets = [tensor.data_ptr() - base]
    for size, step in zip(tensor.shape[:dim], tensor.stride()[:dim], strict=True):
        offsets = [o + i * step * item for o in offsets for i in range(size)]
    return [Strip(o, stride, length) for o in offsets]


class BlockPages:
    """The live blocks of a store on a :class:`PageArena` and the pages committed under them.

    Args:
        arena: the arena under the store's buffer(s).
        page_map: which pages each block touches (:meth:`PageMap.of` of the store's tensors).
        reserve_pages: pages with no live block that stay committed instead of being released at once
            (kvcached keeps 5 to 10 against churn); :meth:`trim` releases them.

    A block is *live* from :meth:`commit_blocks` until :meth:`release_blocks`: its pages stay committed.
    Every call checks its whole argument before it changes anything.
    """

    def __init__(self, arena: PageArena, page_map: PageMap, *, reserve_pages: int = 0) -> None:
        self.arena = arena
        self.map = page_map
        self.reserve_pages = as_int(reserve_pages, "reserve_pages", minimum=0, error=ConfigError)
        self.num_blocks = page_map.num_blocks
        self._usable = self.num_blocks
        self._live = bytearray(self.num_blocks)
        self._num_live = 0
        self._count = [0] * arena.num_pages
        self._empty: dict[int, None] = {}  # committed pages with no live block, oldest first

    @property
    def num_live(self) -> int:
        """Live blocks now."""
        return self._num_live

    @property
    def usable_blocks(self) -> int:
        """Blocks ``[0, usable_blocks)`` may be committed (:meth:`resize`)."""
        return self._usable

    @property
    def num_reserve(self) -> int:
        """Committed pages with no live block (the reserve against churn)."""
        return len(self._empty)

    def is_live(self, block: int) -> bool:
        """Whether ``block`` is live. InvalidIdError outside ``[0, num_blocks)``."""
        block = as_int(block, "block", minimum=0, maximum=self.num_blocks - 1, error=InvalidIdError)
        return bool(self._live[block])

    def live_blocks(self) -> list[int]:
        """The live blocks, ascending."""
        return [b for b, live in enumerate(self._live) if live]

    def live_on(self, page: int) -> int:
        """Live blocks on ``page`` now (0 for an empty committed page or an uncommitted one)."""
        return self._count[page]

    def placement(self, block: int) -> tuple[int, int, int, int]:
        """How good a place ``block`` (free, not live) is to hand out next, smaller is better: ``(pages it
        would commit, -(live blocks on its fullest page), its first page, block)``. Sorting free blocks by it
        hands out blocks on committed pages first, the fullest page first, then fills one fresh page
        before the next (:mod:`kvpool.requests.page_aware`)."""
        pages = self.map.pages_of(block)
        count, empty = self._count, self._empty
        new = sum(1 for p in pages if count[p] == 0 and p not in empty)  # committed: live or in reserve
        return new, -max(count[p] for p in pages), pages[0], block

    def commit_blocks(self, block_ids: Iterable[int]) -> int:
        """Make ``block_ids`` live, committing the pages they need; return the bytes newly committed.
        Live ids and repeats are allowed (a no-op for them).

        Raises:
            InvalidIdError: an id outside ``[0, usable_blocks)`` or not an integer.
            MemoryLimitError, InsufficientMemoryError: the pages cannot be committed.
            AsleepError: the arena is asleep.
        Nothing changes when it raises.
        """
        ids = self._checked(block_ids, self._usable)
        new = [b for b in dict.fromkeys(ids) if not self._live[b]]
        if not new:
            return 0
        pages_of = [self.map.pages_of(b) for b in new]
        needed = {p for pages in pages_of for p in pages if self._count[p] == 0 and p not in self._empty}
        committed = self.arena.commit(needed)
        for block, pages in zip(new, pages_of, strict=True):
            self._live[block] = 1
            for p in pages:
                if self._count[p] == 0:
                    self._empty.pop(p, None)
                self._count[p] += 1
        self._num_live += len(new)
        return len(committed) * self.arena.page_size

    def release_blocks(self, block_ids: Iterable[int]) -> int:
        """Make ``block_ids`` not live; release each page left with no live block (past the reserve);
        return the bytes released.

        Raises:
            InvalidIdError: an id outside ``[0, num_blocks)``, not an integer, or repeated.
            DoubleFreeError: a block that is not live.
            AsleepError: the arena is asleep.
        Nothing changes when it raises.
        """
        self.arena.check_awake()
        ids = self._checked(block_ids, self.num_blocks)
        if len(set(ids)) != len(ids):
            raise InvalidIdError(f"block ids repeat: {ids[:8]}")
        dead = [b for b in ids if not self._live[b]]
        if dead:
            raise DoubleFreeError(f"blocks {dead[:8]} are not live (never committed, or released)")
        for block in ids:
            self._live[block] = 0
            for p in self.map.pages_of(block):
                self._count[p] -= 1
                if self._count[p] == 0:
                    self._empty[p] = None
        self._num_live -= len(ids)
        surplus = len(self._empty) - self.reserve_pages
        return self._release_empty(list(self._empty)[:surplus] if surplus > 0 else [])

    def trim(self) -> int:
        """Release every committed page with no live block (the reserve included); return the bytes."""
        self.arena.check_awake()
        return self._release_empty(list(self._empty))

    def resize(self, num_blocks: int) -> int:
        """Let only blocks ``[0, num_blocks)`` be committed from now on (at most the store's blocks), and
        release the pages left with no live block; return the bytes released. Raises InvalidIdError for
        a size out of range or one that leaves a live block outside (nothing changes then)."""
        self.arena.check_awake()
        size = as_int(num_blocks, "num_blocks", minimum=0, maximum=self.num_blocks, error=InvalidIdError)
        outside = [b for b in range(size, self._usable) if self._live[b]]
        if outside:
            raise InvalidIdError(f"blocks {outside[:8]} at or past {size} are live: release them first")
        self._usable = size
        return self.trim()

    def sleep(self) -> int:
        """Release every page (:meth:`PageArena.sleep`); the live blocks stay live, reading 0 after
        :meth:`wake`. Return the bytes given back."""
        return self.arena.sleep()

    def wake(self) -> int:
        """Commit again what :meth:`sleep` released (reading 0); return the bytes."""
        return self.arena.wake()

    def stats(self) -> dict[str, Any]:
        """The arena's stats plus ``live_blocks``, ``usable_blocks``, ``reserve_pages`` (empty pages kept)
        and ``unit_bytes`` (:meth:`PageMap.unit_bytes`)."""
        return {**self.arena.stats(), "live_blocks": self._num_live, "usable_blocks": self._usable,
                "reserve_pages": len(self._empty), "unit_bytes": self.map.unit_bytes()}

    def check_integrity(self) -> None:
        """Recount every page's live blocks from the live set and check: each page under a live block is
        committed, each committed page has a live block or is in the reserve, the reserve holds only
        empty committed pages. Raises IntegrityError naming the first broken invariant."""
        count = [0] * self.arena.num_pages
        for block in self.live_blocks():
            for p in self.map.pages_of(block):
                count[p] += 1
        if count != self._count:
            raise IntegrityError("a page's live block count differs from the live blocks on it")
        if len(self.live_blocks()) != self._num_live:
            raise IntegrityError("the live block count differs from the live blocks")
        committed = set(self.arena.committed_pages()) if not self.arena.asleep else None
        for p, c in enumerate(count):
            if committed is not None and c and p not in committed:
                raise IntegrityError(f"page {p} holds a live block but is not committed")
            if c and p in self._empty:
                raise IntegrityError(f"page {p} holds a live block but is in the reserve")
        if committed is not None and committed != {p for p, c in enumerate(count) if c} | set(self._empty):
            raise IntegrityError("a committed page has no live block and is not in the reserve")

    def __repr__(self) -> str:
        return (f"BlockPages({plural(self._num_live, 'live block')}, "
                f"{plural(self.arena.num_committed, 'committed page')}, {len(self._empty)} in reserve)")

    def _checked(self, block_ids: Iterable[int], bound: int) -> list[int]:
        ids = as_id_list(block_ids, "block ids")
        bad = [b for b in ids if not 0 <= b < bound]
        if bad:
            raise InvalidIdError(f"block ids must be in [0, {bound}), got {bad[:8]}")
        return ids

    def _release_empty(self, pages: list[int]) -> int:
        self.arena.release(pages)
        for p in pages:
            del self._empty[p]
        return len(pages) * self.arena.page_size

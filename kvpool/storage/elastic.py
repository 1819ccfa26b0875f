"""What every store on a page arena offers: :class:`ElasticMemory`, the ``elastic=`` option's half of a store.

A store built with ``elastic=True`` (or an :class:`~kvpool.storage.arena.ElasticConfig`) allocates its
buffers as views of one :class:`~kvpool.storage.arena.PageArena` (:meth:`ElasticMemory.allocate_elastic`),
each starting on a page, and keeps a :class:`~kvpool.storage.page_map.BlockPages` over them: nothing is
committed until :meth:`ElasticMemory.commit_blocks` names the blocks about to be used, and a page is given
back once every block on it is released. The tensors never move. A store built without it has
``pages = None``, and these methods raise :class:`ConfigError` there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError
from kvpool.numeric import as_int
from kvpool.storage.arena import DEFAULT_PAGE_SIZE, CountingBackend, ElasticConfig, PageArena
from kvpool.storage.page_map import BlockPages, PageMap, Strip

if TYPE_CHECKING:
    import torch


class ElasticMemory:
    """The elastic half of a store: ``pages`` (None for a fixed buffer) and the calls on it.

    "Blocks" are the store's own unit along its block dimension (KV blocks; state slots for the recurrent
    state cache).
    """

    pages: BlockPages | None = None

    def allocate_elastic(self, config: ElasticConfig, device: str | torch.device,
                         buffers: Sequence[tuple[tuple[int, ...], torch.dtype]], block_dim: int
                         ) -> list[torch.Tensor]:
        """Reserve one arena for ``buffers`` (``(shape, dtype)`` each, every one with the same block count
        along ``block_dim``), each starting on a page; set :attr:`pages`; return the tensors (views of
        the arena, nothing committed). Raises ConfigError (a device without an arena back end, a page size
        the back end refuses)."""
        size = config.page_size
        offsets, total = [], 0
        for shape, dtype in buffers:
            offsets.append(total)
            total += -(-_nbytes(shape, dtype) // size) * size
        arena = config.arena(total, device)
        tensors = [arena.view(dtype, tuple(shape), offset)
                   for (shape, dtype), offset in zip(buffers, offsets, strict=True)]
        page_map = PageMap.of([(t, block_dim) for t in tensors], arena.tensor.data_ptr(), arena.page_size)
        self.pages = BlockPages(arena, page_map, reserve_pages=config.reserve_pages)
        return tensors

    @property
    def elastic(self) -> bool:
        """Whether this store sits on a page arena."""
        return self.pages is not None

    @property
    def committed_bytes(self) -> int | None:
        """Bytes of the arena committed now (None for a fixed buffer)."""
        return None if self.pages is None else self.pages.arena.committed_bytes

    def commit_blocks(self, block_ids: Iterable[int]) -> int:
        """Commit the pages under ``block_ids`` before they are written (:meth:`BlockPages.commit_blocks`);
        return the bytes newly committed."""
        return self._elastic().commit_blocks(block_ids)

    def release_blocks(self, block_ids: Iterable[int]) -> int:
        """Release ``block_ids``; each page left with no live block is given back
        (:meth:`BlockPages.release_blocks`). Return the bytes released. Their KV is gone."""
        return self._elastic().release_blocks(block_ids)

    def is_live(self, block: int) -> bool:
        """Whether ``block`` is live (committed and not released since: :meth:`BlockPages.is_live`)."""
        return self._elastic().is_live(block)

    def live_blocks(self) -> list[int]:
        """The live blocks, ascending."""
        return self._elastic().live_blocks()

    def trim(self) -> int:
        """Give back every committed page with no live block; return the bytes."""
        return self._elastic().trim()

    def sleep(self) -> int:
        """Give back every page (KV of live blocks included: it reads 0 after :meth:`wake`); return the
        bytes. Until :meth:`wake` the calls above raise AsleepError."""
        return self._elastic().sleep()

    def wake(self) -> int:
        """Commit again what :meth:`sleep` gave back (reading 0); return the bytes."""
        return self._elastic().wake()

    def elastic_stats(self) -> dict[str, Any] | None:
        """:meth:`BlockPages.stats` (None for a fixed buffer)."""
        return None if self.pages is None else self.pages.stats()

    def _elastic(self) -> BlockPages:
        if self.pages is None:
            raise ConfigError(f"this {type(self).__name__} has a fixed buffer: build it with elastic=True to "
                              "commit and release its memory by pages")
        return self.pages


class PageModel(ElasticMemory):
    """The pages an elastic block-major KV cache of ``num_blocks`` blocks of ``bytes_per_block`` bytes would
    commit (block ``b`` at byte ``b * bytes_per_block``, as an elastic
    :class:`~kvpool.storage.paged.PagedKVCache` lays them out), counted without any memory
    (:class:`~kvpool.storage.arena.CountingBackend`): what a trace replay's elastic pool commits.
    Raises ConfigError for sizes below 1."""

    def __init__(self, num_blocks: int, bytes_per_block: int, *, page_size: int = DEFAULT_PAGE_SIZE,
                 reserve_pages: int = 0) -> None:
        num_blocks = as_int(num_blocks, "num_blocks", minimum=1, error=ConfigError)
        bytes_per_block = as_int(bytes_per_block, "bytes_per_block", minimum=1, error=ConfigError)
        arena = PageArena(num_blocks * bytes_per_block, page_size=page_size, backend=CountingBackend)
        page_map = PageMap([Strip(0, bytes_per_block, bytes_per_block)], num_blocks, arena.page_size)
        self.pages = BlockPages(arena, page_map, reserve_pages=reserve_pages)


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = dtype.itemsize
    for size in shape:
        count *= size
    return count

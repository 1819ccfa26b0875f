"""Which blocks live on which page: PageMap against a brute force over the real memory of each layout, and
BlockPages (live blocks, committed pages, reserve, trim, resize) against a model, driven by hypothesis.

The brute force never reads a stride: it writes 0xFF into block b through the store's own tensor indexing
(``tensor.view(uint8).select(block_dim, b)``), with every page of a zeroed arena committed, and reads
which pages hold a non-zero byte. Page sizes of one and three OS pages (4 and 12 KiB) make blocks straddle
pages in every layout.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.errors import AsleepError, DoubleFreeError, InvalidIdError, MemoryLimitError
from kvpool.spec import KVCacheSpec
from kvpool.spec.state import RecurrentKind, RecurrentStateSpec
from kvpool.storage.arena import ElasticConfig
from kvpool.storage.mla import MLAKVCache
from kvpool.storage.page_map import PageMap
from kvpool.storage.paged import PagedKVCache
from kvpool.storage.state import RecurrentStateCache

S, F = "sliding_attention", "full_attention"


def uniform_spec() -> KVCacheSpec:  # 2 x 3 layers x 16 x 2 x 24 x fp16: 1,536 B per block and strip
    return KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=24, dtype=torch.float16, block_size=16)


def stores(page_size: int) -> dict[str, tuple[object, list[tuple[torch.Tensor, int]]]]:
    """Each layout kvpool has, elastic, with the tensors and block dimension its page map covers."""
    cfg = ElasticConfig(page_size=page_size)
    nhd = PagedKVCache(uniform_spec(), 37, elastic=cfg, packed=False)
    hnd = PagedKVCache(uniform_spec(), 37, elastic=cfg, layout="HND")
    packed = PagedKVCache(uniform_spec(), 37, elastic=cfg)
    mixed = PagedKVCache(KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                                     block_size=2, layer_types=[S, F, S, S], sliding_window=8,
                                     layer_head_dims=[4, 8, 4, 4]), 41, elastic=cfg)
    mla = MLAKVCache(KVCacheSpec(num_layers=3, num_kv_heads=1, head_dim=40, dtype=torch.bfloat16,
                                 block_size=8, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8),
                     29, elastic=cfg)
    state = RecurrentStateCache(RecurrentStateSpec(RecurrentKind.GATED_DELTA_NET, (0, 1, 3), (64, 3),
                                                   (4, 8, 8), torch.bfloat16, torch.float32, 4), 13,
                                elastic=cfg)
    assert not nhd.packed and hnd.layout == "HND" and packed.packed and mixed.packed
    return {"NHD [2, L, N, B, H, D]": (nhd, [(nhd.buffer, 2)]),
            "HND [2, L, N, H, B, D]": (hnd, [(hnd.buffer, 2)]),
            "block-major [N, E]": (packed, [(packed.buffer, 0)]),
            "packed, layers of two shapes": (mixed, [(mixed.buffer, 0)]),
            "MLA [L, N, B, R + P]": (mla, [(mla.buffer, 1)]),
            "state conv + SSM [L, N, ...]": (state, [(state.conv, 1), (state.ssm, 1)])}


def brute_force_pages(store: object, tensors: list[tuple[torch.Tensor, int]]) -> list[list[int]]:
    """For each block, the pages that hold one of its bytes, found by writing it and reading memory."""
    arena = store.pages.arena
    arena.commit(range(arena.num_pages))
    arena.tensor.zero_()
    pages = arena.tensor.view(arena.num_pages, arena.page_size)
    found = []
    for block in range(tensors[0][0].shape[tensors[0][1]]):
        for t, dim in tensors:
            t.view(torch.uint8).select(dim, block).fill_(0xFF)
        found.append(pages.ne(0).any(1).nonzero().flatten().tolist())
        arena.tensor.zero_()
    arena.release_all()
    return found


@pytest.mark.parametrize("page_size", [4096, 12288])
@pytest.mark.parametrize("layout", list(stores(4096)))
def test_page_map_is_exact_for_every_layout(layout: str, page_size: int) -> None:
    store, tensors = stores(page_size)[layout]
    page_map = store.pages.map
    truth = brute_force_pages(store, tensors)
    assert [page_map.pages_of(b) for b in range(page_map.num_blocks)] == truth
    on_page: dict[int, list[int]] = {}
    for block, pages in enumerate(truth):
        for p in pages:
            on_page.setdefault(p, []).append(block)
    for p in range(store.pages.arena.num_pages):
        assert page_map.blocks_on(p) == on_page.get(p, []), f"page {p}"
    assert page_map.pages_of_blocks([0, 3, 3]) == sorted(set(truth[0]) | set(truth[3]))


def test_every_layer_view_of_a_block_lies_on_its_pages() -> None:
    """The per-layer views a kernel reads (not just the buffer) touch only the pages of their block."""
    for name in ("block-major [N, E]", "packed, layers of two shapes", "NHD [2, L, N, B, H, D]"):
        store, _ = stores(12288)[name]
        arena = store.pages.arena
        arena.commit(range(arena.num_pages))
        pages = arena.tensor.view(arena.num_pages, arena.page_size)
        for block in (0, 7, store.num_blocks - 1):
            arena.tensor.zero_()
            for layer in range(store.num_layers):
                store.k_cache(layer)[block].fill_(1.0)
                store.v_cache(layer)[block].fill_(1.0)
            touched = set(pages.ne(0).any(1).nonzero().flatten().tolist())
            assert touched <= set(store.pages.map.pages_of(block)), (name, block)


def test_unit_bytes_by_hand() -> None:
    """The step in which memory follows use: [2, L, N, ...] commits a page in each of 2 x L strips for one
    block; block-major one page. Llama-3.1-8B-like spec: 32 layers x 8 heads x 128 x fp16, B 16: a strip
    block is 16 x 8 x 128 x 2 = 32 KiB, so one block commits 64 pages (128 MiB) strip-major, and one 2 MiB
    page (its own 2 MiB: 2 x 32 x 32 KiB) block-major."""
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16, block_size=16)
    strips = PagedKVCache(spec, 64, device="meta", packed=False).buffer
    major = PagedKVCache(spec, 64, device="meta", packed=True).buffer
    size = 2 << 20
    for buffer, dim, unit in ((strips, 2, 64 * size), (major, 0, size)):
        memory = torch.empty(buffer.numel() * 2 + size, dtype=torch.uint8)  # CPU stand-in, page-aligned
        start = (-memory.data_ptr()) % size
        tensor = memory[start:start + buffer.numel() * 2].view(torch.float16).view(buffer.shape)
        assert PageMap.of([(tensor, dim)], tensor.data_ptr(), size).unit_bytes() == unit


# ---- BlockPages against a model ----------------------------------------------------------------------

BLOCKS = st.lists(st.integers(0, 36), max_size=5) | st.lists(st.integers(-1, 38), max_size=3)


_TRUTH: dict[bool, list[list[int]]] = {}


def _truth(packed: bool, cache: PagedKVCache) -> list[list[int]]:
    """The brute-force pages of each block of this layout (pages count from the arena's start, so one
    cache's answer holds for every cache of the layout)."""
    if packed not in _TRUTH:
        _TRUTH[packed] = brute_force_pages(cache, [(cache.buffer, cache.block_dim)])
    return _TRUTH[packed]


class BlockPagesMachine(RuleBasedStateMachine):
    """BlockPages of an NHD or block-major cache of 37 blocks against a model: the live set; a page is
    committed iff a live block is on it or it is one of the ``reserve`` most recently emptied pages."""

    PACKED = True

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(uniform_spec(), 37, elastic=ElasticConfig(page_size=4096, reserve_pages=2),
                                  packed=self.PACKED)
        self.pages = self.cache.pages
        self.truth = _truth(self.PACKED, self.cache)
        self.live: set[int] = set()
        self.empty: list[int] = []  # committed pages with no live block, oldest first
        self.usable = 37
        self.limit_pages: int | None = None
        self.asleep = False

    def needed(self, live: set[int]) -> set[int]:
        return {p for b in live for p in self.truth[b]}

    @rule(blocks=BLOCKS)
    def commit(self, blocks: list[int]) -> None:
        if any(not 0 <= b < self.usable for b in blocks):
            with pytest.raises(InvalidIdError):
                self.cache.commit_blocks(blocks)
            return
        new_live = self.live | set(blocks)
        held = self.needed(self.live) | set(self.empty)
        new_pages = self.needed(new_live) - held
        if new_pages and self.asleep:
            with pytest.raises(AsleepError):
                self.cache.commit_blocks(blocks)
            return
        if self.limit_pages is not None and len(held | new_pages) > self.limit_pages and new_pages:
            with pytest.raises(MemoryLimitError):
                self.cache.commit_blocks(blocks)
            return
        if self.asleep and set(blocks) - self.live:
            with pytest.raises(AsleepError):
                self.cache.commit_blocks(blocks)
            return
        assert self.cache.commit_blocks(blocks) == len(new_pages) * 4096
        self.live = new_live
        self.empty = [p for p in self.empty if p not in self.needed(new_live)]

    @rule(blocks=BLOCKS)
    def release(self, blocks: list[int]) -> None:
        if self.asleep:
            with pytest.raises(AsleepError):
                self.cache.release_blocks(blocks)
            return
        if any(not 0 <= b < 37 for b in blocks) or len(set(blocks)) != len(blocks):
            with pytest.raises(InvalidIdError):
                self.cache.release_blocks(blocks)
            return
        if not set(blocks) <= self.live:
            with pytest.raises(DoubleFreeError):
                self.cache.release_blocks(blocks)
            return
        # a page empties when its last live block goes: blocks in the order named, pages ascending
        count = {p: sum(p in self.truth[b] for b in self.live) for p in self.needed(self.live)}
        for b in blocks:
            for p in self.truth[b]:
                count[p] -= 1
                if count[p] == 0:
                    self.empty.append(p)
        self.live -= set(blocks)
        surplus = max(0, len(self.empty) - 2)
        gone, self.empty = self.empty[:surplus], self.empty[surplus:]
        assert self.cache.release_blocks(blocks) == len(gone) * 4096

    @rule()
    def trim(self) -> None:
        if self.asleep:
            with pytest.raises(AsleepError):
                self.cache.trim()
            return
        assert self.cache.trim() == len(self.empty) * 4096
        self.empty = []

    @rule(size=st.integers(-1, 38))
    def resize(self, size: int) -> None:
        if self.asleep:
            with pytest.raises(AsleepError):
                self.pages.resize(size)
        elif not 0 <= size <= 37 or any(b >= size for b in self.live):
            with pytest.raises(InvalidIdError):
                self.pages.resize(size)
        else:
            assert self.pages.resize(size) == len(self.empty) * 4096
            self.usable, self.empty = size, []

    @rule(pages=st.none() | st.integers(0, 12))
    def limit(self, pages: int | None) -> None:
        held = len(self.needed(self.live) | set(self.empty)) if not self.asleep else 0
        if pages is not None and pages < held:
            with pytest.raises(MemoryLimitError):
                self.pages.arena.set_limit(pages * 4096)
            return
        self.pages.arena.set_limit(None if pages is None else pages * 4096)
        self.limit_pages = pages

    @rule()
    def sleep_or_wake(self) -> None:
        held = self.needed(self.live) | set(self.empty)
        if not self.asleep:
            assert self.cache.sleep() == len(held) * 4096
            self.asleep = True
        elif self.limit_pages is not None and len(held) > self.limit_pages:
            with pytest.raises(MemoryLimitError):
                self.cache.wake()
        else:
            assert self.cache.wake() == len(held) * 4096
            self.asleep = False

    @invariant()
    def agrees(self) -> None:
        self.pages.check_integrity()
        assert self.pages.live_blocks() == sorted(self.live) and self.pages.num_live == len(self.live)
        expected = set() if self.asleep else self.needed(self.live) | set(self.empty)
        assert self.pages.arena.committed_pages() == sorted(expected)
        assert self.pages.num_reserve == len(self.empty)


class StripBlockPagesMachine(BlockPagesMachine):
    PACKED = False


TestBlockMajorPages = BlockPagesMachine.TestCase
TestBlockMajorPages.settings = settings(max_examples=50, stateful_step_count=25)
TestStripPages = StripBlockPagesMachine.TestCase
TestStripPages.settings = settings(max_examples=50, stateful_step_count=25)

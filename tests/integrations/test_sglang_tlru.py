"""kvpool's ``tlru`` evicts as SGLang 0.5.23's Tail-Optimized LRU (run by tests/integrations/run.sh in the
SGLang venv; skipped without SGLang).

The reference is SGLang's own code: its ``TLRUStrategy.get_priority``
(``sglang/srt/mem_cache/evict_policy.py``) and the bookkeeping its tree core keeps for it
(``_set_tlru_lens_and_raise_history``, ``unified_cache/unified_tree_core.py``), ordering the evictable
leaves of a radix tree with one page per node in the eviction loop of SGLang's ``RadixCache.evict`` (a heap
of the evictable leaves by priority; a parent that becomes a leaf joins it). The same seeded workload (a
shared system prompt, conversations whose turns extend earlier ones, branches, one-off prompts) runs
one request at a time against that tree and against a kvpool ``BlockPool`` with ``TLRUPolicy``: the pages
evicted, in order, must be the same. SGLang counts tokens, the paper and kvpool blocks: the strategy gets
``threshold x PAGE`` tokens."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed here: tests/integrations/run.sh runs this "
                    "file in the peer venv (benchmarks/peers/setup.sh)")

import sglang_harness  # noqa: E402,F401  (stands in for torchvision, which SGLang imports)
from sglang.srt.mem_cache.evict_policy import TLRUStrategy  # noqa: E402
from sglang.srt.mem_cache.unified_cache.unified_tree_core import (  # noqa: E402
    _set_tlru_lens_and_raise_history,
)

from kvpool.allocators.block_pool import BlockPool  # noqa: E402
from kvpool.allocators.prefix_policies import TLRUPolicy  # noqa: E402

PAGE = 16  # tokens per page (SGLang) = per block (kvpool)
CAPACITY = 240  # pages = blocks
_clock = itertools.count(1)


class Node:
    """A radix-tree node of one page, with the fields SGLang's TLRU strategy and bookkeeping read."""

    def __init__(self, parent: Node | None, page: int | None) -> None:
        self.parent, self.page, self.children = parent, page, {}
        self.key = [0] * (PAGE if parent is not None else 0)
        self.last_access_time = next(_clock)
        self.lock_ref = 0
        self._tlru_cached_prefix_len = 0
        self._tlru_history_len = 0

    def __lt__(self, other: Node) -> bool:
        return self.last_access_time < other.last_access_time


class SGLangTree:
    """Pages of ``capacity`` in a page-per-node radix tree, evicted as ``RadixCache.evict`` does with
    SGLang's TLRU strategy."""

    def __init__(self, capacity: int, strategy: TLRUStrategy) -> None:
        self.root, self.capacity, self.size, self.strategy, self.evicted = Node(None, None), capacity, 0, \
            strategy, []

    def request(self, pages: list[int]) -> int:
        node, path = self.root, []
        for page in pages:  # match_prefix: every node on the path is accessed, root first
            child = node.children.get(page)
            if child is None:
                break
            child.last_access_time = next(_clock)
            path.append(child)
            node = child
        for n in path:
            n.lock_ref += 1
        new = len(pages) - len(path)
        self.evict(new - (self.capacity - self.size))
        for page in pages[len(path):]:
            child = Node(node, page)
            node.children[page] = child
            _set_tlru_lens_and_raise_history(child, node)
            node = child
        self.size += new
        for n in path:
            n.lock_ref -= 1
        return len(path)

    def evict(self, num_pages: int) -> None:
        if num_pages <= 0:
            return
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heap = [(self.strategy.get_priority(n), n) for n in leaves]
        heapq.heapify(heap)
        done = 0
        while done < num_pages and heap:
            _, x = heapq.heappop(heap)
            del x.parent.children[x.page]
            self.evicted.append(x.page)
            self.size -= 1
            done += 1
            parent = x.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self.strategy.get_priority(parent), parent))

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack += n.children.values()
        return out


def workload(seed: int, n: int = 1500) -> list[list[int]]:
    """Requests as page chains: a 6-page system prompt; 45% new conversations, 45% next turns of a recent
    one (its last prompt plus 2-20 pages), 10% branches from an earlier turn; 5-40 pages each."""
    rng, pages = random.Random(seed), itertools.count(1000)
    system = [next(pages) for _ in range(6)]
    turns: list[list[int]] = []
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.45 or not turns:
            prompt = system + [next(pages) for _ in range(rng.randrange(2, 30))]
        else:
            base = turns[-rng.randrange(1, min(len(turns), 30) + 1)] if r < 0.9 else rng.choice(turns)
            prompt = base[:rng.randrange(len(system), len(base) + 1)] if r >= 0.9 else list(base)
            prompt += [next(pages) for _ in range(rng.randrange(2, 20))]
        prompt = prompt[:40]
        turns.append(prompt)
        out.append(prompt)
    return out


def kvpool_evictions(requests: list[list[int]], threshold: int, estimate: int) -> tuple[list[int], list[int]]:
    pool, evicted, hits = BlockPool(CAPACITY, policy=TLRUPolicy(threshold, estimate)), [], []
    pool.set_eviction_listener(lambda ids, hashes: evicted.extend(hashes))
    for pages in requests:
        hit = pool.lookup(pages)
        pool.touch(hit)
        new = pool.allocate(len(pages) - len(hit))
        pool.cache_blocks(new, pages[len(hit):])
        pool.free((hit + new)[::-1])
        hits.append(len(hit))
    pool.check_integrity()
    return evicted, hits


@pytest.mark.parametrize(("threshold", "estimate"), [(12, 4), (30, 0), (8, 7)])
@pytest.mark.parametrize("seed", [1, 2])
def test_tlru_evicts_as_sglang(seed: int, threshold: int, estimate: int) -> None:
    requests = workload(seed)
    tree = SGLangTree(CAPACITY, TLRUStrategy(threshold * PAGE, estimate * PAGE))
    their_hits = [tree.request(pages) for pages in requests]
    ours, our_hits = kvpool_evictions(requests, threshold, estimate)
    assert len(tree.evicted) > 10_000, "the workload must evict (it is the point of the test)"
    first = next((i for i, (a, b) in enumerate(zip(tree.evicted, ours, strict=False)) if a != b), None)
    assert first is None and len(ours) == len(tree.evicted), (
        f"first different eviction at {first} of {len(tree.evicted)} / {len(ours)}")
    assert our_hits == their_hits
    print(f"\ntlru threshold {threshold} estimate {estimate}: {len(ours)} evictions in SGLang's order, "
          f"{sum(our_hits)} hit pages")


def test_tlru_differs_from_lru_here() -> None:
    """The workload tells TLRU from LRU (else the comparison above would prove little)."""
    requests = workload(1)
    tree = SGLangTree(CAPACITY, TLRUStrategy(12 * PAGE, 4 * PAGE))
    for pages in requests:
        tree.request(pages)
    lru = SGLangTree(CAPACITY, TLRUStrategy(0, 0))  # threshold 0: nothing TEL-safe, plain LRU
    for pages in requests:
        lru.request(pages)
    assert tree.evicted != lru.evicted

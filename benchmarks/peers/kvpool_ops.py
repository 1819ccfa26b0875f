"""kvpool's side of the peer comparison: the patterns of ``patterns.py`` on kvpool's allocators.
Run by ``compare.py`` with the interpreter kvpool is installed in; prints one JSON line."""

from __future__ import annotations

import patterns as p

import kvpool
from kvpool import BlockPool, TokenToKVPoolAllocator, _native


def main() -> None:
    rows = {
        f"block pool allocate({n})+free": p.alloc_free_per_block(
            lambda: BlockPool(p.BLOCKS), lambda pool, n: pool.allocate(n),
            lambda pool, chunk: pool.free(chunk[::-1]), n)
        for n in (1, 256)
    }
    rows["token allocator alloc(1)+free(1)"] = p.pairs_per_pair(
        lambda: TokenToKVPoolAllocator(p.SLOTS), lambda a: a.alloc(1), lambda a, x: a.free(x))
    rows[f"paged allocator alloc({p.PAGE})+free({p.PAGE})"] = p.pairs_per_pair(
        lambda: TokenToKVPoolAllocator(p.SLOTS, page_size=p.PAGE), lambda a: a.alloc(p.PAGE),
        lambda a, x: a.free(x))
    p.report("kvpool", kvpool.__version__, rows, hot_path=_native.describe())


if __name__ == "__main__":
    main()

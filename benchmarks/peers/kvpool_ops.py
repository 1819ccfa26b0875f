"""kvpool's side of the peer comparison: the patterns of ``patterns.py`` on kvpool's allocators and block
hasher. Run by the runner (``kvpool.bench.peers``) with the interpreter kvpool is installed in; prints one
JSON line per round (``patterns.serve``)."""

from __future__ import annotations

import patterns as p

import kvpool
from kvpool import BlockPool, TokenToKVPoolAllocator, _native
from kvpool.allocators.hashing import BlockHasher


def cached_pool() -> BlockPool:
    """Every block published under its own hash, then freed tail first: all free blocks cached."""
    pool = BlockPool(p.BLOCKS)
    blocks = pool.allocate(p.BLOCKS)
    pool.cache_blocks(blocks, [i.to_bytes(16, "big") for i in range(p.BLOCKS)])
    pool.free(blocks[::-1])
    return pool


def rows() -> dict[str, float]:
    out = {
        f"block pool allocate({n})+free": p.alloc_free_per_block(
            lambda: BlockPool(p.BLOCKS), lambda pool, n: pool.allocate(n),
            lambda pool, chunk: pool.free(chunk[::-1]), n)
        for n in (1, 256)
    }
    out["block pool evicting allocate(1)"] = p.evicting_alloc_per_block(
        cached_pool, lambda pool, n: pool.allocate(n), 1)
    hasher = BlockHasher("sha256", seed="kvpool bench seed, not a secret", shared=True)
    out["sha256 block hash (16 tokens)"] = p.hash_per_block(lambda t: hasher.block_hashes(t, p.HASH_BLOCK))
    out["token allocator alloc(1)+free(1)"] = p.pairs_per_pair(
        lambda: TokenToKVPoolAllocator(p.SLOTS), lambda a: a.alloc(1), lambda a, x: a.free(x))
    out[f"paged allocator alloc({p.PAGE})+free({p.PAGE})"] = p.pairs_per_pair(
        lambda: TokenToKVPoolAllocator(p.SLOTS, page_size=p.PAGE), lambda a: a.alloc(p.PAGE),
        lambda a, x: a.free(x))
    return out


def main() -> None:
    p.serve("kvpool", kvpool.__version__, rows, hot_path=_native.describe())


if __name__ == "__main__":
    main()

"""vLLM's side of the peer comparison: the block-pool and hashing patterns of ``patterns.py`` on vLLM 0.33's
v1 ``BlockPool`` (prefix caching on) and its block hash (``hash_block_tokens`` with its default ``sha256``).
Run with the vLLM venv's python (``setup.sh``); prints one JSON line per round (``patterns.serve``).
vLLM's pool reserves block 0 as its null block, so it is built with one block more. Blocks are cached through
``cache_full_blocks`` with a stand-in request: with KV events off it reads only the request's
``block_hashes``."""

from __future__ import annotations

from types import SimpleNamespace

import patterns as p
import vllm
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import hash_block_tokens


def fresh_pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=p.BLOCKS + 1, enable_caching=True, hash_block_size=p.HASH_BLOCK)


def cached_pool() -> BlockPool:
    """Every block published under its own hash, then freed tail first: all free blocks cached."""
    pool = fresh_pool()
    blocks = pool.get_new_blocks(p.BLOCKS)
    request = SimpleNamespace(block_hashes=[i.to_bytes(32, "big") for i in range(p.BLOCKS)])
    pool.cache_full_blocks(request, blocks, 0, p.BLOCKS, p.HASH_BLOCK, 0)
    pool.free_blocks(reversed(blocks))
    return pool


def hash_sequence(tokens: list[int]) -> list[bytes]:
    parent, out = None, []
    for i in range(0, len(tokens) - p.HASH_BLOCK + 1, p.HASH_BLOCK):
        parent = hash_block_tokens(sha256, parent, tokens[i:i + p.HASH_BLOCK])
        out.append(parent)
    return out


def rows() -> dict[str, float]:
    out = {
        f"block pool allocate({n})+free": p.alloc_free_per_block(
            fresh_pool, lambda pool, n: pool.get_new_blocks(n),
            lambda pool, chunk: pool.free_blocks(reversed(chunk)), n)
        for n in (1, 256)
    }
    out["block pool evicting allocate(1)"] = p.evicting_alloc_per_block(
        cached_pool, lambda pool, n: pool.get_new_blocks(n), 1)
    out["sha256 block hash (16 tokens)"] = p.hash_per_block(hash_sequence)
    return out


def main() -> None:
    kv_cache_utils.init_none_hash(sha256)
    p.serve("vLLM", vllm.__version__, rows)


if __name__ == "__main__":
    main()

"""vLLM's side of the peer comparison: the block-pool patterns of ``patterns.py`` on vLLM 0.33's v1
``BlockPool`` (prefix caching on). Run with the vLLM venv's python (``setup.sh``); prints one JSON line.
vLLM's pool reserves block 0 as its null block, so it is built with one block more."""

from __future__ import annotations

import patterns as p
import vllm
from vllm.v1.core.block_pool import BlockPool


def main() -> None:
    rows = {
        f"block pool allocate({n})+free": p.alloc_free_per_block(
            lambda: BlockPool(num_gpu_blocks=p.BLOCKS + 1, enable_caching=True, hash_block_size=16),
            lambda pool, n: pool.get_new_blocks(n), lambda pool, chunk: pool.free_blocks(reversed(chunk)), n)
        for n in (1, 256)
    }
    p.report("vLLM", vllm.__version__, rows)


if __name__ == "__main__":
    main()

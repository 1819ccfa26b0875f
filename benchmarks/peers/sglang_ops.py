"""SGLang's side of the peer comparison: the token-allocator patterns of ``patterns.py`` on SGLang 0.5.23's
``TokenToKVPoolAllocator`` and ``PagedTokenToKVPoolAllocator`` (CPU tensors). Run with the SGLang venv's
python (``setup.sh``); prints one JSON line per round (``patterns.serve``). The allocator module imports
Triton for its CUDA kernels, which these CPU paths never call: ``stub_modules("triton")`` stands in for it."""

from __future__ import annotations

import patterns as p
from stubs import stub_modules

stub_modules("triton")

import sglang  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)


def rows() -> dict[str, float]:
    common = dict(dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False)
    return {
        "token allocator alloc(1)+free(1)": p.pairs_per_pair(
            lambda: TokenToKVPoolAllocator(p.SLOTS, **common), lambda a: a.alloc(1), lambda a, x: a.free(x)),
        f"paged allocator alloc({p.PAGE})+free({p.PAGE})": p.pairs_per_pair(
            lambda: PagedTokenToKVPoolAllocator(p.SLOTS, p.PAGE, **common), lambda a: a.alloc(p.PAGE),
            lambda a, x: a.free(x)),
    }


def main() -> None:
    p.serve("SGLang", sglang.__version__, rows)


if __name__ == "__main__":
    main()

"""``kvpool bench storage``: ``PagedKVCache.store_kv`` bandwidth against a contiguous ``copy_`` of the same
bytes.

For each token count T, K and V ``[T, H, D]`` go through ``store_kv`` (validation included) to T distinct
scattered slots of one layer, in two patterns: ``random`` (every slot random: a decode batch) and ``paged``
(random blocks filled in runs of ``block_size``: a paged prefill). The baseline copies the same K and V into
T contiguous rows of the same cache with two ``copy_`` calls: the practical ceiling. Both write into an
already-touched (zeroed) buffer so page faults are not timed. Store and copy are timed back to back in each
repetition and the ratio is the median of the per-repetition ratios, so load from other processes hits both.
Target on CPU: ratio >= 0.70 for T >= 256.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from kvpool.bench.timing import median_ns, print_table, require_at_least
from kvpool.cli.options import CommaList, positive_int
from kvpool.errors import ConfigError
from kvpool.numeric import as_seed
from kvpool.spec import KVCacheSpec, parse_kv_dtype
from kvpool.storage.paged import PagedKVCache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", action=CommaList, item=positive_int, default=[1, 16, 256, 4096],
                        metavar="N,...", help="token counts T per store_kv call (default: 1,16,256,4096)")
    parser.add_argument("--num-blocks", type=positive_int, default=2048, metavar="N",
                        help="blocks in the cache")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="B", help="tokens per block")
    parser.add_argument("--kv-heads", type=positive_int, default=8, metavar="N", help="KV heads H")
    parser.add_argument("--head-dim", type=positive_int, default=128, metavar="N", help="head dim D")
    parser.add_argument("--dtype", default="float16", metavar="NAME",
                        help="KV dtype (float16, bfloat16, float32, fp8, ...)")
    parser.add_argument("--repeat", type=positive_int, default=7, metavar="N",
                        help="timed repetitions (median)")
    parser.add_argument("--seed", type=int, default=0, metavar="SEED",
                        help="seed of the random slots and K/V")


def _slots(pattern: str, tokens: int, cache: PagedKVCache) -> torch.Tensor:
    """``random``: distinct random slots (a decode batch: every token in some request's own block);
    ``paged``: random blocks filled in runs of ``block_size`` (a paged prefill's slot mapping)."""
    if pattern == "random":
        return torch.randperm(cache.num_slots)[:tokens]
    size = cache.block_size
    blocks = torch.randperm(cache.num_blocks)[: -(-tokens // size)]
    return (blocks[:, None] * size + torch.arange(size)).flatten()[:tokens]


def _case(cache: PagedKVCache, pattern: str, tokens: int, repeat: int) -> dict[str, Any]:
    k = torch.randn(tokens, cache.num_heads, cache.head_dim).to(cache.dtype)
    v = torch.randn(tokens, cache.num_heads, cache.head_dim).to(cache.dtype)
    slots = _slots(pattern, tokens, cache)
    flat_k, flat_v = cache.flat_k_cache(0)[:tokens], cache.flat_v_cache(0)[:tokens]
    ops = max(1, 4096 // tokens)

    def store() -> None:
        for _ in range(ops):
            cache.store_kv(k, v, slots, 0)

    def copy() -> None:
        for _ in range(ops):
            flat_k.copy_(k)
            flat_v.copy_(v)

    store(), copy()  # warm up
    pairs = [(median_ns(store, ops=ops, repeat=1), median_ns(copy, ops=ops, repeat=1)) for _ in range(repeat)]
    store_ns = statistics.median(p[0] for p in pairs)
    copy_ns = statistics.median(p[1] for p in pairs)
    nbytes = k.nbytes + v.nbytes
    return {"pattern": pattern, "tokens": tokens, "bytes": nbytes, "store_kv_us": store_ns / 1e3,
            "store_kv_gb_s": nbytes / store_ns, "copy_us": copy_ns / 1e3, "copy_gb_s": nbytes / copy_ns,
            "ratio": statistics.median(c / s for s, c in pairs)}


COLUMNS = ("pattern", "tokens", "store_kv_us", "store_kv_gb_s", "copy_us", "copy_gb_s", "ratio")


def run(args: argparse.Namespace) -> dict[str, Any]:
    require_at_least(args, dict.fromkeys(("tokens", "num_blocks", "block_size", "kv_heads", "head_dim",
                                          "repeat"), 1))
    torch.manual_seed(as_seed(args.seed, "--seed", error=ConfigError))
    dtype = parse_kv_dtype(args.dtype)
    num_slots = args.num_blocks * args.block_size
    if max(args.tokens) > num_slots:  # each row writes T distinct slots
        raise ConfigError(f"--tokens {max(args.tokens)} is more than the cache's {num_slots} slots "
                          f"(--num-blocks {args.num_blocks} x --block-size {args.block_size})")
    spec = KVCacheSpec(num_layers=1, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype,
                       block_size=args.block_size)
    cache = PagedKVCache(spec, args.num_blocks, zero=True)
    rows = [_case(cache, pattern, t, args.repeat) for pattern in ("random", "paged") for t in args.tokens]
    config = {"num_blocks": args.num_blocks, "block_size": args.block_size, "kv_heads": args.kv_heads,
              "head_dim": args.head_dim, "dtype": str(dtype), "repeat": args.repeat,
              "torch_threads": torch.get_num_threads()}
    if not args.json:
        print_table(f"store_kv vs contiguous copy_ of the same bytes ({dtype}, H={args.kv_heads}, "
                    f"D={args.head_dim}, {cache.nbytes / 2**20:.0f} MiB cache)",
                    ["slots", "T", "store_kv us", "store GB/s", "copy_ us", "copy GB/s", "ratio"],
                    [[row[key] for key in COLUMNS] for row in rows])
    return {"suite": "storage", "config": config, "target": "ratio >= 0.70 for T >= 256", "rows": rows}

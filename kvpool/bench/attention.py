"""``kvpool bench attention``: attention over the paged pool against SDPA over the same context stored
contiguously (the limit), and today's gather + SDPA (the baseline).

Per context length C, two shapes at SmolLM2-135M's head layout (9 query heads, 3 KV heads, head dim 64; its
``kvpool/configs/smollm2-135m.json``): ``decode`` (R requests of C tokens each compute one query; the
engine's decode step) and ``prefill`` (one request computes all C tokens, causal). The K/V live in one
layer of a :class:`~kvpool.storage.paged.PagedKVCache` in random blocks (a random block table per request)
and, for the limit, in contiguous ``[R, Hkv, C, D]`` tensors holding the same values. Three methods, timed
one after another in every repetition (so load from other processes hits all three):

* ``contiguous``: ``F.scaled_dot_product_attention`` on the contiguous tensors (``is_causal`` for prefill);
* ``gather``: :func:`kvpool.engine.attention.gather_attention` on the step's metadata (index_select of the
  slots, padding and masks, SDPA), what ``attention="gather"`` runs per layer;
* ``paged``: :func:`kvpool.engine.paged_attention.paged_attention` by block table, ``attention="paged"``.

Ratios are speeds, the median of the per-repetition ratios: ``paged_vs_contiguous`` = contiguous time /
paged time (target >= 0.8), ``paged_vs_gather`` = gather time / paged time. ``max_abs_diff``: the largest
difference between the paged and gather outputs (both also checked against the contiguous one). Storing the
step's K/V is not timed (every method would pay it alike).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import torch.nn.functional as F

from kvpool.bench.timing import median_ns, print_table, require_at_least
from kvpool.cli.options import CommaList, positive_int
from kvpool.errors import ConfigError
from kvpool.numeric import as_seed
from kvpool.spec import KVCacheSpec, parse_kv_dtype
from kvpool.storage.paged import PagedKVCache

TARGET = 0.8  # paged attention speed / contiguous SDPA speed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", action=CommaList, item=positive_int, default=[128, 512, 2048],
                        metavar="N,...", help="context lengths C in tokens (default: 128,512,2048)")
    parser.add_argument("--requests", type=positive_int, default=4, metavar="N",
                        help="requests R of a decode step")
    parser.add_argument("--heads", type=positive_int, default=9, metavar="N", help="query heads (SmolLM2)")
    parser.add_argument("--kv-heads", type=positive_int, default=3, metavar="N", help="KV heads (SmolLM2)")
    parser.add_argument("--head-dim", type=positive_int, default=64, metavar="N", help="head dim (SmolLM2)")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="B", help="tokens per block")
    parser.add_argument("--dtype", default="float32", metavar="NAME", help="KV and query dtype")
    parser.add_argument("--repeat", type=positive_int, default=7, metavar="N",
                        help="timed repetitions (median)")
    parser.add_argument("--seed", type=int, default=0, metavar="SEED", help="seed of the tables and values")


def _tables(requests: int, context: int, block_size: int) -> tuple[list[list[int]], int]:
    """Random, disjoint block tables of ``ceil(context / block_size)`` blocks per request out of a pool with
    one spare block per request; returns them and the pool's block count."""
    per = -(-context // block_size)
    num_blocks = requests * (per + 1)
    perm = torch.randperm(num_blocks).tolist()
    return [perm[i * per:(i + 1) * per] for i in range(requests)], num_blocks


def _case(args: argparse.Namespace, dtype: torch.dtype, phase: str, context: int) -> dict[str, Any]:
    from kvpool.engine.attention import build_step_metadata, gather_attention
    from kvpool.engine.paged_attention import load_paged_kernel, paged_attention, paged_batch

    load_paged_kernel()
    requests = args.requests if phase == "decode" else 1
    new = 1 if phase == "decode" else context
    tables, num_blocks = _tables(requests, context, args.block_size)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype,
                       block_size=args.block_size)
    cache = PagedKVCache(spec, num_blocks)
    k = torch.randn(requests, args.kv_heads, context, args.head_dim).to(dtype)  # the contiguous copy
    v = torch.randn(requests, args.kv_heads, context, args.head_dim).to(dtype)
    spans = [((table,), context - new, context) for table in tables]
    meta = build_step_metadata(cache, spec.groups, spans, "cpu")
    slots = torch.cat(meta.groups[0].context_slots)
    cache.store_kv(k.transpose(1, 2).reshape(-1, args.kv_heads, args.head_dim),
                   v.transpose(1, 2).reshape(-1, args.kv_heads, args.head_dim), slots, 0)
    batch = paged_batch(spec.groups[0], spans, num_blocks, args.block_size)
    q = torch.randn(requests, args.heads, new, args.head_dim).to(dtype)
    packed = q.permute(0, 2, 1, 3).reshape(-1, args.heads, args.head_dim)  # [T, Hq, D], request by request
    query = packed.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D], the engine's layout
    kv_k, kv_v = cache.k_cache(0), cache.v_cache(0)
    methods = {
        "contiguous": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=new > 1, enable_gqa=True),
        "gather": lambda: gather_attention(query, cache, 0, meta.groups[0], meta.query_starts),
        "paged": lambda: paged_attention(packed, kv_k, kv_v, batch, check=False),
    }
    outputs = {name: fn() for name, fn in methods.items()}  # warm up, and the outputs to compare
    limit = outputs["contiguous"].permute(0, 2, 1, 3).reshape(-1, args.heads, args.head_dim)
    diff = float((outputs["paged"] - outputs["gather"][0]).abs().max())
    diff_limit = float((outputs["paged"] - limit).abs().max())
    ops = max(1, 2**21 // (requests * new * context * args.heads))
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeat):  # alternated: one repetition of each method, then the next repetition
        for name, fn in methods.items():
            times[name].append(median_ns(lambda fn=fn: [fn() for _ in range(ops)], ops=ops, repeat=1))
    us = {name: statistics.median(t) / 1e3 for name, t in times.items()}
    return {"phase": phase, "requests": requests, "context": context, "query_tokens": requests * new,
            "contiguous_us": us["contiguous"], "gather_us": us["gather"], "paged_us": us["paged"],
            "paged_vs_contiguous": statistics.median(c / p for c, p in zip(times["contiguous"],
                                                                           times["paged"], strict=True)),
            "paged_vs_gather": statistics.median(g / p for g, p in zip(times["gather"], times["paged"],
                                                                      strict=True)),
            "max_abs_diff": diff, "max_abs_diff_contiguous": diff_limit}


COLUMNS = ("phase", "requests", "context", "contiguous_us", "gather_us", "paged_us", "paged_vs_contiguous",
           "paged_vs_gather", "max_abs_diff")


def run(args: argparse.Namespace) -> dict[str, Any]:
    require_at_least(args, dict.fromkeys(("contexts", "requests", "heads", "kv_heads", "head_dim",
                                          "block_size", "repeat"), 1))
    if args.heads % args.kv_heads:
        raise ConfigError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    torch.manual_seed(as_seed(args.seed, "--seed", error=ConfigError))
    dtype = parse_kv_dtype(args.dtype)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"--dtype must be float32, float16 or bfloat16, got {args.dtype}")
    rows = [_case(args, dtype, phase, c) for phase in ("decode", "prefill") for c in args.contexts]
    config = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "block_size": args.block_size, "dtype": str(dtype), "repeat": args.repeat,
              "torch_threads": torch.get_num_threads()}
    if not args.json:
        print_table(f"attention over paged KV vs SDPA over contiguous KV ({dtype}, Hq={args.heads}, "
                    f"Hkv={args.kv_heads}, D={args.head_dim}, B={args.block_size}; speed ratios, target "
                    f"paged / contiguous >= {TARGET})",
                    ["phase", "R", "C", "contiguous us", "gather us", "paged us", "paged/contig",
                     "paged/gather", "max diff"],
                    [[row[key] for key in COLUMNS] for row in rows])
    return {"suite": "attention", "config": config, "target": f"paged_vs_contiguous >= {TARGET}",
            "rows": rows}

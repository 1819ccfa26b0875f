"""``kvpool plan CONFIG``: how much KV cache a model gets on a GPU (per tensor-parallel rank).

Without ``--gpu-memory`` it reads the local CUDA device (its total, free and already-used memory) and adds
``--non-kv-memory`` (the model's weights and activations) to what is already in use.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from kvpool.cli._args import (
    add_hash_arguments,
    describe_hasher,
    fraction,
    hasher_from_args,
    parse_bytes,
    positive_int,
)
from kvpool.errors import ConfigError
from kvpool.planner import MemoryReadings, PoolPlan, plan_pool, profile_cuda_memory
from kvpool.spec import KVCacheSpec
from kvpool.units import plural


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="how much KV cache a model gets on a GPU",
                                   description="How much KV cache a model gets on a GPU, per tensor-parallel "
                                               "rank.")
    parser.add_argument("config", metavar="CONFIG", help="a Hugging Face config.json or a folder holding one")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default 16)")
    add_memory_arguments(parser, gpu_memory_default="read the local CUDA device")
    parser.add_argument("--max-model-len", type=positive_int, metavar="N",
                        help="longest request in tokens; reports how many fit at once")
    add_hash_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)



def add_memory_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                         gpu_memory_default: str) -> None:
    """The options that size a pool as ``kvpool plan`` does (read back by :func:`plan_from_args`)."""
    parser.add_argument("--tp-size", type=positive_int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (the model's dtype), float16, bfloat16, float32, fp8, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--gpu-memory", type=parse_bytes, metavar="BYTES",
                        help=f"device memory per rank, e.g. 80GiB (default: {gpu_memory_default})")
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, metavar="F",
                        help="share of the device memory kvpool may plan with (default 0.9)")
    parser.add_argument("--non-kv-memory", type=parse_bytes, default=0, metavar="BYTES",
                        help="weights, activations and workspace per rank, e.g. 16GiB (default 0)")


def plan_from_args(config: str, args: argparse.Namespace, *, max_model_len: int | None = None
                   ) -> tuple[KVCacheSpec, PoolPlan]:
    """The spec of ``config`` and its plan from the :func:`add_memory_arguments` options and --block-size."""
    spec = KVCacheSpec.from_hf_config(config, tp_size=args.tp_size, kv_cache_dtype=args.kv_cache_dtype,
                                      block_size=args.block_size)
    plan = plan_pool(spec, _readings(args), gpu_memory_utilization=args.gpu_memory_utilization,
                     max_model_len=max_model_len)
    return spec, plan


def run(args: argparse.Namespace) -> int:
    spec, plan = plan_from_args(args.config, args, max_model_len=args.max_model_len)
    report = {**plan_report(spec, plan), "hashing": hasher_from_args(args).describe()}
    print(json.dumps(report) if args.json else _human(report))
    return 0


def _readings(args: argparse.Namespace) -> MemoryReadings:
    if args.gpu_memory is not None:
        return MemoryReadings(total_bytes=args.gpu_memory, non_kv_bytes=args.non_kv_memory)
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device here to read; give --gpu-memory BYTES (and --non-kv-memory BYTES)")
    local = profile_cuda_memory()
    return MemoryReadings(total_bytes=local.total_bytes, non_kv_bytes=local.non_kv_bytes + args.non_kv_memory,
                          free_bytes=local.free_bytes)


def plan_report(spec: KVCacheSpec, plan: PoolPlan) -> dict[str, Any]:
    """The spec's per-rank layout and the plan's breakdown in one flat dict (what ``--json`` prints)."""
    report = {
        "attention": spec.attention.value, "attention_label": spec.attention_label,
        "num_layers": spec.num_layers, "num_attention_heads": spec.num_attention_heads,
        "num_kv_heads": spec.num_kv_heads, "num_kv_heads_per_rank": spec.num_kv_heads_per_rank,
        "head_dim": spec.head_dim, "kv_dtype": str(spec.dtype).removeprefix("torch."),
        "kv_dtype_bytes": spec.dtype_bytes, "tp_size": spec.tp_size, "sliding_window": spec.sliding_window,
        **plan.to_dict(),
    }
    if plan.max_model_len is None:
        for key in _PER_REQUEST_KEYS:
            del report[key]
        for group in report["groups"]:
            del group["blocks_per_request"]
    return report


#: ``--json`` keys that exist only with ``--max-model-len``.
_PER_REQUEST_KEYS = ("max_model_len", "max_concurrency", "blocks_per_request", "bytes_per_request",
                     "all_full_bytes_per_request", "padding_bytes_per_request", "window_saving",
                     "all_full_max_concurrency")


def _layout_line(r: dict[str, Any]) -> str:
    """``GQA: 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 B (bfloat16), 32 query heads``: per rank."""
    tp = r["tp_size"]
    if r["attention"] == "mla":
        parts, rank = "1 latent", ", not split by tensor parallelism" if tp > 1 else ""
    else:
        per_rank = " per rank" if tp > 1 else ""
        parts = f"2 (K, V) x {plural(r['num_kv_heads_per_rank'], 'KV head')}{per_rank}"
        query = r["num_attention_heads"]
        split = "replicated" if r["num_kv_heads"] < tp else f"of {plural(r['num_kv_heads'], 'KV head')}"
        rank = (f", {plural(query, 'query head')}" if query is not None else "") + (
            f", tensor parallel {tp} ({split})" if tp > 1 else "")
    return (f"{r['attention_label']}: {plural(r['num_layers'], 'layer')} x {parts} x {r['head_dim']} x "
            f"{r['kv_dtype_bytes']} B ({r['kv_dtype']}){rank}")


def _human(r: dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"KV layout        {_layout_line(r)}",
        f"per token        {r['bytes_per_token']:,} B",
        f"per block        {r['bytes_per_block']:,} B ({r['block_size']} tokens)",
        f"device memory    {r['total_bytes']:,} B ({r['total_bytes'] / gib:.2f} GiB)",
        f"x utilization    {r['gpu_memory_utilization']} = {r['budget_bytes']:,} B",
        f"- non-KV memory  {r['non_kv_bytes']:,} B ({r['non_kv_bytes'] / gib:.2f} GiB)",
        f"= KV memory      {r['available_kv_bytes']:,} B ({r['available_kv_bytes'] / gib:.2f} GiB, "
        f"limited by {r['limited_by']})",
        f"blocks           {r['num_blocks']:,} ({r['kv_cache_bytes']:,} B)",
        f"tokens           {r['max_num_tokens']:,}",
        f"block hashes     {describe_hasher(r['hashing'])}",
    ]
    if r["free_bytes"] is not None:
        lines.insert(6, f"  free now       {r['free_bytes']:,} B")
    lines[3:3] = _group_lines(r)
    if "max_concurrency" in r:
        lines += _per_request_lines(r)
    return "\n".join(lines)


def _group_lines(r: dict[str, Any]) -> list[str]:
    """One line per KV cache group (kind, window, layers, padding, blocks per request)."""
    groups = r["groups"]
    padding = sum(g["num_padding_layers"] for g in groups)
    head = (f"KV cache groups  {plural(len(groups), 'group')} of "
            f"{plural(r['layers_per_block'], 'layer slot')} per block")
    head += f", {padding} of them padding" if padding else ""
    lines = [head]
    for g in groups:
        kind = g["kind"] + (f" (window {g['window']})" if g["kind"] == "sliding_attention" else
                            f" (chunk {g['window']})" if g["kind"] == "chunked_attention" else "")
        layers = f"{plural(g['num_layers'], 'layer')} {_layer_list(g['layers'])}"
        line = f"  group {g['index']:<8} {kind}, {layers}"
        if g["num_padding_layers"]:
            line += f" + {g['num_padding_layers']} padding"
        if "blocks_per_request" in g:
            line += f", {g['blocks_per_request']:,} blocks per request"
        lines.append(line)
    return lines


def _layer_list(layers: list[int]) -> str:
    shown = ",".join(map(str, layers[:6]))
    return f"[{shown}{',...' if len(layers) > 6 else ''}]"


def _per_request_lines(r: dict[str, Any]) -> list[str]:
    line = f"per request      {r['bytes_per_request']:,} B in {r['blocks_per_request']:,} blocks"
    if r["window_saving"]:
        line += (f" (every layer full: {r['all_full_bytes_per_request']:,} B; windows save "
                 f"{100 * r['window_saving']:.1f}%)")
    lines = [line]
    if r["padding_bytes_per_request"]:
        lines.append(f"  padding        {r['padding_bytes_per_request']:,} B per request")
    line = f"concurrency      {r['max_concurrency']:.2f} requests of {r['max_model_len']:,} tokens"
    line += f" (every layer full: {r['all_full_max_concurrency']:.2f})" if r["window_saving"] else ""
    lines.append(line)
    return lines

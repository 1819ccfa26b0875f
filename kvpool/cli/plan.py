"""``kvpool plan CONFIG``: how much KV cache a model gets on a GPU (per tensor-parallel rank).

CONFIG is a ``config.json``, a folder holding one, or a built-in name
(:data:`kvpool.spec.hf_config.BUILTIN_CONFIGS`).
Without ``--gpu-memory`` it reads the local CUDA device (its total, free and already-used memory) and adds
``--non-kv-memory`` (the model's weights and activations) to what is already in use. Each assumption that
changes the answer (no non-KV memory, the KV dtype ``auto`` picked, the step size of a windowed model) is
said in a ``note:`` line (``notes`` in ``--json``). A ``vs measured`` line (``measured_instead``) says how the
estimate differs from the pool ``kvpool generate --kv-memory auto`` sizes after the model's warm-up.

An attention / recurrent hybrid (Qwen3-Next, Nemotron-H, ...: :func:`kvpool.spec.state.is_recurrent_config`)
is planned over its attention layers only, and a ``recurrent state`` part follows: the state per request and
its KV-token equivalent and, with ``--max-model-len``, both ways the engines size state beside KV
(:mod:`kvpool.spec.state_planner`: vLLM's one pool, SGLang's two pools) in the same KV memory.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvpool.cli._args import (
    add_hash_arguments,
    add_json_argument,
    describe_hasher,
    fraction,
    hasher_from_args,
    memory_bytes,
    positive_int,
)
from kvpool.errors import ConfigError
from kvpool.spec import KVCacheSpec, auto_kv_dtype, parse_kv_dtype
from kvpool.spec.hf_config import BUILTIN_CONFIGS, model_dtype, model_type
from kvpool.spec.memory import ModelMemory
from kvpool.spec.planner import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    MemoryReadings,
    PoolPlan,
    plan_pool,
    profile_cuda_memory,
)
from kvpool.units import human_bytes, plural


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="how much KV cache a model gets on a GPU",
                                   description="How much KV cache a model gets on a GPU, per tensor-parallel "
                                               "rank.")
    parser.add_argument("config", metavar="CONFIG",
                        help=f"a Hugging Face config.json, a folder holding one, or a built-in config: "
                             f"{', '.join(BUILTIN_CONFIGS)}")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="B",
                        help="tokens per block (default: 16)")
    add_memory_arguments(parser, gpu_memory_default="read the local CUDA device")
    parser.add_argument("--max-model-len", type=positive_int, metavar="N",
                        help="longest request in tokens; reports how many fit at once")
    parser.add_argument("--max-num-batched-tokens", "--max-batched-tokens", dest="max_num_batched_tokens",
                        type=positive_int, metavar="N",
                        help=f"tokens one step computes (prefill chunks + decodes): sets the blocks a "
                             f"sliding or chunked layer group holds per request (default: "
                             f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, kvpool's engine; vLLM's is larger, x2 with "
                             f"async scheduling)")
    add_hash_arguments(parser)
    add_json_argument(parser)
    parser.set_defaults(func=run)


def add_memory_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                         gpu_memory_default: str) -> None:
    """The options that size a pool as ``kvpool plan`` does (read back by :func:`plan_from_args`)."""
    parser.add_argument("--tp-size", type=positive_int, default=1, metavar="N",
                        help="tensor-parallel ranks (default: 1)")
    parser.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                        help="auto (vLLM's rule: the config's 16-bit dtype; float32 or none -> bfloat16), "
                             "float16, bfloat16, float32, fp8, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--gpu-memory", type=memory_bytes, metavar="BYTES",
                        help=f"device memory per rank, e.g. 80GiB (default: {gpu_memory_default})")
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, metavar="F",
                        help="share of the device memory kvpool may plan with (default: 0.9)")
    parser.add_argument("--non-kv-memory", type=memory_bytes, default=0, metavar="BYTES",
                        help="weights, activations and workspace per rank, e.g. 16GiB (default: 0, "
                             "uncounted, said in a note)")


def memory_from_args(config: str | dict[str, Any], args: argparse.Namespace) -> ModelMemory:
    """The :class:`ModelMemory` of ``config`` at --tp-size, --kv-cache-dtype and --block-size: the one
    reading of the config a command makes."""
    return ModelMemory.from_config(config, tp_size=args.tp_size, kv_cache_dtype=args.kv_cache_dtype,
                                   block_size=args.block_size)


def plan_from_args(memory: ModelMemory, args: argparse.Namespace, *, max_model_len: int | None = None
                   ) -> tuple[KVCacheSpec, PoolPlan]:
    """The KV spec of ``memory`` (a recurrent hybrid's attention layers; ConfigError for a model without
    any) and its plan from the :func:`add_memory_arguments` options and (where the command has it)
    --max-num-batched-tokens."""
    spec = memory.require_kv()
    plan = plan_pool(spec, _readings(args), gpu_memory_utilization=args.gpu_memory_utilization,
                     max_model_len=max_model_len, max_num_batched_tokens=_step_tokens(args))
    return spec, plan


def run(args: argparse.Namespace) -> int:
    memory = memory_from_args(args.config, args)
    spec, plan = plan_from_args(memory, args, max_model_len=args.max_model_len)
    rule, dtype_note = kv_dtype_rule(memory.config, args.kv_cache_dtype)
    report = {**plan_report(spec, plan), "kv_dtype_rule": rule, "hashing": hasher_from_args(args).describe()}
    report.update(memory.state_kind.plan_entries(plan.available_kv_bytes, args.max_model_len))
    report["measured_instead"] = measured_instead(plan)
    report["notes"] = [note for note in (dtype_note, *_memory_notes(args, plan), _step_note(args, spec),
                                         _shape_note(report)) if note]
    print(json.dumps(report) if args.json else _human(report))
    return 0


def measured_instead(plan: PoolPlan) -> str:
    """How this estimate differs from what ``kvpool generate --kv-memory auto`` measures."""
    return (f"this estimate is total x utilization - non-KV ({human_bytes(plan.non_kv_bytes)}), every "
            "block held from the start; kvpool generate --kv-memory auto instead sizes an elastic pool after "
            "loading and warming up the model: the free memory measured then - max(1 GiB, 0.75 x the "
            "warm-up's transient peak), pages committed only as blocks are used")


def _step_tokens(args: argparse.Namespace) -> int:
    step = getattr(args, "max_num_batched_tokens", None)
    return DEFAULT_MAX_NUM_BATCHED_TOKENS if step is None else step


def kv_dtype_rule(config: dict[str, Any], kv_cache_dtype: str) -> tuple[str, str | None]:
    """How the KV dtype was chosen (``"auto: the config's bfloat16"``, ``"--kv-cache-dtype fp8"``), and a
    note when ``auto`` assumed or changed something (no dtype in the config, a cast) else None."""
    if str(kv_cache_dtype).lower() != "auto":
        return f"--kv-cache-dtype {kv_cache_dtype}", None
    named = model_dtype(config)
    dtype, rule = auto_kv_dtype(named, model_type(config))
    same = named is not None and parse_kv_dtype(named) is dtype
    note = None if same else (f"KV dtype {str(dtype).removeprefix('torch.')} assumed ({rule}); a GPU without "
                              f"bfloat16 (compute capability < 8.0) gets float16, the same size; give "
                              f"--kv-cache-dtype to choose")
    return f"auto: {rule}", note


def _memory_notes(args: argparse.Namespace, plan: PoolPlan) -> list[str]:
    """What the memory figures leave out: the model itself, when --non-kv-memory is 0."""
    if args.non_kv_memory:
        return []
    if args.gpu_memory is not None:
        return [f"non-KV memory 0 B: the model's weights, activations and workspace are not counted, so "
                f"the KV cache gets the whole {human_bytes(plan.budget_bytes)} budget; give --non-kv-memory "
                f"(the weights' size per rank plus a few GiB)"]
    return [f"non-KV memory is what the device uses now ({human_bytes(plan.non_kv_bytes)}); the model is not "
            f"loaded by this command: add its weights and activations with --non-kv-memory"]


def _step_note(args: argparse.Namespace, spec: KVCacheSpec) -> str | None:
    """The step size a windowed model's figures depend on, when it was not given."""
    if not spec.has_windows or getattr(args, "max_num_batched_tokens", None) is not None:
        return None
    return (f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} tokens per step assumed (kvpool's engine): a windowed group "
            f"holds its window plus one step of blocks per request; give --max-num-batched-tokens (vLLM's "
            f"max_num_batched_tokens, x2 with its async scheduling) to plan for another scheduler")


def _shape_note(report: dict[str, Any]) -> str | None:
    """How blocks of groups whose layers differ in bytes are sized, against vLLM's rule."""
    if len({g["layer_bytes_per_token"] for g in report["groups"]}) <= 1:
        return None
    return ("the groups' layers differ in bytes per token: every block has the same bytes, a group of "
            "smaller layers holding more layer slots (one block size for every group); vLLM keeps the "
            "layers per group and grows the smaller pages' block_size instead "
            "(unify_kv_cache_spec_page_size)")


def _readings(args: argparse.Namespace) -> MemoryReadings:
    if args.gpu_memory is not None:  # given: no device read, no torch imported
        return MemoryReadings(total_bytes=args.gpu_memory, non_kv_bytes=args.non_kv_memory)
    import torch  # only to read the device: importing this module imports no torch

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
        "head_dim": spec.head_dim, "kv_dtype": spec.dtype_name,
        "kv_dtype_bytes": spec.dtype_bytes, "tp_size": spec.tp_size, "sliding_window": spec.sliding_window,
        "num_groups": len(spec.groups), "num_kv_layers": spec.num_kv_layers,
        "layer_shapes": _layer_shapes(spec), **plan.to_dict(),
    }
    if plan.max_model_len is None:
        for key in _PER_REQUEST_KEYS:
            del report[key]
        for group in report["groups"]:
            del group["blocks_per_request"]
    return report


def _layer_shapes(spec: KVCacheSpec) -> list[dict[str, Any]]:
    """The distinct K/V shapes of the KV-owning layers per rank, in layer order: ``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``v_head_dim`` and ``bytes_per_token`` (one layer's)."""
    shapes: dict[Any, dict[str, Any]] = {}
    for layer in range(spec.num_layers):
        if spec.kv_source(layer) != layer:
            continue
        shape = spec.layer_shape(layer)
        entry = shapes.setdefault(shape, {"num_layers": 0, "num_kv_heads": shape.num_kv_heads,
                                          "head_dim": shape.head_dim, "v_head_dim": shape.v_head_dim,
                                          "bytes_per_token": spec.layer_bytes_per_token(layer)})
        entry["num_layers"] += 1
    return list(shapes.values())


#: ``--json`` keys that exist only with ``--max-model-len``.
_PER_REQUEST_KEYS = ("max_model_len", "max_concurrency", "context_tokens", "blocks_per_request",
                     "bytes_per_request", "all_full_bytes_per_request", "padding_bytes_per_request",
                     "window_saving", "all_full_max_concurrency")


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
    shapes = r["layer_shapes"]
    shared = r["num_layers"] - r["num_kv_layers"]
    reuse = f" ({shared} more reuse another layer's KV)" if shared else ""
    if r["attention"] != "mla" and (len(shapes) > 1 or shapes[0]["head_dim"] != shapes[0]["v_head_dim"]):
        per_rank = " per rank" if tp > 1 else ""
        parts = " + ".join(
            f"{sh['num_layers']} x {plural(sh['num_kv_heads'], 'KV head')}{per_rank} x "
            + (f"2 (K, V) x {sh['head_dim']}" if sh["head_dim"] == sh["v_head_dim"]
               else f"({sh['head_dim']} K + {sh['v_head_dim']} V)") for sh in shapes)
        return (f"{r['attention_label']}: {plural(r['num_kv_layers'], 'layer')}{reuse}: {parts} x "
                f"{r['kv_dtype_bytes']} B ({r['kv_dtype']}){rank}")
    return (f"{r['attention_label']}: {plural(r['num_kv_layers'], 'layer')}{reuse} x {parts} x "
            f"{r['head_dim']} x {r['kv_dtype_bytes']} B ({r['kv_dtype']}){rank}")


def _human(r: dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"KV layout        {_layout_line(r)}",
        f"KV dtype         {r['kv_dtype']} ({r['kv_dtype_rule']})",
        f"per token        {r['bytes_per_token']:,} B",
        f"per block        {r['bytes_per_block']:,} B ({_block_words(r)})",
        f"device memory    {r['total_bytes']:,} B ({r['total_bytes'] / gib:.2f} GiB)",
        f"x utilization    {r['gpu_memory_utilization']} = {r['budget_bytes']:,} B",
        f"- non-KV memory  {r['non_kv_bytes']:,} B ({r['non_kv_bytes'] / gib:.2f} GiB)",
        f"= KV memory      {r['available_kv_bytes']:,} B ({r['available_kv_bytes'] / gib:.2f} GiB, "
        f"limited by {r['limited_by']})",
        f"blocks           {r['num_blocks']:,} ({r['kv_cache_bytes']:,} B)"
        + (", block 0 the null block (no KV)" if r["num_null_blocks"] else ""),
        *_token_lines(r),
        f"block hashes     {describe_hasher(r['hashing'])}",
        f"vs measured      {r['measured_instead']}",
    ]
    if r["free_bytes"] is not None:
        lines.insert(7, f"  free now       {r['free_bytes']:,} B")
    lines[4:4] = _group_lines(r)
    if "max_concurrency" in r:
        lines += _per_request_lines(r)
    if "recurrent_state" in r:
        lines += _state_lines(r["recurrent_state"])
    return "\n".join(lines + [f"note: {note}" for note in r["notes"]])


def _state_lines(s: dict[str, Any]) -> list[str]:
    """The recurrent part: layers, shapes and bytes per request; with --max-model-len both sizings."""
    ssm = f", ssm {s['ssm_shape']} {s['ssm_dtype']}" if s["ssm_shape"] else ""
    lines = [f"recurrent state  {plural(s['num_layers'], s['kind'] + ' layer')} "
             f"{_layer_list(s['layers'])} beside {plural(len(s['attention_layers']), 'attention layer')}: "
             f"conv {s['conv_shape']} {s['conv_dtype']}{ssm}",
             f"  per request    {s['bytes_per_request']:,} B ({human_bytes(s['bytes_per_request'])}, "
             f"{s['bytes_per_layer']:,} B per layer) = the KV of {s['kv_token_equivalent']:,.0f} tokens"]
    if "sizing" in s:
        lines.append("  the figures above are KV only; state and KV in the same KV memory, both ways:")
        lines += [f"  {line}" for line in s["sizing"]]
    else:
        lines.append("  (give --max-model-len for vLLM's one pool and SGLang's two pools)")
    return lines


def _block_words(r: dict[str, Any]) -> str:
    """``16 tokens``; for several groups ``16 tokens x 10 layer slots: one KV cache group's block``."""
    if r["num_groups"] == 1:
        return f"{r['block_size']} tokens"
    if len(r["layer_shapes"]) > 1:
        return f"{r['block_size']} tokens x one KV cache group's layer slots, the same bytes in every group"
    return f"{r['block_size']} tokens x {r['layers_per_block']} layer slots: one KV cache group's block"


def _token_lines(r: dict[str, Any]) -> list[str]:
    """``tokens N``; with several groups the token slots (over all groups) and the tokens of each."""
    if r["num_groups"] == 1:
        return [f"tokens           {r['max_num_tokens']:,}"]
    n, b = r["num_groups"], r["block_size"]
    return [f"token slots      {r['max_num_tokens']:,} ({r['num_blocks']:,} blocks x {b}, over {n} KV cache "
            f"groups: a token takes a slot in each)",
            f"tokens           {r['tokens_per_group']:,} per group, the blocks split evenly "
            f"({r['num_blocks']:,} // {n} groups x {b}: vLLM 0.19's \"GPU KV cache size\")"]


def _group_lines(r: dict[str, Any]) -> list[str]:
    """One line per KV cache group (kind, window, layers, padding, blocks per request)."""
    groups = r["groups"]
    padding = sum(g["num_padding_layers"] for g in groups)
    shaped = len(r["layer_shapes"]) > 1
    slots = (f"{plural(r['layers_per_block'], 'layer slot')} per block" if not shaped else
             f"{r['bytes_per_block']:,} B per block, the layer slots sized per group")
    head = f"KV cache groups  {plural(len(groups), 'group')} of {slots}"
    head += f", {padding} of them padding" if padding else ""
    lines = [head]
    for g in groups:
        kind = g["kind"] + (f" (window {g['window']})" if g["kind"] == "sliding_attention" else
                            f" (chunk {g['window']})" if g["kind"] == "chunked_attention" else "")
        layers = f"{plural(g['num_layers'], 'layer')} {_layer_list(g['layers'])}"
        line = f"  group {g['index']:<8} {kind}, {layers}"
        if shaped:
            dims = (f"{g['head_dim']}" if g["head_dim"] == g["v_head_dim"] else
                    f"{g['head_dim']} K + {g['v_head_dim']} V")
            line += f" of {plural(g['num_kv_heads'], 'KV head')} x {dims} in {g['slots']} slots"
        if g["num_padding_layers"]:
            line += f" + {g['num_padding_layers']} padding"
            if shaped:
                line += f" ({g['padding_bytes_per_block']:,} B per block)"
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
    if r["num_null_blocks"] or r["num_groups"] > 1:  # a uniform model's context is its tokens
        lines.append(f"context          {r['context_tokens']:,} tokens (concurrency x max_model_len, at "
                     f"{r['max_num_batched_tokens']:,} tokens per step: vLLM 0.33's \"GPU KV cache size\")")
    return lines

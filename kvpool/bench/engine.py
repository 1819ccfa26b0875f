"""``kvpool bench engine``: tokens/s of the kvpool engine against transformers' own paged continuous batching
(``generate_batch``) and padded ``generate``: same model, same prompts (``kvpool generate``'s built-in four),
same greedy settings (EOS ignored, so every run makes prompts x max_new_tokens tokens), one run each.

transformers' peer uses the settings DESIGN.md names for CPU: ``ContinuousBatchingConfig(page_size=16,
num_blocks=64, max_batch_tokens=256, auto_switch_to_flash=False, use_cuda_graph=False)``; kvpool runs with
the same blocks of 16 tokens and 256 tokens per step. ``--num-blocks`` sets both pools; by default 64, or
what the longest prompt needs when that is more (``ceil((prompt + max_new_tokens - 1) / 16)``: the tiny
models' byte tokenizer makes the built-in prompts ~1,200 tokens, 79 blocks with 32 new tokens).

kvpool runs twice: ``attention="gather"`` (the default: each context gathered out of the pool, then SDPA)
and ``attention="paged"`` (the in-place kernel of :mod:`kvpool.engine.paged_attention`; its one-time build
happens before the timing). ``--rounds N`` runs every method N times, alternated (one of each, then the next
round), and reports each method's median.

Threads: torch runs on 1 CPU thread by default (``--threads``, as every command). On a 2-core machine
shared with other work, two intra-op threads make every parallel op wait for the busy core; transformers'
``generate_batch`` steps in a background thread and suffers less from it than the main-thread loops of
kvpool and padded ``generate``, so a multi-threaded run there measures the machine's load more than the
engines.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from kvpool.bench.timing import print_table, require_at_least
from kvpool.errors import ConfigError
from kvpool.units import plural

NUM_BLOCKS, BLOCK_SIZE, BATCH_TOKENS = 64, 16, 256  # the peer's CPU settings (DESIGN.md)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", metavar="NAME",
                        help="smollm2 (default), tiny-llama, ... or a folder")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens per prompt")
    parser.add_argument("--num-blocks", type=int, default=None, metavar="N",
                        help=f"KV blocks of {BLOCK_SIZE} tokens for kvpool and generate_batch (default: "
                             f"{NUM_BLOCKS}, or what the longest prompt needs)")
    parser.add_argument("--skip-padded", action="store_true", help="skip padded generate (the slowest)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="runs of every method, alternated; each method's median is reported")
    parser.add_argument("--tp-size", type=int, default=1, metavar="N",
                        help="also run kvpool on N tensor-parallel ranks (processes) and compare with 1")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvpool.engine.models import DEFAULT_PROMPTS, load_model

    require_at_least(args, {"max_new_tokens": 1, "tp_size": 1, "rounds": 1})
    if args.num_blocks is not None:
        require_at_least(args, {"num_blocks": 1})
    if args.tp_size > 1:  # before loading anything
        from kvpool.engine.models import load_config
        from kvpool.engine.sharding import check_shardable

        check_shardable(load_config(args.model), args.tp_size)
    loaded = load_model(args.model)
    prompts = [loaded.encode(text) for text in DEFAULT_PROMPTS]
    num_blocks = pool_blocks(prompts, args.max_new_tokens, args.num_blocks)
    from kvpool.engine.paged_attention import load_paged_kernel

    load_paged_kernel()  # its one-time build is not timed
    runners: dict[str, Callable[[Any, list[list[int]], int, int], list[list[int]]]] = {
        "kvpool generate": _kvpool, "kvpool generate, attention=paged": _kvpool_paged,
        "transformers generate_batch": _generate_batch}
    if not args.skip_padded:
        runners["transformers padded generate"] = _padded
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, fn in runners.items():
            runs[name].append(_timed(fn, loaded.model, prompts, args.max_new_tokens, num_blocks))
    results = {name: sorted(r, key=lambda x: x["seconds"])[(len(r) - 1) // 2] for name, r in runs.items()}
    tp = _tensor_parallel(args, prompts, num_blocks, results) if args.tp_size > 1 else None
    base, ours = results["transformers generate_batch"]["seconds"], results["kvpool generate"]["tokens"]
    for result in results.values():
        result["speedup_vs_generate_batch"] = base / result["seconds"]
        result["same_tokens_as_kvpool"] = result.pop("tokens") == ours
    out = {"model": args.model, "rounds": args.rounds, "prompts": len(prompts),
           "prompt_tokens": [len(p) for p in prompts],
           "max_new_tokens": args.max_new_tokens, "num_blocks": num_blocks, "block_size": BLOCK_SIZE,
           "threads": torch.get_num_threads(), "results": results}
    if tp is not None:
        out["tensor_parallel"] = tp
    if not args.json:
        rows = [(name, r["seconds"], r["tokens_per_s"], r["speedup_vs_generate_batch"],
                 r["same_tokens_as_kvpool"]) for name, r in results.items()]
        runs_note = "one run" if args.rounds == 1 else f"median of {args.rounds} alternated runs"
        title = (f"engine: {args.model}, {len(prompts)} prompts x {args.max_new_tokens} greedy tokens, "
                 f"{runs_note}")
        print_table(title, ["method", "seconds", "tokens/s", "x generate_batch", "same tokens"], rows)
        if tp is not None:
            _print_tp(tp)
    return out


def _tensor_parallel(args: argparse.Namespace, prompts: list[list[int]], num_blocks: int,
                     results: dict[str, Any]) -> dict[str, Any]:
    """kvpool on ``--tp-size`` ranks (the time of rank 0's generate, after loading), into ``results``; the
    ratio to one process and where shipping each step's decisions costs time (microseconds)."""
    from kvpool.engine.launch import launch

    tokens, seconds, ship = launch(_tp_rank, args.tp_size, args.model, prompts, args.max_new_tokens,
                                   num_blocks, torch.get_num_threads())
    generated = sum(len(t) for t in tokens)
    name = f"kvpool generate, TP {args.tp_size}"
    results[name] = {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
                     "tokens": tokens}
    return {"tp_size": args.tp_size, "vs_tp1": results["kvpool generate"]["seconds"] / seconds, **ship}


def _tp_rank(tp: Any, model_name: str, prompts: list[list[int]], max_new_tokens: int, num_blocks: int,
             threads: int) -> tuple[list[list[int]], float, dict[str, Any]] | None:
    from kvpool.engine.distributed import run_engine
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.models import load_model
    from kvpool.engine.sampling import SamplingParams
    from kvpool.engine.sharding import shard_model

    torch.set_num_threads(threads)
    model = shard_model(load_model(model_name, device=tp.device).model, tp.rank, tp.size, tp.all_reduce)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)

    def lead(engine: Any) -> tuple[list[list[int]], float]:
        start = time.perf_counter()
        tokens = [req.output_token_ids for req in engine.generate(prompts, params)]
        return tokens, time.perf_counter() - start

    engine = LLMEngine(model, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                       max_num_batched_tokens=BATCH_TOKENS, tp_size=tp.size)
    done = run_engine(tp, engine, lead, transport_rounds=50)
    if done is None:
        return None
    (tokens, seconds), ship = done
    return tokens, seconds, ship.to_dict()


def _print_tp(tp: dict[str, Any]) -> None:
    print(f"tensor parallel: {tp['tp_size']} ranks run at {tp['vs_tp1']:.2f}x the speed of 1 process; "
          f"per step ({tp['steps']} steps) rank 0 encodes its decisions in {tp['encode_us_per_step']:.0f} us "
          f"and sends them in {tp['send_us_per_step']:.0f} us (waiting for busy followers included), the "
          f"followers apply them in {tp['apply_us_per_step']:.0f} us; one step's message with every rank "
          f"idle: {tp['transport_us']:.0f} us")


def pool_blocks(prompts: list[list[int]], max_new_tokens: int, num_blocks: int | None) -> int:
    """``num_blocks`` when given (ConfigError when the longest prompt cannot fit it), else the default 64
    or the blocks the longest prompt needs: ``ceil((prompt + max_new_tokens - 1) / BLOCK_SIZE)``."""
    need = -(-(max(map(len, prompts)) + max_new_tokens - 1) // BLOCK_SIZE)
    if num_blocks is None:
        return max(NUM_BLOCKS, need)
    if num_blocks < need:
        raise ConfigError(f"--num-blocks {num_blocks} cannot hold the longest prompt with "
                          f"{plural(max_new_tokens, 'new token')}: it needs {plural(need, 'block')} of "
                          f"{BLOCK_SIZE} tokens")
    return num_blocks


def _timed(fn: Callable[[Any, list[list[int]], int, int], list[list[int]]], model: Any,
           prompts: list[list[int]], max_new_tokens: int, num_blocks: int) -> dict[str, Any]:
    start = time.perf_counter()
    tokens = fn(model, prompts, max_new_tokens, num_blocks)
    seconds = time.perf_counter() - start
    generated = sum(len(t) for t in tokens)
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "tokens": tokens}


def _kvpool(model: Any, prompts: list[list[int]], max_new_tokens: int, num_blocks: int,
            attention: str = "gather") -> list[list[int]]:
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sampling import SamplingParams

    engine = LLMEngine(model, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                       max_num_batched_tokens=BATCH_TOKENS, attention=attention)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [req.output_token_ids for req in engine.generate(prompts, params)]


def _kvpool_paged(model: Any, prompts: list[list[int]], max_new_tokens: int, num_blocks: int
                  ) -> list[list[int]]:
    return _kvpool(model, prompts, max_new_tokens, num_blocks, attention="paged")


def _greedy_config(model: Any, max_new_tokens: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=model.generation_config.pad_token_id or 0)


def _generate_batch(model: Any, prompts: list[list[int]], max_new_tokens: int, num_blocks: int
                    ) -> list[list[int]]:
    from transformers import ContinuousBatchingConfig

    model.set_attn_implementation("sdpa")
    config = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=num_blocks,
                                      max_batch_tokens=BATCH_TOKENS, auto_switch_to_flash=False,
                                      use_cuda_graph=False)
    greedy = _greedy_config(model, max_new_tokens)
    greedy.eos_token_id = -1  # EOS ignored, as generate_batch says it (given None, it warns and sets -1)
    outputs = model.generate_batch(prompts, greedy, continuous_batching_config=config)
    ordered = sorted(outputs.values(), key=lambda out: _request_index(out.request_id))
    return [out.generated_tokens for out in ordered]


def _request_index(request_id: str) -> int:
    return int("".join(ch for ch in request_id if ch.isdigit()) or 0)


@torch.inference_mode()
def _padded(model: Any, prompts: list[list[int]], max_new_tokens: int, num_blocks: int) -> list[list[int]]:
    del num_blocks  # padded generate keeps its own DynamicCache
    model.set_attn_implementation("sdpa")
    config = _greedy_config(model, max_new_tokens)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[config.pad_token_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, generation_config=config)
    return out[:, width:].tolist()

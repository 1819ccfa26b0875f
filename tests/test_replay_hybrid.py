"""Trace replay per KV cache group: blocks in use by hand on a small case, the per-group hit rule, and
``kvpool replay --model-config`` with a hybrid config against the same memory all full."""

import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.spec import KVCacheSpec, LayerKind, kv_cache_groups
from kvpool.trace.loaders import TraceRequest, load_trace
from kvpool.trace.replay import ReplayConfig, request_blocks, run_replay

CONFIGS = Path(__file__).parent / "configs"
S, F = LayerKind.SLIDING, LayerKind.FULL
GROUPS = kv_cache_groups([S, F], {S: 8}, 4)  # B 4: a sliding group (W 8) and a full group


def config(**kwargs) -> ReplayConfig:
    # every token a second: prefill of n uncached tokens takes n s, each decode step 1 s
    return ReplayConfig(block_size=4, groups=GROUPS, step_s=0, prefill_token_s=1, decode_token_s=1, **kwargs)


def test_blocks_in_use_by_hand():
    # 16 prompt tokens (4 blocks per group), 8 output tokens (the prefill samples the first, 7 decode steps
    # compute positions 16-22), instant timing: the prefill holds 4 + 4 = 8 blocks for 16 s. Before position
    # 16 the window frees the sliding blocks before (16 - 8 + 1) // 4 = 2 (6 left) and position 16 starts
    # block 4 in both groups: 8 blocks for positions 16-18; before 19 the window frees block 2
    # ((19 - 7) // 4 = 3): 7 blocks; position 20 starts block 5 in both: 9 blocks for positions 20-22
    request = TraceRequest(0.0, 16, 8, hash_ids=(1,))
    result = run_replay([request], config(timing="instant"))
    assert result.peak_blocks_used == 9
    assert result.mean_blocks_used == pytest.approx((8 * 16 + 8 * 3 + 7 + 9 * 3) / 23)
    assert (result.requests_completed, result.prompt_blocks, result.hit_blocks) == (1, 4, 0)


def test_second_request_hits_every_group():
    # the same 16-token prompt twice: the second may hit the blocks of its first 15 tokens, 3 of them, and
    # restores all 3 in both groups (full: 0..2; sliding: the blocks of the last 7 tokens before token 12,
    # 1 and 2, still cached after the first request freed them)
    requests = [TraceRequest(0.0, 16, 8, hash_ids=(1,)), TraceRequest(100.0, 16, 8, hash_ids=(1,))]
    for timing in ("instant", "trace"):
        result = run_replay(requests, config(timing=timing))
        assert (result.hit_blocks, result.prompt_blocks, result.block_hit_ratio) == (3, 8, 0.375)


def test_trace_timing_preempts_and_finishes_everything():
    # 6 requests of 64 + 400 tokens at once, B 16, W 32: each ends holding cdiv(464, 16) = 29 full blocks
    # and at most cdiv(31, 16) + 1 = 3 sliding ones: 6 x 32 > the 99 usable blocks, so decoding preempts
    groups = kv_cache_groups([S, F], {S: 32}, 16)
    requests = [TraceRequest(0.0, 64, 400, hash_ids=(i,)) for i in range(6)]
    result = run_replay(requests, ReplayConfig(block_size=16, groups=groups, timing="trace", num_blocks=100))
    assert result.requests_completed == 6 and result.preemptions > 0
    assert result.peak_blocks_used <= 99


def test_cli_hybrid_against_all_full(capsys):
    code = main(["replay", "--max-requests", "50", "--model-config", str(CONFIGS / "gpt-oss-20b.json"),
                 "--gpu-memory", "80GiB", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    # bfloat16 (gpt-oss names no dtype: vLLM's auto casts its float32 default down): a group block is
    # 12 x 2 x 8 x 64 x 2 x 16 = 393216 B, floor(80 GiB x 0.9) = 77309411328 B holds 196608 of them; all
    # full a block is 24 layers: 786432 B, 98304 blocks
    assert (report["kv_cache_groups"], report["bytes_per_block"], report["num_blocks"]) == (2, 393216, 196608)
    assert (report["all_full"]["bytes_per_block"], report["all_full"]["num_blocks"]) == (786432, 98304)
    assert report["mean_bytes_used"] == round(report["mean_blocks_used"] * 393216)
    assert 0 < report["mean_memory_saving"] < 0.5  # the 12 full layers save nothing
    assert report["mean_bytes_used"] < report["all_full"]["mean_bytes_used"]


# ---- every capability on a hybrid model -------------------------------------------------------------------

@pytest.mark.parametrize("config_name", [pytest.param("gemma-3-27b-it.json", marks=pytest.mark.slow),
                                         "gpt-oss-20b.json"])
def test_unbounded_host_tier_under_a_hybrid_pool_hits_as_an_unbounded_pool(config_name: str) -> None:
    """Every block a hybrid pool publishes stays on the device or goes down to an unbounded host tier, so
    the chain hits exactly what an unbounded device pool hits (instant timing: one request at a time)."""
    from kvpool.spec import KVCacheSpec
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier
    from kvpool.trace.loaders import load_trace
    from kvpool.trace.replay import request_blocks, unbounded_num_blocks

    requests = load_trace(None, None, max_requests=200).requests
    groups = KVCacheSpec.from_hf_config(CONFIGS / config_name, block_size=16).groups
    unbounded = ReplayConfig(block_size=16, groups=groups)
    oracle = run_replay(requests, unbounded)
    device = max(request_blocks(r, unbounded) for r in requests)  # the largest request alone
    host = HostTier(unbounded_num_blocks(requests, unbounded), Namespace("t", "none", "hash-only"))
    tiered = run_replay(requests, ReplayConfig(block_size=16, groups=groups, num_blocks=device), tiers=[host])
    alone = run_replay(requests, ReplayConfig(block_size=16, groups=groups, num_blocks=device))
    assert len(groups) > 1 and oracle.evictions == 0 and tiered.requests_rejected == 0
    assert tiered.hit_blocks == oracle.hit_blocks > alone.hit_blocks
    assert tiered.tier_hits["host"] > 0 and sum(tiered.tier_hits.values()) == tiered.hit_blocks


@pytest.mark.slow
def test_cli_hybrid_takes_policies_pins_tiers_sweeps_and_the_report(tmp_path, redis_single, capsys,
                                                                    monkeypatch):
    """kvpool replay --model-config of a hybrid config with every option that once needed a uniform model
    (gpt-oss-20b: a sliding and a full group; 2 GiB of KV)."""
    monkeypatch.setenv("KVPOOL_TIER_KEY", "kvpool tests: a tier key")  # disk and Redis values are signed
    gpt_oss = str(CONFIGS / "gpt-oss-20b.json")
    base = ["--max-requests", "200", "--model-config", gpt_oss, "--json", "--no-progress"]
    # the host tier holds every block the device evicts (no disk file written: files cost ~1 ms each here)
    code = main(["replay", *base, "--gpu-memory", "80GiB", "--non-kv-memory", "70GiB", "--policy", "arc",
                 "--pin-prefix", "0", "--host-blocks", "100000", "--disk-dir", str(tmp_path / "d"),
                 "--disk-blocks", "20000", "--remote", redis_single.url])
    one = json.loads(capsys.readouterr().out)
    assert code == 0 and one["policy"] == "arc" and one["pinned_blocks"] > 0 and one["kv_cache_groups"] == 2
    assert set(one["tier_hits"]) == {"device", "host", "disk", "remote"} and one["tier_hits"]["host"] > 0
    report = tmp_path / "r.html"
    code = main(["replay", *base, "--sweep", "1000,3000", "--policies", "lru,lfu", "--no-bound",
                 "--host-blocks", "20000", "--report", str(report)])
    sweep = json.loads(capsys.readouterr().out)
    assert code == 0 and len(sweep["runs"]) == 4 and report.stat().st_size > 10_000
    assert {r["num_blocks"] for r in sweep["runs"]} == {1000, 3000}
    assert all(r["tier_hits"]["host"] > 0 for r in sweep["runs"] if r["num_blocks"] == 1000)


def test_cli_hybrid_compares_memory_over_the_requests_both_pools_serve(capsys):
    # 20 GiB x 0.9 of KV for Gemma-3-27B: the per-group pool and the all-full pool reject different long
    # requests, so the memory saving is over the requests both serve, each side replayed on them alone
    # (before, each side averaged over its own requests and the saving could turn negative); the hit
    # ratios are over every request's prompt, the rejected ones as misses, on both sides
    path = str(CONFIGS / "gemma-3-27b-it.json")
    code = main(["replay", "--max-requests", "200", "--model-config", path, "--gpu-memory", "80GiB",
                 "--non-kv-memory", "60GiB", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    requests = load_trace(max_requests=200).requests
    spec = KVCacheSpec.from_hf_config(path, block_size=16)
    mine = ReplayConfig(groups=spec.groups, num_blocks=report["num_blocks"])
    theirs = ReplayConfig(num_blocks=report["all_full"]["num_blocks"])
    served = [[request_blocks(r, c) <= c.num_blocks for r in requests] for c in (mine, theirs)]
    assert served[0] != served[1] and report["requests_rejected"] == served[0].count(False)
    both = [r for r, a, b in zip(requests, *served, strict=True) if a and b]
    assert report["memory_compared_requests"] == len(both)
    mean = run_replay(both, mine).mean_blocks_used * spec.bytes_per_block
    full_mean = run_replay(both, theirs).mean_blocks_used * spec.bytes_per_token * 16
    assert report["mean_memory_saving"] == pytest.approx(1 - mean / full_mean)
    assert report["mean_memory_saving"] > 0
    assert report["prompt_blocks"] == sum(r.input_tokens // 16 for r in requests)
    assert report["all_full"]["requests_rejected"] == served[1].count(False)


def test_a_hybrid_sweep_prints_its_groups_as_json(capsys) -> None:
    """A sweep's --json names each group by kind and window (gpt-oss-20b's config: sliding_window 128 on the
    even layers, full attention on the odd ones); the kind's rule object is not part of the output."""
    gpt_oss = str(CONFIGS / "gpt-oss-20b.json")
    assert main(["replay", "--max-requests", "20", "--model-config", gpt_oss, "--json", "--no-progress",
                 "--sweep", "1000,3000", "--no-bound"]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    assert [(g["kind"], g["window"], g["layers"][:2]) for g in groups] == [
        ("sliding_attention", 128, [0, 2]), ("full_attention", None, [1, 3])]
    assert all("memory_kind" not in g for g in groups)

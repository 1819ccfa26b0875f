"""Trace replay per KV cache group: blocks in use by hand on a small case, the per-group hit rule, and
``kvpool replay --model-config`` with a hybrid config against the same memory all full."""

import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.spec import LayerKind, kv_cache_groups
from kvpool.trace.loaders import TraceRequest
from kvpool.trace.replay import ReplayConfig, run_replay

CONFIGS = Path(__file__).parent / "configs"
S, F = LayerKind.SLIDING, LayerKind.FULL
GROUPS = kv_cache_groups([S, F], {S: 8}, 4)  # B 4: a sliding group (W 8) and a full group


def config(**kwargs) -> ReplayConfig:
    # every token a second: prefill of n uncached tokens takes n s, each decode step 1 s
    return ReplayConfig(block_size=4, groups=GROUPS, step_s=0, prefill_token_s=1, decode_token_s=1, **kwargs)


def test_blocks_in_use_by_hand():
    # 16 prompt tokens (4 blocks per group), 8 output tokens, instant timing:
    # prefill holds 4 + 4 = 8 blocks for 16 s; publishing frees sliding blocks before (16 - 8 + 1) // 4 = 2
    # (6 left); token 16 starts block 4: 1 + 1 new = 8 blocks for 4 steps; token 20 starts block 5: the
    # window frees 1 more ((20 - 7) // 4 = 3), 2 new: 9 blocks for 4 steps
    request = TraceRequest(0.0, 16, 8, hash_ids=(1,))
    result = run_replay([request], config(timing="instant"))
    assert result.peak_blocks_used == 9
    assert result.mean_blocks_used == pytest.approx((8 * 16 + 8 * 4 + 9 * 4) / 24)
    assert (result.requests_completed, result.prompt_blocks, result.hit_blocks) == (1, 4, 0)


def test_second_request_hits_every_group():
    # the same 16-token prompt twice: the second restores all 4 blocks (full: 0..3; sliding: the blocks of
    # the last 7 tokens before token 16, 2 and 3, still cached after the first freed them)
    requests = [TraceRequest(0.0, 16, 8, hash_ids=(1,)), TraceRequest(100.0, 16, 8, hash_ids=(1,))]
    for timing in ("instant", "trace"):
        result = run_replay(requests, config(timing=timing))
        assert (result.hit_blocks, result.prompt_blocks, result.block_hit_ratio) == (4, 8, 0.5)


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

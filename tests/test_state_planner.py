"""vLLM's one pool and SGLang's two pools for hybrids, checked by hand arithmetic written out here.

vLLM (model_executor/models/config.py, HybridAttentionMambaModelConfig): block = 16 x cdiv(state page,
16 x attention page per token) for MHA (64 for MLA), the state page padded to block x attention page per
token; groups of the uniform-page rule; a request holds cdiv(tokens, block) attention blocks and one block
per state group; block 0 is the null block. SGLang (model_runner_kv_cache_mixin.py): state memory =
M x 0.9 / 1.9, slots = that // state per request, KV tokens = the rest // KV per token, running requests
<= slots // 3 and <= min(max(tokens / context x 512, 2048), 4096).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.errors import ConfigError, InsufficientMemoryError
from kvpool.spec.state import HybridSpec
from kvpool.spec.state_planner import group_size, plan_single_pool, plan_state_memory, plan_two_pools

HYBRID = Path(__file__).parent / "configs" / "hybrid"
GiB = 2**30


def spec(name: str, **kwargs) -> HybridSpec:
    return HybridSpec.from_hf_config(HYBRID / f"{name}.json", **kwargs)


def test_qwen3_next_single_pool() -> None:
    plan = plan_single_pool(spec("qwen3-next-80b-a3b-instruct"), 40 * GiB)
    state_page = (8192 * 3 + 32 * 128 * 128) * 2  # 1,097,728 B per layer per request
    per_token = 2 * 2 * 256 * 2  # one attention layer: 2,048 B per token
    assert plan.state_page_bytes == state_page
    assert plan.block_size == 16 * -(-state_page // (16 * per_token)) == 544  # 33.5 pages of 16 -> 34
    assert plan.attn_page_bytes == 544 * 2048 == 1_114_112
    assert plan.padding_bytes == 1_114_112 - 1_097_728 == 16_384  # 1.49%
    # 12 attention, 36 recurrent layers: groups of 12 -> 1 attention + 3 state groups
    assert (plan.group_size, plan.attention_groups, plan.state_groups) == (12, 1, 3)
    assert plan.block_bytes == 12 * 1_114_112
    assert plan.num_blocks == 40 * GiB // (12 * 1_114_112) == 3212
    # 32K tokens: cdiv(32768, 544) = 61 attention blocks + 3 state blocks; (3212 - 1) // 64 = 50
    assert plan.blocks_per_request(32768) == 61 + 3
    assert plan.max_requests(32768) == 3211 // 64 == 50


def test_jamba_and_kimi_single_pool() -> None:
    jamba = plan_single_pool(spec("jamba-v0.1"), 40 * GiB)
    # state page (8192 x 3 + 8192 x 16) x 2 = 311,296; per token 2 x 8 x 128 x 2 = 4,096: 16 x cdiv(4.75) = 80
    assert (jamba.state_page_bytes, jamba.block_size, jamba.attn_page_bytes) == (311_296, 80, 327_680)
    assert (jamba.group_size, jamba.attention_groups, jamba.state_groups) == (4, 1, 7)  # 4 attn, 28 mamba
    # MLA aligns to 64: state (12288 x 3 + 32 x 128 x 128) x 2 = 1,122,304; latent 576 x 2 = 1,152 per token
    kimi = plan_single_pool(spec("kimi-linear-48b-a3b-instruct"), 40 * GiB)
    assert kimi.block_size == 64 * -(-1_122_304 // (64 * 1_152)) == 1024
    assert (kimi.group_size, kimi.attention_groups, kimi.state_groups) == (7, 1, 3)  # 20 KDA: 1 padding slot


def test_block_size_the_user_sets() -> None:
    qwen = spec("qwen3-next-80b-a3b-instruct")
    assert plan_single_pool(qwen, 40 * GiB, block_size=16).block_size == 544  # too small: grown
    big = plan_single_pool(qwen, 40 * GiB, block_size=1024)
    assert big.block_size == 1024 and big.padding_bytes == 1024 * 2048 - 1_097_728


def test_prefix_caching_align_mode() -> None:
    # Granite 4.0-H-Micro: state (4352 x 3 + 64 x 64 x 128) x 2 = 1,074,688; 2 x 8 x 64 x 2 = 2,048 per token
    granite = spec("granite-4.0-h-micro")
    assert plan_single_pool(granite, 40 * GiB).block_size == 16 * -(-1_074_688 // (16 * 2048)) == 528
    # align: cdiv(1,074,688, 2,048) = 525 tokens, rounded up to lcm(256, 16) = 256: 768; two state pages
    aligned = plan_single_pool(granite, 40 * GiB, prefix_caching=True, chunk_size=256)
    assert aligned.block_size == 768
    assert aligned.state_blocks_per_request == 2 * aligned.state_groups
    with pytest.raises(ConfigError, match="chunk_size"):
        plan_single_pool(granite, 40 * GiB, prefix_caching=True)


def test_qwen3_next_two_pools() -> None:
    qwen = spec("qwen3-next-80b-a3b-instruct")
    plan = plan_two_pools(qwen, 40 * GiB, 32768)
    per_request = 36 * 1_097_728  # 39,518,208
    assert plan.state_slots == int(40 * GiB * 0.9 / 1.9 // per_request) == 514
    assert plan.kv_tokens == (40 * GiB - 514 * per_request) // 24_576 == 921_114
    # default cap min(max(921114 / 32768 x 512, 2048), 4096) = 4096; slots // 3 = 171
    assert plan.max_running_requests == 171
    assert plan.max_requests(32768) == 921_114 // 32768 == 28
    # SGLang keeps SSM states in float32 by default: 36 x (8192 x 3 x 2 + 32 x 128 x 128 x 4) per request
    fp32 = plan_two_pools(spec("qwen3-next-80b-a3b-instruct", ssm_dtype="float32"), 40 * GiB, 32768)
    assert fp32.state_slots == int(40 * GiB * 0.9 / 1.9 // (36 * (49_152 + 2_097_152))) == 263
    assert plan_two_pools(qwen, 40 * GiB, 32768, ratio=0.5).state_slots == int(40 * GiB / 3 // per_request)


def test_plan_lines_say_the_figures() -> None:
    plan = plan_state_memory(spec("qwen3-next-80b-a3b-instruct"), 40 * GiB, 32768)
    text = "\n".join(plan.lines())
    for figure in ("37.69 MiB per request", "1,608 tokens of KV", "block size 544", "16.00 KiB = 1.49%",
                   "50 requests of 32,768 tokens", "514 state slots", "28 requests"):
        assert figure in text, figure


def test_group_size_rule() -> None:
    assert group_size([12, 36]) == 12 and group_size([10, 12]) == 12 and group_size([4, 28]) == 4


def test_bad_plans_are_refused() -> None:
    mamba = HybridSpec.from_hf_config({"model_type": "mamba2", "num_hidden_layers": 2, "hidden_size": 64,
                                       "num_heads": 4, "head_dim": 32, "n_groups": 1, "state_size": 8,
                                       "conv_kernel": 4})
    assert mamba.attention is None and mamba.kv_token_equivalent is None
    with pytest.raises(ConfigError, match="no attention layers"):
        plan_single_pool(mamba, GiB)
    qwen = spec("qwen3-next-80b-a3b-instruct")
    with pytest.raises(InsufficientMemoryError):
        plan_single_pool(qwen, 12 * 1_114_112)  # one block: the null block only
    with pytest.raises(InsufficientMemoryError):
        plan_two_pools(qwen, 36 * 1_097_728, 1024)  # 0.47 of a state slot
    with pytest.raises(ConfigError, match="ratio"):
        plan_two_pools(qwen, GiB, 1024, ratio=0)
    with pytest.raises(ConfigError, match="memory_bytes"):
        plan_single_pool(qwen, True)
    with pytest.raises(ConfigError, match="context_len"):
        plan_state_memory(qwen, GiB, 0)

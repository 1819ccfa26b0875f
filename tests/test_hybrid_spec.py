"""Hybrid attention in the spec, the config reader and the planner, on real published configs.

Every expected number is worked out by hand in the comments from the config's own values and the rules of
issues 10 and 20: per request of L tokens at block size B, computing up to T tokens per step, a full layer
holds cdiv(L, B) blocks, a sliding one min(cdiv(L, B), cdiv(W - 2 + T, B) + 1), a chunked one
min(cdiv(L, B), cdiv(C - 1 + T, B)) (T = 1: cdiv(W - 1, B) + 1 and C / B); a windowed pool keeps one null
block; layers of one kind form KV cache groups of vLLM's uniform size (the fewest layers of any kind, or the
most when under 1.5x the fewest).
Layer kinds are also checked against transformers' own config classes (an independent reader).

Config provenance: gemma-3-27b-it (google/gemma-3-27b-it, whose text_config leaves sliding_window_pattern
out), gpt-oss-20b (openai/gpt-oss-20b), llama-4-scout-17b-16e (meta-llama/Llama-4-Scout-17B-16E, text
config; its vision_config is left out), c4ai-command-r7b-12-2024 (Cohere2, as saved from
CohereForAI/c4ai-command-r7b-12-2024); gemma-2-9b-it, gemma-3-1b-it, mistral-7b-v0.1, phi-3-mini-4k-instruct
and qwen2.5-7b were already here.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.allocators.groups import KVCacheCoordinator
from kvpool.cli import main
from kvpool.errors import ConfigError, InsufficientMemoryError, OutOfBlocksError
from kvpool.spec import KVCacheGroup, KVCacheSpec, LayerKind, cdiv, kv_cache_groups
from kvpool.spec.hf_config import load_config, read_kv_fields
from kvpool.spec.planner import MemoryReadings, plan_pool

CONFIGS = Path(__file__).parent / "configs"
GiB, MiB = 2**30, 2**20
F, S, C = LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED


def spec_of(name: str, **kwargs) -> KVCacheSpec:
    return KVCacheSpec.from_hf_config(CONFIGS / f"{name}.json", **kwargs)


def kinds(spec: KVCacheSpec) -> list[tuple[str, int | None, int, int]]:
    """(kind, window, layers, padding) per group."""
    return [(g.kind.value, g.window, len(g.layers), g.num_padding_layers) for g in spec.groups]


# name: (full layer indices, window or chunk, groups as (kind, number of groups))
LAYOUTS = {
    # text_config has no sliding_window_pattern: Gemma3TextConfig's default 6, (i + 1) % 6 == 0 is full
    "gemma-3-27b-it": (list(range(5, 62, 6)), 1024),
    # sliding_window_pattern 6 given: 26 layers, full at 5, 11, 17, 23
    "gemma-3-1b-it": ([5, 11, 17, 23], 512),
    # Gemma2Config alternates starting with sliding: odd layers full
    "gemma-2-9b-it": (list(range(1, 42, 2)), 4096),
    # layer_types in the file: sliding, full, sliding, ...
    "gpt-oss-20b": (list(range(1, 24, 2)), 128),
    # no_rope_layers [] -> every 4th layer NoPE (full), the RoPE layers chunked
    "llama-4-scout-17b-16e": (list(range(3, 48, 4)), 8192),
    # sliding_window_pattern 4: layers 3, 7, ... full
    "c4ai-command-r7b-12-2024": (list(range(3, 32, 4)), 4096),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layer_kinds_from_real_configs(name):
    full, window = LAYOUTS[name]
    spec = spec_of(name)
    windowed = C if name.startswith("llama-4") else S
    assert spec.layer_types == tuple(F if i in full else windowed for i in range(spec.num_layers))
    assert {g.window for g in spec.groups if g.kind is not F} == {window}


UNIFORM = ["mistral-7b-v0.1", "qwen2.5-7b", "phi-3-mini-4k-instruct"]


@pytest.mark.parametrize("name", [*sorted(LAYOUTS), *UNIFORM])
def test_layer_kinds_agree_with_transformers(name):
    transformers = pytest.importorskip("transformers")
    config = load_config(CONFIGS / f"{name}.json")
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf = transformers.AutoConfig.for_model(config["model_type"], **kwargs).get_text_config(decoder=True)
    except Exception as exc:  # a config class that rejects an old file's field
        pytest.skip(f"transformers cannot build {name}: {exc}")
    ours = read_kv_fields(CONFIGS / f"{name}.json")["layer_types"]
    theirs = getattr(hf, "layer_types", None)
    if ours is None:  # every layer alike: transformers has no list, or one of a single kind
        assert theirs is None or len(set(theirs)) == 1
    else:
        assert list(theirs) == ours


def test_gemma_3_27b_groups_and_padding():
    # 52 sliding, 10 full: size min(52, 10) = 10 (52 >= 1.5 x 10); sliding cdiv(52, 10) = 6 groups of
    # layers[i::6]: 9, 9, 9, 9, 8, 8 layers (8 padding slots), then one full group of 10
    spec = spec_of("gemma-3-27b-it")
    assert kinds(spec) == [("sliding_attention", 1024, 9, 1)] * 4 + [("sliding_attention", 1024, 8, 2)] * 2 \
        + [("full_attention", None, 10, 0)]
    sliding = [i for i in range(62) if (i + 1) % 6]
    assert spec.groups[0].layers == tuple(sliding[0::6])
    assert spec.layers_per_block == 10 and spec.has_windows
    # 2 (K, V) x 16 heads x 128 x 2 B = 8192 B per layer-token; a block: 10 x 8192 x 16 = 1310720 B
    assert spec.bytes_per_token == 62 * 8192 and spec.bytes_per_block == 1310720


def test_group_sizes_of_other_models():
    # gpt-oss 12 + 12: size 12, no padding; Scout 36 chunked + 12 full: size 12, 3 chunked groups;
    # Cohere2 24 + 8: size 8; Gemma 2 21 + 21: size 21; Mistral: one sliding group of 32
    assert kinds(spec_of("gpt-oss-20b")) == [("sliding_attention", 128, 12, 0),
                                             ("full_attention", None, 12, 0)]
    assert kinds(spec_of("llama-4-scout-17b-16e")) == [("chunked_attention", 8192, 12, 0)] * 3 + [
        ("full_attention", None, 12, 0)]
    assert kinds(spec_of("c4ai-command-r7b-12-2024")) == [("sliding_attention", 4096, 8, 0)] * 3 + [
        ("full_attention", None, 8, 0)]
    assert kinds(spec_of("gemma-2-9b-it")) == [("sliding_attention", 4096, 21, 0),
                                               ("full_attention", None, 21, 0)]
    assert kinds(spec_of("mistral-7b-v0.1")) == [("sliding_attention", 4096, 32, 0)]
    assert kinds(spec_of("qwen2.5-7b")) == [("full_attention", None, 28, 0)]  # use_sliding_window false


def test_uniform_spec_block_bytes_unchanged():
    spec = spec_of("llama-3.1-8b")
    assert (spec.layers_per_block, spec.has_windows) == (32, False)
    assert spec.bytes_per_block == spec.bytes_per_token * 16 == 2 * 1024 * 1024


def test_vllm_size_rule_takes_the_larger_count_under_1_5x():
    # 12 sliding + 13 full (gpt-oss + a drafter layer, vLLM's example): 13 < 1.5 x 12, so size 13
    groups = kv_cache_groups([S, F] * 12 + [F], {S: 128}, 16)
    assert [(g.kind, len(g.layers), g.slots) for g in groups] == [(S, 12, 13), (F, 13, 13)]


# name, kwargs, max_model_len, T tokens per step (None: the default 256): blocks per request of each group.
# Sliding: min(cdiv(L, B), cdiv(W - 2 + T, B) + 1); chunked: min(cdiv(L, B), cdiv(C - 1 + T, B));
# full: cdiv(L, B)
@pytest.mark.parametrize(("name", "kwargs", "length", "step", "per_group"), [
    # decode only (T 1), W 1024: cdiv(1023, 16) + 1 = 65 per sliding group; full cdiv(131072, 16) = 8192
    ("gemma-3-27b-it", {}, 131072, 1, [65] * 6 + [8192]),
    # T 256: cdiv(1024 - 2 + 256 = 1278, 16) = 80 (79.875) + 1 = 81
    ("gemma-3-27b-it", {}, 131072, None, [81] * 6 + [8192]),
    # T 2048: cdiv(3070, 16) = 192 (191.875) + 1 = 193
    ("gemma-3-27b-it", {}, 131072, 2048, [193] * 6 + [8192]),
    # W 128: T 1: cdiv(127, 16) + 1 = 9; T 256: cdiv(382, 16) = 24 (23.875) + 1 = 25
    ("gpt-oss-20b", {"kv_cache_dtype": "bfloat16"}, 131072, 1, [9, 8192]),
    ("gpt-oss-20b", {"kv_cache_dtype": "bfloat16"}, 131072, None, [25, 8192]),
    # W 4096: T 1: cdiv(4095, 16) + 1 = 257; T 256: cdiv(4350, 16) = 272 (271.875) + 1 = 273;
    # T 2048: cdiv(6142, 16) = 384 (383.875) + 1 = 385; all against cdiv(32768, 16) = 2048
    ("mistral-7b-v0.1", {}, 32768, 1, [257]),
    ("mistral-7b-v0.1", {}, 32768, None, [273]),
    ("mistral-7b-v0.1", {}, 32768, 2048, [385]),
    # a request shorter than the window holds all its blocks: min(cdiv(1000, 16) = 63, 273)
    ("mistral-7b-v0.1", {}, 1000, None, [63]),
    # C 8192: T 1: 8192 / 16 = 512 per chunked group; T 256: cdiv(8447, 16) = 528 (527.94)
    ("llama-4-scout-17b-16e", {}, 131072, 1, [512] * 3 + [8192]),
    ("llama-4-scout-17b-16e", {}, 131072, None, [528] * 3 + [8192]),
    # W 2047 at B 32: T 1: cdiv(2046, 32) + 1 = 65; T 256: cdiv(2301, 32) = 72 (71.9) + 1 = 73; vs 128
    ("phi-3-mini-4k-instruct", {"block_size": 32}, 4096, 1, [65]),
    ("phi-3-mini-4k-instruct", {"block_size": 32}, 4096, None, [73]),
    # full attention: cdiv(32768, 16) = 2048 whatever T
    ("qwen2.5-7b", {}, 32768, 1, [2048]),
    ("qwen2.5-7b", {}, 32768, 8192, [2048]),
])
def test_blocks_per_request(name, kwargs, length, step, per_group):
    spec = spec_of(name, **kwargs)
    step_kw = {} if step is None else {"max_num_batched_tokens": step}
    plan = plan_pool(spec, MemoryReadings(80 * GiB, 0), max_model_len=length, **step_kw)
    assert [g.blocks_per_request for g in plan.groups] == per_group
    assert plan.blocks_per_request == sum(per_group) and plan.max_num_batched_tokens == (step or 256)
    null = 0 if name == "qwen2.5-7b" else 1  # a windowed pool's block 0 is the null block
    assert plan.num_null_blocks == null
    assert plan.max_concurrency == pytest.approx((plan.num_blocks - null) / sum(per_group))


def _vllm_blocks(group: KVCacheGroup, length: int, step: int) -> int:
    """vLLM 0.33's per-request admission blocks of one group, written out from its kv_cache_interface.py
    (``max_admission_blocks_per_request``, one step in flight): sliding ``cdiv(min(W - 1 + T, L), B) + 1``,
    chunked ``cdiv(min(C + T, L), B)``, full ``cdiv(L, B)``."""
    b, w = group.block_size, group.window
    if group.kind is S:
        return -(-min(w - 1 + step, length) // b) + 1
    if group.kind is C:
        return -(-min(w + step, length) // b)
    return -(-length // b)


@pytest.mark.parametrize("name", ["gemma-3-27b-it", "gpt-oss-20b", "mistral-7b-v0.1", "llama-4-scout-17b-16e",
                                  "gemma-2-9b-it", "c4ai-command-r7b-12-2024", "phi-3-mini-4k-instruct"])
@pytest.mark.parametrize("step", [1, 256, 2048, 8192, 16384])
def test_blocks_per_request_against_vllms_formula(name, step):
    # vLLM reserves the same blocks, or one more: its cdiv(S, B) + 1 for a span of S = W - 1 + T tokens
    # (chunked: C + T) at any offset, where S - 1 tokens past the first one's block suffice (ours is the
    # maximum the steps reach: test_max_blocks_is_the_brute_force_maximum), and its + 1 also on a request
    # shorter than the span, which holds only its own cdiv(L, B) blocks
    spec = spec_of(name)
    for length in (1000, 32768, 131072):
        plan = plan_pool(spec, MemoryReadings(800 * GiB, 0), max_model_len=length,
                         max_num_batched_tokens=step)
        for group, ours in zip(spec.groups, plan.groups, strict=True):
            vllm = _vllm_blocks(group, length, step)
            assert 0 <= vllm - ours.blocks_per_request <= 1
            if group.kind is F:
                assert ours.blocks_per_request == vllm
            span = group.window - 1 + step if group.kind is S else (group.window or 0) + step
            if group.kind is not F and span + group.block_size < length and span % group.block_size != 1:
                assert ours.blocks_per_request == vllm, (group.index, length)


def test_max_blocks_is_the_brute_force_maximum():
    # every step computing tokens [p, q), q = min(p + T, n), holds the blocks from the first one a query
    # reads (sliding: token p - W + 1; chunked: the start of p's chunk) to the block of token q - 1
    for block in (1, 2, 4, 5):
        for step in range(1, 10):
            for n in range(1, 41):
                for window in range(1, 18):
                    held = max((min(p + step, n) - 1) // block - max(0, p - window + 1) // block + 1
                               for p in range(n))
                    assert KVCacheGroup(0, S, window, (0,), 1, block).max_blocks(n, step) == held
                for chunk in range(block, 17, block):
                    held = max((min(p + step, n) - 1) // block - chunk * (p // chunk) // block + 1
                               for p in range(n))
                    assert KVCacheGroup(0, C, chunk, (0,), 1, block).max_blocks(n, step) == held


def test_gemma_3_27b_plan_the_issue_example():
    # 80 GiB x 0.9 = 77309411328 B; - 54 GiB of weights = 19327352832 B; // 1310720 = 14745 blocks
    plan = plan_pool(spec_of("gemma-3-27b-it"), MemoryReadings(80 * GiB, 54 * GiB), max_model_len=131072)
    assert (plan.available_kv_bytes, plan.num_blocks, plan.num_null_blocks) == (19327352832, 14745, 1)
    # at 256 tokens per step: 8192 + 6 x 81 = 8678 blocks per request; 14744 usable / 8678 = 1.699 requests
    assert plan.blocks_per_request == 8678 and plan.max_concurrency == pytest.approx(14744 / 8678)
    assert plan.context_tokens == 14744 * 131072 // 8678 == 222692  # floor(1.699 x 131072)
    # token slots 14745 x 16 = 235920 over 7 groups; 14745 // 7 = 2106 blocks x 16 = 33696 tokens per group
    assert (plan.max_num_tokens, plan.tokens_per_group) == (235920, 33696)
    # all full: 8192 blocks x 62 layers x (8192 x 16 = 131072 B) = 66571993088 B (the issue's 66.6 GB)
    assert plan.all_full_bytes_per_request == 66571993088
    assert plan.bytes_per_request == 8678 * 1310720
    # 19327352832 // (62 x 131072) = 2378 all-full blocks / 8192 = 0.29: one request does not fit
    assert plan.all_full_max_concurrency == pytest.approx(2378 / 8192)
    assert plan.window_saving == pytest.approx(1 - 8678 * 1310720 / 66571993088)
    # 8 padding slots over the 6 sliding groups, 81 blocks each: 648 layer-pages of 131072 B
    assert plan.padding_bytes_per_request == 648 * 131072
    # decoding only (1 token per step): 6 x (cdiv(1023, 16) + 1 = 65) + 8192 = 8582 blocks: 14744 / 8582
    decode = plan_pool(spec_of("gemma-3-27b-it"), MemoryReadings(80 * GiB, 54 * GiB), max_model_len=131072,
                       max_num_batched_tokens=1)
    assert decode.blocks_per_request == 8582 and decode.max_concurrency == pytest.approx(14744 / 8582)


def test_gpt_oss_gets_twice_the_requests():
    # auto: the config names no dtype, vLLM runs it in bfloat16 (its float32 default cast down):
    # 2 x 8 x 64 x 2 = 2048 B per layer-token, block 12 x 2048 x 16 = 393216 B;
    # 58 GiB // 393216 = 158378 blocks; usable 158377 / (8192 + 25) = 19.27; all full: 58 GiB // (24 x 32768)
    # = 79189 / 8192 = 9.67
    spec = spec_of("gpt-oss-20b")
    assert spec.dtype == spec_of("gpt-oss-20b", kv_cache_dtype="bfloat16").dtype
    plan = plan_pool(spec, MemoryReadings(80 * GiB, 14 * GiB), max_model_len=131072)
    assert plan.num_blocks == 158378 and plan.blocks_per_request == 8217
    assert plan.max_concurrency == pytest.approx(158377 / 8217)
    assert plan.all_full_max_concurrency == pytest.approx((58 * GiB // (24 * 32768)) / 8192)
    # 2048 tokens per step: cdiv(128 - 2 + 2048, 16) = 136 (135.875) + 1 = 137 sliding blocks: 158377 / 8329
    wide = plan_pool(spec, MemoryReadings(80 * GiB, 14 * GiB), max_model_len=131072,
                     max_num_batched_tokens=2048)
    assert wide.blocks_per_request == 8329 and round(wide.max_concurrency, 2) == 19.02


def test_mistral_at_32k_slides_every_layer():
    # docs/hybrid.md: bf16, 2 x 32 x 8 x 128 x 2 B x 16 tokens = 2 MiB per block; 80 GiB x 0.9 - 15 GiB
    # = 57 GiB = 29184 blocks, one the null block; a 32K request at 256 tokens per step holds
    # cdiv(4096 - 2 + 256, 16) + 1 = 273 of them (2048 all full)
    plan = plan_pool(spec_of("mistral-7b-v0.1"), MemoryReadings(80 * GiB, 15 * GiB), max_model_len=32768)
    assert plan.num_blocks == 57 * GiB // (2 * MiB) == 29184 and plan.blocks_per_request == 273
    assert round(plan.max_concurrency, 2) == round(29183 / 273, 2) == 106.90
    assert plan.all_full_max_concurrency == 29184 / 2048 == 14.25
    # vLLM at 2048 tokens per step: cdiv(4095 + 2048, 16) + 1 = 385 blocks, 29184 / 385 = 75.80
    vllm_like = plan_pool(spec_of("mistral-7b-v0.1"), MemoryReadings(80 * GiB, 15 * GiB), max_model_len=32768,
                          max_num_batched_tokens=2048)
    assert vllm_like.blocks_per_request == 385 and round(vllm_like.max_concurrency, 2) == 75.80


def test_minimum_counts_every_group_and_the_null_block():
    # Gemma-3-27B needs 8678 blocks of 1310720 B for one 128K request, + the null block; 10 GiB holds 8192
    spec = spec_of("gemma-3-27b-it")
    with pytest.raises(InsufficientMemoryError,
                       match="one request of max_model_len 131072 tokens and the null block") as info:
        plan_pool(spec, MemoryReadings(10 * GiB, 0), gpu_memory_utilization=1.0, max_model_len=131072)
    # 8679 x 1310720 B = 11375738880 B = 10.59 GiB needed; 638320640 B missing = 608.75 MiB (/ 2**20)
    assert "needs 10.59 GiB" in str(info.value) and "(608.75 MiB missing)" in str(info.value)
    # without max_model_len: one request past the windows, 6 x 81 sliding blocks + 1 full block + null = 488
    with pytest.raises(Exception, match="sliding window of 1024 tokens at 256 tokens per step"):
        plan_pool(spec, MemoryReadings(487 * 1310720, 0), gpu_memory_utilization=1.0)
    assert plan_pool(spec, MemoryReadings(488 * 1310720, 0), gpu_memory_utilization=1.0).num_blocks == 488


def test_mistral_at_32k_needs_the_null_block_too():
    # issue 20, item 11: one token per step, cdiv(4095, 16) + 1 = 257 blocks per request; vLLM 0.33 refuses
    # 257 blocks (its check reserves the null block) and accepts 258, and so does the plan
    spec = spec_of("mistral-7b-v0.1")
    block = spec.bytes_per_block
    with pytest.raises(InsufficientMemoryError, match="258 blocks of 2.00 MiB"):
        plan_pool(spec, MemoryReadings(257 * block, 0), gpu_memory_utilization=1.0, max_model_len=32768,
                  max_num_batched_tokens=1)
    plan = plan_pool(spec, MemoryReadings(258 * block, 0), gpu_memory_utilization=1.0, max_model_len=32768,
                     max_num_batched_tokens=1)
    assert plan.num_blocks == 258 and plan.max_concurrency == 257 / 257
    # the coordinator over those 258 blocks admits the 4,097-token request (cdiv(4097, 16) = 257 blocks)
    # that one over 257 refuses: block 0 is the null block
    coordinator = KVCacheCoordinator(spec.groups, plan.num_blocks)
    coordinator.allocate("r", 4097)
    assert coordinator.num_blocks_held("r") == cdiv(4097, 16) == 257
    with pytest.raises(OutOfBlocksError):
        KVCacheCoordinator(spec.groups, 257).allocate("r", 4097)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries but num_layers is 4"),
    ({"layer_types": ["full_attention"] * 3 + ["linear_attention"]}, "unknown layer type 'linear_attention'"),
    ({"layer_types": "full_attention"}, "layer_types must be a list"),
    ({"layer_types": [["full_attention"]] * 4}, r"unknown layer type \['full_attention'\]"),  # unhashable
    ({"layer_types": [None] * 4}, "unknown layer type None"),
    ({"layer_types": ["sliding_attention"] * 4}, "sliding_window is not set"),
    ({"layer_types": ["sliding_attention"] * 4, "sliding_window": 0}, "sliding_window must be an integer"),
    ({"layer_types": ["sliding_attention"] * 4, "sliding_window": -16}, "sliding_window must be"),
    ({"layer_types": ["chunked_attention"] * 4}, "attention_chunk_size is not set"),
    ({"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": 0}, "attention_chunk_size must be"),
    ({"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": 100},
     "attention_chunk_size 100 must be a multiple of block_size 16"),
])
def test_bad_layer_types_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        KVCacheSpec(num_layers=4, num_kv_heads=1, head_dim=8, **kwargs)


def test_hf_config_with_bad_layer_types(tmp_path):
    config = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    config["layer_types"] = config["layer_types"][:-1]
    with pytest.raises(ConfigError, match="layer_types has 23 entries but num_layers is 24"):
        KVCacheSpec.from_hf_config(config)
    config["layer_types"] = ["sliding_attention"] * 23 + ["mamba"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "kvpool", "plan", str(path), "--gpu-memory", "80GiB"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "unknown layer type 'mamba'" in result.stderr


@pytest.mark.parametrize(("name", "field", "value", "error"), [
    # each of these was a TypeError traceback from `kvpool plan` (exit 1): never iterated or hashed now
    ("gpt-oss-20b", "layer_types", 5, "'layer_types' must be a list of layer type names, got 5"),
    ("gpt-oss-20b", "layer_types", True, "'layer_types' must be a list of layer type names, got True"),
    ("gpt-oss-20b", "layer_types", [[1]] * 24, "unknown layer type [1]"),
    ("llama-4-scout-17b-16e", "no_rope_layers", 5, "'no_rope_layers' must be a list (1 = RoPE layer), got 5"),
])
def test_hostile_layer_fields_are_one_line(tmp_path, capsys, name, field, value, error):
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    (config.get("text_config") or config)[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", str(path), "--gpu-memory", "80GiB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err, err


def test_group_rules_by_hand():
    sliding = KVCacheGroup(0, S, 16, (0,), 1, 4)
    # W 16, B 4: a query at q sees (q - 16, q]; before computing token 40, blocks wholly before token
    # 40 - 16 + 1 = 25 are dead: 25 // 4 = 6
    assert sliding.skipped_blocks(40) == 6 and sliding.skipped_blocks(15) == 0
    # before token 42 the window starts at 27, inside block 6 (tokens 24..27): still 6 dead blocks
    assert sliding.skipped_blocks(42) == 6 and sliding.skipped_blocks(43) == 7
    # decode: cdiv(15, 4) + 1 = 5 blocks; a chunk of 8 queries: cdiv(16 + 8 - 2, 4) + 1 = 7
    assert (sliding.max_blocks(10**6), sliding.max_blocks(10**6, 8), sliding.max_blocks(9)) == (5, 7, 3)
    chunked = KVCacheGroup(1, C, 8, (1,), 1, 4)
    # C 8: before token 13 the chunk starts at 8, so blocks 0 and 1 are dead; decode holds 8 / 4 = 2
    assert (chunked.skipped_blocks(13), chunked.skipped_blocks(16), chunked.max_blocks(100)) == (2, 4, 2)
    # a chunk of 3 queries: cdiv(8 - 1 + 3, 4) = 3
    assert chunked.max_blocks(100, 3) == 3
    full = KVCacheGroup(2, F, None, (2,), 1, 4)
    assert (full.skipped_blocks(100), full.max_blocks(10)) == (0, 3)


def test_cli_plan_json_and_text_show_the_groups(capsys):
    from kvpool.cli import main

    args = ["plan", str(CONFIGS / "gemma-3-27b-it.json"), "--gpu-memory", "80GiB", "--non-kv-memory",
            "54GiB", "--max-model-len", "131072"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["layers_per_block"], data["blocks_per_request"], data["num_blocks"]) == (10, 8678, 14745)
    assert [g["blocks_per_request"] for g in data["groups"]] == [81] * 6 + [8192]
    assert data["groups"][6] == {"index": 6, "kind": "full_attention", "window": None,
                                 "layers": list(range(5, 62, 6)), "num_layers": 10, "num_padding_layers": 0,
                                 "bytes_per_block": 1310720, "blocks_per_request": 8192, "slots": 10,
                                 "num_kv_heads": 16, "head_dim": 128, "v_head_dim": 128,
                                 "layer_bytes_per_token": 8192, "padding_bytes_per_block": 0}
    assert data["padding_bytes_per_request"] == 648 * 131072
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "7 groups of 10 layer slots per block, 8 of them padding" in text
    assert "group 6        full_attention, 10 layers [5,11,17,23,29,35,...], 8,192 blocks per request" in text
    # 1 - 8678 x 1310720 / 66571993088 = 82.9%; 14744 / 8678 = 1.70
    assert "windows save 82.9%" in text and "1.70 requests of 131,072 tokens (every layer full: 0.29)" in text
    # without --max-model-len there is nothing per request
    assert main([*args[:-2], "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "blocks_per_request" not in data and "blocks_per_request" not in data["groups"][0]


def test_storage_holds_what_the_plan_says():
    import torch

    from kvpool.storage.paged import PagedKVCache

    # 6 layers, layers 2 and 5 full (pattern 3), W 16: groups of size 2: sliding {0, 3}, {1, 4}, full {2, 5}
    spec = KVCacheSpec(num_layers=6, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4,
                       sliding_window=16, layer_types=["sliding_attention"] * 2 + ["full_attention"] +
                       ["sliding_attention"] * 2 + ["full_attention"])
    assert [g.layers for g in spec.groups] == [(0, 3), (1, 4), (2, 5)]
    cache = PagedKVCache(spec, num_blocks=12)
    # [2, 2 slots, 12 blocks, 4, 2, 8] float32: 12 x spec.bytes_per_block (2 x 2 x 4 x 2 x 8 x 4 B = 1024)
    assert cache.buffer.shape == (2, 2, 12, 4, 2, 8) and cache.nbytes == 12 * spec.bytes_per_block == 12288
    assert cache.layer_group == [0, 1, 2, 0, 1, 2]
    # layers 0, 1, 2 share slot 0 (each in its own group's blocks); layer 3 is slot 1
    assert cache.k_cache(1).data_ptr() == cache.k_cache(0).data_ptr() != cache.k_cache(3).data_ptr()
    k = torch.randn(1, 2, 8)
    cache.store_kv(k, k, torch.tensor([5]), layer=3)  # block 1, offset 1 of slot 1
    assert torch.equal(cache.buffer[0, 1, 1, 1], k[0]) and not torch.equal(cache.buffer[0, 0, 1, 1], k[0])
    # the plan of those bytes gives the same 12 blocks, which hold a request decoding past the windows:
    # 2 sliding groups x (cdiv(15, 4) + 1 = 5) + 1 full block + the null block = 12; one block fewer cannot
    plan = plan_pool(spec, MemoryReadings(cache.nbytes, 0), gpu_memory_utilization=1.0,
                     max_num_batched_tokens=1)
    assert plan.num_blocks == 12
    with pytest.raises(Exception, match=r"12 blocks of 1\.00 KiB"):  # 1024 B
        plan_pool(spec, MemoryReadings(11 * 1024, 0), gpu_memory_utilization=1.0, max_num_batched_tokens=1)

"""KVCacheSpec: the per-rank byte formulas, tensor-parallel splits, dtype names and every validation error."""

import dataclasses

import numpy as np
import pytest
import torch

from kvpool.errors import ConfigError
from kvpool.spec import KV_DTYPES, AttentionKind, KVCacheSpec, auto_kv_dtype, parse_kv_dtype


def llama8b(**overrides) -> KVCacheSpec:
    return KVCacheSpec(**{"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": torch.bfloat16,
                          "block_size": 16, **overrides})


def test_keyword_construction_and_defaults():
    spec = llama8b()
    assert (spec.attention, spec.tp_size, spec.sliding_window) == (AttentionKind.MHA, 1, None)
    assert (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.latent_dim) == (0, 0, 0)
    # 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 B = 131072 B = 128 KiB per token; x 16 tokens = 2 MiB
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert spec.bytes_per_block == 2 * 1024 * 1024
    assert KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1).dtype == torch.bfloat16


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        llama8b().num_layers = 1  # type: ignore[misc]


def test_design_fact_qwen25_05b_is_12_kib_per_token():
    # DESIGN.md: 24 layers x 2 x 2 KV heads x 64 x 2 B = 12 KiB per token, 192 KiB per 16-token block
    spec = KVCacheSpec(num_layers=24, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    assert spec.bytes_per_token == 12 * 1024
    assert spec.bytes_per_block == 192 * 1024


@pytest.mark.parametrize(("tp", "per_rank"), [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1), (32, 1)])
def test_tp_split_and_replication(tp, per_rank):
    # heads >= tp: heads / tp each; heads < tp: every rank holds one replicated head
    spec = llama8b(tp_size=tp)
    assert spec.num_kv_heads_per_rank == per_rank
    assert spec.bytes_per_token == 2 * 32 * per_rank * 128 * 2


@pytest.mark.parametrize(("heads", "tp"), [(8, 3), (8, 6), (8, 12), (4, 6), (3, 2), (28, 8)])
def test_tp_that_cannot_split_names_both_numbers(heads, tp):
    with pytest.raises(ConfigError) as info:
        llama8b(num_kv_heads=heads, tp_size=tp)
    assert f"tp_size {tp}" in str(info.value) and f"num_kv_heads {heads}" in str(info.value)


def test_mqa_single_head_replicates_to_any_tp():
    # MQA (falcon-7b): 1 KV head; tp 4 keeps 1 head per rank: 2 x 32 x 1 x 64 x 2 B = 8192 B
    spec = KVCacheSpec(num_layers=32, num_kv_heads=1, head_dim=64, tp_size=4)
    assert (spec.num_kv_heads_per_rank, spec.bytes_per_token) == (1, 8192)


def test_mla_is_one_latent_not_split_by_tp():
    # DeepSeek-V3: 61 layers x (512 + 64) x 2 B = 70272 B, the same on every rank
    for tp in (1, 8, 16):
        spec = KVCacheSpec(num_layers=61, num_kv_heads=128, head_dim=576, attention="mla", kv_lora_rank=512,
                           qk_rope_head_dim=64, tp_size=tp)
        assert spec.attention is AttentionKind.MLA
        assert (spec.latent_dim, spec.num_kv_heads_per_rank) == (576, 1)
        assert spec.bytes_per_token == 61 * 576 * 2 == 70272
        assert spec.bytes_per_block == 70272 * 16


def test_mla_heads_need_no_tp_divisibility():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=7, head_dim=8, attention="mla", kv_lora_rank=4, tp_size=3)
    assert spec.bytes_per_token == 2 * 4 * 2  # qk_rope_head_dim 0: latent 4


@pytest.mark.parametrize(("name", "dtype", "nbytes"), [
    ("float16", torch.float16, 2), ("half", torch.float16, 2), ("bfloat16", torch.bfloat16, 2),
    ("float32", torch.float32, 4), ("fp8", torch.float8_e4m3fn, 1), ("fp8_e4m3", torch.float8_e4m3fn, 1),
    ("fp8_e5m2", torch.float8_e5m2, 1), ("BFloat16", torch.bfloat16, 2), ("torch.float16", torch.float16, 2),
])
def test_dtype_names(name, dtype, nbytes):
    assert parse_kv_dtype(name) == dtype
    assert llama8b(dtype=name).dtype_bytes == nbytes


def test_fp8_halves_bf16():
    # 2 x 32 x 8 x 128 x 1 B = 65536 B
    assert llama8b(dtype="fp8").bytes_per_token == 65536 == llama8b().bytes_per_token // 2


def test_auto_dtype_follows_vllm():
    # vLLM's dtype="auto" (vllm/config/model.py _resolve_auto_dtype on a GPU of compute capability >= 8.0,
    # supported dtypes bfloat16, float16, float32): a 16-bit config dtype stays, float32 and no dtype
    # (taken as float32) are cast down to bfloat16, float16 is refused for gemma2/gemma3 (bfloat16)
    assert parse_kv_dtype("auto", "bfloat16") == torch.bfloat16
    assert parse_kv_dtype("auto", "float16") == torch.float16
    assert parse_kv_dtype("auto", "float32") == torch.bfloat16
    assert parse_kv_dtype("auto", None) == torch.bfloat16
    assert parse_kv_dtype("auto", "auto") == torch.bfloat16
    assert parse_kv_dtype("auto", "float16", model_type="gemma2") == torch.bfloat16
    assert parse_kv_dtype("auto", "float16", model_type="llama") == torch.float16
    assert parse_kv_dtype("auto", "float8_e4m3fn") == torch.bfloat16  # fp8 weights: no model dtype
    with pytest.raises(ConfigError, match="unknown KV cache dtype 'int4'"):
        parse_kv_dtype("auto", "int4")
    # an explicit dtype is never changed
    assert parse_kv_dtype("float32", None) == torch.float32
    assert parse_kv_dtype("fp8", "float32") == torch.float8_e4m3fn


@pytest.mark.parametrize(("model_dtype", "model_type", "dtype", "rule"), [
    ("bfloat16", "llama", torch.bfloat16, "the config's bfloat16"),
    ("float32", "gemma2", torch.bfloat16, "the config's float32, cast down to bfloat16 as vLLM does"),
    (None, "gpt_oss", torch.bfloat16, "the config names no dtype: vLLM takes it as float32"),
    ("float16", "gemma3_text", torch.bfloat16, "vLLM never runs gemma3_text in float16"),
])
def test_auto_kv_dtype_says_which_rule_applied(model_dtype, model_type, dtype, rule):
    got, why = auto_kv_dtype(model_dtype, model_type)
    assert got == dtype and rule in why


def test_every_accepted_name_round_trips_through_str():
    for dtype in KV_DTYPES.values():
        assert parse_kv_dtype(str(dtype)) == dtype


@pytest.mark.parametrize("bad", ["int4", "fp4", "", "float64", torch.int8, torch.float64])
def test_unknown_dtype_lists_accepted_names(bad):
    with pytest.raises(ConfigError) as info:
        parse_kv_dtype(bad)
    for accepted in ("auto", "float16", "half", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert accepted in str(info.value)


@pytest.mark.parametrize(("field", "value"), [
    ("num_layers", 0), ("num_kv_heads", -1), ("head_dim", 0), ("block_size", 0), ("tp_size", 0),
    ("num_layers", 2.0), ("head_dim", True), ("sliding_window", 0), ("num_kv_heads", None),
    ("num_layers", "32"), ("block_size", np.True_), ("num_attention_heads", 0), ("num_attention_heads", 4),
])
def test_bad_sizes_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        llama8b(**{field: value})


def test_mla_needs_a_latent():
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, attention="mla")
    with pytest.raises(ConfigError, match="qk_rope_head_dim"):
        KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, attention="mla", kv_lora_rank=4,
                    qk_rope_head_dim=None)


def test_unknown_attention_kind():
    with pytest.raises(ConfigError, match="attention"):
        llama8b(attention="linear")


def test_from_hf_config_dict_kv_dtype_block_size_and_tp():
    config = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "hidden_size": 256, "torch_dtype": "float16"}
    spec = KVCacheSpec.from_hf_config(config)
    # head_dim = 256 / 8 = 32; 2 x 4 x 2 x 32 x 2 B (float16 from torch_dtype) = 1024 B
    assert (spec.head_dim, spec.dtype, spec.block_size, spec.bytes_per_token) == (32, torch.float16, 16, 1024)
    fp8 = KVCacheSpec.from_hf_config(config, tp_size=2, kv_cache_dtype="fp8", block_size=32)
    # 2 x 4 x (2 / 2) x 32 x 1 B = 256 B; x 32 tokens = 8192 B
    assert (fp8.bytes_per_token, fp8.bytes_per_block, fp8.tp_size) == (256, 8192, 2)
    with pytest.raises(ConfigError, match="tp_size 3"):
        KVCacheSpec.from_hf_config(config, tp_size=3)


def test_numpy_sizes_are_converted_to_ints():
    """The rule of kvpool.numeric: a numpy integer is the int it holds (so the spec compares equal)."""
    spec = llama8b(num_layers=np.int64(32), block_size=np.int32(16), num_attention_heads=np.int64(32))
    assert spec == llama8b(num_attention_heads=32)
    assert type(spec.num_layers) is int and spec.bytes_per_block == 2 * 32 * 8 * 128 * 2 * 16


@pytest.mark.parametrize(("heads", "kv", "label"), [(None, 8, "MHA/GQA"), (32, 8, "GQA"), (8, 8, "MHA"),
                                                     (32, 1, "MQA")])
def test_attention_label(heads, kv, label):
    assert llama8b(num_kv_heads=kv, num_attention_heads=heads).attention_label == label

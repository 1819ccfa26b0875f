"""read_kv_fields / KVCacheSpec.from_hf_config on real published configs (tests/configs/*.json).

Every expected bytes_per_token is worked out by hand from the model's published config values:
2 (K and V) x layers x KV heads x head_dim x dtype bytes (MHA/GQA/MQA), layers x (kv_lora_rank +
qk_rope_head_dim) x dtype bytes (MLA).
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from kvpool.errors import ConfigError
from kvpool.spec import KVCacheSpec
from kvpool.spec.hf_config import load_config, read_kv_fields

CONFIGS = Path(__file__).parent / "configs"

# file: (num_layers, num_kv_heads, head_dim, sliding_window, model_dtype, bytes_per_token)
COMPLETE = {
    # GQA, 8 of 32 heads: 2 x 32 x 8 x 128 x 2 B (bf16) = 131072 (128 KiB)
    "llama-3.1-8b": (32, 8, 128, None, "bfloat16", 2 * 32 * 8 * 128 * 2),
    # 2 x 80 x 8 x (8192 / 64 = 128) x 2 B = 327680 (320 KiB)
    "llama-3.1-70b": (80, 8, 128, None, "bfloat16", 2 * 80 * 8 * 128 * 2),
    # sliding window 4096: 2 x 32 x 8 x 128 x 2 B = 131072
    "mistral-7b-v0.1": (32, 8, 128, 4096, "bfloat16", 2 * 32 * 8 * 128 * 2),
    # MoE changes no attention: 2 x 32 x 8 x 128 x 2 B = 131072; sliding_window null
    "mixtral-8x7b-v0.1": (32, 8, 128, None, "bfloat16", 2 * 32 * 8 * 128 * 2),
    # 2 x 24 x 2 x (896 / 14 = 64) x 2 B = 12288 (12 KiB); use_sliding_window false
    "qwen2.5-0.5b": (24, 2, 64, None, "bfloat16", 2 * 24 * 2 * 64 * 2),
    # 2 x 28 x 4 x (3584 / 28 = 128) x 2 B = 57344 (56 KiB)
    "qwen2.5-7b": (28, 4, 128, None, "bfloat16", 2 * 28 * 4 * 128 * 2),
    # qwen2_moe: 2 x 28 x 4 x 128 x 2 B = 57344
    "qwen2-57b-a14b": (28, 4, 128, None, "bfloat16", 2 * 28 * 4 * 128 * 2),
    # 2 x 36 x 8 x 128 x 2 B = 147456 (144 KiB)
    "qwen3-8b": (36, 8, 128, None, "bfloat16", 2 * 36 * 8 * 128 * 2),
    # qwen3_moe, head_dim 128 given (hidden / heads would be 2048 / 32 = 64): 2 x 48 x 4 x 128 x 2 B = 98304
    "qwen3-30b-a3b": (48, 4, 128, None, "bfloat16", 2 * 48 * 4 * 128 * 2),
    # gemma head_dim 256 (hidden / heads would be 192): 2 x 28 x 16 x 256 x 2 B = 458752 (448 KiB)
    "gemma-7b": (28, 16, 256, None, "bfloat16", 2 * 28 * 16 * 256 * 2),
    # 2 x 42 x 8 x 256 x 2 B = 344064 (336 KiB); sliding window 4096 on alternate layers
    "gemma-2-9b-it": (42, 8, 256, 4096, "bfloat16", 2 * 42 * 8 * 256 * 2),
    # gemma3_text, MQA: 2 x 26 x 1 x 256 x 2 B = 26624 (26 KiB)
    "gemma-3-1b-it": (26, 1, 256, 512, "bfloat16", 2 * 26 * 1 * 256 * 2),
    # phi3, MHA: 2 x 32 x 32 x (3072 / 32 = 96) x 2 B = 393216 (384 KiB)
    "phi-3-mini-4k-instruct": (32, 32, 96, 2047, "bfloat16", 2 * 32 * 32 * 96 * 2),
    # n_layer / n_head / n_embd, no torch_dtype -> bfloat16 (vLLM: float32, cast down):
    # 2 x 12 x 12 x (768 / 12 = 64) x 2 B = 36864
    "gpt2": (12, 12, 64, None, None, 2 * 12 * 12 * 64 * 2),
    # gpt_neox: 2 x 24 x 16 x (2048 / 16 = 128) x 2 B (float16) = 196608 (192 KiB)
    "pythia-1.4b": (24, 16, 128, None, "float16", 2 * 24 * 16 * 128 * 2),
    # gptj, no torch_dtype -> bfloat16: 2 x 28 x 16 x (4096 / 16 = 256) x 2 B = 458752 (448 KiB)
    "gpt-j-6b": (28, 16, 256, None, None, 2 * 28 * 16 * 256 * 2),
    # falcon multi_query: 1 KV head of (4544 / 71 = 64): 2 x 32 x 1 x 64 x 2 B = 8192 (8 KiB)
    "falcon-7b": (32, 1, 64, None, "bfloat16", 2 * 32 * 1 * 64 * 2),
    # falcon new_decoder_architecture: num_kv_heads 8 of (8192 / 128 = 64): 2 x 60 x 8 x 64 x 2 B = 122880
    "falcon-40b": (60, 8, 64, None, "bfloat16", 2 * 60 * 8 * 64 * 2),
    # MLA: 27 x (512 + 64) x 2 B = 31104
    "deepseek-v2-lite": (27, 16, 576, None, "bfloat16", 27 * (512 + 64) * 2),
    # MLA: 61 x (512 + 64) x 2 B = 70272
    "deepseek-v3": (61, 128, 576, None, "bfloat16", 61 * (512 + 64) * 2),
    # qwen2_vl (flat): 2 x 28 x 4 x 128 x 2 B = 57344
    "qwen2-vl-7b-instruct": (28, 4, 128, None, "bfloat16", 2 * 28 * 4 * 128 * 2),
    # 2 x 30 x 3 x (576 / 9 = 64) x 2 B = 23040
    "smollm2-135m": (30, 3, 64, None, "bfloat16", 2 * 30 * 3 * 64 * 2),
    # hybrid (layer kinds in tests/test_hybrid_spec.py): gemma3 text_config: 2 x 62 x 16 x 128 x 2 B = 507904
    "gemma-3-27b-it": (62, 16, 128, 1024, "bfloat16", 2 * 62 * 16 * 128 * 2),
    # gpt_oss names no dtype -> bfloat16 (as vLLM runs it): 2 x 24 x 8 x 64 x 2 B = 49152
    "gpt-oss-20b": (24, 8, 64, 128, None, 2 * 24 * 8 * 64 * 2),
    # llama4 text_config, chunked layers but no sliding window: 2 x 48 x 8 x 128 x 2 B = 196608
    "llama-4-scout-17b-16e": (48, 8, 128, None, "bfloat16", 2 * 48 * 8 * 128 * 2),
    # cohere2: 2 x 32 x 8 x 128 x 2 B = 131072
    "c4ai-command-r7b-12-2024": (32, 8, 128, 4096, "bfloat16", 2 * 32 * 8 * 128 * 2),
}

# Configs that leave sizes out (transformers' defaults fill them): (missing field, expected as above)
SPARSE = {
    # llava text_config names no sizes: LlamaConfig defaults 32 layers, 32 heads, hidden 4096 (vicuna-7b):
    # 2 x 32 x 32 x 128 x 2 B (float16) = 524288 (512 KiB)
    "llava-1.5-7b-hf": ("num_hidden_layers", (32, 32, 128, None, "float16", 2 * 32 * 32 * 128 * 2)),
    # gemma3 text_config without heads: Gemma3TextConfig defaults 8 heads, 4 KV heads, head_dim 256:
    # 2 x 34 x 4 x 256 x 2 B (bf16 from the wrapper) = 139264 (136 KiB)
    "gemma-3-4b-it": ("num_attention_heads", (34, 4, 256, 1024, "bfloat16", 2 * 34 * 4 * 256 * 2)),
    # gemma3 text_config without head_dim: default 256 (not 3840 / 16 = 240): 2 x 48 x 8 x 256 x 2 B = 393216
    "gemma-3-12b-it": ("head_dim", (48, 8, 256, 1024, "bfloat16", 2 * 48 * 8 * 256 * 2)),
}


def _fields(expected):
    layers, kv_heads, head_dim, window, dtype, _ = expected
    return layers, kv_heads, head_dim, window, dtype


def _got(fields):
    return (fields["num_layers"], fields["num_kv_heads"], fields["head_dim"], fields["sliding_window"],
            fields["model_dtype"])


@pytest.fixture
def no_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError


def test_at_least_twelve_real_configs():
    assert len(COMPLETE) + len(SPARSE) >= 12
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(COMPLETE) | set(SPARSE)


@pytest.mark.parametrize("name", sorted(COMPLETE))
def test_complete_configs_parse_without_transformers(name, no_transformers):
    expected = COMPLETE[name]
    assert _got(read_kv_fields(CONFIGS / f"{name}.json")) == _fields(expected)
    assert KVCacheSpec.from_hf_config(CONFIGS / f"{name}.json").bytes_per_token == expected[-1]


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_configs_take_transformers_defaults(name):
    pytest.importorskip("transformers")
    expected = SPARSE[name][1]
    assert _got(read_kv_fields(CONFIGS / f"{name}.json")) == _fields(expected)
    assert KVCacheSpec.from_hf_config(CONFIGS / f"{name}.json").bytes_per_token == expected[-1]


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_configs_without_transformers_name_the_missing_field(name, no_transformers):
    with pytest.raises(ConfigError, match=SPARSE[name][0]) as info:
        read_kv_fields(CONFIGS / f"{name}.json")
    assert "transformers" in str(info.value)


LLAMA_LIKE = ["llama-3.1-8b", "qwen3-30b-a3b", "gemma-7b", "gemma-2-9b-it", "mixtral-8x7b-v0.1",
              "phi-3-mini-4k-instruct", "qwen2-57b-a14b", "llava-1.5-7b-hf", "gemma-3-12b-it"]


@pytest.mark.parametrize("name", LLAMA_LIKE)
def test_agrees_with_transformers_own_config(name):
    transformers = pytest.importorskip("transformers")
    raw = load_config(CONFIGS / f"{name}.json")
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    text = transformers.AutoConfig.for_model(raw["model_type"], **kwargs).get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    fields = read_kv_fields(raw)
    assert (fields["num_layers"], fields["num_kv_heads"], fields["head_dim"]) == (
        text.num_hidden_layers, text.num_key_value_heads, head_dim)


def test_mla_fields():
    fields = read_kv_fields(CONFIGS / "deepseek-v3.json")
    assert (fields["attention"], fields["kv_lora_rank"], fields["qk_rope_head_dim"]) == ("mla", 512, 64)
    assert read_kv_fields(CONFIGS / "llama-3.1-8b.json")["attention"] == "mha"


def test_tp_on_real_configs():
    # Llama-3.1-70B tp 8: 8 / 8 = 1 KV head per rank: 2 x 80 x 1 x 128 x 2 B = 40960
    assert KVCacheSpec.from_hf_config(CONFIGS / "llama-3.1-70b.json", tp_size=8).bytes_per_token == 40960
    # tp 16 > 8 KV heads: each rank holds 1 replicated head, still 40960
    assert KVCacheSpec.from_hf_config(CONFIGS / "llama-3.1-70b.json", tp_size=16).bytes_per_token == 40960
    # Qwen2.5-7B, 4 KV heads: tp 8 replicates (1 per rank): 2 x 28 x 1 x 128 x 2 B = 14336; tp 3 cannot split
    assert KVCacheSpec.from_hf_config(CONFIGS / "qwen2.5-7b.json", tp_size=8).bytes_per_token == 14336
    with pytest.raises(ConfigError, match="tp_size 3.*num_kv_heads 4"):
        KVCacheSpec.from_hf_config(CONFIGS / "qwen2.5-7b.json", tp_size=3)
    with pytest.raises(ConfigError, match="tp_size 6.*num_kv_heads 4"):
        KVCacheSpec.from_hf_config(CONFIGS / "qwen2.5-7b.json", tp_size=6)
    # DeepSeek-V3 MLA at tp 8: the latent is not split, 70272 per rank
    assert KVCacheSpec.from_hf_config(CONFIGS / "deepseek-v3.json", tp_size=8).bytes_per_token == 70272


def test_fp8_on_real_configs():
    # Llama-3.1-8B fp8: 2 x 32 x 8 x 128 x 1 B = 65536; DeepSeek-V3 fp8: 61 x 576 x 1 B = 35136
    spec = KVCacheSpec.from_hf_config(CONFIGS / "llama-3.1-8b.json", kv_cache_dtype="fp8")
    assert (spec.dtype, spec.bytes_per_token) == (torch.float8_e4m3fn, 65536)
    mla = KVCacheSpec.from_hf_config(CONFIGS / "deepseek-v3.json", kv_cache_dtype="fp8_e5m2")
    assert mla.bytes_per_token == 35136


def test_unknown_kv_dtype_on_a_config():
    with pytest.raises(ConfigError, match="accepted: auto, float16"):
        KVCacheSpec.from_hf_config(CONFIGS / "gpt2.json", kv_cache_dtype="int8")


def test_folder_holding_config_json(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "qwen2.5-0.5b.json").read_text())
    assert KVCacheSpec.from_hf_config(tmp_path).bytes_per_token == 12288
    assert KVCacheSpec.from_hf_config(str(tmp_path)).bytes_per_token == 12288


def test_unreadable_configs(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        read_kv_fields(tmp_path)  # a folder without config.json
    with pytest.raises(ConfigError, match="no config file"):
        read_kv_fields(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        read_kv_fields(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not an object"):
        read_kv_fields(tmp_path / "list.json")


LLAMA_SMALL = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}


def test_kv_heads_default_to_query_heads_and_head_dim_to_hidden_over_heads():
    fields = read_kv_fields(LLAMA_SMALL)
    assert (fields["num_kv_heads"], fields["head_dim"]) == (4, 16)
    assert read_kv_fields({**LLAMA_SMALL, "num_key_value_heads": None})["num_kv_heads"] == 4


def test_unknown_model_type_is_read_with_llama_names():
    fields = read_kv_fields({**LLAMA_SMALL, "model_type": "someone_new", "num_key_value_heads": 2})
    assert (fields["num_layers"], fields["num_kv_heads"], fields["head_dim"]) == (2, 2, 16)


def test_hidden_not_a_multiple_of_heads(no_transformers):
    with pytest.raises(ConfigError, match="hidden_size 66 is not a multiple of num_attention_heads 4"):
        read_kv_fields({**LLAMA_SMALL, "hidden_size": 66})


@pytest.mark.parametrize("drop", ["num_hidden_layers", "num_attention_heads", "hidden_size"])
def test_missing_field_without_transformers(drop, no_transformers):
    config = {k: v for k, v in LLAMA_SMALL.items() if k != drop}
    with pytest.raises(ConfigError, match=drop):
        read_kv_fields(config)


def test_missing_field_of_a_type_transformers_does_not_know():
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match="num_hidden_layers.*no config class"):
        read_kv_fields({"model_type": "not_a_real_model", "num_attention_heads": 4, "hidden_size": 64})


def test_gemma_head_dim_is_never_hidden_over_heads(no_transformers):
    with pytest.raises(ConfigError, match="head_dim"):
        read_kv_fields({**LLAMA_SMALL, "model_type": "gemma"})


def test_falcon_variants():
    base = {"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64}
    assert read_kv_fields({**base, "multi_query": True})["num_kv_heads"] == 1
    assert read_kv_fields({**base, "multi_query": False})["num_kv_heads"] == 8
    assert read_kv_fields({**base, "new_decoder_architecture": True, "num_kv_heads": 2})["num_kv_heads"] == 2
    # the pre-transformers RefinedWebModel falcon-7b config: n_layer / n_head / n_embed, multi_query
    legacy = {"model_type": "RefinedWebModel", "n_layer": 32, "n_head": 71, "n_embed": 4544,
              "multi_query": True, "torch_dtype": "bfloat16"}
    assert KVCacheSpec.from_hf_config(legacy).bytes_per_token == 2 * 32 * 1 * 64 * 2


def test_sliding_window_switch():
    qwen = {**LLAMA_SMALL, "model_type": "qwen2", "sliding_window": 4096}
    assert read_kv_fields({**qwen, "use_sliding_window": False})["sliding_window"] is None
    assert read_kv_fields({**qwen, "use_sliding_window": True})["sliding_window"] == 4096
    assert read_kv_fields({**qwen, "sliding_window": None})["sliding_window"] is None


def test_wrapper_dtype_is_found_where_vllm_looks():
    # vLLM's _find_dtype (vllm/config/model.py): the config's own dtype, else text_config's, else
    # vision_config's; float32 found there is cast down to bfloat16 by dtype=auto
    text = {**LLAMA_SMALL, "torch_dtype": "float16"}
    top = read_kv_fields({"model_type": "llava", "text_config": text, "torch_dtype": "float32"})
    assert top["model_dtype"] == "float32"
    assert KVCacheSpec.from_hf_config({"model_type": "llava", "text_config": text,
                                       "torch_dtype": "float32"}).dtype == torch.bfloat16
    assert read_kv_fields({"model_type": "llava", "text_config": text})["model_dtype"] == "float16"
    vision = {"model_type": "llava", "text_config": LLAMA_SMALL, "vision_config": {"torch_dtype": "float16"}}
    assert read_kv_fields(vision)["model_dtype"] == "float16"
    # transformers 5 writes `dtype`
    wrapped = {"model_type": "llava", "text_config": {**LLAMA_SMALL, "dtype": "bfloat16"}, "dtype": "float16"}
    spec = KVCacheSpec.from_hf_config(wrapped)
    # 2 x 2 x 4 x 16 x 2 B (float16, the config's own) = 512
    assert (spec.dtype, spec.bytes_per_token) == (torch.float16, 512)


def test_dict_is_not_modified():
    config = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    before = json.dumps(config, sort_keys=True)
    KVCacheSpec.from_hf_config(config)
    assert json.dumps(config, sort_keys=True) == before


# ---- a size is an integer >= 1 wherever it comes from (issue 9, item 2) ------------------------------------



@pytest.mark.parametrize("value", [0, -8, "8", 8.0, True], ids=["zero", "negative", "str", "float", "bool"])
@pytest.mark.parametrize("config, key", [
    ({**LLAMA_SMALL, "num_key_value_heads": 2}, "num_key_value_heads"),  # was `x or num_heads`: 4x the KV
    (LLAMA_SMALL, "num_hidden_layers"),
    (LLAMA_SMALL, "num_attention_heads"),
    (LLAMA_SMALL, "hidden_size"),
    ({**LLAMA_SMALL, "head_dim": 16}, "head_dim"),
    ({"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64,
      "new_decoder_architecture": True, "num_kv_heads": 2}, "num_kv_heads"),  # Falcon's own name
    ({"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 8, "kv_lora_rank": 512,
      "qk_rope_head_dim": 64}, "kv_lora_rank"),
    ({**LLAMA_SMALL, "model_type": "mistral", "sliding_window": 4096}, "sliding_window"),
], ids=["kv_heads", "layers", "heads", "hidden", "head_dim", "falcon_kv_heads", "kv_lora_rank", "window"])
def test_zero_negative_or_non_integer_sizes_are_config_errors(config, key, value):
    with pytest.raises(ConfigError, match=f"'{key}' must be an integer"):
        read_kv_fields({**config, key: value})


@pytest.mark.parametrize("value", [0, "x", -1])
def test_bad_sizes_are_named_before_transformers_fills_the_rest(value):
    """The file leaves num_hidden_layers out (transformers would fill it) and has a bad head count: the
    error names the file's field, not whatever transformers' config class raises on it."""
    pytest.importorskip("transformers")
    config = {k: v for k, v in LLAMA_SMALL.items() if k != "num_hidden_layers"}
    with pytest.raises(ConfigError, match="'num_attention_heads' must be an integer"):
        read_kv_fields({**config, "num_attention_heads": value})


def test_sizes_filled_by_transformers_are_checked_too(monkeypatch):
    """A default that comes back zero from transformers' config class is refused like a zero in the file."""
    pytest.importorskip("transformers")
    import kvpool.spec.hf_config as hf

    monkeypatch.setattr(hf, "_filled_from_transformers", lambda config, missing: {**config,
                                                                                 "num_hidden_layers": 0})
    with pytest.raises(ConfigError, match="'num_hidden_layers' must be an integer"):
        read_kv_fields({k: v for k, v in LLAMA_SMALL.items() if k != "num_hidden_layers"})


def test_qk_rope_head_dim_may_be_zero():
    fields = read_kv_fields({"model_type": "deepseek_v2", "num_hidden_layers": 2, "num_attention_heads": 8,
                             "kv_lora_rank": 512, "qk_rope_head_dim": 0})
    assert fields["head_dim"] == 512


@pytest.mark.parametrize("text, why", [
    ('{"num_hidden_layers": ' + "1" * 5000 + "}", "4300 digits"),  # Python's int parsing limit
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (b"\xff\xfe{}", "cannot read"),
])
def test_hostile_json_is_a_config_error(tmp_path, text, why):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=why):
        read_kv_fields(path)


def test_query_heads_are_read_and_label_the_attention():
    # llama-3.1-8b: 32 query heads, 8 KV heads (GQA); phi-3: 32 and 32 (MHA); falcon-7b: 71 and 1 (MQA)
    labels = {name: KVCacheSpec.from_hf_config(CONFIGS / f"{name}.json").attention_label
              for name in ("llama-3.1-8b", "phi-3-mini-4k-instruct", "falcon-7b", "deepseek-v3")}
    assert labels == {"llama-3.1-8b": "GQA", "phi-3-mini-4k-instruct": "MHA", "falcon-7b": "MQA",
                      "deepseek-v3": "MLA"}


# built-in name: the file of tests/configs it ships (the published config)
BUILT_IN_SOURCES = {
    "deepseek-v2-lite": "deepseek-v2-lite", "deepseek-v3": "deepseek-v3", "gemma-2-9b": "gemma-2-9b-it",
    "gemma-3-1b": "gemma-3-1b-it", "gemma-3-4b": "gemma-3-4b-it", "gemma-3-12b": "gemma-3-12b-it",
    "gemma-3-27b": "gemma-3-27b-it", "gpt-oss-20b": "gpt-oss-20b", "llama-3.1-8b": "llama-3.1-8b",
    "llama-3.1-70b": "llama-3.1-70b", "llama-4-scout": "llama-4-scout-17b-16e",
    "mistral-7b-v0.1": "mistral-7b-v0.1", "mixtral-8x7b": "mixtral-8x7b-v0.1",
    "phi-3-mini-4k": "phi-3-mini-4k-instruct", "qwen2.5-0.5b": "qwen2.5-0.5b", "qwen2.5-7b": "qwen2.5-7b",
    "qwen3-8b": "qwen3-8b", "qwen3-30b-a3b": "qwen3-30b-a3b", "smollm2-135m": "smollm2-135m",
    "qwen3-next-80b-a3b": "hybrid/qwen3-next-80b-a3b-instruct",
}


def test_built_in_configs_are_the_package_data():
    from kvpool.spec.hf_config import BUILTIN_CONFIGS, BUILTIN_DIR

    assert {p.stem for p in BUILTIN_DIR.glob("*.json")} == set(BUILTIN_CONFIGS) == set(BUILT_IN_SOURCES)


@pytest.mark.parametrize("name", sorted(BUILT_IN_SOURCES))
def test_a_built_in_config_is_the_published_one(name, no_transformers):
    from kvpool.spec.hf_config import config_path

    source = CONFIGS / f"{BUILT_IN_SOURCES[name]}.json"
    assert config_path(name).parent.name == "configs" and config_path(name).parent.parent.name == "kvpool"
    if BUILT_IN_SOURCES[name] in SPARSE:  # the published file leaves sizes to transformers' defaults
        return
    assert load_config(name) == load_config(source)
    assert read_kv_fields(name) == read_kv_fields(source)


@pytest.mark.parametrize("name", ["gemma-3-4b", "gemma-3-12b"])
def test_built_in_gemma_3_writes_out_transformers_defaults(name):
    # the built-in reads without transformers what the published file reads with transformers' defaults
    pytest.importorskip("transformers")
    with_defaults = read_kv_fields(CONFIGS / f"{BUILT_IN_SOURCES[name]}.json")
    saved = sys.modules.get("transformers")
    sys.modules["transformers"] = None
    try:
        on_its_own = read_kv_fields(name)
    finally:
        sys.modules["transformers"] = saved
    assert on_its_own == with_defaults


def test_a_path_wins_over_a_built_in_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-0.5b").write_text((CONFIGS / "llama-3.1-8b.json").read_text())
    assert read_kv_fields("qwen2.5-0.5b")["num_layers"] == 32  # the file here, not the built-in's 24
    with pytest.raises(ConfigError, match="no config file at mistral-7b; .*built-in config: .*mistral-7b-v0"):
        load_config("mistral-7b")


def test_layer_counts_are_bounded_before_anything_is_built():
    from kvpool.spec.hf_config import MAX_LAYERS

    base = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64}
    assert read_kv_fields({**base, "num_hidden_layers": MAX_LAYERS})["num_layers"] == MAX_LAYERS
    for key, model_type in (("num_hidden_layers", "llama"), ("n_layer", "gpt2")):
        config = {**base, "model_type": model_type, "n_head": 4, "n_embd": 64, key: MAX_LAYERS + 1}
        with pytest.raises(ConfigError, match=f"'{key}' is 65,537: more layers than any model has"):
            read_kv_fields(config)
    # a sparse config goes to transformers (whose config class builds per-layer lists) only after the check
    sparse = {"model_type": "gemma3_text", "num_hidden_layers": 2**31 - 1, "sliding_window": 512}
    with pytest.raises(ConfigError, match="2,147,483,647: more layers"):
        read_kv_fields(sparse)

"""HybridSpec / RecurrentStateSpec on the published configs of tests/configs/hybrid/ and on bad input.

Every expected size is worked out by hand from the config values (bf16 = 2 B, float32 = 4 B; conv states
keep K - 1 columns): layers x (conv channels x (K - 1) + SSM elements) x dtype bytes for the state, and
attention layers x 2 x KV heads x head_dim x dtype bytes (MLA: layers x (kv_lora_rank + qk_rope_head_dim) x
dtype bytes) per token. The layer roles are checked against transformers' own config classes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpool.errors import ConfigError
from kvpool.spec.state import (
    LAYER_TYPE_ROLES,
    HybridSpec,
    LayerRole,
    RecurrentKind,
    RecurrentStateSpec,
    is_recurrent_config,
)

HYBRID = Path(__file__).parent / "configs" / "hybrid"
MiB = 2**20

# file: (kind, recurrent layers, attention layers, state bytes per request, KV bytes per token)
PUBLISHED = {
    # 36 GDN: conv (2 x 16 x 128 + 32 x 128 = 8192) x 3, ssm 32 x 128 x 128; 12 full layers, 2 KV heads x 256
    "qwen3-next-80b-a3b-instruct": (RecurrentKind.GATED_DELTA_NET, 36, 12,
                                    36 * (8192 * 3 + 32 * 128 * 128) * 2, 12 * 2 * 2 * 256 * 2),
    # Mamba-1 on 2 x 4096 = 8192 channels, d_state 16; attention every 8th layer from 4: 4 layers of 8 x 128
    "jamba-v0.1": (RecurrentKind.MAMBA1, 28, 4, 28 * (8192 * 3 + 8192 * 16) * 2, 4 * 2 * 8 * 128 * 2),
    # KDA: 20 layers, conv 3 x 32 x 128 = 12288, state 32 x 128 x 128; 7 MLA layers of 512 + 64 latent
    "kimi-linear-48b-a3b-instruct": (RecurrentKind.KIMI_DELTA, 20, 7,
                                     20 * (12288 * 3 + 32 * 128 * 128) * 2, 7 * (512 + 64) * 2),
    # Mamba-2: 128 heads x 80 = 10240 + 2 x 8 groups x 128 = 12288 conv channels, ssm 128 x 80 x 128
    "nvidia-nemotron-nano-9b-v2": (RecurrentKind.MAMBA2, 27, 4,
                                   27 * (12288 * 3 + 128 * 80 * 128) * 2, 4 * 2 * 8 * 128 * 2),
    # Mamba-2: 2 x 2048 = 4096 = 64 heads x 64, + 2 x 1 x 128 = 4352 conv; head_dim 2048 / 32 = 64
    "granite-4.0-h-micro": (RecurrentKind.MAMBA2, 36, 4, 36 * (4352 * 3 + 64 * 64 * 128) * 2,
                            4 * 2 * 8 * 64 * 2),
    # short convs of width conv_L_cache 3 over 2048 channels, no SSM; 8 attention layers, 2048 / 32 = 64
    "lfm2.5-2.6b": (RecurrentKind.SHORT_CONV, 22, 8, 22 * 2048 * 2 * 2, 8 * 2 * 8 * 64 * 2),
    # text_config; the config names mamba_ssm_dtype float32: conv bf16 (8192 x 3 x 2 B), ssm fp32 (x 4 B)
    "qwen3.5-9b": (RecurrentKind.GATED_DELTA_NET, 24, 8, 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4),
                   8 * 2 * 4 * 256 * 2),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs(name: str) -> None:
    kind, n_rec, n_attn, state_bytes, kv_bytes = PUBLISHED[name]
    spec = HybridSpec.from_hf_config(HYBRID / f"{name}.json")
    assert (spec.state.kind, spec.state.num_layers, spec.attention.num_layers) == (kind, n_rec, n_attn)
    assert spec.state_bytes_per_request == state_bytes
    assert spec.kv_bytes_per_token == kv_bytes
    assert spec.kv_token_equivalent == state_bytes / kv_bytes
    assert is_recurrent_config(HYBRID / f"{name}.json")


def test_the_issue_figures() -> None:
    # issue 21 and DESIGN.md: Qwen3-Next 37.7 MiB = ~1,608 tokens of KV, Jamba-v0.1 8.3 MiB = 532 tokens
    qwen = HybridSpec.from_hf_config(HYBRID / "qwen3-next-80b-a3b-instruct.json")
    assert round(qwen.state_bytes_per_request / MiB, 1) == 37.7 and qwen.kv_token_equivalent == 1608
    jamba = HybridSpec.from_hf_config(HYBRID / "jamba-v0.1.json")
    assert round(jamba.state_bytes_per_request / MiB, 1) == 8.3 and jamba.kv_token_equivalent == 532
    # Kimi Linear as published: 20 KDA + 7 MLA -> 21.4 MiB, 2,783 tokens (the issue's 22.5 MiB / 3,410 is
    # KimiLinearConfig's default layout, checked below)
    kimi = HybridSpec.from_hf_config(HYBRID / "kimi-linear-48b-a3b-instruct.json")
    assert round(kimi.state_bytes_per_request / MiB, 1) == 21.4 and round(kimi.kv_token_equivalent) == 2783


def test_kimi_default_config_gives_the_issue_figure() -> None:
    transformers = pytest.importorskip("transformers")
    # KimiLinearConfig(): 27 layers, layer i > 0 with i % 4 == 0 full (6), 21 KDA; no dtype named -> say bf16
    config = transformers.KimiLinearConfig().to_dict()
    spec = HybridSpec.from_hf_config(config, kv_cache_dtype="bfloat16", conv_dtype="bfloat16")
    assert spec.state_bytes_per_request == 21 * (12288 * 3 + 32 * 128 * 128) * 2  # 22.48 MiB
    assert spec.kv_bytes_per_token == 6 * (512 + 64) * 2  # 6.75 KiB
    assert round(spec.state_bytes_per_request / MiB, 1) == 22.5 and round(spec.kv_token_equivalent) == 3410


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_roles_match_transformers_config_classes(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    raw = json.loads((HYBRID / f"{name}.json").read_text())
    config = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                                     if k != "model_type"})
    types = config.get_text_config(decoder=True).layer_types
    assert HybridSpec.from_hf_config(raw).roles == tuple(LAYER_TYPE_ROLES[t] for t in types)


def test_ssm_dtype_auto_reads_the_config_and_can_be_overridden() -> None:
    raw = json.loads((HYBRID / "qwen3.5-9b.json").read_text())
    assert HybridSpec.from_hf_config(raw).state.ssm_dtype == torch.float32
    bf16 = HybridSpec.from_hf_config(raw, ssm_dtype="bfloat16")
    assert bf16.state_bytes_per_request == 24 * (8192 * 3 + 32 * 128 * 128) * 2
    # no config field: the conv dtype (vLLM's "auto"); SGLang's default is float32
    qwen = HybridSpec.from_hf_config(HYBRID / "qwen3-next-80b-a3b-instruct.json", ssm_dtype="float32")
    assert qwen.state.ssm_bytes == 32 * 128 * 128 * 4 and qwen.state.conv_dtype == torch.bfloat16


def test_tensor_parallel_split() -> None:
    qwen = HybridSpec.from_hf_config(HYBRID / "qwen3-next-80b-a3b-instruct.json", tp_size=2)
    assert (qwen.state.conv_shape, qwen.state.ssm_shape) == ((4096, 3), (16, 128, 128))
    assert qwen.kv_bytes_per_token == 12 * 2 * 1 * 256 * 2
    # Nemotron-H at tp 16: 8 groups replicated to 16 (vLLM's extra_groups_for_head_shards), then split:
    # (10240 + 2 x 16 x 128) / 16 = 896 conv channels, 128 / 16 = 8 heads
    nemotron = HybridSpec.from_hf_config(HYBRID / "nvidia-nemotron-nano-9b-v2.json", tp_size=8)
    assert (nemotron.state.conv_shape, nemotron.state.ssm_shape) == (((10240 + 2 * 8 * 128) // 8, 3),
                                                                      (16, 80, 128))
    granite = HybridSpec.from_hf_config(HYBRID / "granite-4.0-h-micro.json", tp_size=4)
    assert granite.state.conv_shape == ((4096 + 2 * 4 * 128) // 4, 3)  # 1 group replicated to 4
    kimi = HybridSpec.from_hf_config(HYBRID / "kimi-linear-48b-a3b-instruct.json", tp_size=4)
    assert kimi.state.ssm_shape == (8, 128, 128) and kimi.kv_bytes_per_token == 7 * 576 * 2  # MLA: no split
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        HybridSpec.from_hf_config(HYBRID / "qwen3-next-80b-a3b-instruct.json", tp_size=32)
    with pytest.raises(ConfigError, match="n_groups"):
        HybridSpec.from_hf_config(HYBRID / "nvidia-nemotron-nano-9b-v2.json", tp_size=3)


def test_falcon_h1_layers_keep_both() -> None:
    config = {"model_type": "falcon_h1", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4,
              "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4}
    spec = HybridSpec.from_hf_config(config)
    assert spec.roles == (LayerRole.BOTH,) * 3 and spec.attention_layers == spec.state.layers == (0, 1, 2)
    assert spec.state.conv_shape == (64 + 2 * 8, 3) and spec.state.ssm_shape == (4, 16, 8)


def _qwen_next() -> dict:
    return json.loads((HYBRID / "qwen3-next-80b-a3b-instruct.json").read_text())


@pytest.mark.parametrize(("edit", "field"), [
    ({"linear_num_value_heads": None}, "linear_num_value_heads"),
    ({"linear_key_head_dim": 0}, "linear_key_head_dim"),
    ({"linear_value_head_dim": -128}, "linear_value_head_dim"),
    ({"linear_num_key_heads": True}, "linear_num_key_heads"),
    ({"linear_conv_kernel_dim": 4.0}, "linear_conv_kernel_dim"),
    ({"layer_types": ["linear_attention"] * 47 + ["sliding_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 47}, "num_hidden_layers"),
    ({"layer_types": ["full_attention"] * 48}, "no recurrent layer"),
    ({"model_type": "llama"}, "model_type"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
])
def test_bad_recurrent_configs_name_the_field(edit: dict, field: str) -> None:
    config = {**_qwen_next(), **edit}
    if edit.get("linear_num_value_heads", 1) is None:
        del config["linear_num_value_heads"]
    with pytest.raises(ConfigError, match=field):
        HybridSpec.from_hf_config(config)


def test_bad_family_fields_name_the_field() -> None:
    jamba = json.loads((HYBRID / "jamba-v0.1.json").read_text())
    with pytest.raises(ConfigError, match="mamba_d_state"):
        HybridSpec.from_hf_config({**jamba, "mamba_d_state": 0})
    nemotron = json.loads((HYBRID / "nvidia-nemotron-nano-9b-v2.json").read_text())
    with pytest.raises(ConfigError, match="hybrid_override_pattern"):
        HybridSpec.from_hf_config({**nemotron, "hybrid_override_pattern": "M-X*"})
    with pytest.raises(ConfigError, match="ssm_state_size"):
        HybridSpec.from_hf_config({k: v for k, v in nemotron.items() if k != "ssm_state_size"})
    kimi = json.loads((HYBRID / "kimi-linear-48b-a3b-instruct.json").read_text())
    linear = kimi["linear_attn_config"]
    with pytest.raises(ConfigError, match="kda_layers"):
        HybridSpec.from_hf_config({**kimi, "linear_attn_config": {**linear, "kda_layers": [1, 2, 3]}})
    with pytest.raises(ConfigError, match="num_heads"):
        HybridSpec.from_hf_config({**kimi, "linear_attn_config": {**linear, "num_heads": 0}})
    lfm2 = json.loads((HYBRID / "lfm2.5-2.6b.json").read_text())
    with pytest.raises(ConfigError, match="conv_L_cache"):
        HybridSpec.from_hf_config({**lfm2, "conv_L_cache": 0})
    with pytest.raises(ConfigError, match="unknown layer type ''"):
        HybridSpec.from_hf_config({**lfm2, "layer_types": [""] * 30})


def test_state_dtypes_a_pool_cannot_hold() -> None:
    with pytest.raises(ConfigError, match="ssm_dtype"):
        HybridSpec.from_hf_config(_qwen_next(), ssm_dtype="int8")
    with pytest.raises(ConfigError, match="conv_dtype"):
        HybridSpec.from_hf_config(_qwen_next(), conv_dtype=torch.float8_e4m3fn)
    with pytest.raises(ConfigError, match="mamba_ssm_dtype"):
        HybridSpec.from_hf_config({**_qwen_next(), "mamba_ssm_dtype": "fp8"})


def test_state_spec_checks_itself() -> None:
    with pytest.raises(ConfigError, match="conv_shape"):
        RecurrentStateSpec(RecurrentKind.MAMBA2, (0,), (64, 4), (4, 16, 8), conv_kernel=4)
    with pytest.raises(ConfigError, match="layers"):
        RecurrentStateSpec(RecurrentKind.MAMBA2, (1, 1), (64, 3), (4, 16, 8))
    spec = RecurrentStateSpec(RecurrentKind.SHORT_CONV, (2, 0), (64, 2), (), torch.float32, torch.float32, 3)
    assert spec.layers == (0, 2) and spec.ssm_bytes == 0 and spec.bytes_per_request == 2 * 64 * 2 * 4
    assert not RecurrentStateSpec(RecurrentKind.MAMBA1, (0,), (8, 3), (8, 4)).resumes_multi_token
    assert not is_recurrent_config({"model_type": "llama"})

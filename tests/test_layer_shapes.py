"""Layers of several shapes and windows in one model: the spec, the config reader and the planner.

Configs: ``gemma4-text-defaults.json``, ``mimo-v2-flash-defaults.json`` and ``neomme-defaults.json`` are
``Gemma4TextConfig()``, ``MiMoV2FlashConfig()`` and NeoMME's config class defaults as transformers 5.24's
``save_pretrained`` writes them. Every expected number is worked out by hand in the comments (bf16: 2 B per
element; a layer-token takes ``KV heads x (K head_dim + V head_dim) x 2 B``). Shapes are also checked
against the layers transformers builds (an independent reader: the projections' widths). NeoMME is an
encoder (it serves no KV cache): its config stands here for a real ``per_layer_config`` with two windows.
"""

import json
from pathlib import Path

import pytest
import torch

from kvpool.cli import main
from kvpool.errors import ConfigError
from kvpool.spec import KVCacheSpec, LayerKind, LayerShape
from kvpool.spec.hf_config import read_kv_fields
from kvpool.spec.planner import MemoryReadings, plan_pool

CONFIGS = Path(__file__).parent / "configs" / "layer_shapes"
F, S = LayerKind.FULL, LayerKind.SLIDING
GiB = 2**30


def spec_of(name: str, **kwargs) -> KVCacheSpec:
    return KVCacheSpec.from_hf_config(CONFIGS / f"{name}.json", **kwargs)


def test_gemma4_defaults_by_hand():
    spec = spec_of("gemma4-text-defaults")
    # 30 layers, full at 5, 11, 17, 23, 29 (pattern 6); sliding: 4 KV heads x 256, full: 4 x 512
    # (global_head_dim)
    full = [5, 11, 17, 23, 29]
    assert [spec.layer_shape(layer).head_dim for layer in range(30)] == [512 if i in full else 256
                                                                           for i in range(30)]
    # sliding layer-token 4 x (256 + 256) x 2 = 4,096 B; full 4 x (512 + 512) x 2 = 8,192 B
    assert {spec.layer_bytes_per_token(i) for i in full} == {8192}
    assert spec.layer_bytes_per_token(0) == 4096
    # 25 x 4,096 + 5 x 8,192 = 102,400 + 40,960
    assert spec.bytes_per_token == 143360
    # group bytes per token: sliding 25 x 4,096 = 102,400, full 5 x 8,192 = 40,960 (the fewer: >= 1.5x);
    # T = 40,960 (a multiple of lcm(4,096, 8,192)): full 5 slots, sliding 10 -> cdiv(25, 10) = 3 groups
    assert [(g.kind, len(g.layers), g.slots) for g in spec.groups] == [(S, 9, 10), (S, 8, 10), (S, 8, 10),
                                                                      (F, 5, 5)]
    assert spec.groups[3].layers == tuple(full)
    assert spec.groups[0].layers == (0, 3, 7, 10, 14, 18, 21, 25, 28)  # sliding layers[0::3]
    # one block: 40,960 x 16 = 655,360 B in every group; padding: 1 x 4,096 x 16 and 2 x 4,096 x 16
    assert {g.bytes_per_block for g in spec.groups} == {spec.bytes_per_block} == {655360}
    assert [g.padding_bytes_per_block for g in spec.groups] == [65536, 131072, 131072, 0]
    with pytest.raises(ConfigError, match="differ in KV bytes"):
        spec.bytes_per_layer_token  # noqa: B018 - no single per-layer size


def test_mimo_defaults_by_hand():
    spec = spec_of("mimo-v2-flash-defaults")
    # 48 layers: layer 0 and every 6th full (0, 5, 11, ..., 47: 9), 39 sliding (W 129); K 192, V 128;
    # sliding layers have 2 x 4 = 8 KV heads (the modeling code), full 4
    assert spec.layer_shape(0) == LayerShape(4, 192, 128)
    assert spec.layer_shape(1) == LayerShape(8, 192, 128)
    # full 4 x (192 + 128) x 2 = 2,560 B; sliding 8 x 320 x 2 = 5,120 B (not 2 x 192 per head: V is narrower)
    assert (spec.layer_bytes_per_token(0), spec.layer_bytes_per_token(1)) == (2560, 5120)
    # 9 x 2,560 + 39 x 5,120 = 23,040 + 199,680
    assert spec.bytes_per_token == 222720
    # full 23,040 B per token (the fewer), rounded up to lcm(2,560, 5,120) = 5,120: T = 25,600:
    # full 10 slots (9 layers + 1 padding), sliding 5 -> cdiv(39, 5) = 8 groups (the last of 4)
    assert [(g.kind, len(g.layers), g.slots) for g in spec.groups] == [(F, 9, 10)] + [(S, 5, 5)] * 7 + [
        (S, 4, 5)]
    assert spec.bytes_per_block == 25600 * 16 == 409600
    assert spec.groups[0].window is None and spec.groups[1].window == 129


def test_two_sliding_windows_by_hand():
    spec = spec_of("neomme-defaults")
    # 17 layers: full 5, 11, 16; sliding ones alternate W 256 and 1024 (per_layer_config)
    assert [spec.layer_window(i) for i in range(4)] == [256, 1024, 256, 1024]
    assert spec.layer_window(5) is None
    # every layer 4 KV heads x 64: 4 x 128 x 2 = 1,024 B; 17 layers
    assert spec.bytes_per_token == 17 * 1024
    # keys: W 256 (7 layers), W 1024 (7), full (3): size 3 -> 3 + 3 + 1 groups of 3 slots
    assert [(g.window, len(g.layers)) for g in spec.groups] == [(256, 3), (256, 2), (256, 2), (1024, 3),
                                                                (1024, 2), (1024, 2), (None, 3)]
    assert spec.bytes_per_block == 3 * 1024 * 16
    # per request of 32,768 tokens at T = 256 per step: W 256: cdiv(256 + 254, 16) + 1 = 33 blocks;
    # W 1024: cdiv(1278, 16) + 1 = 81; full 2,048: 3 x 33 + 3 x 81 + 2,048 = 2,390
    plan = plan_pool(spec, MemoryReadings(total_bytes=GiB, non_kv_bytes=0), max_model_len=32768)
    assert plan.blocks_per_request == 2390
    assert [g.blocks_per_request for g in plan.groups] == [33] * 3 + [81] * 3 + [2048]


def test_two_windows_by_hand_spec():
    # 4 layers: W 8, W 32, full, W 8; B 4, 2 KV heads x 8, float32: 2 x 2 x 8 x 4 = 128 B per layer-token
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                    "sliding_attention"], layer_windows=[8, 32, None, 8])
    # counts 2, 1, 1: 2 < 1.5 x 1 is false -> size 1: W 8 gets 2 groups of 1, ordered by first layer
    assert [(g.window, g.layers, g.slots) for g in spec.groups] == [(8, (0,), 1), (8, (3,), 1), (32, (1,), 1),
                                                                    (None, (2,), 1)]
    assert spec.bytes_per_block == 128 * 4
    plan = plan_pool(spec, MemoryReadings(total_bytes=1 << 20, non_kv_bytes=0), max_model_len=64)
    # W 8 at T = 256: min(16, cdiv(262, 4) + 1) = 16 (the whole request), so each group holds 16 blocks
    assert [g.blocks_per_request for g in plan.groups] == [16, 16, 16, 16]


def test_plan_sizes_gemma4_exactly():
    spec = spec_of("gemma4-text-defaults")
    plan = plan_pool(spec, MemoryReadings(total_bytes=80 * GiB, non_kv_bytes=20 * GiB), max_model_len=131072)
    # budget 72 GiB - 20 GiB = 52 GiB = 55,834,574,848 B // 655,360 = 85,196 blocks
    assert plan.num_blocks == 55834574848 // 655360 == 85196
    # per request: sliding W 512 at T 256: cdiv(766, 16) + 1 = 49 blocks in each of 3 groups; full 8,192
    assert plan.blocks_per_request == 3 * 49 + 8192
    # padding: 49 x (65,536 + 131,072 + 131,072) = 16,056,320 B
    assert plan.padding_bytes_per_request == 49 * 327680 == 16056320
    # every layer full: 8,192 blocks x 143,360 B x 16 tokens
    assert plan.all_full_bytes_per_request == 8192 * 143360 * 16
    assert [g.padding_bytes_per_block for g in plan.groups] == [65536, 131072, 131072, 0]
    assert [(g.head_dim, g.v_head_dim, g.slots) for g in plan.groups] == [(256, 256, 10)] * 3 + [
        (512, 512, 5)]


def test_cli_plan_shows_the_shapes_and_padding(capsys):
    args = ["plan", str(CONFIGS / "gemma4-text-defaults.json"), "--gpu-memory", "80GiB", "--non-kv-memory",
            "20GiB", "--max-model-len", "131072"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes_per_token"] == 143360 and data["bytes_per_block"] == 655360
    assert data["layer_shapes"] == [
        {"num_layers": 25, "num_kv_heads": 4, "head_dim": 256, "v_head_dim": 256, "bytes_per_token": 4096},
        {"num_layers": 5, "num_kv_heads": 4, "head_dim": 512, "v_head_dim": 512, "bytes_per_token": 8192}]
    assert [g["padding_bytes_per_block"] for g in data["groups"]] == [65536, 131072, 131072, 0]
    assert data["padding_bytes_per_request"] == 16056320
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "30 layers: 25 x 4 KV heads x 2 (K, V) x 256 + 5 x 4 KV heads x 2 (K, V) x 512 x 2 B" in text
    assert "4 KV heads x 512 in 5 slots" in text
    assert "of 4 KV heads x 256 in 10 slots + 2 padding (131,072 B per block)" in text
    assert "padding        16,056,320 B per request" in text


def test_gemma4_published_style_fields_and_shared_kv():
    """A file without per_layer_config (global_head_dim, K = V with num_global_key_value_heads) whose last
    4 of 12 layers reuse earlier KV."""
    config = {"model_type": "gemma4_text", "num_hidden_layers": 12, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 128, "global_head_dim": 256, "attention_k_eq_v": True,
              "num_global_key_value_heads": 2, "sliding_window": 64, "num_kv_shared_layers": 4,
              "hidden_size": 256}
    spec = KVCacheSpec.from_hf_config(config)
    # full layers 5 and 11; layers 8-11 reuse: 8, 9, 10 (sliding) read 7, the last sliding layer before 8;
    # 11 (full) reads 5
    assert [spec.kv_source(i) for i in range(12)] == list(range(8)) + [7, 7, 7, 5]
    assert spec.num_kv_layers == 8
    assert spec.layer_shape(5) == LayerShape(2, 256, 256) and spec.layer_shape(0) == LayerShape(4, 128, 128)
    assert spec.layer_shape(11) == spec.layer_shape(5) and spec.layer_bytes_per_token(11) == 0
    # owners: 7 sliding x 4 x 256 x 2 = 2,048 B each, 1 full (layer 5) x 2 x 512 x 2 = 2,048 B
    assert spec.bytes_per_token == 8 * 2048
    assert sorted(layer for g in spec.groups for layer in g.layers) == list(range(8))


@pytest.mark.parametrize("kwargs", [
    {}, {"attention_k_eq_v": True, "num_global_key_value_heads": 1, "global_head_dim": 64},
    {"num_kv_shared_layers": 2}, {"layer_types": ["sliding_attention", "full_attention"] * 4},
])
def test_gemma4_shapes_agree_with_transformers_layers(kwargs):
    """The projections transformers builds give each layer's K and V widths (and which layers own KV)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma4TextConfig(num_hidden_layers=8, hidden_size=64, intermediate_size=64,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                           vocab_size=64, vocab_size_per_layer_input=64,
                                           hidden_size_per_layer_input=8, sliding_window=16, **kwargs)
    spec = KVCacheSpec.from_hf_config(config.to_dict())
    with torch.device("meta"):
        model = transformers.Gemma4ForCausalLM(config)
    for layer, block in enumerate(model.model.layers):
        attn = block.self_attn
        if attn.is_kv_shared_layer:
            assert spec.kv_source(layer) != layer
            continue
        shape = spec.layer_shape(layer)
        v = attn.v_proj if attn.v_proj is not None else attn.k_proj  # K = V: the cache keeps both
        assert (attn.k_proj.out_features, v.out_features) == (shape.num_kv_heads * shape.head_dim,
                                                              shape.num_kv_heads * shape.v_head_dim)
        assert spec.layer_window(layer) == attn.sliding_window


def test_mimo_shapes_agree_with_transformers_layers():
    transformers = pytest.importorskip("transformers")
    config = transformers.MiMoV2FlashConfig(num_hidden_layers=7, hidden_size=64, intermediate_size=64,
                                            moe_intermediate_size=32, num_attention_heads=8,
                                            num_key_value_heads=2, head_dim=24, v_head_dim=16, vocab_size=64,
                                            n_routed_experts=2, num_experts_per_tok=1)
    spec = KVCacheSpec.from_hf_config(config.to_dict())
    with torch.device("meta"):
        model = transformers.MiMoV2FlashForCausalLM(config)
    for layer, block in enumerate(model.model.layers):
        attn, shape = block.self_attn, spec.layer_shape(layer)
        assert (attn.k_proj.out_features, attn.v_proj.out_features) == (shape.num_kv_heads * shape.head_dim,
                                                                        shape.num_kv_heads * shape.v_head_dim)
        assert spec.layer_window(layer) == attn.sliding_window


def test_mimo_sliding_window_size_is_one_short():
    config = json.loads((CONFIGS / "mimo-v2-flash-defaults.json").read_text())
    config = {**config, "sliding_window_size": 128}
    assert read_kv_fields(config)["sliding_window"] == 129  # MiMoV2FlashConfig: size + 1


@pytest.mark.parametrize(("override", "field"), [
    ({"05": {"head_dim": 0}}, "per_layer_config['05'].head_dim"),
    ({"05": {"num_key_value_heads": -2}}, "per_layer_config['05'].num_key_value_heads"),
    ({"3": {"sliding_window": -1}}, "per_layer_config['3'].sliding_window"),
    ({"7": {"sliding_window": 2.5}}, "per_layer_config['7'].sliding_window"),
    ({"99": {"head_dim": 64}}, "per_layer_config['99']"),
    ({"x": {"head_dim": 64}}, "per_layer_config['x']"),
    ({"2": 5}, "per_layer_config['2']"),
])
def test_bad_per_layer_config_names_the_field(override, field):
    config = json.loads((CONFIGS / "gemma4-text-defaults.json").read_text())
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        read_kv_fields({**config, "per_layer_config": override})


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"layer_head_dims": [64, 0]}, r"layer_head_dims\[1\]"),
    ({"layer_num_kv_heads": [2, -1]}, r"layer_num_kv_heads\[1\]"),
    ({"layer_v_head_dims": [64]}, "layer_v_head_dims has 1 entries"),
    ({"layer_types": ["sliding_attention"] * 2, "layer_windows": [-4, 8]}, r"layer_windows\[0\]"),
    ({"layer_types": ["sliding_attention"] * 2, "layer_windows": [None, 8]}, "layer 0 is sliding_attention"),
    ({"kv_source_layers": [1, 1]}, r"kv_source_layers\[0\]"),
    ({"kv_source_layers": [0, 0], "layer_types": ["sliding_attention", "full_attention"],
      "sliding_window": 8}, "another kind"),
])
def test_bad_per_layer_spec_fields(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, **kwargs)


def test_bad_shared_layer_count():
    config = json.loads((CONFIGS / "gemma4-text-defaults.json").read_text())
    with pytest.raises(ConfigError, match="num_kv_shared_layers"):
        read_kv_fields({**config, "num_kv_shared_layers": 30})


def test_uniform_models_keep_their_layout():
    spec = KVCacheSpec.from_hf_config(CONFIGS.parent / "gemma-3-27b-it.json")
    assert spec.uniform_shape and spec.layers_per_block == 10
    assert spec.bytes_per_block == 10 * spec.bytes_per_layer_token * 16
    assert spec.layer_head_dims is None and spec.v_head_dim is None


def test_cli_plan_notes_the_block_rule(capsys):
    mimo = str(CONFIGS / "mimo-v2-flash-defaults.json")
    assert main(["plan", mimo, "--gpu-memory", "80GiB", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("vLLM keeps the layers per group" in note for note in notes)
    assert main(["plan", str(CONFIGS.parent / "gemma-3-27b-it.json"), "--gpu-memory", "80GiB", "--json"]) == 0
    assert not any("layer slots" in note for note in json.loads(capsys.readouterr().out)["notes"])


def test_random_shapes_fill_blocks_alike():
    """Seeded random per-layer shapes, kinds and shared layers: every KV-owning layer is in exactly one
    group, a group's layers are alike, every block has the same bytes, and the sum of the groups' layer
    bytes is bytes_per_token (brute force over 200 specs)."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 12)
        kinds = [rng.choice([S, F]) for _ in range(n)]
        heads = [rng.choice([1, 2, 4]) for _ in range(n)]
        dims = [rng.choice([8, 16, 24, 32]) for _ in range(n)]
        v_dims = [rng.choice([8, 16, 32]) for _ in range(n)]
        sources = list(range(n))
        for layer in range(1, n):
            earlier = [i for i in range(layer) if sources[i] == i and kinds[i] == kinds[layer]]
            if earlier and rng.random() < 0.2:
                sources[layer] = rng.choice(earlier)
        spec = KVCacheSpec(num_layers=n, num_kv_heads=2, head_dim=8, dtype=torch.float16,
                           block_size=rng.choice([1, 4, 16]),
                           layer_types=[k.value for k in kinds], sliding_window=32, layer_num_kv_heads=heads,
                           layer_head_dims=dims, layer_v_head_dims=v_dims, kv_source_layers=sources)
        owners = [i for i in range(n) if sources[i] == i]
        assert sorted(layer for g in spec.groups for layer in g.layers) == owners
        for g in spec.groups:
            assert {spec.layer_shape(layer) for layer in g.layers} == {g.shape}
            assert {kinds[layer] for layer in g.layers} == {g.kind} and g.num_padding_layers >= 0
            assert g.bytes_per_block == spec.bytes_per_block
        assert spec.bytes_per_token == sum(heads[i] * (dims[i] + v_dims[i]) * 2 for i in owners)


def test_two_chunk_sizes_by_hand():
    # 3 layers: chunked C 8, chunked C 16, full; B 4: each its own group of 1 slot
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                       layer_types=["chunked_attention", "chunked_attention", "full_attention"],
                       layer_windows=[8, 16, None])
    assert [(g.kind, g.window) for g in spec.groups] == [(LayerKind.CHUNKED, 8), (LayerKind.CHUNKED, 16),
                                                         (F, None)]
    # one token per step, 100 tokens: C / B blocks = 2 and 4; skipped: (C x (100 // C)) // B = 24 and 24
    assert [g.max_blocks(100) for g in spec.groups] == [2, 4, 25]
    assert [g.skipped_blocks(100) for g in spec.groups] == [24, 24, 0]
    with pytest.raises(ConfigError, match="the chunk of layer 1, 6, must be a multiple of block_size 4"):
        KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                    layer_types=["chunked_attention"] * 2, layer_windows=[8, 6])


def test_gemma4_wrapper_reads_its_text_config():
    """The multimodal Gemma 4 config keeps the language model under text_config (gemma4_text); a file whose
    text_config has neither per_layer_config nor global_head_dim takes Gemma4TextConfig's 512."""
    transformers = pytest.importorskip("transformers")
    wrapped = transformers.Gemma4Config().to_dict()
    assert KVCacheSpec.from_hf_config(wrapped).bytes_per_token == 143360  # as the text defaults above
    text = {k: v for k, v in wrapped["text_config"].items() if k != "per_layer_config"}
    spec = KVCacheSpec.from_hf_config({"model_type": "gemma4", "text_config": text})
    assert spec.layer_shape(5).head_dim == 512 and spec.bytes_per_token == 143360

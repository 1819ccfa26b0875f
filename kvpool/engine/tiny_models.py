"""The tiny random-weight models the engine and its tests run (a byte vocabulary, no download): attention
models of every layer kind kvpool serves (:data:`TINY_MODELS`) and attention / recurrent hybrids
(:data:`TINY_HYBRID_MODELS`), each built from a transformers config (:func:`tiny_config`) with weights drawn
under a seed (:func:`build_tiny_model`). :func:`kvpool.engine.models.load_model` loads them by name.

transformers is imported lazily (kvpool's ``engine`` extra).
"""

from __future__ import annotations

from typing import Any

import torch

TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gpt2", "tiny-mistral", "tiny-gemma2", "tiny-gemma3",
               "tiny-gpt-oss", "tiny-gemma4", "tiny-mimo", "tiny-llama4")
#: Tiny attention / recurrent hybrids (random weights, byte vocabulary): one per family of
#: :mod:`kvpool.spec.state`, run by the engine with their state in state slots
#: (:mod:`kvpool.engine.recurrent`; :func:`kvpool.engine.models.kv_spec` refuses them: see
#: :func:`kvpool.engine.recurrent.engine_kv_spec`).
TINY_HYBRID_MODELS = ("tiny-qwen3-next", "tiny-qwen3.5", "tiny-nemotron-h", "tiny-granite-4.0-h",
                      "tiny-bamba", "tiny-lfm2", "tiny-kimi-linear", "tiny-olmo-hybrid", "tiny-jamba",
                      "tiny-falcon-h1")
TINY_WINDOW = 16
TINY_INIT_STD = 0.3  # the default 0.02 makes random models repeat one greedy token (DESIGN.md)


def build_tiny_model(name: str, *, seed: int = 0, config: Any = None) -> Any:
    """A small random model (vocab 256 = bytes, hidden 64, 4 query heads, 2 KV heads but GPT-2's), weight
    matrices drawn from N(0, 0.3^2) under ``torch.manual_seed(seed)``; no EOS token. Llama, Qwen2 and GPT-2
    have 2 layers; the sliding-window ones slide over :data:`TINY_WINDOW` tokens: ``tiny-mistral`` (2
    layers, every one sliding), ``tiny-gemma2`` (4 layers alternating sliding and full, logit soft-capping
    50 and 30, scaling ``query_pre_attn_scalar ** -0.5`` with 32), ``tiny-gemma3`` (6 layers, pattern 3:
    layers 2 and 5 full), ``tiny-gpt-oss`` (2 layers, sliding then full, 4 experts of which 2 per token,
    attention sinks drawn from N(0, 1)), ``tiny-gemma4`` (6 layers, pattern 3: layers 2 and 5 full with
    head_dim 64 and 1 KV head where the sliding ones have 16 and 2 (``global_head_dim``, K = V with
    ``num_global_key_value_heads``), the last 2 layers reusing the KV of layers 3 and 2
    (``num_kv_shared_layers``), per-layer inputs of 8), ``tiny-mimo`` (MiMo-V2-Flash's layout: 6 layers,
    0 and 5 full with 1 KV head, the others sliding with 2 and attention sinks from N(0, 1); K heads of 24,
    V heads of 16; 4 experts of which 2 per token), ``tiny-llama4`` (Llama 4's text layout: 4 layers, the
    first 3 chunked-local attention over chunks of :data:`TINY_WINDOW` tokens with RoPE, the last full
    with no RoPE; dense MLPs, no experts). The hybrids of :data:`TINY_HYBRID_MODELS` are
    described at :func:`tiny_hybrid_config`. ``config``: a variant of ``tiny_config(name)`` to build instead
    (the same initialisation)."""
    import transformers

    config = tiny_config(name) if config is None else config
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, TINY_INIT_STD)
        for name_, param in model.named_parameters():
            if name_.endswith(".sinks"):  # gpt-oss: one learned logit per head, big enough to matter
                param.normal_(0.0, 1.0)
    if name == "tiny-nemotron-h":
        _same_dt_limit(model)
    return model


def _same_dt_limit(model: Any) -> None:
    """Nemotron-H clamps dt at ``time_step_min`` (0.001) in its chunked prefill but not in its single-token
    decode (transformers' torch paths), so with random weights a token computed by a prefill (a request
    recomputed after preemption) and by a decode differ by ~1e-2 in the logits. A clamp at 0 (softplus is
    positive anyway) makes both paths compute the same function; it must be set on the built mixers, as
    the config's ``time_step_min`` also seeds the dt bias init (a log of 0)."""
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, float("inf"))


def tiny_config(name: str) -> Any:
    """The transformers config of the tiny model ``name`` (see :func:`build_tiny_model`)."""
    import transformers

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    gqa = dict(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=4096)
    gemma = dict(**gqa, head_dim=16, sliding_window=TINY_WINDOW, query_pre_attn_scalar=32)
    if name in TINY_HYBRID_MODELS:
        return tiny_hybrid_config(name, {**common, **gqa})
    if name == "tiny-gpt2":
        config = transformers.GPT2Config(**common, n_positions=4096)
    elif name == "tiny-mistral":
        config = transformers.MistralConfig(**common, **gqa, sliding_window=TINY_WINDOW)
    elif name == "tiny-gemma2":
        config = transformers.Gemma2Config(**{**common, "num_hidden_layers": 4}, **gemma)
    elif name == "tiny-gemma3":
        config = transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, **gemma,
                                               sliding_window_pattern=3)
    elif name == "tiny-gemma4":
        config = transformers.Gemma4TextConfig(
            **{**common, "num_hidden_layers": 6}, **gqa, head_dim=16, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, global_head_dim=64,
            attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2,
            vocab_size_per_layer_input=256, hidden_size_per_layer_input=8)
    elif name == "tiny-mimo":
        config = transformers.MiMoV2FlashConfig(
            **{**common, "num_hidden_layers": 6}, intermediate_size=128, num_key_value_heads=1,
            max_position_embeddings=4096, head_dim=24, v_head_dim=16, sliding_window=TINY_WINDOW,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    elif name == "tiny-gpt-oss":
        config = transformers.GptOssConfig(**common, **{**gqa, "intermediate_size": 64}, head_dim=16,
                                           sliding_window=TINY_WINDOW, num_local_experts=4,
                                           num_experts_per_tok=2, layer_types=["sliding_attention",
                                                                               "full_attention"])
    elif name == "tiny-llama4":  # no_rope_layers [1, 1, 1, 0]: every 4th layer full with no RoPE
        config = transformers.Llama4TextConfig(
            **{**common, "num_hidden_layers": 4}, **gqa, head_dim=16, intermediate_size_mlp=128,
            attention_chunk_size=TINY_WINDOW, num_local_experts=1, moe_layers=[])
    else:
        cls = transformers.LlamaConfig if name == "tiny-llama" else transformers.Qwen2Config
        config = cls(**common, **gqa)
    return config


def tiny_hybrid_config(name: str, common: dict[str, Any]) -> Any:
    """The config of a tiny hybrid of :data:`TINY_HYBRID_MODELS`: hidden 64, 4 query and 2 KV heads of 16,
    dense MLPs (no experts), 3 or 4 layers with the attention layers the family's config places:

    * ``tiny-qwen3-next``, ``tiny-qwen3.5``, ``tiny-olmo-hybrid``: 3 Gated DeltaNet + 1 attention layer (GDN
      of 2 key heads x 8, 4 value heads x 8, conv width 4);
    * ``tiny-nemotron-h``: Mamba-2, attention, Mamba-2, MLP (4 heads x 16, 2 groups, d_state 8);
      :func:`build_tiny_model` lowers its mixers' dt clamp to 0 (see :func:`_same_dt_limit`);
    * ``tiny-granite-4.0-h``: Mamba-2, attention, Mamba-2, Mamba-2; ``tiny-bamba``: Mamba-2, attention,
      Mamba-2 (4 heads x 32 = 2 x 64, 1 group, d_state 8);
    * ``tiny-lfm2``: short conv (width 3), attention, short conv;
    * ``tiny-kimi-linear``: KDA (4 heads x 8), MLA attention (latent 16 + rope 8, q/k/v heads of 16), KDA;
    * ``tiny-jamba``: Mamba-1 (d_state 8, conv 4) and attention alternating, 4 layers;
    * ``tiny-falcon-h1``: 2 layers, each with attention and Mamba-2 side by side."""
    import transformers

    gdn = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4)
    bamba = dict(mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_d_head=32, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=16)
    four, three = {**common, "num_hidden_layers": 4}, {**common, "num_hidden_layers": 3}
    builders = {
        "tiny-qwen3-next": lambda: transformers.Qwen3NextConfig(**four, **gdn, mlp_only_layers=[0, 1, 2, 3]),
        "tiny-qwen3.5": lambda: transformers.Qwen3_5TextConfig(**four, **gdn),
        "tiny-olmo-hybrid": lambda: transformers.OlmoHybridConfig(**four, **gdn),
        "tiny-nemotron-h": lambda: transformers.NemotronHConfig(
            **common, layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
            head_dim=16, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4,
            chunk_size=16),
        "tiny-granite-4.0-h": lambda: transformers.GraniteMoeHybridConfig(
            **four, **bamba, layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=0,
            shared_intermediate_size=128),
        "tiny-bamba": lambda: transformers.BambaConfig(**three, **bamba, attn_layer_indices=[1]),
        "tiny-lfm2": lambda: transformers.Lfm2Config(**three, full_attn_idxs=[1], conv_L_cache=3),
        "tiny-kimi-linear": lambda: transformers.KimiLinearConfig(
            **{**three, "num_key_value_heads": 4}, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, mlp_layer_types=["dense"] * 3, linear_attn_config={
                "full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 8, "num_heads": 4,
                "short_conv_kernel_size": 4}),
        "tiny-jamba": lambda: transformers.JambaConfig(**four, attn_layer_period=2, attn_layer_offset=1,
                                                       num_experts=1, mamba_d_state=8, mamba_d_conv=4,
                                                       mamba_expand=2),
        "tiny-falcon-h1": lambda: transformers.FalconH1Config(
            **common, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16),
    }
    return builders[name]()

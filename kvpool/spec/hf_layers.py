"""Each layer of a Hugging Face ``config.json`` as transformers' config classes build it: its attention kind
(``layer_types``, computed from a model type's pattern where the file has none: :func:`attention_layers`)
and its KV shape (per-layer KV heads, K and V head sizes, windows and shared-KV sources: Gemma 4,
MiMo-V2-Flash; :func:`layer_shapes`). :mod:`kvpool.spec.hf_config` reads a config's fields with them.
"""

from __future__ import annotations

from typing import Any

from kvpool.errors import ConfigError
from kvpool.numeric import as_int
from kvpool.spec.config_sizes import MAX_DIM, config_int

#: Model types whose config class computes ``layer_types`` from a repeating pattern when the file has none:
#: ``(i + 1) % pattern`` nonzero means layer i slides. Defaults are the config classes' own: Gemma2Config
#: alternates starting with sliding (pattern 2), Gemma3TextConfig's ``sliding_window_pattern`` is 6,
#: Cohere2Config's is 4, GptOssConfig alternates (2).
_PATTERN_DEFAULTS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4, "gpt_oss": 2, "gemma4": 6,
                     "gemma4_text": 6}
#: Llama4TextConfig's ``no_rope_layer_interval`` default: every 4th layer is NoPE (full attention).
_LLAMA4_NOPE_INTERVAL = 4


def attention_layers(lm: dict[str, Any], model_type: str | None, num_layers: Any, window: int | None
                     ) -> dict[str, Any]:
    """``layer_types`` (a list of Hugging Face layer type names, or None = every layer alike) and
    ``attention_chunk_size``, as transformers' config class of ``model_type`` computes them.

    The file's own ``layer_types`` wins. Otherwise: Gemma 2/3, Cohere2 and gpt-oss repeat a pattern of
    sliding layers and one full layer (:data:`_PATTERN_DEFAULTS`; the file's ``sliding_window_pattern``,
    or ``_sliding_window_pattern`` as newer transformers save it); Llama 4 makes RoPE layers chunked and
    NoPE layers full (``no_rope_layers``: 1 = RoPE; empty = every 4th layer NoPE); Qwen2-style configs with
    ``use_sliding_window: true`` slide layers ``i >= max_window_layers``. Checked by :class:`KVCacheSpec`.
    """
    chunk = config_int(lm, "attention_chunk_size") if model_type in ("llama4", "llama4_text") else None
    types = lm.get("layer_types")
    if types is None and isinstance(num_layers, int) and num_layers > 0:
        types = _computed_layer_types(lm, model_type, num_layers, window, chunk)
    if types is not None and not isinstance(types, list):  # an int, a str, an object: never iterated
        raise ConfigError(f"config.json field 'layer_types' must be a list of layer type names, got "
                          f"{types!r:.60}")
    return {"layer_types": types, "attention_chunk_size": chunk}


def _computed_layer_types(lm: dict[str, Any], model_type: str | None, num_layers: int,
                          window: int | None, chunk: int | None) -> list[str] | None:
    if model_type in ("llama4", "llama4_text"):
        rope = lm.get("no_rope_layers") or [int((i + 1) % _LLAMA4_NOPE_INTERVAL != 0)
                                            for i in range(num_layers)]
        if not isinstance(rope, list):  # read by truthiness per layer, as Llama4TextConfig reads it
            raise ConfigError(f"config.json field 'no_rope_layers' must be a list (1 = RoPE layer), got "
                              f"{rope!r:.60}")
        return ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    if window is None:
        return None
    if model_type in _PATTERN_DEFAULTS:
        pattern = config_int(lm, "sliding_window_pattern") or config_int(lm, "_sliding_window_pattern") \
            or _PATTERN_DEFAULTS[model_type]
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        if model_type in ("gemma4", "gemma4_text"):
            types[-1] = "full_attention"  # Gemma4TextConfig forces its last layer full
        return types
    if model_type == "mimo_v2_flash":  # MiMoV2FlashConfig: layer 0 and every 6th full
        return ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention"
                for i in range(num_layers)]
    if lm.get("use_sliding_window") is True:
        first = config_int(lm, "max_window_layers", minimum=0)
        first = 28 if first is None else first  # Qwen2Config / Qwen3Config default
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return None


#: Model types whose ``v_head_dim`` is the V head width of MHA/GQA layers (not an MLA part).
_V_HEAD_DIM_TYPES = ("mimo_v2_flash",)
#: Gemma4TextConfig's ``global_head_dim`` default: the head size of its full-attention layers.
_GEMMA4_GLOBAL_HEAD_DIM = 512
#: Keys of a ``per_layer_config`` entry that change a layer's KV, with their minimum (None: may be null).
_PER_LAYER_KEYS = {"num_key_value_heads": 1, "head_dim": 1, "v_head_dim": 1, "sliding_window": None}


def layer_shapes(lm: dict[str, Any], model_type: str | None, fields: dict[str, Any],
                 layer_types: list[Any] | None) -> dict[str, Any]:
    """Each layer's KV heads, K and V head sizes, window and KV source, as transformers builds the layers.

    * ``per_layer_config`` (transformers' sparse per-layer overrides, ``{layer: {key: value}}``: Gemma 4's
      full layers, per-layer windows): ``num_key_value_heads``, ``head_dim``, ``v_head_dim`` and
      ``sliding_window`` per layer.
    * Gemma 4 without it: full layers take ``global_head_dim`` (512 when absent) and, when
      ``attention_k_eq_v``, ``num_global_key_value_heads`` (Gemma4TextConfig's own rule); the last
      ``num_kv_shared_layers`` layers read the KV of the last earlier layer of their type (its
      ``kv_sharing_modes``: "reuse") and own none.
    * MiMo-V2-Flash: V heads of ``v_head_dim``; sliding layers have twice ``num_key_value_heads`` (its
      modeling code: ``num_key_value_heads * 2 if is_swa``).

    Returns the spec's per-layer fields, each None when every layer takes the model-wide value. Raises
    :class:`ConfigError` naming the field (and layer) of a size that is not a positive integer.
    """
    n, heads, head_dim = fields["num_layers"], fields["num_kv_heads"], fields["head_dim"]
    v_head_dim = config_int(lm, "v_head_dim") if model_type in _V_HEAD_DIM_TYPES else None
    types = list(layer_types) if isinstance(layer_types, list) and len(layer_types) == n else [None] * n
    per_layer: dict[str, list[Any]] = {"num_key_value_heads": [heads] * n, "head_dim": [head_dim] * n,
                                       "v_head_dim": [v_head_dim] * n, "sliding_window": [None] * n}
    if model_type == "mimo_v2_flash":
        per_layer["num_key_value_heads"] = [heads * 2 if t == "sliding_attention" else heads for t in types]
    overrides = _per_layer_config(lm, n)
    if overrides is None and model_type in ("gemma4", "gemma4_text"):
        overrides = _gemma4_overrides(lm, types)
    for layer, entry in (overrides or {}).items():
        for key, value in entry.items():
            per_layer[key][layer] = value
    sources = _gemma4_kv_sources(lm, types) if model_type in ("gemma4", "gemma4_text") else None
    dims = per_layer["head_dim"]
    v_dims = [v or d for v, d in zip(per_layer["v_head_dim"], dims, strict=True)]
    alike = len(set(dims)) == 1 and len(set(v_dims)) == 1
    windows = per_layer["sliding_window"]
    return {"v_head_dim": v_dims[0] if alike and v_dims[0] != dims[0] else None,
            "layer_num_kv_heads": None if len(set(per_layer["num_key_value_heads"])) == 1
            else per_layer["num_key_value_heads"],
            "layer_head_dims": None if alike else dims, "layer_v_head_dims": None if alike else v_dims,
            "layer_windows": None if all(w is None for w in windows) else windows,
            "kv_source_layers": sources, "head_dim": dims[0] if alike else head_dim}


def _per_layer_config(lm: dict[str, Any], num_layers: int) -> dict[int, dict[str, Any]] | None:
    """``per_layer_config`` checked: layer indices (ints or digit strings, as transformers saves them:
    ``"05"``) below ``num_layers``, and the KV keys of :data:`_PER_LAYER_KEYS` as sizes; None when absent."""
    raw = lm.get("per_layer_config")
    if raw is None:
        return None
    if isinstance(raw, list):
        raw = dict(enumerate(raw))
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json field 'per_layer_config' must map layer indices to overrides, got "
                          f"{raw!r:.60}")
    out: dict[int, dict[str, Any]] = {}
    for key, entry in raw.items():
        where = f"config.json field per_layer_config[{key!r}]"
        layer = int(key) if isinstance(key, str) and key.isdigit() else key
        if type(layer) is not int or not 0 <= layer < num_layers:
            raise ConfigError(f"{where}: not a layer index below num_hidden_layers {num_layers}")
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be an object of overrides, got {entry!r:.60}")
        out[layer] = {}
        for name, minimum in _PER_LAYER_KEYS.items():
            if name not in entry or (entry[name] is None and minimum is None):
                continue
            value = as_int(entry[name], f"{where}.{name}", minimum=minimum or 1, maximum=MAX_DIM,
                           error=ConfigError)
            out[layer][name] = value
    return out


def _gemma4_overrides(lm: dict[str, Any], types: list[Any]) -> dict[int, dict[str, Any]]:
    """Gemma4TextConfig's ``per_layer_config`` for a file without one: full layers' head size and KV heads."""
    global_dim = config_int(lm, "global_head_dim") or _GEMMA4_GLOBAL_HEAD_DIM
    entry: dict[str, Any] = {"head_dim": global_dim}
    global_heads = config_int(lm, "num_global_key_value_heads")
    if lm.get("attention_k_eq_v") and global_heads is not None:
        entry["num_key_value_heads"] = global_heads
    return {layer: dict(entry) for layer, t in enumerate(types) if t == "full_attention"}


def _gemma4_kv_sources(lm: dict[str, Any], types: list[Any]) -> list[int] | None:
    """Gemma 4's shared KV: each of the last ``num_kv_shared_layers`` layers reads the KV of the last earlier
    layer of its type (Gemma4TextConfig's ``kv_sharing_modes``); None when no layer shares."""
    shared = config_int(lm, "num_kv_shared_layers", minimum=0) or 0
    n = len(types)
    if shared == 0:
        return None
    first = n - shared
    if first <= 0:
        raise ConfigError(f"config.json field 'num_kv_shared_layers' is {shared}: every one of the {n} "
                          f"layers would read another's KV, and none would own any")
    sources = list(range(n))
    for layer in range(first, n):
        owners = [i for i in range(first) if types[i] == types[layer]]
        if not owners:
            raise ConfigError(f"config.json field 'num_kv_shared_layers' is {shared}: layer {layer} "
                              f"({types[layer]}) has no earlier layer of its type to read KV from")
        sources[layer] = owners[-1]
    return sources

"""Read the KV cache fields of a Hugging Face ``config.json``, without transformers for the common models.

Each model type names its sizes differently (GPT-2 says ``n_layer``, Falcon ``num_kv_heads``); :data:`LAYOUTS`
maps a model type to where it keeps them. A type not in the table is read with the Llama names, which most
decoder models use. Multimodal wrappers (LLaVA, Qwen2-VL, Gemma 3) keep the language model under
``text_config``. A field the config leaves out is taken from the defaults of that model type's transformers
config class (imported only then); without transformers it is a :class:`ConfigError` naming the field.

Every size read, from the file or from transformers' defaults, is checked by
:func:`~kvpool.spec.config_sizes.config_int`; each layer's kind and shape are read by
:mod:`kvpool.spec.hf_layers`.

:data:`BUILTIN_CONFIGS` ships the configs of common models with the package: :func:`load_config` takes their
names (``"llama-3.1-8b"``) where no file of that name exists.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError
from kvpool.spec.config_sizes import (  # noqa: F401 (re-exported)
    LAYER_COUNT_KEYS,
    MAX_DIM,
    MAX_LAYERS,
    config_int,
    too_many_layers,
)
from kvpool.spec.hf_layers import attention_layers, layer_shapes


def _falcon_kv_heads(config: dict[str, Any], num_heads: int) -> int:
    """Falcon: ``num_kv_heads`` with the new decoder architecture (40B/180B), else 1 for multi-query (7B)."""
    if config.get("new_decoder_architecture"):
        heads = config_int(config, "num_kv_heads")
        return num_heads if heads is None else heads
    return 1 if config.get("multi_query", True) else num_heads


@dataclass(frozen=True)
class Layout:
    """Where one model type keeps its sizes: config keys tried in order, first present wins.

    ``head_dim_from_hidden``: without a head_dim key, head_dim = hidden_size / heads (Gemma: never, its
    head_dim is its own field). ``mla``: the KV is one latent of ``kv_lora_rank + qk_rope_head_dim``
    (DeepSeek-V2/V3).
    ``kv_heads_rule``: computes the KV heads from the config where a flag decides it (Falcon).
    """

    num_layers: tuple[str, ...] = ("num_hidden_layers",)
    num_heads: tuple[str, ...] = ("num_attention_heads",)
    num_kv_heads: tuple[str, ...] = ("num_key_value_heads",)
    hidden_size: tuple[str, ...] = ("hidden_size",)
    head_dim: tuple[str, ...] = ("head_dim",)
    head_dim_from_hidden: bool = True
    mla: bool = False
    kv_heads_rule: Callable[[dict[str, Any], int], int] | None = None
    rule_keys: tuple[str, ...] = ()  # sizes the kv_heads_rule reads

    def size_keys(self) -> dict[str, int]:
        """Every size key this layout reads, with its minimum."""
        keys = (*self.num_layers, *self.num_heads, *self.num_kv_heads, *self.hidden_size, *self.head_dim,
                *self.rule_keys, "sliding_window", *(("kv_lora_rank",) if self.mla else ()))
        return {**dict.fromkeys(keys, 1), **({"qk_rope_head_dim": 0} if self.mla else {})}


_LLAMA = Layout()
_GPT2 = Layout(num_layers=("n_layer",), num_heads=("n_head",), num_kv_heads=(), hidden_size=("n_embd",))
_GEMMA = Layout(head_dim_from_hidden=False)
_MLA = Layout(mla=True)
_FALCON = Layout(num_layers=("num_hidden_layers", "n_layer"), num_heads=("num_attention_heads", "n_head"),
                 num_kv_heads=(), hidden_size=("hidden_size", "n_embed"), kv_heads_rule=_falcon_kv_heads,
                 rule_keys=("num_kv_heads",))

#: Model types understood, and where each keeps its sizes (any other type is read as ``_LLAMA``).
LAYOUTS: dict[str, Layout] = {
    **dict.fromkeys(["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
                     "gpt_neox", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"], _LLAMA),
    **dict.fromkeys(["gpt2", "gptj"], _GPT2),
    **dict.fromkeys(["gemma", "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text"], _GEMMA),
    **dict.fromkeys(["falcon", "RefinedWeb", "RefinedWebModel"], _FALCON),
    **dict.fromkeys(["deepseek_v2", "deepseek_v3"], _MLA),
}


class _MissingField(ConfigError):
    def __init__(self, field: str, keys: tuple[str, ...], model_type: str | None) -> None:
        super().__init__(f"config.json ({model_type or 'no model_type'}) has no {field} "
                         f"(looked for {', '.join(keys)})")


def read_kv_fields(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The KV cache fields of a config: num_layers, num_kv_heads, num_attention_heads (query heads),
    head_dim, attention ('mha' | 'mla'), kv_lora_rank, qk_rope_head_dim, sliding_window (tokens or None),
    layer_types (one Hugging Face layer type name per layer, or None when every layer attends alike; see
    :func:`~kvpool.spec.hf_layers.attention_layers`), attention_chunk_size (Llama 4's chunk, or None),
    the per-layer shapes of :func:`~kvpool.spec.hf_layers.layer_shapes` (v_head_dim, layer_num_kv_heads,
    layer_head_dims, layer_v_head_dims, layer_windows, kv_source_layers: None where every layer is alike),
    model_dtype (:func:`model_dtype`)
    and model_type (the language model's ``model_type``, or None).

    ``path_or_dict``: a config.json, a folder holding one, a built-in name (:func:`load_config`), or the
    parsed dict. MLA: head_dim is the latent
    width ``kv_lora_rank + qk_rope_head_dim`` (vLLM's head size for MLA). Raises :class:`ConfigError` for an
    unreadable file, a size that is zero, negative or not an integer, or a missing field that transformers
    is not there (or not able) to fill.
    """
    config = load_config(path_or_dict)
    lm = _language_model(config)
    try:
        return _read(lm, config)
    except _MissingField as missing:
        for key, minimum in _layout(lm, config).size_keys().items():  # the file's own sizes, named, first
            config_int(lm, key, minimum)
        return _read(_filled_from_transformers(config, missing), config)


#: Folder of the built-in configs (package data): ``NAME.json`` for each name of :data:`BUILTIN_CONFIGS`.
BUILTIN_DIR = Path(__file__).parents[1] / "configs"
#: Models whose ``config.json`` ships with kvpool, by name: the published files (instruct and base models
#: share one KV layout), except that gemma-3-4b and gemma-3-12b write out the head counts and head_dim
#: their published files leave to transformers' Gemma3TextConfig defaults (so none needs transformers).
BUILTIN_CONFIGS = (
    "deepseek-v2-lite", "deepseek-v3", "gemma-2-9b", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b",
    "gpt-oss-20b", "llama-3.1-8b", "llama-3.1-70b", "llama-4-scout", "mistral-7b-v0.1", "mixtral-8x7b",
    "phi-3-mini-4k", "qwen2.5-0.5b", "qwen2.5-7b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-next-80b-a3b",
    "smollm2-135m",
)


def config_path(path_or_name: str | Path) -> Path:
    """Where a config is: ``path_or_name`` itself (a file, or a folder's ``config.json``) when it exists,
    else the built-in config of that name (:data:`BUILTIN_CONFIGS`); a path that is neither is returned
    as given (reading it then fails, :func:`load_config` says how)."""
    path = Path(path_or_name)
    if not path.exists() and str(path_or_name) in BUILTIN_CONFIGS:
        return BUILTIN_DIR / f"{path_or_name}.json"
    return path / "config.json" if path.is_dir() else path


def load_config(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The parsed config.json (a file, a folder holding ``config.json``, or a built-in name: see
    :func:`config_path`); a dict is returned as is. Raises :class:`ConfigError` for no such file (naming
    the built-in configs), a file that is not UTF-8 JSON, or JSON that is not an object."""
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = config_path(path_or_dict)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no config file at {path}; give a config.json, a folder holding one, or a "
                          f"built-in config: {', '.join(BUILTIN_CONFIGS)}") from None
    except (OSError, ValueError) as exc:  # not UTF-8, not JSON, an integer of more than 4,300 digits
        why = str(exc) if len(str(exc)) <= 200 else f"{str(exc)[:200]}..."
        raise ConfigError(f"cannot read {path} as JSON: {why}") from None
    except RecursionError:
        raise ConfigError(f"cannot read {path} as JSON: nested too deeply") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def model_type(config: dict[str, Any]) -> str | None:
    """The language model's ``model_type`` (a wrapper's ``text_config``'s before its own), or None."""
    return _model_type(_language_model(config), config)


def _language_model(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _model_type(lm: dict[str, Any], top: dict[str, Any]) -> str | None:
    model_type = lm.get("model_type") or top.get("model_type")
    return model_type if isinstance(model_type, str) else None


def _layout(lm: dict[str, Any], top: dict[str, Any]) -> Layout:
    return LAYOUTS.get(_model_type(lm, top), _LLAMA)


def _read(lm: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    model_type = _model_type(lm, top)
    layout = _layout(lm, top)
    pick = _Picker(lm, model_type)
    num_layers = pick("num_layers", layout.num_layers)
    num_heads = pick("num_attention_heads", layout.num_heads)
    if layout.kv_heads_rule is not None:
        num_kv_heads = layout.kv_heads_rule(lm, num_heads)
    else:
        given = pick.optional(layout.num_kv_heads)
        num_kv_heads = num_heads if given is None else given
    fields = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "num_attention_heads": num_heads,
              "attention": "mha", "kv_lora_rank": 0, "qk_rope_head_dim": 0}
    if layout.mla:
        kv_lora_rank = pick("kv_lora_rank", ("kv_lora_rank",))
        qk_rope_head_dim = pick("qk_rope_head_dim", ("qk_rope_head_dim",), minimum=0)
        fields.update(attention="mla", kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                      head_dim=kv_lora_rank + qk_rope_head_dim)
    else:
        fields["head_dim"] = _head_dim(pick, layout, num_heads)
    window = _sliding_window(lm, model_type)
    layers = attention_layers(lm, model_type, num_layers, window)
    if not layout.mla:
        fields.update(layer_shapes(lm, model_type, fields, layers["layer_types"]))
    return {**fields, "sliding_window": window, **layers, "model_dtype": model_dtype(top),
            "model_type": model_type}


class _Picker:
    """Reads one size from the first of its keys that the config holds (a None value counts as absent),
    checked by :func:`config_int`."""

    def __init__(self, config: dict[str, Any], model_type: str | None) -> None:
        self.config, self.model_type = config, model_type

    def optional(self, keys: tuple[str, ...], minimum: int = 1) -> int | None:
        key = next((key for key in keys if self.config.get(key) is not None), None)
        return None if key is None else config_int(self.config, key, minimum)

    def __call__(self, field: str, keys: tuple[str, ...], minimum: int = 1) -> int:
        value = self.optional(keys, minimum)
        if value is None:
            raise _MissingField(field, keys, self.model_type)
        return value


def _head_dim(pick: _Picker, layout: Layout, num_heads: int) -> int:
    head_dim = pick.optional(layout.head_dim)
    if head_dim is not None:
        return head_dim
    if not layout.head_dim_from_hidden:
        raise _MissingField("head_dim", layout.head_dim, pick.model_type)
    hidden_size = pick("hidden_size", layout.hidden_size)
    if hidden_size % num_heads:
        raise ConfigError(f"hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}")
    return hidden_size // num_heads


def _sliding_window(lm: dict[str, Any], model_type: str | None = None) -> int | None:
    """The window in tokens; None when absent, null, or off (Qwen2's ``use_sliding_window: false``).
    MiMo-V2-Flash's ``sliding_window_size`` S means a window of S + 1 (MiMoV2FlashConfig: S earlier tokens
    plus the query)."""
    if lm.get("use_sliding_window") is False:
        return None
    if model_type == "mimo_v2_flash" and lm.get("sliding_window_size") is not None:
        return config_int(lm, "sliding_window_size") + 1  # type: ignore[operator]
    return config_int(lm, "sliding_window")


def model_dtype(config: dict[str, Any]) -> str | None:
    """The dtype a config names, where vLLM looks for it (``_find_dtype`` in vllm/config/model.py): the
    config's own ``dtype`` (transformers 5) or ``torch_dtype``, else its ``text_config``'s, else its
    ``vision_config``'s; None when none names one."""
    for part in (config, config.get("text_config"), config.get("vision_config")):
        if isinstance(part, dict) and (dtype := part.get("dtype") or part.get("torch_dtype")) is not None:
            return str(dtype)
    return None


def _filled_from_transformers(config: dict[str, Any], missing: _MissingField) -> dict[str, Any]:
    """The language model's config with every field the file leaves out set to transformers' default."""
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ImportError:
        raise ConfigError(f"{missing}; install transformers to take the model type's defaults") from None
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{missing}, and transformers has no config class for it to fill it")
    kwargs = {key: value for key, value in config.items() if key != "model_type"}
    try:
        full = AutoConfig.for_model(model_type, **kwargs)
        return full.get_text_config(decoder=True).to_dict()
    except Exception as exc:  # noqa: BLE001 - any failure of the config class on this file's values
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"{missing}, and transformers cannot fill it from this config: {why}") from None

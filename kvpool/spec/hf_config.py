"""Read the KV cache fields of a Hugging Face ``config.json``, without transformers for the common models.

Each model type names its sizes differently (GPT-2 says ``n_layer``, Falcon ``num_kv_heads``); :data:`LAYOUTS`
maps a model type to where it keeps them. A type not in the table is read with the Llama names, which most
decoder models use. Multimodal wrappers (LLaVA, Qwen2-VL, Gemma 3) keep the language model under
``text_config``. A field the config leaves out is taken from the defaults of that model type's transformers
config class (imported only then); without transformers it is a :class:`ConfigError` naming the field.

Every size read, from the file or from transformers' defaults, must be an integer (never a bool, float or
string) of at least 1 (``qk_rope_head_dim`` at least 0) and at most 2**31 - 1 (a layer count at most
:data:`MAX_LAYERS`): a zero, negative or non-integer value is a :class:`ConfigError` naming the key, never
replaced by another field.

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
from kvpool.numeric import as_int

#: Largest size accepted in a config (a tensor dimension; anything larger is a corrupt file).
MAX_DIM = 2**31 - 1
#: Most layers a model may have. The deepest published transformers have about 1,000 layers; a spec keeps
#: one entry per layer (its layer types, its KV cache groups' layer lists), so a config asking for 2**31
#: layers would build lists of gigabytes before any check could refuse it.
MAX_LAYERS = 2**16
#: Config keys that count layers (checked against :data:`MAX_LAYERS` before anything is built per layer).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer")


def too_many_layers(what: str, value: int) -> str:
    """The message for a layer count above :data:`MAX_LAYERS`."""
    return (f"{what} is {value:,}: more layers than any model has (at most {MAX_LAYERS:,}; the deepest "
            f"published transformers have about 1,000)")


def config_int(config: dict[str, Any], key: str, minimum: int = 1) -> int | None:
    """``config[key]`` checked as a size (see the module docstring); None when absent or null. A layer
    count (:data:`LAYER_COUNT_KEYS`) is at most :data:`MAX_LAYERS`."""
    value = config.get(key)
    if value is None:
        return None
    what = f"config.json field {key!r}"
    value = as_int(value, what, minimum=minimum, maximum=MAX_DIM, error=ConfigError)
    if key in LAYER_COUNT_KEYS and value > MAX_LAYERS:
        raise ConfigError(too_many_layers(what, value))
    return value


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
    :func:`_attention_layers`), attention_chunk_size (Llama 4's chunk, or None), the per-layer shapes of
    :func:`_layer_shapes` (v_head_dim, layer_num_kv_heads, layer_head_dims, layer_v_head_dims,
    layer_windows, kv_source_layers: None where every layer is alike), model_dtype (:func:`model_dtype`)
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
    layers = _attention_layers(lm, model_type, num_layers, window)
    if not layout.mla:
        fields.update(_layer_shapes(lm, model_type, fields, layers["layer_types"]))
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


#: Model types whose config class computes ``layer_types`` from a repeating pattern when the file has none:
#: ``(i + 1) % pattern`` nonzero means layer i slides. Defaults are the config classes' own: Gemma2Config
#: alternates starting with sliding (pattern 2), Gemma3TextConfig's ``sliding_window_pattern`` is 6,
#: Cohere2Config's is 4, GptOssConfig alternates (2).
_PATTERN_DEFAULTS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4, "gpt_oss": 2, "gemma4": 6,
                     "gemma4_text": 6}
#: Llama4TextConfig's ``no_rope_layer_interval`` default: every 4th layer is NoPE (full attention).
_LLAMA4_NOPE_INTERVAL = 4


def _attention_layers(lm: dict[str, Any], model_type: str | None, num_layers: Any, window: int | None
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


def _layer_shapes(lm: dict[str, Any], model_type: str | None, fields: dict[str, Any],
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

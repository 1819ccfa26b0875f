"""The recurrent state of attention / recurrent hybrids (Qwen3-Next, Qwen3.5, Nemotron-H, Granite 4.0-H,
Bamba, Falcon-H1, Jamba, Kimi Linear, LFM2, OLMo hybrid) beside their attention KV, read from a Hugging Face
``config.json``.

A recurrent layer keeps a fixed-size state per request instead of KV per token: a **conv state** (the last
``K - 1`` inputs of its causal short convolution, ``[channels, K - 1]``) and, except for LFM2's short
convolutions, an **SSM state** (Mamba's ``[heads, head_dim, d_state]``, the delta rule's ``[heads, d_k,
d_v]``). Shapes per layer, per request, on one tensor-parallel rank (the layout transformers' modeling code
reads; vLLM's ``MambaStateShapeCalculator`` and SGLang's ``Mamba2StateShape`` give the same sizes):

==================  ====================================================  =================================
kind                conv state                                            SSM state
==================  ====================================================  =================================
gated_delta_net     ``(2 Hk dk + Hv dv) / tp, K - 1``                      ``Hv / tp, dk, dv``
kimi_delta          ``3 H d / tp, K - 1``                                  ``H / tp, d, d``
mamba2              ``(I + 2 G' N) / tp, K - 1`` (I = heads x head_dim)     ``heads / tp, head_dim, N``
mamba (Mamba-1)     ``I / tp, K - 1``                                      ``I / tp, N``
short_conv          ``hidden / tp, L_cache - 1``                           none
==================  ====================================================  =================================

G' is Mamba-2's ``n_groups``, replicated up to ``tp`` when fewer groups than ranks (vLLM's
``extra_groups_for_head_shards``). transformers itself keeps K columns of conv state (one never read) and the
SSM state in float32 whatever the model dtype; a pool needs only ``K - 1`` columns, and the dtypes here follow
vLLM's rule: conv = the model dtype, SSM = the conv dtype (``"auto"``), unless the config names an SSM dtype
(``mamba_ssm_dtype`` / ``mamba_ssm_cache_dtype``, e.g. Qwen3.5's float32) or the caller passes one (SGLang
defaults to float32).

Which layers attend and which recur is computed as each family's transformers config class computes it
(``layer_types``, Nemotron-H's ``hybrid_override_pattern``, Jamba's period and offset, Bamba's
``attn_layer_indices``, LFM2's ``full_attn_idxs``, Kimi's 1-indexed ``kda_layers`` / ``full_attn_layers``,
legacy names ``mamba`` / ``attention``). A recurrent size that is absent, zero, negative or not an integer, an
unknown layer type or state dtype is a :class:`~kvpool.errors.ConfigError` naming the field; nothing is
skipped. Family defaults the config classes supply are listed in :data:`FAMILIES`.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool._lazy import lazy_values
from kvpool.errors import ConfigError
from kvpool.numeric import as_int
from kvpool.spec.hf_config import config_int, load_config
from kvpool.spec.kv import AttentionKind, KVCacheSpec, parse_kv_dtype
from kvpool.spec.kv_dtypes import torch_dtypes

if TYPE_CHECKING:
    import torch

#: State dtypes a pool holds (what the recurrent kernels of vLLM and SGLang accept) -> the torch dtype's
#: name (``STATE_DTYPES``, name -> torch dtype, is made at first use: importing this module imports no torch).
STATE_DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
}
#: Config fields that name the SSM state dtype (Qwen3.5: mamba_ssm_dtype; Nemotron-H: mamba_ssm_cache_dtype).
SSM_DTYPE_FIELDS = ("mamba_ssm_dtype", "mamba_ssm_cache_dtype")


class RecurrentKind(str, enum.Enum):
    """The state layout of a family's recurrent mixer (see the module docstring)."""

    GATED_DELTA_NET = "gated_delta_net"
    KIMI_DELTA = "kimi_delta"
    MAMBA2 = "mamba2"
    MAMBA1 = "mamba"
    SHORT_CONV = "short_conv"


class LayerRole(str, enum.Enum):
    """What a layer keeps: attention KV, a recurrent state, both (Falcon-H1's parallel mixers), or nothing
    (Nemotron-H's MLP / MoE layers)."""

    ATTENTION = "attention"
    RECURRENT = "recurrent"
    BOTH = "attention+recurrent"
    NONE = "none"


#: Layer type names (transformers' conventions, legacy names included) and the role each gives.
LAYER_TYPE_ROLES = {
    "full_attention": LayerRole.ATTENTION, "attention": LayerRole.ATTENTION,
    "linear_attention": LayerRole.RECURRENT, "mamba": LayerRole.RECURRENT, "conv": LayerRole.RECURRENT,
    "hybrid": LayerRole.BOTH, "mlp": LayerRole.NONE, "moe": LayerRole.NONE,
}


@functools.cache
def state_dtypes() -> dict[str, torch.dtype]:
    """:data:`STATE_DTYPE_NAMES` with torch dtypes (``STATE_DTYPES``); imports torch."""
    return torch_dtypes(STATE_DTYPE_NAMES)


#: ``STATE_DTYPES`` (:func:`state_dtypes`), made at first use.
__getattr__ = lazy_values(__name__, {"STATE_DTYPES": state_dtypes})


def parse_state_dtype(name: str | torch.dtype, field: str) -> torch.dtype:
    """A state dtype name (or torch dtype) of ``STATE_DTYPES``; ConfigError naming ``field`` otherwise."""
    import torch

    dtypes = state_dtypes()
    if isinstance(name, torch.dtype) and name in dtypes.values():
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in dtypes:
        raise ConfigError(f"{field} {name!r} is not a state dtype a pool can hold; accepted: "
                          f"{', '.join(sorted(dtypes))}")
    return dtypes[key]


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The recurrent state of one model on one tensor-parallel rank: every recurrent layer holds one conv
    state and (unless ``ssm_shape`` is empty) one SSM state per request, all of the same shape.

    Attributes:
        kind: the :class:`RecurrentKind`.
        layers: the model's layer indices that keep a state, ascending.
        conv_shape: ``(channels, K - 1)`` per layer per request (elements).
        ssm_shape: the SSM state per layer per request (elements); ``()`` for short convolutions.
        conv_dtype, ssm_dtype: storage dtypes.
        conv_kernel: the convolution width K (``conv_shape[1] == K - 1``).

    Raises:
        ConfigError: no layers, a repeated or negative layer, a non-positive dimension, a dtype of no state.
    """

    kind: RecurrentKind
    layers: tuple[int, ...]
    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, ...]
    conv_dtype: torch.dtype = "bfloat16"  # type: ignore[assignment]  # torch dtypes after __post_init__
    ssm_dtype: torch.dtype = "bfloat16"  # type: ignore[assignment]
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RecurrentKind(self.kind))
        object.__setattr__(self, "conv_dtype", parse_state_dtype(self.conv_dtype, "conv_dtype"))
        object.__setattr__(self, "ssm_dtype", parse_state_dtype(self.ssm_dtype, "ssm_dtype"))
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ConfigError(f"recurrent layers must be distinct indices >= 0, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(sorted(self.layers)))
        for field in ("conv_shape", "ssm_shape"):
            if any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in getattr(self, field)):
                raise ConfigError(f"{field} must hold positive integers, got {getattr(self, field)!r}")
        if len(self.conv_shape) != 2 or self.conv_shape[1] != self.conv_kernel - 1:
            raise ConfigError(f"conv_shape must be (channels, conv_kernel - 1 = {self.conv_kernel - 1}), "
                              f"got {self.conv_shape!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def conv_bytes(self) -> int:
        """Bytes of one layer's conv state of one request: ``prod(conv_shape) x conv dtype``."""
        return prod(self.conv_shape) * self.conv_dtype.itemsize

    @property
    def ssm_bytes(self) -> int:
        """Bytes of one layer's SSM state of one request (0 for short convolutions)."""
        return prod(self.ssm_shape) * self.ssm_dtype.itemsize if self.ssm_shape else 0

    @property
    def bytes_per_layer(self) -> int:
        """Bytes of one layer's state of one request (vLLM's ``MambaSpec.page_size_bytes`` unpadded)."""
        return self.conv_bytes + self.ssm_bytes

    @property
    def bytes_per_request(self) -> int:
        """Bytes of one request's whole state on this rank: ``layers x bytes_per_layer`` (SGLang's
        ``mamba_cache_per_req``)."""
        return self.num_layers * self.bytes_per_layer

    @property
    def resumes_multi_token(self) -> bool:
        """Whether transformers can continue a multi-token span from a saved state. False for Mamba-1: its
        full-sequence scan ignores the initial state, so a resumed prefill must run token by token."""
        return self.kind is not RecurrentKind.MAMBA1


@dataclass(frozen=True)
class HybridSpec:
    """An attention / recurrent hybrid on one rank: which layer keeps what, the attention KV (a
    :class:`~kvpool.spec.KVCacheSpec` over the attention layers only, ``num_layers`` of them, in model
    order) and the recurrent state.

    Attributes:
        model_type: the config's (text) model type.
        roles: one :class:`LayerRole` per model layer.
        attention: the KV of the attention layers, or None for a model without any (Mamba).
        state: the :class:`RecurrentStateSpec`.
    """

    model_type: str
    roles: tuple[LayerRole, ...]
    attention: KVCacheSpec | None
    state: RecurrentStateSpec

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Model layer indices that keep KV (``attention.num_layers`` of them)."""
        return tuple(i for i, r in enumerate(self.roles) if r in (LayerRole.ATTENTION, LayerRole.BOTH))

    @property
    def state_bytes_per_request(self) -> int:
        return self.state.bytes_per_request

    @property
    def kv_bytes_per_token(self) -> int:
        """Attention KV bytes of one token on this rank (0 without attention layers)."""
        return 0 if self.attention is None else self.attention.bytes_per_token

    @property
    def kv_token_equivalent(self) -> float | None:
        """How many tokens of KV one request's state weighs: ``state_bytes_per_request /
        kv_bytes_per_token`` (None without attention)."""
        return None if self.attention is None else self.state_bytes_per_request / self.kv_bytes_per_token

    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | dict[str, Any], *, tp_size: int = 1,
                       kv_cache_dtype: str = "auto", conv_dtype: str | torch.dtype = "auto",
                       ssm_dtype: str | torch.dtype = "auto", block_size: int = 16) -> HybridSpec:
        """Read a hybrid's ``config.json`` (a file, a folder holding one, or the parsed dict).

        ``kv_cache_dtype`` / ``conv_dtype``: ``"auto"`` = the model's dtype (float32 when the config names
        none). ``ssm_dtype``: ``"auto"`` = the config's :data:`SSM_DTYPE_FIELDS`, else the conv dtype.

        Raises:
            ConfigError: not a recurrent family of :data:`FAMILIES`, an unknown layer type, a recurrent or
                attention size that is missing, zero or not an integer (named), heads that ``tp_size`` does
                not divide, a dtype no pool holds.
        """
        config = load_config(path_or_dict)
        lm = config["text_config"] if isinstance(config.get("text_config"), dict) else config
        model_type = _model_type(lm, config)
        family = FAMILIES[model_type]
        tp = as_int(tp_size, "tp_size", minimum=1, error=ConfigError)
        roles = family.roles(lm)
        declared = config_int(lm, "num_hidden_layers")
        if declared is not None and declared != len(roles) and model_type != "nemotron_h":
            raise ConfigError(f"config.json ({model_type}) lists {len(roles)} layer types but "
                              f"num_hidden_layers is {declared}")
        recurrent = tuple(i for i, r in enumerate(roles) if r in (LayerRole.RECURRENT, LayerRole.BOTH))
        if not recurrent:
            raise ConfigError(f"config.json ({model_type}) has no recurrent layer in its layer types")
        model_dtype = _dtype_name(lm) or _dtype_name(config)
        conv = _conv_dtype(conv_dtype, model_dtype)
        ssm = _ssm_dtype(ssm_dtype, lm, conv)
        conv_shape, ssm_shape, kernel = family.geometry(_Reader(lm, model_type), tp)
        state = RecurrentStateSpec(family.kind, recurrent, conv_shape, ssm_shape, conv, ssm, kernel)
        n_attn = sum(r in (LayerRole.ATTENTION, LayerRole.BOTH) for r in roles)
        kv_dtype = parse_kv_dtype(kv_cache_dtype, model_dtype)
        attention = None if n_attn == 0 else _attention_spec(_Reader(lm, model_type), n_attn, family, tp,
                                                             kv_dtype, block_size)
        return cls(model_type, roles, attention, state)


def is_recurrent_config(path_or_dict: str | Path | dict[str, Any]) -> bool:
    """Whether a config's (text) model type is a recurrent family of :data:`FAMILIES` (reads no sizes)."""
    config = load_config(path_or_dict)
    lm = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    return (lm.get("model_type") or config.get("model_type")) in FAMILIES


# ------------------------------------------------------------------------------------------ reading
class _Reader:
    """Sizes of one config, each checked by :func:`kvpool.spec.hf_config.config_int` (a bool, float, zero or
    negative value is a ConfigError naming the key); an absent key with no default is one too."""

    def __init__(self, config: dict[str, Any], model_type: str) -> None:
        self.config, self.model_type = config, model_type

    def get(self, key: str, default: int | None = None, *, within: str | None = None) -> int:
        source = self.config.get(within) if within else self.config
        value = config_int(source, key) if isinstance(source, dict) else None
        if value is None:
            value = default
        if value is None:
            where = f"{within}.{key}" if within else key
            raise ConfigError(f"config.json ({self.model_type}) has no {where!r}, which its recurrent state "
                              f"needs")
        return value

    def first(self, *keys: str, default: int | None = None) -> int:
        """The first of ``keys`` the config holds (non-null)."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.get(key)
        return self.get(keys[0], default)


def _model_type(lm: dict[str, Any], top: dict[str, Any]) -> str:
    model_type = lm.get("model_type") or top.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise ConfigError(f"config.json model_type {model_type!r} is not a recurrent hybrid kvpool knows; "
                          f"known: {known}")
    return model_type


def _dtype_name(config: dict[str, Any]) -> str | None:
    dtype = config.get("dtype") or config.get("torch_dtype")
    return None if dtype is None else str(dtype)


def _conv_dtype(conv_dtype: str | torch.dtype, model_dtype: str | None) -> torch.dtype:
    if isinstance(conv_dtype, str) and conv_dtype.lower() == "auto":
        return parse_state_dtype(model_dtype or "float32", "the model dtype (config.json torch_dtype)")
    return parse_state_dtype(conv_dtype, "conv_dtype")


def _ssm_dtype(ssm_dtype: str | torch.dtype, lm: dict[str, Any], conv: torch.dtype) -> torch.dtype:
    if not (isinstance(ssm_dtype, str) and ssm_dtype.lower() == "auto"):
        return parse_state_dtype(ssm_dtype, "ssm_dtype")
    for field in SSM_DTYPE_FIELDS:
        if lm.get(field) not in (None, "auto"):
            return parse_state_dtype(lm[field], f"config.json field {field!r}")
    return conv


def _split(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ConfigError(f"tp_size {tp} does not divide {what} {total}")
    return total // tp


# -------------------------------------------------------------------------------- layer roles
def _roles_of(types: object, field: str) -> tuple[LayerRole, ...]:
    if not isinstance(types, list) or not types:
        raise ConfigError(f"config.json field {field!r} must be a non-empty list of layer types, got "
                          f"{types!r:.60}")
    bad = [t for t in types if not isinstance(t, str) or t not in LAYER_TYPE_ROLES]
    if bad:
        raise ConfigError(f"unknown layer type {bad[0]!r} in config.json field {field!r}; known: "
                          f"{', '.join(LAYER_TYPE_ROLES)}")
    return tuple(LAYER_TYPE_ROLES[t] for t in types)


def _listed_roles(lm: dict[str, Any], *fields: str) -> tuple[LayerRole, ...] | None:
    """The roles of the first of ``fields`` the config holds as a list, or None."""
    for field in fields:
        if lm.get(field) is not None:
            return _roles_of(lm[field], field)
    return None


def _layers(lm: dict[str, Any], model_type: str) -> int:
    return _Reader(lm, model_type).get("num_hidden_layers")


def _every(role_of: Callable[[int], LayerRole]) -> Callable[[dict[str, Any]], tuple[LayerRole, ...]]:
    """Roles from ``layer_types`` when listed, else ``role_of(i)`` for each of ``num_hidden_layers``."""
    def roles(lm: dict[str, Any]) -> tuple[LayerRole, ...]:
        listed = _listed_roles(lm, "layer_types")
        if listed is not None:
            return listed
        return tuple(role_of(i) for i in range(_layers(lm, str(lm.get("model_type")))))
    return roles


def _interval_roles(lm: dict[str, Any]) -> tuple[LayerRole, ...]:
    """Qwen3-Next / Qwen3.5: every ``full_attention_interval``-th layer (default 4) attends."""
    listed = _listed_roles(lm, "layer_types")
    if listed is not None:
        return listed
    reader = _Reader(lm, str(lm.get("model_type")))
    interval = reader.get("full_attention_interval", 4)
    return tuple(LayerRole.RECURRENT if (i + 1) % interval else LayerRole.ATTENTION
                 for i in range(reader.get("num_hidden_layers")))


def _olmo_roles(lm: dict[str, Any]) -> tuple[LayerRole, ...]:
    """OLMo hybrid: layer ``i % 4 == 3`` attends (the last one when no layer would)."""
    roles = list(_every(lambda i: LayerRole.ATTENTION if i % 4 == 3 else LayerRole.RECURRENT)(lm))
    if lm.get("layer_types") is None and LayerRole.ATTENTION not in roles:
        roles[-1] = LayerRole.ATTENTION
    return tuple(roles)


_PATTERN = {"M": LayerRole.RECURRENT, "*": LayerRole.ATTENTION, "-": LayerRole.NONE, "E": LayerRole.NONE}


def _nemotron_roles(lm: dict[str, Any]) -> tuple[LayerRole, ...]:
    """Nemotron-H: ``layers_block_type`` / ``layer_types``, else ``hybrid_override_pattern`` (M mamba,
    * attention, - MLP, E MoE)."""
    listed = _listed_roles(lm, "layers_block_type", "layer_types")
    if listed is not None:
        return listed
    pattern = lm.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(_PATTERN):
        raise ConfigError(f"config.json (nemotron_h) needs layers_block_type or a hybrid_override_pattern of "
                          f"M, *, - and E, got {pattern!r:.60}")
    return tuple(_PATTERN[c] for c in pattern)


def _indices_roles(field: str, inside: LayerRole, outside: LayerRole, default_all: LayerRole
                   ) -> Callable[[dict[str, Any]], tuple[LayerRole, ...]]:
    """Layers named in the list ``field`` get ``inside``, the others ``outside``; without the list every
    layer gets ``default_all`` (Bamba's attn_layer_indices, LFM2's full_attn_idxs)."""
    def roles(lm: dict[str, Any]) -> tuple[LayerRole, ...]:
        listed = _listed_roles(lm, "layer_types")
        if listed is not None:
            return listed
        n = _layers(lm, str(lm.get("model_type")))
        named = lm.get(field)
        if named is None:
            return (default_all,) * n
        _check_indices(named, field, n, base=0)
        return tuple(inside if i in named else outside for i in range(n))
    return roles


def _check_indices(named: object, field: str, n: int, base: int) -> None:
    if not isinstance(named, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in named) \
            or any(not base <= i < n + base for i in named):
        raise ConfigError(f"config.json field {field!r} must list layer indices in [{base}, {n + base}), got "
                          f"{named!r:.60}")


def _jamba_roles(lm: dict[str, Any]) -> tuple[LayerRole, ...]:
    """Jamba: layer i attends when ``i % attn_layer_period == attn_layer_offset`` (defaults 8 and 4)."""
    reader = _Reader(lm, "jamba")
    period, offset = reader.get("attn_layer_period", 8), config_int(lm, "attn_layer_offset", 0)
    offset = 4 if offset is None else offset
    if offset >= period:
        raise ConfigError(f"config.json attn_layer_offset {offset} must be below attn_layer_period {period}")
    return tuple(LayerRole.ATTENTION if i % period == offset else LayerRole.RECURRENT
                 for i in range(reader.get("num_hidden_layers")))


def _kimi_roles(lm: dict[str, Any]) -> tuple[LayerRole, ...]:
    """Kimi Linear: ``layer_types``, else ``linear_attn_config``'s 1-indexed ``full_attn_layers`` and
    ``kda_layers`` (together every layer), else layer ``i > 0`` with ``i % 4 == 0`` attends
    (KimiLinearConfig's default)."""
    listed = _listed_roles(lm, "layer_types")
    if listed is not None:
        return listed
    n = _layers(lm, "kimi_linear")
    linear = lm.get("linear_attn_config") if isinstance(lm.get("linear_attn_config"), dict) else {}
    if "full_attn_layers" in linear and "kda_layers" in linear:
        full, kda = linear["full_attn_layers"], linear["kda_layers"]
        _check_indices(full, "linear_attn_config.full_attn_layers", n, base=1)
        _check_indices(kda, "linear_attn_config.kda_layers", n, base=1)
        if sorted([*full, *kda]) != list(range(1, n + 1)):
            raise ConfigError(f"config.json linear_attn_config: full_attn_layers and kda_layers must name "
                              f"each of the {n} layers (1-indexed) once")
        return tuple(LayerRole.ATTENTION if i + 1 in full else LayerRole.RECURRENT for i in range(n))
    return tuple(LayerRole.ATTENTION if i and i % 4 == 0 else LayerRole.RECURRENT for i in range(n))


def _granite_roles(lm: dict[str, Any]) -> tuple[LayerRole, ...]:
    """Granite 4.0-H: ``layer_types`` / ``layers_block_type`` (legacy ``mamba`` / ``attention``), else every
    layer Mamba-2."""
    listed = _listed_roles(lm, "layer_types", "layers_block_type")
    return listed if listed is not None else (LayerRole.RECURRENT,) * _layers(lm, "granitemoehybrid")


def _all(role: LayerRole) -> Callable[[dict[str, Any]], tuple[LayerRole, ...]]:
    return lambda lm: (role,) * _layers(lm, str(lm.get("model_type")))


# ------------------------------------------------------------------------------- state geometry
Geometry = tuple[tuple[int, int], tuple[int, ...], int]


def _gdn(r: _Reader, tp: int) -> Geometry:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid): q, k (Hk x dk) and v (Hv x dv) through one conv."""
    hk, hv = r.get("linear_num_key_heads"), r.get("linear_num_value_heads")
    dk, dv = r.get("linear_key_head_dim"), r.get("linear_value_head_dim")
    k = r.get("linear_conv_kernel_dim", 4)
    _split(hk, tp, "linear_num_key_heads")
    conv = _split(2 * hk * dk + hv * dv, tp, "the conv channels 2 Hk dk + Hv dv")
    return (conv, k - 1), (_split(hv, tp, "linear_num_value_heads"), dk, dv), k


def _olmo_gdn(r: _Reader, tp: int) -> Geometry:
    """OLMo hybrid's GDN, with OlmoHybridConfig's defaults: heads = num_attention_heads, dk = int(0.75 hidden
    / Hk), dv = 2 dk."""
    heads = r.get("num_attention_heads")
    hk = r.first("linear_num_key_heads", default=heads)
    dk = r.first("linear_key_head_dim", default=int(0.75 * r.get("hidden_size") / hk))
    filled = {"linear_num_key_heads": hk,
              "linear_num_value_heads": r.first("linear_num_value_heads", default=heads),
              "linear_key_head_dim": dk,
              "linear_value_head_dim": r.first("linear_value_head_dim", default=2 * dk),
              "linear_conv_kernel_dim": r.get("linear_conv_kernel_dim", 4)}
    return _gdn(_Reader(filled, r.model_type), tp)


def _kda(r: _Reader, tp: int) -> Geometry:
    """Kimi Delta Attention: q, k, v of H x d each through the short convs; state ``d x d`` per head. The
    published config nests the sizes in ``linear_attn_config``; transformers' own dict has them flat."""
    nested = r.config.get("linear_attn_config")
    nested = nested if isinstance(nested, dict) else {}

    def size(inner: str, flat: str, default: int | None = None) -> int:
        if nested.get(inner) is not None:
            return r.get(inner, within="linear_attn_config")
        return r.get(flat, default)

    heads, dim = size("num_heads", "linear_num_heads"), size("head_dim", "linear_head_dim")
    k = size("short_conv_kernel_size", "linear_conv_kernel_dim", 4)
    heads_per_rank = _split(heads, tp, "the KDA num_heads")
    return (3 * heads_per_rank * dim, k - 1), (heads_per_rank, dim, dim), k


def _mamba2_from(r: _Reader, tp: int, heads: int, head_dim: int, intermediate: int, groups: int,
                 state: int, kernel: int) -> Geometry:
    if head_dim * heads != intermediate:
        raise ConfigError(f"config.json ({r.model_type}): Mamba-2 heads {heads} x head_dim {head_dim} != the "
                          f"intermediate size {intermediate}")
    if groups % tp and tp % groups:
        raise ConfigError(f"tp_size {tp} neither divides nor is a multiple of the Mamba-2 n_groups {groups}")
    groups = max(groups, tp)  # vLLM's extra_groups_for_head_shards: replicate groups up to one per rank
    conv = _split(intermediate + 2 * groups * state, tp, "the Mamba-2 conv channels")
    return (conv, kernel - 1), (_split(heads, tp, "the Mamba-2 heads"), head_dim, state), kernel


def _nemotron(r: _Reader, tp: int) -> Geometry:
    heads, head_dim = r.get("mamba_num_heads"), r.get("mamba_head_dim")
    return _mamba2_from(r, tp, heads, head_dim, heads * head_dim, r.get("n_groups"), r.get("ssm_state_size"),
                        r.get("conv_kernel"))


def _bamba(r: _Reader, tp: int) -> Geometry:
    """Bamba, Granite 4.0-H and Falcon-H1: intermediate = ``mamba_d_ssm`` (Falcon-H1) or ``mamba_expand x
    hidden_size``; ``mamba_d_head`` "auto" = intermediate / heads."""
    intermediate = r.first("mamba_d_ssm", default=r.get("mamba_expand", 2) * r.get("hidden_size"))
    heads = r.get("mamba_n_heads")
    auto = r.config.get("mamba_d_head", "auto") == "auto"
    head_dim = intermediate // heads if auto else r.get("mamba_d_head")
    return _mamba2_from(r, tp, heads, head_dim, intermediate, r.get("mamba_n_groups", 1),
                        r.get("mamba_d_state"), r.get("mamba_d_conv", 4))


def _mamba2(r: _Reader, tp: int) -> Geometry:
    """Plain Mamba-2 (Mamba2Config): intermediate = ``expand x hidden_size``."""
    intermediate = r.get("expand", 2) * r.get("hidden_size")
    return _mamba2_from(r, tp, r.get("num_heads"), r.get("head_dim"), intermediate, r.get("n_groups"),
                        r.get("state_size"), r.get("conv_kernel", 4))


def _jamba(r: _Reader, tp: int) -> Geometry:
    """Jamba's Mamba-1: conv over ``mamba_expand x hidden_size`` channels, state ``channels x d_state``."""
    channels = _split(r.get("mamba_expand", 2) * r.get("hidden_size"), tp, "the Mamba intermediate size")
    k = r.get("mamba_d_conv", 4)
    return (channels, k - 1), (channels, r.get("mamba_d_state")), k


def _mamba1(r: _Reader, tp: int) -> Geometry:
    """MambaConfig / FalconMambaConfig: ``intermediate_size`` (= expand x hidden_size) channels."""
    intermediate = r.first("intermediate_size", default=r.get("expand", 2) * r.get("hidden_size"))
    channels, k = _split(intermediate, tp, "intermediate_size"), r.get("conv_kernel", 4)
    return (channels, k - 1), (channels, r.get("state_size")), k


def _short_conv(r: _Reader, tp: int) -> Geometry:
    """LFM2: a gated short convolution of width ``conv_L_cache`` over ``hidden_size`` channels, no SSM."""
    k = r.get("conv_L_cache", 3)
    return (_split(r.get("hidden_size"), tp, "hidden_size"), k - 1), (), k


@dataclass(frozen=True)
class Family:
    """How one model type lays out its layers and its state, and where its attention sizes are."""

    kind: RecurrentKind
    roles: Callable[[dict[str, Any]], tuple[LayerRole, ...]]
    geometry: Callable[[_Reader, int], Geometry]
    mla: bool = False  # the attention layers keep one MLA latent (Kimi Linear)


_GDN = Family(RecurrentKind.GATED_DELTA_NET, _interval_roles, _gdn)
_BAMBA_LIKE = dict(kind=RecurrentKind.MAMBA2, geometry=_bamba)
#: Model types understood (text configs of multimodal wrappers too) and each one's rules.
FAMILIES: dict[str, Family] = {
    **dict.fromkeys(["qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"], _GDN),
    "olmo_hybrid": Family(RecurrentKind.GATED_DELTA_NET, _olmo_roles, _olmo_gdn),
    "kimi_linear": Family(RecurrentKind.KIMI_DELTA, _kimi_roles, _kda, mla=True),
    "nemotron_h": Family(RecurrentKind.MAMBA2, _nemotron_roles, _nemotron),
    "granitemoehybrid": Family(roles=_granite_roles, **_BAMBA_LIKE),
    "bamba": Family(roles=_indices_roles("attn_layer_indices", LayerRole.ATTENTION, LayerRole.RECURRENT,
                                         LayerRole.RECURRENT), **_BAMBA_LIKE),
    "falcon_h1": Family(roles=_all(LayerRole.BOTH), **_BAMBA_LIKE),
    "mamba2": Family(RecurrentKind.MAMBA2, _all(LayerRole.RECURRENT), _mamba2),
    "jamba": Family(RecurrentKind.MAMBA1, _jamba_roles, _jamba),
    **dict.fromkeys(["mamba", "falcon_mamba"],
                    Family(RecurrentKind.MAMBA1, _all(LayerRole.RECURRENT), _mamba1)),
    **dict.fromkeys(["lfm2", "lfm2_moe"], Family(RecurrentKind.SHORT_CONV, _indices_roles(
        "full_attn_idxs", LayerRole.ATTENTION, LayerRole.RECURRENT, LayerRole.ATTENTION), _short_conv)),
}


# --------------------------------------------------------------------------------- attention
def _attention_spec(r: _Reader, num_layers: int, family: Family, tp: int, dtype: torch.dtype,
                    block_size: int) -> KVCacheSpec:
    """The attention layers' KV: GQA heads and head_dim (``head_dim``, else hidden / heads), or Kimi's MLA
    latent ``kv_lora_rank + qk_rope_head_dim`` (vLLM's MLA head size; not split by tensor parallelism)."""
    heads = r.get("num_attention_heads")
    if family.mla:
        rank, rope = r.get("kv_lora_rank"), config_int(r.config, "qk_rope_head_dim", 0)
        rope = 0 if rope is None else rope
        return KVCacheSpec(num_layers, heads, rank + rope, dtype, block_size, AttentionKind.MLA, rank, rope,
                           tp_size=tp, num_attention_heads=heads)
    kv_heads = r.first("num_key_value_heads", default=heads)
    head_dim = config_int(r.config, "head_dim")
    if head_dim is None:
        hidden = r.get("hidden_size")
        if hidden % heads:
            raise ConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    return KVCacheSpec(num_layers, kv_heads, head_dim, dtype, block_size, tp_size=tp,
                       num_attention_heads=heads)


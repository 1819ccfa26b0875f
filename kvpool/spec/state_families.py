"""The recurrent families of :mod:`kvpool.spec.state`: which layers attend and which recur, and the shape of
each recurrent mixer's state, computed as each family's transformers config class computes them.

:class:`RecurrentKind` names a state layout, :class:`LayerRole` what a layer keeps; :data:`FAMILIES` maps each
model type kvpool understands to its :class:`Family` (its layer roles, its state geometry per tensor-parallel
rank, whether its attention keeps an MLA latent). :class:`ConfigReader` reads a config's sizes, each checked
(a bool, float, zero or negative value, or an absent key with no default, is a ConfigError naming the key).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError
from kvpool.spec.hf_config import config_int


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



# ------------------------------------------------------------------------------------------ reading
class ConfigReader:
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


def model_type_of(lm: dict[str, Any], top: dict[str, Any]) -> str:
    model_type = lm.get("model_type") or top.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise ConfigError(f"config.json model_type {model_type!r} is not a recurrent hybrid kvpool knows; "
                          f"known: {known}")
    return model_type



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
    return ConfigReader(lm, model_type).get("num_hidden_layers")


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
    reader = ConfigReader(lm, str(lm.get("model_type")))
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
    reader = ConfigReader(lm, "jamba")
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


def _gdn(r: ConfigReader, tp: int) -> Geometry:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid): q, k (Hk x dk) and v (Hv x dv) through one conv."""
    hk, hv = r.get("linear_num_key_heads"), r.get("linear_num_value_heads")
    dk, dv = r.get("linear_key_head_dim"), r.get("linear_value_head_dim")
    k = r.get("linear_conv_kernel_dim", 4)
    _split(hk, tp, "linear_num_key_heads")
    conv = _split(2 * hk * dk + hv * dv, tp, "the conv channels 2 Hk dk + Hv dv")
    return (conv, k - 1), (_split(hv, tp, "linear_num_value_heads"), dk, dv), k


def _olmo_gdn(r: ConfigReader, tp: int) -> Geometry:
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
    return _gdn(ConfigReader(filled, r.model_type), tp)


def _kda(r: ConfigReader, tp: int) -> Geometry:
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


def _mamba2_from(r: ConfigReader, tp: int, heads: int, head_dim: int, intermediate: int, groups: int,
                 state: int, kernel: int) -> Geometry:
    if head_dim * heads != intermediate:
        raise ConfigError(f"config.json ({r.model_type}): Mamba-2 heads {heads} x head_dim {head_dim} != the "
                          f"intermediate size {intermediate}")
    if groups % tp and tp % groups:
        raise ConfigError(f"tp_size {tp} neither divides nor is a multiple of the Mamba-2 n_groups {groups}")
    groups = max(groups, tp)  # vLLM's extra_groups_for_head_shards: replicate groups up to one per rank
    conv = _split(intermediate + 2 * groups * state, tp, "the Mamba-2 conv channels")
    return (conv, kernel - 1), (_split(heads, tp, "the Mamba-2 heads"), head_dim, state), kernel


def _nemotron(r: ConfigReader, tp: int) -> Geometry:
    heads, head_dim = r.get("mamba_num_heads"), r.get("mamba_head_dim")
    return _mamba2_from(r, tp, heads, head_dim, heads * head_dim, r.get("n_groups"), r.get("ssm_state_size"),
                        r.get("conv_kernel"))


def _bamba(r: ConfigReader, tp: int) -> Geometry:
    """Bamba, Granite 4.0-H and Falcon-H1: intermediate = ``mamba_d_ssm`` (Falcon-H1) or ``mamba_expand x
    hidden_size``; ``mamba_d_head`` "auto" = intermediate / heads."""
    intermediate = r.first("mamba_d_ssm", default=r.get("mamba_expand", 2) * r.get("hidden_size"))
    heads = r.get("mamba_n_heads")
    auto = r.config.get("mamba_d_head", "auto") == "auto"
    head_dim = intermediate // heads if auto else r.get("mamba_d_head")
    return _mamba2_from(r, tp, heads, head_dim, intermediate, r.get("mamba_n_groups", 1),
                        r.get("mamba_d_state"), r.get("mamba_d_conv", 4))


def _mamba2(r: ConfigReader, tp: int) -> Geometry:
    """Plain Mamba-2 (Mamba2Config): intermediate = ``expand x hidden_size``."""
    intermediate = r.get("expand", 2) * r.get("hidden_size")
    return _mamba2_from(r, tp, r.get("num_heads"), r.get("head_dim"), intermediate, r.get("n_groups"),
                        r.get("state_size"), r.get("conv_kernel", 4))


def _jamba(r: ConfigReader, tp: int) -> Geometry:
    """Jamba's Mamba-1: conv over ``mamba_expand x hidden_size`` channels, state ``channels x d_state``."""
    channels = _split(r.get("mamba_expand", 2) * r.get("hidden_size"), tp, "the Mamba intermediate size")
    k = r.get("mamba_d_conv", 4)
    return (channels, k - 1), (channels, r.get("mamba_d_state")), k


def _mamba1(r: ConfigReader, tp: int) -> Geometry:
    """MambaConfig / FalconMambaConfig: ``intermediate_size`` (= expand x hidden_size) channels."""
    intermediate = r.first("intermediate_size", default=r.get("expand", 2) * r.get("hidden_size"))
    channels, k = _split(intermediate, tp, "intermediate_size"), r.get("conv_kernel", 4)
    return (channels, k - 1), (channels, r.get("state_size")), k


def _short_conv(r: ConfigReader, tp: int) -> Geometry:
    """LFM2: a gated short convolution of width ``conv_L_cache`` over ``hidden_size`` channels, no SSM."""
    k = r.get("conv_L_cache", 3)
    return (_split(r.get("hidden_size"), tp, "hidden_size"), k - 1), (), k


@dataclass(frozen=True)
class Family:
    """How one model type lays out its layers and its state, and where its attention sizes are."""

    kind: RecurrentKind
    roles: Callable[[dict[str, Any]], tuple[LayerRole, ...]]
    geometry: Callable[[ConfigReader, int], Geometry]
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

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

import functools
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool._lazy import lazy_values
from kvpool.errors import ConfigError
from kvpool.numeric import as_int
from kvpool.spec.hf_config import config_int, load_config
from kvpool.spec.kv import AttentionKind, KVCacheSpec
from kvpool.spec.kv_dtypes import TorchDtypeField, kv_dtype_name, torch_dtypes
from kvpool.spec.state_families import (  # noqa: F401 (LAYER_TYPE_ROLES re-exported)
    FAMILIES,
    LAYER_TYPE_ROLES,
    ConfigReader,
    Family,
    LayerRole,
    RecurrentKind,
    model_type_of,
)

if TYPE_CHECKING:
    import torch

#: State dtypes a pool holds (what the recurrent kernels of vLLM and SGLang accept) -> the torch dtype's
#: name (``STATE_DTYPES``, name -> torch dtype, is made at first use: importing this module imports no torch).
STATE_DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
}
#: Bytes per element of each torch dtype name of :data:`STATE_DTYPE_NAMES` (``torch.<name>.itemsize``).
STATE_DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
#: Config fields that name the SSM state dtype (Qwen3.5: mamba_ssm_dtype; Nemotron-H: mamba_ssm_cache_dtype).
SSM_DTYPE_FIELDS = ("mamba_ssm_dtype", "mamba_ssm_cache_dtype")



@functools.cache
def state_dtypes() -> dict[str, torch.dtype]:
    """:data:`STATE_DTYPE_NAMES` with torch dtypes (``STATE_DTYPES``); imports torch."""
    return torch_dtypes(STATE_DTYPE_NAMES)


#: ``STATE_DTYPES`` (:func:`state_dtypes`), made at first use.
__getattr__ = lazy_values(__name__, {"STATE_DTYPES": state_dtypes})


def state_dtype_name(name: object, field: str) -> str:
    """The name of the torch dtype (a key of :data:`STATE_DTYPE_BYTES`) of a name of :data:`STATE_DTYPE_NAMES`
    or a torch dtype (its ``str`` is ``torch.<name>``), without importing torch; ConfigError naming ``field``
    otherwise."""
    key = str(name).lower().removeprefix("torch.")
    if key not in STATE_DTYPE_NAMES:
        raise ConfigError(f"{field} {name!r} is not a state dtype a pool can hold; accepted: "
                          f"{', '.join(sorted(STATE_DTYPE_NAMES))}")
    return STATE_DTYPE_NAMES[key]


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The recurrent state of one model on one tensor-parallel rank: every recurrent layer holds one conv
    state and (unless ``ssm_shape`` is empty) one SSM state per request, all of the same shape.

    Attributes:
        kind: the :class:`RecurrentKind`.
        layers: the model's layer indices that keep a state, ascending.
        conv_shape: ``(channels, K - 1)`` per layer per request (elements).
        ssm_shape: the SSM state per layer per request (elements); ``()`` for short convolutions.
        conv_dtype, ssm_dtype: storage dtypes (a torch dtype or a name of :data:`STATE_DTYPE_NAMES`), kept
            by name (:attr:`conv_dtype_name`, :attr:`ssm_dtype_name`) and read as torch's: sizing a spec
            imports no torch.
        conv_kernel: the convolution width K (``conv_shape[1] == K - 1``).

    Raises:
        ConfigError: no layers, a repeated or negative layer, a non-positive dimension, a dtype of no state.
    """

    kind: RecurrentKind
    layers: tuple[int, ...]
    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, ...]
    conv_dtype: torch.dtype = TorchDtypeField("bfloat16", state_dtype_name)  # type: ignore[assignment]
    ssm_dtype: torch.dtype = TorchDtypeField("bfloat16", state_dtype_name)  # type: ignore[assignment]
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RecurrentKind(self.kind))
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
    def conv_dtype_name(self) -> str:
        """The name of :attr:`conv_dtype` (``"bfloat16"``), read without importing torch."""
        return _CONV_DTYPE.name_of(self)

    @property
    def ssm_dtype_name(self) -> str:
        """The name of :attr:`ssm_dtype` (``"float32"``), read without importing torch."""
        return _SSM_DTYPE.name_of(self)

    @property
    def conv_bytes(self) -> int:
        """Bytes of one layer's conv state of one request: ``prod(conv_shape) x conv dtype``."""
        return prod(self.conv_shape) * STATE_DTYPE_BYTES[self.conv_dtype_name]

    @property
    def ssm_bytes(self) -> int:
        """Bytes of one layer's SSM state of one request (0 for short convolutions)."""
        return prod(self.ssm_shape) * STATE_DTYPE_BYTES[self.ssm_dtype_name] if self.ssm_shape else 0

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


_CONV_DTYPE: TorchDtypeField = RecurrentStateSpec.__dict__["conv_dtype"]  # the dtype fields (by name)
_SSM_DTYPE: TorchDtypeField = RecurrentStateSpec.__dict__["ssm_dtype"]


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
        model_type = model_type_of(lm, config)
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
        conv_shape, ssm_shape, kernel = family.geometry(ConfigReader(lm, model_type), tp)
        state = RecurrentStateSpec(family.kind, recurrent, conv_shape, ssm_shape, conv, ssm, kernel)
        n_attn = sum(r in (LayerRole.ATTENTION, LayerRole.BOTH) for r in roles)
        kv_dtype = kv_dtype_name(kv_cache_dtype, model_dtype)
        attention = None if n_attn == 0 else _attention_spec(ConfigReader(lm, model_type), n_attn, family, tp,
                                                             kv_dtype, block_size)
        return cls(model_type, roles, attention, state)


def is_recurrent_config(path_or_dict: str | Path | dict[str, Any]) -> bool:
    """Whether a config's (text) model type is a recurrent family of :data:`FAMILIES` (reads no sizes)."""
    config = load_config(path_or_dict)
    lm = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    return (lm.get("model_type") or config.get("model_type")) in FAMILIES



def _dtype_name(config: dict[str, Any]) -> str | None:
    dtype = config.get("dtype") or config.get("torch_dtype")
    return None if dtype is None else str(dtype)


def _conv_dtype(conv_dtype: str | torch.dtype, model_dtype: str | None) -> str:
    if isinstance(conv_dtype, str) and conv_dtype.lower() == "auto":
        return state_dtype_name(model_dtype or "float32", "the model dtype (config.json torch_dtype)")
    return state_dtype_name(conv_dtype, "conv_dtype")


def _ssm_dtype(ssm_dtype: str | torch.dtype, lm: dict[str, Any], conv: str) -> str:
    if not (isinstance(ssm_dtype, str) and ssm_dtype.lower() == "auto"):
        return state_dtype_name(ssm_dtype, "ssm_dtype")
    for field in SSM_DTYPE_FIELDS:
        if lm.get(field) not in (None, "auto"):
            return state_dtype_name(lm[field], f"config.json field {field!r}")
    return conv


# --------------------------------------------------------------------------------- attention
def _attention_spec(r: ConfigReader, num_layers: int, family: Family, tp: int, dtype: str,
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


"""``KVCacheSpec``: the shape of one model's KV cache, and how many bytes it takes.

Formulas (per tensor-parallel rank):

* MHA / GQA / MQA: ``bytes_per_token = 2 (K and V) x num_layers x num_kv_heads_per_rank x head_dim x
  dtype_bytes``. GQA counts KV heads, never query heads (Qwen2.5-0.5B: 24 x 2 x 2 x 64 x 2 B = 12 KiB).
* MLA (DeepSeek-V2/V3): one compressed latent per token per layer, ``num_layers x (kv_lora_rank +
  qk_rope_head_dim) x dtype_bytes``; the latent is not split by tensor parallelism.
* ``bytes_per_block = bytes_per_token x block_size``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.errors import ConfigError

#: KV cache dtype names accepted everywhere (CLI, ``from_hf_config``, ``parse_kv_dtype``).
KV_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def parse_kv_dtype(name: str | torch.dtype, model_dtype: str | None = None) -> torch.dtype:
    """Resolve a KV cache dtype name to a torch dtype.

    ``"auto"`` means the model's own dtype (``model_dtype``, e.g. a config's ``torch_dtype``), float32 when
    the model names none. Raises :class:`ConfigError` listing the accepted names for an unknown one (or for
    a torch dtype that is not a KV dtype, such as int8).
    """
    if isinstance(name, torch.dtype) and name in KV_DTYPES.values():
        return name
    key = str(name).lower().removeprefix("torch.")
    if key == "auto":
        return parse_kv_dtype(model_dtype) if model_dtype not in (None, "auto") else torch.float32
    if key not in KV_DTYPES:
        accepted = ", ".join(["auto", *KV_DTYPES])
        raise ConfigError(f"unknown KV cache dtype {name!r}; accepted: {accepted}")
    return KV_DTYPES[key]


class AttentionKind(str, enum.Enum):
    """How K/V are stored: ``MHA`` (K and V per KV head; covers GQA and MQA) or ``MLA`` (one latent)."""

    MHA = "mha"
    MLA = "mla"


def _require_int(minimum: int = 1, **values: int | None) -> None:
    for field, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{field} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache of one model on one tensor-parallel rank.

    Args:
        num_layers: attention layers that keep KV.
        num_kv_heads: KV heads of the whole model, before tensor parallelism (not query heads).
        head_dim: elements per head.
        dtype: KV storage dtype (a torch dtype or a name from :data:`KV_DTYPES`).
        block_size: tokens per block (vLLM's block_size, SGLang's page_size).
        attention: :class:`AttentionKind` (``"mha"`` or ``"mla"``).
        kv_lora_rank, qk_rope_head_dim: the MLA latent's two parts (MLA only).
        sliding_window: attention window in tokens, or None.
        tp_size: tensor-parallel ranks.

    Raises:
        ConfigError: a non-positive size, an MLA spec without a latent size, or KV heads and ``tp_size`` that
            cannot be split (``tp_size`` must divide the heads, or be a multiple of them).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    attention: AttentionKind = AttentionKind.MHA
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    sliding_window: int | None = None
    tp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_kv_dtype(self.dtype))
        try:
            object.__setattr__(self, "attention", AttentionKind(self.attention))
        except ValueError:
            raise ConfigError(f"attention must be 'mha' or 'mla', got {self.attention!r}") from None
        _require_int(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                     block_size=self.block_size, tp_size=self.tp_size)
        if self.sliding_window is not None:
            _require_int(sliding_window=self.sliding_window)
        if self.attention is AttentionKind.MLA:
            _require_int(kv_lora_rank=self.kv_lora_rank)
            _require_int(0, qk_rope_head_dim=self.qk_rope_head_dim)
        else:
            self._check_tp_split()

    def _check_tp_split(self) -> None:
        heads, tp = self.num_kv_heads, self.tp_size
        if heads >= tp and heads % tp:
            raise ConfigError(f"tp_size {tp} does not divide num_kv_heads {heads}")
        if heads < tp and tp % heads:
            raise ConfigError(f"tp_size {tp} is not a multiple of num_kv_heads {heads} (needed to replicate)")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per stored element (1 for fp8)."""
        return self.dtype.itemsize

    @property
    def num_kv_heads_per_rank(self) -> int:
        """KV heads one rank stores: heads / tp, or 1 replicated head when tp > heads; 1 latent for MLA."""
        if self.attention is AttentionKind.MLA:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def latent_dim(self) -> int:
        """MLA latent width per token per layer: ``kv_lora_rank + qk_rope_head_dim`` (0 for MHA)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.attention is AttentionKind.MLA else 0

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes on one rank, all layers (formulas in the module docstring)."""
        if self.attention is AttentionKind.MLA:
            return self.num_layers * self.latent_dim * self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads_per_rank * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        """KV bytes one block of ``block_size`` tokens takes on one rank, all layers."""
        return self.bytes_per_token * self.block_size

    @classmethod
    def from_hf_config(
        cls,
        path_or_dict: str | Path | dict[str, Any],
        *,
        tp_size: int = 1,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
    ) -> KVCacheSpec:
        """Build the spec from a Hugging Face ``config.json`` (a file, a folder holding one, or a dict).

        See :func:`kvpool.hf_config.read_kv_fields` for the model types understood and how missing fields
        are filled. Raises :class:`ConfigError` for an unreadable config, a missing field or a bad dtype.
        """
        from kvpool.hf_config import read_kv_fields

        fields = read_kv_fields(path_or_dict)
        model_dtype = fields.pop("model_dtype")
        return cls(**fields, dtype=parse_kv_dtype(kv_cache_dtype, model_dtype),
                   block_size=block_size, tp_size=tp_size)

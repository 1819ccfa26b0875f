"""``MLAKVCache``: the latent KV of multi-head latent attention (DeepSeek-V2/V3), one tensor for all layers.

MLA caches one vector per token per layer, ``c_kv`` (``kv_lora_rank`` wide) followed by the decoupled RoPE
key ``k_pe`` (``qk_rope_head_dim`` wide), instead of K and V per head (vLLM's and SGLang's MLA layout).
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.spec import AttentionKind, KVCacheSpec
from kvpool.storage.arena import ElasticConfig
from kvpool.storage.block_copy import BlockIds
from kvpool.storage.block_store import BlockStore
from kvpool.storage.slots import as_raw, dequantize, drop_padding, encode, fp8_scales


class MLAKVCache(BlockStore):
    """One latent buffer ``[num_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``.

    Args:
        spec: an MLA :class:`KVCacheSpec`.
        num_blocks: as for :class:`kvpool.storage.paged.PagedKVCache`.
        device: as for :class:`kvpool.storage.paged.PagedKVCache`.
        dtype: overrides ``spec.dtype``, as for :class:`kvpool.storage.paged.PagedKVCache`.
        pin_memory: as for :class:`kvpool.storage.paged.PagedKVCache`.
        zero: as for :class:`kvpool.storage.paged.PagedKVCache` (the buffer is ``torch.empty`` unless
            ``zero``).
        scale: per-tensor fp8 scale of the latent (ignored for other dtypes).
        elastic: as for :class:`kvpool.storage.paged.PagedKVCache`; the latent keeps its
            ``[L, N, B, R + P]`` layout there, so a block touches at least L pages.

    Views (no copies): :meth:`kv_cache` ``[N, B, R + P]``, :meth:`flat_kv_cache` ``[N*B, R + P]``, and the two
    parts :meth:`c_kv_cache` ``[N, B, R]`` and :meth:`k_pe_cache` ``[N, B, P]`` (non-contiguous slices).

    Raises:
        ConfigError: a spec that is not MLA, or a non-positive ``num_blocks``.
    """

    block_dim = 1

    def __init__(self, spec: KVCacheSpec, num_blocks: int, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, scale: float = 1.0, pin_memory: bool = False,
                 zero: bool = False, elastic: bool | ElasticConfig = False) -> None:
        if spec.attention is not AttentionKind.MLA:
            raise ConfigError("MLAKVCache needs an MLA spec (attention='mla'); use PagedKVCache for MHA/GQA")
        if len(spec.groups) > 1:
            raise ConfigError("MLAKVCache stores one KV cache group; this spec has "
                              f"{len(spec.groups)} (sliding-window or chunked layers)")
        dtype = dtype or spec.dtype
        self.spec, self.num_layers = spec, spec.num_layers
        self.kv_lora_rank, self.rope_dim = spec.kv_lora_rank, spec.qk_rope_head_dim
        self.latent_dim = spec.latent_dim
        (self.scale,) = fp8_scales(dtype, scale)
        super().__init__((self.num_layers, num_blocks, spec.block_size, self.latent_dim), spec.block_size,
                         device=device, dtype=dtype, pin_memory=pin_memory, zero=zero, elastic=elastic)
        self._flat_raw = [self._raw[layer].view(self.num_slots, -1) for layer in range(self.num_layers)]

    def kv_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s latent ``[N, B, R + P]`` (a contiguous view)."""
        layer = self._check_layer(layer, self.num_layers)
        return self.buffer[layer]

    def flat_kv_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s latent by slot ``[N*B, R + P]`` (a contiguous view)."""
        return self.kv_cache(layer).view(self.num_slots, self.latent_dim)

    def c_kv_cache(self, layer: int) -> torch.Tensor:
        """The compressed KV part ``[N, B, R]`` (a non-contiguous view)."""
        return self.kv_cache(layer)[..., : self.kv_lora_rank]

    def k_pe_cache(self, layer: int) -> torch.Tensor:
        """The RoPE key part ``[N, B, P]`` (a non-contiguous view)."""
        return self.kv_cache(layer)[..., self.kv_lora_rank:]

    def store_latent(self, c_kv: torch.Tensor, k_pe: torch.Tensor | None, slot_mapping: torch.Tensor,
                     layer: int, *, check: bool = True) -> None:
        """Write token ``t``'s ``[c_kv | k_pe]`` into slot ``slot_mapping[t]`` of ``layer`` (-1 skips).

        ``c_kv`` ``[T, R]``, ``k_pe`` ``[T, P]`` (None when P = 0), dtype and device rules, ``check`` and the
        errors as for :meth:`kvpool.storage.paged.PagedKVCache.store_kv`; nothing is written when it raises.
        """
        layer = self._check_layer(layer, self.num_layers)
        num_tokens = self._check_rows(c_kv, "c_kv", (self.kv_lora_rank,), None)
        if k_pe is not None or self.rope_dim:
            self._check_rows(k_pe, "k_pe", (self.rope_dim,), num_tokens)
            if k_pe.dtype != c_kv.dtype:
                raise InvalidArgumentError(f"c_kv is {c_kv.dtype} but k_pe is {k_pe.dtype}")
        pad = self._padding_after_check(slot_mapping, num_tokens, check)
        latent = torch.cat([c_kv, k_pe], dim=-1) if self.rope_dim else c_kv
        latent = as_raw(encode(latent, self.dtype, self.scale), self._raw.dtype)
        if pad:
            slot_mapping, latent = drop_padding(slot_mapping, latent)
        self._flat_raw[layer].index_copy_(0, slot_mapping, latent)

    def gather(self, layer: int, block_table: BlockIds, seq_len: int, *, dtype: torch.dtype | None = None
               ) -> torch.Tensor:
        """A request's latent as a contiguous ``[seq_len, R + P]`` tensor (``c_kv`` is ``[:, :R]``).

        ``block_table`` and ``dtype`` as for :meth:`kvpool.storage.paged.PagedKVCache.gather`.
        """
        layer = self._check_layer(layer, self.num_layers)
        blocks = self._block_index(block_table, seq_len)
        latent = self.buffer[layer].index_select(0, blocks).reshape(-1, self.latent_dim)[:seq_len]
        return latent if dtype is None else dequantize(latent, self.scale, dtype)

    def bind(self, model: torch.nn.Module) -> int:
        """Give every module of ``model`` that has a ``kv_cache`` attribute its layer's ``kv_cache(l)``, in
        ``model.modules()`` order. Returns the count; :class:`ConfigError` (nothing bound) when it differs
        from ``num_layers``."""
        modules = [m for m in model.modules() if hasattr(m, "kv_cache")]
        if len(modules) != self.num_layers:
            raise ConfigError(f"model has {len(modules)} modules with kv_cache, the cache "
                              f"{self.num_layers} layers")
        for layer, module in enumerate(modules):
            module.kv_cache = self.buffer[layer]
        return len(modules)

    def stats(self) -> dict[str, Any]:
        """:meth:`BlockStore.stats` plus ``num_layers``, ``kv_lora_rank`` and ``qk_rope_head_dim``."""
        return {**super().stats(), "num_layers": self.num_layers, "kv_lora_rank": self.kv_lora_rank,
                "qk_rope_head_dim": self.rope_dim}

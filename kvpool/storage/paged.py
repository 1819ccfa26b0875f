"""``PagedKVCache``: the physical K/V memory of a paged pool, one tensor with per-layer views.

One buffer ``[2, S, num_blocks, block_size, H, D]`` (K then V; nano-vllm / mini-sglang layout), with
H = ``spec.num_kv_heads_per_rank`` and S = ``spec.layers_per_block``: every layer for a uniform model, one KV
cache group's size for a hybrid one, where layer l lives in slot ``position of l in its group`` and uses
only its group's blocks (so the buffer is ``num_blocks x spec.bytes_per_block``, what the plan sizes). No
per-block tensors: a block is an index into dim 2, a slot is ``block_id * block_size + offset`` (int64
everywhere, so pools past 2^31 elements per layer index correctly).

Layers of several shapes (Gemma 4's full layers of head_dim 512 beside sliding ones of 256; MiMo-V2-Flash's
V narrower than K): the **packed** layout, one buffer ``[num_blocks, E]`` of ``E = spec.bytes_per_block /
dtype bytes`` elements, block-major like vLLM's per-block pages. Slot ``p`` of a block of group g holds one
layer's page, K then V: ``[B, H_g, D_g]`` then ``[B, H_g, Dv_g]`` at element ``p x B x H_g x (D_g + Dv_g)``,
so each layer gets views of its own shape (``k_cache(l)`` ``[N, B, H_l, D_l]``, ``v_cache(l)`` ``[N, B, H_l,
Dv_l]``, strided by E between blocks). A layer that reads another's KV (``spec.kv_source``) gets its
source's views. There is no flat ``[N*B, H, D]`` view in this layout (a block holds more than one layer's
page): :meth:`PagedKVCache.gather_slots` reads slots in either layout.

The shared machinery (allocation, raw byte views, slot and block id checks, ``copy_blocks``, memory stats)
lives in :class:`~kvpool.storage.block_store.BlockStore`, which :class:`kvpool.storage.mla.MLAKVCache`
reuses; the slot and encoding helpers in :mod:`kvpool.storage.slots`. Both are importable from here too.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.spec import AttentionKind, KVCacheSpec
from kvpool.storage.arena import ElasticConfig, elastic_config
from kvpool.storage.block_copy import BlockIds
from kvpool.storage.block_store import BlockStore  # noqa: F401  (also its old import path)
from kvpool.storage.slots import (  # noqa: F401  (also the helpers' old import path)
    FP8_DTYPES,
    LAYOUTS,
    as_raw,
    block_slots,
    check_slot_mapping,
    dequantize,
    drop_padding,
    encode,
    fp8_scales,
    raw_dtype,
)
from kvpool.storage.slots import slot_mapping as slot_mapping  # the function's old import path


def _triton_store(device: torch.device) -> Any:
    """The Triton store function on CUDA when Triton imports, else None (the torch path is used)."""
    if device.type != "cuda":
        return None
    try:
        from kvpool.storage.triton_store import store_rows
    except ImportError:
        return None
    return store_rows


class PagedKVCache(BlockStore):
    """K and V of every layer in one buffer, for paged attention.

    Args:
        spec: the model's :class:`KVCacheSpec` (MHA/GQA; H = ``spec.num_kv_heads_per_rank``).
        num_blocks: blocks N (e.g. ``PoolPlan.num_blocks``); each holds ``spec.block_size`` tokens.
        device: where the buffer lives (``"meta"`` allocates nothing: shape and offset arithmetic only).
        dtype: storage dtype, overriding ``spec.dtype`` (e.g. a float32 model whose spec was built by hand).
        layout: ``"NHD"`` (default) allocates ``[2, L, N, B, H, D]``; ``"HND"`` allocates
            ``[2, L, N, H, B, D]`` so that FlashInfer's HND pages are contiguous (see :meth:`flashinfer_kv`).
            A spec whose layers differ in shape (or whose V width differs from K's) is stored packed
            (module docstring; NHD pages only): ``packed`` is then True.
        k_scale: per-tensor fp8 scale of K (stored = value / scale); ignored for other dtypes.
        v_scale: the same for V.
        pin_memory: page-locked CPU memory (the host tier sets it when CUDA exists).
        zero: zero-fill instead of ``torch.empty`` (see :class:`BlockStore` for why the default is empty).
        elastic: True or an :class:`~kvpool.storage.arena.ElasticConfig`: the buffer sits on a page arena
            (:class:`~kvpool.storage.elastic.ElasticMemory`): nothing is committed until
            :meth:`~kvpool.storage.elastic.ElasticMemory.commit_blocks`, pages are given back as blocks
            are released, the views never move. CPU or CUDA; not with ``pin_memory``.
        packed: the block-major ``[N, E]`` layout (a block's bytes in every layer contiguous). None (the
            default): where the layers differ in shape, and on an elastic NHD cache (its memory then
            follows use one page at a time, not ``2 x L`` pages: see ``docs/storage.md``). False for an
            elastic cache in the ``[2, L, N, ...]`` layout; True for a fixed cache in the block-major one.

    Views (no copies): :meth:`k_cache`, :meth:`v_cache` ``[N, B, H, D]`` (FlashAttention's paged layout and
    FlashInfer NHD; in the HND layout these are permuted, non-contiguous views), :meth:`kv_cache`
    ``[2, N, B, H, D]``, :meth:`flat_k_cache` / :meth:`flat_v_cache` ``[N*B, H, D]`` (NHD only: in HND a
    slot's heads are not adjacent, so no flat view exists), :meth:`flashinfer_kv` (contiguous in either
    layout).

    Raises:
        ConfigError: an MLA spec (use ``MLAKVCache``), an unknown layout (or HND packed), ``packed=False``
            for layers of several shapes, a non-positive ``num_blocks``, ``elastic`` with ``pin_memory`` or
            on a device with no page arena.
    """

    block_dim = 2

    def __init__(self, spec: KVCacheSpec, num_blocks: int, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, layout: str = "NHD", k_scale: float = 1.0,
                 v_scale: float = 1.0, pin_memory: bool = False, zero: bool = False,
                 elastic: bool | ElasticConfig = False, packed: bool | None = None) -> None:
        if spec.attention is not AttentionKind.MHA:
            raise ConfigError("PagedKVCache stores MHA/GQA K and V; use MLAKVCache for an MLA spec")
        if layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.spec, self.layout = spec, layout
        self._flat_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # gather_slots' flat views
        self.num_layers, self.head_dim = spec.num_layers, spec.head_dim
        self.num_heads = spec.num_kv_heads_per_rank
        self.layers_per_block = spec.layers_per_block
        #: True for the block-major ``[N, E]`` layout of the module docstring (each layer's views of its own
        #: shape): where layers differ in shape (or V in width from K), on an elastic NHD cache by default,
        #: or where asked
        self.packed = self._packed(spec, layout, packed, elastic_config(elastic) is not None)
        #: per layer: its (H, D, Dv) on this rank (its KV source's for a layer that reads another's KV)
        self.layer_shapes = [spec.layer_shape(layer) for layer in range(self.num_layers)]
        #: per layer: (its KV cache group, its slot in that group's blocks); layer l reads and writes only
        #: blocks of group ``layer_group[l]``, so layers of different groups share a slot's memory. A layer
        #: reading another's KV takes its source's group and slot.
        self.layer_group = [0] * self.num_layers
        self._slot = [0] * self.num_layers
        for group in spec.groups:
            for position, layer in enumerate(group.layers):
                self.layer_group[layer], self._slot[layer] = group.index, position
        for layer in range(self.num_layers):
            source = spec.kv_source(layer)
            self.layer_group[layer], self._slot[layer] = self.layer_group[source], self._slot[source]
        dtype = dtype or spec.dtype
        self.k_scale, self.v_scale = fp8_scales(dtype, k_scale, v_scale)
        if self.packed:
            self._init_packed(num_blocks, device, dtype, pin_memory, zero, elastic)
            return
        bhd = (spec.block_size, self.num_heads, self.head_dim)
        page = bhd if layout == "NHD" else (self.num_heads, spec.block_size, self.head_dim)
        super().__init__((2, self.layers_per_block, num_blocks, *page), spec.block_size, device=device,
                         dtype=dtype, pin_memory=pin_memory, zero=zero, elastic=elastic)
        slots = self._slot
        self._views = [[self._nhd(self.buffer[kv, slot]) for slot in slots] for kv in (0, 1)]
        self._raw_views = [[self._nhd(self._raw[kv, slot]) for slot in slots] for kv in (0, 1)]
        self._flat_raw = [[self._flat(self._raw[kv, slot]) for slot in slots] for kv in (0, 1)]
        self._triton = _triton_store(self.device) if layout == "NHD" else None

    @staticmethod
    def _packed(spec: KVCacheSpec, layout: str, packed: bool | None, elastic: bool) -> bool:
        """Whether the cache is block-major (``packed``): see :class:`PagedKVCache`'s ``packed``."""
        shape = spec.layer_shape(0)
        needed = not spec.uniform_shape or shape.head_dim != shape.v_head_dim
        if packed is None:
            packed = needed or (elastic and layout == "NHD")
        if needed and not packed:
            raise ConfigError("layers of several K/V shapes are stored packed: packed=False cannot hold them")
        if packed and layout != "NHD":
            raise ConfigError("the packed (block-major) layout keeps NHD pages only")
        return bool(packed)

    def _init_packed(self, num_blocks: int, device: str | torch.device, dtype: torch.dtype, pin_memory: bool,
                     zero: bool, elastic: bool | ElasticConfig) -> None:
        """The ``[N, E]`` buffer and each layer's K ``[N, B, H, D]`` and V ``[N, B, H, Dv]`` views."""
        self.block_dim = 0
        b, group = self.spec.block_size, self.spec.groups[0]
        per_block = group.slots * b * group.shape.elements  # type: ignore[union-attr]
        super().__init__((num_blocks, per_block), b, device=device, dtype=dtype, pin_memory=pin_memory,
                         zero=zero, elastic=elastic)
        self._views = [[], []]
        for layer, sh in enumerate(self.layer_shapes):
            start = self._slot[layer] * b * sh.elements
            k_end = start + b * sh.num_kv_heads * sh.head_dim
            v_end = k_end + b * sh.num_kv_heads * sh.v_head_dim
            n = self.buffer.shape[0]
            self._views[0].append(self.buffer[:, start:k_end].view(n, b, sh.num_kv_heads, sh.head_dim))
            self._views[1].append(self.buffer[:, k_end:v_end].view(n, b, sh.num_kv_heads, sh.v_head_dim))
        self._rows = [[self._token_rows(view) for view in self._views[kv]] for kv in (0, 1)]
        self._memos: dict[object, tuple[torch.Tensor, int, Any]] = {}
        self._raw_views = self._flat_raw = [[], []]
        self._triton = None

    def _token_rows(self, view: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """A packed layer view ``[N, B, H, D]`` as rows of one token each: ``(rows, per_block)``, ``rows``
        raw words ``[*, H x D]`` starting at the layer's first row, so slot ``s`` is row ``s + (s // B) x
        (per_block - B)`` (:meth:`_row_index`). None where the buffer does not split into such rows (a
        block's elements not a multiple of the row, or the layer not starting on one)."""
        width = view.shape[2] * view.shape[3]
        start = (view.data_ptr() - self.buffer.data_ptr()) // view.element_size()
        per_block = self.buffer.shape[1]
        if per_block % width or start % width:
            return None
        rows = self.buffer.view(-1, width)[start // width:]
        return rows.view(raw_dtype(width * view.element_size())), per_block // width

    def _row_index(self, slots: torch.Tensor, per_block: int, key: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Each slot's row in a :meth:`_token_rows` view of ``per_block`` rows per block: one division and
        one add, remembered for the slot tensor ``key`` (default ``slots``) as long as it is unchanged
        (:meth:`_memo`)."""
        def rows() -> torch.Tensor:
            block = torch.div(slots, self.block_size, rounding_mode="floor")
            return torch.add(slots, block, alpha=per_block - self.block_size)

        return self._memo(slots if key is None else key, per_block, rows)

    def _memo(self, slots: torch.Tensor, tag: object, make: Any) -> Any:
        """``make()``, or what it returned last for the same ``tag`` and the same slot tensor, unchanged
        since (its ``_version``): the engine passes one slot mapping to every layer of a step, so the row
        index and the padding of a packed cache are computed once per step, not once per layer. An inference
        tensor (``torch.inference_mode``) keeps no version counter, so it is never remembered."""
        if slots.is_inference():  # no version counter: a change in place could not be seen
            return make()
        entry = self._memos.get(tag)
        if entry is not None and entry[0] is slots and entry[1] == slots._version:
            return entry[2]
        value = make()
        self._memos[tag] = (slots, slots._version, value)
        return value

    def _nhd(self, page: torch.Tensor) -> torch.Tensor:
        return page if self.layout == "NHD" else page.permute(0, 2, 1, 3)

    def _flat(self, page: torch.Tensor) -> torch.Tensor | None:
        return page.view(self.num_slots, *page.shape[2:]) if self.layout == "NHD" else None

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K ``[N, B, H, D]`` (a view; permuted and non-contiguous in the HND layout)."""
        layer = self._check_layer(layer, self.num_layers)
        return self._views[0][layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V ``[N, B, H, D]`` (a view; permuted and non-contiguous in the HND layout)."""
        layer = self._check_layer(layer, self.num_layers)
        return self._views[1][layer]

    def kv_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K and V ``[2, N, B, H, D]`` (a view; non-contiguous over dim 0 and in HND).
        Not in the packed layout (K and V are two views there): InvalidArgumentError."""
        layer = self._check_layer(layer, self.num_layers)
        if self.packed:
            raise InvalidArgumentError("a packed cache keeps K and V as two views: use k_cache and v_cache")
        return self._nhd_pair(self.buffer[:, self._slot[layer]])

    def _nhd_pair(self, pages: torch.Tensor) -> torch.Tensor:
        return pages if self.layout == "NHD" else pages.permute(0, 1, 3, 2, 4)

    def flat_k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K by slot ``[N*B, H, D]`` (a view; NHD layout only)."""
        return self._flat_view(0, layer)

    def flat_v_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V by slot ``[N*B, H, D]`` (a view; NHD layout only)."""
        return self._flat_view(1, layer)

    def _flat_view(self, kv: int, layer: int) -> torch.Tensor:
        layer = self._check_layer(layer, self.num_layers)
        if self.layout != "NHD" or self.packed:
            raise InvalidArgumentError("the flat [N*B, H, D] view exists only in the NHD layout of one shape "
                                       "(gather_slots reads slots in any layout)")
        return self._flat(self.buffer[kv, self._slot[layer]])

    def gather_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K ``[n, H, D]`` and V ``[n, H, Dv]`` at ``slots`` (int64 ``[n]`` on this
        device, trusted: the engine's own tables), as stored (no dtype conversion). One ``index_select``
        of the flat view where there is one; else the block and offset of each slot."""
        if not self.packed and self.layout == "NHD":
            k_flat, v_flat = self._flat_views(layer)
            return k_flat.index_select(0, slots), v_flat.index_select(0, slots)
        k_rows, v_rows = (self._rows[0][layer], self._rows[1][layer]) if self.packed else (None, None)
        if k_rows is not None and v_rows is not None:
            k_index = self._row_index(slots, k_rows[1])
            v_index = k_index if v_rows[1] == k_rows[1] else self._row_index(slots, v_rows[1])
            k_view, v_view = self._views[0][layer], self._views[1][layer]
            return (k_rows[0].index_select(0, k_index).view(self.dtype).view(-1, *k_view.shape[2:]),
                    v_rows[0].index_select(0, v_index).view(self.dtype).view(-1, *v_view.shape[2:]))
        block = torch.div(slots, self.block_size, rounding_mode="floor")
        offset = slots - block * self.block_size
        return self._views[0][layer][block, offset], self._views[1][layer][block, offset]

    def _flat_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._flat_kv.get(layer)
        if cached is None:
            cached = self._flat_kv[layer] = (self.flat_k_cache(layer), self.flat_v_cache(layer))
        return cached

    def flashinfer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's paged ``(k_cache, v_cache)`` tuple for ``layer`` in this cache's layout, contiguous
        views: NHD ``[N, B, H, D]`` each, HND ``[N, H, B, D]`` each. (FlashInfer's single-tensor form
        ``[N, 2, B, H, D]`` interleaves K and V per page, which this buffer does not: use the tuple.)"""
        layer = self._check_layer(layer, self.num_layers)
        if self.packed:  # contiguous within a block, strided by the block's elements between blocks
            return self._views[0][layer], self._views[1][layer]
        return self.buffer[0, self._slot[layer]], self.buffer[1, self._slot[layer]]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, layer: int, *,
                 check: bool = True) -> None:
        """Write token ``t``'s K and V into slot ``slot_mapping[t]`` of ``layer``; slot -1 skips the token.

        Args:
            k: ``[T, H, D]`` (the layer's own shape: ``layer_shapes[layer]``), on the cache's device, in the
                cache dtype (an fp8 cache also takes a float dtype, divided by ``k_scale`` and converted).
            v: ``[T, H, Dv]``, as ``k`` (divided by ``v_scale``).
            slot_mapping: int64 ``[T]``, each ``block_id * block_size + offset`` or -1.
            check: False skips the slot range check on CUDA (no host sync; a bad slot is then undefined
                behaviour). On the host the check always runs: it costs what finding -1 slots would.
                Shape, dtype, device and layer are always checked.

        Raises:
            InvalidArgumentError: wrong shape, dtype, device, layer, or k and v of different lengths.
            InvalidIdError: a slot outside ``[0, N*B)`` other than -1. Nothing is written when it raises.
        """
        layer = self._check_layer(layer, self.num_layers)
        shape = self.layer_shapes[layer]
        num_tokens = self._check_rows(k, "k", (shape.num_kv_heads, shape.head_dim), None)
        self._check_rows(v, "v", (shape.num_kv_heads, shape.v_head_dim), num_tokens)
        pad = self._padding_after_check(slot_mapping, num_tokens, check)  # the Triton kernel skips -1
        k, v = encode(k, self.dtype, self.k_scale), encode(v, self.dtype, self.v_scale)
        if self.packed:
            self._store_packed(layer, k, v, slot_mapping, pad)
            return
        if self._triton is not None:
            self._triton(k, v, slot_mapping, self.flat_k_cache(layer), self.flat_v_cache(layer))
            return
        k, v = as_raw(k, self._raw.dtype), as_raw(v, self._raw.dtype)
        if pad:  # drop padding tokens, moving rows as raw words (cheaper than a boolean mask on halves)
            slot_mapping, k, v = drop_padding(slot_mapping, k, v)
        if self.layout == "NHD":
            self._flat_raw[0][layer].index_copy_(0, slot_mapping, k)
            self._flat_raw[1][layer].index_copy_(0, slot_mapping, v)
        else:
            block = torch.div(slot_mapping, self.block_size, rounding_mode="floor")
            index = (block, slot_mapping - block * self.block_size)
            self._raw_views[0][layer].index_put_(index, k)
            self._raw_views[1][layer].index_put_(index, v)

    def _store_packed(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                      pad: bool) -> None:
        """K and V rows ``[T, H, D]`` into ``slot_mapping`` of a packed layer (``pad``: it may hold -1): one
        ``index_copy_`` each of raw token rows where the buffer splits into them (:meth:`_token_rows`), else
        an ``index_put_`` by block and offset."""
        slots = slot_mapping
        if pad:
            keep = self._memo(slot_mapping, "keep", lambda: (slot_mapping != -1).nonzero().squeeze(1))
            slots = self._memo(slot_mapping, "kept", lambda: slot_mapping[keep])
            k, v = k.index_select(0, keep), v.index_select(0, keep)
        for kv, x in ((0, k), (1, v)):
            found = self._rows[kv][layer]
            if found is None:
                block = torch.div(slots, self.block_size, rounding_mode="floor")
                self._views[kv][layer].index_put_((block, slots - block * self.block_size), x)
                continue
            rows, per_block = found
            index = self._row_index(slots, per_block, key=slot_mapping)
            rows.index_copy_(0, index, x.reshape(len(x), -1).view(rows.dtype))

    def gather(self, layer: int, block_table: BlockIds, seq_len: int, *, dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's K and V as contiguous ``[seq_len, H, D]`` tensors (for reference attention and tests).

        ``block_table``: the request's block ids (list or int tensor; entries past ``ceil(seq_len / B)`` are
        ignored). ``dtype``: None returns the stored values bit for bit; a dtype converts (fp8: dequantized
        with the cache's scales). Raises :class:`InvalidArgumentError` / :class:`InvalidIdError`.
        """
        layer = self._check_layer(layer, self.num_layers)
        blocks = self._block_index(block_table, seq_len)
        k, v = (view.index_select(0, blocks).flatten(0, 1)[:seq_len]
                for view in (self._views[0][layer], self._views[1][layer]))
        if dtype is None:
            return k, v
        return dequantize(k, self.k_scale, dtype), dequantize(v, self.v_scale, dtype)

    def bind(self, model: torch.nn.Module) -> int:
        """Give every module of ``model`` that has ``k_cache`` and ``v_cache`` attributes its layer's views
        (``k_cache(l)``, ``v_cache(l)``), in ``model.modules()`` order (nano-vllm style). Returns the count.

        Raises :class:`ConfigError` when that count differs from ``num_layers`` (nothing is bound then).
        """
        modules = [m for m in model.modules() if hasattr(m, "k_cache") and hasattr(m, "v_cache")]
        if len(modules) != self.num_layers:
            raise ConfigError(f"model has {len(modules)} modules with k_cache/v_cache, the cache "
                              f"{self.num_layers} layers")
        for layer, module in enumerate(modules):
            module.k_cache, module.v_cache = self._views[0][layer], self._views[1][layer]
        return len(modules)

    def stats(self) -> dict[str, Any]:
        """:meth:`BlockStore.stats` plus ``num_layers``, ``num_kv_heads``, ``head_dim``, ``layout`` and
        ``packed`` (the model-wide heads and head_dim; a packed cache's layers have their own)."""
        return {**super().stats(), "num_layers": self.num_layers, "num_kv_heads": self.num_heads,
                "head_dim": self.head_dim, "layout": self.layout, "packed": self.packed}

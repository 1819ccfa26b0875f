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
lives in :class:`BlockStore`, which :class:`kvpool.storage.mla.MLAKVCache` reuses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError
from kvpool.numeric import as_int
from kvpool.spec import AttentionKind, KVCacheSpec
from kvpool.storage.arena import ElasticConfig, elastic_config
from kvpool.storage.block_copy import BlockIds, check_block_ids, copy_pairs, copy_within
from kvpool.storage.elastic import ElasticMemory
from kvpool.storage.resident import resident_bytes
from kvpool.units import plural

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
LAYOUTS = ("NHD", "HND")
# Widest element type whose size divides a row: index_copy_ on CPU costs per element, so copying 2 KiB rows
# as 16-byte complex128 "words" is several times faster than as 2-byte halves (bit-exact: a pure move).
_RAW_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)



def raw_dtype(row_bytes: int) -> torch.dtype:
    """The widest dtype of :data:`_RAW_DTYPES` whose item size divides ``row_bytes``."""
    return next(d for d in _RAW_DTYPES if row_bytes % d.itemsize == 0)


def as_raw(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` reinterpreted as ``dtype`` (no copy when its strides allow, else a contiguous copy)."""
    try:
        return x.view(dtype)
    except RuntimeError:
        return x.contiguous().view(dtype)


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int, num_slots: int,
                       device: torch.device, *, values: bool = True) -> bool:
    """Check a slot mapping and return whether it may hold padding (-1) slots.

    Requires an int64 1-D tensor of ``num_tokens`` entries on ``device``, each in ``[0, num_slots)`` or -1.
    ``values``: also check every slot's range, one ``aminmax`` pass (plus a host sync on CUDA); without it
    only the type, dtype, shape and device are checked and the answer is True (padding unknown). Duplicate
    slots are not checked (a sort would cost more than the store); which write wins is unspecified.

    Raises:
        InvalidArgumentError: wrong type, dtype, rank, length or device.
        InvalidIdError: a slot below -1 or at/after ``num_slots`` (never clamped, never wrapped).
    """
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64:
        raise InvalidArgumentError(f"slot_mapping must be an int64 tensor, got {_describe(slot_mapping)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        shape = list(slot_mapping.shape)
        raise InvalidArgumentError(f"slot_mapping must have shape [{num_tokens}], got {shape}")
    if slot_mapping.device != device:
        raise InvalidArgumentError(f"slot_mapping is on {slot_mapping.device}, the cache on {device}")
    if not values:
        return True
    if num_tokens == 0:
        return False
    if num_tokens <= 64 and slot_mapping.device.type == "cpu":  # one tolist beats aminmax + 2 item calls
        values = slot_mapping.tolist()
        low, high = min(values), max(values)
    else:
        low, high = (int(x) for x in slot_mapping.aminmax())
    if low < -1 or high >= num_slots:
        raise InvalidIdError(f"slot ids must be in [0, {num_slots}) or -1 (skip), got min {low}, max {high}")
    return low == -1


def block_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """The int64 slot ids ``[seq_len]`` of a request's first ``seq_len`` tokens: ``block * B + offset``."""
    offsets = torch.arange(block_size, dtype=torch.int64, device=block_table.device)
    return (block_table.to(torch.int64)[:, None] * block_size + offsets).flatten()[:seq_len]


def slot_mapping(block_table: Sequence[int] | torch.Tensor, positions: Sequence[int] | range | torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """The flat slot ids of one request's tokens at ``positions``: what :meth:`PagedKVCache.store_kv` and
    the flat views (:meth:`PagedKVCache.flat_k_cache`) take.

    Args:
        block_table: the request's block ids in order (a list or a 1-D integer tensor): block ``i`` holds
            positions ``i * block_size`` to ``(i + 1) * block_size - 1``.
        positions: token positions in the request, 0-based (a range, a list or a 1-D integer tensor
            ``[T]``): the whole prompt at prefill, the new token(s) at decode.
        block_size: tokens per block, B.

    Returns:
        int64 ``[T]`` on ``block_table``'s device (CPU for a list): ``block_table[p // B] * B + p % B`` for
        each position ``p``, in slot units (``block_id * B + offset``; int64, so large pools index right).

    Raises:
        InvalidArgumentError: ``block_size`` not an integer >= 1, a table or positions that are not 1-D
            integers, or a position below 0 or at/after ``len(block_table) * block_size`` (the request's
            blocks do not cover it: allocate first).
    """
    bs = as_int(block_size, "block_size", minimum=1)
    table = _index_tensor(block_table, "block_table")
    pos = _index_tensor(positions, "positions").to(table.device)
    low, high = (int(pos.min()), int(pos.max())) if pos.numel() else (0, -1)
    if low < 0 or high >= table.numel() * bs:
        raise InvalidArgumentError(
            f"positions must be in [0, {table.numel() * bs}) for a block table of "
            f"{plural(table.numel(), 'block')} of {bs} tokens, got min {low}, max {high}")
    return table[pos // bs] * bs + pos % bs


def _index_tensor(values: Sequence[int] | range | torch.Tensor, name: str) -> torch.Tensor:
    """``values`` as a 1-D int64 tensor (a tensor keeps its device); InvalidArgumentError otherwise."""
    if isinstance(values, range):
        return torch.arange(values.start, values.stop, values.step, dtype=torch.int64)
    if not isinstance(values, torch.Tensor):
        values = list(values)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise InvalidArgumentError(f"{name} must be integers, got {values[:4]!r}...")
        return torch.tensor(values, dtype=torch.int64)
    dtype = values.dtype
    if values.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise InvalidArgumentError(f"{name} must be a 1-D integer tensor, got {dtype} {list(values.shape)}")
    return values.to(torch.int64)


def drop_padding(slot_mapping: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``slot_mapping`` and each of ``rows`` (``[T, ...]``) without the tokens whose slot is -1 (skip)."""
    keep = (slot_mapping != -1).nonzero().squeeze(1)
    return (slot_mapping[keep], *(r.index_select(0, keep) for r in rows))


def encode(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` converted to the storage ``dtype``; for fp8, divided by ``scale`` and saturated to the format's
    finite range (as vLLM's scaled fp8 conversion does) instead of turning into NaN."""
    if x.dtype == dtype:
        return x
    if scale != 1.0:
        x = x.to(torch.float32) / scale
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored values back to ``dtype``: ``x.to(dtype) * scale`` (the inverse of :func:`encode`, up to the
    format's rounding: e4m3 keeps 3 mantissa bits, relative error <= 2^-4; e5m2 2 bits, <= 2^-3)."""
    out = x.to(dtype)
    return out * scale if scale != 1.0 else out


def fp8_scales(dtype: torch.dtype, *scales: float) -> tuple[float, ...]:
    """The scales as floats for an fp8 ``dtype``, all 1.0 otherwise (scales apply only to fp8 storage).
    Raises :class:`ConfigError` for a scale that is not a positive finite number."""
    for scale in scales:
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
            raise ConfigError(f"fp8 scales must be positive finite numbers, got {scale!r}")
    return tuple(float(s) if dtype in FP8_DTYPES else 1.0 for s in scales)


def _describe(x: object) -> str:
    return f"{x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def _process_rss() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


class BlockStore(ElasticMemory):
    """One pre-allocated buffer whose dimension ``block_dim`` indexes blocks; shared by the KV caches.

    Zeroing: the buffer comes from ``torch.empty`` unless ``zero=True``. On CPU that keeps pages lazily
    committed (resident memory grows only with what is written, see ``stats()``), and every reader here
    (``gather``, the engine's paged attention) reads only slots that were written. Pass ``zero=True`` for a
    kernel that loads whole blocks and masks the tail after the fact: unwritten memory may hold NaN, and
    ``0 * NaN`` is NaN. ``pin_memory=True`` (page-locked, for async host<->device copies) commits all pages.

    ``elastic``: the buffer is a view of a :class:`~kvpool.storage.arena.PageArena` instead
    (:class:`~kvpool.storage.elastic.ElasticMemory`): address space for every block, physical memory only
    for the pages under the blocks :meth:`commit_blocks` names, reading 0 when committed.
    """

    block_dim: int

    def __init__(self, shape: Sequence[int], block_size: int, *, device: str | torch.device,
                 dtype: torch.dtype, pin_memory: bool, zero: bool, elastic: bool | ElasticConfig = False
                 ) -> None:
        num_blocks = as_int(shape[self.block_dim], "num_blocks", minimum=1, error=ConfigError)
        shape = [*shape[:self.block_dim], num_blocks, *shape[self.block_dim + 1:]]
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"the KV cache dtype must be a floating torch.dtype, got {dtype!r}")
        config = elastic_config(elastic)
        if config is not None and pin_memory:
            raise ConfigError("an elastic buffer cannot be pinned (pinning commits every page at once)")
        factory = torch.zeros if zero else torch.empty
        try:
            self._rss_before = _process_rss() if torch.device(device).type == "cpu" else None
            if config is not None:  # committed pages read 0: zero needs nothing more
                (self.buffer,) = self.allocate_elastic(config, device, [(tuple(shape), dtype)],
                                                       self.block_dim)
            else:
                self.buffer = factory(tuple(shape), dtype=dtype, device=device, pin_memory=pin_memory)
        except (RuntimeError, AssertionError) as exc:  # a bad device, no pinned memory, out of memory
            raise ConfigError(f"cannot allocate the KV buffer {list(shape)} {dtype} on {device!r}: "
                              f"{str(exc).splitlines()[0]}") from None
        self.dtype = dtype
        self.device = self.buffer.device
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self._raw = self.buffer.view(raw_dtype(shape[-1] * dtype.itemsize))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer (what ``torch.empty`` reserved; see ``stats()`` for what is resident)."""
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every layer (and K and V)."""
        return self.nbytes // self.num_blocks

    def copy_blocks(self, pairs: Sequence[tuple[int, int]] | torch.Tensor) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of a shared partial block).

        ``pairs``: ``(src, dst)`` pairs or an int ``[P, 2]`` tensor. Two index ops on the whole buffer: all
        sources are read before any destination is written (:func:`~kvpool.storage.block_copy.copy_within`).
        Raises :class:`InvalidIdError` for an id out of range or a destination named twice; nothing is
        copied then.
        """
        ids = copy_pairs(pairs, self.num_blocks, self.device)
        if ids is not None:
            copy_within(self._raw, self.block_dim, *ids)

    def read_blocks(self, block_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of whole blocks across every layer, as raw words: the buffer's shape with ``len(block_ids)``
        blocks, in an integer/complex dtype of the same bytes. ``block_ids``: int64 on this device, already
        checked (:func:`check_block_ids`). ``out``: e.g. a pinned staging tensor of that shape and dtype."""
        return torch.index_select(self._raw, self.block_dim, block_ids, out=out)

    def raw_blocks(self) -> torch.Tensor:
        """The buffer as raw words with the block dimension first, ``[num_blocks, ...]`` (a view): row ``b``
        is block ``b`` in every layer (contiguous within a layer, strided across layers)."""
        return self._raw.movedim(self.block_dim, 0)

    def empty_blocks(self, num_blocks: int, *, pin_memory: bool = False) -> torch.Tensor:
        """An uninitialized CPU tensor shaped like :meth:`read_blocks` output for ``num_blocks`` blocks
        (a staging buffer for host<->device copies)."""
        shape = list(self._raw.shape)
        shape[self.block_dim] = num_blocks
        return torch.empty(shape, dtype=self._raw.dtype, pin_memory=pin_memory)

    def write_blocks(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write :meth:`read_blocks` output (of a store with the same shape per block) into ``block_ids``
        (int64 on this device, checked, distinct)."""
        self._raw.index_copy_(self.block_dim, block_ids, blocks)

    def resident_bytes(self) -> int | None:
        """Bytes of this buffer resident in RAM (its own pages, by ``mincore``; see
        :mod:`kvpool.storage.resident`): what was written (or zeroed, or pinned) so far. None off the CPU."""
        return resident_bytes(self.buffer)

    def stats(self) -> dict[str, Any]:
        """``num_blocks``, ``block_size``, ``dtype``, ``device``, ``nbytes``, ``bytes_per_block``,
        ``resident_bytes`` (this buffer's pages in RAM, :meth:`resident_bytes`), the whole process's
        ``rss_bytes`` and ``rss_growth_bytes`` (RSS minus RSS before the allocation: everything the process
        allocated since, not just this cache), None where unknown (off the CPU, or without psutil); and
        ``elastic``: the page arena's stats (:meth:`ElasticMemory.elastic_stats`; None for a fixed buffer)."""
        rss = _process_rss() if self.device.type == "cpu" else None
        growth = rss - self._rss_before if rss is not None and self._rss_before is not None else None
        return {"num_blocks": self.num_blocks, "block_size": self.block_size, "dtype": str(self.dtype),
                "device": str(self.device), "nbytes": self.nbytes, "bytes_per_block": self.bytes_per_block,
                "resident_bytes": self.resident_bytes(), "rss_bytes": rss, "rss_growth_bytes": growth,
                "elastic": self.elastic_stats()}

    def _check_layer(self, layer: int, num_layers: int) -> int:
        """``layer`` as a Python int in ``[0, num_layers)`` (:mod:`kvpool.numeric`); InvalidArgumentError."""
        if type(layer) is int and 0 <= layer < num_layers:
            return layer
        return as_int(layer, "layer", minimum=0, maximum=num_layers - 1)

    def _padding_after_check(self, slot_mapping: torch.Tensor, num_tokens: int, check: bool) -> bool:
        """Check ``slot_mapping`` for a store of ``num_tokens`` rows; return whether it may hold -1 slots.
        The slot range is checked on the host always, and on CUDA unless ``check`` is False (a host sync);
        type, dtype, shape and device always."""
        values = check or self.device.type != "cuda"
        return check_slot_mapping(slot_mapping, num_tokens, self.num_slots, self.device, values=values)

    def _check_rows(self, x: torch.Tensor, name: str, tail: tuple[int, ...], num_tokens: int | None) -> int:
        """Check ``x`` is ``[T, *tail]`` on this device with a storable dtype; return T."""
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a tensor, got {type(x).__name__}")
        shape = x.shape
        if len(shape) != 1 + len(tail) or shape[1:] != tail or num_tokens not in (None, shape[0]):
            want = f"[{num_tokens if num_tokens is not None else 'T'}, {', '.join(map(str, tail))}]"
            raise InvalidArgumentError(f"{name} must have shape {want}, got {list(x.shape)}")
        if x.device != self.device:
            raise InvalidArgumentError(f"{name} is on {x.device}, the cache on {self.device}")
        convertible = self.dtype in FP8_DTYPES and x.dtype.is_floating_point and x.dtype.itemsize > 1
        if x.dtype != self.dtype and not convertible:
            raise InvalidArgumentError(f"{name} has dtype {x.dtype}, the cache stores {self.dtype}")
        return x.shape[0]

    def _block_index(self, block_table: BlockIds, seq_len: int) -> torch.Tensor:
        """The first ``ceil(seq_len / block_size)`` ids of ``block_table``, checked, on this device."""
        seq_len = as_int(seq_len, "seq_len", minimum=0)
        needed = -(-seq_len // self.block_size)  # exact integer ceiling (no float rounding)
        if not isinstance(block_table, torch.Tensor | Sequence):
            raise InvalidArgumentError(f"block_table must be a list or tensor of ids, got {block_table!r}")
        if len(block_table) < needed:
            raise InvalidArgumentError(f"seq_len {seq_len} needs {plural(needed, 'block')}, block_table has "
                                       f"{len(block_table)}")
        return check_block_ids(block_table[:needed], self.num_blocks).to(self.device)


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

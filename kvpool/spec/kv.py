"""``KVCacheSpec``: the shape of one model's KV cache, and how many bytes it takes.

Formulas (per tensor-parallel rank):

* MHA / GQA / MQA: ``bytes_per_token = 2 (K and V) x num_layers x num_kv_heads_per_rank x head_dim x
  dtype_bytes``. GQA counts KV heads, never query heads (Qwen2.5-0.5B: 24 x 2 x 2 x 64 x 2 B = 12 KiB).
* MLA (DeepSeek-V2/V3): one compressed latent per token per layer, ``num_layers x (kv_lora_rank +
  qk_rope_head_dim) x dtype_bytes``; the latent is not split by tensor parallelism.
* ``bytes_per_block = bytes_per_token x block_size`` for a model whose layers all attend alike.

Hybrid attention (Gemma 2/3, gpt-oss, Llama 4, Cohere2): each layer has a :class:`LayerKind` (full,
sliding window of W tokens, chunked local of C tokens). Layers of one kind and window form **KV cache
groups** of equal size (:func:`kv_cache_groups`, vLLM's uniform-page rule), each with its own block table
over one shared pool.
A pool block then holds one group's layers, ``layers_per_block`` of them, so ``bytes_per_block =
layers_per_block x bytes per layer-token x block_size``; ``bytes_per_token`` still counts every layer.

Layers of different shapes (Gemma 4: full layers of head_dim 512 beside sliding ones of 256; MiMo-V2-Flash:
K head_dim 192, V 128, twice the KV heads on sliding layers; or two sliding windows) are described per
layer (``layer_num_kv_heads``, ``layer_head_dims``, ``layer_v_head_dims``, ``layer_windows``), and a layer
that reads another's KV (Gemma 4's ``num_kv_shared_layers``) names it in ``kv_source_layers`` and owns none.
Groups then form by (kind, window, shape), so a group's layers are alike, and every pool block has the same
bytes: a group of smaller layers gets more layer slots per block (:func:`kv_cache_groups`).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.errors import ConfigError
from kvpool.numeric import as_int, as_optional_int
from kvpool.spec.hf_config import MAX_LAYERS, too_many_layers
from kvpool.spec.kinds import ATTENTION_KINDS, MemoryKind, attention_kind

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


def parse_kv_dtype(name: str | torch.dtype, model_dtype: str | None = None, *,
                   model_type: str | None = None) -> torch.dtype:
    """Resolve a KV cache dtype name to a torch dtype.

    ``"auto"`` means the dtype vLLM runs the model in (:func:`auto_kv_dtype` of ``model_dtype``, a config's
    ``dtype`` / ``torch_dtype``, and ``model_type``): a 16-bit config dtype as it is, float32 or none cast
    down to bfloat16. Raises :class:`ConfigError` listing the accepted names for an unknown one (or for a
    torch dtype that is not a KV dtype, such as int8).
    """
    if isinstance(name, torch.dtype) and name in KV_DTYPES.values():
        return name
    key = str(name).lower().removeprefix("torch.")
    if key == "auto":
        return auto_kv_dtype(model_dtype, model_type)[0]
    if key not in KV_DTYPES:
        accepted = ", ".join(["auto", *KV_DTYPES])
        raise ConfigError(f"unknown KV cache dtype {name!r}; accepted: {accepted}")
    return KV_DTYPES[key]


#: Model types vLLM never runs in float16 (``_FLOAT16_NOT_SUPPORTED_MODELS`` in vllm/config/model.py:
#: numerical instability), so ``auto`` gives them bfloat16 even when their config says float16.
NO_FLOAT16_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "plamo2", "glm4"})


def auto_kv_dtype(model_dtype: str | None, model_type: str | None = None) -> tuple[torch.dtype, str]:
    """The KV dtype of ``--kv-cache-dtype auto`` and the rule that chose it, as vLLM picks the model dtype
    for ``dtype="auto"`` (its KV cache dtype ``auto`` is the model dtype): ``_resolve_auto_dtype`` in
    vllm/config/model.py on a GPU of compute capability >= 8.0, whose supported dtypes are bfloat16,
    float16, float32 in that order (``CudaPlatform.supported_dtypes``).

    * a config naming no dtype counts as float32 (vLLM reads the weights' safetensors header first; a
      config alone has none), and float32 is cast down to the first supported dtype: bfloat16;
    * bfloat16 and float16 stay, except float16 for :data:`NO_FLOAT16_MODEL_TYPES` (bfloat16);
    * any other dtype (fp8 weights) is not a model dtype vLLM runs in: bfloat16.

    On older GPUs (compute capability < 8.0, no bfloat16) vLLM picks float16 instead: the same 2 bytes,
    so every count is the same. Returns ``(dtype, rule)``, ``rule`` a phrase for people (``"the config's
    float32, cast down to bfloat16 as vLLM does"``). Raises :class:`ConfigError` for a dtype name that is
    not in :data:`KV_DTYPES`.
    """
    if model_dtype in (None, "auto"):
        return torch.bfloat16, ("the config names no dtype: vLLM takes it as float32 and casts it down to "
                                "bfloat16")
    named = parse_kv_dtype(model_dtype)
    shown = str(named).removeprefix("torch.")
    if named is torch.float32:
        return torch.bfloat16, "the config's float32, cast down to bfloat16 as vLLM does"
    if named is torch.float16 and model_type in NO_FLOAT16_MODEL_TYPES:
        return torch.bfloat16, f"the config's float16, but vLLM never runs {model_type} in float16: bfloat16"
    if named in (torch.bfloat16, torch.float16):
        return named, f"the config's {shown}"
    return torch.bfloat16, f"the config's {shown} is no dtype vLLM runs a model in: bfloat16"


class AttentionKind(str, enum.Enum):
    """How K/V are stored: ``MHA`` (K and V per KV head; covers GQA and MQA) or ``MLA`` (one latent)."""

    MHA = "mha"
    MLA = "mla"


class LayerKind(str, enum.Enum):
    """Which keys a layer's query at position q reads (values are Hugging Face ``layer_types`` names).

    ``FULL``: keys ``0 .. q``. ``SLIDING``: keys in ``(q - W, q]`` for a window of W tokens
    (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - W``). ``CHUNKED``: keys from the start of
    q's chunk of C tokens, ``C * (q // C) .. q`` (Llama 4's ``chunked_overlay``).
    """

    FULL = "full_attention"
    SLIDING = "sliding_attention"
    CHUNKED = "chunked_attention"


def cdiv(a: int, b: int) -> int:
    """Integer ceiling of ``a / b`` (no float rounding)."""
    return -(-a // b)


@dataclass(frozen=True)
class LayerShape:
    """One layer's K and V per token on one rank: ``num_kv_heads`` heads of ``head_dim`` (K) and
    ``v_head_dim`` (V) elements; :meth:`elements` is their sum over K and V."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @property
    def elements(self) -> int:
        """Elements one token takes in the layer: ``num_kv_heads x (head_dim + v_head_dim)``."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: layers of one kind and window that share a block table per request.

    Attributes:
        index: the group's index (vLLM's ``kv_cache_group_id``; events and tiers name groups by it).
        kind: the layers' :class:`LayerKind`.
        window: W tokens (sliding) or C tokens (chunked); None for full attention.
        layers: the model's layer indices in the group, in order.
        slots: layer slots in one pool block (the same for every group of a spec whose layers are all of
            one shape; more for a group of smaller layers); ``slots - len(layers)`` of them are padding.
        block_size: tokens per block.
        shape: the layers' :class:`LayerShape` on one rank, or None where the caller gave no shapes.
        layer_bytes_per_token: bytes one token takes in one of the layers on one rank (0: not given).
        memory_kind: the rules of the layers' kind (:mod:`kvpool.spec.kinds`), from ``kind`` and ``window``.

    Raises:
        ConfigError: a kind that is not a :class:`LayerKind`, a sliding or chunked kind without a window.
    """

    index: int
    kind: LayerKind
    window: int | None
    layers: tuple[int, ...]
    slots: int
    block_size: int
    shape: LayerShape | None = None
    layer_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayerKind(self.kind))
        _ = self.memory_kind  # made (and checked: ConfigError) once, here

    @functools.cached_property
    def memory_kind(self) -> MemoryKind:
        """The rules of the layers' kind (:mod:`kvpool.spec.kinds`), from ``kind`` and ``window``: derived,
        so not a field (``dataclasses.asdict`` and the JSON made from it carry ``kind`` and ``window``)."""
        return attention_kind(self.kind.value, self.window)

    @classmethod
    def full(cls, block_size: int) -> KVCacheGroup:
        """The one group of a model whose layers all attend fully (a trace's, which names no layers)."""
        return cls(0, LayerKind.FULL, None, (0,), 1, block_size)

    @property
    def num_padding_layers(self) -> int:
        """Layer slots of each block of this group that hold no layer (vLLM's padding layers)."""
        return self.slots - len(self.layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block of this group: ``slots x layer_bytes_per_token x block_size`` (padding
        slots included; the same for every group of a spec)."""
        return self.slots * self.layer_bytes_per_token * self.block_size

    @property
    def padding_bytes_per_block(self) -> int:
        """Bytes of each block of this group that hold no layer: ``num_padding_layers x
        layer_bytes_per_token x block_size``."""
        return self.num_padding_layers * self.layer_bytes_per_token * self.block_size

    def skipped_blocks(self, num_tokens: int) -> int:
        """Leading blocks that no query at position ``>= num_tokens`` reads again (they can be freed): its
        :attr:`memory_kind`'s :meth:`~kvpool.spec.kinds.MemoryKind.skipped_blocks` (full: 0; sliding:
        ``max(0, (num_tokens - W + 1) // B)``, vLLM's ``remove_skipped_blocks``; chunked: ``(C * (num_tokens
        // C)) // B``)."""
        return self.memory_kind.skipped_blocks(num_tokens, self.block_size)

    def max_blocks(self, num_tokens: int, chunk_tokens: int = 1) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds in this group at once, when it computes
        ``chunk_tokens`` tokens per step and frees :meth:`skipped_blocks` before each step: its
        :attr:`memory_kind`'s :meth:`~kvpool.spec.kinds.MemoryKind.max_blocks` (full: ``cdiv(n, B)``;
        sliding: ``min(cdiv(n, B), cdiv(W + c - 2, B) + 1)``, c = 1 giving vLLM's SlidingWindowSpec bound
        ``cdiv(W - 1, B) + 1``; chunked: ``min(cdiv(n, B), cdiv(C - 1 + c, B))``)."""
        return self.memory_kind.max_blocks(num_tokens, self.block_size, chunk_tokens)

    def describe(self) -> str:
        """``"sliding_attention (window 1024)"``, ``"chunked_attention (chunk 8192)"`` or
        ``"full_attention"``."""
        return self.memory_kind.describe()


def kv_cache_groups(layer_kinds: Sequence[LayerKind],
                    windows: dict[LayerKind, int | None] | Sequence[int | None], block_size: int, *,
                    shapes: Sequence[LayerShape | None] | None = None,
                    layer_bytes: Sequence[int] | None = None) -> tuple[KVCacheGroup, ...]:
    """Split layers into KV cache groups (vLLM's ``_get_kv_cache_groups_uniform_page_size``, over layers of
    one shape or several).

    Args:
        layer_kinds: each layer's :class:`LayerKind`.
        windows: the window (sliding W, chunked C) of each kind, or one entry per layer (None for full).
        block_size: tokens per block.
        shapes: each layer's :class:`LayerShape`, None for a layer that owns no KV (it reads another's);
            None: every layer owns KV of one shape.
        layer_bytes: bytes one token takes in each layer (``shapes``' order; needed with ``shapes``).

    Layers of one (kind, window, shape) form a key. Where every layer takes the same bytes, keys are split
    into groups of ``size`` slots: ``size`` is the fewest layers of any key (the "1" of an n:1 pattern,
    e.g. Gemma 3's 5:1), or the most when that is under 1.5x the fewest (fewer groups, little padding).
    Where layers differ in bytes, the same rule runs on each key's bytes per token (layers x bytes), and the
    result is rounded up to a multiple of every key's per-layer bytes (their lcm): that is one block's
    bytes per token, ``T``, and a key of layers of ``p`` bytes gets ``T / p`` slots per block, so every block
    of the pool has the same bytes and a group of smaller layers holds more of them. (vLLM, with one layer
    count per group, instead grows the smaller pages' ``block_size`` by the ratio, ``unify_kv_cache_spec_
    page_size``; kvpool's coordinator keeps one block size and grows the layer count.)
    A key of ``n`` layers and ``s`` slots gets ``cdiv(n, s)`` groups; group ``i`` of it holds ``layers[i::
    cdiv(n, s)]`` (vLLM's strided split). Keys are ordered by their first layer, so group indices match
    vLLM's. A model whose layers all attend alike has one group of every layer.
    Example: Gemma-3-27B (52 sliding, 10 full) gives size 10: groups 0-5 sliding (9, 9, 9, 9, 8 and 8
    layers, 8 padding slots in all) and group 6 full. Gemma 4 E2B defaults (25 sliding layers of 4 KiB per
    token, 5 full of 8 KiB): T = 5 x 8 KiB, so 10 sliding slots (3 groups of 9, 8, 8 layers) and 5 full.
    """
    per_layer = not isinstance(windows, dict)
    if per_layer and len(windows) != len(layer_kinds):
        raise ConfigError(f"windows has {len(windows)} entries for {len(layer_kinds)} layers")
    by_key: dict[tuple[Any, ...], list[int]] = {}
    for layer, kind in enumerate(layer_kinds):
        shape = None if shapes is None else shapes[layer]
        if shapes is not None and shape is None:
            continue  # reads another layer's KV: no slot of its own
        window = windows[layer] if per_layer else windows.get(kind)  # type: ignore[index, union-attr]
        rules = attention_kind(LayerKind(kind).value, window)
        by_key.setdefault((LayerKind(kind), rules.window or None, shape), []).append(layer)
    per_key = [1 if layer_bytes is None else layer_bytes[layers[0]] for layers in by_key.values()]
    weights = [len(layers) * b for layers, b in zip(by_key.values(), per_key, strict=True)]
    base = max(weights) if max(weights) < 1.5 * min(weights) else min(weights)
    unit = math.lcm(*per_key)
    per_block = cdiv(base, unit) * unit  # T: a block's bytes per token, a multiple of every key's layer
    groups: list[KVCacheGroup] = []
    for (kind, window, shape), layers, b in zip(by_key, by_key.values(), per_key, strict=True):
        slots = per_block // b
        n = cdiv(len(layers), slots)
        for i in range(n):
            groups.append(KVCacheGroup(len(groups), kind, window, tuple(layers[i::n]), slots, block_size,
                                       shape, 0 if layer_bytes is None else b))
    return tuple(groups)


def needs_null_block(groups: Sequence[KVCacheGroup]) -> bool:
    """Whether a pool serving ``groups`` reserves a null block: when any group's kind frees a request's
    leading blocks (a window), its table holds the null block in their place."""
    return any(g.memory_kind.frees_blocks for g in groups)


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache of one model on one tensor-parallel rank.

    Args:
        num_layers: attention layers that keep KV (at most :data:`kvpool.spec.hf_config.MAX_LAYERS`).
        num_kv_heads: KV heads of the whole model, before tensor parallelism (not query heads).
        head_dim: elements per head.
        dtype: KV storage dtype (a torch dtype or a name from :data:`KV_DTYPES`).
        block_size: tokens per block (vLLM's block_size, SGLang's page_size).
        attention: :class:`AttentionKind` (``"mha"`` or ``"mla"``).
        kv_lora_rank: the MLA latent's compressed part (MLA only).
        qk_rope_head_dim: the MLA latent's RoPE part (MLA only).
        sliding_window: attention window W in tokens of the sliding layers, or None.
        tp_size: tensor-parallel ranks.
        layer_types: one :class:`LayerKind` (or its Hugging Face name) per layer; None means every layer
            slides when ``sliding_window`` is set (Mistral) and attends fully otherwise.
        attention_chunk_size: C tokens of the chunked layers (Llama 4), a multiple of ``block_size``.
        num_attention_heads: query heads, or None when unknown. It takes no memory; it tells GQA
            (fewer KV heads than query heads) and MQA (one KV head) from MHA in :attr:`attention_label`.
        v_head_dim: elements per V head where V is narrower or wider than K (MiMo-V2-Flash: K 192, V 128);
            None: ``head_dim``.
        layer_num_kv_heads: one entry per layer where layers differ (Gemma 4's full layers, MiMo's sliding
            ones), overriding ``num_kv_heads``; None: every layer alike.
        layer_head_dims: the same for ``head_dim`` (an entry also sets that layer's V width unless
            ``layer_v_head_dims`` gives it).
        layer_v_head_dims: the same for ``v_head_dim``.
        layer_windows: one window per layer (W of a sliding layer, C of a chunked one; ignored for full
            layers) where windows differ (e.g. 256 and 1024); a None entry takes ``sliding_window`` /
            ``attention_chunk_size``.
        kv_source_layers: per layer, the layer whose KV it reads: itself, or an earlier layer of the same
            kind that owns its KV (Gemma 4's ``num_kv_shared_layers``); such a layer owns no KV. None:
            every layer owns its KV.

    Sizes are integers by the rule of :mod:`kvpool.numeric` (numpy ints are converted; never bools).

    Raises:
        ConfigError: a non-positive or non-integer size, more layers than any model has, an MLA spec
            without a latent size, KV heads and ``tp_size`` that cannot be split (``tp_size`` must divide
            the heads, or be a multiple of them),
            fewer query heads than KV heads, ``layer_types`` of the wrong length or with an unknown name,
            sliding layers without ``sliding_window``, chunked layers without ``attention_chunk_size`` or
            with one that is not a multiple of ``block_size``; a per-layer list of the wrong length or with
            a size that is not a positive integer (the message names the field and layer), a KV source that
            is not an earlier KV-owning layer of the same kind.
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
    layer_types: tuple[LayerKind, ...] | None = None
    attention_chunk_size: int | None = None
    num_attention_heads: int | None = None
    v_head_dim: int | None = None
    layer_num_kv_heads: tuple[int, ...] | None = None
    layer_head_dims: tuple[int, ...] | None = None
    layer_v_head_dims: tuple[int, ...] | None = None
    layer_windows: tuple[int | None, ...] | None = None
    kv_source_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_kv_dtype(self.dtype))
        try:
            object.__setattr__(self, "attention", AttentionKind(self.attention))
        except ValueError:
            raise ConfigError(f"attention must be 'mha' or 'mla', got {self.attention!r}") from None
        mla = self.attention is AttentionKind.MLA
        self._set_ints(as_int, 1, "num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size")
        if self.num_layers > MAX_LAYERS:  # checked before any per-layer list is built
            raise ConfigError(too_many_layers("num_layers", self.num_layers))
        self._set_ints(as_optional_int, 1, "sliding_window", "attention_chunk_size", "num_attention_heads",
                       "v_head_dim")
        self._set_ints(as_int, 1 if mla else 0, "kv_lora_rank")
        self._set_ints(as_int, 0, "qk_rope_head_dim")
        self._set_layer_lists(mla)
        if not mla:
            for heads in sorted(set(self.layer_num_kv_heads or (self.num_kv_heads,))):
                self._check_tp_split(heads)
            fewest = min(self.layer_num_kv_heads or (self.num_kv_heads,))
            if self.num_attention_heads is not None and self.num_attention_heads < fewest:
                raise ConfigError(f"num_attention_heads {self.num_attention_heads} is fewer than "
                                  f"num_kv_heads {fewest}")
        object.__setattr__(self, "layer_types", self._checked_layer_types())
        object.__setattr__(self, "_windows", self._checked_windows())
        self._check_kv_sources()
        shapes = [self._own_shape(layer) if self.kv_source(layer) == layer else None
                  for layer in range(self.num_layers)]
        sizes = [0 if s is None else s.elements * self.dtype_bytes for s in shapes]
        object.__setattr__(self, "_shapes", tuple(shapes))
        object.__setattr__(self, "_groups", kv_cache_groups(
            self.layer_types, self._windows, self.block_size,  # type: ignore[arg-type, attr-defined]
            shapes=shapes, layer_bytes=sizes))

    _LAYER_LISTS = ("layer_num_kv_heads", "layer_head_dims", "layer_v_head_dims", "kv_source_layers")

    def _set_layer_lists(self, mla: bool) -> None:
        """Each per-layer list checked (length, entries) and stored as a tuple of ints."""
        for field in (*self._LAYER_LISTS, "layer_windows"):
            values = getattr(self, field)
            if values is None:
                continue
            if isinstance(values, str) or not isinstance(values, Sequence):
                raise ConfigError(f"{field} must be a list with one entry per layer, got {values!r:.60}")
            if len(values) != self.num_layers:
                raise ConfigError(f"{field} has {len(values)} entries but num_layers is {self.num_layers}")
            if mla and field != "kv_source_layers":
                raise ConfigError(f"{field} is for MHA/GQA layers; an MLA spec has one latent per layer")
            low = 0 if field == "kv_source_layers" else 1
            check = as_optional_int if field == "layer_windows" else as_int
            object.__setattr__(self, field, tuple(
                check(v, f"{field}[{i}]", minimum=low, error=ConfigError) for i, v in enumerate(values)))

    def _checked_windows(self) -> tuple[int | None, ...]:
        """Each layer's window: its ``layer_windows`` entry, else the spec field its kind names
        (:meth:`~kvpool.spec.kinds.MemoryKind.window_field`: ``sliding_window``, ``attention_chunk_size``;
        None for a kind without a window), checked by the kind."""
        given = self.layer_windows or (None,) * self.num_layers
        windows: list[int | None] = []
        for layer, (kind, w) in enumerate(zip(self.layer_types or (), given, strict=True)):
            rules = ATTENTION_KINDS[kind.value]
            field_name = rules.window_field()
            window = None if not field_name else w if w is not None else getattr(self, field_name)
            if field_name and window is None:
                raise ConfigError(f"layer {layer} is {kind.value} but has no window (layer_windows[{layer}], "
                                  f"sliding_window or attention_chunk_size)")
            if window is not None:
                rules.check_window(window, self.block_size, f"the chunk of layer {layer}, {window},")
            windows.append(window)
        return tuple(windows)

    def _check_kv_sources(self) -> None:
        for layer, source in enumerate(self.kv_source_layers or ()):
            if source == layer:
                continue
            if source > layer or self.kv_source_layers[source] != source:  # type: ignore[index]
                raise ConfigError(f"kv_source_layers[{layer}] is {source}: a layer reads the KV of an "
                                  f"earlier layer that owns its KV")
            if (self.layer_types[source], self.layer_window(source)) != (  # type: ignore[index]
                    self.layer_types[layer], self.layer_window(layer)):  # type: ignore[index]
                raise ConfigError(f"kv_source_layers[{layer}] is {source}, a layer of another kind or window")

    def _own_shape(self, layer: int) -> LayerShape:
        """Layer ``layer``'s K/V shape on one rank (MLA: the latent as one head of ``latent_dim``, no V)."""
        if self.attention is AttentionKind.MLA:
            return LayerShape(1, self.latent_dim, 0)
        heads = self.layer_num_kv_heads[layer] if self.layer_num_kv_heads else self.num_kv_heads
        head_dim = self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim
        if self.layer_v_head_dims:
            v_head_dim = self.layer_v_head_dims[layer]
        elif self.layer_head_dims and self.v_head_dim is None:
            v_head_dim = head_dim
        else:
            v_head_dim = self.v_head_dim or head_dim
        return LayerShape(max(1, heads // self.tp_size), head_dim, v_head_dim)

    def kv_source(self, layer: int) -> int:
        """The layer whose KV ``layer`` reads (itself unless ``kv_source_layers`` names another)."""
        return self.kv_source_layers[layer] if self.kv_source_layers else layer

    def layer_shape(self, layer: int) -> LayerShape:
        """The :class:`LayerShape` of the KV ``layer`` reads, on one rank (its source's, if shared)."""
        return self._shapes[self.kv_source(layer)]  # type: ignore[attr-defined, no-any-return]

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s window (W sliding, C chunked), None for a full layer."""
        return self._windows[layer]  # type: ignore[attr-defined, no-any-return]

    def layer_bytes_per_token(self, layer: int) -> int:
        """KV bytes one token takes in ``layer`` on one rank; 0 for a layer that reads another's KV."""
        if self.kv_source(layer) != layer:
            return 0
        return self._shapes[layer].elements * self.dtype_bytes  # type: ignore[attr-defined, no-any-return]

    @property
    def num_kv_layers(self) -> int:
        """Layers that own KV (``num_layers`` less the layers reading another's)."""
        return sum(1 for layer in range(self.num_layers) if self.kv_source(layer) == layer)

    @property
    def uniform_shape(self) -> bool:
        """Whether every KV-owning layer has one shape (the ``[2, S, N, B, H, D]`` layout holds it)."""
        return len({s for s in self._shapes if s is not None}) == 1  # type: ignore[attr-defined]

    def _checked_layer_types(self) -> tuple[LayerKind, ...]:
        if self.layer_types is None:
            kind = LayerKind.FULL if self.sliding_window is None else LayerKind.SLIDING
            return (kind,) * self.num_layers
        if isinstance(self.layer_types, str) or not isinstance(self.layer_types, Sequence):
            raise ConfigError(f"layer_types must be a list of layer type names, got {self.layer_types!r}")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries but num_layers is "
                              f"{self.num_layers}")
        known = ", ".join(k.value for k in LayerKind)
        names = {m.value for m in LayerKind}
        bad = [k for k in self.layer_types if not isinstance(k, str) or k not in names]
        if bad:  # None, a number, a list (not even hashable): no layer type name
            raise ConfigError(f"unknown layer type {bad[0]!r} in layer_types; known: {known}")
        kinds = tuple(LayerKind(k) for k in self.layer_types)
        if self.layer_windows is not None:  # windows checked per layer (_checked_windows)
            return kinds
        for kind in dict.fromkeys(kinds):  # each kind's spec-wide window, named as the config names it
            rules = ATTENTION_KINDS[kind.value]
            field_name = rules.window_field()
            window = getattr(self, field_name) if field_name else None
            if field_name and window is None:
                raise ConfigError(f"layer_types has {kind.value} layers but {field_name} is not set")
            if window is not None:
                rules.check_window(window, self.block_size, f"{field_name} {window}")
        return kinds

    def _set_ints(self, check: Any, minimum: int, *fields: str) -> None:
        """Each field checked by ``check`` (``as_int`` or ``as_optional_int``) and stored as an int."""
        for field in fields:
            value = check(getattr(self, field), field, minimum=minimum, error=ConfigError)
            object.__setattr__(self, field, value)

    def _check_tp_split(self, heads: int) -> None:
        tp = self.tp_size
        if heads >= tp and heads % tp:
            raise ConfigError(f"tp_size {tp} does not divide num_kv_heads {heads}")
        if heads < tp and tp % heads:
            raise ConfigError(f"tp_size {tp} is not a multiple of num_kv_heads {heads} (needed to replicate)")

    @property
    def attention_label(self) -> str:
        """``"MLA"``; ``"MQA"`` (one KV head), ``"GQA"`` (fewer KV heads than query heads) or ``"MHA"`` when
        the query heads are known; else ``"MHA/GQA"``."""
        if self.attention is AttentionKind.MLA:
            return "MLA"
        q, kv = self.num_attention_heads, self.num_kv_heads
        if q is None:
            return "MHA/GQA"
        return "MHA" if q == kv else "MQA" if kv == 1 else "GQA"

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
    def bytes_per_layer_token(self) -> int:
        """KV bytes one token takes in one layer on one rank: ``heads x (head_dim + v_head_dim) x dtype``,
        i.e. ``2 x heads x head_dim x dtype`` where K and V are alike (MLA: the latent ``latent_dim x
        dtype``). Raises :class:`ConfigError` where layers differ: use :meth:`layer_bytes_per_token`."""
        sizes = {self.layer_bytes_per_token(layer) for layer in range(self.num_layers)} - {0}
        if len(sizes) != 1:
            raise ConfigError("the layers of this spec differ in KV bytes per token; use "
                              "layer_bytes_per_token(layer) or bytes_per_token")
        return sizes.pop()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes on one rank in every layer that owns KV (the sum of
        :meth:`layer_bytes_per_token`; formulas in the module docstring)."""
        return sum(self.layer_bytes_per_token(layer) for layer in range(self.num_layers))

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        """The KV cache groups (:func:`kv_cache_groups`); one group of every layer for a uniform model."""
        return self._groups  # type: ignore[attr-defined]

    @property
    def layers_per_block(self) -> int:
        """Layer slots of one pool block: every layer for a uniform model, one group's size for a hybrid."""
        return self.groups[0].slots

    @property
    def has_windows(self) -> bool:
        """Whether any layer slides or attends in chunks (blocks can be freed before a request ends)."""
        return needs_null_block(self.groups)

    @property
    def bytes_per_block(self) -> int:
        """KV bytes one pool block takes on one rank: ``layers_per_block x bytes_per_layer_token x
        block_size`` (``bytes_per_token x block_size`` for a uniform model); the same for every group
        (:attr:`KVCacheGroup.bytes_per_block`), where layers differ in shape too."""
        return self.groups[0].bytes_per_block

    @classmethod
    def from_hf_config(
        cls,
        path_or_dict: str | Path | dict[str, Any],
        *,
        tp_size: int = 1,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
    ) -> KVCacheSpec:
        """Build the spec from a Hugging Face ``config.json`` (a file, a folder holding one, a dict, or the
        name of a built-in config: :data:`kvpool.spec.hf_config.BUILTIN_CONFIGS`).

        See :func:`kvpool.spec.hf_config.read_kv_fields` for the model types understood and how missing fields
        are filled; ``kv_cache_dtype="auto"`` follows vLLM (:func:`auto_kv_dtype`). Raises
        :class:`ConfigError` for an unreadable config, a missing field or a bad dtype.
        """
        from kvpool.spec.hf_config import read_kv_fields

        fields = read_kv_fields(path_or_dict)
        model_dtype, model_type = fields.pop("model_dtype"), fields.pop("model_type")
        for key in ("layer_types", *cls._LAYER_LISTS, "layer_windows"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        return cls(**fields, dtype=parse_kv_dtype(kv_cache_dtype, model_dtype, model_type=model_type),
                   block_size=block_size, tp_size=tp_size)

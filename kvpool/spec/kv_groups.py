"""Layer kinds and KV cache groups: which keys a layer reads (:class:`LayerKind`), one layer's shape per
token (:class:`LayerShape`), and the layers of one kind, window and shape that share a block table per
request (:class:`KVCacheGroup`, made by :func:`kv_cache_groups`: vLLM's uniform-page rule).

Hybrid attention (Gemma 2/3, gpt-oss, Llama 4, Cohere2): layers of one kind and window form groups of equal
size, each with its own block table over one shared pool; a pool block holds one group's layers. Layers of
different shapes (Gemma 4, MiMo-V2-Flash) form groups by (kind, window, shape), and a group of smaller layers
gets more layer slots per block, so every pool block has the same bytes.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError
from kvpool.spec.kinds import MemoryKind, attention_kind


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

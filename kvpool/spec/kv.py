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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool._lazy import lazy_exports
from kvpool.errors import ConfigError
from kvpool.numeric import as_int, as_optional_int
from kvpool.spec.hf_config import MAX_LAYERS, too_many_layers
from kvpool.spec.kinds import ATTENTION_KINDS
from kvpool.spec.kv_dtypes import (  # noqa: F401 (re-exported)
    KV_DTYPE_BYTES,
    NO_FLOAT16_MODEL_TYPES,
    TorchDtypeField,
    auto_kv_dtype,
    kv_dtype_name,
    parse_kv_dtype,
)
from kvpool.spec.kv_groups import (  # noqa: F401 (the dtypes' and the groups' names, re-exported)
    KVCacheGroup,
    LayerKind,
    LayerShape,
    cdiv,
    kv_cache_groups,
    needs_null_block,
)

if TYPE_CHECKING:
    import torch

#: ``KV_DTYPES`` re-exported on first use (it imports torch; importing this module does not).
__getattr__, __dir__ = lazy_exports(__name__, {"KV_DTYPES": "kvpool.spec.kv_dtypes"})


class AttentionKind(str, enum.Enum):
    """How K/V are stored: ``MHA`` (K and V per KV head; covers GQA and MQA) or ``MLA`` (one latent)."""

    MHA = "mha"
    MLA = "mla"


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache of one model on one tensor-parallel rank.

    Args:
        num_layers: attention layers that keep KV (at most :data:`kvpool.spec.hf_config.MAX_LAYERS`).
        num_kv_heads: KV heads of the whole model, before tensor parallelism (not query heads).
        head_dim: elements per head.
        dtype: KV storage dtype (a torch dtype or a name from ``KV_DTYPES``; default bfloat16).
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
    dtype: torch.dtype = TorchDtypeField("bfloat16")  # type: ignore[assignment]  # kept by name, read as torch's
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
        return KV_DTYPE_BYTES[self.dtype_name]

    @property
    def dtype_name(self) -> str:
        """The name of :attr:`dtype` (``"bfloat16"``, ``"float8_e4m3fn"``), read without importing torch."""
        return _DTYPE.name_of(self)

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
        return cls(**fields, dtype=kv_dtype_name(kv_cache_dtype, model_dtype, model_type=model_type),
                   block_size=block_size, tp_size=tp_size)


_DTYPE: TorchDtypeField = KVCacheSpec.__dict__["dtype"]  # the spec's dtype field (by name)

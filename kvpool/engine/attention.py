"""Paged attention for Hugging Face models, through ``transformers.AttentionInterface``.

The engine runs one packed batch per step: ``input_ids`` ``[1, T]`` (every scheduled request's new tokens,
back to back) with explicit ``position_ids``, and passes a :class:`StepMetadata` as the ``kvpool_step``
keyword argument of ``model(...)``; transformers hands it on to :func:`paged_attention` in every attention
layer. The name is not in ``AttentionMaskInterface``, so the model builds no mask: the function masks itself.

Two ways to attend (the engine's ``attention`` option): ``"gather"`` (this module: index_select each
request's context slots, then SDPA; the reference and the fallback) and ``"paged"``
(:mod:`kvpool.engine.paged_attention`: a kernel that reads the pool's views in place by block table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvpool.engine.paged_attention import PagedBatch, check_softcap, new_token_slots, paged_batch
from kvpool.engine.paged_attention import paged_attention as paged_kernel_attention
from kvpool.errors import InvalidArgumentError
from kvpool.numeric import as_real
from kvpool.spec import KVCacheGroup
from kvpool.spec.kinds import MemoryKind
from kvpool.storage.slots import block_slots

ATTENTION_NAME = "kvpool_paged"


@dataclass
class DecodeBatch:
    """A decode step's contexts padded into one batch (every request computes one token), so each layer
    attends all requests in one SDPA call instead of one per request.

    Attributes:
        slots: ``[R * width]`` int64: request i's context slots, then its first slot repeated up to ``width``.
        width: the longest context.
        mask: ``[R, 1, 1, width]`` bool, False on the padding; None when no context is padded.
    """

    slots: torch.Tensor
    width: int
    mask: torch.Tensor | None


@dataclass
class GroupStep:
    """One KV cache group's index tensors for a step.

    Attributes:
        slot_mapping: ``[T]`` int64 flat slot (``block_id * block_size + offset``) of each new token, in
            this group's blocks.
        context_slots: per request, ``[ctx]`` int64 flat slots of the tokens its queries may read in this
            group (from the first one its window reaches, to the last new one).
        masks: per request, ``[q_len, ctx]`` bool (True = attend), or None when every query sees every key.
        decode: the contexts as one padded batch, when every request of the step decodes one token and
            there are several (see :class:`DecodeBatch`); else None.
        paged: with ``attention="paged"``, the block tables the kernel reads (then ``context_slots`` and
            ``masks`` are empty: nothing is gathered); else None.
    """

    slot_mapping: torch.Tensor
    context_slots: list[torch.Tensor]
    masks: list[torch.Tensor | None]
    decode: DecodeBatch | None = None
    paged: PagedBatch | None = None


@dataclass
class StepMetadata:
    """Index tensors of one engine step, built once by :func:`build_step_metadata` and read by every layer.

    Attributes:
        cache: the :class:`~kvpool.storage.paged.PagedKVCache` holding every layer's K/V.
        query_starts: ``R + 1`` offsets of each request's new tokens in the packed batch.
        groups: one :class:`GroupStep` per KV cache group; layer l uses ``groups[cache.layer_group[l]]``.
        kv_layers: for a hybrid whose cache holds its attention layers only, each attention layer's model
            index -> its layer in the cache; None when the cache holds every model layer.
    """

    cache: Any
    query_starts: list[int]
    groups: list[GroupStep]
    kv_layers: dict[int, int] | None = None


def attention_mask(kind: MemoryKind, lo: int, start: int, end: int, device: torch.device | str = "cpu"
                   ) -> torch.Tensor | None:
    """``[end - start, end - lo]`` bool: query at position p (``start .. end - 1``) reads key t (``lo .. end
    - 1``) when ``kind.window_start(p) <= t <= p`` (sliding: ``t > p - W``, transformers'
    ``sliding_window_overlay``; chunked: ``t >= C * (p // C)``, ``chunked_overlay``). None when that is every
    key for every query."""
    if end - start == 1 and lo == kind.window_start(start):
        return None
    keys = torch.arange(lo, end, device=device)[None, :]
    queries = torch.arange(start, end, device=device)[:, None]
    mask = keys <= queries
    if kind.frees_blocks:  # a window: each query's first key
        mask &= keys >= torch.tensor(kind.window_starts(start, end), device=device)[:, None]
    return mask


def build_step_metadata(cache: Any, groups: Sequence[KVCacheGroup],
                        spans: list[tuple[Sequence[list[int]], int, int]], device: torch.device | str, *,
                        kv_layers: dict[int, int] | None = None, attention: str = "gather") -> StepMetadata:
    """Metadata for requests packed in order; ``spans[i] = (tables, start, end)``: request i computes tokens
    ``start .. end - 1`` this step and ``tables[g]`` (its block table in group g) covers its first ``end``
    tokens from the first one its window reaches (earlier entries may be the null block). The context and
    mask of a (kind, window) are built once and shared by the groups that have it. ``kv_layers``: see
    :class:`StepMetadata`. ``attention="paged"``: block tables only (:class:`PagedBatch` per group)."""
    starts = [0]
    for _, start, end in spans:
        starts.append(starts[-1] + end - start)
    if attention == "paged":
        batches = [paged_batch(group, spans, cache.num_blocks, cache.block_size, device) for group in groups]
        return StepMetadata(cache, starts, [GroupStep(new_token_slots(b, cache.block_size), [], [], paged=b)
                                            for b in batches], kv_layers)
    shapes: dict[MemoryKind, list[tuple[int, torch.Tensor | None]]] = {}
    steps = []
    for group in groups:
        key = group.memory_kind
        if key not in shapes:
            los = [key.window_start(start) for _, start, _ in spans]
            shapes[key] = [(lo, attention_mask(key, lo, start, end, device))
                           for lo, (_, start, end) in zip(los, spans, strict=True)]
        contexts, new = [], []
        for (lo, _), (tables, start, end) in zip(shapes[key], spans, strict=True):
            size = cache.block_size
            table = torch.tensor(tables[group.index][lo // size:], dtype=torch.int64)
            slots = block_slots(table, end - lo // size * size, size)[lo % size:]
            contexts.append(slots.to(device))
            new.append(contexts[-1][start - lo:])
        decode = _decode_batch(contexts, device) if len(spans) > 1 and starts[-1] == len(spans) else None
        steps.append(GroupStep(torch.cat(new), contexts, [m for _, m in shapes[key]], decode))
    return StepMetadata(cache, starts, steps, kv_layers)


def _decode_batch(contexts: list[torch.Tensor], device: torch.device | str) -> DecodeBatch:
    """Pad each context with its own first slot (a real slot: the mask hides it) to the longest one."""
    lengths = [c.numel() for c in contexts]
    width = max(lengths)
    padded = [c if n == width else torch.cat((c, c[:1].expand(width - n))) for c, n in zip(contexts, lengths,
                                                                                          strict=True)]
    mask = None
    if min(lengths) < width:
        keys = torch.arange(width, device=device)
        mask = (keys[None, :] < torch.tensor(lengths, device=device)[:, None])[:, None, None, :]
    return DecodeBatch(torch.cat(padded), width, mask)


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, *, scaling: float | None = None,
                    dropout: float = 0.0, kvpool_step: StepMetadata, softcap: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Write this step's K/V into the pool, then attend each request over its own slots in the layer's group.

    Args:
        query: ``[1, Hq, T, D]``; key, value: ``[1, Hkv, T, D]`` (RoPE applied), T = packed new tokens.
        kvpool_step: the step's :class:`StepMetadata`.
        softcap: Gemma 2's ``attn_logit_softcapping``: scores become ``tanh(s / softcap) * softcap`` before
            the mask and a float32 softmax, as transformers' eager attention does (SDPA has no softcap);
            None: off; one rule on both paths (:func:`~kvpool.engine.paged_attention.check_softcap`: 0 or
            below is refused).

    Other Parameters:
        s_aux (torch.Tensor): (in ``kwargs``) gpt-oss's attention sinks ``[Hq]``, a logit per head that joins
            the softmax and is dropped after it, as transformers' gpt-oss eager attention computes.

    Returns:
        ``([1, T, Hq, Dv], None)`` (Dv: the layer's V head size, D where K and V are alike). GQA runs
        through ``enable_gqa`` (KV heads are not repeated in memory). ``index_select`` on the flat view
        gathers a request's K/V (4x faster on CPU than advanced indexing; a packed cache, whose layers differ
        in shape, has no flat view and indexes block and offset: ``PagedKVCache.gather_slots``). A layer
        that reads another's KV (Gemma 4's shared layers) is given its source's views and group, so it
        stores the same K/V again (the model hands it its source's) and attends over its source's slots.
        A decode step
        of several requests runs as one padded batch (:class:`DecodeBatch`): one gather per K and V and one
        attention call per layer, not one per request.

    Raises:
        InvalidArgumentError: a ``sliding_window`` the model passes that differs from the layer's KV cache
            group; a ``softcap`` of 0 or below, or not a number.
    """
    if softcap is not None:
        softcap = check_softcap(softcap)
    meta = kvpool_step
    layer = module.layer_idx if meta.kv_layers is None else meta.kv_layers[module.layer_idx]
    group_index = meta.cache.layer_group[layer]
    sinks = _layer_sinks(meta.cache.spec.groups[group_index], kwargs)
    step = meta.groups[group_index]
    # slots come from the engine's own block tables: skip the range check (a host sync on CUDA)
    meta.cache.store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), step.slot_mapping, layer,
                        check=False)
    if step.paged is not None:
        out = paged_kernel_attention(query[0].transpose(0, 1), meta.cache.k_cache(layer),
                                     meta.cache.v_cache(layer), step.paged, scale=scaling, softcap=softcap,
                                     sinks=sinks, check=False)
        return out.unsqueeze(0), None
    return gather_attention(query, meta.cache, layer, step, meta.query_starts, scaling, softcap, sinks), None


def gather_attention(query: torch.Tensor, cache: Any, layer: int, step: GroupStep, query_starts: list[int],
                     scaling: float | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The gather path alone (the step's K/V already stored): ``query`` ``[1, Hq, T, D]`` over each
    request's context slots of ``step`` in ``layer``; returns ``[1, T, Hq, Dv]``. See
    :func:`paged_attention` for the arguments (and the softcap rule, checked here too; ``scaling`` a
    finite number)."""
    if softcap is not None:
        softcap = check_softcap(softcap)
    if scaling is not None:
        scaling = as_real(scaling, "scaling", finite=True)
    if step.decode is not None:
        return _decode_attention(query, cache, layer, step.decode, scaling, softcap, sinks)
    outputs = []
    for i, slots in enumerate(step.context_slots):
        k, v = cache.gather_slots(layer, slots)  # [ctx, Hkv, D], [ctx, Hkv, Dv]
        k = k.transpose(0, 1).unsqueeze(0).to(query.dtype)  # [1, Hkv, ctx, D]
        v = v.transpose(0, 1).unsqueeze(0).to(query.dtype)
        q = query[:, :, query_starts[i]:query_starts[i + 1]]
        outputs.append(_attend(q, k, v, step.masks[i], scaling, softcap, sinks))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2)


def _decode_attention(query: torch.Tensor, cache: Any, layer: int, batch: DecodeBatch,
                      scaling: float | None, softcap: float | None,
                      sinks: torch.Tensor | None) -> torch.Tensor:
    """Every request's one new query ``query[0, :, i]`` over its padded context: one gather per K and V and
    one attention call for the whole batch. Returns ``[1, R, Hq, Dv]``."""
    rows = query.shape[2]
    k, v = cache.gather_slots(layer, batch.slots)  # [R * W, Hkv, D], [R * W, Hkv, Dv]
    k = k.view(rows, batch.width, *k.shape[1:]).transpose(1, 2).to(query.dtype)  # [R, Hkv, W, D]
    v = v.view(rows, batch.width, *v.shape[1:]).transpose(1, 2).to(query.dtype)
    q = query[0].transpose(0, 1).unsqueeze(2)  # [R, Hq, 1, D]
    out = _attend(q, k, v, batch.mask, scaling, softcap, sinks)
    return out.transpose(1, 2).transpose(0, 1)  # [R, 1, Hq, D] -> [1, R, Hq, D]


def _layer_sinks(group: KVCacheGroup, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The layer's attention sinks (gpt-oss's ``s_aux``, one logit per query head) or None, after checking
    the ``sliding_window`` the model passes against the layer's KV cache group."""
    window = kwargs.get("sliding_window")
    expected = group.memory_kind.model_sliding_window
    if window is not None and window != expected:
        raise InvalidArgumentError(f"the model's layer slides over {window} tokens, its KV cache group "
                                   f"{group.index} is {group.describe()}")
    return kwargs.get("s_aux")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scaling: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of ``q`` ``[R, Hq, T, D]`` over ``k``, ``v`` ``[R, Hkv, S, D]`` under the boolean ``mask``
    (True: attend): SDPA, or transformers' eager attention where SDPA lacks the model's soft-capping or
    sinks. Returns ``[R, Hq, T, D]``."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return _eager_attention(q, k, v, mask, scaling, softcap, sinks)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None, softcap: float | None,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """transformers' eager attention, on ``[R, H, T, D]`` tensors, with logit soft-capping (Gemma 2:
    ``tanh(s / softcap) * softcap`` before the mask) and attention sinks (gpt-oss: a per-head logit ``[Hq]``
    that joins every row's softmax and is dropped after it, so a row's weights sum to less than 1)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    weights = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)


def register_paged_attention() -> str:
    """Register :func:`paged_attention` with transformers (idempotent); returns its name for
    ``model.set_attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME

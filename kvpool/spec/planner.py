"""Capacity planner: device memory readings in, a :class:`PoolPlan` (how many KV blocks) out.

The arithmetic is vLLM's (``gpu_memory_utilization``, ``num_gpu_blocks_override``), per tensor-parallel rank::

    budget_bytes       = floor(total_bytes x gpu_memory_utilization)
    available_kv_bytes = min(budget_bytes - non_kv_bytes, free_bytes)      (free_bytes when known)
    num_blocks         = available_kv_bytes // spec.bytes_per_block         (the smallest over the ranks)
    num_null_blocks    = 1 with a sliding or chunked group (block 0 stands for "no block"), else 0
    max_num_tokens     = num_blocks x block_size                             (token slots, over all groups)
    tokens_per_group   = num_blocks // num_groups x block_size               (tokens every group holds)
    blocks_per_request = sum over KV cache groups of group.max_blocks(max_model_len, max_num_batched_tokens)
    max_concurrency    = (num_blocks - num_null_blocks) / blocks_per_request
    context_tokens     = floor(max_concurrency x max_model_len)

Per request a full-attention group needs ``cdiv(L, B)`` blocks; a sliding one, while a step computes up to
``T = max_num_batched_tokens`` tokens of it (a prefill chunk), ``min(cdiv(L, B), cdiv(W - 2 + T, B) + 1)``:
the keys of T queries span ``W - 1 + T`` tokens at any offset in a block. vLLM's SlidingWindowSpec
(``max_admission_blocks_per_request``) reserves ``cdiv(min(W - 1 + T, L), B) + 1``: the same, or one block
more where ``W - 1 + T`` is 1 past a multiple of B (never when W and T are multiples of B) or the request is
shorter than that span. A chunked group needs ``min(cdiv(L, B), cdiv(C - 1 + T, B))`` (vLLM:
``cdiv(min(C + T, L), B)``). T is the
scheduler's step budget: :data:`DEFAULT_MAX_NUM_BATCHED_TOKENS` is the reference engine's (vLLM's own is
larger, and with async scheduling it keeps two steps in flight: give it ``2 x max_num_batched_tokens``).
A uniform model has one group, so ``max_concurrency`` is ``num_blocks / cdiv(L, B)``, whatever T.

The pool's null block (the coordinator reserves block 0 when a group has a window; vLLM's BlockPool always
does) holds no KV: the minimum counts it and ``max_concurrency`` divides the other blocks (vLLM 0.33's
concurrency divides them all). ``tokens_per_group`` is what vLLM 0.19 logged as "GPU KV cache size: N
tokens" for a hybrid model (``num_blocks // groups x B``); vLLM 0.33 logs ``max_concurrency x
max_model_len`` there, ``context_tokens`` here. The plan also gives what the windows save against the same
model with every layer full, and the bytes of padding layer slots (:func:`kvpool.spec.kv_cache_groups`).

Layers of several shapes (Gemma 4's 512-wide full layers beside 256-wide sliding ones; MiMo-V2-Flash's
sliding layers with twice the KV heads): every pool block has one size, ``bytes_per_block``, and a group of
smaller layers holds more of them per block (:func:`kvpool.spec.kv_cache_groups`), so padding is only whole
empty layer slots, counted per group (``padding_bytes_per_block``) and per request. vLLM's rule for pages
that differ (``unify_kv_cache_spec_page_size``) keeps the layers per group and grows the smaller pages'
``block_size`` instead (no padding where the pages divide, one block size per group); kvpool's coordinator
keeps one block size for every group, so it grows the layer slots.

:func:`plan_pool` is pure. :mod:`kvpool.spec.device_memory` takes the readings on a live CUDA device
(:func:`~kvpool.spec.device_memory.profile_cuda_memory`), or measures what an elastic pool sized after the
model's warm-up may take (:func:`~kvpool.spec.device_memory.measure_free_memory`, vLLM 0.34's rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from kvpool.errors import InsufficientMemoryError, InvalidArgumentError
from kvpool.numeric import as_int, as_optional_int, as_real
from kvpool.spec.device_memory import (  # noqa: F401  (also the readings' old import path)
    MIN_MARGIN_BYTES,
    PEAK_MARGIN,
    MeasuredMemory,
    MemoryReadings,
    measure_free_memory,
    measured,
    profile_cuda_memory,
    readings_from_cuda_stats,
)
from kvpool.spec.kv import KVCacheGroup, KVCacheSpec, cdiv
from kvpool.units import human_bytes, plural

if TYPE_CHECKING:
    pass

#: The step budget a plan assumes (tokens one scheduler step computes, prefill chunks and decodes together):
#: the default ``max_num_batched_tokens`` of the reference engine (:class:`kvpool.engine.engine.LLMEngine`).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256


def num_null_blocks(spec: KVCacheSpec) -> int:
    """Blocks of the pool that hold no KV: 1 (the null block) when any KV cache group slides or attends in
    chunks (:class:`kvpool.allocators.groups.KVCacheCoordinator` reserves block 0 then), else 0."""
    return 1 if spec.has_windows else 0


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group in a plan: its kind, window, layers and padding, and (with a ``max_model_len``)
    the blocks one request of that length holds in it at most, ``max_num_batched_tokens`` computed per step
    (:meth:`kvpool.spec.KVCacheGroup.max_blocks`)."""

    index: int
    kind: str
    window: int | None
    layers: tuple[int, ...]
    num_layers: int
    num_padding_layers: int
    bytes_per_block: int
    blocks_per_request: int | None
    slots: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    layer_bytes_per_token: int = 0
    padding_bytes_per_block: int = 0

    @classmethod
    def of(cls, group: KVCacheGroup, spec: KVCacheSpec, max_model_len: int | None,
           step_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS) -> GroupPlan:
        """The plan's view of ``group``: its shape per rank (``num_kv_heads``, ``head_dim``, ``v_head_dim``,
        ``layer_bytes_per_token``), its ``slots`` per block and the bytes of each block they leave empty
        (``padding_bytes_per_block``)."""
        blocks = None if max_model_len is None else group.max_blocks(max_model_len, step_tokens)
        shape = group.shape
        return cls(group.index, group.kind.value, group.window, group.layers, len(group.layers),
                   group.num_padding_layers, spec.bytes_per_block, blocks, group.slots,
                   shape.num_kv_heads if shape else 0, shape.head_dim if shape else 0,
                   shape.v_head_dim if shape else 0, group.layer_bytes_per_token,
                   group.padding_bytes_per_block)


@dataclass(frozen=True)
class PoolPlan:
    """How many KV blocks to allocate on each rank, with every term of the breakdown (bytes are per rank).

    ``limited_by`` says which bound set num_blocks: ``"budget"`` (total x utilization - non-KV), ``"free"``
    (the memory actually free) or ``"override"`` (``num_blocks_override``). ``rank`` is the tensor-parallel
    rank whose readings set the plan (the one with the least room). ``groups`` are the KV cache groups; a
    block holds ``layers_per_block`` layers of one group (``bytes_per_block`` is one group's block).
    ``num_null_blocks`` of the blocks hold no KV (:func:`num_null_blocks`). ``max_num_tokens`` counts token
    slots (``num_blocks x block_size``: a token takes a slot in every group), ``tokens_per_group`` the
    tokens every group can hold at once (``num_blocks // len(groups) x block_size``); they are equal for a
    uniform model. ``max_num_batched_tokens`` is the step budget the per-request terms assume. Per request
    of ``max_model_len`` tokens (None without one): ``blocks_per_request`` (all groups),
    ``bytes_per_request``, ``all_full_bytes_per_request`` (every layer full attention, no padding:
    ``cdiv(max_model_len, B) x bytes_per_token x B``), ``window_saving`` (``1 - bytes_per_request /
    all_full_bytes_per_request``), ``padding_bytes_per_request`` (padding layer slots),
    ``max_concurrency`` (requests at once), ``context_tokens`` (their tokens: ``floor(max_concurrency x
    max_model_len)``) and ``all_full_max_concurrency`` (the same memory sized for an all-full pool).
    """

    num_blocks: int
    block_size: int
    bytes_per_token: int
    bytes_per_block: int
    total_bytes: int
    gpu_memory_utilization: float
    budget_bytes: int
    non_kv_bytes: int
    free_bytes: int | None
    available_kv_bytes: int
    kv_cache_bytes: int
    max_num_tokens: int
    max_model_len: int | None
    limited_by: str
    rank: int
    num_null_blocks: int = 0
    tokens_per_group: int = 0
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_concurrency: float | None = None
    context_tokens: int | None = None
    layers_per_block: int = 0
    groups: tuple[GroupPlan, ...] = ()
    blocks_per_request: int | None = None
    bytes_per_request: int | None = None
    all_full_bytes_per_request: int | None = None
    padding_bytes_per_request: int | None = None
    window_saving: float | None = None
    all_full_max_concurrency: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (bytes as ints)."""
        return asdict(self)


def plan_pool(
    spec: KVCacheSpec,
    readings: MemoryReadings | Sequence[MemoryReadings],
    *,
    gpu_memory_utilization: float = 0.9,
    num_blocks_override: int | None = None,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> PoolPlan:
    """Size the KV pool of ``spec`` from memory ``readings`` (one for every rank, or a list of ``tp_size``).

    ``gpu_memory_utilization`` is taken as the decimal written (0.9 is exactly 9/10), so budgets are exact.
    ``num_blocks_override`` replaces the computed count (it must still fit in ``free_bytes`` when known).
    ``max_num_batched_tokens`` (tokens, >= 1): the most tokens one step computes, which sets how many blocks
    a sliding or chunked group holds per request (the module docstring); it changes nothing for a model
    whose layers all attend fully.

    Raises:
        InvalidArgumentError: utilization outside (0, 1], a wrong number of readings, a bad override,
            max_model_len or max_num_batched_tokens.
        InsufficientMemoryError: the pool cannot hold the null block (with windows) and one block, a
            request decoding past its windows, or one request of ``max_model_len`` tokens; the message says
            how many bytes are missing and what to change.
    """
    gpu_memory_utilization = as_real(gpu_memory_utilization, "gpu_memory_utilization", minimum=0, maximum=1,
                                     open_min=True)
    num_blocks_override = as_optional_int(num_blocks_override, "num_blocks_override", minimum=1)
    max_model_len = as_optional_int(max_model_len, "max_model_len", minimum=1)
    step = as_int(max_num_batched_tokens, "max_num_batched_tokens", minimum=1)
    ranks = _per_rank(readings, spec.tp_size)
    share = Fraction(str(gpu_memory_utilization))
    terms = [_rank_terms(r, share) for r in ranks]
    rank = min(range(len(terms)), key=lambda i: terms[i][1])
    budget, available, limited_by = terms[rank]
    num_blocks = max(available, 0) // spec.bytes_per_block
    if num_blocks_override is not None:
        num_blocks, limited_by = num_blocks_override, "override"
        _check_override_fits(num_blocks, spec, ranks)
    least = ranks[rank]
    _check_minimum(spec, num_blocks, available, max_model_len, step, overridden=limited_by == "override",
                   budget=budget, non_kv=least.non_kv_bytes)
    return PoolPlan(
        num_blocks=num_blocks, block_size=spec.block_size, bytes_per_token=spec.bytes_per_token,
        bytes_per_block=spec.bytes_per_block, total_bytes=least.total_bytes,
        gpu_memory_utilization=gpu_memory_utilization, budget_bytes=budget,
        non_kv_bytes=least.non_kv_bytes, free_bytes=least.free_bytes, available_kv_bytes=available,
        kv_cache_bytes=num_blocks * spec.bytes_per_block, max_num_tokens=num_blocks * spec.block_size,
        max_model_len=max_model_len, limited_by=limited_by, rank=rank, num_null_blocks=num_null_blocks(spec),
        tokens_per_group=num_blocks // len(spec.groups) * spec.block_size, max_num_batched_tokens=step,
        layers_per_block=spec.layers_per_block,
        groups=tuple(GroupPlan.of(g, spec, max_model_len, step) for g in spec.groups),
        **_per_request(spec, num_blocks, available, max_model_len, step),
    )


def _per_request(spec: KVCacheSpec, num_blocks: int, available: int, max_model_len: int | None, step: int
                 ) -> dict[str, Any]:
    """The per-request terms of :class:`PoolPlan` (empty without a ``max_model_len``)."""
    if max_model_len is None:
        return {"max_concurrency": None}
    blocks = sum(g.max_blocks(max_model_len, step) for g in spec.groups)
    all_layers = spec.bytes_per_token * spec.block_size  # every KV-owning layer's share of B tokens
    full_blocks = cdiv(max_model_len, spec.block_size)
    all_full = full_blocks * all_layers
    padding = sum(g.max_blocks(max_model_len, step) * g.padding_bytes_per_block for g in spec.groups)
    all_full_blocks = max(available, 0) // all_layers
    concurrency = (num_blocks - num_null_blocks(spec)) / blocks
    return {"max_concurrency": concurrency, "context_tokens": math.floor(concurrency * max_model_len),
            "blocks_per_request": blocks,
            "bytes_per_request": blocks * spec.bytes_per_block, "all_full_bytes_per_request": all_full,
            "padding_bytes_per_request": padding,
            "window_saving": 1 - blocks * spec.bytes_per_block / all_full,
            "all_full_max_concurrency": all_full_blocks / full_blocks}


def _per_rank(readings: MemoryReadings | Sequence[MemoryReadings], tp_size: int) -> list[MemoryReadings]:
    """The readings to plan with: one reading stands for every rank (it is not copied ``tp_size`` times:
    any tp_size plans in constant memory), a list must hold one per rank."""
    if isinstance(readings, MemoryReadings):
        return [readings]
    ranks = list(readings)
    if len(ranks) != tp_size or not all(isinstance(r, MemoryReadings) for r in ranks):
        raise InvalidArgumentError(f"need one MemoryReadings or a list of tp_size={tp_size} of them, "
                                   f"got {len(ranks)} items")
    return ranks


def _rank_terms(readings: MemoryReadings, share: Fraction) -> tuple[int, int, str]:
    """(budget_bytes, available_kv_bytes, limited_by) of one rank; available may be negative."""
    budget = math.floor(readings.total_bytes * share)
    available, limited_by = budget - readings.non_kv_bytes, "budget"
    if readings.free_bytes is not None and readings.free_bytes < available:
        available, limited_by = readings.free_bytes, "free"
    return budget, available, limited_by


def _check_override_fits(num_blocks: int, spec: KVCacheSpec, ranks: list[MemoryReadings]) -> None:
    need = num_blocks * spec.bytes_per_block
    free = min((r.free_bytes for r in ranks if r.free_bytes is not None), default=None)
    if free is not None and need > free:
        raise InsufficientMemoryError(
            f"num_blocks_override {num_blocks} needs {human_bytes(need)} but only {human_bytes(free)} are "
            f"free ({human_bytes(need - free)} missing); lower num_blocks_override or free device memory")


def _check_minimum(spec: KVCacheSpec, num_blocks: int, available: int, max_model_len: int | None,
                   step: int, *, overridden: bool, budget: int, non_kv: int) -> None:
    """The pool must hold its null block (:func:`num_null_blocks`) and one block, or one request of
    max_model_len in every group (without one: a request running past its windows, which holds
    :meth:`KVCacheGroup.max_blocks` in each windowed group at ``step`` tokens per step, and one block in a
    full group). The error gives sizes in binary units; when the non-KV memory alone exceeds the budget it
    says so (never a negative "available")."""
    bs = spec.block_size
    needs = [(1, "one block")]
    if max_model_len is not None:
        needs.append((sum(g.max_blocks(max_model_len, step) for g in spec.groups),
                      f"one request of max_model_len {max_model_len} tokens"))
    elif spec.has_windows:
        blocks = sum(g.memory_kind.steady_blocks(step, bs) for g in spec.groups)
        needs.append((blocks, f"one request running past the {_windows(spec)} at {plural(step, 'token')} "
                              f"per step"))
    blocks, what = max(needs)
    null = num_null_blocks(spec)
    blocks, what = blocks + null, what + (" and the null block" if null else "")
    if num_blocks >= blocks:
        return
    need = blocks * spec.bytes_per_block
    if overridden:
        raise InsufficientMemoryError(f"num_blocks_override {num_blocks} is too small: {what} needs "
                                      f"{plural(blocks, 'block')} of {bs} tokens")
    if available >= 0:
        room = f"only {human_bytes(available)} are available"
    else:
        room = (f"none is left: the non-KV memory {human_bytes(non_kv)} exceeds the budget "
                f"{human_bytes(budget)} (total x gpu_memory_utilization) by {human_bytes(-available)}")
    raise InsufficientMemoryError(
        f"the KV cache needs {human_bytes(need)} for {what} ({plural(blocks, 'block')} of "
        f"{human_bytes(spec.bytes_per_block)}) but {room} ({human_bytes(need - available)} missing); lower "
        f"the non-KV memory, raise gpu_memory_utilization, use a smaller KV dtype (fp8) or more "
        f"tensor-parallel ranks" + (", or a smaller max_model_len" if max_model_len is not None else ""))


def _windows(spec: KVCacheSpec) -> str:
    """``"sliding window of 4096 tokens"`` (and ``"chunk of 8192 tokens"``) for the windowed groups."""
    kinds = {g.memory_kind for g in spec.groups if g.memory_kind.frees_blocks}
    return " and ".join(k.window_phrase() for k in sorted(kinds, key=lambda k: (k.name, k.window)))

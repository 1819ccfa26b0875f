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

:func:`plan_pool` is pure. :func:`profile_cuda_memory` takes the readings on a live CUDA device.
:func:`measure_free_memory` measures instead what an elastic pool sized after the model's warm-up may take
(free memory less a margin of ``max(1 GiB, 0.75 x the warm-up's transient peak)``, vLLM 0.34's rule): what
``kvpool generate --kv-memory auto`` uses.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from kvpool.errors import InsufficientMemoryError, InvalidArgumentError
from kvpool.numeric import as_int, as_optional_int, as_real
from kvpool.spec.kv import KVCacheGroup, KVCacheSpec, cdiv
from kvpool.units import human_bytes, plural

if TYPE_CHECKING:
    import torch

#: The step budget a plan assumes (tokens one scheduler step computes, prefill chunks and decodes together):
#: the default ``max_num_batched_tokens`` of the reference engine (:class:`kvpool.engine.engine.LLMEngine`).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256


def num_null_blocks(spec: KVCacheSpec) -> int:
    """Blocks of the pool that hold no KV: 1 (the null block) when any KV cache group slides or attends in
    chunks (:class:`kvpool.allocators.groups.KVCacheCoordinator` reserves block 0 then), else 0."""
    return 1 if spec.has_windows else 0


@dataclass(frozen=True)
class MemoryReadings:
    """One device's memory, in bytes.

    Args:
        total_bytes: the device's whole memory (``torch.cuda.mem_get_info()[1]``).
        non_kv_bytes: what everything but the KV cache needs at its peak: weights, activations, workspace,
            CUDA context, other processes.
        free_bytes: what is free on the device right now, or None when unknown (a what-if plan).
    """

    total_bytes: int
    non_kv_bytes: int
    free_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("total_bytes", "non_kv_bytes", "free_bytes"):  # whole numbers of bytes >= 0
            check = as_optional_int if name == "free_bytes" else as_int
            object.__setattr__(self, name, check(getattr(self, name), name, minimum=0))


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


def readings_from_cuda_stats(total_bytes: int, free_bytes: int, peak_allocated_bytes: int,
                             reserved_bytes: int) -> MemoryReadings:
    """Non-KV memory from one device's counters: torch's peak allocation plus what is held outside torch.

    ``non_kv_bytes = peak_allocated + max(0, (total - free) - reserved)``: ``total - free`` is all memory in
    use on the device (``cudaMemGetInfo``: every process, the CUDA context, NCCL buffers), and ``reserved`` is
    the part torch's caching allocator holds, so their difference is the memory torch cannot see.
    """
    outside_torch = max(0, (total_bytes - free_bytes) - reserved_bytes)
    return MemoryReadings(total_bytes=total_bytes, non_kv_bytes=peak_allocated_bytes + outside_torch,
                          free_bytes=free_bytes)


def profile_cuda_memory(device: torch.device | int | str | None = None, *,
                        warmup: Callable[[], object] | None = None) -> MemoryReadings:
    """Read one CUDA device's memory for :func:`plan_pool`.

    Call it after loading the model, before allocating the KV cache, with ``warmup``: a function that
    runs one forward pass at the largest batch you will serve (its activations are the peak the KV budget
    must leave room for). The order (SGLang #36583 is the bug it avoids):

    1. synchronize, ``gc.collect()``, ``torch.cuda.empty_cache()``, ``torch.cuda.reset_peak_memory_stats()``:
       loader temporaries kept alive by reference cycles are freed and no longer count in the peak;
    2. ``warmup()``, synchronize;
    3. ``gc.collect()``, ``empty_cache()`` (freed activations leave torch's reserve and count as free), then
       ``torch.cuda.mem_get_info`` and ``torch.cuda.memory_stats`` (``allocated_bytes.all.peak``,
       ``reserved_bytes.all.current``); see :func:`readings_from_cuda_stats`.

    So non-KV = weights + the warmup's peak + memory held outside torch, never garbage. Without ``warmup``
    only step 3 runs, for a warmup you ran yourself before the call: the peak then counts everything since
    the process started (or since your own ``reset_peak_memory_stats()``), loader garbage included, which
    errs on the safe side (a smaller pool).

    Raises:
        InvalidArgumentError: no CUDA device (plan with hand-given :class:`MemoryReadings` instead), or a
            ``warmup`` that is not callable.
    """
    import torch  # at first use: importing this module imports no torch

    if not torch.cuda.is_available():
        raise InvalidArgumentError("no CUDA device to profile; give the memory readings by hand "
                                   "(MemoryReadings, or --gpu-memory on the command line)")
    if warmup is not None and not callable(warmup):
        raise InvalidArgumentError(f"warmup must be a function running one forward pass, got {warmup!r}")
    free, total, stats = _cuda_after(device, warmup)
    return readings_from_cuda_stats(total, free, stats.get("allocated_bytes.all.peak", 0),
                                    stats.get("reserved_bytes.all.current", 0))


def _cuda_after(device: torch.device | int | str | None, warmup: Callable[[], object] | None
                ) -> tuple[int, int, dict[str, Any]]:
    """``(free, total, memory_stats)`` of a CUDA device after ``warmup`` (None: none), garbage collected
    before and after it and the peak reset before it (the order of :func:`profile_cuda_memory`)."""
    import torch  # at first use: importing this module imports no torch

    if warmup is not None:
        _collect(device)
        torch.cuda.reset_peak_memory_stats(device)
        warmup()
    _collect(device)
    free, total = torch.cuda.mem_get_info(device)
    return free, total, torch.cuda.memory_stats(device)


#: The margin a measured pool leaves free: at least this many bytes (vLLM 0.34's extensible KV cache).
MIN_MARGIN_BYTES = 1 << 30
#: ... and at least this share of the warm-up's transient peak (the same rule).
PEAK_MARGIN = Fraction(3, 4)


@dataclass(frozen=True)
class MeasuredMemory:
    """Free memory measured after the model is loaded and warmed up, and the KV bytes it leaves
    (:func:`measure_free_memory`): ``kv_bytes = max(0, free_bytes - margin_bytes)`` with
    ``margin_bytes = max(1 GiB, ceil(0.75 x transient_peak_bytes))``, vLLM 0.34's margin for its
    extensible KV cache. ``transient_peak_bytes``: how far the warm-up's peak rose above what stays
    allocated after it (activations, workspace)."""

    device: str
    free_bytes: int
    transient_peak_bytes: int
    margin_bytes: int
    kv_bytes: int


def measured(device: str, free_bytes: int, transient_peak_bytes: int) -> MeasuredMemory:
    """The :class:`MeasuredMemory` of readings taken by hand (the rule without the measuring)."""
    margin = max(MIN_MARGIN_BYTES, math.ceil(PEAK_MARGIN * max(0, transient_peak_bytes)))
    return MeasuredMemory(device, free_bytes, max(0, transient_peak_bytes), margin,
                          max(0, free_bytes - margin))


def measure_free_memory(device: torch.device | str, warmup: Callable[[], object]) -> MeasuredMemory:
    """Run ``warmup`` (one forward pass at the largest step) and measure, after it, the memory the KV cache
    may take on ``device``: on CUDA ``mem_get_info``'s free bytes after :func:`_collect`, the transient
    peak from the allocator (``allocated_bytes.all.peak`` over ``.current``); on the CPU the machine's
    available memory (``psutil.virtual_memory().available``) and the peak from the process's high-water
    mark (``VmHWM``, reset before the warm-up where Linux lets ``/proc/self/clear_refs`` do it; otherwise
    the peak since the process started, which errs on the safe side) over its RSS after.

    Raises:
        InvalidArgumentError: ``warmup`` not callable, a device neither CPU nor CUDA, or (CPU) psutil
            missing (``pip install psutil``).
    """
    import torch  # at first use: importing this module imports no torch

    if not callable(warmup):
        raise InvalidArgumentError(f"warmup must be a function running one forward pass, got {warmup!r}")
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _, stats = _cuda_after(dev, warmup)
        transient = stats.get("allocated_bytes.all.peak", 0) - stats.get("allocated_bytes.all.current", 0)
        return measured(str(dev), free, transient)
    if dev.type != "cpu":
        raise InvalidArgumentError(f"memory can be measured on a CPU or CUDA device, not {dev}")
    try:
        import psutil
    except ImportError:
        raise InvalidArgumentError("measuring CPU memory needs psutil: pip install psutil") from None
    gc.collect()
    _reset_high_water_mark()
    warmup()
    gc.collect()
    rss = psutil.Process().memory_info().rss
    peak = max(_high_water_mark() or rss, rss)
    return measured("cpu", psutil.virtual_memory().available, peak - rss)


def _reset_high_water_mark() -> None:
    """Reset the process's peak RSS (Linux: ``echo 5 > /proc/self/clear_refs``); nothing where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _high_water_mark() -> int | None:
    """The process's peak RSS in bytes (``VmHWM`` of ``/proc/self/status``), or None where unreadable."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _collect(device: torch.device | int | str | None) -> None:
    """Finish the device's work, free unreachable Python objects, and give torch's free reserve back."""
    import torch  # at first use: importing this module imports no torch

    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()

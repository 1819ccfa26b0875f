"""Attention that reads the pool in place: each query walks its request's block table over a layer's
``[N, B, H, D]`` views, with no gather, no padding and no mask tensor (the engine's ``attention="paged"``).

The reference and fallback is the gather path of :mod:`kvpool.engine.attention` (``attention="gather"``):
index_select every request's context slots, then SDPA. This path computes the same function with a C++
loop (``paged_kernel.cpp`` beside this file, built once per machine by ``torch.utils.cpp_extension`` into
torch's extension cache, then loaded in milliseconds). One call attends a whole packed step of one KV cache
group, prefill chunks and decode tokens mixed.

For the query at position ``p`` of request ``r`` (head ``h``, KV head ``h // (Hq / Hkv)``: GQA by index,
KV heads never repeated), the keys are positions ``lo .. p`` of that request, read from slot
``tables[r, t // B] * B + t % B``, where ``lo`` is the group's kind's
:meth:`~kvpool.spec.kinds.MemoryKind.window_start`: 0 (full), ``max(0, p - W + 1)`` (sliding window W:
transformers' ``sliding_window_overlay``, key t when ``t > p - W``) or ``C * (p // C)`` (chunked C:
``chunked_overlay``); the kernel takes W and C as the kind's ``kernel_bounds()``. Scores are
``s = scale * q.k``, with soft-capping ``s = softcap * tanh(s / softcap)`` (Gemma 2's
``attn_logit_softcapping``, as transformers' eager attention; None: off, and a softcap of 0 or below is
refused, on both engine paths: :func:`check_softcap`), then a float32 softmax computed online block by block
(the running max and sum of FlashAttention), and ``out = sum_t softmax(s)_t v_t``. With gpt-oss's sinks (one
logit ``sink[h]`` per query head), the sink joins the softmax's denominator and is dropped after it:
``out = sum_t e^(s_t - m) v_t / (sum_t e^(s_t - m) + e^(sink - m))``, as transformers' gpt-oss eager
attention computes. Accumulation is in float32 for every storage dtype (float32, float16, bfloat16); the
output has the query's dtype.

Not here: fp8 KV (it needs the gather path's scale and conversion) and CUDA tensors (the kernel is a CPU
loop; on a GPU use ``attention="gather"``, or a FlexAttention / FlashInfer kernel over the same views):
:func:`check_paged_cache` says which with a ConfigError.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError
from kvpool.numeric import as_int, as_real
from kvpool.spec import KVCacheGroup

#: the engine's ``attention`` choices: the gather + SDPA reference, or this module's in-place path
ATTENTION_CHOICES = ("gather", "paged")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SOURCE = Path(__file__).with_name("paged_kernel.cpp")


@dataclass(frozen=True)
class PagedBatch:
    """One step's requests in one KV cache group, as the kernel reads them.

    Attributes:
        tables: ``[R, M]`` int32 block ids: ``tables[r, j]`` holds request r's tokens ``j*B .. j*B + B-1``
            (rows padded with 0 past their length; entries a window left behind may be the null block,
            never read).
        starts: ``[R + 1]`` int32 offsets of each request's new tokens in the packed batch.
        positions: ``[R]`` int32 position of each request's first new token.
        window: the sliding window W, 0 for none; chunk: the chunk size C, 0 for none.
    """

    tables: torch.Tensor
    starts: torch.Tensor
    positions: torch.Tensor
    window: int = 0
    chunk: int = 0


Spans = Sequence[tuple[Sequence[Sequence[int]], int, int]]


def paged_batch(group: KVCacheGroup, spans: Spans, num_blocks: int, block_size: int,
                device: torch.device | str = "cpu") -> PagedBatch:
    """The :class:`PagedBatch` of ``spans`` in ``group`` (``spans[i] = (tables, start, end)``: request i
    computes tokens ``start .. end - 1`` and ``tables[group.index]`` covers its first ``end`` tokens, as
    :func:`kvpool.engine.attention.build_step_metadata` takes them).

    Raises:
        InvalidArgumentError: no request, ``num_blocks`` or ``block_size`` not an integer >= 1, ``start`` /
            ``end`` not integers with ``0 <= start < end``, or a table shorter than ``ceil(end / B)``.
        InvalidIdError: a block id that is not an integer in ``[0, num_blocks)``. Nothing is built when it
            raises.
    """
    num_blocks = as_int(num_blocks, "num_blocks", minimum=1)
    block_size = as_int(block_size, "block_size", minimum=1)
    if not spans:
        raise InvalidArgumentError("a paged batch needs at least one request")
    rows, starts, positions = [], [0], []
    for i, (tables, start, end) in enumerate(spans):
        table = list(tables[group.index])
        start, end = as_int(start, f"request {i}'s start"), as_int(end, f"request {i}'s end")
        if not 0 <= start < end or len(table) * block_size < end:
            raise InvalidArgumentError(f"request {i}: tokens {start} .. {end - 1} need "
                                       f"{-(-end // block_size)} blocks of {block_size}, its table has "
                                       f"{len(table)}")
        rows.append(table)
        starts.append(starts[-1] + end - start)
        positions.append(start)
    width = max(map(len, rows))
    try:  # inferred first: a float or a bool id would pass a cast to int32 as another block
        tables_t = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    except (TypeError, ValueError, RuntimeError) as exc:  # (RuntimeError: an int past int64)
        raise InvalidIdError(f"block ids must be integers in [0, {num_blocks}): {exc}") from None
    if tables_t.dtype != torch.int64:
        raise InvalidIdError(f"block ids must be integers in [0, {num_blocks}), got {tables_t.dtype} ones")
    if int(tables_t.min()) < 0 or int(tables_t.max()) >= num_blocks:
        raise InvalidIdError(f"block ids must be in [0, {num_blocks}), got {int(tables_t.min())} .. "
                             f"{int(tables_t.max())}")
    window, chunk = group.memory_kind.kernel_bounds()
    index = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    return PagedBatch(tables_t.to(device, torch.int32), index(starts), index(positions), window, chunk)


def new_token_slots(batch: PagedBatch, block_size: int) -> torch.Tensor:
    """``[T]`` int64 flat slot (``block * B + offset``) of every new token of ``batch``, in order: the
    ``slot_mapping`` of ``PagedKVCache.store_kv``. InvalidArgumentError for a ``block_size`` that is not
    an integer >= 1."""
    block_size = as_int(block_size, "block_size", minimum=1)
    starts = batch.starts.long()
    lengths = starts[1:] - starts[:-1]
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=starts.device), lengths)
    pos = batch.positions.long()[rows] + torch.arange(int(starts[-1]), device=starts.device) - starts[rows]
    blocks = batch.tables.long()[rows, pos // block_size]
    return blocks * block_size + pos % block_size


@functools.cache
def _kernel() -> Any:
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline("kvpool_paged_attention", cpp_sources=_SOURCE.read_text(),
                           functions=["paged_attention"], extra_ldflags=["-fopenmp"],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"])
    except Exception as exc:  # a missing compiler, ninja or headers: say so once, typed
        raise ConfigError(f"attention='paged' needs its C++ kernel, which did not build ({exc}); use "
                          "attention='gather'") from exc


def load_paged_kernel() -> None:
    """Build (first time on this machine, about a minute) or load the kernel. Raises ConfigError when it
    cannot be built (no C++ compiler or ninja)."""
    _kernel()


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise ConfigError unless one layer's K ``[N, B, Hkv, D]`` and V ``[N, B, Hkv, Dv]`` views can be
    read by the kernel for queries of ``dtype``: on the CPU, float32 / float16 / bfloat16, the queries'
    dtype, last dim contiguous."""
    if k_cache.device.type != "cpu":
        raise ConfigError(f"attention='paged' runs on the CPU; the KV cache is on {k_cache.device}: use "
                          "attention='gather'")
    if k_cache.dtype not in _DTYPES or k_cache.dtype != dtype:
        raise ConfigError(f"attention='paged' reads a float32, float16 or bfloat16 cache in the model's "
                          f"dtype ({dtype}); this one is {k_cache.dtype}: use attention='gather'")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ConfigError("attention='paged' needs each head's K and V contiguous (the NHD or HND layouts)")


def check_softcap(softcap: object) -> float | None:
    """``softcap`` (logit soft-capping, scores ``tanh(s / softcap) * softcap``) as a float, None for none: the
    one rule of both engine attention paths (this kernel and the gather path). None is off, as in
    transformers (a model passes its ``attn_logit_softcapping``, None where it caps nothing); a softcap of 0
    or below means nothing there (its eager attention divides by it: 0 gives NaN, a negative c acts as
    ``|c|``; FlashAttention reads 0 as off), so it is refused rather than read one way or another.

    Raises:
        InvalidArgumentError: not None and not a finite number > 0.
    """
    if softcap is None:
        return None
    return as_real(softcap, "softcap", minimum=0.0, open_min=True, finite=True)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch, *,
                    scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """Attention of the packed ``query`` ``[T, Hq, D]`` (RoPE applied) over one layer's pool views
    ``k_cache`` ``[N, B, Hkv, D]``, ``v_cache`` ``[N, B, Hkv, Dv]`` (the step's K/V already stored) by
    ``batch``'s block tables. ``scale``: a finite number, default ``D ** -0.5``; ``softcap``: Gemma 2's
    logit soft-capping (:func:`check_softcap`); ``sinks``: ``[Hq]`` gpt-oss sink logits. Returns ``[T, Hq,
    Dv]`` in the query's dtype (the module docstring has each formula).

    Raises:
        InvalidArgumentError: an argument that is not a tensor where one belongs, shapes that do not agree
            (``T`` vs ``batch.starts[-1]``, heads, head dims of 0, a ``Hq`` not a multiple of ``Hkv``, a
            block size other than the tables'), a window or chunk that is not an integer in ``[0,
            2**63)``, a ``scale`` that is not a finite number, a ``softcap`` :func:`check_softcap` refuses.
        ConfigError: a cache the kernel cannot read (:func:`check_paged_cache`) or no kernel.
    ``check=False`` (the engine, whose tables and arguments it built and checked itself) skips the checks.
    """
    if check:
        _check_shapes(query, k_cache, v_cache, batch, sinks)
        check_paged_cache(k_cache, v_cache, query.dtype)
        scale = None if scale is None else as_real(scale, "scale", finite=True)
        softcap = check_softcap(softcap)
    out = query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])
    empty = sinks is None
    sink = torch.empty(0) if empty else sinks.detach().to(torch.float32).contiguous()  # type: ignore[union-attr]
    _kernel().paged_attention(query if query.stride(-1) == 1 else query.contiguous(), k_cache, v_cache,
                              batch.tables, batch.starts, batch.positions, sink, out, batch.window,
                              batch.chunk, query.shape[-1] ** -0.5 if scale is None else float(scale),
                              0.0 if softcap is None else float(softcap))
    return out


def _check_shapes(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PagedBatch,
                  sinks: torch.Tensor | None) -> None:
    named = [("query", query), ("k_cache", k), ("v_cache", v), ("sinks", sinks)]
    named += [(f"batch.{field}", getattr(batch, field, None)) for field in ("tables", "starts", "positions")]
    for name, t in named:
        if not isinstance(t, torch.Tensor) and (t is not None or name != "sinks"):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if query.dim() != 3 or k.dim() != 4 or v.dim() != 4:
        raise InvalidArgumentError(f"query must be [T, Hq, D] and the caches [N, B, Hkv, D]; got "
                                   f"{tuple(query.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    tokens, hq, d = query.shape
    if k.shape[:3] != v.shape[:3] or k.shape[3] != d or not k.shape[2] or hq % k.shape[2]:
        raise InvalidArgumentError(f"query {tuple(query.shape)} does not fit K {tuple(k.shape)} and V "
                                   f"{tuple(v.shape)} (same D, Hq a multiple of Hkv)")
    if not d or not v.shape[3] or not k.shape[1]:
        raise InvalidArgumentError(f"head dims and the block size must be at least 1, got D {d}, Dv "
                                   f"{v.shape[3]}, B {k.shape[1]}")
    if tokens != int(batch.starts[-1]):
        raise InvalidArgumentError(f"the batch packs {int(batch.starts[-1])} tokens, the query {tokens}")
    if v.dtype != k.dtype:
        raise InvalidArgumentError(f"K is {k.dtype}, V {v.dtype}: they must share one dtype")
    _check_index_tensors(batch)
    if batch.tables.numel() and not 0 <= int(batch.tables.min()) <= int(batch.tables.max()) < k.shape[0]:
        raise InvalidIdError(f"the tables name blocks {int(batch.tables.min())} .. {int(batch.tables.max())} "
                             f"of a cache of {k.shape[0]}")
    _check_extents(batch, k.shape[1])
    if sinks is not None and sinks.shape != (hq,):
        raise InvalidArgumentError(f"sinks must be [{hq}], got {tuple(sinks.shape)}")


def _check_index_tensors(batch: PagedBatch) -> None:
    """The kernel reads tables / starts / positions as contiguous int32 arrays of R x M, R + 1 and R."""
    requests = batch.tables.shape[0] if batch.tables.dim() == 2 else -1
    expected = (("tables", batch.tables, (requests, batch.tables.shape[-1])),
                ("starts", batch.starts, (requests + 1,)), ("positions", batch.positions, (requests,)))
    for name, t, shape in expected:
        bad_layout = t.dtype != torch.int32 or not t.is_contiguous() or t.device.type != "cpu"
        if bad_layout or tuple(t.shape) != shape:
            raise InvalidArgumentError(f"batch.{name} must be a contiguous int32 CPU tensor of shape {shape} "
                                       f"(tables [R, M]); got {t.dtype} {tuple(t.shape)} on {t.device}")
    for name in ("window", "chunk"):  # the kernel's int64_t
        as_int(getattr(batch, name), f"batch.{name}", minimum=0, maximum=2**63 - 1)


def _check_extents(batch: PagedBatch, block_size: int) -> None:
    """Every request's keys ``0 .. positions[r] + n_r - 1`` must lie in its table's row (no read past it)."""
    starts = batch.starts.long()
    lengths = starts[1:] - starts[:-1]
    if int(starts[0]) != 0 or (lengths.numel() and int(lengths.min()) < 0):
        raise InvalidArgumentError(f"batch.starts must rise from 0, got {batch.starts.tolist()}")
    ends = batch.positions.long() + lengths
    if batch.positions.numel() and (int(batch.positions.min()) < 0
                                    or int(ends.max()) > batch.tables.shape[1] * block_size):
        raise InvalidArgumentError(f"positions {batch.positions.tolist()} + new tokens {lengths.tolist()} "
                                   f"pass the tables' {batch.tables.shape[1]} blocks of {block_size}")

"""Slots, slot mappings and the encodings of stored K/V: the tensor helpers of every KV store here.

A slot is ``block_id * block_size + offset`` (int64, so pools past 2^31 elements per layer index correctly);
a slot mapping names the slot each new token's K/V goes to (-1: a padding row, skipped). The fp8 encodings
(:func:`encode`, :func:`dequantize`, :func:`fp8_scales`) are vLLM's per-tensor scaled ones, and the raw views
(:func:`raw_dtype`, :func:`as_raw`) move rows as the widest integer words their bytes allow.
:mod:`kvpool.storage.paged` re-exports every public name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError
from kvpool.numeric import as_int
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

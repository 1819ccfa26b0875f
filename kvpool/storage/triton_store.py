"""The CUDA store kernel (Triton): one program per token copies its K and V rows into their slots.

Imported only on CUDA when ``triton`` imports (``PagedKVCache`` falls back to the torch path otherwise); the
torch path (``index_copy_`` on the flat view) is the reference it must match bit for bit, and
``tests/test_paged_kv_cache.py`` compares the two when a GPU is present. Written after nano-vllm's
``store_kvcache_kernel``, but dtype-agnostic (rows move as integers of the same width, so fp8 and bf16
copy bit-exact) and with int64 offsets. **Not run on the CPU-only machine this was written on.**
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _store_kernel(k_ptr, v_ptr, k_stride, v_stride, k_cache_ptr, v_cache_ptr, slot_ptr,
                  ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot == -1:
        return
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    k = tl.load(k_ptr + token * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_stride + cols, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, v, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` as ``[T, H*D]`` integers with unit stride inside a row (a copy only if needed)."""
    rows = x.reshape(x.shape[0], -1)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows.view(_INT_OF_SIZE[x.element_size()])


def store_rows(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, flat_k: torch.Tensor,
               flat_v: torch.Tensor) -> None:
    """Write ``k[t]``, ``v[t]`` (``[T, H, D]``, cache dtype) into ``flat_k[slot]``, ``flat_v[slot]``
    (``[N*B, H, D]`` contiguous views) for ``slot = slot_mapping[t]`` (int64; -1 skips). Inputs are assumed
    checked by ``PagedKVCache.store_kv``."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k_rows, v_rows = _rows(k), _rows(v)
    row = k_rows.shape[1]
    int_dtype = k_rows.dtype
    _store_kernel[(num_tokens,)](
        k_rows, v_rows, k_rows.stride(0), v_rows.stride(0), flat_k.view(int_dtype), flat_v.view(int_dtype),
        slot_mapping, ROW=row, BLOCK=triton.next_power_of_2(row),
    )

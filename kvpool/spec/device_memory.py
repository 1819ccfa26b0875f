"""Device memory read on a live device, for the planner: :class:`MemoryReadings` and the ways to take them.

:func:`profile_cuda_memory` takes the readings :func:`kvpool.spec.planner.plan_pool` plans from on a live
CUDA device (non-KV memory = weights + the warm-up's peak + memory held outside torch).
:func:`measure_free_memory` measures instead what an elastic pool sized after the model's warm-up may take
(free memory less a margin of ``max(1 GiB, 0.75 x the warm-up's transient peak)``, vLLM 0.34's rule): what
``kvpool generate --kv-memory auto`` uses. :mod:`kvpool.spec.planner` re-exports every public name.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from kvpool.errors import InvalidArgumentError
from kvpool.numeric import as_int, as_optional_int

if TYPE_CHECKING:
    import torch


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

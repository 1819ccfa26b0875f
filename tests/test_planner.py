"""plan_pool arithmetic with hand-given readings, every error path, profile_cuda_memory on a fake device."""

import gc
import json
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import InsufficientMemoryError, InvalidArgumentError
from kvpool.spec import KVCacheSpec, device_memory, planner
from kvpool.spec.planner import MemoryReadings, plan_pool, profile_cuda_memory, readings_from_cuda_stats

GiB = 2**30
# Llama-3.1-8B, bf16: 2 x 32 x 8 x 128 x 2 B = 131072 B per token, x 16 = 2 MiB per block
LLAMA_8B = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
BLOCK = 2 * 2**20


def test_llama_8b_on_80_gib():
    plan = plan_pool(LLAMA_8B, MemoryReadings(total_bytes=80 * GiB, non_kv_bytes=16 * GiB))
    # 80 GiB x 0.9 = 72 GiB; 72 - 16 = 56 GiB; 56 GiB / 2 MiB = 28672 blocks = 458752 tokens
    assert plan.budget_bytes == 72 * GiB == 77_309_411_328
    assert plan.available_kv_bytes == 56 * GiB == 60_129_542_144
    assert (plan.num_blocks, plan.max_num_tokens) == (28672, 28672 * 16)
    assert plan.kv_cache_bytes == 28672 * BLOCK
    assert (plan.bytes_per_token, plan.bytes_per_block, plan.block_size) == (131072, BLOCK, 16)
    assert (plan.limited_by, plan.rank, plan.max_concurrency, plan.free_bytes) == ("budget", 0, None, None)


def test_budget_is_floored_exactly():
    tiny = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="fp8", block_size=1)  # 2 B per block
    # 1001 x 0.9 = 900.9 -> 900; 900 - 0 = 900 B = 450 blocks; 0.9 is exactly 9/10 (no float rounding)
    plan = plan_pool(tiny, MemoryReadings(total_bytes=1001, non_kv_bytes=0))
    assert (plan.budget_bytes, plan.num_blocks) == (900, 450)
    # 10**12 x 0.3 = 3 x 10**11 exactly (the float 0.3 x 10**12 is 299999999999.99994)
    assert plan_pool(tiny, MemoryReadings(10**12, 0), gpu_memory_utilization=0.3).budget_bytes == 3 * 10**11


def test_never_more_than_free():
    readings = MemoryReadings(total_bytes=80 * GiB, non_kv_bytes=16 * GiB, free_bytes=40 * GiB)
    plan = plan_pool(LLAMA_8B, readings)
    # budget room is 56 GiB but only 40 GiB are free: 40 GiB / 2 MiB = 20480 blocks
    assert (plan.available_kv_bytes, plan.num_blocks, plan.limited_by) == (40 * GiB, 20480, "free")
    roomy = plan_pool(LLAMA_8B, MemoryReadings(80 * GiB, 16 * GiB, free_bytes=60 * GiB))
    assert (roomy.available_kv_bytes, roomy.limited_by) == (56 * GiB, "budget")


def test_min_across_tp_ranks():
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, tp_size=2)  # 4 heads/rank: 1 MiB blocks
    ranks = [MemoryReadings(80 * GiB, 16 * GiB), MemoryReadings(80 * GiB, 20 * GiB)]
    plan = plan_pool(spec, ranks)
    # rank 1: 72 - 20 = 52 GiB / 1 MiB = 53248 blocks (rank 0 would allow 57344)
    assert (plan.rank, plan.non_kv_bytes, plan.available_kv_bytes) == (1, 20 * GiB, 52 * GiB)
    assert plan.num_blocks == 53248
    assert plan_pool(spec, MemoryReadings(80 * GiB, 16 * GiB)).num_blocks == 57344  # one reading, every rank


def test_wrong_number_of_rank_readings():
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, tp_size=4)
    with pytest.raises(InvalidArgumentError, match="tp_size=4"):
        plan_pool(spec, [MemoryReadings(80 * GiB, 0)] * 3)


def test_max_model_len_gives_concurrency():
    readings = MemoryReadings(80 * GiB, 16 * GiB)
    # 458752 tokens / 8192 = 56 requests; / 100000 = 4.58752
    assert plan_pool(LLAMA_8B, readings, max_model_len=8192).max_concurrency == 56.0
    assert plan_pool(LLAMA_8B, readings, max_model_len=100_000).max_concurrency == pytest.approx(4.58752)


def test_max_model_len_past_the_pool():
    # 1 GiB x 0.9 = 966367641 B -> 460 blocks of 2 MiB = 7360 tokens; 8192 tokens need 512 blocks
    with pytest.raises(InsufficientMemoryError) as info:
        plan_pool(LLAMA_8B, MemoryReadings(GiB, 0), max_model_len=8192)
    # missing: 512 x 2 MiB - 966367641 = 1073741824 - 966367641 = 107374183 B = 102.40 MiB
    # (107374183 / 2**20 = 102.4000...); available 966367641 B = 921.60 MiB; need 512 x 2 MiB = 1.00 GiB
    message = str(info.value)
    assert "needs 1.00 GiB" in message and "only 921.60 MiB are available (102.40 MiB missing)" in message
    assert "512 blocks of 2.00 MiB" in message and "max_model_len" in message


def test_too_little_memory_says_how_much_is_missing():
    with pytest.raises(InsufficientMemoryError) as info:
        plan_pool(LLAMA_8B, MemoryReadings(total_bytes=16 * GiB, non_kv_bytes=16 * GiB))
    # 16 GiB x 0.9 - 16 GiB = -1717986919 B (floor(17179869184 x 0.9) = 15461882265 B = 14.40 GiB);
    # 1717986919 B = 1.60 GiB over; one 2 MiB block missing on top: 1720084071 B = 1.60 GiB
    message = str(info.value)
    assert "available" not in message and not re.search(r"-\d", message)  # never a negative "available"
    assert ("none is left: the non-KV memory 16.00 GiB exceeds the budget 14.40 GiB (total x "
            "gpu_memory_utilization) by 1.60 GiB (1.60 GiB missing)") in message
    assert "needs 2.00 MiB for one block (1 block of 2.00 MiB)" in message
    assert "gpu_memory_utilization" in message and "fp8" in message


def test_exactly_one_block_and_one_byte_short():
    assert plan_pool(LLAMA_8B, MemoryReadings(BLOCK, 0), gpu_memory_utilization=1.0).num_blocks == 1
    with pytest.raises(InsufficientMemoryError, match=r"\(1 B missing\)"):
        plan_pool(LLAMA_8B, MemoryReadings(BLOCK - 1, 0), gpu_memory_utilization=1.0)


def test_sliding_window_needs_window_plus_one_block_and_the_null_block():
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, sliding_window=4096)
    # decoding (1 token per step): 4095 / 16 -> 256 blocks + 1 = 257, + the null block = 258 = 541065216 B
    ok = plan_pool(spec, MemoryReadings(258 * BLOCK, 0), gpu_memory_utilization=1.0, max_num_batched_tokens=1)
    assert (ok.num_blocks, ok.num_null_blocks) == (258, 1)
    with pytest.raises(InsufficientMemoryError) as info:
        plan_pool(spec, MemoryReadings(257 * BLOCK, 0), gpu_memory_utilization=1.0, max_num_batched_tokens=1)
    assert "sliding window of 4096 tokens at 1 token per step and the null block" in str(info.value)
    assert "(2.00 MiB missing)" in str(info.value)
    # 256 tokens per step (the default): cdiv(4096 - 2 + 256, 16) = 272 (271.875) + 1 = 273, + null = 274
    assert plan_pool(spec, MemoryReadings(274 * BLOCK, 0), gpu_memory_utilization=1.0).num_blocks == 274
    with pytest.raises(InsufficientMemoryError, match=r"274 blocks of 2\.00 MiB"):
        plan_pool(spec, MemoryReadings(273 * BLOCK, 0), gpu_memory_utilization=1.0)
    # a window that is not a whole number of blocks rounds up: 4100 tokens -> cdiv(4099, 16) = 257 + 1 + null
    odd = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, sliding_window=4100)
    with pytest.raises(InsufficientMemoryError, match="259 blocks"):
        plan_pool(odd, MemoryReadings(258 * BLOCK, 0), gpu_memory_utilization=1.0, max_num_batched_tokens=1)


def test_the_step_size_counts_only_for_windows():
    # full attention: cdiv(8192, 16) = 512 blocks per request whatever the step; no null block
    for step in (1, 256, 8192):
        plan = plan_pool(LLAMA_8B, MemoryReadings(80 * GiB, 16 * GiB), max_model_len=8192,
                         max_num_batched_tokens=step)
        assert (plan.blocks_per_request, plan.max_concurrency, plan.num_null_blocks) == (512, 56.0, 0)
        assert plan.context_tokens == 56 * 8192 == plan.max_num_tokens == plan.tokens_per_group
    assert planner.DEFAULT_MAX_NUM_BATCHED_TOKENS == 256
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(InvalidArgumentError, match="max_num_batched_tokens"):
            plan_pool(LLAMA_8B, MemoryReadings(80 * GiB, 0), max_num_batched_tokens=bad)


def test_the_engine_default_is_the_plans():
    # one constant for the step budget: LLMEngine's default max_num_batched_tokens is the plan's
    import inspect

    from kvpool.engine.engine import LLMEngine

    default = inspect.signature(LLMEngine).parameters["max_num_batched_tokens"].default
    assert default == planner.DEFAULT_MAX_NUM_BATCHED_TOKENS


def test_any_tp_size_plans_in_constant_memory():
    # one reading stands for every rank: tp_size 2**62 (1 KV head, replicated on every rank) is not a
    # list of 2**62 readings (MemoryError before)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=64, tp_size=2**62)
    # 2 x 2 x 1 x 64 x 2 B = 512 B per token, 8192 per block; 72 GiB // 8192 = 9437184 blocks
    assert plan_pool(spec, MemoryReadings(80 * GiB, 0)).num_blocks == 72 * GiB // 8192 == 9437184


def test_num_blocks_override():
    plan = plan_pool(LLAMA_8B, MemoryReadings(80 * GiB, 16 * GiB), num_blocks_override=1000)
    assert (plan.num_blocks, plan.max_num_tokens, plan.limited_by) == (1000, 16000, "override")
    assert plan.available_kv_bytes == 56 * GiB  # the breakdown is still reported
    # more than is free: 1000 x 2 MiB = 2097152000 B (1.95 GiB) against 1 GiB free: 1023410176 B missing
    # = 976.00 MiB (1023410176 / 2**20 = 976 exactly)
    with pytest.raises(InsufficientMemoryError, match=r"needs 1\.95 GiB but only 1\.00 GiB are free "
                                                      r"\(976\.00 MiB missing\)"):
        plan_pool(LLAMA_8B, MemoryReadings(80 * GiB, 0, free_bytes=GiB), num_blocks_override=1000)
    window = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, sliding_window=64)
    with pytest.raises(InsufficientMemoryError, match="num_blocks_override 4 is too small"):
        plan_pool(window, MemoryReadings(80 * GiB, 0), num_blocks_override=4)  # needs 64 / 16 + 1 = 5


@pytest.mark.parametrize("kwargs", [
    {"gpu_memory_utilization": 0}, {"gpu_memory_utilization": 1.5}, {"gpu_memory_utilization": -0.1},
    {"gpu_memory_utilization": True}, {"num_blocks_override": 0}, {"num_blocks_override": 2.5},
    {"max_model_len": 0}, {"max_model_len": -8},
])
def test_bad_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        plan_pool(LLAMA_8B, MemoryReadings(80 * GiB, 0), **kwargs)


@pytest.mark.parametrize("fields", [(-1, 0), (80, -1), (80, 0, -5), (80.5, 0), (80, None)])
def test_bad_readings(fields):
    with pytest.raises(InvalidArgumentError):
        MemoryReadings(*fields)


def test_mla_plan_on_tp_8():
    spec = KVCacheSpec(num_layers=61, num_kv_heads=128, head_dim=576, attention="mla", kv_lora_rank=512,
                       qk_rope_head_dim=64, dtype="fp8", tp_size=8)
    plan = plan_pool(spec, MemoryReadings(141 * GiB, 90 * GiB))
    # 61 x 576 x 1 B = 35136 B per token, 562176 per block; floor(141 GiB x 0.9) = 136257837465;
    # - 90 GiB (96636764160) = 39621073305 B; // 562176 = 70478 blocks
    assert (plan.bytes_per_block, plan.available_kv_bytes, plan.num_blocks) == (562176, 39621073305, 70478)


def test_to_dict_is_json_with_integer_bytes():
    plan = plan_pool(LLAMA_8B, MemoryReadings(80 * GiB, 16 * GiB, free_bytes=70 * GiB), max_model_len=4096)
    data = json.loads(json.dumps(plan.to_dict()))
    for key in ("bytes_per_token", "bytes_per_block", "total_bytes", "budget_bytes", "non_kv_bytes",
                "free_bytes", "available_kv_bytes", "kv_cache_bytes", "num_blocks", "max_num_tokens"):
        assert isinstance(data[key], int), key
    assert data["max_concurrency"] == 112.0


@given(total=st.integers(0, 2**41), non_kv=st.integers(0, 2**40), percent=st.integers(1, 100),
       block_size=st.sampled_from([1, 16, 32]), heads=st.sampled_from([1, 2, 8]))
def test_num_blocks_is_the_most_that_fit(total, non_kv, percent, block_size, heads):
    spec = KVCacheSpec(num_layers=4, num_kv_heads=heads, head_dim=64, block_size=block_size)
    budget = total * percent // 100  # integer percent: exact by construction
    try:
        plan = plan_pool(spec, MemoryReadings(total, non_kv), gpu_memory_utilization=percent / 100)
    except InsufficientMemoryError:
        assert budget - non_kv < spec.bytes_per_block
        return
    n = plan.num_blocks
    assert n >= 1 and n * spec.bytes_per_block <= budget - non_kv < (n + 1) * spec.bytes_per_block


def test_readings_from_cuda_stats():
    # 80 GiB device, 50 GiB free -> 30 GiB in use; torch reserves 20 GiB of it, so 10 GiB is outside torch;
    # peak allocated 18 GiB -> non-KV = 18 + 10 = 28 GiB
    r = readings_from_cuda_stats(80 * GiB, 50 * GiB, peak_allocated_bytes=18 * GiB, reserved_bytes=20 * GiB)
    assert (r.total_bytes, r.free_bytes, r.non_kv_bytes) == (80 * GiB, 50 * GiB, 28 * GiB)
    # reserved above the device's used figure (counters read at different instants) never subtracts
    r = readings_from_cuda_stats(80 * GiB, 70 * GiB, peak_allocated_bytes=5 * GiB, reserved_bytes=12 * GiB)
    assert r.non_kv_bytes == 5 * GiB


def test_profile_cuda_memory_call_order(monkeypatch):
    calls = []

    def record(name, result=None):
        return lambda *args, **kwargs: calls.append(name) or result

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", record("synchronize"))
    monkeypatch.setattr(gc, "collect", record("gc.collect", 0))
    monkeypatch.setattr(torch.cuda, "empty_cache", record("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", record("mem_get_info", (50 * GiB, 80 * GiB)))
    stats = {"allocated_bytes.all.peak": 18 * GiB, "reserved_bytes.all.current": 20 * GiB}
    monkeypatch.setattr(torch.cuda, "memory_stats", record("memory_stats", stats))
    readings = profile_cuda_memory()
    assert calls == ["synchronize", "gc.collect", "empty_cache", "mem_get_info", "memory_stats"]
    assert readings == MemoryReadings(total_bytes=80 * GiB, non_kv_bytes=28 * GiB, free_bytes=50 * GiB)
    assert device_memory.gc.collect is gc.collect


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_profile_without_cuda_says_what_to_do():
    with pytest.raises(InvalidArgumentError, match="by hand"):
        profile_cuda_memory()


class FakeCuda:
    """torch.cuda's memory counters for one device, as the caching allocator keeps them: ``allocated``
    (live tensors), ``reserved`` (allocated + freed blocks kept for reuse, given back by ``empty_cache``),
    ``peak`` (most allocated since the last ``reset_peak_memory_stats``), and ``outside`` bytes held by the
    CUDA context and other processes."""

    def __init__(self, total: int, outside: int) -> None:
        self.total, self.outside = total, outside
        self.allocated = self.reserved = self.peak = 0
        self.calls: list[str] = []

    def malloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def release(self, nbytes: int) -> None:
        self.allocated -= nbytes  # the block stays reserved until empty_cache

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: self.calls.append("synchronize"))
        monkeypatch.setattr(cuda, "empty_cache", self._empty_cache)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self._reset_peak)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (
            self.total - self.reserved - self.outside, self.total))
        monkeypatch.setattr(cuda, "memory_stats", lambda device=None: {
            "allocated_bytes.all.peak": self.peak, "reserved_bytes.all.current": self.reserved})

    def _empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = self.allocated

    def _reset_peak(self, device=None) -> None:
        self.calls.append("reset_peak")
        self.peak = self.allocated


class LoaderTemporary:
    """A device buffer that a reference cycle keeps alive until the cycle collector runs (SGLang #36583:
    a loader's temporary still counted in the peak that sized the KV cache)."""

    def __init__(self, cuda: FakeCuda, nbytes: int) -> None:
        self.cuda, self.nbytes, self.myself = cuda, nbytes, self
        cuda.malloc(nbytes)

    def __del__(self) -> None:
        self.cuda.release(self.nbytes)


@pytest.fixture
def no_automatic_gc():
    gc.collect()
    gc.disable()  # only profile_cuda_memory's own gc.collect() may free the temporary
    yield
    gc.enable()


def test_profile_with_warmup_counts_weights_and_activations_not_garbage(monkeypatch, no_automatic_gc):
    cuda = FakeCuda(total=80 * GiB, outside=GiB)
    cuda.install(monkeypatch)
    cuda.malloc(16 * GiB)                          # the weights
    LoaderTemporary(cuda, 4 * GiB)                 # unreachable, but alive until gc.collect()
    assert cuda.allocated == 20 * GiB

    def warmup():                                  # activations of the largest step, freed at the end
        cuda.calls.append("warmup")
        cuda.malloc(2 * GiB)
        cuda.release(2 * GiB)

    readings = profile_cuda_memory(warmup=warmup)
    # by hand: peak = 16 GiB weights + 2 GiB activations (the 4 GiB temporary was collected and the peak
    # reset before the warmup); outside torch 1 GiB; free = 80 - 16 reserved - 1 = 63 GiB
    assert (readings.total_bytes, readings.free_bytes, readings.non_kv_bytes) == (80 * GiB, 63 * GiB,
                                                                                   19 * GiB)
    assert cuda.calls == ["synchronize", "empty_cache", "reset_peak", "warmup", "synchronize", "empty_cache"]
    # the KV budget: floor(80 GiB x 0.9) = 77309411328 B (36,864 blocks of 2 MiB) - 19 GiB (9,728 blocks)
    assert plan_pool(LLAMA_8B, readings).num_blocks == 36864 - 9728


def test_profile_after_your_own_warmup_keeps_the_peak(monkeypatch, no_automatic_gc):
    """Without ``warmup`` the peak is not reset: a warmup run before the call still counts (safe side)."""
    cuda = FakeCuda(total=80 * GiB, outside=0)
    cuda.install(monkeypatch)
    cuda.malloc(16 * GiB)
    cuda.malloc(3 * GiB)
    cuda.release(3 * GiB)                          # the caller's warmup
    assert profile_cuda_memory().non_kv_bytes == 19 * GiB and "reset_peak" not in cuda.calls
    with pytest.raises(InvalidArgumentError, match="warmup"):
        profile_cuda_memory(warmup="forward")

"""PagedKVCache: views, store_kv against a brute-force per-token model, errors that write nothing, gather,
copy_blocks, bind, fp8 round trip, int64 offsets past 2^31 (meta tensors), and the Triton path on CUDA."""

import pytest
import torch

from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError, KVPoolError
from kvpool.spec import KVCacheSpec
from kvpool.storage.paged import PagedKVCache, block_slots, check_slot_mapping

L, H, D, B, N = 3, 2, 8, 4, 6  # layers, KV heads, head dim, block size, blocks


def spec(dtype: torch.dtype = torch.float16, **kw) -> KVCacheSpec:
    return KVCacheSpec(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype, block_size=B, **kw)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaN payloads included): a bit-exact copy must keep every one."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(ints).view(dtype)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def filled(cache: PagedKVCache, seed: int = 0) -> PagedKVCache:
    gen = torch.Generator().manual_seed(seed)
    cache.buffer.copy_(random_bits(tuple(cache.buffer.shape), cache.dtype, gen))
    return cache


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_buffer_shape_and_views_share_storage(layout: str) -> None:
    cache = PagedKVCache(spec(), N, layout=layout)
    page = (B, H, D) if layout == "NHD" else (H, B, D)
    assert cache.buffer.shape == (2, L, N, *page)
    assert cache.nbytes == 2 * L * N * B * H * D * 2  # 2 (K, V) x elements x 2 bytes
    for layer in range(L):
        k, v, kv = cache.k_cache(layer), cache.v_cache(layer), cache.kv_cache(layer)
        assert k.shape == v.shape == (N, B, H, D) and kv.shape == (2, N, B, H, D)
        assert k.data_ptr() == cache.buffer[0, layer].data_ptr()
        assert v.data_ptr() == cache.buffer[1, layer].data_ptr()
        fk, fv = cache.flashinfer_kv(layer)
        assert fk.shape == (N, *page) and fk.is_contiguous() and fv.is_contiguous()
        assert k.is_contiguous() == (layout == "NHD")
    cache.k_cache(2)[4, 3, 1, 5] = 7.0  # a write through a view lands in the buffer
    index = (0, 2, 4, 3, 1, 5) if layout == "NHD" else (0, 2, 4, 1, 3, 5)
    assert cache.buffer[index] == 7.0
    assert cache.kv_cache(2)[0, 4, 3, 1, 5] == 7.0


def test_flat_views_nhd_only() -> None:
    cache = PagedKVCache(spec(), N)
    flat = cache.flat_k_cache(1)
    assert flat.shape == (N * B, H, D) and flat.data_ptr() == cache.buffer[0, 1].data_ptr()
    assert cache.flat_v_cache(1).data_ptr() == cache.buffer[1, 1].data_ptr()
    with pytest.raises(InvalidArgumentError, match="NHD"):
        PagedKVCache(spec(), N, layout="HND").flat_k_cache(0)


def expected_after_store(cache: PagedKVCache, k, v, slots, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force: one token at a time, slot -> (block, offset) by Python division."""
    ek, ev = cache.k_cache(layer).clone(), cache.v_cache(layer).clone()
    for t, slot in enumerate(slots.tolist()):
        if slot != -1:
            ek[slot // B, slot % B] = k[t]
            ev[slot // B, slot % B] = v[t]
    return ek, ev


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_store_kv_matches_per_token_model_bit_for_bit(layout: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = filled(PagedKVCache(spec(dtype), N, layout=layout))
    slots = torch.tensor([5, -1, 23, 0, 17, -1, 12, 22, 9])  # scattered, two padding tokens
    k, v = (random_bits((len(slots), H, D), dtype, gen) for _ in range(2))
    others = [(cache.k_cache(x).clone(), cache.v_cache(x).clone()) for x in (0, 2)]
    ek, ev = expected_after_store(cache, k, v, slots, 1)
    cache.store_kv(k, v, slots, 1)
    assert torch.equal(bits(cache.k_cache(1)), bits(ek)) and torch.equal(bits(cache.v_cache(1)), bits(ev))
    for x, (ok, ov) in zip((0, 2), others, strict=True):  # other layers untouched
        assert torch.equal(bits(cache.k_cache(x)), bits(ok)) and torch.equal(bits(cache.v_cache(x)), bits(ov))
    for t, slot in enumerate(slots.tolist()):  # every view reads the token back
        if slot == -1:
            continue
        assert torch.equal(bits(cache.kv_cache(1)[0, slot // B, slot % B]), bits(k[t]))
        assert torch.equal(bits(cache.kv_cache(1)[1, slot // B, slot % B]), bits(v[t]))
        fk, _ = cache.flashinfer_kv(1)
        page = fk[slot // B, slot % B] if layout == "NHD" else fk[slot // B, :, slot % B]
        assert torch.equal(bits(page), bits(k[t]))
        if layout == "NHD":
            assert torch.equal(bits(cache.flat_k_cache(1)[slot]), bits(k[t]))
            assert torch.equal(bits(cache.flat_v_cache(1)[slot]), bits(v[t]))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gather_concatenates_the_block_table(layout: str) -> None:
    cache = filled(PagedKVCache(spec(torch.float32), N, layout=layout), seed=2)
    table, seq_len = [4, 1, 5], 10  # 10 tokens: blocks 4, 1 full, 2 tokens of block 5
    k, v = cache.gather(2, table, seq_len)
    want_k = torch.cat([cache.k_cache(2)[4], cache.k_cache(2)[1], cache.k_cache(2)[5, :2]])
    want_v = torch.cat([cache.v_cache(2)[4], cache.v_cache(2)[1], cache.v_cache(2)[5, :2]])
    assert k.shape == (10, H, D) and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(bits(k), bits(want_k)) and torch.equal(bits(v), bits(want_v))
    k_tensor, _ = cache.gather(2, torch.tensor(table + [0, 0]), seq_len)  # spare entries ignored
    assert torch.equal(bits(k_tensor), bits(want_k))
    assert cache.gather(0, [], 0)[0].shape == (0, H, D)


def test_store_then_gather_round_trip_with_noncontiguous_input() -> None:
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(spec(torch.float32), N)
    qkv = torch.randn(7, (4 + 2 * H) * D, generator=gen)  # a fused projection, split as engines do
    _, k, v = qkv.split([4 * D, H * D, H * D], dim=-1)
    k, v = k.view(7, H, D), v.view(7, H, D)
    assert not k.is_contiguous()
    table = [3, 0]
    cache.store_kv(k, v, block_slots(torch.tensor(table), 7, B), 0)
    gk, gv = cache.gather(0, table, 7)
    assert torch.equal(gk, k) and torch.equal(gv, v)


def bad_store_cases() -> list[tuple[str, dict, type]]:
    T = 3
    good = {"k": torch.zeros(T, H, D, dtype=torch.float16), "v": torch.zeros(T, H, D, dtype=torch.float16),
            "slot_mapping": torch.tensor([0, 5, 9]), "layer": 0}
    cases = [
        ("k dtype", {"k": good["k"].float()}, InvalidArgumentError),
        ("v dtype", {"v": good["v"].bfloat16()}, InvalidArgumentError),
        ("k heads", {"k": torch.zeros(T, H + 1, D, dtype=torch.float16)}, InvalidArgumentError),
        ("k rank", {"k": torch.zeros(T, H * D, dtype=torch.float16)}, InvalidArgumentError),
        ("k, v lengths", {"v": torch.zeros(T + 1, H, D, dtype=torch.float16)}, InvalidArgumentError),
        ("k device", {"k": torch.zeros(T, H, D, dtype=torch.float16, device="meta")}, InvalidArgumentError),
        ("k not a tensor", {"k": [[0.0]]}, InvalidArgumentError),
        ("layer high", {"layer": L}, InvalidArgumentError),
        ("layer negative", {"layer": -1}, InvalidArgumentError),
        ("layer float", {"layer": 0.0}, InvalidArgumentError),
        ("slot past end", {"slot_mapping": torch.tensor([0, N * B, 1])}, InvalidIdError),
        ("slot -2", {"slot_mapping": torch.tensor([0, -2, 1])}, InvalidIdError),
        ("slot int32", {"slot_mapping": torch.tensor([0, 5, 9], dtype=torch.int32)}, InvalidArgumentError),
        ("slot 2-D", {"slot_mapping": torch.tensor([[0, 5, 9]])}, InvalidArgumentError),
        ("slot length", {"slot_mapping": torch.tensor([0, 5])}, InvalidArgumentError),
        ("slot list", {"slot_mapping": [0, 5, 9]}, InvalidArgumentError),
    ]
    return [(name, {**good, **change}, error) for name, change, error in cases]


@pytest.mark.parametrize("check", [True, False])  # check=False skips the range check on CUDA only
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("name", "args", "error"), bad_store_cases(), ids=[c[0] for c in bad_store_cases()])
def test_bad_store_raises_and_writes_nothing(layout: str, name: str, args: dict, error: type,
                                             check: bool) -> None:
    cache = filled(PagedKVCache(spec(), N, layout=layout), seed=4)
    before = bits(cache.buffer).clone()
    with pytest.raises(error):
        cache.store_kv(**args, check=check)
    assert torch.equal(bits(cache.buffer), before)


@pytest.mark.parametrize("check", [True, False])
def test_all_padding_and_empty_store_write_nothing(check: bool) -> None:
    cache = filled(PagedKVCache(spec(), N), seed=5)
    before = bits(cache.buffer).clone()
    cache.store_kv(torch.ones(2, H, D, dtype=torch.float16), torch.ones(2, H, D, dtype=torch.float16),
                   torch.tensor([-1, -1]), 0, check=check)
    cache.store_kv(torch.ones(0, H, D, dtype=torch.float16), torch.ones(0, H, D, dtype=torch.float16),
                   torch.zeros(0, dtype=torch.int64), 0)
    assert torch.equal(bits(cache.buffer), before)


@pytest.mark.parametrize(("table", "seq_len", "error"), [
    ([0, N], 5, InvalidIdError), ([-1], 1, InvalidIdError), ([0], 5, InvalidArgumentError),
    ([0, 1], -1, InvalidArgumentError), ([0.5], 1, InvalidArgumentError),
])
def test_bad_gather_raises(table: list, seq_len: int, error: type) -> None:
    with pytest.raises(error):
        PagedKVCache(spec(), N).gather(0, table, seq_len)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2])
def test_copy_blocks_reads_all_sources_before_writing(layout: str, dtype: torch.dtype) -> None:
    cache = filled(PagedKVCache(spec(dtype), N, layout=layout), seed=6)
    old = bits(cache.buffer).clone()
    cache.copy_blocks([(0, 3), (3, 5)])  # block 5 must get block 3's *old* contents
    want = old.clone()
    want[:, :, 3], want[:, :, 5] = old[:, :, 0], old[:, :, 3]
    assert torch.equal(bits(cache.buffer), want)
    cache.copy_blocks(torch.tensor([[1, 2]]))
    want[:, :, 2] = want[:, :, 1]
    assert torch.equal(bits(cache.buffer), want)
    cache.copy_blocks([])
    assert torch.equal(bits(cache.buffer), want)


@pytest.mark.parametrize(("pairs", "error"), [
    ([(0, 1), (2, 1)], InvalidIdError), ([(0, N)], InvalidIdError), ([(-1, 0)], InvalidIdError),
    ([(0, 1, 2)], InvalidArgumentError),
])
def test_bad_copy_blocks_copies_nothing(pairs: list, error: type) -> None:
    cache = filled(PagedKVCache(spec(), N), seed=7)
    before = bits(cache.buffer).clone()
    with pytest.raises(error):
        cache.copy_blocks(pairs)
    assert torch.equal(bits(cache.buffer), before)


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.k_cache = self.v_cache = torch.tensor([])  # nano-vllm's placeholder


def toy_model(num_attention: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 2), *[Attention() for _ in range(num_attention)])


def test_bind_gives_each_layer_its_views_in_module_order() -> None:
    cache, model = PagedKVCache(spec(), N), toy_model(L)
    assert cache.bind(model) == L
    for layer, module in enumerate(model[1:]):
        assert module.k_cache.data_ptr() == cache.buffer[0, layer].data_ptr()
        assert module.v_cache.data_ptr() == cache.buffer[1, layer].data_ptr()
        assert module.k_cache.shape == (N, B, H, D)


@pytest.mark.parametrize("count", [L - 1, L + 1])
def test_bind_with_wrong_layer_count_binds_nothing(count: int) -> None:
    model = toy_model(count)
    with pytest.raises(ConfigError, match=f"{count} modules"):
        PagedKVCache(spec(), N).bind(model)
    assert all(m.k_cache.numel() == 0 for m in model[1:])


@pytest.mark.parametrize(("dtype", "max_rel"), [(torch.float8_e4m3fn, 2.0**-4), (torch.float8_e5m2, 2.0**-3)])
def test_fp8_round_trip_within_format_precision(dtype: torch.dtype, max_rel: float) -> None:
    """e4m3 keeps 3 mantissa bits (round to nearest: relative error <= 2^-4 for normal values), e5m2 2 bits
    (<= 2^-3). Values are scaled into the normal range of the format before the check."""
    gen = torch.Generator().manual_seed(8)
    k_scale, v_scale = 0.5, 4.0
    cache = PagedKVCache(spec(torch.bfloat16), N, dtype=dtype, k_scale=k_scale, v_scale=v_scale)
    k = torch.randn(20, H, D, generator=gen) * 3
    v = torch.randn(20, H, D, generator=gen) * 30
    slots = torch.arange(20)
    cache.store_kv(k, v, slots, 0)
    assert torch.equal(bits(cache.flat_k_cache(0)[:20]), bits((k / k_scale).to(dtype)))  # torch's conversion
    gk, gv = cache.gather(0, [0, 1, 2, 3, 4], 20, dtype=torch.float32)
    tiny = torch.finfo(dtype).smallest_normal
    for got, want, scale in ((gk, k, k_scale), (gv, v, v_scale)):
        normal = (want / scale).abs() >= tiny
        rel = ((got - want).abs() / want.abs())[normal]
        assert normal.float().mean() > 0.9 and rel.max() <= max_rel


def test_fp8_saturates_instead_of_nan() -> None:
    cache = PagedKVCache(spec(), N, dtype=torch.float8_e4m3fn, k_scale=2.0)
    big = torch.full((1, H, D), 1e6)
    cache.store_kv(big, -big, torch.tensor([0]), 0)
    k, v = cache.gather(0, [0], 1, dtype=torch.float32)
    assert torch.all(k == 448.0 * 2.0) and torch.all(v == -448.0)  # e4m3fn max finite is 448


def test_dtype_argument_overrides_spec() -> None:
    cache = PagedKVCache(spec(torch.bfloat16), N, dtype=torch.float32)
    assert cache.buffer.dtype == torch.float32 and cache.nbytes == 2 * L * N * B * H * D * 4
    x = torch.randn(1, H, D)
    cache.store_kv(x, x, torch.tensor([3]), 0)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        cache.store_kv(x.bfloat16(), x.bfloat16(), torch.tensor([3]), 0)


@pytest.mark.parametrize("kwargs", [{"layout": "NDH"}, {"k_scale": 0.0}, {"v_scale": float("nan")}])
def test_bad_construction_raises_config_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        PagedKVCache(spec(), N, **kwargs)


def test_mla_spec_and_bad_num_blocks_rejected() -> None:
    with pytest.raises(ConfigError, match="MLAKVCache"):
        PagedKVCache(spec(attention="mla", kv_lora_rank=8), N)
    with pytest.raises(ConfigError, match="num_blocks"):
        PagedKVCache(spec(), 0)


def test_offsets_past_2_pow_31_on_meta_tensors() -> None:
    """A pool whose per-layer K has more than 2^31 elements, on the meta device (nothing allocated): the
    views' element offsets, written out here in Python's unbounded ints, are exact."""
    big = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float16, block_size=16)
    blocks = 2**31 // (16 * 8 * 128) + 8  # 131,080 blocks
    per_layer = blocks * 16 * 8 * 128  # 2,147,549,184 elements > 2^31
    assert per_layer > 2**31
    cache = PagedKVCache(big, blocks, device="meta")
    assert cache.nbytes == 2 * 2 * per_layer * 2
    assert cache.flat_k_cache(1).storage_offset() == 1 * per_layer
    assert cache.flat_v_cache(1).storage_offset() == 3 * per_layer  # (V=1) * L + layer 1
    last = cache.flat_v_cache(1)[blocks * 16 - 1]
    assert last.storage_offset() == 3 * per_layer + (blocks * 16 - 1) * 8 * 128 == 4 * per_layer - 1024
    k, _ = cache.gather(1, [blocks - 1, blocks - 2], 20)
    assert k.shape == (20, 8, 128)


def test_slot_ids_past_2_pow_31_are_int64_exact() -> None:
    table = torch.tensor([2**28, 2**28 + 3])  # block ids whose slots pass 2^32
    assert block_slots(table, 20, 16).tolist() == [2**28 * 16 + i for i in range(16)] + [
        (2**28 + 3) * 16 + i for i in range(4)]
    cpu = torch.device("cpu")
    assert check_slot_mapping(torch.tensor([2**31 + 5, -1]), 2, 2**33, cpu) is True
    with pytest.raises(InvalidIdError):
        check_slot_mapping(torch.tensor([2**33]), 1, 2**33, cpu)


def test_stats_report_sizes() -> None:
    stats = PagedKVCache(spec(), N).stats()
    assert stats["nbytes"] == 2 * L * N * B * H * D * 2 and stats["bytes_per_block"] == 2 * L * B * H * D * 2
    assert stats["num_blocks"] == N and stats["layout"] == "NHD"
    assert issubclass(InvalidIdError, KVPoolError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_store_matches_torch_path() -> None:
    """On CUDA, store_kv takes the Triton kernel when Triton imports; it must equal the CPU torch path."""
    gen = torch.Generator().manual_seed(9)
    cpu = filled(PagedKVCache(spec(torch.bfloat16), N), seed=10)
    gpu = PagedKVCache(spec(torch.bfloat16), N, device="cuda")
    gpu.buffer.copy_(cpu.buffer)
    slots = torch.tensor([7, -1, 0, 23, 12])
    k, v = (random_bits((5, H, D), torch.bfloat16, gen) for _ in range(2))
    cpu.store_kv(k, v, slots, 2)
    gpu.store_kv(k.cuda(), v.cuda(), slots.cuda(), 2)
    assert torch.equal(bits(gpu.buffer.cpu()), bits(cpu.buffer))


def test_rows_move_as_raw_words_bit_exact_for_nan_patterns() -> None:
    """Rows are copied as 16-byte words (complex128 views): signaling-NaN double patterns, which a float
    conversion would quiet, must survive store_kv, copy_blocks and gather unchanged."""
    cache = PagedKVCache(spec(), N, zero=True)
    snan = torch.full((2, H, D // 4), 0x7FF0000000000001, dtype=torch.int64).view(torch.float16)
    snan.view(torch.int64)[1] = -0x000FFFFFFFFFFFFF  # 0xFFF0000000000001: negative signaling NaN
    cache.store_kv(snan, snan, torch.tensor([1, 2]), 1)
    cache.copy_blocks([(0, 4)])
    k, v = cache.gather(1, [4], 3)
    assert torch.equal(bits(k[1:]), bits(snan)) and torch.equal(bits(v[1:]), bits(snan))


# ---- regressions: ids that must not be truncated or overflow, unusable buffers ---------------------------

@pytest.mark.parametrize("pairs", [[(1.9, 2)], [(0.5, 1)], [(0, 1, 2)], [(0, 1), (2,)], [(0, 2**70)], None,
                                   [("a", "b")]])
def test_copy_blocks_rejects_what_is_not_int_pairs(pairs) -> None:
    cache = filled(PagedKVCache(spec(), N))
    before = bits(cache.buffer).clone()
    with pytest.raises(InvalidArgumentError):
        cache.copy_blocks(pairs)
    assert torch.equal(bits(cache.buffer), before)


@pytest.mark.parametrize("table", [[2**70], None, 1])
def test_gather_with_a_bad_block_table_raises(table) -> None:
    cache = filled(PagedKVCache(spec(), N))
    with pytest.raises(InvalidArgumentError):
        cache.gather(0, table, 2)


@pytest.mark.parametrize("kw", [{"dtype": torch.int32}, {"dtype": "float16"}, {"device": "bogus"}])
def test_unusable_buffer_is_a_config_error(kw) -> None:
    with pytest.raises(ConfigError):
        PagedKVCache(spec(), N, **kw)


def test_a_buffer_too_large_for_memory_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot allocate"):
        PagedKVCache(spec(), 2**50)


# ---- slot_mapping -----------------------------------------------------------------------------------------


def test_slot_mapping_by_hand() -> None:
    from kvpool import slot_mapping

    # B 4, blocks [7, 2, 5]: positions 0-3 in block 7 (slots 28-31), 4-7 in block 2 (8-11), 8-9 in 5 (20, 21)
    got = slot_mapping([7, 2, 5], range(10), 4)
    assert got.dtype == torch.int64 and got.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    table = torch.tensor([7, 2, 5], dtype=torch.int32)  # a kernel's block table row
    assert slot_mapping(table, torch.tensor([9, 4]), 4).tolist() == [21, 8]
    assert slot_mapping([7], [], 4).tolist() == []


@pytest.mark.parametrize(("table", "positions", "block_size", "message"), [
    ([1, 2], [8], 4, r"positions must be in \[0, 8\)"),
    ([1, 2], [-1], 4, "got min -1"),
    ([1, 2], [0.5], 4, "positions must be integers"),
    ([1.0], [0], 4, "block_table must be a 1-D integer tensor|block_table must be integers"),
    ([1, 2], [0], 0, "block_size"),
])
def test_slot_mapping_refuses_bad_input(table, positions, block_size, message) -> None:
    from kvpool import slot_mapping

    with pytest.raises(InvalidArgumentError, match=message):
        slot_mapping(table, positions, block_size)

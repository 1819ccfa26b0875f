"""The packed storage layout: layers of several K/V shapes in one ``[N, E]`` buffer, each with views of its
own shape (kvpool.storage.paged). Offsets are checked against hand arithmetic and a brute-force rebuild of the
whole buffer from what was stored."""

from pathlib import Path

import pytest
import torch

from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.spec import KVCacheSpec
from kvpool.storage.paged import PagedKVCache

S, F = "sliding_attention", "full_attention"


def small_spec(**kwargs) -> KVCacheSpec:
    # 4 layers, layer 1 full of head_dim 8, the others sliding of 4; 2 KV heads, float32, B 2.
    # layer-token: sliding 2 x (4 + 4) = 16 elements (64 B), full 2 x (8 + 8) = 32 (128 B).
    # keys: sliding 3 x 64 = 192 B per token, full 128: 192 < 1.5 x 128 is false -> 128, lcm(64, 128) = 128:
    # T = 128 B: full 1 slot, sliding 2 -> sliding layers [0, 2, 3] in cdiv(3, 2) = 2 groups: [0, 3], [2];
    # keys in order of their first layer: the sliding groups 0 and 1, the full group 2
    return KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=2,
                       layer_types=[S, F, S, S], sliding_window=8, layer_head_dims=[4, 8, 4, 4], **kwargs)


def test_offsets_by_hand():
    spec = small_spec()
    assert [(g.layers, g.slots) for g in spec.groups] == [((0, 3), 2), ((2,), 2), ((1,), 1)]
    cache = PagedKVCache(spec, num_blocks=5, zero=True)
    # a block: T x B / 4 B = 128 x 2 / 4 = 64 elements; the buffer is 5 x spec.bytes_per_block
    assert cache.packed and cache.buffer.shape == (5, 64) and cache.nbytes == 5 * spec.bytes_per_block == 1280
    assert cache.k_cache(1).shape == (5, 2, 2, 8) and cache.v_cache(0).shape == (5, 2, 2, 4)
    base, item = cache.buffer.data_ptr(), 4
    # layer 3: group 0, slot 1 -> K at 1 x B x 2 x (4 + 4) = 32 elements, V 2 x 2 x 4 = 16 further
    assert cache.k_cache(3).data_ptr() == base + 32 * item
    assert cache.v_cache(3).data_ptr() == base + 48 * item
    # layer 1 (full, one slot): K at 0, V at B x 2 x 8 = 32
    assert (cache.k_cache(1).data_ptr(), cache.v_cache(1).data_ptr()) == (base, base + 32 * item)
    assert cache.k_cache(1).stride(0) == 64  # blocks are E elements apart
    assert cache.layer_group == [0, 2, 1, 0]


def test_store_and_gather_rebuild_the_buffer():
    spec = small_spec()
    cache = PagedKVCache(spec, num_blocks=7, zero=True)
    gen = torch.Generator().manual_seed(0)
    expected = torch.zeros(7, 64)
    # each layer writes 3 tokens into blocks of its own group: group g uses blocks 2g + 1, 2g + 2
    for layer in range(4):
        shape = cache.layer_shapes[layer]
        g = cache.layer_group[layer]
        slots = torch.tensor([(2 * g + 1) * 2, (2 * g + 1) * 2 + 1, (2 * g + 2) * 2], dtype=torch.int64)
        k = torch.randn(3, shape.num_kv_heads, shape.head_dim, generator=gen)
        v = torch.randn(3, shape.num_kv_heads, shape.v_head_dim, generator=gen)
        cache.store_kv(k, v, slots, layer)
        got_k, got_v = cache.gather(layer, [2 * g + 1, 2 * g + 2], 3)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        gk, gv = cache.gather_slots(layer, slots)
        assert torch.equal(gk, k) and torch.equal(gv, v)
        # brute force: the layer's page in its slot, K then V, token by token
        position = spec.groups[g].layers.index(layer)
        page = 2 * shape.num_kv_heads * (shape.head_dim + shape.v_head_dim)
        k_len = 2 * shape.num_kv_heads * shape.head_dim
        for t, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, 2)
            row = expected[block, position * page:(position + 1) * page]
            row[offset * k.shape[1] * k.shape[2]:(offset + 1) * k.shape[1] * k.shape[2]] = k[t].flatten()
            vw = v.shape[1] * v.shape[2]
            row[k_len + offset * vw:k_len + (offset + 1) * vw] = v[t].flatten()
    assert torch.equal(cache.buffer, expected)


def test_copy_blocks_and_padding_slots():
    cache = PagedKVCache(small_spec(), num_blocks=4, zero=True)
    k, v = torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0)
    cache.store_kv(k, v, torch.tensor([2, -1], dtype=torch.int64), 1)  # -1 skips the second token
    cache.copy_blocks([(1, 3)])
    assert torch.equal(cache.buffer[3], cache.buffer[1]) and cache.buffer[1].sum() == 16 + 32
    assert cache.read_blocks(torch.tensor([3])).shape[0] == 1


def test_v_narrower_than_k_is_packed():
    # MiMo-like: every layer K 12, V 8: 2 x (12 + 8) = 40 elements per token, not 2 x 2 x 12 = 48
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=12, v_head_dim=8, dtype=torch.float32,
                       block_size=4)
    assert spec.bytes_per_token == 2 * 40 * 4
    cache = PagedKVCache(spec, num_blocks=3)
    assert cache.packed and cache.buffer.shape == (3, 2 * 4 * 40)
    assert cache.v_cache(1).shape == (3, 4, 2, 8)
    with pytest.raises(InvalidArgumentError, match=r"v must have shape \[1, 2, 8\]"):
        cache.store_kv(torch.zeros(1, 2, 12), torch.zeros(1, 2, 12), torch.tensor([0]), 0)
    with pytest.raises(InvalidArgumentError, match="flat"):
        cache.flat_k_cache(0)
    with pytest.raises(InvalidArgumentError, match="two views"):
        cache.kv_cache(0)


def test_shared_layers_read_their_source():
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=2,
                       layer_types=[S, F, S, F], sliding_window=8, layer_head_dims=[4, 8, 4, 8],
                       kv_source_layers=[0, 1, 0, 1])
    assert spec.num_kv_layers == 2 and spec.bytes_per_token == (16 + 32) * 4
    cache = PagedKVCache(spec, num_blocks=2)
    assert cache.k_cache(3).data_ptr() == cache.k_cache(1).data_ptr()
    assert cache.layer_group[2] == cache.layer_group[0]


def test_packed_refuses_hnd_and_uniform_keeps_its_layout():
    with pytest.raises(ConfigError, match="NHD"):
        PagedKVCache(small_spec(), num_blocks=2, layout="HND")
    uniform = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=2)
    cache = PagedKVCache(uniform, num_blocks=3)
    assert not cache.packed and cache.buffer.shape == (2, 2, 3, 2, 2, 4)


def test_gemma4_defaults_views():
    spec = KVCacheSpec.from_hf_config(Path(__file__).parent / "configs" / "layer_shapes" /
                                      "gemma4-text-defaults.json")
    cache = PagedKVCache(spec, num_blocks=2, device="meta")
    # 655,360 B per block / 2 B = 327,680 elements
    assert cache.buffer.shape == (2, 327680)
    assert cache.k_cache(0).shape == (2, 16, 4, 256) and cache.k_cache(5).shape == (2, 16, 4, 512)


def test_host_swap_round_trip():
    from kvpool.storage.host import HostKVCache

    cache = PagedKVCache(small_spec(), num_blocks=4, zero=True)
    cache.buffer.copy_(torch.arange(4 * 64, dtype=torch.float32).view(4, 64))
    host = HostKVCache.like(cache, 3)
    host_ids = host.swap_out(cache, [2, 3])
    before = cache.buffer.clone()
    cache.buffer.zero_()
    host.swap_in(cache, host_ids, [0, 1])
    assert torch.equal(cache.buffer[:2], before[2:]) and cache.buffer[2:].sum() == 0


def test_block_major_uniform_cache_matches_the_strips_with_padding_and_a_reused_slot_tensor():
    """packed=True on a uniform spec stores through raw token rows and remembers the row index of the last
    slot tensor: the same tensor changed in place between two stores must not reuse the old rows."""
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=4)
    strips = PagedKVCache(spec, 9, packed=False, zero=True)
    major = PagedKVCache(spec, 9, packed=True, zero=True)
    assert major.packed and major.buffer.shape == (9, 2 * 3 * 4 * 2 * 8)
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([5, -1, 30, 12, -1, 0], dtype=torch.int64)
    for _ in range(3):
        for layer in range(3):  # one slot tensor for every layer of a step, as the engine passes it
            k = torch.randn(6, 2, 8, generator=gen).half()
            v = torch.randn(6, 2, 8, generator=gen).half()
            for cache in (strips, major):
                cache.store_kv(k, v, slots, layer)
        slots[0] += 1  # in place: the next step writes another slot through the same tensor
    for layer in range(3):
        table = list(range(9))
        assert all(torch.equal(a, b) for a, b in zip(major.gather(layer, table, 36),
                                                     strips.gather(layer, table, 36), strict=True))
        everything = torch.arange(36)
        assert all(torch.equal(a, b) for a, b in zip(major.gather_slots(layer, everything),
                                                     strips.gather_slots(layer, everything), strict=True))


def test_block_major_store_under_inference_mode():
    """The engine runs under torch.inference_mode, whose tensors keep no version counter: the row index is
    computed afresh for them (a slot tensor changed in place is still seen)."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_size=4)
    strips = PagedKVCache(spec, 5, packed=False, zero=True)
    major = PagedKVCache(spec, 5, packed=True, zero=True)
    with torch.inference_mode():
        slots = torch.tensor([3, -1, 9], dtype=torch.int64)
        for layer in (0, 1, 0):
            k = torch.full((3, 2, 8), float(layer + 1), dtype=torch.float16)
            for cache in (strips, major):
                cache.store_kv(k, k, slots, layer)
            slots[0] += 4
        for layer in (0, 1):
            assert all(torch.equal(a, b) for a, b in zip(major.gather(layer, range(5), 20),
                                                         strips.gather(layer, range(5), 20), strict=True))

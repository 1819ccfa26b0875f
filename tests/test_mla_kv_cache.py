"""MLAKVCache: latent layout and views, store_latent against a per-token model, errors, gather, copy_blocks,
bind and fp8."""

import pytest
import torch

from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError
from kvpool.spec import KVCacheSpec
from kvpool.storage.mla import MLAKVCache

L, R, P, B, N = 2, 16, 8, 4, 5  # layers, kv_lora_rank, qk_rope_head_dim, block size, blocks


def spec(rope: int = P, dtype: torch.dtype = torch.bfloat16) -> KVCacheSpec:
    return KVCacheSpec(num_layers=L, num_kv_heads=1, head_dim=R + rope, dtype=dtype, block_size=B,
                       attention="mla", kv_lora_rank=R, qk_rope_head_dim=rope)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def filled(cache: MLAKVCache, seed: int) -> MLAKVCache:
    gen = torch.Generator().manual_seed(seed)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=gen))
    return cache


def test_latent_buffer_and_views() -> None:
    cache = MLAKVCache(spec(), N)
    assert cache.buffer.shape == (L, N, B, R + P) and cache.nbytes == L * N * B * (R + P) * 2
    assert cache.nbytes == spec().bytes_per_block * N  # the spec's MLA formula: layers x latent x bytes
    assert cache.kv_cache(1).data_ptr() == cache.buffer[1].data_ptr()
    assert cache.flat_kv_cache(1).shape == (N * B, R + P)
    assert cache.c_kv_cache(1).shape == (N, B, R) and cache.k_pe_cache(1).shape == (N, B, P)
    assert cache.k_pe_cache(1).data_ptr() == cache.buffer[1, 0, 0, R].data_ptr()


def test_store_latent_matches_per_token_model_and_gather() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = filled(MLAKVCache(spec(), N), seed=1)
    slots = torch.tensor([6, -1, 19, 0, 13])
    c_kv = torch.randn(5, R, generator=gen).bfloat16()
    k_pe = torch.randn(5, P, generator=gen).bfloat16()
    want = cache.kv_cache(0).clone()
    for t, slot in enumerate(slots.tolist()):
        if slot != -1:
            want[slot // B, slot % B, :R], want[slot // B, slot % B, R:] = c_kv[t], k_pe[t]
    other = cache.kv_cache(1).clone()
    cache.store_latent(c_kv, k_pe, slots, 0)
    assert torch.equal(bits(cache.kv_cache(0)), bits(want))
    assert torch.equal(bits(cache.kv_cache(1)), bits(other))
    latent = cache.gather(0, [1, 4], 7)  # blocks 1 (slots 4-7) and 4 (slots 16-18)
    assert torch.equal(bits(latent), bits(torch.cat([want[1], want[4, :3]])))
    assert torch.equal(bits(cache.c_kv_cache(0)[3, 1]), bits(c_kv[4]))  # token 4: slot 13 = block 3, offset 1
    assert torch.equal(bits(cache.k_pe_cache(0)[3, 1]), bits(k_pe[4]))


def test_rope_free_latent_takes_no_k_pe() -> None:
    cache = MLAKVCache(spec(rope=0), N)
    c_kv = torch.randn(2, R).bfloat16()
    cache.store_latent(c_kv, None, torch.tensor([3, 8]), 1)
    assert torch.equal(cache.gather(1, [0, 1, 2], 9)[[3, 8]], c_kv)


@pytest.mark.parametrize(("change", "error"), [
    ({"c_kv": torch.zeros(3, R + 1, dtype=torch.bfloat16)}, InvalidArgumentError),
    ({"k_pe": torch.zeros(3, P - 1, dtype=torch.bfloat16)}, InvalidArgumentError),
    ({"k_pe": torch.zeros(2, P, dtype=torch.bfloat16)}, InvalidArgumentError),
    ({"k_pe": None}, InvalidArgumentError),
    ({"c_kv": torch.zeros(3, R)}, InvalidArgumentError),
    ({"slot_mapping": torch.tensor([0, N * B, 1])}, InvalidIdError),
    ({"slot_mapping": torch.tensor([0, 1, -3])}, InvalidIdError),
    ({"layer": L}, InvalidArgumentError),
    ({"layer": True}, InvalidArgumentError),
    ({"slot_mapping": torch.tensor([0, 1, 2], dtype=torch.int32)}, InvalidArgumentError),
    ({"slot_mapping": torch.tensor([0, 1, 2], device="meta")}, InvalidArgumentError),
])
@pytest.mark.parametrize("check", [True, False])  # the store_kv contract: check=False skips it on CUDA only
def test_bad_store_latent_writes_nothing(change: dict, error: type, check: bool) -> None:
    cache = filled(MLAKVCache(spec(), N), seed=2)
    args = {"c_kv": torch.zeros(3, R, dtype=torch.bfloat16), "k_pe": torch.zeros(3, P, dtype=torch.bfloat16),
            "slot_mapping": torch.tensor([0, 1, 2]), "layer": 0, **change}
    before = bits(cache.buffer).clone()
    with pytest.raises(error):
        cache.store_latent(**args, check=check)
    assert torch.equal(bits(cache.buffer), before)


def test_unchecked_store_on_the_host_still_refuses_a_slot_past_the_end() -> None:
    """Issue 9, item 1: [0, 16] on a 16-slot cache raised IndexError after writing slot 0."""
    cache = filled(MLAKVCache(spec(), 4), seed=6)  # 4 blocks x 4 tokens = 16 slots: 0..15
    before = bits(cache.buffer).clone()
    with pytest.raises(InvalidIdError, match=r"\[0, 16\)"):
        cache.store_latent(torch.ones(2, R, dtype=torch.bfloat16), torch.ones(2, P, dtype=torch.bfloat16),
                           torch.tensor([0, 16]), 0, check=False)
    assert torch.equal(bits(cache.buffer), before)


def test_copy_blocks_every_layer() -> None:
    cache = filled(MLAKVCache(spec(), N), seed=3)
    old = cache.buffer.clone()
    cache.copy_blocks([(2, 0), (0, 4)])
    want = old.clone()
    want[:, 0], want[:, 4] = old[:, 2], old[:, 0]
    assert torch.equal(bits(cache.buffer), bits(want))


def test_fp8_latent_round_trip() -> None:
    """e4m3: 3 mantissa bits, relative error <= 2^-4 for values in the normal range."""
    gen = torch.Generator().manual_seed(4)
    cache = MLAKVCache(spec(), N, dtype=torch.float8_e4m3fn, scale=0.25)
    c_kv, k_pe = torch.randn(6, R, generator=gen), torch.randn(6, P, generator=gen)
    cache.store_latent(c_kv, k_pe, torch.arange(6), 1)
    got, want = cache.gather(1, [0, 1], 6, dtype=torch.float32), torch.cat([c_kv, k_pe], dim=-1)
    normal = (want / 0.25).abs() >= torch.finfo(torch.float8_e4m3fn).smallest_normal
    assert ((got - want).abs() / want.abs())[normal].max() <= 2.0**-4


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kv_cache = torch.tensor([])


def test_bind_and_wrong_count() -> None:
    cache, model = MLAKVCache(spec(), N), torch.nn.Sequential(Attention(), Attention())
    assert cache.bind(model) == L and model[1].kv_cache.data_ptr() == cache.buffer[1].data_ptr()
    with pytest.raises(ConfigError):
        cache.bind(torch.nn.Sequential(Attention()))


def test_mha_spec_rejected() -> None:
    with pytest.raises(ConfigError, match="MLA spec"):
        MLAKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8), N)

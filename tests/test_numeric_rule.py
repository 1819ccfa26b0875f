"""One rule for integers (kvpool.numeric), applied by every API that takes ids or counts (issue 9, items 6
and 10): Python ints, numpy ints and 0-d int tensors are the id they hold; bools, floats, strings, None,
meta tensors and tensors with dimensions (as counts) are refused with a kvpool error and change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool import (
    BlockPool,
    HostKVCache,
    InvalidArgumentError,
    InvalidIdError,
    KVCacheSpec,
    KVPoolError,
    MLAKVCache,
    PagedKVCache,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from kvpool.numeric import as_id_list, as_id_tensor, as_int, as_real, as_seed, index_or_none

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, block_size=4)
MLA = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=12, dtype=torch.float32, block_size=4,
                  attention="mla", kv_lora_rank=8, qk_rope_head_dim=4)
BOOLS = [True, False, np.True_, torch.tensor(True)]
META = torch.tensor([1], device="meta")


# ---- the rule itself ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (3, 3), (np.int64(3), 3), (np.uint8(3), 3), (np.array(3), 3), (torch.tensor(3), 3),
    (torch.tensor(3, dtype=torch.int16), 3), (2**70, 2**70),
    (True, None), (np.True_, None), (torch.tensor(True), None), (3.0, None), ("3", None), (None, None),
    (torch.tensor([3]), None), (np.array([3]), None), (torch.tensor(3.0), None),
    (torch.tensor(3, device="meta"), None),
])
def test_what_is_an_integer(value, expected):
    assert index_or_none(value) == expected


def test_as_int_bounds_and_error_type():
    assert as_int(np.int32(5), "n", minimum=1, maximum=5) == 5 and type(as_int(np.int32(5), "n")) is int
    with pytest.raises(InvalidArgumentError, match=r"n must be an integer in \[1, 5\], got 6"):
        as_int(6, "n", minimum=1, maximum=5)
    with pytest.raises(KeyError):  # the caller's error type
        as_int(True, "n", error=KeyError)
    with pytest.raises(InvalidArgumentError, match="an integer of 16,610 bits"):  # no 5,000-digit repr
        as_int(10**5000, "n", maximum=0)


def test_seeds_and_reals():
    assert as_seed(2**64 - 1) == 2**64 - 1
    for bad in (-1, 2**64, 2**70, True, 1.5):
        with pytest.raises(InvalidArgumentError):
            as_seed(bad)
    assert as_real(np.float32(0.5), "p", minimum=0, maximum=1) == 0.5 and as_real(1, "p") == 1.0
    for bad in (float("nan"), True, "1", None, 0.0):
        with pytest.raises(InvalidArgumentError):
            as_real(bad, "p", minimum=0, maximum=1, open_min=True)
    with pytest.raises(InvalidArgumentError, match="finite"):
        as_real(float("inf"), "t", minimum=0, finite=True)


@pytest.mark.parametrize("ids", [[1, 2], (1, 2), range(1, 3), np.array([1, 2]), torch.tensor([1, 2]),
                                 torch.tensor([1, 2], dtype=torch.int32), [np.int64(1), torch.tensor(2)]])
def test_sequences_of_ids(ids):
    assert as_id_list(ids) == [1, 2] and as_id_tensor(ids).tolist() == [1, 2]
    assert all(type(i) is int for i in as_id_list(ids))


@pytest.mark.parametrize("ids", [[1, True], [np.True_], torch.tensor([True]), np.array([True]), [1.0],
                                 torch.tensor([1.0]), 3, torch.tensor(3), "12", None, META, [[1]]])
def test_not_sequences_of_ids(ids):
    with pytest.raises(InvalidIdError):
        as_id_list(ids)
    with pytest.raises(InvalidIdError):
        as_id_tensor(ids)


# ---- every API that takes ids ------------------------------------------------------------------------


def _filled(cache):
    cache.buffer.copy_(torch.arange(cache.buffer.numel(), dtype=torch.float32).view(cache.buffer.shape))
    return cache


def _storage_calls():
    """(name, make state, call with ids, snapshot): each call takes a list of two ids."""
    def paged():
        return {"cache": _filled(PagedKVCache(SPEC, 4))}

    def mla():
        return {"cache": _filled(MLAKVCache(MLA, 4))}

    def host():
        device = _filled(PagedKVCache(SPEC, 4))
        tier = HostKVCache.like(device, 4)
        tier.cache.buffer.zero_()  # torch.empty: two tiers' unwritten blocks would differ
        return {"cache": device, "host": tier, "held": tier.swap_out(device, [2, 3])}

    def buffers(st):
        return [st["cache"].buffer.clone()] + ([st["host"].cache.buffer.clone(), st["host"].num_free_blocks]
                                               if "host" in st else [])

    return [
        ("copy_blocks", paged, lambda st, a, b: st["cache"].copy_blocks([(a, b)]), buffers),
        ("copy_blocks (MLA)", mla, lambda st, a, b: st["cache"].copy_blocks([(a, b)]), buffers),
        ("gather", paged, lambda st, a, b: st["cache"].gather(0, [a, b], 8), buffers),
        ("gather (MLA)", mla, lambda st, a, b: st["cache"].gather(0, [a, b], 8), buffers),
        ("swap_out", host, lambda st, a, b: st["host"].swap_out(st["cache"], [a, b]), buffers),
        ("swap_in", host, lambda st, a, b: st["host"].swap_in(st["cache"], st["held"], [a, b]), buffers),
        ("host free", host, lambda st, a, b: st["host"].free([a, b]), buffers),
    ]


STORAGE = _storage_calls()


@pytest.mark.parametrize(("name", "make", "call", "snap"), STORAGE, ids=[c[0] for c in STORAGE])
@pytest.mark.parametrize("bad", BOOLS, ids=["True", "False", "np.True_", "bool tensor"])
def test_storage_refuses_bools_as_block_ids(name, make, call, snap, bad):
    """``copy_blocks([(True, False)])`` copied block 1 onto block 0; gather, swap_out, free too."""
    state = make()
    before = snap(state)
    with pytest.raises(InvalidIdError):
        call(state, bad, 0)
    after = snap(state)
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(before, after,
                                                                                          strict=True))


@pytest.mark.parametrize(("name", "make", "call", "snap"), STORAGE, ids=[c[0] for c in STORAGE])
def test_storage_takes_numpy_and_0d_ids_as_their_value(name, make, call, snap):
    plain, wrapped = make(), make()
    out = call(plain, 1, 0)
    other = call(wrapped, np.int64(1), torch.tensor(0))
    if isinstance(out, tuple):  # gather
        assert all(torch.equal(x, y) for x, y in zip(out, other, strict=True))
    elif isinstance(out, torch.Tensor):
        assert torch.equal(out, other)
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(snap(plain), snap(wrapped), strict=True))


def test_meta_tensors_and_missing_caches_are_refused():
    cache = PagedKVCache(SPEC, 4)
    host = HostKVCache.like(cache, 4)
    pool = BlockPool(4)
    tokens = TokenToKVPoolAllocator(16)
    for call in (lambda: cache.copy_blocks(torch.tensor([[1, 2]], device="meta")),
                 lambda: cache.gather(0, META, 2), lambda: host.swap_out(cache, META),
                 lambda: host.free(META), lambda: pool.free(META), lambda: pool.touch(META),
                 lambda: tokens.free(META), lambda: host.swap_out(None, [1]),
                 lambda: host.swap_in("cache", [0], [1]), lambda: host.swap_out(cache, [1], pool="pool")):
        with pytest.raises(KVPoolError):
            call()
    assert host.num_free_blocks == 4 and pool.num_free_blocks == 4 and tokens.available_size == 15


def test_token_allocators_refuse_bools_and_take_numpy_ids():
    a = TokenToKVPoolAllocator(16)
    slots = a.alloc(3)                                   # 1, 2, 3
    for bad in ([1, True], torch.tensor([True]), [np.True_]):
        with pytest.raises(InvalidArgumentError):
            a.free(bad)
    assert a.available_size == 12
    a.free([np.int64(1), torch.tensor(2)])
    assert a.available_size == 14
    with pytest.raises(InvalidArgumentError):
        a.alloc(torch.tensor([1, 1]))                    # not one count
    assert a.alloc(torch.tensor(1)).numel() == 1 and a.available_size == 13
    a.free(slots[2:])
    rows = ReqToTokenPool(4, 8)
    (row,) = rows.alloc(np.int64(1))
    rows.write(np.int64(row), [5, 6], start=torch.tensor(1))
    assert rows.read(torch.tensor(row), 3, start=np.int32(1)).tolist() == [5, 6]
    for bad in (lambda: rows.write(True, [1]), lambda: rows.free([True]), lambda: rows.read(row, True)):
        with pytest.raises(InvalidArgumentError):
            bad()
    rows.free([np.int64(row)])
    assert rows.available_size == 4

"""SWATokenToKVPoolAllocator (SGLang style): both pools per token, the full-to-SWA mapping, freeing out of
the window, atomic allocation; sizes worked out by hand (slot 0 of each pool is padding)."""

import numpy as np
import pytest
import torch

from kvpool.allocators.swa_token import SWATokenToKVPoolAllocator
from kvpool.errors import (
    DoubleFreeError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    OutOfBlocksError,
)


def test_alloc_maps_each_full_slot_to_an_swa_slot():
    pool = SWATokenToKVPoolAllocator(64, 16)  # 63 full and 15 SWA slots allocatable
    assert (pool.full_available_size, pool.swa_available_size, pool.available_size) == (63, 15, 15)
    full = pool.alloc(10)
    swa = pool.translate_loc_from_full_to_swa(full)
    assert full.dtype == swa.dtype == torch.int64 and bool((full > 0).all()) and bool((swa > 0).all())
    assert swa.unique().numel() == 10 and pool.available_size == 5  # min(53, 5)
    assert pool.translate_loc_from_full_to_swa(torch.tensor([0])).tolist() == [0]  # padding maps to none
    pool.check_integrity()


def test_free_swa_keeps_full_slots_and_free_releases_both():
    pool = SWATokenToKVPoolAllocator(64, 16)
    full = pool.alloc(12)
    pool.free_swa(full[:8])  # 8 tokens fell out of the window
    assert (pool.full_available_size, pool.swa_available_size) == (63 - 12, 15 - 4)
    assert pool.translate_loc_from_full_to_swa(full[:8]).tolist() == [0] * 8
    pool.free_swa(full[:8])  # again: nothing left to release
    pool.check_integrity()
    pool.free(full)
    assert (pool.full_available_size, pool.swa_available_size) == (63, 15)
    pool.check_integrity()


def test_alloc_is_atomic_when_the_window_pool_is_short():
    pool = SWATokenToKVPoolAllocator(64, 8)  # 7 SWA slots
    pool.alloc(5)
    with pytest.raises(OutOfBlocksError):
        pool.alloc(3)
    assert (pool.full_available_size, pool.swa_available_size) == (58, 2)
    pool.check_integrity()


def test_bad_frees_change_nothing():
    pool = SWATokenToKVPoolAllocator(32, 8)
    full = pool.alloc(4)
    with pytest.raises(DoubleFreeError):
        pool.free(torch.tensor([int(full[0]), 31]))  # 31 was never allocated
    with pytest.raises(InvalidIdError):
        pool.free_swa(torch.tensor([0]))  # the padding slot
    with pytest.raises(InvalidIdError):
        pool.translate_loc_from_full_to_swa([32])
    assert (pool.full_available_size, pool.swa_available_size) == (27, 3)
    pool.check_integrity()
    pool._full_to_swa[int(full[0])] = 0  # corrupt: an allocated SWA slot nobody maps to
    with pytest.raises(IntegrityError):
        pool.check_integrity()


@pytest.mark.parametrize("count", [np.int64(5), torch.tensor(5)])
def test_alloc_of_a_numpy_or_tensor_count_is_atomic_too(count):
    # 63 full slots but 4 SWA slots free: 5 tokens cannot be had, and the full pool must not lose 5 slots
    pool = SWATokenToKVPoolAllocator(64, 5)
    with pytest.raises(OutOfBlocksError):
        pool.alloc(count)
    assert (pool.full_available_size, pool.swa_available_size) == (63, 4)
    assert pool.alloc(np.int64(4)).numel() == 4 and pool.available_size == 0
    with pytest.raises(InvalidArgumentError):
        pool.alloc(True)
    assert (pool.full_available_size, pool.swa_available_size) == (59, 0)
    pool.check_integrity()

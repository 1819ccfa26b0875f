"""RecurrentStateCache: buffer shapes and bytes by hand, per-slot views that write through, zero and copy."""

from __future__ import annotations

import pytest
import torch

from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError
from kvpool.spec.state import RecurrentKind, RecurrentStateSpec
from kvpool.storage.state import RecurrentStateCache

# a GDN-like spec: layers 0, 1 and 3 recurrent, conv 64 channels x (K - 1 = 3), SSM 4 x 8 x 8
SPEC = RecurrentStateSpec(RecurrentKind.GATED_DELTA_NET, (0, 1, 3), (64, 3), (4, 8, 8), torch.bfloat16,
                          torch.float32, 4)


def filled(num_slots: int = 5) -> RecurrentStateCache:
    cache = RecurrentStateCache(SPEC, num_slots)
    torch.manual_seed(0)
    cache.conv.normal_()
    cache.ssm.normal_()
    return cache


def test_buffers_and_bytes() -> None:
    cache = RecurrentStateCache(SPEC, 5)
    assert cache.conv.shape == (3, 5, 64, 3) and cache.conv.dtype == torch.bfloat16
    assert cache.ssm.shape == (3, 5, 4, 8, 8) and cache.ssm.dtype == torch.float32
    # 5 slots x 3 layers x (64 x 3 x 2 B + 4 x 8 x 8 x 4 B) = 5 x 3 x (384 + 1024)
    assert cache.nbytes == 5 * 3 * (64 * 3 * 2 + 4 * 8 * 8 * 4) == 5 * SPEC.bytes_per_request
    assert not cache.conv.any() and not cache.ssm.any()  # a fresh cache holds zero states
    short_spec = RecurrentStateSpec(RecurrentKind.SHORT_CONV, (1,), (8, 2), (), conv_kernel=3)
    short = RecurrentStateCache(short_spec, 2)
    assert short.ssm is None and short.nbytes == 2 * 8 * 2 * 2
    with pytest.raises(InvalidArgumentError, match="no SSM state"):
        short.ssm_state(1)
    with pytest.raises(ConfigError):
        RecurrentStateCache(SPEC, 0)


def test_views_write_through() -> None:
    cache = RecurrentStateCache(SPEC, 5)
    view = cache.conv_view(3, 2)
    assert view.shape == (1, 64, 3) and view.is_contiguous()
    view.fill_(1.5)  # what causal_conv1d_update's conv_state.copy_ does in a decode step
    assert (cache.conv_state(3)[2] == 1.5).all() and cache.conv[2, 2].eq(1.5).all()
    assert not cache.conv_state(3)[[0, 1, 3, 4]].any() and not cache.conv_state(1).any()
    ssm = cache.ssm_view(0, 4)
    ssm.copy_(torch.ones(1, 4, 8, 8))
    assert cache.ssm[0, 4].eq(1).all() and cache.ssm.sum() == 4 * 8 * 8
    with pytest.raises(InvalidArgumentError, match="layer 2"):
        cache.conv_view(2, 0)  # an attention layer
    with pytest.raises(InvalidIdError):
        cache.ssm_view(0, 5)
    with pytest.raises(InvalidIdError):
        cache.conv_view(0, True)


def test_zero_slots() -> None:
    cache = filled()
    before_conv, before_ssm = cache.conv.clone(), cache.ssm.clone()
    cache.zero_slots([1, 3])
    for slot in range(5):
        zeroed = slot in (1, 3)
        assert bool((cache.conv[:, slot] == 0).all()) == zeroed
        assert torch.equal(cache.ssm[:, slot], torch.zeros_like(before_ssm[:, slot]) if zeroed
                           else before_ssm[:, slot])
    assert torch.equal(cache.conv[:, 0], before_conv[:, 0])
    snapshot = cache.conv.clone()
    with pytest.raises(InvalidIdError):
        cache.zero_slots([0, 5])
    assert torch.equal(cache.conv, snapshot)


def test_copy_slots_reads_before_writing() -> None:
    cache = filled()
    conv, ssm = cache.conv.clone(), cache.ssm.clone()
    cache.copy_slots([(1, 2), (2, 1), (0, 4)])  # swap 1 and 2, copy 0 over 4
    for src, dst in ((1, 2), (2, 1), (0, 4), (0, 0), (3, 3)):
        assert torch.equal(cache.conv[:, dst], conv[:, src]) and torch.equal(cache.ssm[:, dst], ssm[:, src])
    snapshot = cache.ssm.clone()
    with pytest.raises(InvalidIdError):
        cache.copy_slots([(0, 1), (2, 1)])  # destination named twice
    with pytest.raises(InvalidIdError):
        cache.copy_slots(torch.tensor([[0, 9]]))
    with pytest.raises(InvalidArgumentError):  # not pairs: the same rule as a KV cache's copy_blocks
        cache.copy_slots(torch.tensor([0, 1]))
    with pytest.raises(InvalidIdError):  # a float id is refused, never truncated to slot 1
        cache.copy_slots([(1.7, 3)])
    assert torch.equal(cache.ssm, snapshot)
    cache.copy_slots([])

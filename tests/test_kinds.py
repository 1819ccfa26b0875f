"""The memory kinds (``kvpool.spec.kinds``): each kind's rules against a brute-force model built from what a
query reads, so the formulas (skipped blocks, when they move, the most blocks a request holds, the hit rule,
the window a query reads, the paged kernel's bounds) are derived independently of the code under test.

What a query at position q reads, from the definitions (transformers' masking_utils): full attention every
key ``t <= q``; a sliding window W the keys with ``q - W < t <= q`` (``sliding_window_overlay``); chunks of C
the keys with ``C * (q // C) <= t <= q`` (``chunked_overlay``).
"""

from __future__ import annotations

import functools
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import ConfigError
from kvpool.spec import KVCacheSpec, LayerKind, kv_cache_groups
from kvpool.spec.kinds import (
    ATTENTION_KINDS,
    NEVER,
    ChunkedLocal,
    FullAttention,
    MemoryKind,
    RecurrentState,
    SlidingWindow,
    attention_kind,
)

B = 4
KINDS = [FullAttention(), SlidingWindow(5), SlidingWindow(8), SlidingWindow(1), ChunkedLocal(8),
         ChunkedLocal(16)]


def reads(kind: MemoryKind, q: int, t: int) -> bool:
    """Whether the query at q reads key t (the module docstring's definitions, not the kind's code)."""
    if t > q:
        return False
    if isinstance(kind, SlidingWindow):
        return t > q - kind.window
    if isinstance(kind, ChunkedLocal):
        return t >= kind.window * (q // kind.window)
    return True


@functools.cache
def brute_skipped(kind: MemoryKind, n: int, horizon: int = 40) -> int:
    """Leading blocks no query at q >= n reads (queries up to ``n + horizon`` are enough for these windows,
    all under 40 tokens)."""
    b = 0
    while b * B < n and not any(reads(kind, q, t) for q in range(n, n + horizon)
                                for t in range(b * B, b * B + B)):
        b += 1
    return b


@pytest.mark.parametrize("kind", KINDS, ids=repr)
def test_skipped_blocks_are_the_blocks_no_later_query_reads(kind: MemoryKind) -> None:
    for n in range(0, 60):
        assert kind.skipped_blocks(n, B) == brute_skipped(kind, n), n


@pytest.mark.parametrize("kind", KINDS, ids=repr)
def test_skip_moves_at_the_first_count_that_skips_more(kind: MemoryKind) -> None:
    for dead in range(0, 10):
        moves = kind.skip_moves_at(dead, B)
        first = next((n for n in range(0, 200) if kind.skipped_blocks(n, B) > dead), NEVER)
        assert moves == first, dead


def brute_max_blocks(kind: MemoryKind, n: int, chunk: int) -> int:
    """A request of n tokens computing at most ``chunk`` tokens per step, its skipped blocks freed before
    each step: the most blocks it holds at once, over every schedule (a step may start at any s < n, after
    steps of one token): the blocks from the first not skipped at s to the step's end."""
    return max(-(-min(n, s + chunk) // B) - brute_skipped(kind, s) for s in range(n))


@pytest.mark.parametrize("kind", KINDS, ids=repr)
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_max_blocks_is_the_peak_of_a_request_run_step_by_step(kind: MemoryKind, chunk: int) -> None:
    for n in range(1, 70):
        assert kind.max_blocks(n, B, chunk) == brute_max_blocks(kind, n, chunk), n


@pytest.mark.parametrize("kind", KINDS, ids=repr)
def test_steady_blocks_is_what_a_long_request_holds(kind: MemoryKind) -> None:
    # a request far past any window holds max_blocks of a long one; a full group keeps growing: one block
    expected = 1 if isinstance(kind, FullAttention) else brute_max_blocks(kind, 150, 3)
    assert kind.steady_blocks(3, B) == expected


@pytest.mark.parametrize("kind", KINDS, ids=repr)
def test_window_start_is_the_first_key_read(kind: MemoryKind) -> None:
    for q in range(0, 50):
        assert kind.window_start(q) == min(t for t in range(q + 1) if reads(kind, q, t))
    assert kind.window_starts(3, 9) == [kind.window_start(q) for q in range(3, 9)]


def brute_hit(kind: MemoryKind, bound: int, cached: set[int]) -> int:
    """The longest k <= bound whose needed blocks are all cached: every block the last query of the prefix
    (position kB - 1) and every later one may read; for a recurrent state only the checkpoint at k."""
    for k in range(bound, 0, -1):
        if isinstance(kind, RecurrentState):
            needed = {k - 1}
        else:
            needed = {b for b in range(k) if not b < brute_skipped(kind, k * B)}
        if needed <= cached:
            return k
    return 0


@given(st.sampled_from([*KINDS, RecurrentState()]), st.integers(0, 12), st.sets(st.integers(0, 11)))
def test_longest_hit_is_the_longest_restorable_prefix(kind: MemoryKind, bound: int, cached: set[int]) -> None:
    asked: list[int] = []

    def is_cached(i: int) -> bool:
        asked.append(i)
        return i in cached

    assert kind.longest_hit(bound, B, is_cached) == brute_hit(kind, bound, cached)
    assert len(asked) == len(set(asked)) <= bound  # each block asked at most once: O(bound)


def test_a_full_hit_asks_only_up_to_the_first_miss() -> None:
    asked: list[int] = []
    assert FullAttention().longest_hit(10, B, lambda i: asked.append(i) or i < 3) == 3
    assert asked == [0, 1, 2, 3]


def test_the_recurrent_state_holds_one_slot_and_frees_nothing() -> None:
    state = RecurrentState()
    assert [state.max_blocks(n, B, 8) for n in (1, 100, 10_000)] == [1, 1, 1]
    assert state.skipped_blocks(1000, B) == 0 and state.skip_moves_at(0, B) == NEVER
    assert not state.frees_blocks and not state.needs_whole_prefix


def test_the_paged_kernel_bounds_and_the_model_window() -> None:
    # the kernel's (window, chunk) arguments; transformers' attention passes sliding_window=W on sliding
    # layers
    assert [k.kernel_bounds() for k in (FullAttention(), SlidingWindow(5), ChunkedLocal(8))] == \
        [(0, 0), (5, 0), (0, 8)]
    assert [k.model_sliding_window for k in (FullAttention(), SlidingWindow(5), ChunkedLocal(8))] == \
        [None, 5, None]


def test_event_metadata_is_vllms() -> None:
    # vLLM 0.33's KVCacheSpecKind values (vllm/v1/kv_cache_interface.py), and the window only for sliding
    kinds = (FullAttention(), SlidingWindow(5), ChunkedLocal(8), RecurrentState())
    assert [(k.event_name, k.event_window) for k in kinds] == [
        ("full_attention", None), ("sliding_window", 5), ("chunked_local_attention", None), ("mamba", None)]


def test_names_describe_and_values() -> None:
    assert [k.describe() for k in (FullAttention(), SlidingWindow(1024), ChunkedLocal(8192))] == [
        "full_attention", "sliding_attention (window 1024)", "chunked_attention (chunk 8192)"]
    assert SlidingWindow(5) == SlidingWindow(5) != SlidingWindow(6) != ChunkedLocal(6)
    assert len({SlidingWindow(5), SlidingWindow(5), FullAttention(), FullAttention(7)}) == 2
    for kind in (*KINDS, RecurrentState()):
        assert pickle.loads(pickle.dumps(kind)) == kind


def test_every_layer_kind_has_its_class() -> None:
    assert set(ATTENTION_KINDS) == {k.value for k in LayerKind}
    assert attention_kind("sliding_attention", 7) == SlidingWindow(7)
    assert attention_kind(LayerKind.FULL) == FullAttention()
    with pytest.raises(ConfigError, match="unknown layer type 'linear'"):
        attention_kind("linear", 4)
    with pytest.raises(ConfigError, match="needs a window"):
        attention_kind("chunked_attention")


def test_a_group_carries_its_kind() -> None:
    spec = KVCacheSpec.from_hf_config("gemma-3-1b", block_size=16)
    assert {g.memory_kind for g in spec.groups} == {SlidingWindow(512), FullAttention()}
    (group,) = kv_cache_groups([LayerKind.CHUNKED], {LayerKind.CHUNKED: 64}, 16)
    assert group.memory_kind == ChunkedLocal(64) and group.skipped_blocks(130) == 8  # 64 * 2 // 16
    with pytest.raises(ConfigError, match="needs a window"):
        kv_cache_groups([LayerKind.SLIDING], {}, 16)

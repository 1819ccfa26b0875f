"""Pinned behaviour of TokenToKVPoolAllocator; every expected value is worked out by hand in the test.

Numbering used throughout: a pool of ``size`` slots has pages ``0 .. size // page_size - 1``; page 0 is the
padding page, so the allocatable pages are ``1 ..``. A fresh pool hands pages out in ascending order.
"""

import pytest
import torch

from kvpool.allocators.token import AllocatorState, TokenToKVPoolAllocator
from kvpool.errors import DoubleFreeError, InvalidArgumentError, InvalidIdError, KVPoolError, OutOfBlocksError


def ids(t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int64
    return t.tolist()


# ------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize(("size", "page_size"), [(1, 1), (0, 1), (-4, 1), (10, 4), (4, 4), (8, 0), (8.0, 1)])
def test_bad_construction(size, page_size):
    with pytest.raises(InvalidArgumentError):
        TokenToKVPoolAllocator(size, page_size=page_size)


def test_sizes():
    a = TokenToKVPoolAllocator(64, page_size=16)    # pages 0..3, page 0 padding
    assert (a.num_pages, a.num_free_pages, a.available_size) == (4, 3, 48)


# ------------------------------------------------------------------------------ padding slot, clear()
def test_padding_slot_never_returned_even_after_clear():
    a = TokenToKVPoolAllocator(8)                    # slots 0..7, slot 0 is padding: 7 usable
    for _ in range(3):
        got = ids(a.alloc(3)) + ids(a.alloc(1)) + ids(a.alloc(3))
        assert sorted(got) == [1, 2, 3, 4, 5, 6, 7]
        with pytest.raises(OutOfBlocksError):
            a.alloc(1)
        a.clear()
        assert a.available_size == 7
        a.check_integrity()


def test_padding_page_never_returned_paged():
    a = TokenToKVPoolAllocator(16, page_size=4)      # pages 1..3 = slots 4..15
    for _ in range(2):
        assert sorted(ids(a.alloc(12))) == list(range(4, 16))
        a.clear()


@pytest.mark.parametrize("page_size", [1, 4])
def test_freeing_padding_slot_raises(page_size):
    a = TokenToKVPoolAllocator(16, page_size=page_size)
    a.alloc(4)
    for bad in ([0], [0, 5], [page_size - 1]):
        with pytest.raises(InvalidIdError):
            a.free(torch.tensor(bad))
    assert a.available_size == 16 - page_size - 4
    a.check_integrity()


# ----------------------------------------------------------------------------------- double free
@pytest.mark.parametrize("page_size", [1, 4])
def test_double_free_raises_and_available_unchanged(page_size):
    a = TokenToKVPoolAllocator(32, page_size=page_size)
    x, y = a.alloc(8), a.alloc(8)
    a.free(x)
    before = a.available_size
    with pytest.raises(DoubleFreeError):
        a.free(x)                                    # bulk path
    with pytest.raises(DoubleFreeError):
        a.free(x[:1])                                # single-id path
    with pytest.raises(DoubleFreeError):
        a.free(torch.cat([y, x]))                    # half valid: nothing of y is freed either
    assert a.available_size == before
    a.free(y)
    assert a.available_size == 32 - page_size
    a.check_integrity()


def test_repeated_slot_in_one_call_raises():
    a = TokenToKVPoolAllocator(16)
    x = a.alloc(3)
    with pytest.raises(InvalidIdError):
        a.free(torch.cat([x, x[:1]]))
    assert a.available_size == 12
    a.free(x)


@pytest.mark.parametrize("bad", [[-1], [16], [3, -2], [3, 99], [2**40]])
def test_out_of_range_raises(bad):
    a = TokenToKVPoolAllocator(16, page_size=2)
    a.alloc(14)
    with pytest.raises(InvalidIdError):
        a.free(torch.tensor(bad))
    assert a.available_size == 0
    a.check_integrity()


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.tensor([True]), [1.5]])
def test_non_integer_ids_raise(bad):
    a = TokenToKVPoolAllocator(8)
    a.alloc(7)
    with pytest.raises(InvalidArgumentError):
        a.free(bad)
    assert a.available_size == 0


def test_free_accepts_lists_ints_and_other_int_dtypes():
    a = TokenToKVPoolAllocator(8)
    a.alloc(7)                                       # slots 1..7
    a.free(3)
    a.free([1, 2])
    a.free(torch.tensor([[4, 5]], dtype=torch.int32))
    a.free([])
    assert a.available_size == 5
    a.check_integrity()


# ----------------------------------------------------------------------------------- alloc errors
def test_alloc_bad_counts():
    a = TokenToKVPoolAllocator(32, page_size=4)
    for bad in (-1, 3, 2.0, True):
        with pytest.raises(InvalidArgumentError):
            a.alloc(bad)
    assert a.alloc(0).tolist() == []
    with pytest.raises(OutOfBlocksError):
        a.alloc(32)                                  # 7 pages = 28 slots are allocatable
    assert a.available_size == 28
    assert len(a.alloc(28)) == 28


def test_out_of_blocks_is_atomic():
    a = TokenToKVPoolAllocator(8)
    a.alloc(5)
    with pytest.raises(OutOfBlocksError):
        a.alloc(3)                                   # 2 free
    assert a.available_size == 2
    assert sorted(ids(a.alloc(2))) == [6, 7]
    a.check_integrity()


# --------------------------------------------------------------------------------- fragmentation
def test_fragmented_pool_satisfies_alloc():
    # The case: an 8-slot pool whose slots {0,1} and {4,5} are free. Slot 0 is our padding slot, so
    # the 8 allocatable slots are ids 1..8 (size 9) and the slot i is our id i + 1.
    a = TokenToKVPoolAllocator(9)
    assert ids(a.alloc(8)) == [1, 2, 3, 4, 5, 6, 7, 8]
    a.free(torch.tensor([1, 2, 5, 6]))               # issue slots {0,1} and {4,5}
    with pytest.raises(OutOfBlocksError):
        a.alloc_contiguous(4)                        # the longest free run is 2
    assert a.available_size == 4
    assert sorted(ids(a.alloc(4))) == [1, 2, 5, 6]
    assert a.available_size == 0
    a.check_integrity()


def test_fragmented_paged_pool():
    a = TokenToKVPoolAllocator(18, page_size=2)      # 8 allocatable pages 1..8 = slots 2..17
    a.alloc(16)
    a.free(torch.tensor([2, 4, 10, 12]))             # one slot each of pages 1, 2, 5, 6
    got = ids(a.alloc(8))
    assert sorted(got) == [2, 3, 4, 5, 10, 11, 12, 13]


def test_alloc_contiguous_first_fit():
    a = TokenToKVPoolAllocator(16)
    a.alloc(15)                                      # 1..15
    a.free(torch.tensor([2, 3, 7, 8, 9, 12, 13, 14, 15]))
    assert ids(a.alloc_contiguous(3)) == [7, 8, 9]   # runs: 2-3, 7-9, 12-15
    assert ids(a.alloc_contiguous(2)) == [2, 3]
    assert ids(a.alloc_contiguous(4)) == [12, 13, 14, 15]
    assert a.available_size == 0
    a.check_integrity()


def test_alloc_contiguous_paged_and_errors():
    a = TokenToKVPoolAllocator(32, page_size=4)      # pages 1..7
    with pytest.raises(InvalidArgumentError):
        a.alloc_contiguous(6)
    assert ids(a.alloc_contiguous(8)) == list(range(4, 12))
    with pytest.raises(OutOfBlocksError):
        a.alloc_contiguous(24)                       # 5 pages free (12..31), 6 needed
    assert a.available_size == 20
    assert ids(a.alloc_contiguous(20)) == list(range(12, 32))
    a.check_integrity()


# ------------------------------------------------------------------ reserve for a queued request
@pytest.mark.parametrize("page_size", [1, 4])
def test_reserve_and_abort_100_times_ends_all_free(page_size):
    a = TokenToKVPoolAllocator(11 * page_size, page_size=page_size)  # 10 allocatable pages
    running = a.alloc(3 * page_size)
    for _ in range(100):
        queued = a.alloc(4 * page_size)              # reserved for a queued request ...
        assert a.num_free_pages == 3
        a.free(queued)                               # ... which is aborted
    a.free(running)
    assert a.num_free_pages == 10
    a.check_integrity()


# ------------------------------------------------------------------------------- paged alloc paths
def test_alloc_extend_fills_partial_page_then_new_pages():
    a = TokenToKVPoolAllocator(64, page_size=4)      # pages 1..15, handed out 1, 2, 3, ...
    first = a.alloc_extend([0], [6], [-1])           # tokens 0..5: page 1 (4..7), page 2 (8, 9)
    assert ids(first) == [4, 5, 6, 7, 8, 9]
    # tokens 6..12: 6, 7 fill page 2 (10, 11); 8..11 take page 3 (12..15); 12 starts page 4 (16)
    assert ids(a.alloc_extend([6], [13], [9])) == [10, 11, 12, 13, 14, 15, 16]
    assert a.num_free_pages == 11
    a.check_integrity()


def test_alloc_extend_batch():
    a = TokenToKVPoolAllocator(64, page_size=4)
    a.alloc_extend([0], [2], [-1])                   # request A: tokens 0, 1 in page 1 (slots 4, 5)
    # A extends 2..8 (6, 7 in page 1; page 2 = 8..11 for 4..7; page 3 slot 12 for 8);
    # B is new with 3 tokens (page 4 = 16, 17, 18); C extends from 4 (page aligned) by 0 tokens.
    out = a.alloc_extend([2, 0, 4], [9, 3, 4], [5, -1, 123])
    assert ids(out) == [6, 7, 8, 9, 10, 11, 12, 16, 17, 18]
    assert a.num_free_pages == 15 - 4


def test_alloc_decode_takes_a_page_only_when_full():
    a = TokenToKVPoolAllocator(64, page_size=4)
    a.alloc_extend([0, 0], [3, 4], [-1, -1])         # A: 4, 5, 6 (page 1); B: 8..11 (page 2)
    # A's token 3 goes to slot 7; B's token 4 opens page 3 (slot 12)
    assert ids(a.alloc_decode([4, 5], [6, 11])) == [7, 12]
    # A's token 4 opens page 4 (16); B's token 5 follows slot 12
    assert ids(a.alloc_decode([5, 6], [7, 12])) == [16, 13]
    assert a.num_free_pages == 15 - 4
    a.check_integrity()


@pytest.mark.parametrize(("pre", "seq", "last"), [
    ([-1], [3], [-1]),      # negative prefix
    ([5], [4], [8]),        # seq < prefix
    ([2], [5], [6]),        # slot 6 is offset 2, token 1 needs offset 1
    ([2], [5], [21]),       # offset 1 but page 5 is not allocated
    ([2], [5], [-3]),       # out of range
    ([2, 0], [5], [5]),     # lengths differ
])
def test_alloc_extend_rejects_inconsistent_input(pre, seq, last):
    a = TokenToKVPoolAllocator(64, page_size=4)
    a.alloc_extend([0], [2], [-1])                   # slots 4, 5 (page 1)
    with pytest.raises(InvalidArgumentError):
        a.alloc_extend(pre, seq, last)
    assert a.num_free_pages == 14
    a.check_integrity()


def test_alloc_decode_rejects_bad_input_and_out_of_blocks():
    a = TokenToKVPoolAllocator(16, page_size=4)      # pages 1..3
    a.alloc_extend([0, 0], [4, 4], [-1, -1])         # pages 1, 2 full
    with pytest.raises(InvalidArgumentError):
        a.alloc_decode([0], [7])
    with pytest.raises(InvalidArgumentError):
        a.alloc_decode([6], [7])                     # token 4 is at slot 12 or beyond, not after 7
    with pytest.raises(OutOfBlocksError):
        a.alloc_decode([5, 5], [7, 11])              # both open a page, 1 free
    assert a.num_free_pages == 1
    assert ids(a.alloc_decode([5], [7])) == [12]


@pytest.mark.parametrize(("pre", "seq", "last"), [
    ([2, 2], [3, 4], [5, 5]),        # both continue slot 5: both would get slot 6
    ([2, 3], [4, 4], [5, 6]),        # A after slot 5 (6, 7), B after slot 6 (7): slot 7 twice
    ([2, 0, 2], [3, 2, 5], [5, -1, 5]),  # a new request between them does not hide it
])
def test_alloc_extend_refuses_two_rows_continuing_one_partial_page(pre, seq, last):
    """Issue 9, item 5: rows that continue the same partial page were handed the same slots."""
    a = TokenToKVPoolAllocator(64, page_size=4)
    a.alloc_extend([0], [2], [-1])                   # tokens 0, 1: slots 4, 5 of page 1
    before = (a.num_free_pages, ids(a.free_pages()))
    with pytest.raises(InvalidArgumentError, match="both continue page 1"):
        a.alloc_extend(pre, seq, last)
    assert (a.num_free_pages, ids(a.free_pages())) == before
    a.check_integrity()


def test_alloc_decode_refuses_two_rows_continuing_one_partial_page():
    a = TokenToKVPoolAllocator(64, page_size=4)
    a.alloc_extend([0], [2], [-1])                   # slots 4, 5 (page 1)
    with pytest.raises(InvalidArgumentError, match="requests 0 and 1 both continue page 1"):
        a.alloc_decode([3, 3], [5, 5])               # both would get slot 6
    assert a.num_free_pages == 14
    # two rows whose new tokens open pages, or continue different pages, are fine
    a.alloc_extend([0], [2], [-1])                   # slots 8, 9 (page 2)
    assert ids(a.alloc_decode([3, 3], [5, 9])) == [6, 10]
    a.check_integrity()


def test_page_size_one_ignores_last_loc():
    a = TokenToKVPoolAllocator(16)
    assert ids(a.alloc_extend([3, 0], [5, 1], [99, -7])) == [1, 2, 3]
    assert ids(a.alloc_decode([4, 2], [-1, -1])) == [4, 5]
    with pytest.raises(InvalidArgumentError):
        a.alloc_extend([3], [2], [0])


# -------------------------------------------------------------------------------------- paged free
def test_freeing_tail_from_mid_page_releases_that_page_once():
    a = TokenToKVPoolAllocator(32, page_size=4)
    req = a.alloc_extend([0], [10], [-1])            # pages 1, 2, 3: slots 4..11, 12, 13
    a.free(req[6:])                                  # tokens 6.. = slots 10, 11, 12, 13: pages 2 and 3
    assert a.num_free_pages == 7 - 1
    with pytest.raises(DoubleFreeError):
        a.free(req[5:6])                             # slot 9 lives in page 2, already released
    with pytest.raises(DoubleFreeError):
        a.free(req[4:])                              # page 2 again, whole
    assert a.num_free_pages == 6
    a.check_integrity()
    assert sorted(ids(a.alloc(24))) == list(range(8, 32))  # every page exactly once


def test_free_group_batches_and_does_not_nest():
    a = TokenToKVPoolAllocator(16)
    x, y = a.alloc(3), a.alloc(3)
    a.free_group_begin()
    assert a.in_free_group
    with pytest.raises(InvalidArgumentError):
        a.free_group_begin()
    a.free(x)
    a.free(y[:1])
    assert a.available_size == 9                     # pending until the end
    a.free_group_end()
    assert a.available_size == 13
    with pytest.raises(InvalidArgumentError):
        a.free_group_end()
    a.check_integrity()


def test_free_group_with_a_bad_free_releases_nothing():
    a = TokenToKVPoolAllocator(16)
    x = a.alloc(3)
    a.free_group_begin()
    a.free(x)
    a.free(x[:1])                                    # the same slot twice in one batch
    with pytest.raises(InvalidIdError):
        a.free_group_end()
    assert not a.in_free_group
    assert a.available_size == 12
    a.free(x)
    assert a.available_size == 15


def test_free_group_copies_ids():
    a = TokenToKVPoolAllocator(16)
    x = a.alloc(2)
    a.free_group_begin()
    a.free(x)
    x[:] = 0                                         # the caller reuses its tensor
    a.free_group_end()
    assert a.available_size == 15


# ------------------------------------------------------------------------------- backup / restore
def test_restore_after_allocs_returns_the_same_slots():
    a = TokenToKVPoolAllocator(32)
    a.alloc(5)
    state = a.backup_state()
    assert isinstance(state, AllocatorState) and state.available_size == 26
    draft = ids(a.alloc(4))
    a.restore_state(state)
    assert a.available_size == 26
    assert ids(a.alloc(4)) == draft                  # the same slots are free again
    a.restore_state(state)                           # repeatable
    assert a.available_size == 26
    a.check_integrity()


def test_restore_after_frees_and_allocs_reverts_both():
    a = TokenToKVPoolAllocator(16, page_size=2)      # pages 1..7
    held = a.alloc(6)                                # pages 1, 2, 3
    state = a.backup_state()
    a.free(held[:2])                                 # page 1 freed after the backup
    a.alloc(8)                                       # dips into the backed-up free pages
    a.free(held[2:4])                                # a free writes into that region
    a.restore_state(state)
    assert a.num_free_pages == 4
    with pytest.raises(DoubleFreeError):
        a.free(torch.tensor([8]))                    # page 4 was free at backup
    a.free(held)                                     # pages 1..3 are allocated again
    assert a.num_free_pages == 7
    a.check_integrity()


def test_restore_after_clear_and_stale_states():
    a = TokenToKVPoolAllocator(16)
    a.alloc(10)
    old = a.backup_state()
    new = a.backup_state()
    a.clear()
    with pytest.raises(InvalidArgumentError):
        a.restore_state(old)
    a.restore_state(new)
    assert a.available_size == 5
    a.free_group_begin()
    with pytest.raises(InvalidArgumentError):
        a.backup_state()
    with pytest.raises(InvalidArgumentError):
        a.restore_state(new)
    a.free_group_end()
    a.check_integrity()


def test_errors_are_kvpool_errors():
    for cls in (DoubleFreeError, InvalidArgumentError, InvalidIdError, OutOfBlocksError):
        assert issubclass(cls, KVPoolError)


# ---- regressions: int64 overflow in alloc_extend, inputs that are not ids, an unusable device ------------

@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seq_lens", [[2**63 - 1], [2**63 - 1, 2**63 - 1], [2**62, 2**62]])
def test_alloc_extend_of_a_huge_length_is_out_of_blocks(page_size, seq_lens):
    a = TokenToKVPoolAllocator(64, page_size=page_size)
    a.alloc(4 * page_size)
    free = ids(a.free_pages())
    with pytest.raises(OutOfBlocksError):
        a.alloc_extend([0] * len(seq_lens), seq_lens, [-1] * len(seq_lens))
    assert ids(a.free_pages()) == free
    a.check_integrity()


@pytest.mark.parametrize("bad", [None, "ab", [[1], [2, 3]], 2**70, [1, 2**70]])
def test_free_of_what_is_not_ids_is_an_invalid_argument(bad):
    a = TokenToKVPoolAllocator(16)
    a.alloc(4)
    free = ids(a.free_pages())
    with pytest.raises(InvalidArgumentError):
        a.free(bad)
    assert ids(a.free_pages()) == free


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "bogus"])
def test_an_unusable_device_fails_at_construction(device):
    with pytest.raises(InvalidArgumentError):
        TokenToKVPoolAllocator(16, device=device)


def test_freeing_one_pages_slots_takes_the_one_page_path_with_the_same_checks():
    a = TokenToKVPoolAllocator(64, page_size=4)      # pages 1..15
    slots = a.alloc(8)                               # pages 1, 2: slots 4..11
    bad_frees = (([4, 5, -1], InvalidIdError), ([4, 5, 64], InvalidIdError),
                 ([12, 13], DoubleFreeError))        # page 3 (slots 12, 13) was never handed out
    for bad, error in bad_frees:
        with pytest.raises(error):
            a.free(bad)
        assert a.num_free_pages == 13
    a.free(slots[:4].flip(0))                        # page 1's four slots, any order: page 1 once
    assert a.num_free_pages == 14 and ids(a.free_pages())[0] == 1
    with pytest.raises(DoubleFreeError):
        a.free([5, 6])
    a.free(torch.tensor([9, 9, 8]))                  # page 2, a slot repeated: released once


# ------------------------------------------------------------------ one page without a torch op
class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ATen ops run inside it (a slice, a copy, an index write: every torch op)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("page_size", [1, 16])
def test_one_page_pairs_run_no_torch_op_once_warm(page_size):
    # the bound: alloc(1) + free(1) with at most one torch call; once every page has its view, none
    a = TokenToKVPoolAllocator(64 * page_size, page_size=page_size)
    for x in [a.alloc(page_size) for _ in range(8)]:
        a.free(x)
    with _CountOps() as counted:
        held = [a.alloc(page_size) for _ in range(8)]
        for x in held:
            a.free(x)
    assert counted.ops == []
    # the stack is LIFO: the 8 pages come back in the order they were freed, 8 first
    assert [int(x[0]) // page_size for x in held] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert [x.tolist() for x in held[:1]] == [list(range(8 * page_size, 9 * page_size))]
    a.check_integrity()
    assert a.num_free_pages == 63


def test_a_write_into_a_returned_view_is_read_by_value_and_the_ids_are_rebuilt():
    a = TokenToKVPoolAllocator(16)
    x, y = a.alloc(1), a.alloc(1)                   # slots 1 and 2
    assert (int(x), int(y)) == (1, 2)
    x.fill_(2)                                      # the caller's tensor now names slot 2
    a.free(x)                                       # read by value: slot 2 is freed, slot 1 stays held
    with pytest.raises(DoubleFreeError):
        a.free(y)                                   # y's slot 2 is free already
    assert a.alloc(1).tolist() == [2]               # rebuilt ids: the value is the slot, not a stale 2
    assert a.alloc(1).tolist() == [3]
    a.free(torch.tensor([1]))
    a.check_integrity()
    assert a.num_free_pages == 15 - 2


def test_freed_view_is_checked_like_any_id():
    a = TokenToKVPoolAllocator(16)
    x = a.alloc(1)
    a.free(x)
    with pytest.raises(DoubleFreeError):
        a.free(x)                                   # the same view twice: slot 1 is free
    a.free_group_begin()
    y = a.alloc(1)
    a.free(y)                                       # inside a group: collected, released at the end
    assert a.num_free_pages == 14
    a.free_group_end()
    assert a.num_free_pages == 15
    a.check_integrity()

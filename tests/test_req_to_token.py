"""ReqToTokenPool: row alloc/free rules, the table dtype, read/write, and the documented release order."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.allocators.req_to_token import ReqToTokenPool
from kvpool.allocators.token import TokenToKVPoolAllocator
from kvpool.errors import DoubleFreeError, InvalidArgumentError, InvalidIdError, OutOfBlocksError


@pytest.mark.parametrize(("num_slots", "dtype"), [
    (None, torch.int32),
    (2**31, torch.int32),        # largest slot id 2**31 - 1 still fits int32
    (2**31 + 1, torch.int64),    # slot id 2**31 does not
])
def test_table_dtype_follows_slot_count(num_slots, dtype):
    pool = ReqToTokenPool(4, 8, num_slots=num_slots)
    assert pool.req_to_token.dtype == dtype
    assert pool.req_to_token.shape == (4, 8)


@pytest.mark.parametrize("args", [(0, 8), (4, 0), (-1, 8), (4, 8.0), (True, 8)])
def test_bad_construction(args):
    with pytest.raises(InvalidArgumentError):
        ReqToTokenPool(*args)
    with pytest.raises(InvalidArgumentError):
        ReqToTokenPool(4, 8, num_slots=0)


def test_alloc_and_free_rules():
    pool = ReqToTokenPool(4, 8)
    assert pool.alloc(3) == [0, 1, 2]
    with pytest.raises(OutOfBlocksError):
        pool.alloc(2)
    with pytest.raises(InvalidArgumentError):
        pool.alloc(-1)
    assert pool.alloc(0) == []
    for bad, error in (([4], InvalidIdError), ([-1], InvalidIdError), ([1, 1], InvalidIdError),
                       ([3], DoubleFreeError), ([0, 3], DoubleFreeError), ([1.0], InvalidArgumentError)):
        with pytest.raises(error):
            pool.free(bad)
        assert pool.available_size == 1            # nothing changed
    pool.free([2, 0])
    pool.free(torch.tensor([1]))
    assert pool.available_size == 4
    with pytest.raises(DoubleFreeError):
        pool.free(1)
    pool.check_integrity()


def test_write_read_copy():
    pool = ReqToTokenPool(2, 6)
    (row,) = pool.alloc(1)
    pool.write(row, torch.tensor([7, 8, 9]))
    pool.write(row, [10], start=3)
    got = pool.read(row, 4)
    assert got.dtype == torch.int64 and got.tolist() == [7, 8, 9, 10]
    pool.write(row, [0, 0, 0, 0])
    assert got.tolist() == [7, 8, 9, 10]           # a copy, not a view of the reused row
    assert pool.read(row, 3, start=1).tolist() == [0, 0]
    with pytest.raises(InvalidArgumentError):
        pool.write(row, [1, 2], start=5)           # past max_context_len
    with pytest.raises(InvalidArgumentError):
        pool.write(row, [2**31])                   # does not fit the int32 table
    with pytest.raises(InvalidArgumentError):
        pool.read(row, 2, start=3)
    with pytest.raises(InvalidIdError):
        pool.read(1 - row, 1)                      # not allocated


def test_wide_table_holds_large_slot_ids():
    pool = ReqToTokenPool(1, 2, num_slots=2**33)
    (row,) = pool.alloc()
    pool.write(row, [2**32 + 5])
    assert pool.read(row, 1).tolist() == [2**32 + 5]


def test_queued_request_aborted_100_times_ends_all_free():
    # A 10-slot KV pool (size 11: slot 0 is padding) and 2 request rows. A running request holds 3 slots;
    # a queued one reserves a row and 4 slots, is aborted, and is released in the documented order.
    kv, rows = TokenToKVPoolAllocator(11), ReqToTokenPool(2, 16)
    (run_row,) = rows.alloc()
    rows.write(run_row, kv.alloc(3))
    for _ in range(100):
        (row,) = rows.alloc()
        rows.write(row, kv.alloc(4))
        assert (kv.available_size, rows.available_size) == (3, 0)
        slots = rows.read(row, 4)                  # 1. copy the row's slot ids
        kv.free(slots)                             # 2. free the KV slots
        rows.free(row)                             # 3. free the row
    kv.free(rows.read(run_row, 3))
    rows.free(run_row)
    assert (kv.available_size, rows.available_size) == (10, 2)
    kv.check_integrity()
    rows.check_integrity()


class ReqToTokenMachine(RuleBasedStateMachine):
    """Rows against a set model; every error path predicted from the model."""

    ROWS = 6

    def __init__(self) -> None:
        super().__init__()
        self.pool = ReqToTokenPool(self.ROWS, 4)
        self.used: set[int] = set()

    @rule(n=st.integers(-1, 7))
    def alloc(self, n: int) -> None:
        if n < 0:
            with pytest.raises(InvalidArgumentError):
                self.pool.alloc(n)
        elif n > self.ROWS - len(self.used):
            with pytest.raises(OutOfBlocksError):
                self.pool.alloc(n)
        else:
            rows = self.pool.alloc(n)
            assert len(set(rows)) == n and not set(rows) & self.used
            self.used |= set(rows)

    @rule(rows=st.lists(st.integers(-1, 6), max_size=4))
    def free(self, rows: list[int]) -> None:
        if any(not 0 <= r < self.ROWS for r in rows) or len(set(rows)) != len(rows):
            error = InvalidIdError
        elif not set(rows) <= self.used:
            error = DoubleFreeError
        else:
            self.pool.free(rows)
            self.used -= set(rows)
            return
        with pytest.raises(error):
            self.pool.free(rows)

    @rule()
    def clear(self) -> None:
        self.pool.clear()
        self.used = set()

    @invariant()
    def agrees(self) -> None:
        self.pool.check_integrity()
        assert self.pool.available_size == self.ROWS - len(self.used)


TestReqToTokenStateful = ReqToTokenMachine.TestCase
TestReqToTokenStateful.settings = settings(max_examples=300, stateful_step_count=30)


# ---- regressions ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", ["a", None, 1.0])
def test_write_with_a_non_int_start_is_an_invalid_argument(start):
    pool = ReqToTokenPool(2, 8)
    (row,) = pool.alloc()
    with pytest.raises(InvalidArgumentError):
        pool.write(row, [1, 2], start=start)
    assert torch.equal(pool.req_to_token, torch.zeros(2, 8, dtype=torch.int32))


@pytest.mark.parametrize("slot", [2**31, -(2**31) - 1, -(2**40)])
def test_int32_table_never_wraps_a_slot_id(slot):
    pool = ReqToTokenPool(2, 8)
    (row,) = pool.alloc()
    with pytest.raises(InvalidArgumentError):
        pool.write(row, [slot])
    assert torch.equal(pool.req_to_token, torch.zeros(2, 8, dtype=torch.int32))

"""StatePool and HybridReqToTokenPool: unit cases, and a hypothesis state machine against a brute-force model.

The model keeps each slot's reference count as a dict and each row's slot; every step compares the pools'
ref counts, free counts and ``req_to_state`` with it and runs ``check_integrity()``. A call that must fail
(too few slots or rows, a free / padding / repeated / out-of-range slot, a free row) must raise and leave
both pools exactly as they were (compared field by field with a snapshot).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.allocators.state_pool import PADDING_SLOT, HybridReqToTokenPool, StatePool
from kvpool.errors import (
    DoubleFreeError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    OutOfBlocksError,
)


def test_alloc_free_and_ref_counts() -> None:
    pool = StatePool(4)
    assert pool.alloc(2) == [0, 1] and pool.available_size == 2
    pool.incref([1])
    assert (pool.ref_count(0), pool.ref_count(1), pool.ref_count(np.int64(2))) == (1, 2, 0)
    assert pool.free([0, 1]) == [0]  # slot 1 still held once
    assert pool.free(torch.tensor([1])) == [1] and pool.available_size == 4
    assert pool.alloc(0) == [] and pool.num_used_slots == 0
    pool.check_integrity()


def test_padding_slot_is_never_handed_out() -> None:
    pool = StatePool(3, padding_slot=True)
    assert pool.capacity == 2 and sorted(pool.alloc(2)) == [1, 2]
    with pytest.raises(OutOfBlocksError):
        pool.alloc(1)
    with pytest.raises(InvalidIdError, match="padding"):
        pool.free([PADDING_SLOT])
    pool.clear()
    assert pool.alloc(2) == [1, 2]
    with pytest.raises(InvalidArgumentError):
        StatePool(1, padding_slot=True)


def test_failed_calls_change_nothing() -> None:
    pool = StatePool(3)
    slots = pool.alloc(2)
    before = (list(pool._refs), list(pool._free))
    calls = [(lambda: pool.alloc(2), OutOfBlocksError), (lambda: pool.free([slots[0], 2]), DoubleFreeError),
             (lambda: pool.free([slots[0], slots[0]]), InvalidIdError),
             (lambda: pool.free([slots[0], 3]), InvalidIdError),
             (lambda: pool.incref([slots[1], 2]), DoubleFreeError),
             (lambda: pool.free([True]), InvalidIdError),
             (lambda: pool.alloc(-1), InvalidArgumentError), (lambda: pool.alloc(1.0), InvalidArgumentError)]
    for call, error in calls:
        with pytest.raises(error):
            call()
        assert (pool._refs, pool._free) == before
    pool._refs[2] = 1  # a slot marked used but left in the free list
    with pytest.raises(IntegrityError):
        pool.check_integrity()


def test_hybrid_rows_own_state_slots() -> None:
    pool = HybridReqToTokenPool(3, 16, state_pool=StatePool(3, padding_slot=True))
    rows = pool.alloc(2)
    slots = [pool.state_slot(r) for r in rows]
    assert sorted(slots) == [1, 2] and pool.req_to_state[rows].tolist() == slots
    assert pool.state_slots(rows).tolist() == slots
    with pytest.raises(OutOfBlocksError, match="state slots"):
        pool.alloc(1)  # a row is free but no state slot: no row taken either
    assert pool.available_size == 1
    pool.state_pool.incref([slots[0]])  # a cache keeps the first request's state
    pool.free(rows)
    assert pool.state_pool.ref_count(slots[0]) == 1 and pool.state_pool.ref_count(slots[1]) == 0
    assert pool.req_to_state.tolist() == [-1, -1, -1]
    with pytest.raises(InvalidIdError):
        pool.state_slot(rows[0])
    with pytest.raises(DoubleFreeError):
        pool.free(rows[0])
    pool.check_integrity()
    pool.clear()
    assert pool.state_pool.ref_count(slots[0]) == 1  # the cache's reference is not the rows'
    pool.check_integrity()


class StatePoolMachine(RuleBasedStateMachine):
    """A StatePool shared by a HybridReqToTokenPool's rows and outside holders (a cache)."""

    @initialize(slots=st.integers(2, 9), rows=st.integers(1, 6), padding=st.booleans())
    def setup(self, slots: int, rows: int, padding: bool) -> None:
        self.states = StatePool(slots, padding_slot=padding)
        self.pool = HybridReqToTokenPool(rows, 8, state_pool=self.states)
        self.first = 1 if padding else 0
        self.refs: dict[int, int] = {}  # slot -> ref count (> 0)
        self.rows: dict[int, int] = {}  # row -> slot
        self.held: list[int] = []  # outside references, one entry per reference

    def _snapshot(self) -> tuple:
        return (list(self.states._refs), list(self.states._free), set(self.pool._used), list(self.pool._free),
                list(self.pool._row_slot), self.pool.req_to_state.tolist())

    def _refused(self, call, error) -> None:
        before = self._snapshot()
        with pytest.raises(error):
            call()
        assert self._snapshot() == before

    def _free_slots(self) -> int:
        return self.states.capacity - len(self.refs)

    @rule(n=st.integers(0, 4))
    def alloc_rows(self, n: int) -> None:
        if n > self._free_slots() or n > self.pool.max_reqs - len(self.rows):
            self._refused(lambda: self.pool.alloc(n), OutOfBlocksError)
            return
        for row in self.pool.alloc(n):
            slot = self.pool.state_slot(row)
            assert row not in self.rows and slot not in self.refs and slot >= self.first
            self.rows[row], self.refs[slot] = slot, 1

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def free_rows(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, unique=True))
        self.pool.free(rows)
        for row in rows:
            self._drop(self.rows.pop(row))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def keep_state(self, data: st.DataObject) -> None:
        slot = self.rows[data.draw(st.sampled_from(sorted(self.rows)))]
        self.states.incref([slot])
        self.refs[slot] += 1
        self.held.append(slot)

    @rule(n=st.integers(0, 3))
    def outside_alloc(self, n: int) -> None:
        if n > self._free_slots():
            self._refused(lambda: self.states.alloc(n), OutOfBlocksError)
            return
        for slot in self.states.alloc(n):
            assert slot not in self.refs
            self.refs[slot] = 1
            self.held.append(slot)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def outside_free(self, data: st.DataObject) -> None:
        slot = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        released = self.states.free([slot])
        self._drop(slot)
        assert released == ([] if slot in self.refs else [slot])

    @rule(data=st.data())
    def bad_state_calls(self, data: st.DataObject) -> None:
        free = [s for s in range(self.first, self.states.num_slots) if s not in self.refs]
        if free:
            slot = data.draw(st.sampled_from(free))
            self._refused(lambda: self.states.free([slot]), DoubleFreeError)
            self._refused(lambda: self.states.incref([slot]), DoubleFreeError)
        if self.refs:
            used = data.draw(st.sampled_from(sorted(self.refs)))
            self._refused(lambda: self.states.free([used, used]), InvalidIdError)
            self._refused(lambda: self.states.free([used, self.states.num_slots]), InvalidIdError)
        if self.first:
            self._refused(lambda: self.states.incref([PADDING_SLOT]), InvalidIdError)

    @rule(data=st.data())
    def bad_row_frees(self, data: st.DataObject) -> None:
        free = [r for r in range(self.pool.max_reqs) if r not in self.rows]
        if free:
            row = data.draw(st.sampled_from(free))
            self._refused(lambda: self.pool.free([*self.rows, row]), DoubleFreeError)
        if self.rows:
            row = data.draw(st.sampled_from(sorted(self.rows)))
            self._refused(lambda: self.pool.free([row, row]), InvalidIdError)

    def _drop(self, slot: int) -> None:
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            del self.refs[slot]

    @invariant()
    def matches_the_model(self) -> None:
        self.pool.check_integrity()
        assert self.states.available_size == self._free_slots()
        for slot in range(self.first, self.states.num_slots):
            assert self.states.ref_count(slot) == self.refs.get(slot, 0)
        expected = [-1] * self.pool.max_reqs
        for row, slot in self.rows.items():
            expected[row] = slot
        assert self.pool.req_to_state.tolist() == expected


TestStatePoolMachine = StatePoolMachine.TestCase
TestStatePoolMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)

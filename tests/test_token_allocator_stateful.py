"""Stateful property tests: TokenToKVPoolAllocator against a brute-force model (sets and lists).

The model keeps the set of free pages and, per request, its slot ids in token order (token i of a request
sits at page offset i % page_size). Every rule, error paths included, predicts the outcome from the model
alone; after every step ``check_integrity()`` runs and the free counts must agree. Handed-out pages must be
free in the model, and freeing a page the model calls free must raise, so the two free sets stay equal.
"""

import copy

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.allocators.token import TokenToKVPoolAllocator
from kvpool.errors import DoubleFreeError, InvalidArgumentError, InvalidIdError, OutOfBlocksError


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class TokenAllocatorMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    NUM_PAGES = 10          # page 0 is padding: 9 allocatable

    def __init__(self) -> None:
        super().__init__()
        self.ps = self.PAGE_SIZE
        self.size = self.NUM_PAGES * self.ps
        self.alloc = TokenToKVPoolAllocator(self.size, page_size=self.ps)
        self.free: set[int] = set(range(1, self.NUM_PAGES))
        self.reqs: list[list[int]] = []
        self.pending: list[int] | None = None       # pages freed inside an open group
        self.backup: tuple | None = None            # (state, free, reqs)
        self.stale: list = []

    # ---------------------------------------------------------------------------------------- helpers
    def take_new_pages(self, slots: list[int], positions: list[int], known: dict[int, int]) -> None:
        """Check that each new token sits at offset pos % ps of a page that was free, one page per
        (request, page index); ``known`` maps page index -> page already taken for this request."""
        for slot, pos in zip(slots, positions, strict=True):
            page, off = divmod(slot, self.ps)
            assert off == pos % self.ps
            if pos // self.ps in known:
                assert known[pos // self.ps] == page
            else:
                assert page in self.free, f"page {page} handed out but not free in the model"
                self.free.discard(page)
                known[pos // self.ps] = page

    def release(self, slots: list[int]) -> None:
        pages = {s // self.ps for s in slots}
        if self.pending is None:
            assert not pages & self.free
            self.free |= pages
        else:
            self.pending.extend(pages)

    def pick_req(self, data, nonempty: bool = False) -> int | None:
        choices = [i for i, r in enumerate(self.reqs) if r or not nonempty]
        return data.draw(st.sampled_from(choices)) if choices else None

    # ------------------------------------------------------------------------------------------ rules
    @rule(pages=st.integers(0, 2) | st.integers(-1, 10), ragged=st.booleans())
    def alloc_n(self, pages: int, ragged: bool) -> None:
        n = pages * self.ps + (ragged and self.ps > 1)          # ragged: not a whole number of pages
        if n < 0 or n % self.ps:
            with pytest.raises(InvalidArgumentError):
                self.alloc.alloc(n)
        elif n // self.ps > len(self.free):
            with pytest.raises(OutOfBlocksError):
                self.alloc.alloc(n)
        else:
            slots = self.alloc.alloc(n).tolist()
            assert len(slots) == n
            self.take_new_pages(slots, list(range(n)), {})
            self.reqs.append(slots)

    @rule()
    def alloc_everything(self) -> None:
        slots = self.alloc.alloc(len(self.free) * self.ps).tolist()
        assert {s // self.ps for s in slots} == self.free
        self.take_new_pages(slots, list(range(len(slots))), {})
        self.reqs.append(slots)

    @rule(k=st.integers(0, 5))
    def alloc_contiguous(self, k: int) -> None:
        runs = [p for p in range(1, self.NUM_PAGES - k + 1) if all(q in self.free for q in range(p, p + k))]
        if k == 0:
            assert self.alloc.alloc_contiguous(0).tolist() == []
        elif not runs:
            with pytest.raises(OutOfBlocksError):
                self.alloc.alloc_contiguous(k * self.ps)
        else:
            slots = self.alloc.alloc_contiguous(k * self.ps).tolist()
            assert slots == list(range(runs[0] * self.ps, (runs[0] + k) * self.ps))   # first fit
            self.take_new_pages(slots, list(range(len(slots))), {})
            self.reqs.append(slots)

    @rule(data=st.data())
    def extend(self, data) -> None:
        count = data.draw(st.integers(1, 3))
        targets = data.draw(st.lists(st.sampled_from([*range(len(self.reqs)), None] if self.reqs else [None]),
                                     min_size=count, max_size=count))
        targets = [t for i, t in enumerate(targets) if t is None or t not in targets[:i]]
        pre = [len(self.reqs[t]) if t is not None else 0 for t in targets]
        ext = [data.draw(st.integers(0, 2 * self.ps + 1)) for _ in targets]
        last = [self.reqs[t][-1] if t is not None and self.reqs[t] else -1 for t in targets]
        corrupt = self.ps > 1 and any(p % self.ps for p in pre) and data.draw(st.booleans())
        if corrupt:
            i = next(i for i, p in enumerate(pre) if p % self.ps)
            last[i] = data.draw(st.sampled_from([last[i] + 1, -1, self.size, 0]))
        need = sum(ceil_div(p + e, self.ps) - ceil_div(p, self.ps) for p, e in zip(pre, ext, strict=True))
        args = ([*pre], [p + e for p, e in zip(pre, ext, strict=True)], last)
        if corrupt:
            with pytest.raises(InvalidArgumentError):
                self.alloc.alloc_extend(*args)
            return
        if need > len(self.free):
            with pytest.raises(OutOfBlocksError):
                self.alloc.alloc_extend(*args)
            return
        out = self.alloc.alloc_extend(*args).tolist()
        assert len(out) == sum(ext)
        for t, p, e in zip(targets, pre, ext, strict=True):
            new, out = out[:e], out[e:]
            slots = self.reqs[t] if t is not None else []
            known = {(len(slots) - 1) // self.ps: slots[-1] // self.ps} if p % self.ps else {}
            self.take_new_pages(new, list(range(p, p + e)), known)
            if t is None:
                self.reqs.append(new)
            else:
                slots.extend(new)

    @rule(data=st.data())
    def decode(self, data) -> None:
        live = [i for i, r in enumerate(self.reqs) if r]
        if not live:
            return
        targets = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        seq = [len(self.reqs[t]) + 1 for t in targets]
        need = sum(1 for s in seq if (s - 1) % self.ps == 0)
        if need > len(self.free):
            with pytest.raises(OutOfBlocksError):
                self.alloc.alloc_decode(seq, [self.reqs[t][-1] for t in targets])
            return
        out = self.alloc.alloc_decode(seq, [self.reqs[t][-1] for t in targets]).tolist()
        for t, s, slot in zip(targets, seq, out, strict=True):
            slots = self.reqs[t]
            if (s - 1) % self.ps:
                assert slot == slots[-1] + 1
            else:
                self.take_new_pages([slot], [s - 1], {})
            slots.append(slot)

    @rule(data=st.data())
    def free_tail(self, data) -> None:
        i = self.pick_req(data)
        if i is None:
            return
        slots = self.reqs[i]
        k = data.draw(st.integers(0, len(slots)) | st.integers(max(0, len(slots) - 1), len(slots)))
        self.alloc.free(torch.tensor(slots[k:], dtype=torch.int64))
        self.release(slots[k:])
        del slots[k - k % self.ps:]                  # a tail from mid-page loses that whole page

    @precondition(lambda self: self.pending is None)
    @rule(data=st.data(), kind=st.sampled_from(["double", "range", "padding", "repeat"]))
    def bad_free(self, data, kind: str) -> None:
        i = self.pick_req(data, nonempty=True)
        good = self.reqs[i] if i is not None else []
        if kind == "double":
            if not self.free:
                return
            page = data.draw(st.sampled_from(sorted(self.free)))
            bad = [page * self.ps + data.draw(st.integers(0, self.ps - 1))]
            error = DoubleFreeError
        elif kind == "range":
            bad, error = [data.draw(st.sampled_from([-1, -self.ps - 1, self.size, 10**12]))], InvalidIdError
        elif kind == "padding":
            bad, error = [data.draw(st.integers(0, self.ps - 1))], InvalidIdError
        else:
            if self.ps > 1 or not good:
                return
            bad, error = [good[0]], InvalidIdError
        ids = data.draw(st.permutations(good + bad))
        with pytest.raises(error):
            self.alloc.free(torch.tensor(ids, dtype=torch.int64))

    @precondition(lambda self: self.pending is None)
    @rule()
    def group_begin(self) -> None:
        self.alloc.free_group_begin()
        self.pending = []

    @precondition(lambda self: self.pending is not None)
    @rule()
    def group_end(self) -> None:
        with pytest.raises(InvalidArgumentError):
            self.alloc.free_group_begin()            # groups do not nest
        self.alloc.free_group_end()
        pages, self.pending = set(self.pending), None
        assert not pages & self.free
        self.free |= pages

    @precondition(lambda self: self.pending is None)
    @rule()
    def group_end_without_begin(self) -> None:
        with pytest.raises(InvalidArgumentError):
            self.alloc.free_group_end()

    @precondition(lambda self: self.pending is None)
    @rule()
    def backup_state(self) -> None:
        if self.backup is not None:
            self.stale.append(self.backup[0])
        self.backup = (self.alloc.backup_state(), set(self.free), copy.deepcopy(self.reqs))

    @precondition(lambda self: self.pending is None and self.backup is not None)
    @rule()
    def restore_state(self) -> None:
        state, free, reqs = self.backup
        self.alloc.restore_state(state)
        assert set(self.alloc.free_pages().tolist()) == free
        self.alloc.alloc(self.alloc.available_size)
        self.alloc.restore_state(state)                                      # repeatable
        self.free, self.reqs = set(free), copy.deepcopy(reqs)

    @precondition(lambda self: self.pending is None)
    @rule(data=st.data(), steps=st.lists(st.sampled_from(["alloc", "free", "decode", "extend"]), max_size=5))
    def speculate(self, data, steps: list[str]) -> None:
        """A speculative-decoding round: backup, a few allocs and frees, then roll back."""
        self.backup_state()
        for step in steps:
            if step == "alloc":
                self.alloc_n(data.draw(st.integers(0, 2)), False)
            elif step == "free":
                self.free_tail(data)
            else:
                getattr(self, step)(data)
        self.restore_state()

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def restore_stale_state(self, data) -> None:
        with pytest.raises(InvalidArgumentError):
            self.alloc.restore_state(data.draw(st.sampled_from(self.stale)))

    @rule()
    def clear(self) -> None:
        self.alloc.clear()
        self.free = set(range(1, self.NUM_PAGES))
        self.reqs = []
        if self.pending is not None:
            self.pending = []

    # ------------------------------------------------------------------------------------ invariants
    @invariant()
    def agrees_with_model(self) -> None:
        self.alloc.check_integrity()
        assert set(self.alloc.free_pages().tolist()) == self.free
        assert self.alloc.num_free_pages == len(self.free)
        assert self.alloc.available_size == len(self.free) * self.ps
        assert self.alloc.in_free_group == (self.pending is not None)


class PagedAllocatorMachine(TokenAllocatorMachine):
    PAGE_SIZE = 4


STEPS = settings(max_examples=500, stateful_step_count=30)
TestTokenAllocatorStateful = TokenAllocatorMachine.TestCase
TestTokenAllocatorStateful.settings = STEPS
TestPagedAllocatorStateful = PagedAllocatorMachine.TestCase
TestPagedAllocatorStateful.settings = STEPS

"""State slots of recurrent layers (SGLang's ``MambaPool`` allocator, vLLM's state blocks): which fixed-size
slot of the state buffers (:class:`kvpool.storage.state.RecurrentStateCache`) belongs to whom.

A recurrent layer keeps one conv state and one SSM state per request, whatever its length, so a request
holds exactly one slot (every recurrent layer's state of that request lives at that slot index). Slots are
counted by reference, so a finished request's state can outlive it (a prefix cache that keeps the state of
a prompt's end increments the count before the request frees its slot) and be shared copy-on-write later.

:class:`HybridReqToTokenPool` is SGLang's pairing: a :class:`~kvpool.allocators.req_to_token.ReqToTokenPool`
row (the request's token slots) that also owns a state slot, taken and released with it.

Every call checks all its ids before it changes anything: a call that raises changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.allocators.req_to_token import ReqToTokenPool
from kvpool.errors import DoubleFreeError, IntegrityError, InvalidIdError, OutOfBlocksError
from kvpool.numeric import IntArg, as_id_list, as_int, as_optional_int, index_or_none

#: The slot a pool with a padding slot never hands out: batch rows that pad a kernel launch (CUDA graphs of
#: a fixed batch size) point their state there, so padded rows never touch a request's state.
PADDING_SLOT = 0

SlotIds = Sequence[int] | torch.Tensor | int


class StatePool:
    """``num_slots`` state slots, handed out one per request, O(1) per slot.

    Args:
        num_slots: slots of the state buffers, padding slot included.
        padding_slot: reserve slot :data:`PADDING_SLOT` (never handed out, not even after ``clear()``).

    Bookkeeping: a stack of free slots (the lowest first on a fresh pool) and a ref count per slot (0 =
    free). Errors: ``OutOfBlocksError`` when too few slots are free; ``InvalidIdError`` for a slot out of
    range, the padding slot, or a slot repeated in one call; ``DoubleFreeError`` for a slot that is not
    allocated. A call that raises changes nothing.
    """

    def __init__(self, num_slots: IntArg, *, padding_slot: bool = False) -> None:
        self.padding_slot = bool(padding_slot)
        self.num_slots = as_int(num_slots, "num_slots", minimum=2 if self.padding_slot else 1)
        self._first = 1 if self.padding_slot else 0
        self._refs: list[int] = [0] * self.num_slots
        self._free: list[int] = []
        self.clear()

    # ------------------------------------------------------------------------------------- queries
    @property
    def capacity(self) -> int:
        """Slots that can be handed out (the padding slot excluded)."""
        return self.num_slots - self._first

    @property
    def available_size(self) -> int:
        """Free slots."""
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.capacity - len(self._free)

    def ref_count(self, slot: IntArg) -> int:
        """The ref count of ``slot`` (0 when free). Raises InvalidIdError for a slot out of range."""
        return self._refs[self._check_range([slot])[0]]

    # ---------------------------------------------------------------------------------- allocation
    def alloc(self, n: IntArg = 1) -> list[int]:
        """``n`` free slots, each at ref count 1 (the lowest first on a fresh pool).

        Raises InvalidArgumentError for n < 0, OutOfBlocksError when fewer than n are free."""
        n = as_int(n, "n", minimum=0)
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} state slots, {len(self._free)} free of {self.capacity}")
        slots = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        for slot in slots:
            self._refs[slot] = 1
        return slots

    def incref(self, slots: SlotIds) -> None:
        """One more reference to each allocated slot of ``slots`` (a cache or a second request keeps it).

        Raises InvalidIdError, DoubleFreeError (a free slot)."""
        ids = self._check_used(slots)
        for slot in ids:
            self._refs[slot] += 1

    def free(self, slots: SlotIds) -> list[int]:
        """Drop one reference to each slot of ``slots``; those that reach 0 become free (returned, in the
        order given). Raises InvalidIdError, DoubleFreeError."""
        ids = self._check_used(slots)
        released = []
        for slot in ids:
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                released.append(slot)
        self._free.extend(reversed(released))
        return released

    def clear(self) -> None:
        """Free every slot (ref counts to 0); the buffers are left as they are."""
        self._refs = [0] * self.num_slots
        self._free = list(range(self.num_slots - 1, self._first - 1, -1))

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the free slots are distinct, exactly the allocatable slots at ref count
        0, the rest at ref count >= 1, and the padding slot is neither."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a state slot is in the free list twice")
        if self.padding_slot and (PADDING_SLOT in free or self._refs[PADDING_SLOT] != 0):
            raise IntegrityError("the padding state slot is free or referenced")
        for slot in range(self._first, self.num_slots):
            refs = self._refs[slot]
            if refs < 0 or (refs == 0) != (slot in free):
                raise IntegrityError(f"state slot {slot} has ref count {refs} and is "
                                     f"{'' if slot in free else 'not '}free")

    # -------------------------------------------------------------------------------------- checks
    def _check_range(self, slots: SlotIds) -> list[int]:
        ids = _ids(slots, "state slots")
        if ids and (min(ids) < self._first or max(ids) >= self.num_slots):
            bad = next(s for s in ids if not self._first <= s < self.num_slots)
            what = "the padding slot" if self.padding_slot and bad == PADDING_SLOT else "out of range"
            raise InvalidIdError(f"state slot {bad} is {what} (slots {self._first} .. {self.num_slots - 1})")
        return ids

    def _check_used(self, slots: SlotIds) -> list[int]:
        ids = self._check_range(slots)
        if len(set(ids)) != len(ids):
            raise InvalidIdError(f"a state slot is repeated in one call: {ids[:8]}")
        for slot in ids:
            if self._refs[slot] == 0:
                raise DoubleFreeError(f"state slot {slot} is not allocated (double free?)")
        return ids


class HybridReqToTokenPool(ReqToTokenPool):
    """A :class:`ReqToTokenPool` whose rows each own a state slot of ``state_pool`` (SGLang's
    ``HybridReqToTokenPool``): ``alloc`` takes rows and slots together, ``free`` releases both.

    Args:
        max_reqs: as :class:`ReqToTokenPool`.
        max_context_len: as :class:`ReqToTokenPool`.
        num_slots: as :class:`ReqToTokenPool`.
        device: as :class:`ReqToTokenPool`.
        state_pool: the :class:`StatePool` to take slots from; a new one of ``max_reqs`` slots when None.

    ``req_to_state``: ``[max_reqs]`` int64 on ``device``, the state slot of each row (-1 for a free row), what
    a kernel indexes the state buffers with. Release order when a request finishes: copy its slot ids
    (:meth:`read`) and free its token slots, then ``free(row)``; to keep its state (a prefix cache),
    ``state_pool.incref([state_slot(row)])`` before ``free(row)``.
    """

    def __init__(self, max_reqs: int, max_context_len: int, *, state_pool: StatePool | None = None,
                 num_slots: int | None = None, device: torch.device | str = "cpu") -> None:
        max_reqs = as_int(max_reqs, "max_reqs", minimum=1)
        self.state_pool = StatePool(max_reqs) if state_pool is None else state_pool
        self._row_slot = [-1] * max_reqs
        super().__init__(max_reqs, max_context_len, num_slots=as_optional_int(num_slots, "num_slots"),
                         device=device)
        self.req_to_state = torch.full((max_reqs,), -1, dtype=torch.int64, device=self.req_to_token.device)

    def alloc(self, n: int = 1) -> list[int]:
        """``n`` rows, each with a fresh state slot at ref count 1. Raises OutOfBlocksError (rows or state
        slots short: neither is taken)."""
        n = as_int(n, "n", minimum=0)
        if n > self.state_pool.available_size:
            raise OutOfBlocksError(f"need {n} state slots, {self.state_pool.available_size} free")
        rows = super().alloc(n)
        slots = self.state_pool.alloc(n)
        for row, slot in zip(rows, slots, strict=True):
            self._row_slot[row] = slot
        if rows:
            self.req_to_state[torch.tensor(rows)] = torch.tensor(slots, device=self.req_to_state.device)
        return rows

    def free(self, rows: int | Sequence[int] | torch.Tensor) -> None:
        """Release rows and drop their state slots' reference (see the class docstring for the order).
        Raises InvalidIdError, DoubleFreeError; nothing is released then."""
        ids = _ids(rows, "rows")
        super().free(ids)
        slots = [self._row_slot[row] for row in ids]
        for row in ids:
            self._row_slot[row] = -1
        if ids:
            self.req_to_state[torch.tensor(ids)] = -1
            self.state_pool.free(slots)

    def state_slot(self, row: int) -> int:
        """The state slot of an allocated row. Raises InvalidIdError for a row that is not allocated."""
        r = as_int(row, "row", minimum=0, maximum=self.max_reqs - 1, error=InvalidIdError)
        if self._row_slot[r] < 0:
            raise InvalidIdError(f"row {row!r} is not an allocated row")
        return self._row_slot[r]

    def state_slots(self, rows: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """A copy of the state slots of ``rows`` (int64 ``[len(rows)]``). Raises InvalidIdError."""
        return torch.tensor([self.state_slot(r) for r in as_id_list(rows, "rows")], dtype=torch.int64)

    def clear(self) -> None:
        """Free every row and its state slot."""
        row_slot = getattr(self, "_row_slot", [])
        held = [s for s in row_slot if s >= 0]
        super().clear()
        if held:
            self.state_pool.free(held)
        self._row_slot = [-1] * len(row_slot)
        if hasattr(self, "req_to_state"):
            self.req_to_state.fill_(-1)

    def check_integrity(self) -> None:
        """The row invariants, the state pool's, and: every allocated row maps to its own referenced state
        slot, every free row to none, and ``req_to_state`` says the same."""
        super().check_integrity()
        self.state_pool.check_integrity()
        used = [r for r, s in enumerate(self._row_slot) if s >= 0]
        if set(used) != self._used:
            raise IntegrityError("the rows with a state slot are not the allocated rows")
        slots = [self._row_slot[r] for r in used]
        if len(set(slots)) != len(slots):
            raise IntegrityError("two rows map to one state slot")
        if any(self.state_pool.ref_count(s) < 1 for s in slots):
            raise IntegrityError("a row maps to a free state slot")
        if self.req_to_state.tolist() != self._row_slot:
            raise IntegrityError("req_to_state differs from the rows' state slots")


def _ids(ids: object, what: str) -> list[int]:
    """One id (an integer by :mod:`kvpool.numeric`'s rule) or a sequence / 1-D tensor of ids, as a list."""
    one = index_or_none(ids)
    if one is not None:
        return [one]
    if isinstance(ids, torch.Tensor) and ids.ndim == 0:  # a bool or float scalar tensor: refused below
        ids = ids.reshape(1)
    return as_id_list(ids, what)  # type: ignore[arg-type]

"""State slots of recurrent layers (SGLang's ``MambaPool`` allocator, vLLM's state blocks): which fixed-size
slot of the state buffers (:class:`kvpool.storage.state.RecurrentStateCache`) belongs to whom.

A recurrent layer keeps one conv state and one SSM state per request, whatever its length, so a request
holds exactly one slot (every recurrent layer's state of that request lives at that slot index). Slots are
counted by reference, so a finished request's state can outlive it (a prefix cache that keeps the state of
a prompt's end increments the count before the request frees its slot) and be shared copy-on-write later.

:class:`~kvpool.allocators.req_to_token.HybridReqToTokenPool` (also importable from here) is SGLang's
pairing: a :class:`~kvpool.allocators.req_to_token.ReqToTokenPool` row (the request's token slots) that also
owns a state slot, taken and released with it.

Every call checks all its ids before it changes anything: a call that raises changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

from kvpool._lazy import lazy_exports
from kvpool.errors import DoubleFreeError, IntegrityError, InvalidIdError, OutOfBlocksError
from kvpool.numeric import IntArg, as_int, as_one_or_ids

if TYPE_CHECKING:
    import torch

#: :class:`~kvpool.allocators.req_to_token.HybridReqToTokenPool`, importable from here too (on first use: its
#: tables are torch tensors, and a pool of state slots alone, a replay's, imports no torch).
__getattr__, __dir__ = lazy_exports(__name__, {"HybridReqToTokenPool": "kvpool.allocators.req_to_token"})

#: The slot a pool with a padding slot never hands out: batch rows that pad a kernel launch (CUDA graphs of
#: a fixed batch size) point their state there, so padded rows never touch a request's state.
PADDING_SLOT = 0

SlotIds: TypeAlias = "Sequence[int] | torch.Tensor | int"


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
        ids = as_one_or_ids(slots, "state slots")
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

"""The request-to-token table (SGLang style): row r holds the KV slot id of every token of one request.

Release order when a request finishes or is aborted (the row is reused by the next request, so its slot ids
must be copied out before anything else happens to it)::

    slots = req_pool.read(row, seq_len)     # 1. copy the row's slot ids
    allocator.free(slots)                   # 2. free the KV slots
    req_pool.free(row)                      # 3. free the row

:class:`HybridReqToTokenPool` is SGLang's pairing of a row with a state slot of a
:class:`~kvpool.allocators.state_pool.StatePool` (it lives here, beside its tensors, so that a state pool
alone imports no torch; ``kvpool.allocators.state_pool`` exports it too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.allocators.state_pool import StatePool
from kvpool.allocators.token import IdsLike
from kvpool.errors import (
    DoubleFreeError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    OutOfBlocksError,
)
from kvpool.numeric import as_id_list, as_id_tensor, as_int, as_one_or_ids, as_optional_int, index_or_none

_INT32_MAX = 2**31 - 1


class ReqToTokenPool:
    """``max_reqs`` rows of ``max_context_len`` slot ids, handed out and released by row.

    ``req_to_token``: ``[max_reqs, max_context_len]`` on ``device``, int32, or int64 when ``num_slots`` (the
    KV pool's slot count) lets slot ids pass 2**31 - 1. Errors: OutOfBlocksError when too few rows are
    free; InvalidIdError for a row out of range or repeated in one call; DoubleFreeError for a row that is
    not allocated; InvalidArgumentError for bad counts or positions. A call that raises changes nothing.
    """

    def __init__(self, max_reqs: int, max_context_len: int, *, num_slots: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        max_reqs = as_int(max_reqs, "max_reqs", minimum=1)
        max_context_len = as_int(max_context_len, "max_context_len", minimum=1)
        num_slots = as_optional_int(num_slots, "num_slots", minimum=1)
        wide = num_slots is not None and num_slots - 1 > _INT32_MAX
        self.max_reqs, self.max_context_len = max_reqs, max_context_len
        dtype = torch.int64 if wide else torch.int32
        try:
            self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=dtype, device=device)
        except (RuntimeError, AssertionError, TypeError) as exc:  # a bad device, or out of memory
            raise InvalidArgumentError(f"cannot allocate the [{max_reqs}, {max_context_len}] table on "
                                       f"{device!r}: {exc}") from None
        self._free: list[int] = []
        self._used: set[int] = set()
        self.clear()

    @property
    def available_size(self) -> int:
        """Free rows."""
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int]:
        """``n`` free row ids (lowest first on a fresh pool).

        Raises InvalidArgumentError for n < 0, OutOfBlocksError when fewer than n rows are free."""
        n = as_int(n, "n", minimum=0)
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} request rows, {len(self._free)} free")
        rows = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        self._used.update(rows)
        return rows

    def free(self, rows: int | Sequence[int] | torch.Tensor) -> None:
        """Release rows (see the module docstring for the order). Raises InvalidIdError, DoubleFreeError."""
        rows = as_id_tensor(rows, "rows", flatten=True).tolist()
        if not rows:
            return
        if min(rows) < 0 or max(rows) >= self.max_reqs:
            raise InvalidIdError(f"a row id is out of range [0, {self.max_reqs}): {rows}")
        if len(set(rows)) != len(rows):
            raise InvalidIdError(f"a row id is repeated in one free(): {rows}")
        if not self._used.issuperset(rows):
            raise DoubleFreeError(f"row {sorted(set(rows) - self._used)[0]} is not allocated (double free?)")
        self._used.difference_update(rows)
        self._free.extend(reversed(rows))

    def write(self, row: int, slots: IdsLike, start: int = 0) -> None:
        """Store ``slots`` (``[n]`` ints) as the slot ids of tokens ``start .. start + n - 1`` of ``row``."""
        ids = as_id_tensor(slots, "slots", flatten=True, to_host=False)
        row, start, end = self._check_span(row, start, _plus(start, ids.numel()))
        if self.req_to_token.dtype == torch.int32 and ids.numel() and _outside_int32(ids):
            raise InvalidArgumentError("slot id outside int32 in an int32 table: pass num_slots")
        self.req_to_token[row, start:end] = ids

    def read(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        """A copy (int64 ``[end - start]``, on the table's device) of the slot ids of tokens start..end-1."""
        row, start, end = self._check_span(row, start, end)
        return self.req_to_token[row, start:end].to(torch.int64, copy=True)

    def clear(self) -> None:
        """Free every row (the table's contents are left as they are)."""
        self._free = list(range(self.max_reqs - 1, -1, -1))
        self._used.clear()

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free and used rows are disjoint, unique and together all rows."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a row is in the free list twice")
        if free & self._used:
            raise IntegrityError("a row is both free and used")
        if free | self._used != set(range(self.max_reqs)):
            raise IntegrityError(f"free + used rows != {self.max_reqs}")

    def _check_span(self, row: int, start: int, end: int | None) -> tuple[int, int, int]:
        """(row, start, end) as Python ints: an allocated row and ``0 <= start <= end <= max_context_len``."""
        r = index_or_none(row)
        if r is None or r not in self._used:
            raise InvalidIdError(f"row {row!r} is not an allocated row")
        lo, hi = index_or_none(start), index_or_none(end)
        if lo is None or hi is None or not 0 <= lo <= hi <= self.max_context_len:
            raise InvalidArgumentError(f"token span [{start}, {end}) outside [0, {self.max_context_len}]")
        return r, lo, hi


def _plus(start: object, n: int) -> int | None:
    """``start + n`` for an integer ``start`` (None otherwise: the span check then names it)."""
    lo = index_or_none(start)
    return None if lo is None else lo + n


def _outside_int32(ids: torch.Tensor) -> bool:
    """Whether an int64 tensor holds a value that an int32 table would silently wrap."""
    low, high = (int(x) for x in ids.aminmax())
    return low < -_INT32_MAX - 1 or high > _INT32_MAX


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
        ids = as_one_or_ids(rows, "rows")
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

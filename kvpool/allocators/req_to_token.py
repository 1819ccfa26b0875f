"""The request-to-token table (SGLang style): row r holds the KV slot id of every token of one request.

Release order when a request finishes or is aborted (the row is reused by the next request, so its slot ids
must be copied out before anything else happens to it)::

    slots = req_pool.read(row, seq_len)     # 1. copy the row's slot ids
    allocator.free(slots)                   # 2. free the KV slots
    req_pool.free(row)                      # 3. free the row
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.allocators.token import IdsLike
from kvpool.errors import (
    DoubleFreeError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    OutOfBlocksError,
)
from kvpool.numeric import as_id_tensor, as_int, as_optional_int, index_or_none

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

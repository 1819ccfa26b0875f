"""Token-slot and page allocators (SGLang style): which slot of the flat KV buffer belongs to whom.

A slot id indexes the flat KV buffer of ``size`` slots (``PagedKVCache.flat_k_cache(l)`` has
``num_blocks * block_size`` of them). Slot 0 (page 0, i.e. slots ``0 .. page_size - 1``, when paged) is the
padding slot that kernels write padded tokens into: it is never handed out, not even after ``clear()``.

Bookkeeping lives in host memory: a stack of free page ids (an ``array`` that is also a torch int64 tensor,
free entries ``stack[head:]``) and one state byte per page (free / allocated / padding), also a torch view.
A single alloc, or a free of one slot or of one page's slots, is therefore plain Python plus at most one
torch call (none for one page, below), and every bulk path (alloc(n), a free of many, ``alloc_extend``,
``alloc_decode``) is a fixed number of vectorized torch ops: no Python loop over requests or tokens, and no
free costs O(pool size) (SGLang's ``torch.cat`` of the whole free list does).
The ids returned are int64 tensors on ``device``; the checks need their values on the host anyway.

**One page, no torch call.** On the host, ``alloc(page_size)`` returns a read-only-by-contract view of one
page's slots in a constant ``arange`` of every slot id, made once per page and kept (the first
:data:`MAX_CACHED_VIEWS` pages; others get a fresh view each time), and ``free`` recognises such a view by
identity (a dict from each cached view's ``id`` to its page): a pair is plain Python plus one attribute read,
no torch op. Writing into a returned tensor is allowed (it is the caller's tensor) and is noticed by the
``arange``'s version counter: the ids are then rebuilt, and that tensor is read by value like any other.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

from kvpool.errors import (
    DoubleFreeError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    OutOfBlocksError,
)
from kvpool.numeric import IntArg, as_id_tensor, as_int
from kvpool.units import plural

_FREE, _USED, _PAD = 0, 1, 2

#: Slot ids, lengths or locations: an int tensor of any shape (any device), a sequence of integers, or one
#: integer (the rule of :mod:`kvpool.numeric`: never bools).
IdsLike: TypeAlias = "torch.Tensor | Sequence[int] | int"

#: At most this many one-page views are kept (~600 B each): see :meth:`TokenToKVPoolAllocator.alloc`.
MAX_CACHED_VIEWS = 65_536


@dataclass(frozen=True)
class AllocatorState:
    """Opaque handle returned by ``backup_state()``; only the latest one can be restored."""

    token: int
    available_size: int


@dataclass
class _Backup:
    token: int
    head: int
    snapshot: torch.Tensor | None = None  # stack[head:] as it was, copied before the first write into it


class TokenToKVPoolAllocator:
    """Free KV slots (``page_size == 1``) or pages (``page_size > 1``) of a flat buffer of ``size`` slots.

    ``size`` counts every slot of the KV buffer, padding included, and must be a multiple of ``page_size``;
    ``size // page_size - 1`` pages are allocatable. Errors: ``OutOfBlocksError`` when too few are free;
    ``InvalidIdError`` for an id out of range, the padding slot, or (page_size 1) an id repeated in one call;
    ``DoubleFreeError`` for an id that is not allocated; ``InvalidArgumentError`` for bad counts, lengths or
    call order. A call that raises changes nothing.

    Paged frees name pages through any of their slots: freeing one slot of a page releases the whole page
    (a request's tail that starts mid-page releases that page), slots of one page in one call release it
    once, and freeing another slot of an already released page raises ``DoubleFreeError``.
    """

    def __init__(self, size: IntArg, *, page_size: IntArg = 1, device: torch.device | str = "cpu") -> None:
        page_size = as_int(page_size, "page_size", minimum=1)
        size = as_int(size, "size", minimum=2 * page_size)
        if size % page_size:
            raise InvalidArgumentError(
                f"size must be a multiple of page_size={page_size} holding >= 2 pages, got {size!r}")
        self.size, self.page_size, self.num_pages = size, page_size, size // page_size
        try:
            self.device = torch.empty(0, device=device).device  # fails now, not at the first alloc
        except (RuntimeError, AssertionError, TypeError) as exc:
            raise InvalidArgumentError(f"device {device!r} is not usable here: {exc}") from None
        self._on_host = self.device.type == "cpu"
        self._cap = self.num_pages - 1                       # allocatable pages: 1 .. num_pages - 1
        self._ids = array("q", bytes(8 * self._cap))         # free stack: free pages are _ids[_head:]
        self._stack = torch.frombuffer(self._ids, dtype=torch.int64)
        self._state = bytearray(self.num_pages + 1)          # per page: _FREE / _USED / _PAD, + a _PAD
        self._state[-1] = _PAD                               # sentinel that clamped bad ids land on
        self._mask_ext = torch.frombuffer(self._state, dtype=torch.uint8)
        self._mask = self._mask_ext[:self.num_pages]
        self._stamp = torch.empty(self.num_pages, dtype=torch.int64)  # scratch for deduplication
        self._offsets = torch.arange(page_size)
        self._slot_ids = torch.arange(size)                  # values of the one-page views alloc returns
        self._slot_version = self._slot_ids._version         # bumped by any write into one of them
        self._views: list[torch.Tensor | None] = [None] * self.num_pages
        self._view_pages: dict[int, int] = {}                # id(view) -> page, for the cached views
        self._head = 0
        self._group: list[torch.Tensor] | None = None
        self._backup: _Backup | None = None
        self._frozen = self._cap   # a push while _head > _frozen writes into a live backup's free region
        self._tokens = 0
        self.clear()

    # ----------------------------------------------------------------------------------------- queries
    @property
    def available_size(self) -> int:
        """Free slots (free pages * page_size); frees pending in an open free group are not counted."""
        return (self._cap - self._head) * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self._cap - self._head

    @property
    def in_free_group(self) -> bool:
        return self._group is not None

    def free_pages(self) -> torch.Tensor:
        """A copy of the free page ids (slot ids when page_size is 1), next to be handed out first: int64
        ``[num_free_pages]``. O(free pages); for inspection, not for the hot path."""
        return self._stack[self._head:].clone()

    # ------------------------------------------------------------------------------------ allocation
    def alloc(self, n: IntArg) -> torch.Tensor:
        """``n`` free slot ids, int64 ``[n]`` on ``device`` (whole pages, ascending inside each page).

        Raises InvalidArgumentError if n < 0 or (paged) not a multiple of page_size, OutOfBlocksError if
        fewer than n slots are free (nothing is handed out).
        """
        if type(n) is int and n == self.page_size:
            return self._alloc_one_page()
        pages = self._take(self._pages_for(n))
        return self._out(pages.clone() if self.page_size == 1 else self._page_slots(pages))

    def alloc_extend(self, prefix_lens: IdsLike, seq_lens: IdsLike, last_loc: IdsLike) -> torch.Tensor:
        """Slots for tokens ``prefix_lens[i] .. seq_lens[i] - 1`` of each request, concatenated in order.

        prefix_lens, seq_lens, last_loc: ``[R]`` ints (moved to the host); ``last_loc[i]`` is the slot of
        token ``prefix_lens[i] - 1`` (any value when the prefix ends on a page boundary). Each request's
        partial last page is filled first (``last_loc + 1, ...``), then whole new pages, then a partial tail
        page. Returns int64 ``[sum(seq_lens - prefix_lens)]``. Raises InvalidArgumentError for a negative
        prefix, ``seq < prefix``, or a last_loc not in an allocated page at the right offset;
        OutOfBlocksError when the new pages (computed on the host) are not free.
        """
        pre, seq, last = _lens(prefix_lens, seq_lens, last_loc)
        ps = self.page_size
        bad = (pre < 0) | (seq < pre)
        if ps > 1:
            bad |= self._bad_last_loc(last, pre - 1, pre % ps != 0)
        _raise_bad_rows(bad, "alloc_extend")
        if ps > 1:
            self._check_own_pages(last, (pre % ps != 0) & (seq > pre), "alloc_extend")
        if seq.numel() and int(seq.max()) > self.size:  # also keeps the page arithmetic below int64
            raise OutOfBlocksError(f"a request of {int(seq.max())} tokens exceeds the {self.size} slots")
        ext = seq - pre
        if ps == 1:
            return self.alloc(int(ext.sum()))
        held = (pre + ps - 1) // ps
        new = (seq + ps - 1) // ps - held
        pages = self._take(int(new.sum()))
        return self._out(self._extend_slots(pages, pre, ext, last, held, new))

    def alloc_decode(self, seq_lens: IdsLike, last_loc: IdsLike) -> torch.Tensor:
        """One slot per request for its token ``seq_lens[i] - 1`` (seq_lens already count it): int64 ``[R]``.

        ``last_loc[i]`` is the slot of token ``seq_lens[i] - 2``; a new page is taken only when that page is
        full. Raises InvalidArgumentError for seq_lens < 1 or an inconsistent last_loc, OutOfBlocksError.
        """
        seq, last = _lens(seq_lens, last_loc)
        ps = self.page_size
        if ps == 1:
            _raise_bad_rows(seq < 1, "alloc_decode")
            return self.alloc(seq.numel())
        opens = (seq - 1) % ps == 0                      # the new token starts a page
        _raise_bad_rows((seq < 1) | self._bad_last_loc(last, seq - 2, ~opens), "alloc_decode")
        self._check_own_pages(last, ~opens, "alloc_decode")
        pages = self._take(int(opens.sum()))
        if pages.numel() == 0:
            return self._out(last + 1)
        new_slots = pages[(opens.cumsum(0) - 1).clamp_(min=0)] * ps
        return self._out(torch.where(opens, new_slots, last + 1))

    def alloc_contiguous(self, n: IntArg) -> torch.Tensor:
        """``n`` consecutive slot ids (the lowest run of free pages that fits, first fit): int64 ``[n]``.

        Costs O(pool size). Raises OutOfBlocksError when no run of n free slots exists (nothing changes).
        """
        k = self._pages_for(n)
        if k == 0:
            return self._out(torch.empty(0, dtype=torch.int64))
        start = self._find_run(k)
        if start < 0:
            raise OutOfBlocksError(f"no run of {n} contiguous free slots; {self.available_size} free")
        self._snapshot_backup()                          # compaction rewrites the whole free region
        free = self._stack[self._head:]
        rest = free.masked_select((free < start) | (free >= start + k))
        self._stack[self._head + k:].copy_(rest)
        self._mask[start:start + k] = _USED
        self._head += k
        return self._out(torch.arange(start * self.page_size, (start + k) * self.page_size))

    # ---------------------------------------------------------------------------------------- freeing
    def free(self, slots: IdsLike) -> None:
        """Release ``slots`` (any shape, any integer dtype, any device; paged: their pages).

        Inside a free group the ids are copied and released at ``free_group_end()``. Raises InvalidIdError,
        DoubleFreeError (see the class docstring); nothing is released then.
        """
        page = self._view_pages.get(id(slots), -1)  # (no storage_offset(): it costs ~4 us at times)
        if page >= 0 and self._views[page] is slots and self._group is None and \
                self._slot_ids._version == self._slot_version:
            self._free_page(page)  # a one-page view alloc handed out, unchanged: no torch call
            return
        ids = as_id_tensor(slots, "slots", flatten=True)
        if self._group is not None:
            self._group.append(ids.clone())
            return
        n = ids.numel()
        if n == 1:
            self._free_one(ids.item())
        elif 1 < n <= self.page_size and self._one_page(values := ids.tolist()):
            self._free_one(values[0])  # one page's slots (a request's last page): plain Python
        elif n:
            self._free_pages(ids if self.page_size == 1 else ids.div(self.page_size, rounding_mode="floor"))

    def free_group_begin(self) -> None:
        """Collect the following frees and release them as one batch at ``free_group_end()`` (no nesting)."""
        if self._group is not None:
            raise InvalidArgumentError("free_group_begin() while a free group is open (groups do not nest)")
        self._group = []

    def free_group_end(self) -> None:
        """Release every free collected since ``free_group_begin()`` as one call; the group closes even if
        that call raises (and then releases nothing)."""
        if self._group is None:
            raise InvalidArgumentError("free_group_end() without free_group_begin()")
        pending, self._group = self._group, None
        if pending:
            self.free(torch.cat(pending))

    # ------------------------------------------------------------------------------ state management
    def backup_state(self) -> AllocatorState:
        """Remember the free set (O(1)) for a later ``restore_state`` (speculative decoding rollback).

        Only the latest backup can be restored. Raises InvalidArgumentError inside a free group.
        """
        self._no_group("backup_state")
        self._tokens += 1
        self._backup = _Backup(self._tokens, self._head)
        self._frozen = self._head
        return AllocatorState(self._tokens, self.available_size)

    def restore_state(self, state: AllocatorState) -> None:
        """Make the free set exactly what it was at ``backup_state()``; may be repeated.

        Cost: O(slots changed since) when no free reached the backed-up free region, else O(pool size).
        Raises InvalidArgumentError for a state that is not the latest backup, or inside a free group.
        """
        self._no_group("restore_state")
        b = self._backup
        if b is None or not isinstance(state, AllocatorState) or state.token != b.token:
            raise InvalidArgumentError("restore_state() takes the state of the latest backup_state()")
        if b.snapshot is not None:
            self._stack[b.head:].copy_(b.snapshot)
            self._mask.fill_(_USED)
            self._state[0] = _PAD
            self._mask.index_fill_(0, b.snapshot, _FREE)
            b.snapshot = None
        elif self._head > b.head:                        # handed out since: still in place below _head
            self._mask.index_fill_(0, self._stack[b.head:self._head], _FREE)
        elif self._head < b.head:                        # freed since, never reached the backed-up region
            self._mask.index_fill_(0, self._stack[self._head:b.head], _USED)
        self._head = self._frozen = b.head

    def clear(self) -> None:
        """Free every slot except the padding slot; drops frees pending in an open group (the group stays
        open); a live backup can still be restored."""
        self._snapshot_backup()
        if self._group is not None:
            self._group = []
        self._stack.copy_(torch.arange(1, self.num_pages))
        self._mask.zero_()
        self._state[0] = _PAD
        self._head = 0

    def check_integrity(self) -> None:
        """Raise IntegrityError unless: the padding page is reserved; free-stack entries are in
        ``[1, num_pages)``, unique and exactly the pages marked free; free + allocated == num_pages - 1."""
        free, p = self._stack[self._head:], self.num_pages
        if self._state[0] != _PAD or self._state[-1] != _PAD:
            raise IntegrityError("padding page 0 (or the sentinel after the last page) is not reserved")
        if free.numel() and (int(free.min()) < 1 or int(free.max()) >= p):
            raise IntegrityError(f"free stack holds an id outside [1, {p})")
        counts = torch.bincount(free, minlength=p)
        if free.numel() and int(counts.max()) > 1:
            raise IntegrityError("a page is in the free stack twice")
        if not torch.equal(counts[1:] > 0, self._mask[1:] == _FREE):
            raise IntegrityError("free stack and page states disagree")
        if int((self._mask[1:] == _USED).sum()) + free.numel() != p - 1:
            raise IntegrityError(f"free + allocated != {p - 1} pages")

    # ------------------------------------------------------------------------------------- internals
    def _pages_for(self, n: IntArg) -> int:
        n = as_int(n, "n", minimum=0)
        if n % self.page_size:
            raise InvalidArgumentError(f"n must be a multiple of page_size={self.page_size}, got {n}")
        return n // self.page_size

    def _alloc_one_page(self) -> torch.Tensor:
        head = self._head
        if head == self._cap:
            raise OutOfBlocksError(f"need 1 page ({self.page_size} slots), 0 free")
        page = self._ids[head]
        self._state[page] = _USED
        self._head = head + 1
        if not self._on_host:
            return self._out(self._offsets + page * self.page_size)
        view = self._views[page]
        if view is None or self._slot_ids._version != self._slot_version:
            view = self._page_view(page)
        return view

    def _page_view(self, page: int) -> torch.Tensor:
        """The view of ``page``'s slot ids, cached; rebuilds every id first if one was written into."""
        if self._slot_ids._version != self._slot_version:
            self._slot_ids = torch.arange(self.size)
            self._slot_version = self._slot_ids._version
            self._views = [None] * self.num_pages
            self._view_pages = {}
        ps = self.page_size
        view = self._slot_ids[page * ps:page * ps + ps]
        if len(self._view_pages) < MAX_CACHED_VIEWS:  # a cached view stays alive: its id stays its own
            self._views[page] = view
            self._view_pages[id(view)] = page
        return view

    def _take(self, k: int) -> torch.Tensor:
        """Mark the top k free pages allocated; returns them as a view valid until the next push."""
        if k > self._cap - self._head:
            raise OutOfBlocksError(f"need {plural(k, 'page')} ({plural(k * self.page_size, 'slot')}), "
                                   f"{self.num_free_pages} free")
        pages = self._stack[self._head:self._head + k]
        self._mask.index_fill_(0, pages, _USED)
        self._head += k
        return pages

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        return torch.add(self._offsets, pages.unsqueeze(1), alpha=self.page_size).reshape(-1)

    def _extend_slots(self, pages: torch.Tensor, pre: torch.Tensor, ext: torch.Tensor, last: torch.Tensor,
                      held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Slot of every new token: ``last + 1 + (pos - pre)`` inside the held page, else its new page."""
        ps = self.page_size
        ends = ext.cumsum(0)
        tok = torch.arange(int(ends[-1]) if ends.numel() else 0)
        # request of each token (not repeat_interleave: it forks threads even for two requests)
        req = torch.searchsorted(ends, tok, right=True)
        per = torch.stack((pre - ends + ext, held * ps, last + 1 - pre, new.cumsum(0) - new - held))
        pos_off, held_end, old_off, page_off = per.index_select(1, req)
        pos = tok + pos_off                                              # token position in its request
        old = pos + old_off
        if pages.numel() == 0:
            return old
        fresh = pages[(pos.div(ps, rounding_mode="floor") + page_off).clamp_(min=0)] * ps + pos % ps
        return torch.where(pos < held_end, old, fresh)

    def _bad_last_loc(self, last: torch.Tensor, prev_pos: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
        """Rows where ``last`` is used but is not the slot of ``prev_pos`` in an allocated page."""
        ps = self.page_size
        page = last.div(ps, rounding_mode="floor").clamp_(0, self.num_pages)  # out of range -> a _PAD entry
        return used & ((last % ps != prev_pos % ps) | (self._mask_ext.index_select(0, page) != _USED))

    def _check_own_pages(self, last: torch.Tensor, fills: torch.Tensor, what: str) -> None:
        """Raise InvalidArgumentError when two rows that write into their partial last page (``fills``)
        name the same page through ``last``: they would be handed the same slots (aliasing). ``last`` is
        checked already (its pages are allocated). Two vectorized ops, as the deduplication of a free."""
        rows = fills.nonzero().squeeze(1)
        if rows.numel() < 2:
            return
        pages = last.index_select(0, rows).div(self.page_size, rounding_mode="floor")
        order = torch.arange(pages.numel())
        self._stamp.index_copy_(0, pages, order)
        repeat = self._stamp.index_select(0, pages) != order  # one more row of the same page
        if bool(repeat.any()):
            page = pages[repeat.nonzero()[0]]
            first, second = rows.masked_select(pages == page)[:2].tolist()
            raise InvalidArgumentError(f"{what}: requests {first} and {second} both continue page "
                                       f"{int(page)}: the same slots would be handed out twice")

    def _one_page(self, slots: list[int]) -> bool:
        """Whether ``slots`` (at most page_size of them, paged) are in range and all in one page."""
        ps, size = self.page_size, self.size
        page = slots[0] // ps
        return all(0 <= s < size and s // ps == page for s in slots)

    def _free_one(self, slot: int) -> None:
        if not 0 <= slot < self.size:
            raise InvalidIdError(f"slot {slot} out of range [0, {self.size})")
        self._free_page(slot // self.page_size)

    def _free_page(self, page: int) -> None:
        if self._state[page] != _USED:
            raise self._not_allocated(page)
        if self._head > self._frozen:
            self._snapshot_backup()
        self._head -= 1
        self._ids[self._head] = page
        self._state[page] = _FREE

    def _free_pages(self, pages: torch.Tensor) -> None:
        """Validate and release ``pages`` (repeats allowed only when paged) in a fixed number of torch ops."""
        order = torch.arange(pages.numel())
        try:
            self._stamp.index_copy_(0, pages, order)     # raises on a negative or too large id
        except IndexError:
            raise InvalidIdError(f"a slot id is out of range [0, {self.size})") from None
        uniq = pages.masked_select(self._stamp.index_select(0, pages) == order)  # one entry per page
        if self.page_size == 1 and uniq.numel() != pages.numel():
            raise InvalidIdError("a slot id is repeated in one free()")
        states = self._mask.index_select(0, uniq)
        if bool((states != _USED).any()):
            bad = uniq.masked_select(states != _USED)
            raise self._not_allocated(0 if bool((bad == 0).any()) else int(bad[0]))
        self._push(uniq)

    def _push(self, pages: torch.Tensor) -> None:
        if self._head > self._frozen:
            self._snapshot_backup()
        head = self._head - pages.numel()
        self._stack[head:self._head].copy_(pages)
        self._mask.index_fill_(0, pages, _FREE)
        self._head = head

    def _not_allocated(self, page: int) -> Exception:
        unit = "slot" if self.page_size == 1 else "page"
        if page == 0:
            return InvalidIdError(f"{unit} 0 is the padding {unit}; it is never allocated")
        ps = self.page_size
        slots = "" if ps == 1 else f" (slots {page * ps}..{page * ps + ps - 1})"
        return DoubleFreeError(f"{unit} {page}{slots} is not allocated (double free?)")

    def _find_run(self, k: int) -> int:
        """Lowest page starting k consecutive free pages, or -1."""
        free = (self._mask == _FREE).to(torch.int32)
        count = torch.cat((torch.zeros(1, dtype=torch.int64), free.cumsum(0)))  # count[i]: free in [0, i)
        hits = ((count[k:] - count[:-k]) == k).nonzero()
        return int(hits[0]) if hits.numel() else -1

    def _snapshot_backup(self) -> None:
        """Copy a live backup's free region before its first overwrite."""
        b = self._backup
        if b is not None and b.snapshot is None:
            b.snapshot = self._stack[b.head:].clone()
        self._frozen = self._cap

    def _no_group(self, what: str) -> None:
        if self._group is not None:
            raise InvalidArgumentError(f"{what}() inside a free group")

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._on_host else t.to(self.device)


def _lens(*args: IdsLike) -> tuple[torch.Tensor, ...]:
    out = tuple(as_id_tensor(a, "lengths and locations", flatten=True, error=InvalidArgumentError)
                for a in args)
    if len({t.numel() for t in out}) > 1:
        raise InvalidArgumentError(f"per-request inputs differ in length: {[t.numel() for t in out]}")
    return out


def _raise_bad_rows(bad: torch.Tensor, what: str) -> None:
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise InvalidArgumentError(f"{what}: request {row} has a negative or decreasing length, or a "
                                   "last_loc that is not the slot of its previous token in an allocated page")

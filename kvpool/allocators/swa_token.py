"""``SWATokenToKVPoolAllocator``: token slots for a model with full and sliding-window layers (SGLang style).

A token-slot engine (SGLang, mini-sglang) keeps two flat KV buffers: the full layers' (``size`` slots) and
the sliding layers' (``size_swa`` slots, usually far fewer). Every token gets a slot in both; a mapping
``full slot -> SWA slot`` says where its sliding-layer K/V lives, and once the token falls out of the window
its SWA slot is released while its full slot stays (``free_swa``). The engine indexes the full layers with
the slot ids this allocator returns and the sliding layers with ``translate_loc_from_full_to_swa`` of them.

Slot 0 is the padding slot of both pools (never handed out); a mapping entry of 0 means "no SWA slot". Both
pools are :class:`~kvpool.allocators.token.TokenToKVPoolAllocator` with ``page_size`` 1. Every call checks
before it changes anything: one that raises leaves both pools and the mapping as they were.
"""

from __future__ import annotations

import torch

from kvpool.allocators.token import IdsLike, TokenToKVPoolAllocator
from kvpool.errors import IntegrityError, InvalidIdError, OutOfBlocksError
from kvpool.numeric import as_id_tensor, as_int


class SWATokenToKVPoolAllocator:
    """Full and sliding-window token slots with a full-to-SWA slot mapping.

    Args:
        size: slots of the full layers' buffer, padding slot 0 included.
        size_swa: slots of the sliding layers' buffer, padding slot 0 included.
        device: where returned ids live (bookkeeping stays on the host).

    Raises:
        InvalidArgumentError: as :class:`TokenToKVPoolAllocator` for either size.
    """

    def __init__(self, size: int, size_swa: int, *, device: torch.device | str = "cpu") -> None:
        self.full = TokenToKVPoolAllocator(size, device=device)
        self.swa = TokenToKVPoolAllocator(size_swa, device=device)
        self.size, self.size_swa, self.device = size, size_swa, self.full.device
        self._full_to_swa = torch.zeros(size, dtype=torch.int64)  # host; 0 = no SWA slot

    @property
    def available_size(self) -> int:
        """Tokens that can be allocated now: the smaller of the two pools' free slots (SGLang's rule)."""
        return min(self.full.available_size, self.swa.available_size)

    @property
    def full_available_size(self) -> int:
        return self.full.available_size

    @property
    def swa_available_size(self) -> int:
        return self.swa.available_size

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` tokens: a full slot and an SWA slot each; returns the full slot ids, int64 ``[n]``.

        Raises:
            InvalidArgumentError: ``n`` negative or not an int.
            OutOfBlocksError: either pool has fewer than ``n`` free slots (nothing is handed out).
        """
        if type(n) is not int:  # a numpy or 0-d tensor count as the int it holds: checked against both
            n = as_int(n, "n", minimum=0)  # pools before either hands anything out
        if n > self.available_size:
            raise OutOfBlocksError(f"asked for {n} tokens; {self.full.available_size} full and "
                                   f"{self.swa.available_size} sliding-window slots are free")
        full = self.full.alloc(n)
        swa = self.swa.alloc(n)
        self._full_to_swa[full.cpu()] = swa.cpu()
        return full

    def free(self, full_slots: IdsLike) -> None:
        """Release tokens: their full slots and the SWA slots they still hold.

        Raises:
            InvalidIdError, DoubleFreeError: as ``TokenToKVPoolAllocator.free`` for the full slots (nothing
                is released then).
        """
        ids = as_id_tensor(full_slots, "full_slots", flatten=True)
        self.full.free(ids)  # validates every id before anything changes
        swa = self._full_to_swa[ids]
        self.swa.free(swa[swa > 0])
        self._full_to_swa[ids] = 0

    def free_swa(self, full_slots: IdsLike) -> None:
        """Release only the SWA slots of tokens that fell out of the window (their full slots stay); tokens
        that hold no SWA slot any more are skipped.

        Raises:
            InvalidIdError: an id outside ``[1, size)`` (nothing is released).
        """
        ids = self._checked(full_slots)
        swa = self._full_to_swa[ids]
        keep = swa > 0
        self.swa.free(swa[keep])
        self._full_to_swa[ids[keep]] = 0

    def translate_loc_from_full_to_swa(self, full_slots: IdsLike) -> torch.Tensor:
        """The SWA slot of each full slot (0 where the token holds none), int64 on ``device``.

        Raises:
            InvalidIdError: an id outside ``[0, size)``.
        """
        return self._full_to_swa[self._checked(full_slots, low=0)].to(self.device)

    def _checked(self, slots: IdsLike, *, low: int = 1) -> torch.Tensor:
        ids = as_id_tensor(slots, "full_slots", flatten=True)
        if ids.numel() and (int(ids.min()) < low or int(ids.max()) >= self.size):
            raise InvalidIdError(f"full slot ids must be in [{low}, {self.size}), got "
                                 f"{int(ids.min())} .. {int(ids.max())}")
        return ids

    def clear(self) -> None:
        """Free everything in both pools."""
        self.full.clear()
        self.swa.clear()
        self._full_to_swa.zero_()

    def check_integrity(self) -> None:
        """Both pools' invariants, and the mapping: only allocated full slots map to an SWA slot, no two to
        the same one, and exactly the allocated SWA slots are mapped to. Raises IntegrityError."""
        self.full.check_integrity()
        self.swa.check_integrity()
        mapped = self._full_to_swa[self._full_to_swa > 0]
        free_full = self.full.free_pages()
        if free_full.numel() and bool((self._full_to_swa[free_full] != 0).any()):
            raise IntegrityError("a free full slot still maps to an SWA slot")
        if mapped.unique().numel() != mapped.numel():
            raise IntegrityError("two full slots map to the same SWA slot")
        swa_used = self.size_swa - 1 - self.swa.available_size
        free_swa = set(self.swa.free_pages().tolist())
        if mapped.numel() != swa_used or free_swa & set(mapped.tolist()):
            raise IntegrityError("the mapped SWA slots are not exactly the allocated ones")

    def __repr__(self) -> str:
        return (f"SWATokenToKVPoolAllocator(size={self.size}, size_swa={self.size_swa}, "
                f"available={self.available_size})")

"""A hybrid's state checkpoints below the device: :class:`CheckpointTiers` stores each checkpoint the
device evicts into the tiers and finds it there again, so a prefix whose KV a tier restores is a hit of the
hybrid too when its checkpoint was evicted from the device.

**Keys.** A checkpoint goes down under :func:`~kvpool.allocators.groups.group_key` ``(group, block hash)``,
``group`` the state's own group (the number of KV cache groups), so it never meets a KV block's key in a
tier (:func:`~kvpool.tiers.backend.block_key` hashes the pair as it hashes a KV group's, vLLM's offload key
form).

**Rows.** One checkpoint is one tier row of ``bytes_per_slot`` bytes (every recurrent layer's conv, then SSM
state of one slot: :meth:`~kvpool.storage.state.RecurrentStateCache.read_slots`). The tiers are of the KV
side's kinds (host, disk, Redis) and the same :class:`~kvpool.tiers.backend.TierBackend` contract; where
no data moves (a trace replay, rows of 0 bytes) they are the KV chain's own tier objects, where data moves
they are built for the state's row size in the state group's namespace (a tier checks each row's size).

**Stores.** Inclusive, as a write-through chain: an evicted checkpoint is stored in every tier (each bounds
and evicts its own). **Loads.** :meth:`find` asks the tiers in order; a tier that lacks the key, or gives
it truncated, forged or not at all (a fault below), is a miss there, and the next tier is asked: a state
comes back intact or not at all, never wrong.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.errors import InvalidArgumentError
from kvpool.numeric import as_int
from kvpool.requests.checkpoint_store import state_key

if TYPE_CHECKING:
    from kvpool.tiers.backend import TierBackend


class StateRows(Protocol):
    """What moves a checkpoint's bytes: :class:`~kvpool.storage.state.RecurrentStateCache`."""

    @property
    def bytes_per_slot(self) -> int: ...

    def read_slots(self, slots: Sequence[int]) -> Any: ...

    def write_slots(self, slots: Sequence[int], rows: Any) -> None: ...


class CheckpointTiers:
    """The tiers under a hybrid's state checkpoints (see the module docstring).

    Args:
        tiers: the tiers, fastest first, each with ``block_bytes`` equal to the rows' size (0 without
            ``rows``).
        group: the state's group index (>= 1: the number of KV cache groups).
        rows: the state store whose slots the rows come from and go to (None: hashes only).

    Raises:
        InvalidArgumentError: a tier of another row size, or a group below 1.
    """

    def __init__(self, tiers: Sequence[TierBackend], group: int, *, rows: StateRows | None = None) -> None:
        self.tiers, self.rows = list(tiers), rows
        self.group = as_int(group, "group", minimum=1)
        self.row_bytes = 0 if rows is None else rows.bytes_per_slot
        for tier in self.tiers:
            if tier.block_bytes != self.row_bytes:
                raise InvalidArgumentError(f"the {tier.medium} tier stores {tier.block_bytes} B rows, a "
                                           f"state checkpoint is {self.row_bytes} B")
        #: Checkpoints stored (each into every tier), found, and reads that failed in a tier holding the key.
        self.stored = self.found = self.load_failures = 0

    def key(self, block_hash: Hashable) -> Hashable:
        return state_key(self.group, block_hash)

    def store(self, block_hash: Hashable, slot: int) -> None:
        """Store the checkpoint of ``block_hash`` held in ``slot`` into every tier (the device is about to
        reuse the slot)."""
        rows = None if self.rows is None else self.rows.read_slots([slot])
        key = self.key(block_hash)
        for tier in self.tiers:
            tier.set([key], rows)
        self.stored += 1

    def find(self, block_hash: Hashable) -> tuple[int, Any] | None:
        """The checkpoint of ``block_hash`` from the first tier that gives it intact: ``(tier index, its
        row)`` (the row a CPU ``uint8 [1, row_bytes]`` tensor, None without data); None when no tier does."""
        key = self.key(block_hash)
        for t, tier in enumerate(self.tiers):
            if not tier.exists([key]):
                continue
            out = None
            if self.rows is not None:
                import torch

                out = torch.empty((1, self.row_bytes), dtype=torch.uint8)
            if tier.get([key], out) == 1:
                self.found += 1
                return t, out
            self.load_failures += 1  # held but not given intact: a miss, the next tier is asked
        return None

    def restore(self, slot: int, row: Any, block_hash: Hashable = None) -> None:
        """Write a row :meth:`find` gave for ``block_hash`` into ``slot`` (nothing without data; the hash
        names the checkpoint to a tensor-parallel leader's recorder: :mod:`kvpool.engine.tp_state`)."""
        if self.rows is not None and row is not None:
            self.rows.write_slots([slot], row)

    def stats(self) -> dict[str, int]:
        """``stored``, ``found`` and ``load_failures`` (see the attributes)."""
        return {"stored": self.stored, "found": self.found, "load_failures": self.load_failures}

"""``HostRowsTier``: a host tier of plain byte rows, for values that are not KV blocks shaped like a device
cache (a hybrid's recurrent state checkpoints, one state slot a row).

It is a :class:`~kvpool.tiers.host.HostTier` in every rule (its own :class:`BlockPool` indexes the rows by
key in LRU order; a store into a full tier recycles the least recently used row; reads refresh; stats and
checks the same) whose memory is one CPU ``uint8 [num_blocks, block_bytes]`` tensor instead of a
:class:`~kvpool.storage.host.HostKVCache`: the rows move by the generic ``get`` / ``set`` only (no device
swap path, nothing in flight).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from kvpool.allocators.block_pool import BlockPool
from kvpool.errors import ConfigError
from kvpool.numeric import as_int
from kvpool.tiers.backend import Namespace, TierBackend
from kvpool.tiers.host import HostTier


class HostRowsTier(HostTier):
    """``num_blocks`` host rows of ``block_bytes`` bytes each.

    Raises:
        ConfigError: ``num_blocks`` or ``block_bytes`` not an integer >= 1, or the rows cannot be allocated.
    """

    def __init__(self, num_blocks: int, namespace: Namespace, block_bytes: int) -> None:
        n = as_int(num_blocks, "num_blocks", minimum=1, error=ConfigError)
        row = as_int(block_bytes, "block_bytes", minimum=1, error=ConfigError)
        TierBackend.__init__(self, namespace, row)
        try:
            self.rows = torch.empty((n, self.block_bytes), dtype=torch.uint8)
        except RuntimeError as exc:
            raise ConfigError(f"cannot allocate {n} host rows of {self.block_bytes} B: "
                              f"{str(exc).splitlines()[0]}") from None
        self.host, self.pool = None, BlockPool(n)
        self._overflow = 0
        self.ops = 0

    def get(self, keys: Sequence[Hashable], out: torch.Tensor | None) -> int:
        self._check_rows(keys, out, "out")
        with self._lock:
            ids = self._hold_prefix(keys)
            if ids:
                out[:len(ids)] = self.rows[ids]  # type: ignore[index]
            return self._release_loaded(ids, len(keys))

    #: Blocks always carry bytes here (its own rows).
    _holds_data = True

    def _write_rows(self, ids: list[int], new: list[int], blocks: torch.Tensor) -> None:
        """Write ``blocks[new]`` into rows ``ids`` (the lock held); :meth:`HostTier.set` does the rest."""
        self.rows[ids] = blocks[new]

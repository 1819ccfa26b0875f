"""``BlockStore``: one pre-allocated buffer whose one dimension indexes blocks, the base of the KV stores.

The machinery :class:`kvpool.storage.paged.PagedKVCache` and :class:`kvpool.storage.mla.MLAKVCache` share:
allocation (fixed or on a page arena, :class:`~kvpool.storage.elastic.ElasticMemory`), raw byte views,
slot and block id checks, ``copy_blocks`` and the block moves of the tiers, memory stats.
:mod:`kvpool.storage.paged` re-exports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.numeric import as_int
from kvpool.storage.arena import ElasticConfig, elastic_config
from kvpool.storage.block_copy import BlockIds, check_block_ids, copy_pairs, copy_within
from kvpool.storage.elastic import ElasticMemory
from kvpool.storage.resident import resident_bytes
from kvpool.storage.slots import FP8_DTYPES, check_slot_mapping, raw_dtype
from kvpool.units import plural


def _process_rss() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


class BlockStore(ElasticMemory):
    """One pre-allocated buffer whose dimension ``block_dim`` indexes blocks; shared by the KV caches.

    Zeroing: the buffer comes from ``torch.empty`` unless ``zero=True``. On CPU that keeps pages lazily
    committed (resident memory grows only with what is written, see ``stats()``), and every reader here
    (``gather``, the engine's paged attention) reads only slots that were written. Pass ``zero=True`` for a
    kernel that loads whole blocks and masks the tail after the fact: unwritten memory may hold NaN, and
    ``0 * NaN`` is NaN. ``pin_memory=True`` (page-locked, for async host<->device copies) commits all pages.

    ``elastic``: the buffer is a view of a :class:`~kvpool.storage.arena.PageArena` instead
    (:class:`~kvpool.storage.elastic.ElasticMemory`): address space for every block, physical memory only
    for the pages under the blocks :meth:`commit_blocks` names, reading 0 when committed.
    """

    block_dim: int

    def __init__(self, shape: Sequence[int], block_size: int, *, device: str | torch.device,
                 dtype: torch.dtype, pin_memory: bool, zero: bool, elastic: bool | ElasticConfig = False
                 ) -> None:
        num_blocks = as_int(shape[self.block_dim], "num_blocks", minimum=1, error=ConfigError)
        shape = [*shape[:self.block_dim], num_blocks, *shape[self.block_dim + 1:]]
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"the KV cache dtype must be a floating torch.dtype, got {dtype!r}")
        config = elastic_config(elastic)
        if config is not None and pin_memory:
            raise ConfigError("an elastic buffer cannot be pinned (pinning commits every page at once)")
        factory = torch.zeros if zero else torch.empty
        try:
            self._rss_before = _process_rss() if torch.device(device).type == "cpu" else None
            if config is not None:  # committed pages read 0: zero needs nothing more
                (self.buffer,) = self.allocate_elastic(config, device, [(tuple(shape), dtype)],
                                                       self.block_dim)
            else:
                self.buffer = factory(tuple(shape), dtype=dtype, device=device, pin_memory=pin_memory)
        except (RuntimeError, AssertionError) as exc:  # a bad device, no pinned memory, out of memory
            raise ConfigError(f"cannot allocate the KV buffer {list(shape)} {dtype} on {device!r}: "
                              f"{str(exc).splitlines()[0]}") from None
        self.dtype = dtype
        self.device = self.buffer.device
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self._raw = self.buffer.view(raw_dtype(shape[-1] * dtype.itemsize))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer (what ``torch.empty`` reserved; see ``stats()`` for what is resident)."""
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every layer (and K and V)."""
        return self.nbytes // self.num_blocks

    def copy_blocks(self, pairs: Sequence[tuple[int, int]] | torch.Tensor) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of a shared partial block).

        ``pairs``: ``(src, dst)`` pairs or an int ``[P, 2]`` tensor. Two index ops on the whole buffer: all
        sources are read before any destination is written (:func:`~kvpool.storage.block_copy.copy_within`).
        Raises :class:`InvalidIdError` for an id out of range or a destination named twice; nothing is
        copied then.
        """
        ids = copy_pairs(pairs, self.num_blocks, self.device)
        if ids is not None:
            copy_within(self._raw, self.block_dim, *ids)

    def read_blocks(self, block_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of whole blocks across every layer, as raw words: the buffer's shape with ``len(block_ids)``
        blocks, in an integer/complex dtype of the same bytes. ``block_ids``: int64 on this device, already
        checked (:func:`check_block_ids`). ``out``: e.g. a pinned staging tensor of that shape and dtype."""
        return torch.index_select(self._raw, self.block_dim, block_ids, out=out)

    def raw_blocks(self) -> torch.Tensor:
        """The buffer as raw words with the block dimension first, ``[num_blocks, ...]`` (a view): row ``b``
        is block ``b`` in every layer (contiguous within a layer, strided across layers)."""
        return self._raw.movedim(self.block_dim, 0)

    def empty_blocks(self, num_blocks: int, *, pin_memory: bool = False) -> torch.Tensor:
        """An uninitialized CPU tensor shaped like :meth:`read_blocks` output for ``num_blocks`` blocks
        (a staging buffer for host<->device copies)."""
        shape = list(self._raw.shape)
        shape[self.block_dim] = num_blocks
        return torch.empty(shape, dtype=self._raw.dtype, pin_memory=pin_memory)

    def write_blocks(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write :meth:`read_blocks` output (of a store with the same shape per block) into ``block_ids``
        (int64 on this device, checked, distinct)."""
        self._raw.index_copy_(self.block_dim, block_ids, blocks)

    def resident_bytes(self) -> int | None:
        """Bytes of this buffer resident in RAM (its own pages, by ``mincore``; see
        :mod:`kvpool.storage.resident`): what was written (or zeroed, or pinned) so far. None off the CPU."""
        return resident_bytes(self.buffer)

    def stats(self) -> dict[str, Any]:
        """``num_blocks``, ``block_size``, ``dtype``, ``device``, ``nbytes``, ``bytes_per_block``,
        ``resident_bytes`` (this buffer's pages in RAM, :meth:`resident_bytes`), the whole process's
        ``rss_bytes`` and ``rss_growth_bytes`` (RSS minus RSS before the allocation: everything the process
        allocated since, not just this cache), None where unknown (off the CPU, or without psutil); and
        ``elastic``: the page arena's stats (:meth:`ElasticMemory.elastic_stats`; None for a fixed buffer)."""
        rss = _process_rss() if self.device.type == "cpu" else None
        growth = rss - self._rss_before if rss is not None and self._rss_before is not None else None
        return {"num_blocks": self.num_blocks, "block_size": self.block_size, "dtype": str(self.dtype),
                "device": str(self.device), "nbytes": self.nbytes, "bytes_per_block": self.bytes_per_block,
                "resident_bytes": self.resident_bytes(), "rss_bytes": rss, "rss_growth_bytes": growth,
                "elastic": self.elastic_stats()}

    def _check_layer(self, layer: int, num_layers: int) -> int:
        """``layer`` as a Python int in ``[0, num_layers)`` (:mod:`kvpool.numeric`); InvalidArgumentError."""
        if type(layer) is int and 0 <= layer < num_layers:
            return layer
        return as_int(layer, "layer", minimum=0, maximum=num_layers - 1)

    def _padding_after_check(self, slot_mapping: torch.Tensor, num_tokens: int, check: bool) -> bool:
        """Check ``slot_mapping`` for a store of ``num_tokens`` rows; return whether it may hold -1 slots.
        The slot range is checked on the host always, and on CUDA unless ``check`` is False (a host sync);
        type, dtype, shape and device always."""
        values = check or self.device.type != "cuda"
        return check_slot_mapping(slot_mapping, num_tokens, self.num_slots, self.device, values=values)

    def _check_rows(self, x: torch.Tensor, name: str, tail: tuple[int, ...], num_tokens: int | None) -> int:
        """Check ``x`` is ``[T, *tail]`` on this device with a storable dtype; return T."""
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a tensor, got {type(x).__name__}")
        shape = x.shape
        if len(shape) != 1 + len(tail) or shape[1:] != tail or num_tokens not in (None, shape[0]):
            want = f"[{num_tokens if num_tokens is not None else 'T'}, {', '.join(map(str, tail))}]"
            raise InvalidArgumentError(f"{name} must have shape {want}, got {list(x.shape)}")
        if x.device != self.device:
            raise InvalidArgumentError(f"{name} is on {x.device}, the cache on {self.device}")
        convertible = self.dtype in FP8_DTYPES and x.dtype.is_floating_point and x.dtype.itemsize > 1
        if x.dtype != self.dtype and not convertible:
            raise InvalidArgumentError(f"{name} has dtype {x.dtype}, the cache stores {self.dtype}")
        return x.shape[0]

    def _block_index(self, block_table: BlockIds, seq_len: int) -> torch.Tensor:
        """The first ``ceil(seq_len / block_size)`` ids of ``block_table``, checked, on this device."""
        seq_len = as_int(seq_len, "seq_len", minimum=0)
        needed = -(-seq_len // self.block_size)  # exact integer ceiling (no float rounding)
        if not isinstance(block_table, torch.Tensor | Sequence):
            raise InvalidArgumentError(f"block_table must be a list or tensor of ids, got {block_table!r}")
        if len(block_table) < needed:
            raise InvalidArgumentError(f"seq_len {seq_len} needs {plural(needed, 'block')}, block_table has "
                                       f"{len(block_table)}")
        return check_block_ids(block_table[:needed], self.num_blocks).to(self.device)

"""Block copies, in one place: every copy of whole KV blocks (or state slots) kvpool makes goes through here.

* :func:`check_block_ids` checks the ids every copy (and every other block call of a store) takes, and
  :func:`copy_pairs` the ``(src, dst)`` pairs of a copy-on-write call (checked, never truncated).
* :func:`copy_within` copies blocks of one buffer into other blocks of it, every source read before any
  destination is written (copy-on-write of a shared partial block; a state checkpoint).
* :func:`copy_blocks` copies blocks of one store into blocks of another store with the same per-block shape
  and dtype (a swap between a device cache and its host copy): on the CPU one strided ``copy_`` per block,
  which moves the bytes once (``index_copy_`` along the block dimension runs at about a quarter of that
  here); elsewhere one gather and one scatter along the block dimension.
* :func:`copy_token_prefix` copies the first token slots of blocks into other blocks, every layer's K and V
  (a prefix hit that ends inside a block: copy-on-partial-reuse, :mod:`kvpool.requests.partial_hits`).
* :func:`gather_rows` and :func:`scatter_rows` copy blocks to and from contiguous byte rows ``uint8 [n,
  bytes_per_block]``, the unit the lower tiers store (:mod:`kvpool.tiers.backend`).

A store's raw view (:meth:`~kvpool.storage.block_store.BlockStore.raw_blocks`, the buffer as raw words
with the block dimension first) is what all of them read and write, so a copy is bit-exact whatever the
dtype (fp8 included). The asynchronous device <-> host swaps (streams, pinned staging, events) are the
host cache's (:mod:`kvpool.storage.host`); their bytes move with the store's ``read_blocks`` /
``write_blocks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kvpool.errors import InvalidArgumentError, InvalidIdError
from kvpool.numeric import as_id_tensor, as_int


class BlockStore(Protocol):
    """What the copies read of a store: its raw view (:class:`kvpool.storage.block_store.BlockStore` and every
    store built on it have one)."""

    def raw_blocks(self) -> torch.Tensor:
        """The buffer as ``[num_blocks, ...]`` raw words, the block dimension first."""
        ...

#: Block ids as the stores take them: a sequence of integers or a 1-D integer tensor.
BlockIds = Sequence[int] | torch.Tensor


def check_block_ids(block_ids: BlockIds, num_blocks: int, *, distinct: bool = False) -> torch.Tensor:
    """``block_ids`` (a sequence of integers or a 1-D integer tensor, as :mod:`kvpool.numeric` defines
    them: never bools) as a CPU int64 tensor, after checking each is in ``[0, num_blocks)`` and, when
    ``distinct``, that none repeats.

    Raises :class:`InvalidIdError` (an :class:`InvalidArgumentError`) for a non-integer, a bool, a meta or
    non-1-D tensor, or an id out of range or repeated.
    """
    ids = as_id_tensor(block_ids, "block ids")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise InvalidIdError(f"block ids must be in [0, {num_blocks}), got {ids.tolist()}")
    if distinct and ids.unique().numel() != ids.numel():
        raise InvalidIdError(f"block ids repeat: {ids.tolist()}")
    return ids


def copy_pairs(pairs: Sequence[tuple[int, int]] | torch.Tensor, num_blocks: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(src, dst)`` int64 ids on ``device`` of ``pairs`` (pairs of ids, or an int ``[P, 2]`` tensor), or
    None for no pairs. Ids follow :mod:`kvpool.numeric` (a float id is refused, never truncated to a block).

    Raises:
        InvalidArgumentError: not pairs of ids.
        InvalidIdError: an id outside ``[0, num_blocks)``, or a destination named twice.
    """
    if isinstance(pairs, torch.Tensor):
        table = pairs
    else:  # never ``torch.tensor(pairs, dtype=int64)``: it truncates a float id to a block
        try:
            flat = [block for src, dst in pairs for block in (src, dst)]
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"pairs must be (src, dst) pairs of ids, got {pairs!r}") from None
        table = as_id_tensor(flat, "ids").reshape(-1, 2)
    if table.numel() == 0:
        return None
    if table.dim() != 2 or table.shape[1] != 2:
        raise InvalidArgumentError(f"pairs must be (src, dst) pairs, got shape {list(table.shape)}")
    src = check_block_ids(table[:, 0], num_blocks).to(device)
    dst = check_block_ids(table[:, 1], num_blocks, distinct=True).to(device)
    return src, dst


def copy_within(buffer: torch.Tensor, dim: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy entries ``src`` of ``buffer`` along ``dim`` into entries ``dst`` (checked ids on its device,
    ``dst`` distinct): one gather of every source, then one scatter, so the pairs may overlap."""
    buffer.index_copy_(dim, dst, buffer.index_select(dim, src))


def copy_blocks(src: BlockStore, src_ids: Sequence[int], dst: BlockStore, dst_ids: Sequence[int]) -> None:
    """Copy blocks ``src_ids`` of ``src`` into blocks ``dst_ids`` of ``dst``, another store with the same
    per-block shape and dtype (ids checked by the caller, ``dst_ids`` distinct)."""
    mine, theirs = block_rows(src), block_rows(dst)
    if mine.device.type == theirs.device.type == "cpu":
        for s, d in zip(src_ids, dst_ids, strict=True):
            theirs[d].copy_(mine[s])
        return
    ids = torch.tensor(list(src_ids), dtype=torch.int64, device=mine.device)
    rows = mine.index_select(0, ids).to(theirs.device)
    theirs.index_copy_(0, torch.tensor(list(dst_ids), dtype=torch.int64, device=theirs.device), rows)


def copy_token_prefix(store: Any, pairs: Sequence[tuple[int, int]], num_tokens: int) -> None:
    """Copy the first ``num_tokens`` token slots of block ``src`` into block ``dst`` for each ``(src, dst)``
    of ``pairs``, in every layer's K and V (a :class:`~kvpool.storage.paged.PagedKVCache` in any layout:
    its ``k_cache`` / ``v_cache`` views ``[N, B, ...]``) or latent (an MLA cache's ``kv_cache``). Bit-exact
    (fp8 included: the scales are per cache); the other slots of ``dst`` are left as they are. Every source
    is read before any destination is written.

    Raises:
        InvalidIdError: an id outside ``[0, num_blocks)`` or a destination named twice.
        InvalidArgumentError: ``num_tokens`` not an integer in ``[0, block_size]``. Nothing is copied then.
    """
    ids = copy_pairs(pairs, store.num_blocks, store.device)
    n = as_int(num_tokens, "num_tokens", minimum=0, maximum=store.block_size)
    if ids is None or n == 0:
        return
    src, dst = ids
    latent = not hasattr(store, "v_cache")
    for layer in range(store.num_layers):
        for view in (store.kv_cache(layer),) if latent else (store.k_cache(layer), store.v_cache(layer)):
            view[dst, :n] = view[src, :n]


def block_rows(store: BlockStore) -> torch.Tensor:
    """A view of ``store``'s buffer as ``[num_blocks, ...]`` raw words with the block dimension first: row
    ``b`` is block ``b``'s bytes in every layer (contiguous within a layer, strided across layers)."""
    return store.raw_blocks()


def gather_rows(store: BlockStore, block_ids: Sequence[int], out: torch.Tensor) -> None:
    """Copy blocks ``block_ids`` of ``store`` into ``out[:n]`` (CPU ``uint8 [>= n, bytes_per_block]``,
    contiguous), one row per block: one ``index_select`` on the CPU; on a GPU a gather there and one copy."""
    rows = block_rows(store)
    n = len(block_ids)
    dst = out[:n].view(rows.dtype).view(n, *rows.shape[1:])
    ids = torch.tensor(block_ids, dtype=torch.int64, device=rows.device)
    if rows.device.type == "cpu":
        torch.index_select(rows, 0, ids, out=dst)
    else:
        dst.copy_(rows.index_select(0, ids))


def scatter_rows(store: BlockStore, block_ids: Sequence[int], rows_in: torch.Tensor) -> None:
    """Copy byte rows ``rows_in[:n]`` into blocks ``block_ids`` of ``store`` (ids distinct)."""
    rows = block_rows(store)
    n = len(block_ids)
    src = rows_in[:n].view(rows.dtype).view(n, *rows.shape[1:])
    if rows.device.type != "cpu":
        ids = torch.tensor(block_ids, dtype=torch.int64, device=rows.device)
        rows.index_copy_(0, ids, src.to(rows.device))
        return
    for i, block in enumerate(block_ids):  # one strided copy per block: faster than index_copy_ on a view
        rows[block].copy_(src[i])

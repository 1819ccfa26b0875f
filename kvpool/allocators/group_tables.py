"""The tables of :class:`~kvpool.allocators.groups.KVCacheCoordinator`: group keys, a request's tables, a hit.

A block is keyed in the prefix index by its chained hash and its KV cache group (:func:`group_key`); a
request holds one block table per group (:class:`RequestTables`), and a prefix hit names each group's
first k table entries (:class:`CacheHit`). :func:`check_tables` checks the tables against the pool.
Compiled with the coordinator (``kvpool._native.COMPILED_MODULES``): it builds these on every admission.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.errors import IntegrityError
from kvpool.numeric import IntArg, as_int

if TYPE_CHECKING:
    from kvpool.spec.kv import KVCacheGroup


def group_key(group: int, block_hash: Hashable) -> Hashable:
    """The prefix-index key of ``block_hash`` in KV cache group ``group``: the hash for group 0, else
    ``(group, hash)`` (a tuple never equals a 16-byte hash, so groups never share a key)."""
    return block_hash if group == 0 else (group, block_hash)


def split_group_key(key: Hashable) -> tuple[int, Hashable]:
    """The ``(group, block hash)`` a :func:`group_key` names (a KV event sink reads the pool's keys so)."""
    return (key[0], key[1]) if key_group(key) else (0, key)  # type: ignore[index]


class RequestTables:
    """One request's state: a block table per group, each group's leading null entries, the full blocks
    published, and the computed tokens at which a window next moves past a block."""

    __slots__ = ("tables", "skipped", "published", "next_skip")

    def __init__(self, tables: list[list[int]], skipped: list[int], published: int) -> None:
        self.tables = tables
        self.skipped = skipped
        self.published = published
        self.next_skip = 0


@dataclass(frozen=True)
class CacheHit:
    """The longest cached prefix of a request, per group. ``num_blocks``: k, the prompt blocks every group
    can restore; ``blocks[g]``: group g's first k table entries (the null block where g needs none);
    ``block_hashes``: the request's first k block hashes, which
    :meth:`~kvpool.allocators.groups.KVCacheCoordinator.allocate` checks each hit block still holds (under
    its group's key) before it touches it (empty: only that each block still holds a hash)."""

    num_blocks: int
    blocks: tuple[list[int], ...]
    block_hashes: tuple[Hashable, ...] = ()


def check_tables(pool: Any, groups: Sequence[KVCacheGroup], null: int,
                 requests: dict[Hashable, RequestTables]) -> None:
    """Every group's tables of ``requests`` against ``pool`` (whose own invariants are checked apart;
    ``null``: its null block, -1 without one): ref counts equal the table entries naming each block plus its
    pins; a block appears in one group only; a group of a kind that frees no block holds no null entry, the
    others only a prefix of them; a published block holds its own group's key. O(blocks in tables +
    num_blocks). Raises IntegrityError naming what broke."""
    owners: dict[int, int] = {}
    counts: dict[int, int] = {}
    for request_id, req in requests.items():
        for g, table in enumerate(req.tables):
            skipped = req.skipped[g]
            require(all(b == null for b in table[:skipped]) and null not in table[skipped:],
                   f"request {request_id!r} group {g}: null entries are not exactly its skipped prefix")
            require(skipped == 0 or groups[g].memory_kind.frees_blocks,
                   f"request {request_id!r}: group {g}, of a kind that frees no block, holds the null "
                   f"block")
            for b in table[skipped:]:
                require(owners.setdefault(b, g) == g, f"block {b} is in the tables of two groups")
                counts[b] = counts.get(b, 0) + 1
    pins = pool.pinned_blocks()
    for b, n in counts.items():
        require(pool.ref_count(b) == n + pins.get(b, 0),
                f"block {b} has ref count {pool.ref_count(b)} but {n} table entries and "
                f"{pins.get(b, 0)} pins")
        h = pool.block_hash(b)
        require(h is None or key_group(h) == owners[b], f"block {b} holds another group's key")
    require(len(counts.keys() | pins.keys()) == pool.num_used_blocks,
             "a block is in use outside every table and pin")


def tokens_arg(num_tokens: IntArg) -> int:
    """``num_tokens`` as an int >= 0 (an int passes without a call into :mod:`kvpool.numeric`)."""
    if type(num_tokens) is int and num_tokens >= 0:
        return num_tokens
    return as_int(num_tokens, "num_tokens", minimum=0)


def key_group(key: Hashable) -> int:
    """The group a prefix-index key names (:func:`group_key`): 0 for a bare hash."""
    return key[0] if type(key) is tuple and len(key) == 2 and type(key[0]) is int else 0


def require(ok: bool, invariant: str) -> None:
    """IntegrityError naming ``invariant`` unless ``ok``."""
    if not ok:
        raise IntegrityError(f"KVCacheCoordinator invariant broken: {invariant}")

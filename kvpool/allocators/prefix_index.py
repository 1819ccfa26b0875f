"""The prefix index of a :class:`~kvpool.allocators.block_pool.BlockPool`: which block holds each published
hash, and which hash each block holds, in flat arrays that grow with the blocks handed out.

Bookkeeping per block, 8 bytes, and per distinct hash one 4-byte slot of a table at most 3/4 full, with no
Python object per block for integer hashes (a trace's hash ids):

* ``key[b]``: the hash block ``b`` holds as a 64-bit integer: the hash itself when it is an ``int`` in the
  int64 range (other than :data:`NO_HASH`), else Python's ``hash()`` of it, the object itself kept in
  ``_objects[b]`` (a per-block list made at the first such hash: bytes, tuples); :data:`NO_HASH` when ``b``
  holds none. An ``int`` hash equals only an equal ``int`` hash; any other hash equals the objects it
  compares equal to (``==``, same ``hash()``).
* ``_slots``: an open-addressing table (linear probing) of ``block + 1`` (0: empty) of the block lookups find
  for each distinct hash, placed by a multiplicative hash of its key; a removal shifts the entries after it
  back (no tombstones), and the table doubles past 3/4 full.
* ``dups``: hash -> the further blocks holding it, in publish order (two requests computed the same block at
  once: rare, so a dict of lists). When the block lookups find loses its hash, the first of them takes its
  place (vLLM's ``BlockHashToBlockMap``).

The pool validates every argument first: block ids given here are in range, a block given to
:meth:`PrefixIndex.publish` holds no hash, one given to :meth:`PrefixIndex.remove` holds one.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Final

from librt.vecs import vec
from mypy_extensions import i32, i64

from kvpool.allocators.arrays import extend_to, grown_i32, grown_i64, release_freed_memory

#: ``key[b]`` of a block that holds no hash: -2**62, inside the range of the small ints mypyc keeps unboxed
#: (a compare with it is one native compare; -2**63 would be a boxed constant converted at every use).
NO_HASH: Final = -(1 << 62)
_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1
_MIN_SLOTS: Final = 8
_MIX: Final = 0x5BD1E995  # an odd 31-bit multiplier (MurmurHash2's): times a 32-bit value, below 2**63


def key_of(block_hash: object) -> tuple[i64, bool]:
    """``(key, is_object)`` of a hash: an ``int`` hash (an int in the int64 range other than NO_HASH) is its
    own key; any other hash's key is its ``hash()``, moved off NO_HASH, and it is kept as an object. Raises
    TypeError for an unhashable value."""
    if type(block_hash) is int and _INT64_MIN <= block_hash <= _INT64_MAX and block_hash != NO_HASH:  # noqa: E721
        return block_hash, False  # (type() is int: a bool is no int hash)
    k: i64 = hash(block_hash)
    return (NO_HASH + 1 if k == NO_HASH else k), True


class PrefixIndex:
    """Published hashes and the blocks that hold them (see the module docstring)."""

    def __init__(self) -> None:
        self.key: vec[i64] = vec[i64]()
        self._objects: list[object] = []  # per block once the first hash that is no int hash arrives
        self._slots: vec[i32] = grown_i32(vec[i32](), _MIN_SLOTS, 0)
        self._mask: i64 = _MIN_SLOTS - 1
        self._shift: i64 = 32 - 3  # the home of a key: the top log2(len(_slots)) bits of a 32-bit product
        self._used = 0  # distinct hashes: filled slots
        self.dups: dict[object, list[int]] = {}
        self.num_dups = 0  # blocks in the lists of ``dups``

    def grow(self, capacity: int) -> None:
        """Cover block ids below ``capacity`` (they hold no hash)."""
        if capacity > len(self.key):
            self.key = grown_i64(self.key, capacity, NO_HASH)
            if self._objects:
                extend_to(self._objects, capacity, None)

    # ---- reading ----------------------------------------------------------------------------------------

    def holds(self, block: int) -> bool:
        """Whether ``block`` holds a hash."""
        return self.key[block] != NO_HASH

    def hash_of(self, block: int) -> Hashable | None:
        """The hash ``block`` holds (an int hash as an equal int), or None."""
        k = self.key[block]
        if k == NO_HASH:
            return None
        if self._objects:
            held = self._objects[block]
            if held is not None:
                return held
        return int(k)

    def find(self, block_hash: object) -> int:
        """The block lookups find for ``block_hash``, or -1. Raises TypeError for an unhashable value."""
        k, is_object = key_of(block_hash)
        pos = self._locate(k, block_hash, is_object)
        return int(self._slots[pos]) - 1 if pos >= 0 else -1

    def _locate(self, k: i64, block_hash: object, is_object: bool) -> int:
        """The slot of the entry for ``block_hash`` (key ``k``), or ``~slot`` of the empty slot where it
        would go: a linear probe from the key's home to the first empty slot."""
        slots, key, mask = self._slots, self.key, self._mask
        pos = self._home(k)
        while True:
            s = int(slots[pos])
            if s == 0:
                return ~pos
            if key[s - 1] == k and self._same(s - 1, block_hash, is_object):
                return pos
            pos = (pos + 1) & mask

    def _same(self, block: int, block_hash: object, is_object: bool) -> bool:
        """Whether ``block``, whose key is ``block_hash``'s, holds it: both ``int`` hashes, or both objects
        that compare equal."""
        held: object = self._objects[block] if self._objects else None
        if not is_object:
            return held is None
        return held is not None and (held is block_hash or held == block_hash)

    def holds_hash(self, block: int, block_hash: object) -> bool:
        """Whether ``block`` holds ``block_hash`` (by the equality of the module docstring)."""
        k, is_object = key_of(block_hash)
        return self.key[block] == k and self._same(block, block_hash, is_object)

    def __len__(self) -> int:
        """Distinct hashes published."""
        return self._used

    @property
    def num_holders(self) -> int:
        """Blocks holding a hash (several blocks of one hash count each)."""
        return self._used + self.num_dups

    def first_holders(self) -> list[int]:
        """The block lookups find of every distinct hash, by block id."""
        return sorted(int(s) - 1 for s in self._slots if s)

    # ---- changing ---------------------------------------------------------------------------------------

    def publish(self, block: int, block_hash: object) -> bool:
        """``block`` (holding no hash) now holds ``block_hash``: True when the hash entered the index (no
        block held it), False when ``block`` joined its holders. Raises TypeError (nothing changed) for an
        unhashable value."""
        k, is_object = key_of(block_hash)
        pos = self._locate(k, block_hash, is_object)
        self._hold(block, k, block_hash, is_object)
        if pos >= 0:
            self.dups.setdefault(self.hash_of(int(self._slots[pos]) - 1), []).append(block)
            self.num_dups += 1
            return False
        self._slots[~pos] = block + 1
        self._used += 1
        if 4 * self._used > 3 * len(self._slots):
            self._resize(2 * len(self._slots))
        return True

    def _hold(self, block: int, k: i64, block_hash: object, is_object: bool) -> None:
        self.key[block] = k
        if is_object:
            if not self._objects:
                self._objects = [None] * len(self.key)
            self._objects[block] = block_hash

    def _insert(self, block: int, k: i64) -> None:
        """Put ``block`` (key ``k``, no entry yet) in the table (when it is rebuilt)."""
        slots, mask = self._slots, self._mask
        pos = self._home(k)
        while slots[pos]:
            pos = (pos + 1) & mask
        slots[pos] = block + 1

    def remove(self, block: int) -> bool:
        """``block``'s hash leaves it (another holder, if any, becomes the one lookups find); True when no
        block holds the hash now."""
        if self.dups:
            held = self.hash_of(block)
            rest = self.dups.get(held)
            if rest is not None:
                pos = self._slot_of(self.find(held))
                if self._slots[pos] == block + 1:
                    self._slots[pos] = rest.pop(0) + 1
                else:
                    rest.remove(block)
                self.num_dups -= 1
                if not rest:
                    del self.dups[held]
                self._release(block)
                return False
        self._delete_at(self._slot_of(block))
        self._release(block)
        self._used -= 1
        return True

    def _release(self, block: int) -> None:
        self.key[block] = NO_HASH
        if self._objects:
            self._objects[block] = None

    def clear(self) -> None:
        """Forget every hash (O(table + blocks holding one))."""
        for s in self._slots:
            if s:
                self._release(int(s) - 1)
        for rest in self.dups.values():
            for block in rest:
                self._release(block)
        self.dups.clear()
        self.num_dups = self._used = 0
        self._slots = grown_i32(vec[i32](), _MIN_SLOTS, 0)
        self._mask, self._shift = _MIN_SLOTS - 1, 32 - 3

    # ---- the table --------------------------------------------------------------------------------------

    def _home(self, k: i64) -> i64:
        """The slot a key is looked for first: the top bits of (its 32-bit fold times an odd constant)
        mod 2**32 (multiplicative hashing, Knuth TAOCP 6.4; no product passes 2**63, so compiled and
        interpreted runs agree)."""
        folded = (k ^ (k >> 32)) & 0xFFFFFFFF
        return ((folded * _MIX) & 0xFFFFFFFF) >> self._shift

    def _slot_of(self, block: int) -> i64:
        """The slot holding ``block`` (a block lookups find)."""
        slots, mask = self._slots, self._mask
        target: i32 = block + 1
        pos = self._home(self.key[block])
        while slots[pos] != target:
            pos = (pos + 1) & mask
        return pos

    def _delete_at(self, hole: i64) -> None:
        """Empty slot ``hole``, moving back each later entry of its cluster whose probe passes the hole."""
        slots, key, mask = self._slots, self.key, self._mask
        j = hole
        while True:
            j = (j + 1) & mask
            s = int(slots[j])
            if s == 0:
                break
            home = self._home(key[s - 1])
            if (home <= hole or home > j) if j > hole else (home <= hole and home > j):
                slots[hole] = s
                hole = j
        slots[hole] = 0

    def _resize(self, size: int) -> None:
        self._slots = self._rehashed(size)
        release_freed_memory(4 * size)  # the old table's pages

    def _rehashed(self, size: int) -> vec[i32]:
        """The table's entries placed in a new one of ``size`` slots (which becomes the table's size)."""
        old = self._slots
        self._slots = grown_i32(vec[i32](), size, 0)
        self._mask = size - 1
        self._shift = 32 - (size.bit_length() - 1)
        key = self.key
        for s in old:
            if s:
                self._insert(int(s) - 1, key[int(s) - 1])
        return self._slots

    def problems(self) -> str:
        """The first broken invariant of the index, or "" (O(table + blocks), one byte per block besides):
        each entry is found from its key, the counts agree, every further holder holds its hash, no block
        has two entries and every block holding a hash has one."""
        key, objects, slots = self.key, self._objects, self._slots
        seen = bytearray(len(key))
        used = 0
        for pos in range(len(slots)):
            b = int(slots[pos]) - 1
            if b < 0:
                continue
            used += 1
            if not b < len(key) or key[b] == NO_HASH:
                return f"index entry {b} holds no hash"
            held: object = objects[b] if objects else None
            if self._locate(key[b], held, held is not None) != pos:  # the first entry its probe meets
                return f"index entry {b}: its hash does not lead to it"
            if seen[b]:
                return "a block has two index entries"
            seen[b] = 1
        if used != self._used:
            return "the count of distinct hashes is off"
        held = used
        for h, rest in self.dups.items():
            if not rest or self.find(h) < 0:
                return "a hash has further holders but none that lookups find"
            for b in rest:
                if not 0 <= b < len(key) or not self.holds_hash(b, h):
                    return "a further holder of a hash does not hold it"
                if seen[b]:
                    return "a block has two index entries"
                seen[b] = 1
                held += 1
        if self.num_dups != held - used:
            return "the count of further holders is off"
        for b in range(len(key)):
            if key[b] != NO_HASH and not seen[b]:
                return "a block holds a hash that is not indexed"
        return ""

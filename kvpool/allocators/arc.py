"""Adaptive Replacement Cache (ARC) as a pool eviction policy: Megiddo and Modha's algorithm (``arc``) and
vLLM 0.33's variant of it (``arc-vllm``), on the :class:`~kvpool.allocators.policies.EvictionPolicy`
interface. ``make_policy("arc")`` builds one; :mod:`kvpool.allocators.policies` lists every policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from librt.vecs import vec
from mypy_extensions import u8

from kvpool.allocators.arrays import extend_to, grown_u8
from kvpool.allocators.policy_base import EvictionPolicy
from kvpool.errors import InvalidArgumentError

#: ARC's variants: Megiddo and Modha's algorithm, and vLLM 0.33's ``arc`` (``ARCPolicy.__doc__``).
ARC_VARIANTS = ("paper", "vllm")


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
    FAST 2003). Cached blocks are in T1 (published, not hit since) or T2 (hit at least once); evicted hashes
    are remembered in the ghost lists B1 (from T1) and B2 (from T2). A miss on a hash found in B1 grows the
    target size ``p`` of T1 by ``max(|B2| / |B1|, 1)`` (at most ``c = num_blocks``), one found in B2 shrinks
    it by ``max(|B1| / |B2|, 1)`` (at least 0).

    ``variant="paper"`` (policy ``arc``, the default) is the paper's: a ghost hit enters T2; eviction takes
    the LRU evictable block of T1 while ``|T1| > p`` (or ``|T1| == p`` when the miss was found in B2, the
    paper's tie rule), else of T2 (T1 when T2 has none); ``|T1| + |B1| <= c`` and
    ``|T1| + |T2| + |B1| + |B2| <= 2c``. ``variant="vllm"`` (policy ``arc-vllm``) is vLLM 0.33's ``arc``
    (``vllm/v1/kv_offload/cpu/policies/arc.py``), which departs from the paper in four rules: a ghost hit
    enters T1 (it is promoted only by a later hit); eviction takes T1 while ``|T1| >= int(p)``; a hit on a
    T2 block moves it to T2's MRU end; B1 and B2 are bounded by ``c`` each (trimmed after an eviction only),
    and a ghost that misses again moves to its list's MRU end.

    The target adapts when the pool's caller reports the miss (:meth:`missed`, before the allocation that
    makes room for it, as the paper and vLLM's ``on_store_miss`` do); a hash published from a ghost list
    without that report adapts it at :meth:`published`, after the eviction (kvpool's pool evicts before it
    knows the hash). Adapted to a pool where in-use blocks cannot be evicted: |T1| and |T2| count every
    cached block, but only evictable ones are victims, each list's evictable part in free order (kvpool's
    recency: a free is a use). O(1) per call.

    Raises:
        InvalidArgumentError: ``variant`` not one of :data:`ARC_VARIANTS`.
    """

    name = "arc"

    def __init__(self, variant: str = "paper") -> None:
        super().__init__()
        if variant not in ARC_VARIANTS:
            raise InvalidArgumentError(f"ARC variant must be one of {', '.join(ARC_VARIANTS)}, "
                                       f"got {variant!r}")
        self.variant = variant
        self.vllm = variant == "vllm"
        if self.vllm:
            self.name = "arc-vllm"
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()  # evictable part of T1, LRU head first
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()  # ghost hashes, oldest first
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self.size_t1 = self.size_t2 = 0
        self._in_t2: vec[u8] = vec[u8]()
        self._hash: list[Hashable | None] = []
        self._returning: OrderedDict[Hashable, None] = OrderedDict()  # ghosts missed, not yet published
        self._tie = False  # the last miss was found in B2 (the paper's tie rule for the next eviction)

    def grow(self, capacity: int) -> None:
        self._in_t2 = grown_u8(self._in_t2, capacity)
        extend_to(self._hash, capacity, None)

    def missed(self, block_hash: Hashable) -> None:
        in_b1, in_b2 = block_hash in self.b1, block_hash in self.b2
        self._tie = in_b2
        if not (in_b1 or in_b2):
            self._returning.pop(block_hash, None)
            return
        self._adapt(in_b1)
        if self.vllm:
            (self.b1 if in_b1 else self.b2).move_to_end(block_hash)
        returning = self._returning
        returning[block_hash] = None
        returning.move_to_end(block_hash)
        if len(returning) > self._n:
            returning.popitem(False)

    def _adapt(self, from_b1: bool) -> None:
        n1, n2 = len(self.b1), len(self.b2)
        if from_b1:
            self.p = min(float(self._n), self.p + max(n2 / n1, 1.0))
        else:
            self.p = max(0.0, self.p - max(n1 / n2, 1.0))

    def published(self, block: int, block_hash: Hashable) -> None:
        b1, b2 = self.b1, self.b2
        ghost = block_hash in self._returning
        if ghost:
            del self._returning[block_hash]
        elif block_hash in b1 or block_hash in b2:
            ghost = True
            self._adapt(block_hash in b1)
        self._tie = False
        if self.vllm:  # vLLM's insert leaves neither list holding the key
            b1.pop(block_hash, None)
            b2.pop(block_hash, None)
        elif block_hash in b1:  # (a hash two holders left can be in both: it leaves the one it hit)
            del b1[block_hash]
        elif block_hash in b2:
            del b2[block_hash]
        to_t2 = ghost and not self.vllm
        self._in_t2[block] = 1 if to_t2 else 0
        if to_t2:
            self.size_t2 += 1
        else:
            self.size_t1 += 1
        self._hash[block] = block_hash
        if not self.vllm:
            self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self._n
        if self.vllm:
            while len(self.b1) > c:
                self.b1.popitem(False)
            while len(self.b2) > c:
                self.b2.popitem(False)
            return
        while self.b1 and self.size_t1 + len(self.b1) > c:
            self.b1.popitem(False)
        while self.b2 and self.size_t1 + self.size_t2 + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(False)

    def hit(self, block: int) -> None:
        if self._in_t2[block]:
            if self.vllm and block in self.t2:
                self.t2.move_to_end(block)
            return
        self._in_t2[block] = 1
        self.size_t1 -= 1
        self.size_t2 += 1
        if block in self.t1:  # evictable: the pool's ``remove`` follows and looks for it in T2
            del self.t1[block]
            self.t2[block] = None

    def insert(self, block: int, priority: int) -> None:
        (self.t2 if self._in_t2[block] else self.t1)[block] = None

    def remove(self, block: int) -> None:
        (self.t2 if self._in_t2[block] else self.t1).pop(block)

    def _from_t1(self, size_t1: int) -> bool:
        """Whether the next victim comes from T1 when T1 has ``size_t1`` cached blocks."""
        if self.vllm:
            return size_t1 >= int(self.p)
        return size_t1 > self.p or (self._tie and size_t1 == self.p)

    def pop(self) -> int:
        from_t1 = bool(self.t1) and (self._from_t1(self.size_t1) or not self.t2)
        block = (self.t1 if from_t1 else self.t2).popitem(False)[0]
        (self.b1 if from_t1 else self.b2)[self._hash[block]] = None
        self._forget(block)
        self._trim_ghosts()
        return block

    def dropped(self, block: int) -> None:
        if self._hash[block] is None:
            return
        (self.t2 if self._in_t2[block] else self.t1).pop(block, None)
        self._forget(block)

    def _forget(self, block: int) -> None:
        if self._in_t2[block]:
            self.size_t2 -= 1
        else:
            self.size_t1 -= 1
        self._in_t2[block] = 0
        self._hash[block] = None

    def order(self) -> list[int]:
        """The next victim is exact; later ones assume no publish, hit or miss in between (``p`` stays)."""
        t1, t2 = list(self.t1), list(self.t2)
        out, size_t1 = [], self.size_t1
        while t1 or t2:
            if t1 and (self._from_t1(size_t1) or not t2):
                out.append(t1.pop(0))
                size_t1 -= 1
            else:
                out.append(t2.pop(0))
        return out

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

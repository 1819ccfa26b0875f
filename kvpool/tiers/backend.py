"""The storage-backend interface of the lower KV tiers: blocks named by chained block hash plus a namespace.

A **tier** stores whole KV blocks under their prefix hash (the chained hash of
:mod:`kvpool.allocators.hashing`; in a trace replay, the trace's block ids). A :class:`Namespace` (model,
KV dtype, layout, tensor-parallel rank, layer group, hash scheme) goes into every key and every value, so
two models, ranks or layouts never share a block.

The unit a tier moves is one block as **contiguous bytes** (``block_bytes`` of them): the block's slice of
every layer of the device buffer, K then V, in the buffer's own order (:func:`block_rows`). Batched calls
take and fill ``uint8`` tensors ``[n, block_bytes]`` on the CPU. A tier built with ``block_bytes=0`` stores
hashes only (a replay that moves no data).

Contract of every :class:`TierBackend` (a call never raises for a fault of the medium, from any thread:
see the thread contract in :class:`TierBackend`):

* ``exists(keys) -> int``: how many leading keys are stored (the length of the stored prefix).
* ``get(keys, out) -> int``: load the leading stored blocks into ``out[i]``; returns how many. It stops at
  the first block that is missing, truncated, fails its checksum, belongs to another namespace or key, or
  does not verify under the tier's key (``unauthenticated``: forged, tampered, or written with another
  key), or cannot be read (an I/O or connection error): each is a **miss**, counted in :class:`TierStats`,
  never wrong KV. Rows from the returned count on are unspecified.
* ``set(keys, blocks) -> int``: store each block (independently); returns how many are stored now. A key
  already stored is refreshed (marked recently used), not rewritten. A block that cannot be written (disk
  full, server down, larger than the tier) is counted in ``store_failures`` and skipped.
* ``refresh(keys)``: mark them recently used (the offload manager does it before the device allocation
  whose evictions could otherwise push out blocks it is about to load).
* ``delete(keys) -> int``; ``clear() -> int`` (every block of the namespace); ``capacity_bytes`` (None =
  unbounded), ``used_bytes``, ``num_blocks``; ``stats()``; ``check_integrity()`` (raises
  :class:`IntegrityError`); ``close()``.

A stored value (disk, Redis) is ``header (64 bytes) || payload``; the header holds a magic, the format
version (2), zero flags, the namespace digest, the block key, the payload length, and a 16-byte MAC of all
of those and the payload under the fleet's :class:`~kvpool.tiers.auth.TierKey` (BLAKE3 keyed). So a flipped
byte anywhere, a truncation, a value copied under another key or namespace, and a value forged by someone
who can write the medium but lacks the key are all misses. Version 1 (an unkeyed XXH3-64 checksum in
place of the MAC) is read as ``unauthenticated``.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import xxhash

from kvpool.errors import InvalidArgumentError
from kvpool.numeric import as_int
from kvpool.storage.block_copy import block_rows, gather_rows, scatter_rows  # noqa: F401 (re-exported)
from kvpool.storage.paged import BlockStore
from kvpool.tiers.auth import TierKey

MAGIC = b"KVPB"
VERSION = 2  # 1 was unauthenticated (an XXH3-64 checksum where the MAC is): its values are misses
_HEADER = struct.Struct("<4sHH16s16sQ16s")  # magic, version, flags, namespace, key, length, MAC tag
HEADER_BYTES = _HEADER.size  # 64
_SIGNED = HEADER_BYTES - 16  # the header bytes the MAC covers (every field but the tag), before the payload
_UNAUTHENTICATED_VERSIONS = (1,)
KEY_BYTES = 16
MEDIUMS = ("host", "disk", "remote")


@dataclass(frozen=True)
class Namespace:
    """What a stored block belongs to; part of every key and value, so that blocks of two models, dtypes,
    layouts, ranks or layer groups never match.

    Args:
        model: the model's identity, e.g. its name plus fingerprints of its weights and its config
            (:func:`weights_fingerprint`, :func:`config_fingerprint`).
        kv_dtype: the KV storage dtype (``"bfloat16"``).
        layout: the block layout and shape (:func:`block_layout`).
        tp_rank: the tensor-parallel rank.
        tp_size: the tensor-parallel world size.
        layer_group: the KV cache group index (0 for a model whose layers form one group).
        hash_scheme: how the block hashes were computed (the hash algorithm), so that two schemes never
            meet under one key.
    """

    model: str
    kv_dtype: str
    layout: str
    tp_rank: int = 0
    tp_size: int = 1
    layer_group: int = 0
    hash_scheme: str = ""

    def __post_init__(self) -> None:
        if not all(isinstance(v, str) for v in (self.model, self.kv_dtype, self.layout, self.hash_scheme)):
            raise InvalidArgumentError(f"namespace text fields must be str, got {self!r}")
        size = as_int(self.tp_size, "tp_size", minimum=1)
        object.__setattr__(self, "tp_size", size)
        object.__setattr__(self, "tp_rank", as_int(self.tp_rank, "tp_rank", minimum=0, maximum=size - 1))
        object.__setattr__(self, "layer_group", as_int(self.layer_group, "layer_group", minimum=0))

    @property
    def digest(self) -> bytes:
        """16 bytes: BLAKE2b of the fields, each length-prefixed (so no two namespaces collide by
        concatenation)."""
        parts = [str(v).encode() for v in asdict(self).values()]
        data = b"".join(struct.pack("<I", len(p)) + p for p in parts)
        return hashlib.blake2b(data, digest_size=16, person=b"kvpool-ns").digest()

    @property
    def tag(self) -> str:
        """The digest as 32 hex digits: the namespace's part of a Redis key or a directory name."""
        return self.digest.hex()

    @classmethod
    def for_cache(cls, cache: BlockStore, *, model: str, tp_rank: int = 0, tp_size: int = 1,
                  layer_group: int = 0, hash_scheme: str = "") -> Namespace:
        """The namespace of blocks of the device ``cache`` (dtype and layout taken from it)."""
        return cls(model, str(cache.dtype).removeprefix("torch."), block_layout(cache), tp_rank, tp_size,
                   layer_group, hash_scheme)


def block_layout(cache: BlockStore) -> str:
    """The class, layout and per-block shape of ``cache``, e.g. ``"PagedKVCache/NHD/2x30x16x3x64"``."""
    shape = list(cache.buffer.shape)
    del shape[cache.block_dim]
    return f"{type(cache).__name__}/{getattr(cache, 'layout', '-')}/{'x'.join(map(str, shape))}"


def weights_fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """32 hex digits of XXH3-128 over the bytes of ``tensors`` (a model's parameters): two processes
    agree on it exactly when their weights are bit-identical. ~50 GB/s on a CPU; a GPU tensor is copied."""
    digest = xxhash.xxh3_128()
    for t in tensors:
        t = t.detach()
        digest.update(str((tuple(t.shape), t.dtype)).encode())
        flat = t.reshape(-1).cpu().contiguous()
        if flat.numel():
            digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


#: Config entries that never change a block's KV: where the files came from, the library that saved them.
_CONFIG_NOISE = ("transformers_version",)


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """32 hex digits of XXH3-128 over a model config (``model.config.to_dict()``), its keys sorted, without
    entries that name no computation (keys starting with ``_`` such as ``_name_or_path``, and
    ``transformers_version``). The weights alone do not fix the KV: the same weights with another
    ``rope_theta``, ``rope_scaling``, sliding window or norm epsilon compute other keys and values, so a
    namespace names both (:func:`weights_fingerprint` and this)."""
    kept = {k: v for k, v in config.items() if not str(k).startswith("_") and k not in _CONFIG_NOISE}
    text = json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(text.encode())


def block_key(block_hash: Hashable) -> bytes:
    """The 16-byte key of a block hash: a 16-byte ``bytes`` hash as it is; an int (a trace's block id) as
    16 bytes big-endian two's complement; a KV cache group's key ``(g, hash)`` with ``g >= 1``
    (:func:`kvpool.allocators.group_tables.group_key`) as BLAKE2b-128 of the hash's key then ``g`` as 4 bytes
    big-endian (vLLM's offload key is the block hash followed by the group index so), so blocks of two
    groups never share a key. Raises :class:`InvalidArgumentError` for anything else."""
    if type(block_hash) is bytes and len(block_hash) == KEY_BYTES:
        return block_hash
    if type(block_hash) is int and -(2**127) <= block_hash < 2**127:
        return block_hash.to_bytes(KEY_BYTES, "big", signed=True)
    if type(block_hash) is tuple and len(block_hash) == 2 and type(block_hash[0]) is int \
            and 1 <= block_hash[0] < 2**32:
        data = block_key(block_hash[1]) + block_hash[0].to_bytes(4, "big")
        return hashlib.blake2b(data, digest_size=KEY_BYTES, person=b"kvpool-group").digest()
    raise InvalidArgumentError(f"a tier keys blocks by 16-byte hashes, ints or (group, hash) pairs, got "
                               f"{block_hash!r}")


def block_keys(block_hashes: Sequence[Hashable]) -> list[bytes]:
    """:func:`block_key` of each hash."""
    return [block_key(h) for h in block_hashes]


def encode_header(namespace: bytes, key: bytes, payload: Any, *, auth_key: TierKey) -> bytes:
    """The 64-byte header of a value holding ``payload`` (bytes-like) under ``namespace``/``key``, its MAC
    computed with ``auth_key``."""
    signed = _HEADER.pack(MAGIC, VERSION, 0, namespace, key, memoryview(payload).nbytes, b"")[:_SIGNED]
    return signed + auth_key.tag(signed, payload)


def check_header(header: Any, namespace: bytes, key: bytes, length: int) -> str | None:
    """What a value's header says before its MAC is checked: ``"corrupt"`` (bad magic, version, flags or
    length), ``"unauthenticated"`` (the unauthenticated format 1), ``"foreign"`` (another namespace or key),
    or None when it fits. ``header`` must be 64 bytes."""
    magic, version, flags, ns, k, size, _ = _HEADER.unpack(header)
    if magic == MAGIC and version in _UNAUTHENTICATED_VERSIONS:
        return "unauthenticated"
    if magic != MAGIC or version != VERSION or flags or size != length:
        return "corrupt"
    if ns != namespace or k != key:
        return "foreign"
    return None


def verify_parts(header: Any, payload: Any, namespace: bytes, key: bytes, length: int, *, auth_key: TierKey
                 ) -> str | None:
    """Why a header and its payload are a miss (``"corrupt"``, ``"foreign"``, ``"unauthenticated"``: the
    MAC does not verify under ``auth_key``), or None when they may be served."""
    header, payload = memoryview(header), memoryview(payload)
    if header.nbytes != HEADER_BYTES or payload.nbytes != length:
        return "corrupt"
    why = check_header(header, namespace, key, length)
    if why is None and not auth_key.verifies(bytes(header[_SIGNED:]), header[:_SIGNED], payload):
        return "unauthenticated"
    return why


def verify_value(value: Any, namespace: bytes, key: bytes, length: int, *, auth_key: TierKey
                 ) -> tuple[str | None, memoryview]:
    """(why it is a miss or None, the payload view) for a whole stored value (header then payload)."""
    view = memoryview(value)
    if view.nbytes != HEADER_BYTES + length:
        return "corrupt", view
    return (verify_parts(view[:HEADER_BYTES], view[HEADER_BYTES:], namespace, key, length, auth_key=auth_key),
            view[HEADER_BYTES:])


@dataclass
class TierStats:
    """Counters of one tier, in blocks and bytes, cumulative.

    ``stored``/``stored_bytes``: blocks written by ``set``; ``store_failures``: blocks ``set`` could not
    write; ``loaded``/``loaded_bytes``: blocks ``get`` returned intact; ``evictions``: blocks the tier
    dropped to make room; misses of ``get`` by reason: ``missing`` (not there, or evicted by the server),
    ``corrupt`` (truncated, bad header), ``foreign`` (another namespace or key), ``unauthenticated`` (the
    MAC does not verify: forged or tampered, a flipped payload byte, a value written with another key or in
    the unauthenticated format 1; a MAC cannot tell a forgery from a fault), ``errors`` (I/O or
    connection). ``hits`` is counted by the :class:`~kvpool.tiers.manager.OffloadManager`: prompt
    blocks its lookups found in this tier.
    """

    stored: int = 0
    stored_bytes: int = 0
    store_failures: int = 0
    loaded: int = 0
    loaded_bytes: int = 0
    evictions: int = 0
    missing: int = 0
    corrupt: int = 0
    foreign: int = 0
    unauthenticated: int = 0
    errors: int = 0
    hits: int = 0

    @property
    def misses(self) -> int:
        """Gets that were a miss, whatever the reason."""
        return self.missing + self.corrupt + self.foreign + self.unauthenticated + self.errors

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "misses": self.misses}


class TierBackend(ABC):
    """One storage tier (see the module docstring for the contract every method keeps).

    Subclasses set ``medium`` (``"host"``, ``"disk"`` or ``"remote"``), ``namespace`` and ``block_bytes``,
    and guard their state with ``self._lock``. A tier whose values leave the process (disk, remote) takes
    an ``auth_key`` (:class:`~kvpool.tiers.auth.TierKey`) and refuses to start without one.

    **Thread contract.** Every method may be called from several threads at once: the offload manager calls
    a lower tier from the engine thread (``exists``, ``get``, ``refresh``) and from its writer thread
    (``set``, and the cascade of a tier's evictions into the next). A tier holds ``self._lock`` for work in
    memory only (its index, its counters) and does its I/O outside it, on resources of the call or of the
    thread: a file descriptor per call (the file tier; the changes of its folder, a write, an eviction, the
    removal of a bad file, take turns under a second lock so that the index and the files change together),
    **one Redis client per thread** (the Redis tier). Neither a lock around whole calls nor one shared
    client: under a lock a stalled medium stalls every thread (the engine's lookup waits behind the writer's
    multi-MiB store, then for its own timeout); with one client, a timeout on one thread drops the client
    under the other thread's pipeline (redis-py then raises from a closed socket), so no thread closes a
    client another thread is using. Whatever the medium's client library raises during a call is a fault of
    the medium (a broken or hostile server can make a reply parser raise anything). So a fault or a stall
    of the medium on one thread is a counted miss or store failure of that thread's call alone, never an
    exception on either. The host tier (memory copies, no medium that stalls) holds its lock for whole calls.
    """

    medium: str
    namespace: Namespace
    block_bytes: int

    def __init__(self, namespace: Namespace, block_bytes: int) -> None:
        if not isinstance(namespace, Namespace):
            raise InvalidArgumentError(f"namespace must be a Namespace, got {namespace!r}")
        self.namespace, self.block_bytes = namespace, as_int(block_bytes, "block_bytes", minimum=0)
        self._ns = namespace.digest
        self._stats = TierStats()
        self._lock = threading.RLock()

    @abstractmethod
    def exists(self, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` are stored."""

    @abstractmethod
    def get(self, keys: Sequence[Hashable], out: torch.Tensor | None) -> int:
        """Load the leading stored blocks of ``keys`` into rows of ``out`` (``uint8 [>= n, block_bytes]``;
        None with ``block_bytes == 0``); returns how many were loaded intact."""

    @abstractmethod
    def set(self, keys: Sequence[Hashable], blocks: torch.Tensor | None) -> int:
        """Store ``blocks[i]`` under ``keys[i]``; returns how many of ``keys`` are stored afterwards."""

    @abstractmethod
    def delete(self, keys: Sequence[Hashable]) -> int:
        """Remove ``keys``; returns how many were there."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """Bytes the tier may hold (values with their headers), None when it sets no bound itself."""

    @property
    def capacity_blocks(self) -> int | None:
        """Blocks the tier may hold, None when it sets no bound itself (``capacity_bytes`` over
        ``value_bytes``)."""
        capacity = self.capacity_bytes
        return None if capacity is None or not self.value_bytes else capacity // self.value_bytes

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes held now (for a remote tier: what this process knows it stored, not the server's total)."""

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Blocks held now (for a remote tier: as ``used_bytes``)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Verify the tier's invariants; raises :class:`~kvpool.errors.IntegrityError` naming it."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every block of this tier's namespace (a replay starting cold); returns how many."""

    def refresh(self, keys: Sequence[Hashable]) -> None:  # noqa: B027 (optional: tiers without an LRU)
        """Mark ``keys`` recently used (a tier with its own LRU moves them to its tail); no-op here."""

    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        with self._lock:
            return TierStats(**asdict(self._stats))

    def count_hits(self, n: int) -> None:
        """Add ``n`` to ``hits`` (the manager's lookups)."""
        with self._lock:
            self._stats.hits += n

    def close(self) -> None:  # noqa: B027 (optional: most tiers hold nothing to release)
        """Release files, sockets or memory (the tier is unusable afterwards)."""

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value: header plus payload."""
        return HEADER_BYTES + self.block_bytes

    def _check_rows(self, keys: Sequence[Hashable], rows: torch.Tensor | None, name: str) -> list[bytes]:
        """The keys as 16-byte keys, after checking ``rows`` is a contiguous CPU uint8 tensor with at least
        ``len(keys)`` rows of ``block_bytes`` (or None for a hash-only tier). Raises InvalidArgumentError."""
        out = block_keys(keys)
        if self.block_bytes == 0 and rows is None:
            return out
        ok = (isinstance(rows, torch.Tensor) and rows.dtype == torch.uint8 and rows.device.type == "cpu"
              and rows.dim() == 2 and rows.shape[0] >= len(out) and rows.shape[1] == self.block_bytes
              and rows.is_contiguous())
        if not ok:
            got = f"{rows.dtype} {list(rows.shape)} {rows.device}" if isinstance(rows, torch.Tensor) else rows
            raise InvalidArgumentError(f"{name} must be a contiguous CPU uint8 tensor [>= {len(out)}, "
                                       f"{self.block_bytes}], got {got}")
        return out

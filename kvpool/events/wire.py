"""The wire types of KV cache events (vLLM 0.33) and the wire form of block hashes.

**Event types.** Declared as vLLM 0.33 declares them (``vllm/distributed/kv_events.py``), so a consumer
decodes kvpool's messages with its own vLLM structs: :class:`KVEventBatch` is an ``array_like`` msgspec
Struct ``[ts, events, data_parallel_rank]``; each event is a tagged msgspec Struct (``tag=True``: a map whose
``"type"`` key is the class name), ``omit_defaults=True``: :class:`BlockStored` when hashes enter a pool's
prefix index, :class:`BlockRemoved` when they leave it, :class:`AllBlocksCleared` when it is reset.

**Block hashes on the wire** (vLLM consumers take ``bytes | int``; see :func:`wire_hash`): kvpool's block
hashes are 16-byte ``bytes`` (``kvpool.allocators.hashing``) and go out as those 16 bytes (msgpack ``bin``),
as vLLM's default (SHA-256 ``bytes``) does. ``hash_format="int64"`` sends ``int.from_bytes(h, "big") &
(2**64 - 1)`` instead, vLLM's mapping under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (the last 8 bytes as a
big-endian unsigned integer), for consumers that key on 64-bit integers. Integer hashes (trace hash ids) go
out unchanged in both formats; they must lie in ``[0, 2**64)``. Any other hash type is refused.

The bottom of :mod:`kvpool.events`: of kvpool it imports only the ground. ``msgspec`` is needed to import it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import msgspec

from kvpool.errors import InvalidArgumentError
from kvpool.numeric import as_id_list

# ---- the wire types (vLLM 0.33) -------------------------------------------------------------------------

WireHash = bytes | int
"""A block hash on the wire (vLLM's ``ExternalBlockHash``)."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
FULL_ATTENTION = "full_attention"
"""vLLM's ``kv_cache_spec_kind`` of a full-attention KV cache group."""
SPEC_KINDS = {"full_attention": FULL_ATTENTION, "sliding_attention": "sliding_window",
              "chunked_attention": "chunked_local_attention"}
"""kvpool's layer kinds (``kvpool.spec.LayerKind`` values) as vLLM's ``kv_cache_spec_kind`` names."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message's payload: ``[ts, events, data_parallel_rank]`` (seconds since the epoch)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a map tagged ``"type": <class name>``, fields at their default left out."""


class BlockStored(KVCacheEvent):
    """Blocks entered the prefix index: ``block_hashes`` in chain order, each one's parent the one before
    it and the first one's ``parent_block_hash`` (None: the first block of a sequence); ``token_ids`` the
    tokens of all of them (``len(block_hashes) * block_size``; empty where the caller gave none);
    ``extra_keys`` one entry per block (None: no key), untagged as vLLM publishes them."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Hashes left the prefix index (evicted, or unpublished by ``evict_blocks``)."""

    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix index was emptied (``reset_prefix_cache``): forget every hash of this publisher."""


class KVEventBatch(EventBatch):
    """The payload of every message: a timestamp, the events of one step, the data-parallel rank."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ---- block hashes on the wire ---------------------------------------------------------------------------

HASH_FORMATS = ("bytes", "int64")
_U64 = (1 << 64) - 1


def wire_hash(block_hash: Hashable, hash_format: str = "bytes") -> WireHash:
    """The wire form of a kvpool block hash (see the module docstring): ``bytes`` unchanged, or (``int64``)
    the last 8 bytes as a big-endian unsigned integer; an int in ``[0, 2**64)`` unchanged.

    Raises:
        InvalidArgumentError: a hash that is neither bytes nor such an int, or an unknown format.
    """
    if type(block_hash) is bytes:
        if hash_format == "bytes":
            return block_hash
        if hash_format == "int64":
            return int.from_bytes(block_hash, "big") & _U64
        raise InvalidArgumentError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")
    if type(block_hash) is int and 0 <= block_hash <= _U64:
        return block_hash
    raise InvalidArgumentError(
        f"a block hash sent as a KV event must be bytes or an int in [0, 2**64), got {block_hash!r}")




def wire_extra_keys(keys: tuple | None) -> tuple[Any, ...] | None:
    """One block's extra keys (``kvpool.allocators.hashing.block_extra_keys``) as vLLM publishes them:
    untagged, ``("mm", content_hash, offset)`` -> ``(content_hash, offset)``, ``("lora", name, path, digest)``
    -> the LoRA name, any other ``(tag, ..., value)`` -> its last value (the cache salt, an embeddings
    digest); kvpool's order."""
    if keys is None:
        return None
    return tuple(tuple(k[1:]) if k[0] == "mm" else k[1] if k[0] == "lora" else k[-1] for k in keys)


def wire_hash_or_none(block_hash: Hashable, hash_format: str) -> WireHash | None:
    """:func:`wire_hash` of ``block_hash``, or None for a hash it refuses."""
    try:
        return wire_hash(block_hash, hash_format)
    except InvalidArgumentError:
        return None


#: Token ids msgpack (and vLLM's ``list[int]``) can carry: an int64 or a uint64.
TOKEN_MIN, TOKEN_MAX = -(1 << 63), (1 << 64) - 1


def wire_token_ids(values: Sequence[int]) -> list[int]:
    """Token ids as a list of Python ints (a numpy int, a 0-d tensor, a tensor or array converted, as
    :mod:`kvpool.numeric` reads ids); InvalidArgumentError for anything else or one msgpack cannot carry."""
    out = as_id_list(values, "token_ids", error=InvalidArgumentError)
    if out and not (min(out) >= TOKEN_MIN and max(out) <= TOKEN_MAX):
        raise InvalidArgumentError(f"token_ids must lie in [-2**63, 2**64), got {min(out)} .. {max(out)}")
    return out

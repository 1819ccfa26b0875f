"""Engine keys as kvpool tier keys: the one place where a vLLM offload key or an SGLang page key becomes the
16-byte key a :class:`~kvpool.tiers.backend.TierBackend` stores a block under.

A tier keys blocks by 16 bytes (:func:`kvpool.tiers.backend.block_key`). The engines' keys are longer:

* vLLM's ``OffloadKey`` is the block hash (32 bytes with its default SHA-256; any length) followed by the
  KV cache group index, 4 bytes big-endian (``vllm.v1.kv_offload.base.make_offload_key``);
* SGLang's page key is a hex string (the SHA-256 chain of the page's tokens, ``get_hash_str``), to which
  HiCache appends ``.<pool>`` for a page of another pool than KV.

:func:`tier_key` maps both to ``BLAKE2b-96(hash) || group``: 12 bytes of a BLAKE2b digest (personalised
per engine, so a vLLM hash and an SGLang key never meet) followed by the group index, 4 bytes big-endian,
as vLLM lays it out. The group stays readable in the key (``group_of``), and two groups of one block never
share a key. 96 bits keep collisions out of reach: by the birthday bound, 2^36 stored blocks (68 billion)
collide with probability about 2^-25. Tiers also check the namespace and a checksum on every value, so a
collision could only ever swap two blocks of the same namespace.
"""

from __future__ import annotations

import hashlib

from kvpool.errors import InvalidArgumentError
from kvpool.numeric import as_int

#: Bytes of an engine key's digest in a tier key; the last 4 bytes name the group.
DIGEST_BYTES = 12
GROUP_BYTES = 4
_PERSON = {"vllm": b"kvpool-vllm", "sglang": b"kvpool-sglang"}


def tier_key(block_hash: bytes, group: int = 0, engine: str = "vllm") -> bytes:
    """The 16-byte tier key of ``block_hash`` (bytes of any length) in KV cache group ``group``
    (0 <= group < 2^32) for ``engine`` (``"vllm"`` or ``"sglang"``).

    Raises:
        InvalidArgumentError: ``block_hash`` not bytes, a group out of range, or an unknown engine.
    """
    if not isinstance(block_hash, bytes):
        raise InvalidArgumentError(f"a block hash must be bytes, got {type(block_hash).__name__}")
    if engine not in _PERSON:
        raise InvalidArgumentError(f"engine must be one of {', '.join(_PERSON)}, got {engine!r}")
    group = as_int(group, "group", minimum=0, maximum=2**32 - 1)
    digest = hashlib.blake2b(block_hash, digest_size=DIGEST_BYTES, person=_PERSON[engine]).digest()
    return digest + group.to_bytes(GROUP_BYTES, "big")


def offload_tier_key(offload_key: bytes) -> bytes:
    """The tier key of a vLLM ``OffloadKey`` (block hash then 4 bytes of group index, big-endian).

    Raises:
        InvalidArgumentError: not bytes, or too short to hold a group index.
    """
    if not isinstance(offload_key, bytes) or len(offload_key) <= GROUP_BYTES:
        raise InvalidArgumentError(f"a vLLM offload key is bytes of a block hash and 4 bytes of group index, "
                                   f"got {offload_key!r}")
    return tier_key(offload_key[:-GROUP_BYTES], int.from_bytes(offload_key[-GROUP_BYTES:], "big"))


def page_tier_key(page_key: str, group: int = 0) -> bytes:
    """The tier key of an SGLang page key (its hex hash string, as HiCache passes it) in ``group``.

    Raises:
        InvalidArgumentError: ``page_key`` not a str.
    """
    if not isinstance(page_key, str):
        raise InvalidArgumentError(f"an SGLang page key is a str, got {page_key!r}")
    return tier_key(page_key.encode(), group, "sglang")


def group_of(key: bytes) -> int:
    """The group index a tier key names (its last 4 bytes)."""
    return int.from_bytes(key[-GROUP_BYTES:], "big")

"""Chained block hashes for prefix caching, deterministic across processes (never Python's ``hash()``).

The hash of block ``i`` covers blocks ``0..i``: it digests its parent's hash, so two sequences share block
``i``'s hash only if they share every token (and extra key) up to the end of block ``i``. Format, stable:

    digest( parent (16 bytes; ROOT_HASH for the first block)
            || int64 little-endian token count || each token id as int64 little-endian
            || canonical encoding of the block's extra keys, if any )

``digest`` is XXH3-128 (``algorithm="xxh3_128"``, the optional ``xxhash`` package: ~2x faster here, not
cryptographic) or BLAKE2b with a 16-byte digest (``"blake2b"``, stdlib). The default ``"auto"`` picks
XXH3-128 when ``xxhash`` is importable, else BLAKE2b: deterministic for one installation (every process
and run agree), but two installations that differ in ``xxhash`` produce different hashes. Pass an explicit
algorithm when hashes are stored or shared across machines. Both give 16-byte ``bytes``; hashes of the two
algorithms never match each other (a mix only loses hits, never makes a false one).

Extra keys separate blocks whose tokens are equal but whose KV differs: a LoRA adapter (id and name), a
cache salt (tenant isolation), multimodal items (content hash + offset). :func:`block_extra_keys` builds
them per block. An extra key is None, a bool, int, str or bytes, or a tuple of those (nested).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

from kvpool.errors import InvalidArgumentError

ROOT_HASH = bytes(16)
"""Parent of a sequence's first block."""

ALGORITHMS = ("auto", "blake2b", "xxh3_128")

ExtraKeys = tuple | None
MMItem = tuple[object, int, int]  # (content hash, start token, length in tokens)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys = None, *,
               algorithm: str = "auto") -> bytes:
    """The 16-byte hash of one block of ``token_ids`` (any length) following ``parent`` (None = first).

    Raises:
        InvalidArgumentError: a token id that is not an int64, a parent that is not 16 bytes, a bad extra
            key or an unknown algorithm.
    """
    digest = _digest_fn(algorithm)
    tokens = _pack(token_ids)
    data = _parent(parent) + struct.pack("<q", len(tokens) // 8) + tokens
    return digest(data + _encode(extra_keys) if extra_keys is not None else data)


def block_hashes(token_ids: Sequence[int], block_size: int, *, extra_keys: Sequence[ExtraKeys] | None = None,
                 parent: bytes | None = None, algorithm: str = "auto") -> list[bytes]:
    """One chained hash per **full** block of ``token_ids`` (a partial tail block gets none).

    ``extra_keys``: one entry per block of ``token_ids`` (full blocks, optionally plus the partial tail,
    whose entry is ignored), e.g. from :func:`block_extra_keys`. ``parent``: the hash of the block just
    before ``token_ids`` when hashing a continuation. Equals ``hash_block`` applied block by block.

    Raises:
        InvalidArgumentError: ``block_size`` < 1, ``extra_keys`` of the wrong length, or as hash_block.
    """
    if type(block_size) is not int or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
    digest, buf, prev = _digest_fn(algorithm), _pack(token_ids), _parent(parent)
    num_full, step = len(buf) // 8 // block_size, 8 * block_size
    extras = _extras_per_block(extra_keys, num_full, -(-len(buf) // step))
    head = struct.pack("<q", block_size)
    out = []
    for i in range(num_full):
        data = prev + head + buf[i * step:(i + 1) * step]
        prev = digest(data + extras[i] if extras else data)
        out.append(prev)
    return out


def block_extra_keys(num_tokens: int, block_size: int, *, lora: tuple[int, str] | None = None,
                     cache_salt: str | bytes | None = None, mm_items: Sequence[MMItem] = (),
                     start_block: int = 0) -> list[ExtraKeys]:
    """Extra keys for each full block of a ``num_tokens``-token sequence, for :func:`block_hashes`.

    ``lora`` ``(lora_id, lora_name)`` goes into every block; ``cache_salt`` into block 0 only (the chain
    carries it on); each multimodal item ``(content_hash, start, length)`` (token positions) adds
    ``("mm", content_hash, block_start - start)`` to every block its span overlaps, the offset saying which
    part of the item the block holds. ``start_block``: index of the first block when hashing a continuation
    (token positions stay absolute). Blocks with no key get None.
    """
    out: list[ExtraKeys] = []
    for i in range(start_block, start_block + num_tokens // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        keys: list[object] = []
        if lora is not None:
            keys.append(("lora", *lora))
        if cache_salt is not None and i == 0:
            keys.append(("salt", cache_salt))
        keys += [("mm", h, lo - start) for h, start, length in mm_items if start < hi and lo < start + length]
        out.append(tuple(keys) if keys else None)
    return out


@functools.cache
def _digest_fn(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm == "auto":
        return _digest_fn("xxh3_128") if importlib.util.find_spec("xxhash") else _blake2b
    if algorithm == "blake2b":
        return _blake2b
    if algorithm == "xxh3_128":
        import xxhash  # optional dependency (extra "fasthash"), imported only when asked for

        return xxhash.xxh3_128_digest
    raise InvalidArgumentError(f"unknown hash algorithm {algorithm!r}; choose one of {ALGORITHMS}")


def resolved_algorithm(algorithm: str = "auto") -> str:
    """The algorithm ``algorithm`` stands for in this installation (``"auto"`` -> ``"xxh3_128"`` or
    ``"blake2b"``)."""
    return "blake2b" if _digest_fn(algorithm) is _blake2b else "xxh3_128"


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as int64 little-endian bytes (a tensor or array is converted with ``tolist()``)."""
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    try:
        arr = array("q", token_ids)
    except (TypeError, OverflowError) as exc:
        raise InvalidArgumentError(f"token ids must be ints in int64 range: {exc}") from None
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def _parent(parent: bytes | None) -> bytes:
    if parent is None:
        return ROOT_HASH
    if type(parent) is not bytes or len(parent) != 16:
        raise InvalidArgumentError(f"parent must be a 16-byte block hash or None, got {parent!r}")
    return parent


def _extras_per_block(extra_keys: Sequence[ExtraKeys] | None, num_full: int, num_blocks: int) -> list[bytes]:
    if extra_keys is None:
        return []
    if len(extra_keys) not in (num_full, num_blocks):
        raise InvalidArgumentError(
            f"extra_keys needs one entry per block ({num_full} full, {num_blocks} in all), "
            f"got {len(extra_keys)}")
    return [_encode(k) if k is not None else b"" for k in extra_keys[:num_full]]


def _encode(value: object) -> bytes:
    """Canonical, type-tagged, length-prefixed bytes of an extra key (so ("a", "bc") != ("ab", "c"))."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        return b"i%d;" % value
    if isinstance(value, str):
        value = value.encode("utf-8")
        return b"s%d:" % len(value) + value
    if isinstance(value, bytes):
        return b"b%d:" % len(value) + value
    if isinstance(value, tuple):
        return b"(" + b"".join(_encode(v) for v in value) + b")"
    raise InvalidArgumentError(f"extra keys must be None, bool, int, str, bytes or tuples, got {value!r}")

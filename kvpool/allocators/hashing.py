"""Chained block hashes for prefix caching, and :class:`BlockHasher`, the one place that decides how they
are keyed: the digest algorithm, the secret root every chain starts from, whether the hashes leave the
process.

The hash of block ``i`` covers blocks ``0..i``: it digests its parent's hash, so two sequences share block
``i``'s hash only if they share every token (and extra key) up to the end of block ``i``. Format, stable:

    digest( parent (16 bytes; the hasher's root for the first block)
            || int64 little-endian token count || each token id as int64 little-endian
            || canonical encoding of the block's extra keys, if any )

``digest`` is the first 16 bytes of SHA-256 (``"sha256"``), BLAKE2b with a 16-byte digest (``"blake2b"``),
or XXH3-128 (``"xxh3_128"``, the optional ``xxhash`` package; fast, not cryptographic). Never Python's
``hash()``.

**Why the root is secret.** A prefix cache hands the KV of one request to another whose block hashes match.
With a public root and a non-cryptographic hash, anyone who can send prompts can compute block hashes
offline and search for token blocks whose hash equals another tenant's (then read or poison that tenant's
cached KV); with any hash and a public root, anyone who sees hashes (a shared store's keys, a KV event
stream) can confirm a guessed prompt by hashing it. A secret root defeats both: no hash can be computed
without it. So:

* a process-local pool (``shared=False``, the default) gets a fresh random root per process unless a seed
  is configured, and may use the fast XXH3-128;
* hashes that leave the process (``shared=True``: tiers, events, a store shared by a fleet) must agree
  across processes, so their root comes from a configured seed, the same secret in every process of the
  fleet (``seed=`` or the ``KVPOOL_HASH_SEED`` environment variable), and the default algorithm is a
  cryptographic one (SHA-256). A shared hasher with no seed uses the public root ``PUBLIC_ROOT`` (16 zero
  bytes) and must then be cryptographic: still collision-safe, but its hashes confirm guesses;
  ``describe()`` says ``seeded: False``.

Extra keys separate blocks whose tokens are equal but whose KV differs: a LoRA adapter
(:class:`~kvpool.allocators.extra_keys.LoRAIdentity`), a cache salt (tenant isolation), multimodal items
(content hash + offset), prompt embeddings (a digest of each block's embedding rows):
:mod:`kvpool.allocators.extra_keys`, whose :func:`~kvpool.allocators.extra_keys.block_extra_keys` builds
them per block. An extra key is None, a bool, int, str or bytes, or a tuple of those (nested).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvpool.allocators.extra_keys import (  # noqa: F401  (also the extra keys' old import path)
    ExtraKeys,
    LoRAIdentity,
    MMItem,
    adapter_digest,
    block_extra_keys,
    embedding_digest,
)
from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.numeric import INT64_MAX, as_int, int_dtypes, is_tensor

PUBLIC_ROOT = bytes(16)
"""Root of a shared hasher with no seed configured (16 zero bytes)."""

SEED_ENV = "KVPOOL_HASH_SEED"
"""Environment variable holding the root seed (the same secret in every process of a fleet)."""

MIN_SEED_BYTES = 16
ALGORITHMS = ("auto", "sha256", "blake2b", "xxh3_128")
CRYPTOGRAPHIC = frozenset({"sha256", "blake2b"})
_ROOT_DOMAIN = b"kvpool block-hash root v1\x00"


class BlockHasher:
    """Computes chained block hashes with one algorithm and one root; immutable (read-only properties).

    ``BlockHasher(algorithm="auto", *, seed=None, shared=False)``:

    * ``algorithm``: ``"sha256"``, ``"blake2b"``, ``"xxh3_128"`` or ``"auto"``: SHA-256 when ``shared``,
      else XXH3-128 when ``xxhash`` is installed, else SHA-256.
    * ``seed``: the secret the root is derived from (str or bytes, at least 16 bytes; the root is
      ``sha256(b"kvpool block-hash root v1\\0" + seed)[:16]``). None: ``$KVPOOL_HASH_SEED`` if set, else a
      random root (``os.urandom``) for a process-local hasher, or ``PUBLIC_ROOT`` for a shared one.
    * ``shared``: whether the hashes leave this process (a tier, an event stream). Tiers and events build
      their hasher with ``shared=True``; the engine's default is process-local.

    Two hashers agree exactly when their algorithms and roots agree. ``repr`` and :meth:`describe` show the
    choice and where the seed came from, never the seed or the root. Pickling one carries its root (that
    is how a worker process gets the same hashes); treat a pickled hasher as a secret.

    Raises:
        ConfigError: an unknown algorithm, ``xxh3_128`` without ``xxhash`` or shared without a seed (a
            public root and a non-cryptographic hash: the configuration an attacker can aim at), or a seed
            (argument or environment) that is not str/bytes or shorter than 16 bytes.
    """

    __slots__ = ("_algorithm", "_digest", "_root", "_seed_source", "_shared")

    def __init__(self, algorithm: str = "auto", *, seed: str | bytes | None = None, shared: bool = False
                 ) -> None:
        if type(shared) is not bool:
            raise ConfigError(f"shared must be a bool, got {shared!r}")
        self._shared = shared
        self._algorithm = _resolve_algorithm(algorithm, shared)
        self._digest = _digest_fn(self._algorithm)
        self._root, self._seed_source = _make_root(seed, shared)
        _check_unseeded(self._algorithm, self._seed_source)

    @property
    def algorithm(self) -> str:
        """The digest algorithm in use (``"auto"`` resolved)."""
        return self._algorithm

    @property
    def shared(self) -> bool:
        """Whether the hashes are meant to leave this process."""
        return self._shared

    @property
    def seeded(self) -> bool:
        """Whether the root is secret (a configured seed or a random root), i.e. not ``PUBLIC_ROOT``."""
        return self._seed_source != "none"

    @property
    def seed_source(self) -> str:
        """Where the root came from: ``"argument"``, ``"KVPOOL_HASH_SEED"``, ``"random"`` (per process) or
        ``"none"`` (the public root)."""
        return self._seed_source

    @property
    def cryptographic(self) -> bool:
        """Whether the algorithm is collision-resistant against an attacker (SHA-256, BLAKE2b)."""
        return self._algorithm in CRYPTOGRAPHIC

    def describe(self) -> dict[str, Any]:
        """``{"algorithm", "cryptographic", "seeded", "seed_source", "shared"}`` (JSON-ready; no secret)."""
        return {"algorithm": self._algorithm, "cryptographic": self.cryptographic, "seeded": self.seeded,
                "seed_source": self._seed_source, "shared": self._shared}

    def hash_block(self, parent: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys = None
                   ) -> bytes:
        """The 16-byte hash of one block of ``token_ids`` (any length) following ``parent`` (None = first).

        Raises:
            InvalidArgumentError: a token id that is not an int64, a parent that is not 16 bytes, or a bad
                extra key.
        """
        tokens = _pack(token_ids)
        data = self._parent(parent) + struct.pack("<q", len(tokens) // 8) + tokens
        return self._digest(data + _encode(extra_keys) if extra_keys is not None else data)

    def block_hashes(self, token_ids: Sequence[int], block_size: int, *,
                     extra_keys: Sequence[ExtraKeys] | None = None, parent: bytes | None = None
                     ) -> list[bytes]:
        """One chained hash per **full** block of ``token_ids`` (a partial tail block gets none).

        ``extra_keys``: one entry per block of ``token_ids`` (full blocks, optionally plus the partial tail,
        whose entry is ignored), e.g. from :func:`~kvpool.allocators.extra_keys.block_extra_keys`.
        ``parent``: the hash of the block just before ``token_ids`` when hashing a continuation.
        Equals :meth:`hash_block` applied block by block.

        Raises:
            InvalidArgumentError: ``block_size`` not an integer in ``[1, 2**63 - 1]``, ``extra_keys`` of the
                wrong length, or as hash_block.
        """
        if type(block_size) is not int or not 1 <= block_size <= INT64_MAX:  # packed as int64 below
            block_size = as_int(block_size, "block_size", minimum=1, maximum=INT64_MAX)
        digest, buf, prev = self._digest, _pack(token_ids), self._parent(parent)
        num_full, step = len(buf) // 8 // block_size, 8 * block_size
        extras = _extras_per_block(extra_keys, num_full, -(-len(buf) // step))
        head = struct.pack("<q", block_size)
        out = []
        for i in range(num_full):
            data = prev + head + buf[i * step:(i + 1) * step]
            prev = digest(data + extras[i] if extras else data)
            out.append(prev)
        return out

    def _parent(self, parent: bytes | None) -> bytes:
        if parent is None:
            return self._root
        if type(parent) is not bytes or len(parent) != 16:
            raise InvalidArgumentError(f"parent must be a 16-byte block hash or None, got {parent!r}")
        return parent

    def __repr__(self) -> str:
        return (f"BlockHasher(algorithm={self._algorithm!r}, seeded={self.seeded}, "
                f"seed_source={self._seed_source!r}, shared={self._shared})")

    def __getstate__(self) -> tuple[str, bytes, str, bool]:
        return self._algorithm, self._root, self._seed_source, self._shared

    def __setstate__(self, state: tuple[str, bytes, str, bool]) -> None:
        self._algorithm, self._root, self._seed_source, self._shared = state
        self._digest = _digest_fn(self._algorithm)


@functools.cache
def default_hasher() -> BlockHasher:
    """The process-local hasher used when none is given: ``BlockHasher()``, built on first use (so it reads
    ``$KVPOOL_HASH_SEED`` then) and kept for the life of the process."""
    return BlockHasher()


def hashes_leave_process(*, events: bool = False, media: Iterable[str] = ()) -> bool:
    """Whether block hashes leave this process, so that every process must compute the same ones (a shared
    hasher): a KV event stream publishes them (``events``), or a tier keeps them outside the process (a
    ``media`` entry other than ``"host"``: a disk folder, a Redis server). The one rule: the engine, the
    request path and the command line all ask it."""
    return events or any(medium != "host" for medium in media)


def hasher_for(hasher: BlockHasher | None, *, events: bool = False, media: Iterable[str] = ()) -> BlockHasher:
    """``hasher``, checked for where its hashes go (``events``, ``media``: :func:`hashes_leave_process`); or,
    for None, the default there: ``BlockHasher(shared=True)`` when the hashes leave the process, else
    :func:`default_hasher`.

    Raises:
        ConfigError: ``hasher`` is process-local (``shared=False``) and the hashes leave the process.
    """
    leaving = hashes_leave_process(events=events, media=media)
    if hasher is None:
        return BlockHasher(shared=True) if leaving else default_hasher()
    if leaving and not hasher.shared:
        where = " and ".join(filter(None, ["KV events" if events else "", ", ".join(
            sorted({f"a {m} tier" for m in media if m != "host"}))]))
        raise ConfigError(f"{where} carry block hashes out of this process: give a shared hasher "
                          f"(BlockHasher(shared=True); ${SEED_ENV} for a fleet), not a process-local one")
    return hasher


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys = None, *,
               hasher: BlockHasher | None = None) -> bytes:
    """:meth:`BlockHasher.hash_block` of ``hasher`` (default: :func:`default_hasher`)."""
    return (hasher or default_hasher()).hash_block(parent, token_ids, extra_keys)


def block_hashes(token_ids: Sequence[int], block_size: int, *, extra_keys: Sequence[ExtraKeys] | None = None,
                 parent: bytes | None = None, hasher: BlockHasher | None = None) -> list[bytes]:
    """:meth:`BlockHasher.block_hashes` of ``hasher`` (default: :func:`default_hasher`)."""
    hasher = hasher or default_hasher()
    return hasher.block_hashes(token_ids, block_size, extra_keys=extra_keys, parent=parent)


# ---- internals --------------------------------------------------------------------------------------------


def _resolve_algorithm(algorithm: str, shared: bool) -> str:
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown hash algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if algorithm != "auto":
        return algorithm
    return "xxh3_128" if not shared and importlib.util.find_spec("xxhash") else "sha256"


def _make_root(seed: str | bytes | None, shared: bool) -> tuple[bytes, str]:
    if seed is not None:
        return _derive_root(seed, "the hash seed"), "argument"
    env = os.environ.get(SEED_ENV)
    if env is not None:
        return _derive_root(env, f"${SEED_ENV}"), SEED_ENV
    return (PUBLIC_ROOT, "none") if shared else (os.urandom(16), "random")


def _check_unseeded(algorithm: str, seed_source: str) -> None:
    if seed_source == "none" and algorithm not in CRYPTOGRAPHIC:
        raise ConfigError(f"shared {algorithm} hashes need a secret seed (set ${SEED_ENV} or pass seed=): "
                          "with a public root anyone can aim a collision at them; or use sha256 / blake2b")


def secret_bytes(secret: str | bytes, what: str) -> bytes:
    """The bytes of a configured secret (a hash seed, a tier key): str as UTF-8 (an environment value that
    is not UTF-8 keeps its own bytes) or bytes, at least :data:`MIN_SEED_BYTES` of them. Raises
    :class:`ConfigError` naming ``what`` (never the secret) otherwise."""
    try:  # surrogateescape: an environment value that is not UTF-8 is its own bytes (as os.environb holds)
        raw = secret.encode("utf-8", "surrogateescape") if isinstance(secret, str) else secret
    except UnicodeEncodeError:
        raise ConfigError(f"{what} holds a lone surrogate: give bytes or text") from None
    if type(raw) is not bytes:
        raise ConfigError(f"{what} must be str or bytes, got {type(secret).__name__}")
    if len(raw) < MIN_SEED_BYTES:
        raise ConfigError(f"{what} must be at least {MIN_SEED_BYTES} bytes of secret, got {len(raw)} "
                          "(e.g. python3 -c 'import secrets; print(secrets.token_hex(32))')")
    return raw


def _derive_root(seed: str | bytes, what: str) -> bytes:
    return hashlib.sha256(_ROOT_DOMAIN + secret_bytes(seed, what)).digest()[:16]


def _digest_fn(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm == "sha256":
        return _sha256
    if algorithm == "blake2b":
        return _blake2b
    try:
        import xxhash  # optional dependency (extra "fasthash"), imported only when asked for
    except ImportError:
        raise ConfigError("hash algorithm 'xxh3_128' needs the xxhash package (pip install xxhash)"
                          ) from None
    return xxhash.xxh3_128_digest


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as int64 little-endian bytes (a tensor or array is converted with ``tolist()``; a bool or
    float tensor is rejected; a list is not scanned for bools, which would cost as much as the packing)."""
    if hasattr(token_ids, "tolist"):
        dtype = getattr(token_ids, "dtype", None)
        integral = dtype in int_dtypes() if is_tensor(token_ids) else \
            getattr(dtype, "kind", "i") in ("i", "u")  # numpy's kind; an array.array has no dtype
        if not integral:
            raise InvalidArgumentError(f"token ids must be integers, got dtype {dtype}")
        token_ids = token_ids.tolist()
    try:
        arr = array("q", token_ids)
    except (TypeError, OverflowError) as exc:
        raise InvalidArgumentError(f"token ids must be ints in int64 range: {exc}") from None
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def _extras_per_block(extra_keys: Sequence[ExtraKeys] | None, num_full: int, num_blocks: int) -> list[bytes]:
    if extra_keys is None:
        return []
    if len(extra_keys) not in (num_full, num_blocks):
        raise InvalidArgumentError(
            f"extra_keys needs one entry per block ({num_full} full, {num_blocks} in all), "
            f"got {len(extra_keys)}")
    memo: dict[int, bytes] = {}  # tuples by identity: a LoRA key shared by every block is encoded once
    return [_encode(k, memo) if k is not None else b"" for k in extra_keys[:num_full]]


def _encode(value: object, memo: dict[int, bytes] | None = None) -> bytes:
    """Canonical, type-tagged, length-prefixed bytes of an extra key (so ("a", "bc") != ("ab", "c")).
    ``memo`` caches tuples by ``id`` (never by equality: ``(1,) == (True,)``) while the caller holds them."""
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
        if memo is None:
            return b"(" + b"".join(_encode(v) for v in value) + b")"
        out = memo.get(id(value))
        if out is None:
            out = memo[id(value)] = b"(" + b"".join(_encode(v, memo) for v in value) + b")"
        return out
    raise InvalidArgumentError(f"extra keys must be None, bool, int, str, bytes or tuples, got {value!r}")

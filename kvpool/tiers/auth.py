"""``TierKey``: the fleet secret that authenticates the values of the tiers that leave the process.

A disk folder or a Redis server is written by whoever has access to it, not only by kvpool: a value's
header alone (namespace, block key, length) can be recomputed by anyone, and the block keys are no secret
there (they are the file and key names). So every value of a disk or Redis tier carries a **MAC**, a
16-byte BLAKE3 keyed hash over its header fields (format version, namespace digest, block key, payload
length) and its payload, keyed by a secret every process of the fleet shares. Without the secret no one can
make a value that verifies: a forged, tampered or foreign-key value is a miss (``unauthenticated``), never
KV. The host tier never leaves the process and needs no key.

Where the secret comes from (:meth:`TierKey.from_env`), first match wins:

1. ``$KVPOOL_TIER_KEY``: a secret for the tier values only. Give it when some process must compute block
   hashes but must not be able to write tier values (a KV-aware router reading the events holds
   ``$KVPOOL_HASH_SEED``, not this).
2. ``$KVPOOL_HASH_SEED``: the hash root's seed (:mod:`kvpool.allocators.hashing`), when it is the only
   secret set: one secret then keys both, through separate derivations (the MAC key is not the hash root,
   and neither reveals the other).
3. Neither: no key. A disk or Redis tier then refuses to start (:class:`~kvpool.errors.ConfigError`), unless
   given :meth:`TierKey.public` explicitly (values checked for faults, not authenticated: for a folder no
   one else can write).

The key itself is ``BLAKE3-derive_key("kvpool 2025-06 tier value MAC key v1", secret)`` (32 bytes; BLAKE3's
key derivation mode), and a value's tag ``BLAKE3-keyed_hash(key, header[:48] || payload)[:16]`` (the
``blake3`` package, SIMD: 0.4-2 GB/s on one core of the shared 2-core test box, docs/benchmarks.md; ``pip
install kvpool[tiers]``). BLAKE3's keyed mode is a PRF, so a tag needs no nonce and a key has no usage
limit.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from kvpool.allocators.hashing import SEED_ENV, secret_bytes
from kvpool.errors import ConfigError

KEY_ENV = "KVPOOL_TIER_KEY"
"""Environment variable holding the tier values' secret (the same in every process of a fleet)."""

TAG_BYTES = 16
_CONTEXT = "kvpool 2025-06 tier value MAC key v1"  # BLAKE3 derive_key context: fixed, globally unique
_PUBLIC_SECRET = b"kvpool public tier key: it authenticates nothing"
_T = TypeVar("_T")


def redact_url(url: _T) -> _T:
    """``url`` as error messages and reports may show it: a string's password (what follows the user name in
    ``scheme://user:password@host``, or the whole user part when it has no ``:``) replaced by ``***``;
    anything else unchanged. Nothing is parsed beyond that, so a malformed URL is redacted too."""
    if not isinstance(url, str):
        return url
    match = re.match(r"([^:/?#]+://)([^/?#]*)(.*)", url, re.DOTALL)
    if match is None or "@" not in match[2]:
        return url
    user_info, host = match[2].rsplit("@", 1)
    user = user_info.split(":", 1)[0] + ":***" if ":" in user_info else "***"
    return f"{match[1]}{user}@{host}{match[3]}"  # type: ignore[return-value]


def _blake3() -> Any:
    try:
        import blake3  # the tiers extra; imported when a key is made (the host tier never needs it)
    except ImportError:
        raise ConfigError("disk and Redis tiers authenticate their values with BLAKE3: pip install blake3 "
                          "(or kvpool[tiers])") from None
    return blake3.blake3


class TierKey:
    """A MAC key for tier values, derived from a secret; immutable, its ``repr`` shows where it came from,
    never the secret.

    ``TierKey(secret)``: ``secret`` is str or bytes, at least 16 bytes (as a hash seed). Use
    :meth:`from_env` to read the fleet's secret, :meth:`public` to opt out of authentication.

    Raises:
        ConfigError: a secret that is not str/bytes or shorter than 16 bytes; ``blake3`` not installed.
    """

    __slots__ = ("_hasher", "_key", "_source")

    def __init__(self, secret: str | bytes) -> None:
        self._init(secret_bytes(secret, "the tier key"), "argument")

    def _init(self, raw: bytes, source: str) -> None:
        self._hasher = _blake3()
        self._key = self._hasher(raw, derive_key_context=_CONTEXT).digest(32)
        self._source = source

    @classmethod
    def _made(cls, raw: bytes, source: str) -> TierKey:
        key = cls.__new__(cls)
        key._init(raw, source)
        return key

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TierKey | None:
        """The key of ``$KVPOOL_TIER_KEY``, else of ``$KVPOOL_HASH_SEED``, else None (``environ``: the
        environment to read, ``os.environ`` by default). Raises ConfigError for a value shorter than 16
        bytes (naming the variable, never its value)."""
        env = os.environ if environ is None else environ
        for name in (KEY_ENV, SEED_ENV):
            value = env.get(name)
            if value is not None:
                return cls._made(secret_bytes(value, f"${name}"), name)
        return None

    @classmethod
    def public(cls) -> TierKey:
        """A key everyone knows: values are still checked for faults (a flipped or truncated byte is a
        miss) but anyone who can write the medium can forge them. An explicit opt-out, for a folder or a
        Redis no one else can write."""
        return cls._made(_PUBLIC_SECRET, "public")

    @property
    def source(self) -> str:
        """``"argument"``, ``"KVPOOL_TIER_KEY"``, ``"KVPOOL_HASH_SEED"`` or ``"public"``."""
        return self._source

    @property
    def authenticates(self) -> bool:
        """Whether the key is a secret (False for :meth:`public`)."""
        return self._source != "public"

    def tag(self, signed: Any, payload: Any) -> bytes:
        """The 16-byte MAC of ``signed`` (the header's fields) then ``payload`` (bytes-like)."""
        digest = self._hasher(signed, key=self._key)
        digest.update(payload)
        return digest.digest(TAG_BYTES)

    def verifies(self, tag: bytes, signed: Any, payload: Any) -> bool:
        """Whether ``tag`` is the MAC of ``signed`` then ``payload`` (compared in constant time)."""
        return hmac.compare_digest(tag, self.tag(signed, payload))

    def __repr__(self) -> str:
        return f"TierKey(source={self._source!r})"

    def __reduce__(self) -> Any:
        raise TypeError("a TierKey is not pickled (it would carry the fleet's secret): build it in each "
                        "process (TierKey.from_env())")


def require_auth_key(auth_key: TierKey | str | bytes | None, what: str) -> TierKey:
    """``auth_key`` as a :class:`TierKey` (str or bytes: a secret) for ``what`` (``"a disk tier"``), whose
    values leave the process. Raises ConfigError for None, saying how to give one."""
    if isinstance(auth_key, TierKey):
        return auth_key
    if auth_key is None:
        raise ConfigError(f"{what} keeps values outside the process, so they are authenticated: give "
                          f"auth_key=TierKey.from_env() with ${KEY_ENV} (or ${SEED_ENV}) set to the same "
                          "secret of at least 16 bytes in every process, or auth_key=TierKey.public() to "
                          "opt out (anyone who can write the medium can then forge KV)")
    return TierKey(auth_key)

"""Tiers from URLs: the one place that turns a tier's description into a tier, and checks it.

Every consumer (``kvpool generate`` and ``kvpool replay``, :meth:`kvpool.engine.engine.LLMEngine.
enable_offload`, a user's own engine) describes its chain as URLs, fastest first:

- ``host://?blocks=N``: a host (CPU memory) tier of N blocks (:class:`~kvpool.tiers.host.HostTier`);
- ``file:///DIR?bytes=SIZE`` or ``file:///DIR?blocks=N``: a disk tier in folder DIR (created if missing),
  bounded in bytes (values with their 64-byte headers; ``SIZE`` as ``4GiB``) or in blocks
  (:class:`~kvpool.tiers.file.FileTier`);
- ``redis://HOST:PORT[/DB]`` or ``rediss://...``: a Redis server or Redis Cluster node shared by processes
  (:class:`~kvpool.tiers.redis.RedisTier`).

:func:`parse_tier_url` checks one URL without touching anything but a disk tier's folder, which it probes
(so a command fails before it loads a model), into a :class:`TierURL`; :func:`check_chain` checks a chain's
order (at most one host tier, first); :func:`tiers_from_urls` builds the tiers. Both take a
:class:`TierURL` as it is, so a command that reads its chain once parses each URL once. :func:`build_tier`
is the one place a tier is made from its description (the vLLM and SGLang plug-ins' ``open_tier`` too).
Every malformed URL is a :class:`~kvpool.errors.ConfigError` naming what is wrong.
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError
from kvpool.tiers.auth import redact_url
from kvpool.units import parse_bytes

MEDIUMS = {"host": "host", "file": "disk", "redis": "remote", "rediss": "remote"}


@dataclass(frozen=True)
class TierURL:
    """One checked tier URL: ``medium`` (``host``, ``disk``, ``remote``), ``url`` as given, and its size:
    ``blocks`` (host, or a disk bounded in blocks) or ``bytes`` (a disk bounded in bytes); ``path`` is a
    disk tier's folder."""

    medium: str
    url: str
    blocks: int | None = None
    bytes: int | None = None
    path: str | None = None


def parse_tier_url(url: str) -> TierURL:
    """``url`` checked (see the module docstring); nothing is created or connected.

    Raises:
        ConfigError: an unknown scheme, a missing or malformed size, unknown options, a disk folder that
            cannot be created or written, a malformed Redis address.
    """
    if not isinstance(url, str):
        raise _bad_url(url, "expected a str such as host://?blocks=1024")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:  # an unclosed [ of an IPv6 address
        raise _bad_url(url, str(exc)) from None
    medium = MEDIUMS.get(parts.scheme)
    if medium is None:
        raise _bad_url(url, "the scheme must be host://, file:// or redis://")
    if medium == "remote":
        from kvpool.tiers.redis import check_url  # redis-py: only for a Redis tier

        return TierURL(medium, check_url(url))
    if parts.fragment:
        raise _bad_url(url, "no #fragment")
    options = _options(url, parts.query)
    if medium == "host":
        if parts.netloc or parts.path not in ("", "/"):
            raise _bad_url(url, "a host tier has no address (host://?blocks=N)")
        if set(options) != {"blocks"}:
            raise _bad_url(url, "a host tier takes one option, blocks=N")
        return TierURL(medium, url, blocks=_positive(url, options["blocks"]))
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise _bad_url(url, "a disk tier is file:///ABSOLUTE/DIR (or file:DIR)")
    if len(options) != 1 or not set(options) <= {"bytes", "blocks"}:
        raise _bad_url(url, "a disk tier takes one size, bytes=SIZE or blocks=N")
    path = urllib.parse.unquote(parts.path)
    if "blocks" in options:
        return disk_tier(path, blocks=_positive(url, options["blocks"]), url=url)
    try:
        size = parse_bytes(options["bytes"])
    except ValueError as exc:
        raise _bad_url(url, str(exc)) from None
    return disk_tier(path, bytes=size, url=url)


def disk_tier(folder: str, *, bytes: int | None = None, blocks: int | None = None, url: str | None = None,
              what: str | None = None) -> TierURL:
    """The checked :class:`TierURL` of a disk tier in ``folder`` bounded in ``bytes`` or in ``blocks`` (one
    of them): the folder is probed once (:func:`check_folder`). ``url``: the tier's URL as written (default:
    :func:`disk_url` of the folder); ``what``: how an error names the tier (default: by its URL).

    Raises:
        ConfigError: a folder that cannot be created or written, no size or two, a size below 1.
    """
    url = url if url is not None else disk_url(folder, bytes=bytes, blocks=blocks)
    check_folder(folder, what if what is not None else f"bad tier URL {redact_url(url)!r}")
    if (bytes is None) == (blocks is None):
        raise _bad_url(url, "a disk tier takes one size, bytes=SIZE or blocks=N")
    size, unit = (bytes, "bytes") if bytes is not None else (blocks, "blocks")
    if size is None or size < 1:
        raise _bad_url(url, f"the disk tier needs {unit} > 0")
    return TierURL("disk", url, blocks=blocks, bytes=bytes, path=folder)


def _options(url: str, query: str) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise _bad_url(url, "options are name=value pairs joined by &") from None
    options = dict(pairs)
    if len(options) != len(pairs):
        raise _bad_url(url, "an option is given twice")
    return options


def _positive(url: str, text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) < 1:
        raise _bad_url(url, f"blocks must be an integer >= 1, got {text!r}")
    return int(text)


def check_folder(path: str, what: str) -> None:
    """The folder ``path`` exists and is writable, or its nearest existing parent is (it will be created);
    ConfigError starting with ``what`` otherwise. Probed, not only asked (``os.access`` says yes to root
    everywhere, even in ``/proc``): a folder is created in the nearest existing one and removed again, so
    nothing is left behind."""
    folder = Path(path)
    try:
        parent = next((p for p in (folder, *folder.parents) if "\0" not in path and p.exists()), None)
    except OSError:  # a name too long for the file system
        parent = None
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) \
            or not _can_create_in(parent):
        raise ConfigError(f"{what}: {path!r} is not a folder that can be created or written")


def _can_create_in(folder: Path) -> bool:
    """Whether a folder can be created (and removed) in ``folder``."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvpool-probe-", dir=folder))
    except OSError:
        return False
    return True


def check_chain(urls: Sequence[str | TierURL]) -> list[TierURL]:
    """Every URL of a chain checked, and the chain's order: at most one host tier, and it comes first. A
    :class:`TierURL` was checked when it was made: it is taken as it is (a URL is parsed once per
    command). Raises ConfigError."""
    parsed = [u if isinstance(u, TierURL) else parse_tier_url(u) for u in urls]
    hosts = [i for i, t in enumerate(parsed) if t.medium == "host"]
    if len(hosts) > 1 or hosts and hosts[0] != 0:
        raise ConfigError("a tier chain has at most one host tier, and it comes first (fastest first)")
    return parsed


def tiers_from_urls(urls: Sequence[str | TierURL], namespace: Any, *, block_bytes: int, like: Any = None,
                    auth_key: Any = None) -> list[Any]:
    """The tiers ``urls`` (URLs, or :class:`TierURL` s checked already) describe, fastest first, each
    :func:`build_tier`'s. ``auth_key``: as :func:`resolve_auth_key` reads it, for the disk and Redis tiers.

    Raises:
        ConfigError: as :func:`check_chain` and :func:`build_tier`.
    """
    chain = check_chain(urls)
    key = resolve_auth_key(auth_key) if any(t.medium != "host" for t in chain) else None
    return [build_tier(tier, namespace, block_bytes=block_bytes, like=like, auth_key=key) for tier in chain]


def resolve_auth_key(auth_key: Any = None) -> Any:
    """The :class:`~kvpool.tiers.auth.TierKey` a disk or Redis tier authenticates its values with: a key, or
    a secret (str or bytes: the tier makes the key), as it is; ``"public"``: :meth:`~kvpool.tiers.auth.
    TierKey.public` (an explicit opt-out); None: the environment's (:meth:`~kvpool.tiers.auth.TierKey.
    from_env`, None when it holds none: the tier then refuses to open)."""
    from kvpool.tiers.auth import TierKey

    if auth_key is None:
        return TierKey.from_env()
    return TierKey.public() if isinstance(auth_key, str) and auth_key == "public" else auth_key


def build_tier(tier: TierURL, namespace: Any, *, block_bytes: int, like: Any = None, auth_key: Any = None,
               **redis_options: Any) -> Any:
    """The one place a tier is made from its description: ``tier`` in ``namespace`` (a
    :class:`~kvpool.tiers.backend.Namespace`), storing ``block_bytes`` per block (0: hash-only, a replay).
    A host tier copies ``like``, the device cache (None: hash-only); a disk tier bounded in blocks holds
    that many values with their 64-byte headers; a Redis tier takes ``redis_options`` (``prefix``,
    ``timeout_s``, ``retry_s``, ``ttl_s``: see :class:`~kvpool.tiers.redis.RedisTier`). ``auth_key``: the
    disk and Redis tiers' :class:`~kvpool.tiers.auth.TierKey` (or a secret), used as it is (see
    :func:`resolve_auth_key`).

    Raises:
        ConfigError: a disk or Redis tier without a key, Redis options for another tier, or a tier that
            cannot be built (a disk folder another process holds, a host buffer too large).
    """
    if redis_options and tier.medium != "remote":
        raise ConfigError(f"options {', '.join(sorted(redis_options))} are for a Redis tier, not a "
                          f"{tier.medium} tier")
    if tier.medium == "host":
        from kvpool.tiers.host import HostTier

        return HostTier(tier.blocks, namespace, like=like)
    if tier.medium == "disk":
        from kvpool.tiers.backend import HEADER_BYTES
        from kvpool.tiers.file import FileTier

        capacity = tier.bytes if tier.bytes is not None else tier.blocks * (HEADER_BYTES + block_bytes)
        return FileTier(tier.path, namespace, capacity_bytes=capacity, block_bytes=block_bytes,
                        auth_key=auth_key)
    from kvpool.tiers.redis import RedisTier

    return RedisTier(tier.url, namespace, block_bytes=block_bytes, auth_key=auth_key, **redis_options)


def host_url(blocks: int) -> str:
    return f"host://?blocks={blocks}"


def disk_url(folder: str, *, bytes: int | None = None, blocks: int | None = None) -> str:
    """The URL of a disk tier in ``folder`` (made absolute) bounded in bytes or blocks."""
    path = urllib.parse.quote(str(Path(folder).absolute()))
    return f"file://{path}?bytes={bytes}" if bytes is not None else f"file://{path}?blocks={blocks}"


def _bad_url(url: object, why: str) -> ConfigError:
    """The error for a refused URL: it names the URL with its password hidden (:func:`redact_url`)."""
    return ConfigError(f"bad tier URL {redact_url(url)!r}: {why}")

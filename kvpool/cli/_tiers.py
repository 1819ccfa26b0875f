"""The tier options shared by ``kvpool generate`` and ``kvpool replay``, and the tiers they build.

``--tier URL`` (repeatable; :mod:`kvpool.tiers.from_url`: ``host://?blocks=N``, ``file:///DIR?bytes=SIZE``
or ``?blocks=N``, ``redis://HOST:PORT``) names each tier below the device pool; the older spellings
``--host-blocks N``, ``--disk-dir DIR`` with ``--disk-bytes BYTES`` or ``--disk-blocks N``, and ``--remote
redis://HOST:PORT`` say the same and keep working (both commands take all of them). The chain runs fastest
first: host, disk, remote. ``--write-through``, ``--tier-admission K``. The tier modules (redis-py, xxhash,
blake3: the ``tiers`` extra) are imported only when a tier is asked for. The disk and Redis tiers
authenticate their values with the fleet secret of the environment
(:meth:`~kvpool.tiers.auth.TierKey.from_env`: ``$KVPOOL_TIER_KEY``, else ``$KVPOOL_HASH_SEED``); without one
they are refused (exit 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvpool.allocators.hashing import hashes_leave_process
from kvpool.cli._args import parse_bytes, positive_int
from kvpool.errors import ConfigError
from kvpool.tiers.auth import redact_url
from kvpool.tiers.from_url import TierURL, check_chain, disk_tier, host_url, tiers_from_urls

_ORDER = {"host": 0, "disk": 1, "remote": 2}


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """The tier options, the same for every command that takes them."""
    group = parser.add_argument_group("tiers below the device pool (kvpool's tiers extra)")
    group.add_argument("--tier", action="append", default=[], metavar="URL",
                       help="a tier, repeatable, fastest first: host://?blocks=N, file:///DIR?bytes=SIZE "
                            "(or ?blocks=N), redis://HOST:PORT")
    group.add_argument("--host-blocks", type=positive_int, metavar="N",
                       help="a host (CPU) tier of N blocks (as --tier host://?blocks=N)")
    group.add_argument("--disk-dir", metavar="DIR", help="a disk tier in DIR (created if missing), sized by "
                                                        "--disk-bytes or --disk-blocks")
    group.add_argument("--disk-bytes", type=parse_bytes, metavar="BYTES",
                       help="the disk tier's size, e.g. 4GiB (files with their 64-byte headers)")
    group.add_argument("--disk-blocks", type=positive_int, metavar="N", help="the disk tier's size in blocks")
    group.add_argument("--remote", metavar="URL",
                       help="a Redis server or Redis Cluster node shared by processes: redis://HOST:PORT")
    group.add_argument("--write-through", action="store_true",
                       help="store each block in every tier when it is published (default: when the device "
                            "evicts it, cascading down)")
    group.add_argument("--tier-admission", type=admission_arg, default=1, metavar="K",
                       help="a count K or the word valued. K: frequency admission, a block goes down "
                            "only once it has been offered K times (evicted, or published with "
                            "--write-through); 1 stores every block. valued: only the blocks the device's "
                            "eviction policy values (not one-hit wonders by its own signal: s3fifo's main "
                            "queue, sieve's visited, lineage's reused)")


def tier_chain(args: argparse.Namespace) -> list[TierURL]:
    """The chain the options ask for, checked, fastest first: read once per command and kept in
    ``args.tier_chain``, so each URL is parsed, and a disk tier's folder probed, once however often the
    command asks. Raises ConfigError for half a disk tier, a disk tier given two sizes, or a malformed chain
    (:func:`kvpool.tiers.from_url.check_chain`: the ``--tier`` URLs in their order, then the whole chain)."""
    chain = getattr(args, "tier_chain", None)
    if chain is None:
        chain = args.tier_chain = _read_chain(args)
    return chain


def _read_chain(args: argparse.Namespace) -> list[TierURL]:
    chain = check_chain(args.tier)
    if args.host_blocks:
        chain.append(TierURL("host", host_url(args.host_blocks), blocks=args.host_blocks))
    sizes = [s for s in (args.disk_bytes, args.disk_blocks) if s is not None]
    if (args.disk_dir is None) != (not sizes) or len(sizes) > 1:
        raise ConfigError("a disk tier needs --disk-dir and one size: --disk-bytes or --disk-blocks")
    if args.disk_dir:
        chain.append(disk_tier(str(Path(args.disk_dir).absolute()), bytes=args.disk_bytes,
                               blocks=args.disk_blocks, what=f"--disk-dir {args.disk_dir!r}"))
    if args.remote:
        from kvpool.tiers.redis import check_url  # its messages name a Redis URL

        chain.append(TierURL("remote", check_url(args.remote)))
    return check_chain(sorted(chain, key=lambda t: _ORDER[t.medium]))


def tier_urls(args: argparse.Namespace) -> list[str]:
    """The URLs of :func:`tier_chain`, fastest first."""
    return [t.url for t in tier_chain(args)]


def wants_tiers(args: argparse.Namespace) -> bool:
    """Whether any tier is asked for (the chain checked); ConfigError for write-through or admission
    without a tier."""
    some = bool(tier_urls(args))
    if (args.write_through or args.tier_admission != 1) and not some:
        raise ConfigError("--write-through and --tier-admission need a tier (--tier, --host-blocks, "
                          "--disk-dir, --remote)")
    return some


def check_tier_targets(args: argparse.Namespace) -> None:
    """Fail early (before a model loads) on any malformed tier, or a disk or Redis tier without a tier
    secret in the environment (:func:`tier_auth_key`)."""
    tier_urls(args)
    tier_auth_key(args)


def admission_arg(text: str) -> int | str:
    """``--tier-admission``: ``valued`` or an integer >= 1."""
    return "valued" if text.strip().lower() == "valued" else positive_int(text)


def tier_admission(args: argparse.Namespace) -> Any:
    """The :class:`~kvpool.allocators.policies.FrequencyAdmission` (or ``ValuedAdmission``) that
    ``--tier-admission`` asks for, or None."""
    from kvpool.allocators.policies import FrequencyAdmission, ValuedAdmission

    if args.tier_admission == "valued":
        return ValuedAdmission()
    return FrequencyAdmission(args.tier_admission) if args.tier_admission > 1 else None


def leaves_process(args: argparse.Namespace) -> bool:
    """Whether a tier keeps blocks outside this process (disk, remote): their values need the fleet secret
    (:func:`tier_auth_key`), their hashes a shared hasher (:func:`hashes_leave`)."""
    return hashes_leave_process(media=_media(args))


def hashes_leave(args: argparse.Namespace) -> bool:
    """Whether the command's block hashes leave this process (``--kv-events``, a disk or Redis tier), so its
    hasher must be shared: :func:`~kvpool.allocators.hashing.hashes_leave_process`."""
    return hashes_leave_process(events=getattr(args, "kv_events", None) is not None, media=_media(args))


def _media(args: argparse.Namespace) -> list[str]:
    return [t.medium for t in tier_chain(args)]


# ---- the tier secret and the hash root (what a shared store's operator could otherwise do) ---------------

def tier_auth_key(args: argparse.Namespace) -> Any:
    """The :class:`~kvpool.tiers.auth.TierKey` of the environment for the disk and Redis tiers (None when
    none is asked for). Raises ConfigError when they are asked for and no secret is set."""
    if not leaves_process(args):
        return None
    from kvpool.tiers.auth import KEY_ENV, TierKey

    key = TierKey.from_env()
    if key is None:
        raise ConfigError(f"{_leaving(args)}: tier values that leave the process are authenticated with "
                          f"a fleet secret: set ${KEY_ENV} (or $KVPOOL_HASH_SEED) to the same secret of at "
                          f"least 16 bytes in every process, e.g. export {KEY_ENV}=$(python3 -c "
                          "'import secrets; print(secrets.token_hex(32))')")
    return key


def public_root_hint(args: argparse.Namespace, hasher: Any) -> str | None:
    """One line for stderr when block hashes leave the process (a disk or Redis tier, ``--kv-events``)
    from the public root (no ``$KVPOOL_HASH_SEED``): whoever sees them (a store's key names, the event
    stream) can confirm a guessed prompt by hashing it. None otherwise. (The tier values' secret needs no
    hint: without one a disk or Redis tier is refused, :func:`tier_auth_key`.)"""
    if hasher.seeded or not hashes_leave(args):
        return None
    events = getattr(args, "kv_events", None) is not None
    where = " and ".join(filter(None, [_leaving(args), "--kv-events" if events else ""]))
    return (f"hint: block hashes leave this process ({where}) from the public root, so whoever sees them can "
            "confirm a guessed prompt: set $KVPOOL_HASH_SEED to a secret of at least 16 bytes, the same in "
            "every process")


def _leaving(args: argparse.Namespace) -> str:
    """The options asking for tiers that keep blocks outside the process."""
    named = [name for name, on in (("--disk-dir", args.disk_dir), ("--remote", args.remote)) if on]
    named += [f"--tier {redact_url(t.url)}" for t in tier_chain(args)
              if t.url in args.tier and t.medium != "host"]
    return " and ".join(named)


def build_tiers(args: argparse.Namespace, namespace: Any, *, block_bytes: int, like: Any = None,
                auth_key: Any = None) -> list[Any]:
    """The tiers the options ask for, fastest first, in ``namespace``; ``like``: the device cache a host
    tier copies (None: hash-only); ``auth_key``: the disk and Redis tiers'
    :class:`~kvpool.tiers.auth.TierKey` (None: :func:`tier_auth_key`, the environment's)."""
    key = auth_key if auth_key is not None else tier_auth_key(args)
    return tiers_from_urls(tier_chain(args), namespace, block_bytes=block_bytes, like=like, auth_key=key)

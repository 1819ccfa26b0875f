"""The tier options shared by ``kvpool generate`` and ``kvpool replay``, and the tiers they build.

``--host-blocks N``, ``--disk-dir DIR`` with ``--disk-bytes BYTES`` (generate) or ``--disk-blocks N``
(replay), ``--remote redis://HOST:PORT``, ``--write-through``. The tier modules (redis-py, xxhash, blake3:
the ``tiers`` extra) are imported only when a tier is asked for. The disk and Redis tiers authenticate
their values with the fleet secret of the environment (:meth:`~kvpool.tiers.auth.TierKey.from_env`:
``$KVPOOL_TIER_KEY``, else ``$KVPOOL_HASH_SEED``); without one they are refused (exit 2).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvpool.cli._args import parse_bytes, positive_int
from kvpool.errors import ConfigError


def add_tier_arguments(parser: argparse.ArgumentParser, *, disk_in_blocks: bool) -> None:
    """The tier options; the disk tier's size in blocks (a replay moves no bytes) or in bytes."""
    group = parser.add_argument_group("tiers below the device pool (pip install kvpool[tiers])")
    group.add_argument("--host-blocks", type=positive_int, metavar="N", help="a host (CPU) tier of N blocks")
    group.add_argument("--disk-dir", metavar="DIR", help="a disk tier in DIR (created if missing)")
    if disk_in_blocks:
        group.add_argument("--disk-blocks", type=positive_int, metavar="N",
                           help="the disk tier's size in blocks")
    else:
        group.add_argument("--disk-bytes", type=parse_bytes, metavar="BYTES",
                           help="the disk tier's size, e.g. 4GiB (files with their 64-byte headers)")
    group.add_argument("--remote", metavar="URL",
                       help="a Redis server or Redis Cluster node shared by processes: redis://HOST:PORT")
    group.add_argument("--write-through", action="store_true",
                       help="store each block in every tier when it is published (default: when the device "
                            "evicts it, cascading down)")
    group.add_argument("--tier-admission", type=positive_int, default=1, metavar="K",
                       help="frequency admission: a block goes down only once it has been offered K times "
                            "(evicted, or published with --write-through); 1 stores every block")


def wants_tiers(args: argparse.Namespace) -> bool:
    """Whether any tier option is given; ConfigError for half a disk tier or write-through alone."""
    size = getattr(args, "disk_blocks", None) if hasattr(args, "disk_blocks") else args.disk_bytes
    size_name = "--disk-blocks" if hasattr(args, "disk_blocks") else "--disk-bytes"
    if (args.disk_dir is None) != (size is None):
        raise ConfigError(f"a disk tier needs both --disk-dir and {size_name}")
    some = bool(args.host_blocks or args.disk_dir or args.remote)
    if (args.write_through or args.tier_admission > 1) and not some:
        raise ConfigError("--write-through and --tier-admission need a tier (--host-blocks, --disk-dir, "
                          "--remote)")
    return some


def tier_admission(args: argparse.Namespace) -> Any:
    """The :class:`~kvpool.allocators.policies.FrequencyAdmission` ``--tier-admission`` asks for, or None."""
    from kvpool.allocators.policies import FrequencyAdmission

    return FrequencyAdmission(args.tier_admission) if args.tier_admission > 1 else None


def check_tier_targets(args: argparse.Namespace) -> None:
    """Fail early (before a model loads) on a malformed ``--remote`` URL, a ``--disk-dir`` that cannot be
    a folder, or either without a tier secret in the environment (:func:`tier_auth_key`)."""
    _check_places(args)
    tier_auth_key(args)


def _check_places(args: argparse.Namespace) -> None:
    if args.remote:
        from kvpool.tiers.redis import check_url

        check_url(args.remote)
    if args.disk_dir:
        folder = Path(args.disk_dir)
        parent = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"--disk-dir {args.disk_dir!r}: not a folder that can be created or written")


def leaves_process(args: argparse.Namespace) -> bool:
    """Whether a tier keeps block hashes outside this process (disk, remote): they need a shared hasher."""
    return bool(args.disk_dir or args.remote)


# ---- the tier secret and the hash root (what a shared store's operator could otherwise do) ---------------

def tier_auth_key(args: argparse.Namespace) -> Any:
    """The :class:`~kvpool.tiers.auth.TierKey` of the environment for ``--disk-dir`` / ``--remote`` (None
    when neither is asked for). Raises ConfigError when they are asked for and no secret is set."""
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
    events = getattr(args, "kv_events", None) is not None
    if hasher.seeded or not (events or leaves_process(args)):
        return None
    where = " and ".join(filter(None, [_leaving(args), "--kv-events" if events else ""]))
    return (f"hint: block hashes leave this process ({where}) from the public root, so whoever sees them can "
            "confirm a guessed prompt: set $KVPOOL_HASH_SEED to a secret of at least 16 bytes, the same in "
            "every process")


def _leaving(args: argparse.Namespace) -> str:
    return " and ".join(name for name, on in (("--disk-dir", args.disk_dir), ("--remote", args.remote)) if on)


def build_tiers(args: argparse.Namespace, namespace: Any, *, block_bytes: int, like: Any = None,
                auth_key: Any = None) -> list[Any]:
    """The tiers the options ask for, fastest first (host, disk, remote), in ``namespace``; ``like``: the
    device cache a host tier copies (None: hash-only); ``auth_key``: the disk and Redis tiers'
    :class:`~kvpool.tiers.auth.TierKey` (None: :func:`tier_auth_key`, the environment's)."""
    from kvpool.tiers.backend import HEADER_BYTES
    from kvpool.tiers.file import FileTier
    from kvpool.tiers.host import HostTier
    from kvpool.tiers.redis import RedisTier

    _check_places(args)
    auth_key = auth_key if auth_key is not None else tier_auth_key(args)
    tiers: list[Any] = []
    if args.host_blocks:
        tiers.append(HostTier(args.host_blocks, namespace, like=like))
    if args.disk_dir:
        capacity = args.disk_blocks * (HEADER_BYTES + block_bytes) if hasattr(args, "disk_blocks") \
            else args.disk_bytes
        tiers.append(FileTier(args.disk_dir, namespace, capacity_bytes=capacity, block_bytes=block_bytes,
                              auth_key=auth_key))
    if args.remote:
        tiers.append(RedisTier(args.remote, namespace, block_bytes=block_bytes, auth_key=auth_key))
    return tiers

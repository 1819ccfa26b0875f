"""``kvpool bench tiers``: store and load bandwidth of each tier against a raw baseline of the same bytes,
timed in the same run, and the replay's speed with a tier chain.

For two real block shapes (SmolLM2-135M and Llama-3-8B, bfloat16, 16 tokens: 360 KiB and 2 MiB), a batch of
``--batch`` blocks (default: 64) goes through each tier and back:

* **host**: ``HostTier.store_from_device`` / ``load_to_device`` (the device is a CPU cache here) against one
  ``copy_`` of the same bytes between two contiguous tensors;
* **disk**: ``FileTier.set`` / ``get`` (a file per block, header and MAC included) against writing /
  reading the same payloads as plain files in the same folder (one ``write`` / ``readinto`` each);
* **remote**: ``RedisTier.set`` / ``get`` (pipelined, header and MAC included) against a raw redis-py
  pipeline of ``SET`` / ``GET`` of the same payloads. A ``redis-server`` is started on a free loopback port
  unless ``--remote URL`` names one; without the binary the rows are skipped.

Each repetition times the tier and its baseline back to back (the tier cleared first, outside the timing),
and the ratio is the median of the per-repetition ratios (baseline time / tier time: 1.0 = as fast as the
baseline), so load from other processes hits both. Target: ratio >= 0.80 at 64 blocks. The replay row
replays the first ``--max-requests`` Mooncake requests at block size 16 on a 20,000-block device pool
with an unbounded host tier (the identity run); target >= 1M block operations per second.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvpool.bench.timing import print_table, require_at_least
from kvpool.options import CommaList, add_deprecated_alias, non_negative_int, positive_int
from kvpool.spec import KVCacheSpec
from kvpool.storage.paged import PagedKVCache

_BF16_16 = dict(dtype=torch.bfloat16, block_size=16)
BLOCKS = {  # KV heads and head_dim of tests/configs/smollm2-135m.json and llama-3.1-8b.json
    "smollm2-135m": KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, **_BF16_16),
    "llama-3-8b": KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, **_BF16_16),
}
TARGET_RATIO = 0.80
BENCH_TIER_KEY = "kvpool bench tier key, not a secret"  # the MAC costs the same under any key
TARGET_OPS_PER_S = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=positive_int, default=64, metavar="N",
                        help="blocks per store / load call (default: 64)")
    parser.add_argument("--repeat", type=positive_int, default=5, metavar="N",
                        help="timed repetitions (median; default: 5)")
    shapes = parser.add_argument("--block-shapes", dest="blocks", action=CommaList, allowed=list(BLOCKS),
                                 default=list(BLOCKS), metavar="NAME,...",
                                 help=f"block shapes (default: {','.join(BLOCKS)})")
    add_deprecated_alias(parser, "--blocks", shapes)
    parser.add_argument("--disk-dir", metavar="DIR",
                        help="folder for the disk tier (default: a temporary one)")
    parser.add_argument("--remote", metavar="URL", help="a Redis to use (default: start one if installed)")
    requests = parser.add_argument("--max-requests", dest="replay_requests", type=non_negative_int,
                                   default=2000, metavar="N",
                                   help="Mooncake requests for the replay row (0: skip it; default: 2000)")
    add_deprecated_alias(parser, "--replay-requests", requests)


def run(args: argparse.Namespace) -> dict[str, Any]:
    require_at_least(args, {"batch": 1, "repeat": 1, "replay_requests": 0})
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with _folder(args.disk_dir) as folder, _redis(args.remote, notes) as url:
        for name in args.blocks:
            rows += _block_rows(name, BLOCKS[name], args, folder, url)
    replay = _replay_row(args.replay_requests) if args.replay_requests else None
    if not args.json:
        print_table(f"tier store / load of {args.batch} blocks against a raw baseline of the same bytes "
                    f"(median of {args.repeat}; ratio = baseline time / tier time)",
                    ["block", "tier", "op", "MiB", "tier GB/s", "baseline", "base GB/s", "ratio"],
                    [[r["block"], r["tier"], r["op"], r["mib"], r["gb_s"], r["baseline"], r["baseline_gb_s"],
                      r["ratio"]] for r in rows])
        if replay:
            print(f"replay with an unbounded host tier: {replay['block_ops_per_s']:,.0f} block ops/s "
                  f"({replay['x_target']:.2f}x the 1M target), hit ratio {replay['block_hit_ratio']:.4f}")
        for note in notes:
            print(note)
    return {"suite": "tiers", "batch": args.batch, "repeat": args.repeat, "target_ratio": TARGET_RATIO,
            "rows": rows, "replay": replay, "notes": notes, "torch_threads": torch.get_num_threads()}


# ---- the tiers ----------------------------------------------------------------------------------------

def _block_rows(name: str, spec: KVCacheSpec, args: argparse.Namespace, folder: Path, url: str | None
                ) -> list[dict[str, Any]]:
    from kvpool.tiers.auth import TierKey
    from kvpool.tiers.backend import Namespace, gather_rows
    from kvpool.tiers.file import FileTier
    from kvpool.tiers.host import HostTier
    from kvpool.tiers.redis import RedisTier

    n = args.batch
    device = PagedKVCache(spec, 2 * n, zero=True)
    device.buffer.view(torch.int16).random_(-(2**15), 2**15, generator=torch.Generator().manual_seed(0))
    ns = Namespace.for_cache(device, model=f"bench:{name}", hash_scheme="bench")
    bpb = device.bytes_per_block
    rows_in = torch.empty(n, bpb, dtype=torch.uint8)
    gather_rows(device, list(range(n)), rows_in)
    keys = [i.to_bytes(16, "big") for i in range(n)]
    out: list[dict[str, Any]] = []
    host = HostTier(n, ns, like=device)
    out += _host_rows(name, host, device, keys, args.repeat)
    key = TierKey(BENCH_TIER_KEY)
    disk = FileTier(folder / "tier", ns, capacity_bytes=2 * n * (bpb + 64), block_bytes=bpb, auth_key=key)
    out += _byte_tier_rows(name, disk, rows_in, keys, args.repeat, _FileBaseline(folder / "raw", rows_in))
    disk.clear()
    disk.close()
    if url is not None:
        remote = RedisTier(url, ns, block_bytes=bpb, auth_key=key)
        out += _byte_tier_rows(name, remote, rows_in, keys, args.repeat, _RedisBaseline(url, rows_in))
        remote.clear()
        remote.close()
    return out


def _host_rows(name: str, host: Any, device: PagedKVCache, keys: list[bytes], repeat: int) -> list[dict]:
    n = len(keys)
    src_ids, dst_ids = list(range(n)), list(range(n, 2 * n))
    nbytes = n * device.bytes_per_block
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1), b.fill_(2)  # touched: no page faults in the timing

    def store() -> None:
        host.store_from_device(device, src_ids, keys)

    def load() -> None:
        assert host.load_to_device(device, keys, dst_ids) == n

    def baseline() -> None:
        b.copy_(a)

    rows = [_pair(name, "host", "store", store, baseline, "copy_", nbytes, repeat, setup=host.clear)]
    store()
    rows.append(_pair(name, "host", "load", load, baseline, "copy_", nbytes, repeat))
    return rows


def _byte_tier_rows(name: str, tier: Any, rows_in: torch.Tensor, keys: list[bytes], repeat: int,
                    raw: Any) -> list[dict]:
    n, nbytes = len(keys), rows_in.numel()
    out = torch.empty_like(rows_in)
    out.fill_(0)

    def store() -> None:
        assert tier.set(keys, rows_in) == n

    def load() -> None:
        assert tier.get(keys, out) == n

    def setup() -> None:
        tier.clear()
        raw.clear()

    rows = [_pair(name, tier.medium, "store", store, raw.store, raw.what("store"), nbytes, repeat,
                  setup=setup)]
    store()
    raw.store()
    rows.append(_pair(name, tier.medium, "load", load, raw.load, raw.what("load"), nbytes, repeat))
    if not torch.equal(out, rows_in):
        raise AssertionError(f"the {tier.medium} tier returned other bytes than it stored")
    return rows


class _FileBaseline:
    """One plain file per payload in ``folder``: ``write`` and ``readinto``, nothing else."""

    def __init__(self, folder: Path, rows: torch.Tensor) -> None:
        self.folder, self.rows = folder, rows
        folder.mkdir(parents=True, exist_ok=True)
        self.paths = [folder / f"{i:032x}" for i in range(rows.shape[0])]
        self.out = torch.zeros_like(rows)

    def what(self, op: str) -> str:
        return "file write" if op == "store" else "file read"

    def store(self) -> None:
        for path, row in zip(self.paths, self.rows, strict=True):
            with open(path, "wb", buffering=0) as f:
                f.write(memoryview(row.numpy()))

    def load(self) -> None:
        for path, row in zip(self.paths, self.out, strict=True):
            with open(path, "rb", buffering=0) as f:
                f.readinto(memoryview(row.numpy()))

    def clear(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)


class _RedisBaseline:
    """A raw redis-py pipeline of ``SET`` / ``GET`` of the payloads (as ``bytes``, built once)."""

    def __init__(self, url: str, rows: torch.Tensor) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.values = [row.numpy().tobytes() for row in rows]
        self.names = [f"bench-raw:{i}".encode() for i in range(len(self.values))]

    def what(self, op: str) -> str:
        return "redis SET" if op == "store" else "redis GET"

    def store(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, value in zip(self.names, self.values, strict=True):
            pipe.set(name, value)
        pipe.execute()

    def load(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name in self.names:
            pipe.get(name)
        assert all(v is not None for v in pipe.execute())

    def clear(self) -> None:
        self.client.delete(*self.names)


def _pair(name: str, tier: str, op: str, fn: Callable[[], None], base: Callable[[], None], base_name: str,
          nbytes: int, repeat: int, setup: Callable[[], object] | None = None) -> dict[str, Any]:
    """Time ``fn`` and ``base`` back to back ``repeat`` times (``setup`` before each, untimed); the ratio
    is the median of base time / fn time."""
    fn_s, base_s = [], []
    for _ in range(repeat + 1):  # the first pair warms caches and is dropped
        for f, times in ((fn, fn_s), (base, base_s)):
            if setup is not None:
                setup()
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
    fn_s, base_s = fn_s[1:], base_s[1:]
    t, b = statistics.median(fn_s), statistics.median(base_s)
    return {"block": name, "tier": tier, "op": op, "blocks_bytes": nbytes, "mib": nbytes / 2**20,
            "s": t, "gb_s": nbytes / t / 1e9, "baseline": base_name, "baseline_s": b,
            "baseline_gb_s": nbytes / b / 1e9,
            "ratio": statistics.median(bb / tt for bb, tt in zip(base_s, fn_s, strict=True))}


# ---- the replay ----------------------------------------------------------------------------------------

def _replay_row(requests: int) -> dict[str, Any]:
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier
    from kvpool.trace.loaders import load_trace
    from kvpool.trace.replay import ReplayConfig, run_replay, unbounded_num_blocks

    trace = load_trace(max_requests=requests)
    host = HostTier(unbounded_num_blocks(trace.requests, 16), Namespace("bench", "none", "hash-only"))
    result = run_replay(trace.requests, ReplayConfig(block_size=16, num_blocks=20_000), tiers=[host])
    return {"requests": result.requests_completed, "block_size": 16, "num_blocks": 20_000,
            "block_ops": result.block_ops, "wall_s": result.wall_s, "block_ops_per_s": result.block_ops_per_s,
            "x_target": result.block_ops_per_s / TARGET_OPS_PER_S, "block_hit_ratio": result.block_hit_ratio,
            "tier_hits": result.tier_hits}


# ---- resources -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def _folder(given: str | None) -> Iterator[Path]:
    if given is not None:
        Path(given).mkdir(parents=True, exist_ok=True)
        yield Path(given)
        return
    folder = Path(tempfile.mkdtemp(prefix="kvpool-bench-tiers-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _redis(url: str | None, notes: list[str]) -> Iterator[str | None]:
    """``url``, or a redis-server of our own on a free loopback port (stopped at the end), or None."""
    if url is not None:
        yield url
        return
    if shutil.which("redis-server") is None:
        notes.append("remote rows skipped: no redis-server here (apt-get install redis-server; or --remote)")
        yield None
        return
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="kvpool-bench-redis-")
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", folder], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    try:
        _wait_for_redis(f"redis://127.0.0.1:{port}")
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def _die_with_parent() -> None:
    """Linux: the server gets SIGKILL when this process dies, even killed (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _wait_for_redis(url: str, timeout_s: float = 15.0) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)

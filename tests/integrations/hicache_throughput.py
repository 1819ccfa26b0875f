"""Throughput of kvpool's HiCache backend beside SGLang's own, on the same pages (SGLang venv: run.sh).

Pages of SGLang's MHA host pool (CPU, page_first, fp16, 4 layers x 2 KV heads x 64 dims x 16 tokens: 32 KiB a
page) are stored then read back in batches of 128 (HiCache's STORAGE_BATCH_SIZE), the way its cache
controller calls each backend: kvpool's disk and Redis tiers and SGLang's ``SimHiCacheStorage`` through the
zero-copy v1 calls, SGLang's ``file`` backend (HiCacheFile) through the generic calls with the host pool's
page tensors. The simulator runs at its default bandwidth settings (5 GB/s, 100 us per call). Medians of
``--rounds`` rounds; ratios against HiCacheFile in the same round. Prints one table (``--json``: one line).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import sglang_harness as sh
import torch
from redis_servers import redis_server
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.storage.sim_storage import SimHiCacheStorage

BATCH = 128


def measure_v1(backend, host, keys, idx, dst):
    t0 = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        assert all(backend.batch_set_v1(keys[i : i + BATCH], idx[i * sh.PAGE : (i + BATCH) * sh.PAGE]))
    t1 = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        assert all(backend.batch_get_v1(keys[i : i + BATCH], dst[i * sh.PAGE : (i + BATCH) * sh.PAGE]))
    return t1 - t0, time.perf_counter() - t1


def measure_generic(backend, host, keys, idx, dst):
    """HiCache's generic path (cache_controller._generic_page_set / _generic_page_get)."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        data = [host.get_data_page(int(idx[(i + j) * sh.PAGE])) for j in range(len(keys[i : i + BATCH]))]
        assert backend.batch_set(keys[i : i + BATCH], data)
    t1 = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        part = keys[i : i + BATCH]
        pages = backend.batch_get(part, [host.get_dummy_flat_data_page() for _ in part])
        for j, page in enumerate(pages):
            assert page is not None
            host.set_from_flat_data_page(int(dst[(i + j) * sh.PAGE]), page)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    host = sh.host_pool(tokens=args.pages * sh.PAGE)
    gen = torch.Generator().manual_seed(0)
    idx = host.alloc(args.pages * sh.PAGE)
    dst = host.alloc(args.pages * sh.PAGE)
    for i in range(args.pages):
        host.set_from_flat_data_page(
            int(idx[i * sh.PAGE]), torch.randn(host.get_dummy_flat_data_page().shape, generator=gen).half()
        )
    page_bytes = host.get_dummy_flat_data_page().numel() * 2
    total = args.pages * page_bytes
    results: dict[str, list[tuple[float, float]]] = {}
    work = Path(tempfile.mkdtemp(prefix="kvpool-hicache-"))
    with redis_server(work / "redis") as server:
        for r in range(args.rounds):
            keys = [f"{r:08x}{i:056x}" for i in range(args.pages)]
            sides = {
                "SGLang file (HiCacheFile)": (
                    lambda: HiCacheFile(sh.storage_config({"file_storage_path": str(work / f"f{r}")})),  # noqa: B023
                    measure_generic,
                ),
                "SGLang sim (5 GB/s, 100 us)": (lambda: SimHiCacheStorage(sh.storage_config({})), measure_v1),
                "kvpool disk (FileTier)": (
                    lambda: StorageBackendFactory.create_backend(
                        "dynamic",
                        sh.storage_config(
                            sh.kvpool_extra(
                                {
                                    "tier": "disk",
                                    "directory": str(work / f"k{r}"),  # noqa: B023
                                    "capacity_bytes": 4 * total,
                                }
                            )
                        ),
                        host,
                    ),
                    measure_v1,
                ),
                "kvpool redis (RedisTier)": (
                    lambda: StorageBackendFactory.create_backend(
                        "dynamic",
                        sh.storage_config(
                            sh.kvpool_extra({"tier": "redis", "url": server.url}), model=f"round{r}"  # noqa: B023
                        ),
                        host,
                    ),
                    measure_v1,
                ),
            }
            for name, (build, measure) in sides.items():
                backend = build()
                backend.register_mem_pool_host(host)
                results.setdefault(name, []).append(measure(backend, host, keys, idx, dst))
                if hasattr(backend, "close"):
                    backend.close()
    shutil.rmtree(work, ignore_errors=True)
    base = "SGLang file (HiCacheFile)"
    rows = []
    for name, times in results.items():
        w = statistics.median(total / s / 1e9 for s, _ in times)
        g = statistics.median(total / g / 1e9 for _, g in times)
        wr = statistics.median(b[0] / t[0] for t, b in zip(times, results[base], strict=True))
        gr = statistics.median(b[1] / t[1] for t, b in zip(times, results[base], strict=True))
        rows.append(
            {"backend": name, "write_GBps": w, "read_GBps": g, "write_vs_file": wr, "read_vs_file": gr}
        )
    if args.json:
        print(
            json.dumps({"pages": args.pages, "page_bytes": page_bytes, "rounds": args.rounds, "rows": rows})
        )
        return
    print(
        f"{args.pages} pages of {page_bytes // 1024} KiB ({total / 2**20:.0f} MiB), batches of {BATCH}, "
        f"median of {args.rounds} rounds"
    )
    print(f"{'backend':32} {'write GB/s':>10} {'read GB/s':>10} {'write/file':>10} {'read/file':>10}")
    for row in rows:
        print(
            f"{row['backend']:32} {row['write_GBps']:10.2f} {row['read_GBps']:10.2f} "
            f"{row['write_vs_file']:9.2f}x {row['read_vs_file']:9.2f}x"
        )


if __name__ == "__main__":
    sys.exit(main())

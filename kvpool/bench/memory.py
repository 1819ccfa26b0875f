"""``kvpool bench memory``: what elastic memory costs and what it gives back, against baselines timed in the
same run.

Four tables:

* **Per page.** A :class:`~kvpool.storage.arena.PageArena` commits and releases ``--pages`` pages one call
  each (and all in one call). Baselines: the first write of the same bytes of a fresh ``torch.empty`` buffer
  (the page faults every new tensor pays) and freeing a written ``torch.empty`` buffer of one page (what
  giving memory back costs without an arena). On CUDA (when a GPU and cuda-python are there) the driver's
  calls are timed one by one beside kvcached's A100 figures (create 193 us, map 1.45 us, set_access 36 us,
  unmap 25.6 us per 2 MiB page), and a commit against ``cudaMalloc`` + free of a page (torch's caching
  allocator emptied before each).
* **RSS** (a fresh process): a pool of ``--pool-gib`` GiB elastic against the same pool fixed
  (``torch.empty``): RSS after building it, after writing ``--used`` of its blocks, after releasing them,
  and after ``sleep()``.
* **Layout**: for each model of ``--configs``, the ``[2, L, N, ...]`` strips against the block-major layout
  an elastic cache takes by default: the bytes the first block commits (the step in which memory follows
  use), the pages a block touches (page counts updated per block handed out or freed), and one step's
  ``store_kv`` + ``gather_slots`` over every layer (``--tokens`` decode tokens, each in its own block at a
  random offset), timed in turn.
* **Eviction** (:mod:`kvpool.bench.memory_evict`): the bytes page-aware eviction gives back against LRU
  eviction of as many blocks, in kvcached's ``bench_evict`` shape (4,096 cached blocks, 128 a page, every
  stride-th block touched again; 3,584 evicted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import torch

from kvpool.bench.memory_evict import eviction_rows
from kvpool.bench.timing import print_table, require_at_least
from kvpool.cli.options import CommaList, non_negative_int, positive_int
from kvpool.spec import KVCacheSpec
from kvpool.storage.arena import DEFAULT_PAGE_SIZE, ElasticConfig, PageArena
from kvpool.storage.paged import PagedKVCache

#: kvcached's figures per 2 MiB page on an A100 (its README / issue 32), microseconds.
KVCACHED_A100_US = {"cuMemCreate": 193.0, "cuMemMap": 1.45, "cuMemSetAccess": 36.0, "cuMemUnmap": 25.6}
MiB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=positive_int, default=64, metavar="N", help="pages committed per run")
    parser.add_argument("--page-kib", type=positive_int, default=DEFAULT_PAGE_SIZE // 1024, metavar="N",
                        help="KiB per page, a multiple of 4")
    parser.add_argument("--repeat", type=positive_int, default=5, metavar="N", help="timed repetitions")
    parser.add_argument("--pool-gib", type=non_negative_int, default=4, metavar="GIB",
                        help="the RSS table's pool size in GiB (0 skips the table)")
    parser.add_argument("--used", type=float, default=0.25, metavar="FRACTION",
                        help="fraction of the pool's blocks the RSS table writes")
    parser.add_argument("--configs", action=CommaList, default=["smollm2-135m", "gemma-3-1b", "llama-3.1-8b"],
                        metavar="NAME,...", help="built-in model configs of the layout table")
    parser.add_argument("--tokens", type=positive_int, default=32, metavar="T",
                        help="decode tokens per step in the layout table")
    parser.add_argument("--layout-blocks", type=positive_int, default=None, metavar="N",
                        help="blocks of each layout table cache (default: 256 MiB of them, at least T)")


# ---- per page ---------------------------------------------------------------------------------------------

def _per_page_ns(fn: Callable[[], Any], pages: int, repeat: int, setup: Callable[[], Any]) -> float:
    samples = []
    for _ in range(repeat):
        setup()
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / pages)
    return statistics.median(samples)


def cpu_page_costs(pages: int, page_size: int, repeat: int) -> list[dict[str, Any]]:
    """Arena commit / release per page on the CPU, with the fresh-tensor baselines (see the module)."""
    arena = PageArena(pages * page_size, page_size=page_size)
    ids = list(range(pages))
    held: list[torch.Tensor] = []

    def fresh() -> None:
        held[:] = [torch.empty(pages * page_size, dtype=torch.uint8)]

    def first_write() -> None:
        buffer = held[0]
        for p in ids:
            buffer[p * page_size:(p + 1) * page_size].fill_(0)

    def written_pages() -> None:
        held[:] = [torch.empty(page_size, dtype=torch.uint8).fill_(0) for _ in ids]

    def free() -> None:
        held.clear()

    rows = []
    one_by_one = _per_page_ns(lambda: [arena.commit([p]) for p in ids], pages, repeat, arena.release_all)
    in_one = _per_page_ns(lambda: arena.commit(ids), pages, repeat, arena.release_all)
    touch = _per_page_ns(first_write, pages, repeat, fresh)
    rows.append({"what": "commit, one call a page", "us_per_page": one_by_one / 1e3,
                 "baseline": "first write of a fresh torch.empty", "baseline_us": touch / 1e3,
                 "ratio": one_by_one / touch})
    rows.append({"what": f"commit, {pages} pages in one call", "us_per_page": in_one / 1e3,
                 "baseline": "first write of a fresh torch.empty", "baseline_us": touch / 1e3,
                 "ratio": in_one / touch})
    release = _per_page_ns(lambda: [arena.release([p]) for p in ids], pages, repeat,
                           lambda: arena.commit(ids))
    freed = _per_page_ns(free, pages, repeat, written_pages)
    rows.append({"what": "release, one call a page", "us_per_page": release / 1e3,
                 "baseline": "free of a written torch.empty page", "baseline_us": freed / 1e3,
                 "ratio": release / freed})
    arena.close()
    return rows


class TimedDriver:
    """A proxy of ``cuda.bindings.driver`` that adds each call's wall time to ``seconds[name]``."""

    def __init__(self, driver: Any) -> None:
        self._driver, self.seconds, self.counts = driver, {}, {}

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._driver, name)
        if not name.startswith("cu") or not callable(target):
            return target

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return target(*args)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.counts[name] = self.counts.get(name, 0) + 1

        return timed


def cuda_page_costs(pages: int, page_size: int) -> dict[str, Any] | None:
    """Per-call driver costs of committing and releasing ``pages`` pages on the current GPU (None without a
    GPU or cuda-python), and commit / release against cudaMalloc / cudaFree of a page."""
    if not torch.cuda.is_available():
        return None
    try:
        from kvpool.storage.arena_cuda import CUDABackend, import_driver

        driver = TimedDriver(import_driver())
    except Exception:  # noqa: BLE001 (no cuda-python: the table says so)
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    arena = PageArena(pages * page_size, device=device, page_size=page_size,
                      backend=lambda d: CUDABackend(d, driver=driver))
    ids = list(range(pages))
    start = time.perf_counter()
    for p in ids:
        arena.commit([p])
    commit_s = time.perf_counter() - start
    start = time.perf_counter()
    for p in ids:
        arena.release([p])
    release_s = time.perf_counter() - start
    calls = {name: 1e6 * s / driver.counts[name] for name, s in driver.seconds.items()}
    arena.close()
    start = time.perf_counter()
    for _ in ids:
        torch.cuda.empty_cache()
        torch.empty(page_size, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
    malloc_s = time.perf_counter() - start
    torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(device), "page_size": page_size,
            "commit_us": 1e6 * commit_s / pages, "release_us": 1e6 * release_s / pages,
            "cudamalloc_free_us": 1e6 * malloc_s / pages, "commit_ratio": commit_s / malloc_s,
            "per_call_us": calls, "kvcached_a100_us": KVCACHED_A100_US}


# ---- RSS ---------------------------------------------------------------------------------------------------

_RSS_SCRIPT = textwrap.dedent("""
    import json, sys, torch, psutil
    from kvpool.spec import KVCacheSpec
    from kvpool.storage.paged import PagedKVCache, block_slots
    elastic, gib, used = sys.argv[1] == "elastic", int(sys.argv[2]), float(sys.argv[3])
    rss = lambda: psutil.Process().memory_info().rss
    spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float16, block_size=16)
    blocks = gib * 4096  # 256 KiB a block
    n = int(blocks * used)
    k = torch.full((n * 16, 8, 128), 1.5, dtype=torch.float16)
    slots = block_slots(torch.arange(n), n * 16, 16)
    out, start = {}, rss()
    cache = PagedKVCache(spec, blocks, elastic=elastic)
    out["built"] = rss() - start
    if elastic:
        cache.commit_blocks(range(n))
    for layer in range(4):
        cache.store_kv(k, k, slots, layer)
    out["written"] = rss() - start
    if elastic:
        cache.release_blocks(range(n))
    out["released"] = rss() - start
    if elastic:
        cache.commit_blocks(range(n))
        cache.sleep()
    out["asleep"] = rss() - start
    print(json.dumps(out))
""")


def rss_table(gib: int, used: float) -> dict[str, Any]:
    """RSS growth (bytes) per stage of an elastic and a fixed pool, each in a fresh process."""
    result = {}
    for kind in ("elastic", "fixed"):
        done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, kind, str(gib), str(used)],
                              capture_output=True, text=True, check=True)
        result[kind] = json.loads(done.stdout)
    return result


# ---- layout -----------------------------------------------------------------------------------------------

def layout_rows(configs: list[str], tokens: int, page_size: int, repeat: int, blocks: int | None = None
                ) -> list[dict[str, Any]]:
    """Strips against block-major per model (see the module docstring); ``blocks`` per cache (default 256
    MiB of them), at least ``tokens``."""
    rows = []
    for name in configs:
        spec = KVCacheSpec.from_hf_config(name)
        num_blocks = max(tokens, blocks or (256 * MiB) // spec.bytes_per_block)
        caches = {packed: PagedKVCache(spec, num_blocks, packed=packed, elastic=_config(page_size))
                  for packed in (False, True)}
        for cache in caches.values():
            cache.commit_blocks(range(num_blocks))
        gen = torch.Generator().manual_seed(0)  # distinct blocks, a random offset in each (a decode step)
        slots = (torch.randperm(num_blocks, generator=gen)[:tokens] * spec.block_size
                 + torch.randint(0, spec.block_size, (tokens,), generator=gen))
        shape = spec.layer_shape(0)
        k = torch.randn(tokens, shape.num_kv_heads, shape.head_dim, generator=gen).to(spec.dtype)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeat):
            for packed, cache in caches.items():
                start = time.perf_counter_ns()
                for layer in range(spec.num_layers):
                    cache.store_kv(k, k, slots, layer)
                    cache.gather_slots(layer, slots)
                times[packed].append(time.perf_counter_ns() - start)
        strips, major = (statistics.median(times[p]) for p in (False, True))
        maps = {p: c.pages.map for p, c in caches.items()}
        rows.append({"model": name, "bytes_per_block": spec.bytes_per_block,
                     "strips_unit_bytes": maps[False].unit_bytes(),
                     "block_major_unit_bytes": maps[True].unit_bytes(),
                     "strips_pages_per_block": len(maps[False].pages_of(1)),
                     "block_major_pages_per_block": len(maps[True].pages_of(1)),
                     "strips_step_us": strips / 1e3, "block_major_step_us": major / 1e3,
                     "ratio": major / strips})
        for cache in caches.values():
            cache.pages.arena.close()
    return rows


def _config(page_size: int) -> ElasticConfig:
    return ElasticConfig(page_size=page_size)


def run(args: argparse.Namespace) -> dict[str, Any]:
    require_at_least(args, {"pages": 1, "page_kib": 4, "repeat": 1, "tokens": 1})
    args.page_size = args.page_kib * 1024
    per_page = cpu_page_costs(args.pages, args.page_size, args.repeat)
    cuda = cuda_page_costs(args.pages, args.page_size)
    rss = rss_table(args.pool_gib, args.used) if args.pool_gib else None
    layout = layout_rows(args.configs, args.tokens, args.page_size, args.repeat, args.layout_blocks)
    eviction = eviction_rows()
    if not args.json:
        _print(args, per_page, cuda, rss, layout)
        _print_eviction(eviction)
    return {"suite": "memory", "config": {"pages": args.pages, "page_size": args.page_size,
                                          "repeat": args.repeat, "pool_gib": args.pool_gib, "used": args.used,
                                          "torch_threads": torch.get_num_threads()},
            "per_page": per_page, "cuda": cuda, "rss": rss, "layout": layout, "eviction": eviction}


def _print(args: argparse.Namespace, per_page: list[dict[str, Any]], cuda: dict[str, Any] | None,
           rss: dict[str, Any] | None, layout: list[dict[str, Any]]) -> None:
    size = f"{args.page_size / MiB:g} MiB"
    print_table(f"CPU page arena, {args.pages} pages of {size} (median of {args.repeat})",
                ["what", "us/page", "baseline", "baseline us", "ratio"],
                [[r["what"], r["us_per_page"], r["baseline"], r["baseline_us"], r["ratio"]]
                 for r in per_page])
    if cuda is None:
        print("CUDA: no GPU or no cuda-python here (the per-call table runs where both are)")
    else:
        calls = cuda["per_call_us"]
        print_table(f"CUDA page arena on {cuda['device']}: commit {cuda['commit_us']:.1f} us/page, release "
                    f"{cuda['release_us']:.1f} us/page, cudaMalloc+free {cuda['cudamalloc_free_us']:.1f} us "
                    f"(commit ratio {cuda['commit_ratio']:.2f})",
                    ["driver call", "us/call", "kvcached A100 us"],
                    [[name, calls[name], KVCACHED_A100_US.get(name)] for name in sorted(calls)])
    if rss is not None:
        stages = ["built", "written", "released", "asleep"]
        print_table(f"RSS growth, MiB: a {args.pool_gib} GiB pool, {args.used:.0%} of its blocks written "
                    "(each in a fresh process)", ["stage", "elastic", "fixed"],
                    [[s, rss["elastic"][s] / MiB, rss["fixed"][s] / MiB] for s in stages])
    print_table(f"Layout: [2, L, N, ...] strips vs block-major, {size} pages; a step = store_kv + "
                f"gather_slots of {args.tokens} tokens in every layer",
                ["model", "block", "unit strips", "unit major", "pages/block s", "pages/block m",
                 "step us s", "step us m", "ratio"],
                [[r["model"], f"{r['bytes_per_block'] / 1024:g} KiB", f"{r['strips_unit_bytes'] / MiB:g} MiB",
                  f"{r['block_major_unit_bytes'] / MiB:g} MiB", r["strips_pages_per_block"],
                  r["block_major_pages_per_block"], r["strips_step_us"], r["block_major_step_us"], r["ratio"]]
                 for r in layout])


def _print_eviction(rows: list[dict[str, Any]]) -> None:
    first = rows[0]
    print_table(f"Eviction, kvcached's shape: 4,096 cached blocks of 16 KiB, {first['blocks_per_page']} a "
                f"page (2 MiB), every stride-th touched again; {first['evicted']:,} evicted; MiB given back",
                ["stride", "LRU", "page-aware", "ratio"],
                [[r["stride"], r["freed_lru"] / MiB, r["freed_page_aware"] / MiB,
                  "inf (LRU frees 0)" if r["ratio"] == float("inf") else r["ratio"]] for r in rows])

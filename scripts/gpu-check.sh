#!/usr/bin/env bash
# Every CUDA path kvpool has, checked on a GPU: one line per check (PASS / FAIL / SKIP name: detail), exit 1
# when any check fails. The page arena's CUDA back end comes first (the driver's VMM API through
# cuda-python), then the Triton store kernel, the host tier's swaps on CUDA streams, the planner's CUDA
# profile, the engine on CUDA (greedy tokens against transformers), and tensor parallelism over NCCL
# (two GPUs or more).
#
# Needs: a CUDA build of torch and kvpool installed (`pip install -e '.[engine,dev,cuda]'`; the `cuda` extra
# is NVIDIA's cuda-python, of your driver's CUDA major version). Where the machine has no index to install
# from, KVPOOL_WHEELS=DIR installs cuda-python from wheels in DIR first (pip --no-index --find-links DIR).
# About 2-4 minutes on one GPU.
#
#   bash scripts/gpu-check.sh            # every check
#   bash scripts/gpu-check.sh arena      # the checks whose name starts with "arena"
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ONLY=${1:-}
FAILED=0

report() {  # report STATUS NAME DETAIL
    printf '%s %s: %s\n' "$1" "$2" "$3"
    [ "$1" = FAIL ] && FAILED=1
    return 0
}

wanted() { [ -z "$ONLY" ] || [[ "$1" == "$ONLY"* ]]; }

if [ -n "${KVPOOL_WHEELS:-}" ] && ! "$PY" -c "import cuda.bindings.driver" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-index --find-links "$KVPOOL_WHEELS" cuda-python \
        || "$PY" -m pip install --quiet --no-index --find-links "$KVPOOL_WHEELS" cuda-bindings
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    report FAIL setup "torch sees no CUDA device (a CUDA build of torch and a GPU are needed)"
    exit 1
fi
report PASS setup "$("$PY" -c "import torch; print(f'torch {torch.__version__}, {torch.cuda.device_count()} x ' \
    f'{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}')")"

# The Python checks: each prints its own line; the exit code is 1 if any failed.
if ! "$PY" - "$ONLY" <<'EOF'; then FAILED=1; fi
import sys
import traceback

import torch

ONLY = sys.argv[1] if len(sys.argv) > 1 else ""
MiB, PAGE = 2**20, 2 << 20
failed = False


def check(name):
    def run(fn):
        global failed
        if ONLY and not name.startswith(ONLY):
            return fn
        try:
            detail = fn()
            print(f"PASS {name}: {detail}", flush=True)
        except Exception as exc:  # noqa: BLE001 (a failed check is a line, not a stop)
            failed = True
            where = traceback.extract_tb(exc.__traceback__)[-1]
            print(f"FAIL {name}: {type(exc).__name__}: {exc} (line {where.lineno})", flush=True)
        return fn
    return run


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@check("arena-import")
def _():
    from cuda.bindings import driver  # noqa: F401

    from kvpool.storage.arena_cuda import CUDABackend

    backend = CUDABackend(torch.device("cuda", 0))
    return f"cuda-python imports; granularity {backend.granularity // 1024} KiB"


@check("arena-commit-release")
def _():
    from kvpool.storage.arena import PageArena

    before = free_bytes()
    arena = PageArena(64 * PAGE, device="cuda")
    address = arena.tensor.data_ptr()
    assert address % PAGE == 0, f"reservation at {address:#x} not page-aligned"
    assert before - free_bytes() < 4 * PAGE, "a reservation took physical memory"
    arena.commit(range(32))
    taken = before - free_bytes()
    assert taken >= 32 * PAGE, f"32 pages committed but free memory fell by {taken / MiB:.0f} MiB"
    arena.tensor[:32 * PAGE].fill_(7)
    assert int(arena.tensor[:32 * PAGE].min()) == 7 == int(arena.tensor[:32 * PAGE].max())
    arena.release(range(16))
    back = free_bytes() - (before - taken)
    assert back >= 16 * PAGE, f"16 pages released but free memory rose by {back / MiB:.0f} MiB"
    arena.commit(range(16))
    assert int(arena.tensor[:16 * PAGE].max()) == 0, "a recommitted page does not read 0"
    assert int(arena.tensor[16 * PAGE:32 * PAGE].min()) == 7, "a page that stayed committed lost its bytes"
    assert arena.tensor.data_ptr() == address
    arena.close()
    del arena
    left = before - free_bytes()
    assert left < 4 * PAGE, f"{left / MiB:.0f} MiB still taken after close"
    return (f"32 pages took {taken / MiB:.0f} MiB, 16 released gave back {back / MiB:.0f} MiB; recommitted "
            f"pages read 0, the others kept their bytes, the address never moved")


@check("arena-limits-sleep")
def _():
    from kvpool.errors import AsleepError, MemoryLimitError
    from kvpool.storage.arena import MemoryBudget, PageArena

    budget = MemoryBudget(6 * PAGE)
    a = PageArena(8 * PAGE, device="cuda", budget=budget)
    b = PageArena(8 * PAGE, device="cuda", budget=budget)
    a.commit(range(4))
    try:
        b.commit(range(4))
        raise AssertionError("the shared budget let 8 pages through")
    except MemoryLimitError:
        pass
    before = free_bytes()
    a.tensor[:4 * PAGE].fill_(3)
    assert a.sleep() == 4 * PAGE
    slept = free_bytes() - before
    try:
        a.commit([5])
        raise AssertionError("commit while asleep")
    except AsleepError:
        pass
    a.wake()
    assert int(a.tensor[:4 * PAGE].max()) == 0
    a.close()
    b.close()
    return f"budget refused past 6 pages; sleep gave back {slept / MiB:.0f} MiB, wake reads 0"


@check("arena-kv-cache")
def _():
    from kvpool.spec import KVCacheSpec
    from kvpool.storage.paged import PagedKVCache, slot_mapping

    spec = KVCacheSpec.from_hf_config("smollm2-135m")
    gpu = PagedKVCache(spec, 512, device="cuda", elastic=True)
    cpu = PagedKVCache(spec, 512)
    assert gpu.packed and gpu.committed_bytes == 0
    blocks = [3, 100, 511]
    gpu.commit_blocks(blocks)
    gen = torch.Generator().manual_seed(0)
    slots = slot_mapping(blocks, range(40), spec.block_size)
    for layer in range(spec.num_layers):
        k = torch.randn(40, spec.num_kv_heads, spec.head_dim, generator=gen).to(spec.dtype)
        v = torch.randn(40, spec.num_kv_heads, spec.head_dim, generator=gen).to(spec.dtype)
        cpu.store_kv(k, v, slots, layer)
        gpu.store_kv(k.cuda(), v.cuda(), slots.cuda(), layer)
    for layer in range(spec.num_layers):
        for mine, theirs in zip(gpu.gather(layer, blocks, 40), cpu.gather(layer, blocks, 40), strict=True):
            assert torch.equal(mine.cpu(), theirs), f"layer {layer} differs"
    committed = gpu.committed_bytes
    gpu.release_blocks(blocks)
    assert gpu.committed_bytes == 0
    return f"block-major cache on the arena stores and gathers as the CPU one; {committed / MiB:.0f} MiB committed"


@check("arena-timings")
def _():
    from kvpool.bench.memory import KVCACHED_A100_US, cuda_page_costs

    costs = cuda_page_costs(32, PAGE)
    assert costs is not None
    calls = costs["per_call_us"]
    here = ", ".join(f"{name.removeprefix('cuMem')} {calls[name]:.1f} us (A100 {ref:g})"
                     for name, ref in KVCACHED_A100_US.items() if name in calls)
    return (f"{costs['device']}: commit {costs['commit_us']:.0f} us/page, release {costs['release_us']:.0f} "
            f"us/page, cudaMalloc+free {costs['cudamalloc_free_us']:.0f} us; {here}")


@check("host-swap")
def _():
    from kvpool.allocators.block_pool import BlockPool
    from kvpool.spec import KVCacheSpec
    from kvpool.storage.host import HostKVCache
    from kvpool.storage.paged import PagedKVCache

    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, block_size=16)
    for elastic in (False, True):
        device = PagedKVCache(spec, 32, device="cuda", elastic=elastic)
        if elastic:
            device.commit_blocks(range(32))
        device.buffer.copy_(torch.randn(device.buffer.shape).half().cuda())
        pool = BlockPool(32)
        blocks = pool.allocate(8)
        expected = [device.k_cache(layer)[blocks].clone() for layer in range(4)]
        host = HostKVCache.like(device, 16, elastic=elastic)
        host_ids = host.swap_out(device, blocks, pool=pool)
        host.synchronize()
        pool.free(blocks[::-1])
        fresh = pool.allocate(8)
        host.swap_in(device, host_ids, fresh)
        torch.cuda.synchronize()
        for layer in range(4):
            assert torch.equal(device.k_cache(layer)[fresh], expected[layer]), layer
        host.free(host_ids)
    return "swap out and back in on the swap stream (fixed and elastic, pinned staging) round-trips"


@check("planner-profile")
def _():
    from kvpool.spec.planner import profile_cuda_memory

    r = profile_cuda_memory()
    assert 0 < r.free_bytes <= r.total_bytes and 0 <= r.non_kv_bytes < r.total_bytes
    return (f"total {r.total_bytes / 2**30:.1f} GiB, free {r.free_bytes / 2**30:.1f} GiB, non-KV "
            f"{r.non_kv_bytes / 2**30:.2f} GiB")


sys.exit(1 if failed else 0)
EOF

run_cmd() {  # run_cmd NAME DETAIL COMMAND...: PASS with DETAIL when it exits 0, FAIL with its last line
    local name=$1 detail=$2
    shift 2
    wanted "$name" || return 0
    local out
    if out=$("$@" 2>&1); then
        report PASS "$name" "$detail"
    else
        report FAIL "$name" "$(printf '%s' "$out" | tail -n 1)"
    fi
}

run_cmd triton-store "the Triton store kernel writes what the torch path writes" \
    "$PY" -m pytest -q -x -p no:cacheprovider tests/test_paged_kv_cache.py -k cuda
run_cmd cuda-suite "storage, host, arena and elastic tests on a CUDA machine (pinned host memory)" \
    "$PY" -m pytest -q -x -p no:cacheprovider tests/test_host_kv_cache.py tests/test_arena.py \
    tests/test_elastic_storage.py tests/test_page_map.py tests/test_paged_kv_cache.py
run_cmd engine-cuda "kvpool generate on CUDA (pool sized from the GPU profile) matches transformers' greedy" \
    "$PY" -m kvpool generate --model tiny-llama --max-new-tokens 8 --check
run_cmd engine-cuda-host-tier "kvpool generate on CUDA with a host tier (swaps on the swap stream)" \
    "$PY" -m kvpool generate --model tiny-llama --max-new-tokens 8 --check --host-blocks 64
if wanted tp-nccl; then
    if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        run_cmd tp-nccl "tensor parallelism over NCCL, 2 ranks" \
            "$PY" -m kvpool generate --model tiny-llama --max-new-tokens 8 --tp-size 2 --check
    else
        report SKIP tp-nccl "one GPU: tensor parallelism over NCCL needs two"
    fi
fi

exit $FAILED

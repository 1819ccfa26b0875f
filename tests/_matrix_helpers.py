"""The feature matrix of the request path: model kind x tiers x policy x pin x TP x events, as cells that
one process or every tensor-parallel rank runs (spawned ranks import this module by name).

A cell builds an engine (optionally sharded), its tiers (each rank its own, in its own namespace), pins a
shared prefix, publishes KV events, and runs prompts that share a 40-token document while unrelated prompts
push it out of a small device pool (so the tiers are what serves it). Rank 0 returns what it saw; the test
compares the tokens with transformers' own generate and the events with the pool's index.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

BLOCK = 4
NEW = 6
SHARED = list(range(30, 70))  # 40 tokens: 10 full blocks shared by three prompts
PROMPTS = [
    SHARED + [1, 2, 3],
    [200 - i for i in range(51)],  # unrelated: pushes the shared blocks out of the device
    SHARED + [9, 8, 7, 6, 5],
    [150 + i % 40 for i in range(51)],
    SHARED[:33] + [4],
]
MODELS = ("tiny-llama", "tiny-mistral", "tiny-gemma3")  # full; sliding (window 16); Gemma 3's 2:1 layout
TIERS = ("none", "host", "host+disk", "host+disk+redis")
POLICIES = ("lru", "arc", "lfu")
FACTORS = {"model": MODELS, "tiers": TIERS, "policy": POLICIES, "pin": (False, True), "tp": (1, 2),
           "events": (False, True)}
#: The fleet secret that authenticates the disk and Redis tiers' values (a str: it crosses to the ranks).
TIER_SECRET = "kvpool tests: the matrix's tier secret"
#: Tokens per step: prefill in chunks of 8, so a sliding group (window 16) holds at most
#: cdiv(16 + 8 - 2, 4) + 1 = 7 blocks of a request.
STEP_TOKENS = 8
#: The pinned prefix: 2 blocks (in every group).
PINNED = SHARED[:8]
#: The device pool of each model: the largest prompt alone fits beside the pinned prefix (51 + 6 - 1
#: tokens: 14 full blocks; 7 in a sliding group; Gemma 3's two sliding groups and one full group: 7 + 7 +
#: 14, and the null block), two prompts do not.
NUM_BLOCKS = {"tiny-llama": 16, "tiny-mistral": 10, "tiny-gemma3": 36}


def pairwise_cells(factors: dict[str, tuple[Any, ...]] = FACTORS) -> list[dict[str, Any]]:
    """A covering array of strength 2 over ``factors`` (default :data:`FACTORS`): every pair of values of
    every two factors is in some cell. Greedy (each new cell covers the most pairs still uncovered, the first
    such in lexicographic order), so deterministic; the whole product (288 cells) would take too long."""
    names = list(factors)
    left = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
            for x in factors[a] for y in factors[b]}
    cells = []
    product = [dict(zip(names, values, strict=True)) for values in itertools.product(*factors.values())]
    pairs = list(itertools.combinations(names, 2))

    def covers(cell: dict[str, Any], left: set) -> int:
        return sum(((a, cell[a]), (b, cell[b])) in left for a, b in pairs)

    while left:
        best = max(product, key=lambda cell, left=left: covers(cell, left))
        cells.append(best)
        left -= {((a, best[a]), (b, best[b])) for a, b in itertools.combinations(names, 2)}
    return cells


def cell_id(cell: dict[str, Any]) -> str:
    return (f"{cell['model']}-{cell['tiers']}-{cell['policy']}-{'pin' if cell['pin'] else 'nopin'}-"
            f"tp{cell['tp']}-{'events' if cell['events'] else 'noevents'}")


def run_cells(tp: Any, cells: list[dict[str, Any]], folder: str, redis_url: str | None
              ) -> list[dict[str, Any]] | None:
    """Every cell on this rank (``tp`` None: one process); rank 0 (or the one process) returns outcomes."""
    out = [run_cell(tp, cell, Path(folder) / f"cell{i}", redis_url) for i, cell in enumerate(cells)]
    return out if tp is None or tp.rank == 0 else None


def run_cell(tp: Any, cell: dict[str, Any], folder: Path, redis_url: str | None) -> dict[str, Any] | None:
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.models import load_model
    from kvpool.engine.sharding import shard_model
    from kvpool.events import QueueEventPublisher

    torch.set_num_threads(1)
    model = load_model(cell["model"], seed=3).model
    if tp is not None:
        shard_model(model, tp.rank, tp.size, tp.all_reduce)
    lead = tp is None or tp.rank == 0
    publisher = QueueEventPublisher(100_000) if cell["events"] and lead else None
    engine = LLMEngine(model, num_blocks=NUM_BLOCKS[cell["model"]], block_size=BLOCK, keep_logits=True,
                       max_num_batched_tokens=STEP_TOKENS,
                       policy=cell["policy"], hasher=BlockHasher("sha256", shared=True),
                       kv_events=publisher, tp_size=tp.size if tp is not None else 1)
    urls = tier_urls(cell["tiers"], folder, redis_url, engine.cache.bytes_per_block)
    # a namespace per cell: cells never meet in a shared Redis, whatever ran before
    offload = engine.enable_offload(urls, namespace=engine.tier_namespace(cell_id(cell)),
                                    auth_key=TIER_SECRET) if urls else None
    if cell["pin"] and lead:  # rank 0 decides (its pin calls reach the followers' pools as logged calls)
        engine.pin_prefix(PINNED)  # pinned once the first prompt publishes it

    def drive(engine: Any) -> dict[str, Any]:
        from kvpool.engine.sampling import SamplingParams

        params = SamplingParams(max_new_tokens=NEW)
        requests = [r for p in PROMPTS for r in engine.generate([p], params)]
        requests += engine.generate(PROMPTS, params)  # all at once: preemption in a pool this small
        engine.kv_manager.check_integrity()
        return {"tokens": [r.output_token_ids for r in requests],
                "logits": [torch.stack(r.logits) for r in requests],
                "tier_hits": offload.tier_hits() if offload is not None else {},
                "pinned": sum(map(len, engine.kv_manager.pins)),
                "preemptions": engine.stats.preemptions,
                "prefix_hit_tokens": engine.stats.prefix_hit_tokens,
                "events": _events(publisher), "index": _index(engine.pool)}

    return drive_on_ranks(tp, engine, drive, offload)


def drive_on_ranks(tp: Any, engine: Any, drive: Any, offload: Any) -> dict[str, Any] | None:
    """``drive(engine)`` in one process (``tp`` None) or on every rank (rank 0's result, None on the
    others), then every rank's tiers finish their stores, pass check_integrity and close."""
    from kvpool.engine.distributed import run_engine

    try:
        done = (drive(engine), None) if tp is None else run_engine(tp, engine, drive)
        if offload is not None:
            offload.synchronize()
            offload.check_integrity()  # every rank checks its own tiers
    finally:
        if offload is not None:
            offload.close()
    return None if done is None else done[0]


def tier_urls(tiers: str, folder: Path, redis_url: str | None, block_bytes: int) -> list[str]:
    urls = []
    if "host" in tiers:
        urls.append("host://?blocks=12")
    if "disk" in tiers:
        urls.append(f"file://{folder.absolute()}/disk?blocks=10")
    if "redis" in tiers:
        assert redis_url is not None
        urls.append(redis_url)
    return urls


def _events(publisher: Any) -> list[tuple[str, str, int, list[Any]]] | None:
    """Every event the publisher took: (type, medium, group, hashes)."""
    if publisher is None:
        return None
    out = []
    for batch in publisher.drain():
        for e in batch.events:
            name = type(e).__name__
            out.append((name, getattr(e, "medium", None), getattr(e, "group_idx", None),
                        list(getattr(e, "block_hashes", []))))
    return out


def _index(pool: Any) -> set[Any]:
    """The device pool's prefix index as (group, hash) pairs."""
    from kvpool.allocators.groups import split_group_key

    raw = getattr(pool, "pool", pool)
    return {split_group_key(h) for h in (raw.block_hash(b) for b in range(raw.num_blocks)) if h is not None}

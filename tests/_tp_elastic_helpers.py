"""What tests/test_engine_tp_elastic.py runs on every rank (spawned ranks import this module by name): an
elastic engine on a tiny Llama's shard, put to sleep and woken, or with a host tier, driven by rank 0 through
:func:`kvpool.engine.distributed.run_engine`. Rank 0 returns what it saw; the other ranks None.
"""

from __future__ import annotations

from typing import Any

import torch
from _tp_helpers import BLOCK, NEW, PROMPTS, build_model

SECRET = "kvpool tests: the tp elastic tier secret"  # a disk tier's blocks are signed with it
PAGE = 4096  # 4 KiB pages: a tiny Llama's block on a rank (tp 2: 1 of its 2 KV heads) holds 1 KiB of KV


def _engine(tp: Any, reserve_pages: int = 0, **options: Any) -> Any:
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sharding import shard_model
    from kvpool.storage.arena import ElasticConfig

    torch.set_num_threads(1)
    model = build_model("tiny-llama")
    if tp is not None:
        shard_model(model, tp.rank, tp.size, tp.all_reduce)
    return LLMEngine(model, block_size=BLOCK, tp_size=tp.size if tp is not None else 1,
                     elastic=ElasticConfig(page_size=PAGE, reserve_pages=reserve_pages), **options)


def _run(tp: Any, engine: Any, lead: Any) -> Any:
    from kvpool.engine.distributed import run_engine

    done = run_engine(tp, engine, lead)
    return None if done is None else done[0]


def sleep_and_wake(tp: Any) -> dict[str, Any] | None:
    """Two prompts run, a third is mid-prefill (6-token chunks) when the engine sleeps; every rank's
    committed bytes are read before, during and after the sleep (each arena keeps 2 empty pages in reserve,
    which only a sleep gives back); after the wake the third finishes and the first two run again."""
    from kvpool.engine.distributed import committed_by_rank
    from kvpool.engine.sampling import SamplingParams

    engine = _engine(tp, reserve_pages=2, num_blocks=64, max_num_batched_tokens=6)
    params = SamplingParams(max_new_tokens=NEW)

    def lead(engine: Any) -> dict[str, Any]:
        first = engine.generate(PROMPTS[:2], params)
        in_flight = engine.add_request(PROMPTS[0], params)
        engine.step()
        engine.step()  # 12 of its 40 prompt tokens computed, KV in its blocks
        awake = committed_by_rank(engine)
        given = engine.sleep()
        asleep, cached_asleep = committed_by_rank(engine), engine.pool.num_evictable_blocks
        engine.wake()
        woken = committed_by_rank(engine)
        while engine.has_unfinished():
            engine.step()
        after = engine.generate(PROMPTS[:2], params)
        return {"first": [r.output_token_ids for r in first],
                "in_flight": engine.requests[in_flight].output_token_ids,
                "after": [r.output_token_ids for r in after], "awake": awake, "asleep": asleep,
                "woken": woken, "given": given, "preemptions": engine.stats.preemptions,
                "cached_asleep": cached_asleep}

    return _run(tp, engine, lead)


def tier_hit(tp: Any, url: str) -> dict[str, Any] | None:
    """A prompt runs (its blocks written through to each rank's tier, ``url``, as they are published),
    ``trim()`` evicts its cached blocks from the device and gives their pages back, then the prompt runs
    again: its prefix comes from the tier, restored on every rank into blocks committed as rank 0
    committed."""
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.engine.sampling import SamplingParams

    engine = _engine(tp, num_blocks=32, hasher=BlockHasher("sha256", shared=True))
    offload = engine.enable_offload([url], write_through=True, auth_key=SECRET)
    params = SamplingParams(max_new_tokens=NEW)

    def lead(engine: Any) -> dict[str, Any]:
        first = engine.generate([PROMPTS[0]], params)[0]
        offload.synchronize()
        trimmed = engine.trim()
        evicted = engine.pool.num_evictable_blocks
        again = engine.generate([PROMPTS[0]], params)[0]
        return {"first": first.output_token_ids, "again": again.output_token_ids, "trimmed": trimmed,
                "cached_after_trim": evicted, "hits": engine.kv_manager.hits_by_place()}

    try:
        return _run(tp, engine, lead)
    finally:
        offload.close()

"""What tests/test_tp_compaction.py runs on every rank (spawned ranks import this module by name): an
elastic engine on a tiny Llama's shard whose rank 0 compacts after every step (forced: ``slack_pages=-1``),
driven through :func:`kvpool.engine.distributed.run_engine`. Rank 0 returns what it saw; the others None.
"""

from __future__ import annotations

from typing import Any

import torch
from _tp_helpers import BLOCK, build_model

PAGE = 8192  # a tiny Llama's block on a rank (tp 2: 1 of its 2 KV heads) holds 1 KiB: 8 blocks a page
PROMPTS = [list(range(7, 47)), [99, 98, 97, 96, 95, 94, 93], list(range(7, 30)) + [200, 201],
           [150 + i % 40 for i in range(51)], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW = [12, 3, 9, 5, 14]


def compacting(tp: Any, shipped: bool) -> dict[str, Any] | None:
    """Run :data:`PROMPTS` (prefix caching off: a finished request's blocks all go, leaving holes) with a
    compaction after every step; ``shipped=False`` is the control: rank 0's copy is left out of the log
    (every rank still moves its pool and pages, only rank 0 copies its KV shard)."""
    from kvpool.engine.distributed import run_engine
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.engine.sharding import shard_model
    from kvpool.storage.arena import ElasticConfig

    torch.set_num_threads(1)
    model = build_model("tiny-llama")
    shard_model(model, tp.rank, tp.size, tp.all_reduce)
    engine = LLMEngine(model, block_size=BLOCK, tp_size=tp.size, num_blocks=64, keep_logits=True,
                       max_num_batched_tokens=24, enable_prefix_caching=False,
                       elastic=ElasticConfig(page_size=PAGE))
    engine.compactor.slack_pages = -1  # compact whenever a page can be emptied

    def lead(engine: Any) -> dict[str, Any]:
        copy = engine.compactor.copy if shipped else engine.cache.copy_blocks  # the control: not recorded
        moved_running = []

        def copy_and_count(pairs: list[tuple[int, int]]) -> None:  # before the tables are renamed
            tables = {b for req in engine.running for t in engine.kv_manager.block_tables(req) for b in t}
            moved_running.extend(src for src, _ in pairs if src in tables)
            copy(pairs)

        engine.compactor.copy = copy_and_count
        params = [SamplingParams(max_new_tokens=n) for n in NEW]
        ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, params, strict=True)]
        while engine.has_unfinished():
            engine.step()  # (its compaction runs at its end)
        engine.pool.check_integrity()  # every rank's pool, pages and live blocks compared
        reqs = [engine.requests[i] for i in ids]
        return {"tokens": [r.output_token_ids for r in reqs], "logits": [torch.stack(r.logits) for r in reqs],
                "moved": engine.compactor.stats.moved, "moved_running": len(moved_running)}

    done = run_engine(tp, engine, lead)
    return None if done is None else done[0]

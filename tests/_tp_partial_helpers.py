"""What the tensor-parallel partial-hit test runs on every rank (spawned ranks import this module by name):
a prompt that publishes its blocks, then one that shares them up to a point inside a block, on ``tiny-llama``
sharded over the ranks, with and without the followers' copies."""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK, UNIT, NEW = 8, 2, 8
DOC = [(7 * i + 3) % 251 for i in range(45)]  # 45 tokens (byte ids)
FIRST = DOC + [10, 11, 12]  # 48 tokens: 6 full blocks published
SECOND = DOC[:29] + list(range(150, 170))  # shares 29 tokens: 3 full blocks (24) + 2 units (4) = 28 hit
MODEL = "tiny-llama"


def run_partial(tp: Any) -> dict[str, Any] | None:
    """Both runs on this rank (``tp`` None: one process): ``shipped`` (every rank copies the hit into its
    own shard) and ``rank_0_only`` (the control: rank 0 copies, its copy is not logged, the followers keep
    whatever their fresh block held). Rank 0 (or the one process) returns ``{run: outcome}``."""
    from kvpool.engine.distributed import run_engine
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.models import load_model
    from kvpool.engine.sharding import shard_model

    torch.set_num_threads(1)
    model = load_model(MODEL, seed=1).model
    if tp is not None:
        shard_model(model, tp.rank, tp.size, tp.all_reduce)
    out = {}
    for run, unlogged in (("shipped", False), ("rank_0_only", True)):
        engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, keep_logits=True, match_unit=UNIT,
                           tp_size=tp.size if tp else 1)
        lead = functools.partial(_lead, unlogged=unlogged)
        if tp is None:
            out[run] = lead(engine)
            continue
        done = run_engine(tp, engine, lead)
        if done is not None:
            out[run] = done[0]
    return out if tp is None or tp.rank == 0 else None


def _lead(engine: Any, unlogged: bool) -> dict[str, Any]:
    from kvpool.engine.sampling import SamplingParams
    from kvpool.storage.block_copy import copy_token_prefix

    if unlogged:  # rank 0's own copy, not the recording one the leader put in front of it
        engine.kv_manager.partial.copy = functools.partial(copy_token_prefix, engine.cache)
    engine.generate([FIRST], SamplingParams(max_new_tokens=2))
    (req,) = engine.generate([SECOND], SamplingParams(max_new_tokens=NEW))
    stats = engine.kv_manager.partial.first_stats
    return {"tokens": req.output_token_ids, "logits": torch.stack(req.logits),
            "cached": req.num_cached_tokens, "partial": (stats.hits, stats.tokens, stats.copied_blocks),
            "all_free": engine.pool.num_free_blocks == engine.pool.num_blocks}

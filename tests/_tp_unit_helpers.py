"""What the tensor-parallel test of a hybrid's unit hits runs on every rank (spawned ranks import this module
by name): a prompt saving its state at every unit boundary, then one sharing it up to a point inside a
block, on ``tiny-qwen3-next`` sharded over the ranks (its attention heads and its recurrent state heads)."""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK, UNIT, NEW = 8, 2, 6
DOC = [(7 * i + 3) % 251 for i in range(45)]
FIRST = DOC + [10, 11, 12]  # 48 tokens: 6 full blocks; a block checkpoint at 48 only
SECOND = DOC[:29] + list(range(150, 170))  # shares 29 tokens: 3 blocks + 2 units = 28 from a unit checkpoint
MODEL = "tiny-qwen3-next"


def run_units(tp: Any) -> dict[str, Any] | None:
    """FIRST then SECOND on this rank's shard (``tp`` None: one process), twice: ``shipped`` (every rank
    copies the unit hit's KV into its own shard) and ``rank_0_only`` (the control: rank 0's copy is not
    logged, so the followers' KV heads miss the copied slots). Rank 0 returns ``{run: outcome}``."""
    from kvpool.engine.distributed import run_engine
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.models import load_model
    from kvpool.engine.sharding import shard_model
    from kvpool.requests.state_checkpoints import SavePolicy

    torch.set_num_threads(1)
    model = load_model(MODEL, seed=1).model
    if tp is not None:
        shard_model(model, tp.rank, tp.size, tp.all_reduce)
    out = {}
    for run, unlogged in (("shipped", False), ("rank_0_only", True)):
        engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, keep_logits=True, state_save="tail",
                           state_checkpoints=64, match_unit=UNIT, tp_size=tp.size if tp else 1)
        engine.kv_manager.partial.saves.policy = SavePolicy.parse("dense")
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
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engine.generate([FIRST], params)
    (req,) = engine.generate([SECOND], params)
    return {"tokens": req.output_token_ids, "logits": torch.stack(req.logits),
            "cached": req.num_cached_tokens, "unit_restores": engine.kv_manager.partial.saves.restored}

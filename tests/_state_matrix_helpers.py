"""The feature matrix of a recurrent hybrid's state: save policy x eviction policy x pins x events x tiers x
TP, as cells that one process or every tensor-parallel rank runs (spawned ranks import this module by name).

A cell builds a tiny hybrid's engine (optionally sharded) with two checkpoint slots, its tiers (each rank its
own, in its own namespace), pins a shared prefix, publishes KV events, and runs one prompt at a time: X (a
40-token document + 3), U (51 unrelated tokens: its KV and its state saves push X's out of the device, into
the tiers when there are some), Y (the document + 5: its KV and its 40-token state come back from the tiers)
and Y again (a hit on the device in every cell: Y's own tail checkpoint at 44 tokens), then all four at once
(preemption in a pool this small). Rank 0 returns what it saw; the test compares the tokens with
transformers' own generate and the events with the pool's index and the checkpoints held.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from _matrix_helpers import TIER_SECRET, _events, _index, drive_on_ranks, tier_urls

BLOCK = 4
NEW = 6
SHARED = list(range(30, 70))  # 40 tokens: 10 full blocks
X, U, Y = SHARED + [1, 2, 3], [200 - i for i in range(51)], SHARED + [9, 8, 7, 6, 5]
PROMPTS = [X, U, Y, Y]
#: One full-attention KV cache group (group 0) each, the state's group 1: Qwen3-Next (gated delta rule: conv
#: and SSM states) in every cell, LFM2 (short convolutions: conv states only) at TP 1.
MODELS = ("tiny-qwen3-next", "tiny-lfm2")
FACTORS = {"save": ("tail", "dense"), "policy": ("lru", "arc"), "pin": (False, True),
           "events": (False, True), "tiers": ("none", "host", "host+disk"), "tp": (1, 2)}
#: The pinned prefix: 2 blocks (and, saved densely, the checkpoint at 8 tokens).
PINNED = SHARED[:8]
#: U alone (51 + 6 - 1 = 56 tokens: 14 blocks) fits beside the pinned prefix (2 blocks); X beside it does not.
NUM_BLOCKS = 16
#: Two checkpoints: U's two tail saves (48 and 56 tokens) evict X's (40 and 48) under either policy.
CHECKPOINTS = 2


def cells(model: str = MODELS[0], tp: int | None = None) -> list[dict[str, Any]]:
    """Every combination of :data:`FACTORS` (96) on ``model``, or those of one ``tp``."""
    names = list(FACTORS)
    out = [{"model": model, **dict(zip(names, values, strict=True))}
           for values in itertools.product(*FACTORS.values())]
    return [c for c in out if tp is None or c["tp"] == tp]


def cell_id(cell: dict[str, Any]) -> str:
    return (f"{cell['model']}-{cell['save']}-{cell['policy']}-{'pin' if cell['pin'] else 'nopin'}-"
            f"{'events' if cell['events'] else 'noevents'}-{cell['tiers']}-tp{cell['tp']}")


def run_cells(tp: Any, cells: list[dict[str, Any]], folder: str) -> list[dict[str, Any]] | None:
    """Every cell on this rank (``tp`` None: one process); rank 0 (or the one process) returns outcomes.
    Each model is built and sharded once; each cell has its own engine."""
    from kvpool.engine.models import load_model
    from kvpool.engine.sharding import shard_model

    torch.set_num_threads(1)
    models: dict[str, Any] = {}
    for name in dict.fromkeys(c["model"] for c in cells):
        models[name] = load_model(name, seed=3).model
        if tp is not None:
            shard_model(models[name], tp.rank, tp.size, tp.all_reduce)
    out = [run_cell(tp, models[c["model"]], c, Path(folder) / f"cell{i}") for i, c in enumerate(cells)]
    return out if tp is None or tp.rank == 0 else None


def run_cell(tp: Any, model: Any, cell: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.engine.engine import LLMEngine
    from kvpool.events import QueueEventPublisher

    lead = tp is None or tp.rank == 0
    publisher = QueueEventPublisher(100_000) if cell["events"] and lead else None
    engine = LLMEngine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, keep_logits=True,
                       max_num_batched_tokens=16, policy=cell["policy"], state_save=cell["save"],
                       state_checkpoints=CHECKPOINTS, hasher=BlockHasher("sha256", shared=True),
                       kv_events=publisher, tp_size=tp.size if tp is not None else 1)
    urls = tier_urls(cell["tiers"], folder, None, engine.cache.bytes_per_block)
    offload = engine.enable_offload(urls, namespace=engine.tier_namespace(cell_id(cell)),
                                    auth_key=TIER_SECRET) if urls else None
    if cell["pin"] and lead:  # rank 0 decides (its pin calls reach the followers' pools as logged calls)
        engine.pin_prefix(PINNED)

    def drive(engine: Any) -> dict[str, Any]:
        from kvpool.engine.sampling import SamplingParams

        params = SamplingParams(max_new_tokens=NEW)
        requests = [r for p in PROMPTS for r in engine.generate([p], params)]
        requests += engine.generate(PROMPTS, params)  # all at once
        engine.kv_manager.check_integrity()
        engine.states.check_integrity()
        ckpt = engine.states.checkpoints
        events = _events(publisher)
        return {"tokens": [r.output_token_ids for r in requests],
                "logits": [torch.stack(r.logits) for r in requests],
                "cached": [r.num_cached_tokens for r in requests],
                "kv_tier_hits": offload.tier_hits() if offload is not None else {},
                "states": engine.states.describe(), "state_group": ckpt.group,
                "pinned": sum(map(len, engine.kv_manager.pins)),
                "events": events, "index": _index(engine.pool),
                "checkpoints_held": len(ckpt),
                "in_checkpoints": {h: h in ckpt for _, _, group, hashes in events or [] if group == ckpt.group
                                   for h in hashes}}

    return drive_on_ranks(tp, engine, drive, offload)

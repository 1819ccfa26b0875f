"""What the tensor-parallel tests run on every rank (spawned ranks import this module by name), and the same
scenarios in one process for the expected values.

Each scenario is one engine configuration and the prompts it runs; a rank builds the model, shards it, and
runs every scenario through :func:`kvpool.engine.distributed.run_engine`; rank 0 returns what it saw.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.storage.arena import ElasticConfig

BLOCK = 4
NEW = 12
BASE = list(range(7, 47))  # a 40-token prompt (byte ids)
PROMPTS = [BASE, BASE[:30] + [200, 201, 202, 203, 204], [99, 98, 97, 96, 95, 94, 93], BASE[:17]]
# (engine options, one generate call per prompt list)
SCENARIOS: dict[str, tuple[dict[str, Any], list[list[list[int]]]]] = {
    # all four join in step 1, then PROMPTS[1] and PROMPTS[0] again: they hit the published blocks
    "batch then prefix hits": ({}, [PROMPTS, [PROMPTS[1], PROMPTS[0]]]),
    # 6 tokens per step (7 chunks for the 40-token prompt), 14 blocks: preemption by recompute
    "chunked prefill and preemption": ({"max_num_batched_tokens": 6, "num_blocks": 14}, [PROMPTS]),
    # each rank's shard on its own arena of 4 KiB pages, its commits and releases shipped with the pool calls
    # (every follower checks each one's result against rank 0's); prefix hits and preemptions as above
    "elastic": ({"elastic": ElasticConfig(page_size=4096), "max_num_batched_tokens": 6, "num_blocks": 14},
                [PROMPTS, [PROMPTS[1], PROMPTS[0]]]),
}
MQA = "tiny-llama-mqa"  # built here: 6 query heads, 1 KV head (replicated on every rank)


def build_model(name: str) -> Any:
    """``name``'s random model (seed 1); :data:`MQA` is a Llama with 6 query heads and 1 KV head."""
    from kvpool.engine.models import TINY_INIT_STD, load_model

    if name != MQA:
        return load_model(name, seed=1).model
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=96, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=1, intermediate_size=192,
                                      max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, TINY_INIT_STD)
    return model.eval()


def run_scenarios(tp: Any, names: list[str], only: list[str] | None = None) -> dict[str, Any] | None:
    """Every scenario (or those named in ``only``) on every model of ``names``, on this rank (``tp`` None: one
    process). Rank 0 (or the one process) returns ``{model: {scenario: outcome}}``; the other ranks None."""
    from kvpool.engine.distributed import run_engine
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sharding import shard_model

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in names:
        model = build_model(name)
        if tp is not None:
            shard_model(model, tp.rank, tp.size, tp.all_reduce)
        for scenario, (options, calls) in SCENARIOS.items():
            if only is not None and scenario not in only:
                continue
            options = {"num_blocks": 64, **options}
            engine = LLMEngine(model, block_size=BLOCK, keep_logits=True, tp_size=tp.size if tp else 1,
                               **options)
            if tp is None:
                out.setdefault(name, {})[scenario] = (_lead(engine, calls), None)
                continue
            done = run_engine(tp, engine, lambda e, calls=calls: _lead(e, calls))
            if done is not None:
                out.setdefault(name, {})[scenario] = (done[0], done[1].to_dict())
    return out if tp is None or tp.rank == 0 else None


def _lead(engine: Any, calls: list[list[list[int]]]) -> dict[str, Any]:
    from kvpool.engine.sampling import SamplingParams

    requests = [r for prompts in calls for r in engine.generate(prompts, SamplingParams(max_new_tokens=NEW))]
    s = engine.stats
    return {"tokens": [r.output_token_ids for r in requests],
            "logits": [torch.stack(r.logits) for r in requests],
            "stats": (s.prefix_hit_tokens, s.preemptions, s.peak_blocks_used, s.generated_tokens, s.steps),
            "all_free": engine.pool.num_free_blocks == engine.pool.num_blocks}


def diverge_then_check(tp: Any) -> None:
    """Rank 1's pool takes one block rank 0's does not; then the cross-rank check_integrity (collective)."""
    from kvpool.allocators.block_pool import BlockPool
    from kvpool.engine.distributed import check_across_ranks

    pool = BlockPool(8)
    pool.allocate(2)
    if tp.rank == 1:
        pool.allocate(1)
    check_across_ranks(tp, pool)


def fail_on_rank_1(tp: Any) -> int:
    """Rank 1 raises; rank 0 waits in a collective that rank 1 never joins."""
    if tp.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    tensor = torch.ones(4)
    tp.all_reduce(tensor)
    return 0


def all_reduce_forever(tp: Any) -> None:
    """Sum a tensor over the ranks until a collective fails (a rank was killed)."""
    tensor = torch.ones(4)
    while True:
        tp.all_reduce(tensor)
        tensor.fill_(1.0)

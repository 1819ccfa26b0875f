"""Shared by the tests of hits finer than a block, in one process and under tensor parallelism, on a
plain model (``tiny-llama``) and a recurrent hybrid (``tiny-qwen3-next``): the two prompts, the control that
zeroes the copied KV, and what the tensor-parallel tests run on every rank (spawned ranks import this module
by name).

Block size 8, match unit 2: FIRST (48 tokens, 6 full blocks) is cached, then SECOND shares its first 29
tokens: 3 full blocks (24) + 2 whole units (4) = 28 tokens hit, the last 4 of them copied into a fresh block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from kvpool.engine.sampling import SamplingParams

BLOCK, UNIT = 8, 2
DOC = [(7 * i + 3) % 251 for i in range(45)]  # 45 tokens (byte ids)
FIRST = DOC + [10, 11, 12]  # 48 tokens: 6 full blocks
SECOND = DOC[:29] + list(range(150, 170))  # shares 29 tokens: 3 full blocks (24) + 2 units (4) = 28 hit
#: The plain model's TP run: its model and the tokens it generates for SECOND.
PARTIAL_MODEL, PARTIAL_NEW = "tiny-llama", 8
#: The hybrid's TP run (state saved at every unit boundary): its model and the tokens it generates.
UNIT_MODEL, UNIT_NEW = "tiny-qwen3-next", 6


def zeroing_copy(cache: Any) -> Callable[[list[tuple[int, int]], int], None]:
    """The control's copy for ``kv_manager.partial.copy``: copies the first ``n`` token slots of each
    ``(src, dst)`` block pair in ``cache`` (every layer's K and V), then zeroes them in ``dst``, so a request
    reads other KV than the prefix's."""
    from kvpool.storage.block_copy import copy_token_prefix

    def copy_then_zero(pairs: list[tuple[int, int]], n: int) -> None:
        copy_token_prefix(cache, pairs, n)
        for layer in range(cache.num_layers):
            for view in (cache.k_cache(layer), cache.v_cache(layer)):
                for _, dst in pairs:
                    view[dst, :n] = 0

    return copy_then_zero


def matches_transformers(outcome: dict[str, Any], model_name: str, new: int, atol: float
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Assert a TP run's ``shipped`` outcome generated transformers' own greedy tokens and logits (within
    ``atol``) for SECOND, and that the ``rank_0_only`` control's first logits left them (by more than 1e-2:
    rank 1's heads missed the copied slots); returns (shipped, control) for the caller's own checks."""
    from kvpool.engine.models import load_model, reference_greedy

    tokens, logits = reference_greedy(load_model(model_name, seed=1).model, SECOND, new)
    shipped, control = outcome["shipped"], outcome["rank_0_only"]
    assert shipped["tokens"] == tokens
    torch.testing.assert_close(shipped["logits"], logits, atol=atol, rtol=0)
    assert (control["logits"][0] - logits[0]).abs().max() > 1e-2
    return shipped, control


def run_partial(tp: Any) -> dict[str, Any] | None:
    """The plain model's TP run (``tp`` None: one process): both runs of :func:`_run_both`, FIRST with 2 new
    tokens, SECOND with :data:`PARTIAL_NEW`; each outcome holds the first admissions' partial-hit stats and
    whether every block is free at the end."""
    return _run_both(tp, PARTIAL_MODEL, {}, None, SamplingParams(max_new_tokens=2),
                     SamplingParams(max_new_tokens=PARTIAL_NEW),
                     _partial_outcome)


def run_units(tp: Any) -> dict[str, Any] | None:
    """The hybrid's TP run (``tp`` None: one process): both runs of :func:`_run_both` with the state saved
    at every unit boundary (``dense``), FIRST and SECOND each with :data:`UNIT_NEW` tokens past EOS; each
    outcome holds the unit checkpoints restored."""
    params = SamplingParams(max_new_tokens=UNIT_NEW, ignore_eos=True)
    return _run_both(tp, UNIT_MODEL, {"state_save": "tail", "state_checkpoints": 64}, _dense_unit_saves,
                     params, params, _unit_outcome)


def _run_both(tp: Any, model_name: str, engine_kwargs: dict[str, Any],
              configure: Callable[[Any], None] | None, first: Any, second: Any,
              outcome: Callable[[Any, Any], dict[str, Any]]) -> dict[str, Any] | None:
    """FIRST then SECOND on this rank's shard of ``model_name``, twice: ``shipped`` (every rank copies the
    hit's KV into its own shard) and ``rank_0_only`` (the control: rank 0's copy is not logged, so the
    followers' KV heads miss the copied slots). Rank 0 (or the one process) returns ``{run: outcome}``."""
    from kvpool.engine.distributed import run_engine
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.models import load_model
    from kvpool.engine.sharding import shard_model

    torch.set_num_threads(1)
    model = load_model(model_name, seed=1).model
    if tp is not None:
        shard_model(model, tp.rank, tp.size, tp.all_reduce)
    out = {}
    for run, unlogged in (("shipped", False), ("rank_0_only", True)):
        engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, keep_logits=True, match_unit=UNIT,
                           tp_size=tp.size if tp else 1, **engine_kwargs)
        if configure is not None:
            configure(engine)
        lead = functools.partial(_lead, unlogged=unlogged, first=first, second=second, outcome=outcome)
        if tp is None:
            out[run] = lead(engine)
            continue
        done = run_engine(tp, engine, lead)
        if done is not None:
            out[run] = done[0]
    return out if tp is None or tp.rank == 0 else None


def _lead(engine: Any, unlogged: bool, first: Any, second: Any, outcome: Callable[[Any, Any], dict[str, Any]]
          ) -> dict[str, Any]:
    from kvpool.storage.block_copy import copy_token_prefix

    if unlogged:  # rank 0's own copy, not the recording one the leader put in front of it
        engine.kv_manager.partial.copy = functools.partial(copy_token_prefix, engine.cache)
    engine.generate([FIRST], first)
    (req,) = engine.generate([SECOND], second)
    return {"tokens": req.output_token_ids, "logits": torch.stack(req.logits),
            "cached": req.num_cached_tokens, **outcome(engine, req)}


def _dense_unit_saves(engine: Any) -> None:
    from kvpool.requests.state_checkpoints import SavePolicy

    engine.kv_manager.partial.saves.policy = SavePolicy.parse("dense")


def _partial_outcome(engine: Any, req: Any) -> dict[str, Any]:
    stats = engine.kv_manager.partial.first_stats
    return {"partial": (stats.hits, stats.tokens, stats.copied_blocks),
            "all_free": engine.pool.num_free_blocks == engine.pool.num_blocks}


def _unit_outcome(engine: Any, req: Any) -> dict[str, Any]:
    return {"unit_restores": engine.kv_manager.partial.saves.restored}

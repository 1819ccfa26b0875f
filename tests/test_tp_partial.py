"""Partial hits (a prefix hit that ends inside a block) under tensor parallelism: rank 0's copy is shipped in
the pool log and every rank copies its own KV shard.

Expected tokens and logits are transformers' own greedy ``generate`` (the whole model in one process, no
kvpool code); the control leaves the copy on rank 0 only, so rank 1's KV heads read a block that never got
the matched tokens, and the logits leave transformers'.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import _partial_helpers as helpers  # noqa: E402

from kvpool.engine.distributed import RecordingPool, replay  # noqa: E402
from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.launch import launch  # noqa: E402
from kvpool.engine.models import load_model  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.engine.tp_partial import COPY, apply_copy  # noqa: E402
from kvpool.errors import IntegrityError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.timeout(400)
def test_tp2_partial_hit_matches_transformers_and_a_rank_0_only_copy_diverges() -> None:
    outcome = launch(helpers.run_partial, 2)
    runs = helpers.matches_transformers(outcome, helpers.PARTIAL_MODEL, helpers.PARTIAL_NEW, atol=1e-4)
    # 3 full blocks of 8 + 2 units of 2 (29 shared tokens: 5 in block 3, 2 whole units); one copy, one group
    for run in runs:
        assert run["cached"] == 28 and run["partial"] == (1, 4, 1) and run["all_free"]


def test_the_copy_is_logged_between_the_hold_and_the_release_and_a_follower_applies_it() -> None:
    """In one process: rank 0's engine behind a RecordingPool with its copies recorded (as the leader
    wires them), and a second cache of the same shape that applies the log's copies: after the partial hit,
    the second cache's destination block holds the source block's first 4 token slots, as rank 0's does."""
    from kvpool.engine.tp_partial import record_copies

    model = load_model(helpers.PARTIAL_MODEL, seed=1).model
    engine = LLMEngine(model, num_blocks=64, block_size=helpers.BLOCK, match_unit=helpers.UNIT)
    recorder = engine.kv_manager.wrap_pool(lambda pool: RecordingPool(pool, on_check=lambda: None))
    engine.kv_manager.partial.copy = record_copies(engine.kv_manager.partial.copy, recorder)
    engine.generate([helpers.FIRST], SamplingParams(max_new_tokens=2))
    recorder.drain()
    engine.add_request(helpers.SECOND, SamplingParams(max_new_tokens=1))
    engine.step()  # admission: hold the source, copy, release
    log = recorder.drain()
    names = [name for name, *_ in log]
    copy_at = names.index(COPY)
    assert names.count(COPY) == 1 and "touch" in names[:copy_at] and "free" in names[copy_at:]
    (pairs, tokens) = log[copy_at][1]
    assert tokens == 4 and len(pairs) == 1
    (src, dst), cache = pairs[0], engine.cache
    mirror = LLMEngine(model, num_blocks=64, block_size=helpers.BLOCK).cache
    for layer in range(cache.num_layers):
        mirror.k_cache(layer)[src] = cache.k_cache(layer)[src]
        mirror.v_cache(layer)[src] = cache.v_cache(layer)[src]
        mirror.k_cache(layer)[dst] = 0  # (a fresh cache is uninitialized memory)
    apply_copy(mirror, log[copy_at][1], rank=1)
    for layer in range(cache.num_layers):
        assert torch.equal(mirror.k_cache(layer)[dst, :4], cache.k_cache(layer)[src, :4])
        assert torch.equal(mirror.v_cache(layer)[dst, :4], cache.v_cache(layer)[src, :4])
        assert not mirror.k_cache(layer)[dst, 4:].any()  # the rest of the fresh block is not copied


def test_a_copy_a_follower_cannot_make_is_an_integrity_error() -> None:
    from kvpool.allocators.block_pool import BlockPool

    model = load_model(helpers.PARTIAL_MODEL, seed=1).model
    cache = LLMEngine(model, num_blocks=8, block_size=helpers.BLOCK).cache
    with pytest.raises(IntegrityError, match="rank 1: rank 0's partial-hit copy failed here"):
        replay(BlockPool(8), [(COPY, ([(0, 9)], 4), {}, None)], rank=1, cache=cache)  # block 9 of 8
    with pytest.raises(IntegrityError, match="this rank has no KV cache"):
        replay(BlockPool(8), [(COPY, ([(0, 1)], 4), {}, None)], rank=1)

"""Compaction of an elastic KV cache under tensor parallelism (kvpool.engine.tp_compaction): rank 0's moves
are shipped in the pool log and every rank copies its own KV shard.

Expected tokens and logits are transformers' own greedy ``generate`` (the whole model in one process, no
kvpool code); the control leaves rank 0's copy out of the log, so rank 1's moved blocks hold no KV and
the logits leave transformers'. Every run ends with the cross-rank check (pools, live blocks and committed
pages of every rank compared)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import _tp_compaction_helpers as helpers  # noqa: E402
import _tp_helpers  # noqa: E402

from kvpool.allocators.block_pool import BlockPool  # noqa: E402
from kvpool.engine.distributed import replay  # noqa: E402
from kvpool.engine.launch import launch  # noqa: E402
from kvpool.engine.models import reference_greedy  # noqa: E402
from kvpool.engine.tp_compaction import MOVE  # noqa: E402
from kvpool.errors import IntegrityError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.timeout(400)
def test_tp2_compaction_matches_transformers_and_a_rank_0_only_copy_diverges() -> None:
    model = _tp_helpers.build_model("tiny-llama")
    refs = [reference_greedy(model, p, n) for p, n in zip(helpers.PROMPTS, helpers.NEW, strict=True)]
    shipped = launch(helpers.compacting, 2, True)
    assert shipped["moved_running"] > 0  # blocks a running request's table named moved
    assert shipped["tokens"] == [tokens for tokens, _ in refs]
    for got, (_, logits) in zip(shipped["logits"], refs, strict=True):
        torch.testing.assert_close(got, logits, atol=1e-4, rtol=0)
    control = launch(helpers.compacting, 2, False)
    assert control["moved"] == shipped["moved"]  # the same moves, rank 1 without the copy
    assert any(not torch.allclose(got, logits, atol=1e-4, rtol=0)
               for got, (_, logits) in zip(control["logits"], refs, strict=True))


def test_a_move_a_follower_cannot_make_is_an_integrity_error() -> None:
    with pytest.raises(IntegrityError, match="this rank has no KV cache"):
        replay(BlockPool(8), [(MOVE, ([(1, 2)],), {}, None)], rank=1)
    with pytest.raises(IntegrityError, match="rank 1: rank 0's move_block raised here"):
        replay(BlockPool(8), [("move_block", (1, 2), {}, None)], rank=1)  # block 1 holds nothing here


def _leader_and_follower(model):
    """Rank 0's engine with its pool, pages and compaction copies recorded as a leader wires them, and a
    follower's engine of the same shape (same pool, same elastic cache) that only replays."""
    from kvpool.engine.distributed import RecordingPool
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.tp_compaction import record_moves
    from kvpool.engine.tp_memory import RecordingMemory
    from kvpool.storage.arena import ElasticConfig

    def build():
        return LLMEngine(model, block_size=_tp_helpers.BLOCK, num_blocks=64, max_num_batched_tokens=24,
                         enable_prefix_caching=False, elastic=ElasticConfig(page_size=2 * helpers.PAGE))

    lead, follower = build(), build()
    recorder = lead.kv_manager.wrap_pool(lambda pool: RecordingPool(pool, on_check=lambda: None))
    lead.kv_manager.memory.store = RecordingMemory(lead.kv_manager.memory.store, recorder)
    lead.compactor.copy = record_moves(lead.compactor.copy, recorder)
    lead.compactor.slack_pages = -1
    return lead, recorder, follower


@pytest.mark.parametrize("drop", [None, "move_block"])
def test_a_follower_replaying_the_log_holds_rank_0s_pool_and_kv_and_without_the_moves_it_diverges(drop
                                                                                                   ) -> None:
    """In one process (a whole model, 16 KiB pages of 8 blocks): after each step the follower replays rank
    0's log; with every record its pool digest and its live blocks and committed pages equal rank 0's after
    each step; with the ``move_block`` records left out, the follower's pool leaves rank 0's (its digest
    differs, or a replayed call returns what rank 0's did not: IntegrityError)."""
    from kvpool.engine.pool_log import pool_digest
    from kvpool.engine.sampling import SamplingParams
    from kvpool.engine.tp_memory import memory_digest

    lead, recorder, follower = _leader_and_follower(_tp_helpers.build_model("tiny-llama"))
    for prompt, new in zip(helpers.PROMPTS, helpers.NEW, strict=True):
        lead.add_request(prompt, SamplingParams(max_new_tokens=new))
    pool, cache = follower.kv_manager.block_pool, follower.cache
    diverged = False
    while lead.has_unfinished() and not diverged:
        lead.step()
        log = [record for record in recorder.drain() if record[0] != drop]
        try:
            replay(pool, log, rank=1, cache=cache)
        except IntegrityError:
            diverged = True
        diverged = diverged or pool_digest(pool) != pool_digest(lead.kv_manager.block_pool) or \
            memory_digest(cache) != memory_digest(lead.cache)  # (what check_across_ranks compares)
    assert diverged == (drop is not None)
    assert lead.compactor.stats.moved > 0

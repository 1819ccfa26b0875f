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

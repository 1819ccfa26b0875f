"""A hybrid's hits finer than a block under tensor parallelism: rank 0 decides the unit hit, its KV copy and
its state restore travel in the pool log, the unit saves in the step's batch, and every rank applies them to
its own shard. Expected tokens and logits are transformers' own greedy ``generate`` (the whole model in one
process, no kvpool code); the control leaves the KV copy on rank 0 only, and the logits leave
transformers'."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import _partial_helpers as helpers  # noqa: E402

from kvpool.engine.launch import launch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.timeout(400)
def test_tp2_unit_hit_on_a_hybrid_matches_transformers_and_a_rank_0_only_copy_diverges() -> None:
    outcome = launch(helpers.run_units, 2)
    runs = helpers.matches_transformers(outcome, helpers.UNIT_MODEL, helpers.UNIT_NEW, atol=1e-3)
    # 3 full blocks of 8 + 2 units of 2, the state from the unit checkpoint at 28 tokens
    for run in runs:
        assert run["cached"] == 28 and run["unit_restores"] == 1

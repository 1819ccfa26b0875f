"""What the tensor-parallel hybrid tests run on every rank (spawned ranks import this module by name), and the
same scenario in one process for the expected values: a tiny recurrent hybrid whose prompts share prefixes,
its states saved at every block boundary (``dense``), so later requests restore checkpoints."""

from __future__ import annotations

import copy
from typing import Any

import torch

BLOCK = 4
NEW = 10
BASE = list(range(30, 62))  # a 32-token prompt (byte ids)
# the first call's requests run together; the second call's hit the checkpoints the first one saved
CALLS = [[BASE, BASE[:21] + [200, 201, 202], [99, 98, 97, 96, 95, 94, 93]], [BASE[:26], BASE]]


def build(name: str) -> Any:
    from kvpool.engine.models import load_model

    return load_model(name, seed=1).model


def run_hybrid(tp: Any, name: str, break_state_sharding: bool = False) -> dict[str, Any] | None:
    """``CALLS`` on ``name`` (this rank's shard; ``tp`` None: one process). ``break_state_sharding``: rank 1
    keeps rank 0's heads of every recurrent mixer (and so rank 0's state shard) instead of its own, the
    attention and MLPs sharded as they should be: a control that must diverge. Rank 0 returns the tokens
    and counters, the other ranks None."""
    from kvpool.engine.distributed import run_engine
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.engine.sharding import _keep_rows, _row_parallel, shard_model
    from kvpool.engine.sharding_recurrent import shard_recurrent_mixer

    torch.set_num_threads(1)
    model = build(name)
    if tp is not None:
        layers = model.model.layers
        mixers = {i: copy.deepcopy(layer.linear_attn) for i, layer in enumerate(layers)
                  if getattr(layer, "linear_attn", None) is not None}
        shard_model(model, tp.rank, tp.size, tp.all_reduce)
        if break_state_sharding and tp.rank == 1:
            def row_parallel(linear: Any, columns: slice) -> Any:
                return _row_parallel(linear, columns, tp.all_reduce)

            for i, mixer in mixers.items():
                shard_recurrent_mixer(mixer, 0, tp.size, row_parallel, _keep_rows)
                layers[i].linear_attn = mixer
    engine = LLMEngine(model, num_blocks=64, block_size=BLOCK, state_save="dense",
                       tp_size=1 if tp is None else tp.size)

    def lead(engine: Any) -> dict[str, Any]:
        params = SamplingParams(max_new_tokens=NEW)
        tokens = [r.output_token_ids for call in CALLS for r in engine.generate(call, params)]
        states = engine.states.describe()
        return {"tokens": tokens, "checkpoint_hits": states["checkpoint_hits"],
                "checkpoints_saved": states["checkpoints_saved"],
                "prefix_hit_tokens": engine.stats.prefix_hit_tokens, "steps": engine.stats.steps}

    if tp is None:
        return lead(engine)
    done = run_engine(tp, engine, lead)
    return None if done is None else done[0]

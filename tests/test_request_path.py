"""One request path: the engine and the trace replay make the same pool calls, and every capability composes.

* **Parity.** The engine runs requests on a tiny model; the replay runs the same requests with a clock for a
  model (it gives back the tokens the engine sampled): both pools' logged calls (allocate, free, touch,
  cache_blocks, pin, ... with their arguments and results) are the same list, in the same order, for a
  full-attention model and for a hybrid one, with preemption and chunked prefill; so the replay's hit
  ratios are the engine's by construction.
* **The feature matrix.** Every pair of {full, sliding, Gemma 3 layout} x {no tier, host, host+disk,
  host+disk+Redis} x {lru, arc, lfu} x {no pin, pin} x {TP 1, TP 2} x {events off, on} runs in some cell
  (a covering array); each cell's tokens equal transformers' own greedy generate, the pool and every tier
  pass check_integrity, and the KV events rebuild the pool's index exactly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import _matrix_helpers as matrix  # noqa: E402

from kvpool.allocators.hashing import BlockHasher  # noqa: E402
from kvpool.engine.distributed import RecordingPool  # noqa: E402
from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.launch import launch  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.requests import Request  # noqa: E402
from kvpool.trace.replayer import ReplayConfig, Replayer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = list(range(7, 47))
PARITY_PROMPTS = [BASE, BASE[:30] + [200, 201, 202, 203, 204], [99, 98, 97, 96, 95, 94, 93], BASE[:17],
                  BASE + [5, 6], [120 + i % 30 for i in range(45)], BASE[:22]]


def _recorded(pool: object) -> RecordingPool:
    return RecordingPool(pool, on_check=lambda: None)


@pytest.mark.parametrize(("name", "num_blocks"), [("tiny-llama", 20), ("tiny-gemma3", 44)])
def test_the_replay_makes_the_engines_pool_calls(name: str, num_blocks: int) -> None:
    model = load_model(name, seed=1).model
    hasher = BlockHasher("sha256", shared=True)
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=12, max_num_seqs=5,
                       hasher=hasher)
    engine_log = engine.kv_manager.wrap_pool(_recorded)
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    done = engine.generate(PARITY_PROMPTS, params)
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_tokens > 0  # the log covers both

    outputs = {r.request_id: r.output_token_ids for r in done}
    requests = [Request(i, p, 9) for i, p in enumerate(PARITY_PROMPTS)]
    config = ReplayConfig(block_size=4, num_blocks=num_blocks, timing="trace", max_batched_tokens=12,
                          max_running=5, groups=engine.kv.groups)
    replayer = Replayer(requests, config, hasher=hasher,
                        next_token=lambda req: outputs[req.request_id][req.num_output_tokens])
    replay_log = replayer.kv.wrap_pool(_recorded)
    result = replayer.run(0.0)
    assert result.requests_completed == len(PARITY_PROMPTS) and result.preemptions == engine.stats.preemptions
    assert len(engine_log.log) > 50
    assert replay_log.log == engine_log.log
    # the replay's hit count is the engine's: first admissions only, in blocks of 4 tokens
    assert result.hit_blocks * 4 == sum(r.num_cached_tokens for r in done)


# ---- the feature matrix ---------------------------------------------------------------------------------

CELLS = matrix.pairwise_cells()


def test_the_cells_cover_every_pair() -> None:
    import itertools

    names = list(matrix.FACTORS)
    for a, b in itertools.combinations(names, 2):
        seen = {(c[a], c[b]) for c in CELLS}
        assert seen == set(itertools.product(matrix.FACTORS[a], matrix.FACTORS[b])), (a, b)
    assert len(CELLS) < 30  # far fewer than the 288 of the whole product


@pytest.fixture(scope="module")
def references() -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    out = {}
    for name in matrix.MODELS:
        model = load_model(name, seed=3).model
        out[name] = [reference_greedy(model, p, matrix.NEW) for p in matrix.PROMPTS]
    return out


def check_cell(cell: dict, outcome: dict, refs: list) -> None:
    expected = refs + refs  # one by one, then all at once
    for (tokens, logits), got_tokens, got_logits in zip(expected, outcome["tokens"], outcome["logits"],
                                                        strict=True):
        assert got_tokens == tokens
        torch.testing.assert_close(got_logits, logits, atol=1e-4, rtol=0)
    if cell["tiers"] != "none" and not cell["pin"]:  # the shared prefix came back from a tier
        assert sum(n for where, n in outcome["tier_hits"].items() if where != "device") > 0
    if cell["pin"]:
        assert outcome["pinned"] > 0
    if cell["events"]:
        index: set = set()
        for kind, medium, group, hashes in outcome["events"]:
            if medium not in (None, "GPU"):
                continue
            if kind == "BlockStored":
                index |= {(group, h) for h in hashes}
            elif kind == "BlockRemoved":
                index -= {(group, h) for h in hashes}
            else:
                index.clear()
        assert index == outcome["index"] and index


def _redis(cells: list[dict], tmp_path, redis_single) -> str | None:
    return redis_single.url if any("redis" in c["tiers"] for c in cells) else None


ONE_PROCESS = [c for c in CELLS if c["tp"] == 1]
TWO_RANKS = [c for c in CELLS if c["tp"] == 2]


@pytest.mark.parametrize("cell", ONE_PROCESS, ids=matrix.cell_id)
def test_matrix_cell_one_process(cell: dict, references: dict, tmp_path, redis_single) -> None:
    (outcome,) = matrix.run_cells(None, [cell], str(tmp_path), _redis([cell], tmp_path, redis_single))
    check_cell(cell, outcome, references[cell["model"]])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_matrix_cells_on_two_ranks(references: dict, tmp_path, redis_single) -> None:
    redis_url = _redis(TWO_RANKS, tmp_path, redis_single)
    outcomes = launch(matrix.run_cells, 2, TWO_RANKS, str(tmp_path), redis_url)
    for cell, outcome in zip(TWO_RANKS, outcomes, strict=True):
        check_cell(cell, outcome, references[cell["model"]])


def test_a_wrapped_pool_takes_the_request_paths_calls_and_the_tiers_attach_below_it() -> None:
    """The declared seam a tensor-parallel leader takes the pool over through (issue 31: it rewired the
    coordinator and ``attach_tiers`` unwrapped it by duck typing): the wrapper is ``kv.pool`` and logs an
    admission's allocate, ``block_pool`` stays the pool, the tiers attach to it, one wrapper only."""
    from kvpool.errors import InvalidArgumentError
    from kvpool.requests.kv_manager import KVCacheManager
    from kvpool.spec import KVCacheGroup, LayerKind
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier

    kv = KVCacheManager((KVCacheGroup(0, LayerKind.FULL, None, (0,), 1, 2),), 16)
    raw = kv.pool
    log = kv.wrap_pool(_recorded)
    assert kv.pool is log and kv.block_pool is raw and log.pool is raw
    assert kv.admit(Request(0, [1, 2, 3, 4, 5], 1), 64) == 5  # 5 tokens: 3 blocks of 2
    assert ("allocate", (3,)) in [(name, args) for name, args, _, _ in log.drain()]
    manager = kv.attach_tiers([HostTier(8, Namespace("m", "none", "hash-only", hash_scheme="trace"))],
                              asynchronous=False)
    assert manager.pool is raw
    with pytest.raises(InvalidArgumentError, match="wrapper in front"):
        kv.wrap_pool(_recorded)

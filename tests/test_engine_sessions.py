"""The reference engine with a session and the cached-token accounting: a second turn that an open session
kept finds its whole previous turn cached where LRU alone evicted it, its tokens are transformers' own
greedy tokens (no kvpool code), every request's read + creation + uncached tokens sum to its prompt, and
closing the session leaves no reference behind."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.errors import InvalidIdError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B, NEW = 4, 6
TURN1 = list(range(40, 53))  # 13 tokens: KV for 13 + 6 - 1 = 18 tokens, 5 blocks, 4 full ones published
OTHER = list(range(100, 113))  # the same shape, no session: 4 cached blocks
BIG = list(range(200, 230))  # 30 tokens + 6: KV for 35 tokens, 9 blocks


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llama", seed=2).model


def run(engine: LLMEngine, prompt: list[int], **kw):
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=NEW), **kw)
    while engine.has_unfinished():
        engine.step()
    req = engine.requests[rid]
    assert req.cache_usage.prompt_tokens == len(prompt)  # read + creation + uncached
    return req


@pytest.mark.parametrize("session", [False, True])
def test_a_session_keeps_its_turn_and_the_tokens_stay_transformers(model, session: bool) -> None:
    engine = LLMEngine(model, num_blocks=14, block_size=B)
    sid = "chat" if session else None
    if session:
        engine.sessions.open(sid)
    first = run(engine, TURN1, session_id=sid)
    # 13 tokens: nothing cached yet; 3 full prompt blocks (12 tokens) created, 1 token uncached
    assert first.cache_usage.to_dict() == {"cache_read_tokens": 0, "cache_read_tokens_by_tier": {"device": 0},
                                           "cache_creation_tokens": 12, "uncached_tokens": 1}
    run(engine, OTHER)
    # BIG takes the 6 uncached free blocks and evicts 3 cached ones: LRU takes the first turn's (older,
    # freed tail first: its last 3 blocks), the open session leaves them and OTHER's go instead
    run(engine, BIG)
    turn2 = TURN1 + first.output_token_ids + [7, 8, 9]
    second = run(engine, turn2, session_id=sid)
    assert second.cache_usage.cache_read_tokens == (16 if session else 4)
    assert second.output_token_ids == reference_greedy(model, turn2, NEW)[0]
    if session:
        assert engine.sessions.close(sid) > 0
    engine.kv_manager.check_integrity()
    assert engine.pool.num_pinned_blocks == 0 and engine.pool.num_used_blocks == 0


def test_an_unknown_session_is_refused_and_nothing_is_queued(model) -> None:
    engine = LLMEngine(model, num_blocks=14, block_size=B)
    with pytest.raises(InvalidIdError):
        engine.add_request(TURN1, session_id="nope")
    with pytest.raises(InvalidIdError):
        engine.sessions.close("nope")
    assert not engine.has_unfinished() and not engine.requests

"""Sessions and retained ranges on the request path (kvpool.requests.sessions), the cached-token accounting
(kvpool.requests.accounting) on trace-like requests and on a replay of the generated multi-turn trace.

Pools are small and every expectation is worked out by hand in the comments: blocks of 4 tokens, a trace-like
request of 9 prompt tokens and 1 output holds KV for 9 tokens = 3 blocks (2 full, hashed; the third
unhashed), so after it finishes 2 blocks are cached and 1 is uncached free.
"""

from __future__ import annotations

import pytest

from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError, OutOfBlocksError
from kvpool.requests import KVCacheManager, Request, Scheduler
from kvpool.requests.sessions import Retention, SessionPolicy
from kvpool.spec import KVCacheGroup

B = 4


def make(num_blocks: int = 8, pin_cap: float = 0.5) -> Scheduler:
    kv = KVCacheManager((KVCacheGroup.full(B),), num_blocks, pin_cap=pin_cap)
    return Scheduler(kv, max_num_batched_tokens=10_000, max_num_seqs=1)


def req(rid: int, hashes: list[int], prompt: int | None = None, **kw) -> Request:
    """A trace-like request: ``prompt`` tokens (default: the hashed blocks + 1 token), 1 output token."""
    n = len(hashes) * B + 1 if prompt is None else prompt
    return Request(rid, None, 1, num_prompt_tokens=n, block_hashes=list(hashes), **kw)


def run(sched: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, [None] * out.num_sampled)
    sched.kv.check_integrity()


def cached(sched: Scheduler, hashes: list[int]) -> int:
    """How many leading blocks of ``hashes`` are cached now."""
    return len(sched.kv.pool.match_prefix(hashes))


@pytest.mark.parametrize("session", [False, True])
def test_an_open_session_outranks_blocks_of_no_session(session: bool) -> None:
    sched = make()
    if session:
        sched.kv.sessions.open("chat")
    # A (the session's turn) then C (no session): 2 cached blocks each. D needs 6 blocks (23 tokens + 1
    # output: KV for 24 tokens): the pool has 4 uncached free blocks, so 2 cached blocks are evicted.
    run(sched, req(0, [1, 2], session_id="chat" if session else None), req(1, [3, 4]))
    run(sched, req(2, [10, 11, 12, 13, 14], prompt=23))
    # LRU alone evicts the older A; with the session open, A is pinned and C (no session) goes instead.
    assert (cached(sched, [1, 2]), cached(sched, [3, 4])) == ((2, 0) if session else (0, 2))


def test_closing_a_session_dereferences_and_never_frees_under_a_request() -> None:
    sched = make()
    kv = sched.kv
    kv.sessions.open("s")
    run(sched, req(0, [1, 2], session_id="s"))
    assert kv.pool.num_pinned_blocks == 2 and kv.pool.num_used_blocks == 2
    follow = req(1, [1, 2, 3])  # hits [1, 2] and is left running across the close
    sched.add_request(follow)
    out = sched.schedule()
    assert follow.num_computed_tokens == 2 * B
    assert kv.sessions.close("s") == 2
    kv.check_integrity()
    # the two shared blocks are still in use (the running request's references), no longer pinned
    assert kv.pool.num_pinned_blocks == 0
    assert all(kv.pool.ref_count(b) == 1 for b in kv.pool.match_prefix([1, 2]))
    sched.update(out, [None] * out.num_sampled)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, [None] * out.num_sampled)
    kv.check_integrity()
    assert kv.pool.num_used_blocks == 0 and cached(sched, [1, 2, 3]) == 3  # released, still cached


@pytest.mark.parametrize("keep, pinned", [(None, [1, 2, 3, 4, 5]), (1, [1, 2, 5]), (2, [1, 2, 4, 5]),
                                          (0, [])])
def test_keep_the_last_n_turns(keep: int | None, pinned: list[int]) -> None:
    sched = make(num_blocks=16)
    sched.kv.sessions.open("s", keep_turns=keep)
    # an agent rewriting its last block each turn: turn prefixes [1, 2, 3], [1, 2, 4], [1, 2, 5]; a turn
    # keeps its whole prefix, so the last N turns keep [1, 2] and their own last blocks
    run(sched, req(0, [1, 2, 3], session_id="s"), req(1, [1, 2, 4], session_id="s"),
        req(2, [1, 2, 5], session_id="s"))
    pool = sched.kv.pool
    assert sorted(pool.block_hash(b) for b in pool.pinned_blocks()) == pinned
    assert sched.kv.sessions.close("s") == 3 * min(3, 3 if keep is None else keep)  # one pin per block a turn
    assert pool.num_pinned_blocks == 0 and pool.num_used_blocks == 0
    sched.kv.check_integrity()


def test_a_retained_range_expires_after_its_steps() -> None:
    sched = make(num_blocks=16)
    kv = sched.kv
    # tokens [0, 10) cover the full blocks 0 and 1 (block 2 ends at token 12): 2 blocks kept for 3 steps
    run(sched, req(0, [1, 2, 3], retain=Retention(end=10, steps=3)))
    pool = kv.pool
    assert sorted(pool.block_hash(b) for b in pool.pinned_blocks()) == [1, 2]
    # a request of 1 prompt token and 3 outputs runs 3 scheduler steps (a prefill that samples, 2 decodes):
    # the range is still kept through them, and released at the start of the step after
    run(sched, Request(9, None, 3, num_prompt_tokens=1))
    assert pool.num_pinned_blocks == 2 and kv.sessions.stats.expired == 0
    run(sched, Request(10, None, 1, num_prompt_tokens=1))
    assert pool.num_pinned_blocks == 0 and pool.num_used_blocks == 0 and cached(sched, [1, 2, 3]) == 3
    assert kv.sessions.stats.expired == 1


def test_kept_sessions_give_way_before_a_request_waits() -> None:
    # pin cap 1.0: the session may pin the whole pool; a request needing all 8 blocks must still run
    sched = make(pin_cap=1.0)
    sched.kv.sessions.open("s")
    run(sched, req(0, [1, 2], session_id="s"))
    assert sched.kv.pool.num_pinned_blocks == 2
    big = req(1, [20, 21, 22, 23, 24, 25, 26], prompt=31)  # 31 + 1 - 1 = 31 tokens: 8 blocks
    run(sched, big)  # without the session's release, schedule() raised OutOfBlocksError here
    assert big.num_output_tokens == 1
    assert sched.kv.sessions.stats.released == 1 and sched.kv.pool.num_pinned_blocks == 0


def test_a_released_turn_in_the_hit_is_counted_as_needed() -> None:
    sched = make(pin_cap=1.0)
    sched.kv.sessions.open("s")
    sched.kv.sessions.open("t")
    # s keeps [1, 2] (2 blocks), then t keeps [9] (1 block): 5 of the 8 blocks free
    run(sched, req(0, [1, 2], session_id="s"), req(1, [9], session_id="t"))
    # s's next turn hits [1, 2] and needs 6 new blocks (31 tokens: 8 blocks). Releasing s's old turn (the
    # oldest) frees 2 blocks but makes them evictable hit blocks that admission must keep: 8 needed, 7
    # free; t's turn goes too, and then it fits
    turn2 = req(2, [1, 2, 3, 4, 5, 6, 7], prompt=31, session_id="s")
    run(sched, turn2)
    assert turn2.cache_usage.cache_read_tokens == 2 * B
    assert sched.kv.sessions.stats.released == 2


def test_bad_input_is_a_typed_error_that_changes_nothing() -> None:
    sched = make()
    sessions = sched.kv.sessions
    sessions.open("s", keep_turns=2)
    with pytest.raises(InvalidIdError):
        sessions.open("s")
    with pytest.raises(InvalidIdError):
        sessions.close("nope")
    with pytest.raises(InvalidArgumentError):
        sessions.open("t", keep_turns=-1)
    assert sessions.num_open == 1 and not sessions.is_open("t")
    with pytest.raises(InvalidIdError):
        sched.add_request(req(0, [1], session_id="unknown"))
    assert not sched.has_unfinished()
    for bad in (dict(end=8, steps=-1), dict(end=-1, steps=3), dict(end=4, steps=3, start=4)):
        with pytest.raises(InvalidArgumentError):
            Retention(**bad)
    with pytest.raises(InvalidArgumentError):
        req(0, [1], retain=(0, 8, 3))
    with pytest.raises(ConfigError):
        SessionPolicy.parse("last=-2")
    assert SessionPolicy.parse("last=3").keep_turns == 3 and str(SessionPolicy.parse("session")) == "session"


def test_out_of_blocks_still_raised_when_no_session_helps() -> None:
    # a manager pin (not a session's) that leaves too little room is still the scheduler's error
    sched = make(pin_cap=1.0)
    run(sched, req(0, [1, 2]))
    sched.kv.pin_when_cached([1, 2])
    with pytest.raises(OutOfBlocksError):
        run(sched, req(1, [20, 21, 22, 23, 24, 25, 26], prompt=31))


# ---- accounting -----------------------------------------------------------------------------------------

def test_accounting_of_a_hit_a_miss_and_a_partial_block() -> None:
    sched = make(num_blocks=16)
    first, again = req(0, [1, 2, 3], prompt=14), req(1, [1, 2, 3], prompt=14)
    run(sched, first, again)
    # first: 14 tokens, 3 full hashed blocks (12 tokens) computed and cached, 2 tokens of the partial block
    u = first.cache_usage.to_dict()
    assert (u["cache_read_tokens"], u["cache_creation_tokens"], u["uncached_tokens"]) == (0, 12, 2)
    # again: hits the 3 blocks (12 <= 14 - 1 tokens), creates nothing, the partial block again
    u = again.cache_usage.to_dict()
    assert u["cache_read_tokens_by_tier"] == {"device": 12}
    assert (u["cache_creation_tokens"], u["uncached_tokens"]) == (0, 2)
    assert sched.kv.usage.to_dict()["cache_read_tokens"] == 12


def test_accounting_without_prefix_caching_is_all_uncached() -> None:
    kv = KVCacheManager((KVCacheGroup.full(B),), 16, enable_caching=False)
    sched = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=4)
    r = req(0, [1, 2, 3], prompt=14)
    run(sched, r)
    assert r.cache_usage.to_dict()["uncached_tokens"] == 14 and r.cache_usage.cache_read_tokens == 0


@pytest.mark.parametrize("policy", [None, "session", "last=1"])
def test_replay_accounting_sums_to_every_prompt(monkeypatch, policy: str | None) -> None:
    from kvpool.trace import replayer
    from kvpool.trace.loaders import TraceRequest
    from kvpool.trace.synthetic import WorkloadShape, generate

    rows = generate(3, WorkloadShape(requests=150))
    trace = [TraceRequest(r["timestamp"] / 1000, r["input_length"], r["output_length"], tuple(r["hash_ids"]),
                          r["session_id"]) for r in rows]
    made: list[Request] = []
    real = replayer.trace_request

    def collect(*args):
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(replayer, "trace_request", collect)
    from kvpool.trace.replay import run_replay

    res = run_replay(trace, replayer.ReplayConfig(block_size=16, num_blocks=3000, sessions=policy))
    admitted = [r for r in made if r.cache_usage is not None]
    assert len(admitted) == res.requests_completed == 150
    for r in admitted:  # every request: read + creation + uncached = its prompt
        assert r.cache_usage.prompt_tokens == r.num_prompt_tokens
    usage = res.cache["usage"]
    assert usage["cache_read_tokens"] == res.hit_blocks * 16  # the report's hits, in tokens
    assert usage["cache_read_tokens"] + usage["cache_creation_tokens"] + usage["uncached_tokens"] == \
        sum(t.input_tokens for t in trace)
    if policy is not None:
        s = res.cache["sessions"]
        assert s["opened"] == s["closed"] == len({t.session_id for t in trace}) and s["kept_blocks"] == 0


def test_prometheus_exports_the_accounting_and_the_sessions() -> None:
    pytest.importorskip("prometheus_client")
    from kvpool.metrics import KVPoolCollector

    sched = make(num_blocks=16)
    sched.kv.sessions.open("s")
    # as test_accounting_of_a_hit_a_miss_and_a_partial_block: (0, 12, 2) then (12, 0, 2); the second one
    # is the session's turn: its 3 published blocks stay pinned
    run(sched, req(0, [1, 2, 3], prompt=14), req(1, [1, 2, 3], prompt=14, session_id="s"))
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in KVPoolCollector().add_usage(sched.kv).collect() for s in f.samples}
    assert got[("kvpool_cache_read_tokens_total", (("tier", "device"),))] == 12
    assert got[("kvpool_cache_creation_tokens_total", ())] == 12
    assert got[("kvpool_cache_uncached_tokens_total", ())] == 4
    assert got[("kvpool_sessions_open", ())] == 1 and got[("kvpool_session_kept_blocks", ())] == 3
    with pytest.raises(InvalidArgumentError):
        KVPoolCollector().add_usage(sched.kv).add_usage(sched.kv)


# ---- the command line -------------------------------------------------------------------------------------

def _write_trace(tmp_path, **shape) -> str:
    from kvpool.trace.synthetic import main as synthetic

    path = str(tmp_path / "syn.jsonl")
    assert synthetic([path, "--seed", "1", "--requests", "60", *(f"--{k.replace('_', '-')}={v}"
                                                                   for k, v in shape.items())]) == 0
    return path


@pytest.mark.parametrize("bad", ["last=-1", "all", "last="])
def test_cli_bad_session_policy_prints_one_line_and_exits_2(tmp_path, capsys, bad: str) -> None:
    from kvpool.cli import main

    path = _write_trace(tmp_path)
    capsys.readouterr()
    assert main(["replay", path, "--sessions", bad, "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "session policy" in err


def test_cli_replay_reports_sessions_and_accounting(tmp_path, capsys) -> None:
    import json

    from kvpool.cli import main
    from kvpool.trace.loaders import load_trace

    path = _write_trace(tmp_path, one_off_share=0.3)
    trace = load_trace(path)
    assert any(r.session_id is None for r in trace.requests) and any(r.session_id for r in trace.requests)
    capsys.readouterr()
    argv = ["replay", path, "--num-blocks", "3000", "--no-progress"]
    assert main([*argv, "--sessions", "last=2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    usage, sessions = report["cache"]["usage"], report["cache"]["sessions"]
    assert usage["cache_read_tokens"] + usage["cache_creation_tokens"] + usage["uncached_tokens"] == \
        sum(r.input_tokens for r in trace.requests)
    assert sessions["opened"] == sessions["closed"] == len({r.session_id for r in trace.requests} - {None})
    assert report["cache"]["session_policy"] == "last=2"
    assert main([*argv, "--sessions", "session"]) == 0
    out = capsys.readouterr().out
    assert "cache_read_tokens" in out and "sessions             session:" in out


def test_replay_accounting_splits_reads_by_tier() -> None:
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier
    from kvpool.trace.loaders import load_trace
    from kvpool.trace.replay import ReplayConfig, request_blocks, run_replay, unbounded_num_blocks

    requests = load_trace(None, None, max_requests=200).requests
    unbounded = ReplayConfig(block_size=16)
    oracle = run_replay(requests, unbounded)  # nothing evicted: every reusable block is read
    device = max(request_blocks(r, unbounded) for r in requests)
    host = HostTier(unbounded_num_blocks(requests, unbounded), Namespace("t", "none", "hash-only"))
    tiered = run_replay(requests, ReplayConfig(block_size=16, num_blocks=device), tiers=[host])
    usage = tiered.cache["usage"]
    # an unbounded host tier under the device loses nothing: the reads are the oracle's, in tokens
    assert usage["cache_read_tokens"] == oracle.hit_blocks * 16 == oracle.cache["usage"]["cache_read_tokens"]
    by_tier = usage["cache_read_tokens_by_tier"]
    assert by_tier["host"] > 0 and by_tier == {p: n * 16 for p, n in tiered.tier_hits.items()}
    assert usage["cache_read_tokens"] + usage["cache_creation_tokens"] + usage["uncached_tokens"] == \
        sum(r.input_tokens for r in requests)

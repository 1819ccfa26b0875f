"""State checkpoints on the request path: save policies, the joint hit, the checkpoint slots' LRU, the replay.

Hand arithmetic of the junction case (block size 16; A 3,000 prompt tokens, B and C 5,000, all sharing the
first 2,000 = 125 blocks, then diverging; one output token each, so a request's KV ends at its prompt):

* every lookup is capped at the full blocks of the first ``num_tokens - 1`` tokens; B and C find the KV of
  the 125 shared blocks cached (A's, then A's and B's), never more.
* ``tail``: A saves at 3,000 // 16 = 187, B and C at 5,000 // 16 = 312; nothing at 125, so B and C hit 0
  and 2 x 2,000 tokens of cached KV go unused; 3 checkpoints.
* ``tail+junction``: B's KV hit (125) ends past its last checkpoint (none): B saves at 125 as it computes
  it; C restores there: hits 0, 0, 2,000; 4 checkpoints; 2,000 unused KV tokens (B's).
* ``dense``: A saves at 1 .. 187, so B hits 125 blocks; B adds 126 .. 312 (187 more), C the same: hits
  0, 2,000, 2,000; 187 x 3 = 561 checkpoints.
* ``interval=25``: 125 = 5 x 25: hits 0, 2,000, 2,000; A saves 25 .. 175 (7), B 150 .. 300 (7 new),
  C 7 new: 21.
* ``tail+junction`` with one checkpoint slot: B's junction save evicts A's 187 and then holds the only slot
  (pending), so B's tail save (312) is skipped; C still restores 125, then its tail save (312) evicts it:
  hits 0, 0, 2,000; 3 checkpoints saved (187, 125, 312), 2 evictions, 1 held at most.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.allocators.hashing import BlockHasher
from kvpool.allocators.state_pool import StatePool
from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError, OutOfBlocksError
from kvpool.requests import KVCacheManager, Request, Scheduler
from kvpool.requests.state_checkpoints import NO_SLOT, RequestStates, SavePolicy, StateCheckpoints
from kvpool.spec import KVCacheGroup, LayerKind
from kvpool.trace.replayer import ReplayConfig, Replayer

SHARED = list(range(2000))


def _junction_requests() -> list[Request]:
    return [Request(0, SHARED + [3000 + i % 7 for i in range(1000)], 1),
            Request(1, SHARED + [4000 + i % 11 for i in range(3000)], 1),
            Request(2, SHARED + [5000 + i % 13 for i in range(3000)], 1)]


def _replay(policy: str, capacity: int | None = None) -> tuple[list[int], object]:
    requests = _junction_requests()
    config = ReplayConfig(block_size=16, state_save=policy, state_checkpoints=capacity)
    result = Replayer(requests, config, hasher=BlockHasher("sha256"), next_token=lambda req: 1
                      ).run(time.perf_counter())
    return [r.num_cached_tokens for r in requests], result


@pytest.mark.parametrize(("policy", "hits", "saved", "kv_only"), [
    ("tail", [0, 0, 0], 3, 4000),
    ("tail+junction", [0, 0, 2000], 4, 2000),
    ("dense", [0, 2000, 2000], 561, 0),
    ("interval=25", [0, 2000, 2000], 21, 0),
])
def test_the_junction_case_hits_by_policy(policy: str, hits: list[int], saved: int, kv_only: int) -> None:
    got, result = _replay(policy)
    assert got == hits
    assert result.hit_blocks == sum(hits) // 16 and result.checkpoints_saved == saved
    assert result.kv_only_tokens == kv_only and result.state_slots_peak == 1
    assert result.checkpoint_hits == sum(1 for h in hits if h) and result.state_save == policy
    assert result.checkpoint_evictions == 0 and result.checkpoints_peak == saved


def test_one_checkpoint_slot_keeps_the_junction() -> None:
    got, result = _replay("tail+junction", capacity=1)
    assert got == [0, 0, 2000]
    assert (result.checkpoints_saved, result.checkpoint_evictions, result.checkpoints_peak) == (3, 2, 1)


def test_without_state_the_replay_reuses_all_cached_kv() -> None:
    requests = _junction_requests()
    Replayer(requests, ReplayConfig(block_size=16), hasher=BlockHasher("sha256"), next_token=lambda r: 1
             ).run(time.perf_counter())
    assert [r.num_cached_tokens for r in requests] == [0, 2000, 2000]


@pytest.mark.parametrize(("text", "policy"), [
    ("tail", SavePolicy()), ("dense", SavePolicy(tail=False, interval=1)),
    ("interval=4", SavePolicy(tail=False, interval=4)), ("Tail+Junction", SavePolicy(junction=True)),
])
def test_policies_parse_and_print(text: str, policy: SavePolicy) -> None:
    assert SavePolicy.parse(text) == policy and SavePolicy.parse(str(policy)) == policy


@pytest.mark.parametrize(("text", "match"), [
    ("interval=0", "state_save interval must be"), ("interval=-2", "state_save interval"),
    ("interval=x", "state_save interval"), ("every", "state_save must be one of"), ("", "state_save"),
])
def test_bad_policies_name_the_field(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SavePolicy.parse(text)
    with pytest.raises(ConfigError, match=match):
        ReplayConfig(state_save=text)


def test_bad_checkpoint_capacities() -> None:
    with pytest.raises(ConfigError, match="state_checkpoints must be"):
        ReplayConfig(state_save="tail", state_checkpoints=0)
    with pytest.raises(ConfigError, match="needs a state_save"):
        ReplayConfig(state_checkpoints=4)
    with pytest.raises(ConfigError, match="state checkpoints must be"):
        StateCheckpoints(-1)
    with pytest.raises(ConfigError, match="need a capacity"):
        StateCheckpoints(pool=StatePool(2))


def test_checkpoints_evict_least_recently_used_and_restores_touch() -> None:
    pool = StatePool(3)
    ckpt = StateCheckpoints(2, pool=pool)
    a, b = ckpt.reserve(), ckpt.reserve()
    assert ckpt.reserve() is None and ckpt.stats.skipped == 1  # both pending: nothing to evict
    ckpt.commit("a", a)
    ckpt.commit("b", b)
    assert ckpt.touch("a") == a  # b is now the least recently used
    c = ckpt.reserve()
    assert "b" not in ckpt and "a" in ckpt and c == b and ckpt.stats.evicted == 1
    ckpt.commit("a", c)  # a key held already: touched, the slot released
    assert len(ckpt) == 1 and pool.num_used_slots == 1 and ckpt.stats.saved == 2
    ckpt.check_integrity()
    with pytest.raises(InvalidIdError):
        ckpt.touch("b")
    with pytest.raises(InvalidIdError):
        ckpt.release(c)  # not pending
    assert ckpt.longest(["x", "a", "y"], 3) == 2 and ckpt.longest(["a"], 0) == 0


@pytest.mark.parametrize(("policy", "evicted"), [("lru", "b"), ("fifo", "a"), ("lfu", "a")])
def test_checkpoints_are_evicted_in_the_policys_order(policy: str, evicted: str) -> None:
    # a and b saved in that order; b restored twice, then a once. LRU: b is the least recently used; FIFO:
    # a was saved first (restores do not count); LFU: a was used least (one restore against two).
    ckpt = StateCheckpoints(2, policy=policy)
    for key in "ab":
        ckpt.commit(key, ckpt.reserve())
    for key in "bba":
        ckpt.touch(key)
    ckpt.reserve()
    assert evicted not in ckpt and len(ckpt) == 1 and ckpt.stats.evicted == 1
    assert ckpt.policy.name == policy


def test_a_policy_serves_one_set_of_checkpoints() -> None:
    from kvpool.allocators.policies import make_policy

    policy = make_policy("arc")
    StateCheckpoints(4, policy=policy)
    with pytest.raises(InvalidArgumentError, match="already serves a pool"):
        StateCheckpoints(4, policy=policy)
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy"):
        StateCheckpoints(4, policy="mru")


@pytest.mark.parametrize("policy", ["fifo", "belady"])
def test_the_replay_evicts_checkpoints_by_its_policy(policy: str) -> None:
    from kvpool.trace.loaders import TraceRequest

    trace = [TraceRequest(0.0, 1024, 8, (1, 2)), TraceRequest(1.0, 1024, 8, (1, 3))]
    replayer = Replayer(trace, ReplayConfig(block_size=16, state_save="tail", policy=policy,
                                            state_checkpoints=2))
    # belady orders KV blocks by the trace's future; the checkpoints fall back to LRU
    assert replayer.kv.states.checkpoints.policy.name == ("lru" if policy == "belady" else policy)


class _Mover:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []

    def zero_slots(self, slots: list[int]) -> None:
        self.calls.append(("zero", list(slots)))

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        self.calls.append(("copy", list(pairs)))


def _manager(policy: str, capacity: int, *, bs: int = 4, seqs: int = 2, mover: object = None
             ) -> tuple[KVCacheManager, Scheduler, RequestStates]:
    pool = StatePool(seqs + capacity)
    states = RequestStates(policy, bs, pool, checkpoints=StateCheckpoints(capacity, pool=pool), mover=mover)
    kv = KVCacheManager((KVCacheGroup(0, LayerKind.FULL, None, (0,), 1, bs),), 400,
                        hasher=BlockHasher("sha256"), states=states)
    return kv, Scheduler(kv, max_num_batched_tokens=6, max_num_seqs=seqs), states


def _run(sched: Scheduler, reqs: list[Request], on_step: object = None) -> None:
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        out = sched.schedule()
        if on_step is not None:
            on_step(out)
        sched.update(out, [7] * out.num_sampled)
        sched.kv.check_integrity()


def test_saves_are_planned_per_chunk_and_restored_into_the_slot() -> None:
    mover = _Mover()
    kv, sched, states = _manager("interval=2", 4, mover=mover)
    planned: list[list[tuple[int, int]]] = []
    _run(sched, [Request("a", list(range(20)), 2)],
         lambda out: planned.append([t for req, _ in out.scheduled for t, _ in states.pending(req)]))
    # chunks of 6 tokens: 0-6, 6-12, 12-18, 18-20; boundaries every 8 tokens; the sampled token (20) is
    # hashed with its block, and the second output's KV (token 20) is never written
    assert planned == [[], [8], [16], [], []]
    assert states.stats.saved == 2 and mover.calls == [("zero", [mover.calls[0][1][0]])]
    assert states.num_request_slots == 0
    b = Request("b", list(range(17)) + [99], 1)  # limit (18 - 1) // 4 = 4 blocks; checkpoint at 4
    _run(sched, [b])
    assert b.num_cached_tokens == 16 and mover.calls[1][0] == "copy" and states.stats.restored == 1


def test_a_preempted_request_frees_its_slot_and_pending_saves() -> None:
    kv, sched, states = _manager("dense", 2, seqs=2)
    req = Request("a", list(range(10)), 1)
    sched.add_request(req)
    out = sched.schedule()
    assert states.pending(req) == [(4, states.pending(req)[0][1])]
    sched.abort(req)
    assert states.num_request_slots == 0 and states.pending(req) == []
    assert states.pool.num_used_slots == 0
    kv.check_integrity()
    assert out.scheduled


def test_block_sizes_must_match() -> None:
    states = RequestStates("tail", 8, StatePool(1))
    with pytest.raises(ConfigError, match="block size"):
        KVCacheManager((KVCacheGroup(0, LayerKind.FULL, None, (0,), 1, 4),), 10, states=states)


# ---- a state machine against a brute-force model --------------------------------------------------------

BS = 4


class CheckpointMachine(RuleBasedStateMachine):
    """Requests one at a time (each prefills whole, samples one token) that branch off earlier ones; the
    model keys everything by token prefixes: the KV cached is every full-block prefix computed so far
    (an unbounded pool), the checkpoints an LRU list of prefixes with the policy's save points, and each
    hit is the longest prefix with KV whose end is a checkpoint, found by scanning."""

    @initialize(policy=st.sampled_from(["tail", "dense", "interval=2", "interval=3", "tail+junction"]),
                capacity=st.sampled_from([None, 1, 2, 5]))
    def setup(self, policy: str, capacity: int | None) -> None:
        self.policy, self.capacity = SavePolicy.parse(policy), capacity
        pool = StatePool(1 + (capacity or 0))
        ckpt = StateCheckpoints(capacity, pool=pool if capacity else None)
        self.states = RequestStates(self.policy, BS, pool if capacity else StatePool(1), checkpoints=ckpt)
        self.kv = KVCacheManager((KVCacheGroup(0, LayerKind.FULL, None, (0,), 1, BS),), 4000,
                                 hasher=BlockHasher("sha256"), states=self.states)
        self.sched = Scheduler(self.kv, max_num_batched_tokens=10**6, max_num_seqs=1)
        self.prompts: list[list[int]] = []
        self.kv_prefixes: set[tuple[int, ...]] = set()
        self.lru: list[tuple[int, ...]] = []  # least recently used first
        self.saved = self.evicted = 0

    @rule(parent=st.integers(0, 50), share=st.integers(0, 40), tail=st.integers(1, 12), tag=st.integers(0, 3))
    def run_request(self, parent: int, share: int, tail: int, tag: int) -> None:
        base = self.prompts[parent % len(self.prompts)] if self.prompts else []
        prompt = base[:share] + [100 + 10 * len(self.prompts) + tag + i for i in range(tail)]
        self.prompts.append(prompt)
        expect = self._model(prompt)
        req = Request(len(self.prompts), prompt, 1)
        self.sched.add_request(req)
        while self.sched.has_unfinished():
            out = self.sched.schedule()
            self.sched.update(out, [0] * out.num_sampled)
        assert req.num_cached_tokens == expect

    def _model(self, prompt: list[int]) -> int:
        n = len(prompt) // BS
        limit = (len(prompt) - 1) // BS
        k = max((i for i in range(limit + 1) if all(tuple(prompt[:j * BS]) in self.kv_prefixes
                                                   for j in range(1, i + 1))), default=0)
        j = max((i for i in range(k + 1) if i == 0 or tuple(prompt[:i * BS]) in self.lru), default=0)
        if j:
            key = tuple(prompt[:j * BS])
            self.lru.remove(key)
            self.lru.append(key)
        junction = k if self.policy.junction and k > j else None
        pending = []
        for b in range(j + 1, n + 1):
            key = tuple(prompt[:b * BS])
            rule = (self.policy.interval and b % self.policy.interval == 0) or (self.policy.tail and b == n)
            if (b == junction or rule) and key not in self.lru:
                if self.capacity is not None and len(self.lru) + len(pending) >= self.capacity:
                    if not self.lru:
                        continue
                    self.lru.pop(0)
                    self.evicted += 1
                pending.append(key)
        for key in pending:
            self.lru.append(key)
            self.saved += 1
        self.kv_prefixes |= {tuple(prompt[:b * BS]) for b in range(1, n + 1)}
        return j * BS

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity()
        ckpt = self.states.checkpoints
        assert len(ckpt) == len(self.lru) and ckpt.stats.saved == self.saved
        assert ckpt.stats.evicted == self.evicted
        assert all((slot == NO_SLOT) == (self.capacity is None) for slot in ckpt.slots())


TestCheckpointMachine = CheckpointMachine.TestCase
TestCheckpointMachine.settings = settings(max_examples=60, stateful_step_count=15, deadline=None)


# ---- the command line ----------------------------------------------------------------------------------

def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from kvpool.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def _replay_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    import json

    code, out, err = _cli(capsys, "replay", "--max-requests", "60", "--json", *argv)
    assert (code, err) == (0, "")
    return json.loads(out)


def test_cli_replay_counts_state_beside_kv(capsys: pytest.CaptureFixture[str]) -> None:
    # 400 GiB x 0.9 of Qwen3-Next's 12 attention layers (24,576 B per token, 393,216 B per block) is
    # 983,040 blocks: nothing of 60 requests is evicted, so the KV hit of every admission is the plain
    # replay's, and each policy's hit plus the KV it left unused (for lack of a checkpoint) is all of it
    plain = _replay_json(capsys, "--num-blocks", "983040")
    model = ("--model-config", "qwen3-next-80b-a3b", "--gpu-memory", "400GiB")
    runs = {p: _replay_json(capsys, *model, "--state-save", p) for p in ("tail", "tail+junction", "dense")}
    assert plain["hit_blocks"] > 0 and plain["evictions"] == 0
    for policy, run in runs.items():
        assert run["num_blocks"] == 983040 and run["evictions"] == 0 and run["state_save"] == policy
        assert run["hit_blocks"] + run["kv_only_tokens"] // 16 == plain["hit_blocks"], policy
        assert run["state_slots_peak"] == 1  # instant timing: one request at a time
    assert runs["dense"]["hit_blocks"] == plain["hit_blocks"] and runs["dense"]["kv_only_tokens"] == 0
    assert runs["tail"]["hit_blocks"] <= runs["tail+junction"]["hit_blocks"] <= plain["hit_blocks"]
    assert runs["tail"]["checkpoints_saved"] == 60  # one per prompt: no output has a hash
    default = _replay_json(capsys, *model)
    assert default["state_save"] == "tail" and default["hit_blocks"] == runs["tail"]["hit_blocks"]
    code, out, _ = _cli(capsys, "replay", "--max-requests", "5", *model, "--state-save", "dense")
    assert code == 0 and "checkpoints_saved" in out and "kv_only_tokens" in out
    code, out, _ = _cli(capsys, "replay", "--max-requests", "5")
    assert code == 0 and "state_save" not in out


@pytest.mark.parametrize(("argv", "match"), [
    (("--model-config", "qwen3-next-80b-a3b", "--gpu-memory", "80GiB", "--state-save", "interval=0"),
     "state_save interval must be"),
    (("--model-config", "qwen3-next-80b-a3b", "--gpu-memory", "80GiB", "--state-save", "sometimes"),
     "state_save must be one of"),
    (("--state-save", "tail"), "--state-save needs --model-config of a recurrent"),
    (("--model-config", "llama-3.1-8b", "--gpu-memory", "80GiB", "--state-checkpoints", "4"),
     "--state-checkpoints needs"),
    (("--model-config", "qwen3-next-80b-a3b", "--gpu-memory", "80GiB", "--state-checkpoints", "0"), "0"),
])
def test_cli_replay_bad_state_options(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], match: str
                                      ) -> None:
    code, out, err = _cli(capsys, "replay", *argv)
    assert code == 2 and out == "" and match in err and len(err.strip().splitlines()) == 1


def test_cli_plan_shows_the_recurrent_state(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    code, out, _ = _cli(capsys, "plan", "qwen3-next-80b-a3b", "--gpu-memory", "80GiB", "--json")
    data = json.loads(out)
    # 12 of 48 layers attend: 12 x 2 x 2 KV heads x 256 x 2 B = 24,576 B per token; 36 Gated DeltaNet layers
    # of conv (2 x 16 x 128 + 32 x 128) x 3 x 2 B = 49,152 B and ssm 32 x 128 x 128 x 2 B = 1,048,576 B
    state = data["recurrent_state"]
    assert code == 0 and data["num_layers"] == 12 and data["bytes_per_token"] == 24576
    assert (state["num_layers"], state["bytes_per_layer"]) == (36, 49152 + 1048576)
    assert state["bytes_per_request"] == 36 * 1097728 == 39518208 and state["kv_token_equivalent"] == 1608
    assert "sizing" not in state
    code, out, _ = _cli(capsys, "plan", "qwen3-next-80b-a3b", "--gpu-memory", "80GiB", "--max-model-len",
                        "32768")
    assert code == 0 and "recurrent state  36 gated_delta_net layers" in out
    assert "vLLM one pool: block size 544 tokens" in out and "SGLang two pools" in out


def test_metrics_export_the_state_counts() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvpool.metrics import KVPoolCollector

    requests = _junction_requests()
    replayer = Replayer(requests, ReplayConfig(block_size=16, state_save="tail+junction"),
                        hasher=BlockHasher("sha256"), next_token=lambda req: 1)
    replayer.run(time.perf_counter())
    registry = CollectorRegistry()
    collector = KVPoolCollector().add_states(replayer.kv.states)
    registry.register(collector)
    got = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
           for s in f.samples if not s.name.endswith("_created")}
    # the junction case by hand (module docstring): 4 checkpoints, C's restore, B's 2,000 unused KV tokens;
    # instant timing holds one request slot; the checkpoints are unbounded (-1)
    assert got == {"kvpool_state_slots_used": 0, "kvpool_state_slots_capacity": 1,
                   "kvpool_state_checkpoints": 4, "kvpool_state_checkpoints_capacity": -1,
                   "kvpool_state_checkpoints_saved_total": 4,
                   "kvpool_state_checkpoint_hits_total": 1, "kvpool_state_checkpoints_evicted_total": 0,
                   "kvpool_kv_tokens_without_state_total": 2000}
    with pytest.raises(InvalidArgumentError, match="already"):
        collector.add_states(replayer.kv.states)


class InterleavedMachine(RuleBasedStateMachine):
    """Requests that branch off earlier ones, added at any time and stepped under a small token budget and a
    short pool (chunked prefill, decodes beside prefills, preemption): after every step the request slots
    are exactly the running requests', the shared pool holds those plus the checkpoints and the pending
    saves, at most ``capacity`` checkpoints, and every hit ends at a boundary where a state was saved."""

    @initialize(policy=st.sampled_from(["tail", "dense", "interval=3", "tail+junction"]),
                capacity=st.integers(1, 4), blocks=st.integers(10, 18))
    def setup(self, policy: str, capacity: int, blocks: int) -> None:
        pool = StatePool(4 + capacity)
        ckpt = StateCheckpoints(capacity, pool=pool)
        self.committed: set[object] = set()  # every key a checkpoint was ever stored under
        commit = ckpt.commit
        ckpt.commit = lambda key, slot: (self.committed.add(key), commit(key, slot))[1]  # type: ignore
        self.states = RequestStates(policy, 4, pool, checkpoints=ckpt)
        self.kv = KVCacheManager((KVCacheGroup(0, LayerKind.FULL, None, (0,), 1, 4),), blocks,
                                 hasher=BlockHasher("sha256"), states=self.states)
        self.sched = Scheduler(self.kv, max_num_batched_tokens=6, max_num_seqs=4)
        self.capacity, self.prompts, self.reqs = capacity, [list(range(12))], []

    @rule(parent=st.integers(0, 20), share=st.integers(0, 20), tail=st.integers(1, 10), out=st.integers(1, 6))
    def add(self, parent: int, share: int, tail: int, out: int) -> None:
        base = self.prompts[parent % len(self.prompts)]
        prompt = base[:share] + [60 + 7 * len(self.prompts) + i for i in range(tail)]
        req = Request(len(self.reqs), prompt, out)
        try:
            self.sched.add_request(req)
        except OutOfBlocksError:  # larger than the pool alone: refused, nothing changed
            return
        self.prompts.append(prompt)
        self.reqs.append(req)

    @rule(n=st.integers(1, 3))
    def step(self, n: int) -> None:
        for _ in range(n):
            if self.sched.has_unfinished():
                out = self.sched.schedule()
                self.sched.update(out, [5] * out.num_sampled)

    @invariant()
    def slots_add_up(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity()
        states, ckpt = self.states, self.states.checkpoints
        pending = sum(len(states.pending(r)) for r in self.sched.running)
        assert states.num_request_slots == len(self.sched.running)
        assert states.pool.num_used_slots == len(self.sched.running) + len(ckpt) + pending
        assert len(ckpt) + pending <= self.capacity
        for req in self.reqs:  # a hit ends where some request's state was saved, never elsewhere
            k = max(req.num_cached_tokens, 0) // 4
            assert k == 0 or req.block_hashes[k - 1] in self.committed


TestInterleavedMachine = InterleavedMachine.TestCase
TestInterleavedMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                          derandomize=True)

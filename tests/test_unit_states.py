"""Hits finer than a block for recurrent hybrids on the request path and the replay
(:mod:`kvpool.requests.unit_states`): unit checkpoints under the checkpoints' policy, pins, events and tiers.

The replay's oracle: with a state saved at every block and every unit boundary (``dense`` both) and no bound
on the checkpoints, every prefix a plain model can restore has its state, so a hybrid's hits (partial ones
included) equal the plain model's on the same trace (which tests/test_partial_hits.py checks against a brute
force over the units).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpool.events.publishers import QueueEventPublisher
from kvpool.events.sink import KVEventSink
from kvpool.events.wire import BlockRemoved, BlockStored
from kvpool.requests.checkpoint_store import StateCheckpoints, state_key, unit_key
from kvpool.requests.state_checkpoints import SavePolicy
from kvpool.requests.state_offload import CheckpointTiers
from kvpool.tiers.backend import Namespace
from kvpool.tiers.host import HostTier
from kvpool.trace.replay import ReplayConfig

QWEN3_NEXT = Path(__file__).parent / "configs" / "hybrid" / "qwen3-next-80b-a3b-instruct.json"


def _trace(seed: int, n: int = 120) -> list:
    from test_partial_hits import _random_trace

    return _random_trace(seed, n)


def _replay(requests: list, config: ReplayConfig, *, unit_save: str | None = None,
            tiers: list = ()) -> object:
    from kvpool.trace.replayer import Replayer

    replayer = Replayer(requests, config)
    if unit_save is not None:
        replayer.kv.partial.saves.policy = SavePolicy.parse(unit_save)
    if tiers:
        replayer.chain(list(tiers), write_through=False)
    return replayer.run(time.perf_counter())


def _hit_tokens(result: object) -> int:
    return result.hit_blocks * result.block_size + (result.partial_tokens or 0)


def _groups(block_size: int) -> tuple:
    from kvpool.spec.state import HybridSpec

    return HybridSpec.from_hf_config(QWEN3_NEXT, block_size=block_size).attention.groups


@pytest.mark.parametrize("seed", [1, 2])
def test_dense_unit_saves_hit_what_a_plain_model_hits(seed: int) -> None:
    requests = _trace(seed)
    plain = _replay(requests, ReplayConfig(block_size=64, match_unit=16))
    hybrid = _replay(requests, ReplayConfig(block_size=64, match_unit=16, groups=_groups(64),
                                            state_save="dense"), unit_save="dense")
    assert hybrid.partial_hits == plain.partial_hits > 0
    assert _hit_tokens(hybrid) == _hit_tokens(plain) and hybrid.kv_only_tokens == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_match_unit_adds_hits_to_a_hybrid(seed: int) -> None:
    """The default saves (``tail`` blocks, ``tail+junction`` units): a hybrid hits more with a match unit than
    without, and each partial hit copies its tokens once per KV cache group (one here: Qwen3-Next's
    attention layers)."""
    requests = _trace(seed)
    config = {"block_size": 64, "groups": _groups(64), "state_save": "tail"}
    whole = _replay(requests, ReplayConfig(**config))
    finer = _replay(requests, ReplayConfig(**config, match_unit=16))
    assert _hit_tokens(finer) > _hit_tokens(whole) and finer.partial_hits > 0
    assert finer.partial_copied_tokens == finer.partial_tokens * len(config["groups"])


def test_unit_checkpoints_go_down_to_a_tier_and_come_back() -> None:
    """Checkpoints for one prefill's saves over an unbounded host tier hit what unbounded checkpoints hit
    (every evicted checkpoint, unit ones included, stays below; the KV pool is unbounded: a partial hit's
    source block is looked up on the device only)."""
    requests = _trace(4, n=150)
    config = {"block_size": 64, "groups": _groups(64), "state_save": "dense", "match_unit": 16}
    oracle = _replay(requests, ReplayConfig(**config), unit_save="dense")
    most = max(r.input_tokens for r in requests) // 16 + 1  # every save one prefill plans (one per unit)
    bounded = ReplayConfig(**config, state_checkpoints=most)
    tiered = _replay(requests, bounded, unit_save="dense",
                     tiers=[HostTier(10**7, Namespace("t", "none", "hash-only"))])
    assert tiered.checkpoint_evictions > 0 and tiered.checkpoint_tier_hits > 0
    assert tiered.partial_tokens == oracle.partial_tokens > 0 and _hit_tokens(tiered) == _hit_tokens(oracle)


def test_a_unit_checkpoint_is_an_event_of_the_group_after_the_block_checkpoints() -> None:
    """Block checkpoints of a one-KV-group hybrid are group 1; unit checkpoints group 2, kind ``mamba`` too,
    their hashes the unit hashes; an evicted one is a ``BlockRemoved`` of group 2."""
    from kvpool.allocators.groups import split_group_key

    sink = KVEventSink(QueueEventPublisher(), block_size=16)
    sink.use_groups(split_group_key, {0: ("full_attention", None)})
    ckpt = StateCheckpoints(1)
    ckpt.attach_events(sink, 1)
    sink.describe_group(2, "mamba", None)  # what StatePartialHits does when it joins the states
    ckpt.commit(unit_key(31), ckpt.reserve())
    ckpt.commit(11, ckpt.reserve())  # evicts the unit checkpoint
    events = sink.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored]
    assert [(e.group_idx, e.block_hashes) for e in events] == [(2, [31]), (2, [31]), (1, [11])]
    assert events[0].kv_cache_spec_kind == events[2].kv_cache_spec_kind == "mamba"
    assert state_key(1, unit_key(31)) == (2, 31) and state_key(1, 31) == (1, 31)


def test_the_engine_manager_describes_the_unit_group() -> None:
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.allocators.state_pool import StatePool
    from kvpool.requests import KVCacheManager
    from kvpool.requests.state_checkpoints import RequestStates
    from kvpool.spec import KVCacheGroup

    sink = KVEventSink(QueueEventPublisher(), block_size=4)
    states = RequestStates("tail", 4, StatePool(2), checkpoints=StateCheckpoints(8))
    KVCacheManager([KVCacheGroup.full(4)], 32, hasher=BlockHasher("sha256", shared=True), states=states,
                   event_sink=sink, match_unit=2)
    assert sink._groups[1][0] == sink._groups[2][0] == "mamba"
    assert str(states.units.policy) == "tail+junction"


def test_a_pinned_block_checkpoint_outlives_unit_checkpoints() -> None:
    """Capacity 4: block checkpoint 1 pinned, then six unit checkpoints turn over the other three slots
    (least recently used first); a unit key can be pinned as a block hash is."""
    ckpt = StateCheckpoints(4)
    gone: list = []
    ckpt.on_evict = lambda key, slot: gone.append(key)
    ckpt.pin([1, unit_key(100)])
    ckpt.commit(1, ckpt.reserve())
    for h in range(100, 106):
        ckpt.commit(unit_key(h), ckpt.reserve())
    # unit 100 pinned (2 pins = half of 4); 101, 102 evicted by 104, 105... 3 slots: 1, u100 pinned + 2 more
    assert 1 in ckpt and unit_key(100) in ckpt and ckpt.num_pinned == 2
    assert gone == [unit_key(101), unit_key(102), unit_key(103)]
    ckpt.check_integrity()


def test_a_unit_checkpoint_tier_key_is_its_own_group() -> None:
    host = HostTier(8, Namespace("t", "none", "hash-only"))
    below = CheckpointTiers([host], 1)
    below.store(unit_key(5), 0)
    assert host.exists([(2, 5)]) == 1 and host.exists([(1, 5)]) == 0
    assert below.find(unit_key(5)) == (0, None) and below.find(5) is None


def test_a_unit_hit_whose_source_is_gone_falls_back_to_the_block_checkpoint() -> None:
    """Block 8, unit 2, block saves at the tail (48) and unit saves dense: SECOND (sharing 29 tokens of
    FIRST) hits 3 blocks + 2 units = 28 tokens from the unit checkpoint at unit 14. When the source block is
    gone by the time the hit is held (the index's lookup through the pool finds nothing then), the hit falls
    back to the last block checkpoint within it, none (0 tokens: its 3 KV blocks have no state), nothing
    copied, and every count stays consistent."""
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.allocators.state_pool import StatePool
    from kvpool.requests import KVCacheManager
    from kvpool.requests.request import Request
    from kvpool.requests.state_checkpoints import RequestStates
    from kvpool.spec import KVCacheGroup

    doc = [(7 * i + 3) % 251 for i in range(48)]
    first, second = doc, doc[:29] + list(range(150, 170))

    def manager() -> KVCacheManager:
        states = RequestStates("tail", 8, StatePool(2))
        kv = KVCacheManager([KVCacheGroup.full(8)], 64, hasher=BlockHasher(seed="unit-states-test-seed"),
                            states=states, match_unit=2)
        kv.partial.saves.policy = SavePolicy.parse("dense")
        req = Request("a", first, 1)
        kv.hash_blocks(req)
        assert kv.admit(req, 1000) == 48
        req.num_computed_tokens = 48
        kv.publish(req)
        kv.free(req)
        return kv

    def admit(kv: KVCacheManager) -> Request:
        req = Request("b", second, 1)
        kv.hash_blocks(req)
        assert kv.admit(req, 1000) is not None
        kv.check_integrity()
        return req

    kv = manager()
    assert admit(kv).num_computed_tokens == 28 and kv.partial.saves.restored == 1
    kv = manager()
    index, joint_lookup = kv.partial.index, kv.partial.lookup

    class GoneAtHold:  # the index as joint() sees it; at hold() (the pool's own lookup) the source is gone
        def longest(self, hashes, k, r, lookup):  # noqa: ANN001, ANN202
            return index.longest(hashes, k, r, lookup) if lookup is joint_lookup else (0, None)

        def __getattr__(self, name: str) -> object:
            return getattr(index, name)

    kv.partial.index = GoneAtHold()
    req = admit(kv)
    assert req.num_computed_tokens == 0 and kv.partial.saves.restored == 0
    assert kv.states.stats.restored == 0 and kv.partial.stats.hits == 0

"""A hybrid's state checkpoints under the coordinator's rules: the eviction policy, pins, admission, KV events
of their own group, and the tiers (a checkpoint the device evicts goes down and comes back).

The replay's oracle: every checkpoint and every KV block a bounded device lets go stays in an unbounded host
tier, so with a device big enough for the largest request alone and checkpoint slots for every save one
prefill plans (``interval=4``: a quarter of its blocks, plus one), a replay over the tier hits exactly the
tokens an unbounded device with unbounded checkpoints hits; without the checkpoints' tier (the KV tier
alone) it hits fewer, since the KV it restores lies past the last checkpoint still held.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpool.allocators.policies import FrequencyAdmission
from kvpool.events.publishers import QueueEventPublisher
from kvpool.events.sink import KVEventSink
from kvpool.events.wire import BlockRemoved, BlockStored
from kvpool.requests.state_checkpoints import NO_SLOT, StateCheckpoints
from kvpool.requests.state_offload import CheckpointTiers
from kvpool.tiers.backend import Namespace
from kvpool.tiers.host import HostTier

QWEN3_NEXT = Path(__file__).parent / "configs" / "hybrid" / "qwen3-next-80b-a3b-instruct.json"


def _commit(ckpt: StateCheckpoints, block_hash: int) -> None:
    ckpt.commit(block_hash, ckpt.reserve())


# ---- the replay: an unbounded host tier equals an unbounded device ------------------------------------

def _replay(requests: list, config: object, tiers: list, *, state_tiers: bool = True) -> object:
    from kvpool.trace.replayer import Replayer

    replayer = Replayer(requests, config)
    if tiers:
        replayer.chain(tiers, write_through=False)
    if not state_tiers:  # the control: the checkpoints keep no tier (the KV still does)
        replayer.kv.states.below = None
        replayer.kv.states.checkpoints.on_evict = None
    return replayer.run(time.perf_counter())


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_an_unbounded_host_tier_hits_as_an_unbounded_device_with_checkpoints(policy: str) -> None:
    from kvpool.spec.state import HybridSpec
    from kvpool.trace.loaders import load_trace
    from kvpool.trace.replay import ReplayConfig, request_blocks

    requests = load_trace(None, None, max_requests=200).requests
    groups = HybridSpec.from_hf_config(QWEN3_NEXT, block_size=16).attention.groups
    unbounded = ReplayConfig(block_size=16, groups=groups, state_save="interval=4", policy=policy)
    oracle = _replay(requests, unbounded, [])
    device = max(request_blocks(r, unbounded) for r in requests)  # the largest request alone
    bounded = ReplayConfig(block_size=16, groups=groups, state_save="interval=4", policy=policy,
                           num_blocks=device, state_checkpoints=device // 4 + 1)
    host = HostTier(10**7, Namespace("t", "none", "hash-only"))
    tiered = _replay(requests, bounded, [host])
    kv_only = _replay(requests, bounded, [HostTier(10**7, Namespace("t", "none", "hash-only"))],
                      state_tiers=False)
    assert oracle.evictions == 0 and oracle.checkpoint_evictions == 0 and tiered.requests_rejected == 0
    assert tiered.checkpoint_evictions > 0 and tiered.checkpoint_tier_hits > 0
    assert tiered.tier_hits["host"] > 0
    assert tiered.hit_blocks == oracle.hit_blocks > kv_only.hit_blocks
    assert tiered.token_hit_ratio == oracle.token_hit_ratio
    assert kv_only.checkpoint_tier_hits == 0 and kv_only.kv_only_tokens > tiered.kv_only_tokens


# ---- policy, pins, admission, events ----------------------------------------------------------------------

@pytest.mark.parametrize(("policy", "evicted"), [("lru", 2), ("arc", 2)])
def test_a_pinned_checkpoint_is_never_evicted(policy: str, evicted: int) -> None:
    # capacity 4: 1, 2, 3, 4 held, 1 pinned; touching 1 makes 2 the least recently used (lru) and the one
    # seen once before the others (arc's T1 tail after 1 moved to T2); two more saves evict 2 then 3, never 1
    ckpt = StateCheckpoints(4, policy=policy)
    gone: list[int] = []
    ckpt.on_evict = lambda h, slot: gone.append(h)
    for h in (1, 2, 3, 4):
        _commit(ckpt, h)
    ckpt.pin([1])
    ckpt.touch(1)
    _commit(ckpt, 5)
    _commit(ckpt, 6)
    assert gone[0] == evicted and 1 in ckpt and 1 not in gone and ckpt.num_pinned == 1
    ckpt.check_integrity()
    for h in (7, 8, 9):
        _commit(ckpt, h)
    assert 1 in ckpt  # still pinned: only the 3 others turn over
    assert ckpt.unpin_all() == 1
    for h in (10, 11, 12, 13):
        _commit(ckpt, h)
    assert 1 not in ckpt and 1 in gone
    ckpt.check_integrity()


def test_pins_take_at_most_half_the_checkpoints() -> None:
    ckpt = StateCheckpoints(4)
    ckpt.pin([1, 2, 3])
    for h in (1, 2, 3):
        _commit(ckpt, h)
    assert ckpt.num_pinned == 2  # 2 x 2 = 4: a third pin would pass half of 4
    for h in (4, 5, 6, 7):
        _commit(ckpt, h)
    assert 1 in ckpt and 2 in ckpt and 3 not in ckpt
    ckpt.check_integrity()


def test_every_slot_pinned_or_pending_skips_the_save() -> None:
    ckpt = StateCheckpoints(2)
    ckpt.pin([1])
    _commit(ckpt, 1)
    slot = ckpt.reserve()
    assert slot == NO_SLOT and ckpt.reserve() is None and ckpt.stats.skipped == 1
    ckpt.release(slot)


def test_admission_keeps_a_checkpoint_out_until_its_second_offer() -> None:
    ckpt = StateCheckpoints(4)
    ckpt.admission = FrequencyAdmission(2)
    _commit(ckpt, 7)
    assert 7 not in ckpt and ckpt.stats.not_admitted == 1
    _commit(ckpt, 7)
    assert 7 in ckpt and ckpt.stats.saved == 1


def test_checkpoints_are_events_of_their_own_group() -> None:
    """A hybrid with one KV cache group: a checkpoint stored is a ``BlockStored`` of group 1 (the state's,
    after the KV group 0), kind ``mamba``; an evicted one a ``BlockRemoved`` of group 1."""
    from kvpool.allocators.groups import split_group_key

    publisher = QueueEventPublisher()
    sink = KVEventSink(publisher, block_size=16)
    sink.use_groups(split_group_key, {0: ("full_attention", None)})
    ckpt = StateCheckpoints(1)
    ckpt.attach_events(sink, 1)
    _commit(ckpt, 11)
    _commit(ckpt, 12)  # evicts 11
    events = sink.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored]
    assert [e.block_hashes for e in events] == [[11], [11], [12]]
    assert {e.group_idx for e in events} == {1}
    assert events[0].kv_cache_spec_kind == "mamba" and events[0].token_ids == []


def test_the_manager_wires_group_events_admission_and_pins() -> None:
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.allocators.state_pool import StatePool
    from kvpool.requests import KVCacheManager
    from kvpool.requests.state_checkpoints import RequestStates
    from kvpool.spec import KVCacheGroup, LayerKind

    sink = KVEventSink(QueueEventPublisher(), block_size=4)
    groups = (KVCacheGroup(0, LayerKind.FULL, None, (0,), 1, 4),
              KVCacheGroup(1, LayerKind.SLIDING, 8, (1,), 1, 4))
    states = RequestStates("dense", 4, StatePool(2), checkpoints=StateCheckpoints(8))
    kv = KVCacheManager(groups, 100, hasher=BlockHasher("sha256", shared=True), states=states,
                        event_sink=sink, admission=FrequencyAdmission(3))
    assert states.checkpoints.group == 2 and states.checkpoints.sink is sink
    admission = states.checkpoints.admission
    assert admission.min_count == 3 and admission is not kv.pool.admission
    kv.pin_when_cached([b"p" * 16])
    for _ in range(3):  # the third offer is admitted
        _commit(states.checkpoints, b"p" * 16)
    assert states.checkpoints.stats.not_admitted == 2 and states.checkpoints.num_pinned == 1
    assert [e.group_idx for e in sink.take_events()] == [2]
    kv.unpin_all()
    assert states.checkpoints.num_pinned == 0


# ---- tiers: stores, finds, faults -------------------------------------------------------------------------

class _FaultyTier(HostTier):
    """A host tier that holds its keys but gives none back intact (a fault below)."""

    def get(self, keys, out):  # noqa: ANN001, ANN201
        return 0


def test_a_checkpoint_goes_down_on_eviction_and_a_fault_is_a_miss() -> None:
    space = Namespace("t", "none", "hash-only")
    faulty, good = _FaultyTier(8, space), HostTier(8, space)
    below = CheckpointTiers([faulty, good], 1)
    ckpt = StateCheckpoints(1)
    ckpt.on_evict = below.store
    _commit(ckpt, 21)
    _commit(ckpt, 22)  # evicts 21 into both tiers
    assert below.stored == 1 and faulty.exists([(1, 21)]) == 1 and good.exists([(1, 21)]) == 1
    assert below.find(21) == (1, None)  # the faulty tier holds it but fails: the next one gives it
    assert below.load_failures == 1
    assert below.find(22) is None  # never evicted: not below
    only_faulty = CheckpointTiers([faulty], 1)
    assert only_faulty.find(21) is None and only_faulty.load_failures == 1


def test_tiers_of_another_row_size_are_refused() -> None:
    from kvpool.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="0 B rows, a state checkpoint is 64 B"):
        CheckpointTiers([HostTier(4, Namespace("t", "none", "x"))], 1, rows=_Rows(64))
    with pytest.raises(InvalidArgumentError, match="group"):
        CheckpointTiers([], 0)


class _Rows:
    def __init__(self, n: int) -> None:
        self.bytes_per_slot = n


def test_state_rows_round_trip_through_a_host_rows_tier() -> None:
    """Slot 2's conv and SSM states read as one row, stored in a HostRowsTier, read back into slot 0 equal
    slot 2 in every layer; a row of another size is refused."""
    import torch

    from kvpool.errors import InvalidArgumentError
    from kvpool.spec.state import RecurrentKind, RecurrentStateSpec
    from kvpool.storage.state import RecurrentStateCache
    from kvpool.tiers.host_rows import HostRowsTier

    spec = RecurrentStateSpec(RecurrentKind.MAMBA2, (0, 2, 5), (6, 3), (2, 4, 5), "bfloat16", "float32")
    cache = RecurrentStateCache(spec, 4)
    gen = torch.Generator().manual_seed(0)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
    cache.ssm.copy_(torch.randn(cache.ssm.shape, generator=gen))
    # 3 layers x (6 x 3 x 2 B conv + 2 x 4 x 5 x 4 B SSM) = 3 x (36 + 160) = 588 B a slot
    assert cache.bytes_per_slot == 588 == spec.bytes_per_request
    tier = HostRowsTier(2, Namespace("t", "bf16", "rows", layer_group=1), 588)
    assert tier.set([(1, 5)], cache.read_slots([2])) == 1
    out = torch.empty((1, 588), dtype=torch.uint8)
    assert tier.get([(1, 5)], out) == 1
    cache.write_slots([0], out)
    assert torch.equal(cache.conv[:, 0], cache.conv[:, 2]) and torch.equal(cache.ssm[:, 0], cache.ssm[:, 2])
    assert not torch.equal(cache.conv[:, 1], cache.conv[:, 2])
    with pytest.raises(InvalidArgumentError, match="uint8"):
        cache.write_slots([0], out[:, :100])
    tier.check_integrity()

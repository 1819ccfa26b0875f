"""KV events of multi-group models, with and without tiers: a router that rebuilds each pool's prefix index
from the event stream after every engine step (a set of (group, hash) per medium) has exactly what the
device pool and the host tier's pool hold, and every ``BlockStored`` names its blocks' own group, that
group's kind and window, and (on the device) its chain: each hash's parent is the block before it in the
request that computed it.

The device pool and the host tier's pool both publish blocks of several groups in one ``cache_blocks``
call (a restore from the tiers, a batch of evicted blocks going down), so a sink that took the group of a
call's first block would name the wrong group for the others."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

# the feature matrix's prompts: a shared 40-token document that unrelated prompts push out of a small pool
from _matrix_helpers import BLOCK, NEW, PROMPTS  # noqa: E402

from kvpool.allocators.groups import split_group_key  # noqa: E402
from kvpool.allocators.hashing import BlockHasher  # noqa: E402
from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import TINY_MODELS, kv_spec, load_model  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.events import SPEC_KINDS, AllBlocksCleared, BlockRemoved, BlockStored, QueueEventPublisher  # noqa: E402
from kvpool.spec import LayerKind  # noqa: E402

#: Every tiny model with more than one KV cache group (checked against the models' own specs below).
MULTI_GROUP = ("tiny-gemma2", "tiny-gemma3", "tiny-gpt-oss", "tiny-gemma4", "tiny-mimo", "tiny-llama4")
TIERS = ("none", "host", "host+disk")
STEP_TOKENS = 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_multi_group_models_are_every_tiny_model_with_several_groups() -> None:
    several = {name for name in TINY_MODELS
               if len(kv_spec(load_model(name).model, block_size=BLOCK).groups) > 1}
    assert several == set(MULTI_GROUP)


def _device_blocks(groups) -> int:
    """The largest prompt (51 + 6 - 1 = 56 tokens written, in chunks of 8) alone, and a few blocks more:
    two prompts do not fit, so the shared prefix leaves the device between its uses."""
    need = sum(g.max_blocks(56, STEP_TOKENS) for g in groups)
    return need + 1 + len(groups)  # the null block, one spare block per group


class Router:
    """What a KV-aware router keeps: the (group, hash) pairs each medium holds, from the events alone."""

    def __init__(self, groups) -> None:
        self.index: dict[str, set] = {"GPU": set(), "CPU": set()}
        self.kinds = {g.index: (SPEC_KINDS[g.kind.value], g.window if g.kind is LayerKind.SLIDING else None)
                      for g in groups}

    def apply(self, events, parents: dict) -> None:
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.index["GPU"].clear()
                continue
            pairs = {(e.group_idx, h) for h in e.block_hashes}
            if isinstance(e, BlockRemoved):
                self.index[e.medium] -= pairs
                continue
            assert isinstance(e, BlockStored)
            assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == self.kinds[e.group_idx]
            if e.medium == "GPU":  # a device run is a piece of one request's chain
                chain = [e.parent_block_hash, *e.block_hashes]
                assert all(parents[h] == p for p, h in zip(chain, chain[1:], strict=False)), \
                    _short(e, parents)
            else:  # the host tier's blocks went down together, not as a chain
                assert e.parent_block_hash is None
            self.index[e.medium] |= pairs


def _short(e: BlockStored, parents: dict) -> tuple:
    """An event's group, parent and hashes, and each hash's true parent (6 hex digits each)."""
    def x(h):
        return None if h is None else h.hex()[:6]

    hashes = e.block_hashes
    return e.group_idx, x(e.parent_block_hash), [x(h) for h in hashes], [x(parents[h]) for h in hashes]


def _index(pool) -> set:
    raw = getattr(pool, "pool", pool)
    return {split_group_key(h) for h in (raw.block_hash(b) for b in range(raw.num_blocks)) if h is not None}


@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("name", MULTI_GROUP)
def test_an_index_rebuilt_from_the_events_every_step_equals_the_pools(name: str, tiers: str,
                                                                       tmp_path: Path) -> None:
    model = load_model(name, seed=3).model
    groups = kv_spec(model, block_size=BLOCK).groups
    publisher = QueueEventPublisher(100_000)
    engine = LLMEngine(model, num_blocks=_device_blocks(groups), block_size=BLOCK,
                       max_num_batched_tokens=STEP_TOKENS, hasher=BlockHasher("sha256", shared=True),
                       kv_events=publisher)
    g = len(groups)  # room below for the shared prefix in every group (10 blocks each)
    urls = ([f"host://?blocks={12 * g}"] if "host" in tiers else []) + (
        [f"file://{tmp_path}/disk?blocks={20 * g}"] if "disk" in tiers else [])
    offload = engine.enable_offload(urls, auth_key="kvpool tests: a tier key of 16+ bytes") if urls else None
    router, parents, steps = Router(groups), {}, 0
    params = SamplingParams(max_new_tokens=NEW)
    # one by one (the unrelated prompts push the shared one down), then all at once (preemption)
    for batch in [[p] for p in PROMPTS] + [PROMPTS]:
        for prompt in batch:
            engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
            steps += 1
            for req in engine.requests.values():  # each hash's parent: the hash before it
                chain = [None, *req.block_hashes]
                parents.update(zip(chain[1:], chain, strict=False))
            router.apply([e for b in publisher.drain() for e in b.events], parents)
            assert router.index["GPU"] == _index(engine.pool), f"step {steps}"
            if offload is not None and offload.host is not None:
                assert router.index["CPU"] == _index(offload.host.pool), f"step {steps}"
    if offload is not None:
        hosts = router.index["CPU"]
        assert hosts and len({g for g, _ in hosts}) == len(groups)  # every group went down to the host
        assert sum(n for where, n in offload.tier_hits().items() if where != "device") > 0  # and came back
        offload.close()
    engine.kv.check_integrity()

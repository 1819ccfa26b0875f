"""The reference engine with lower tiers: a device pool too small to keep the shared prefixes finds them in
the host, disk and Redis tiers and the greedy tokens (and logits) stay those of transformers' own generate
(no kvpool code); a Redis killed mid-run changes no token; the pools are all free at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("redis")

from kvpool.allocators.hashing import BlockHasher  # noqa: E402
from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.errors import ConfigError  # noqa: E402
from kvpool.tiers.auth import TierKey  # noqa: E402
from kvpool.tiers.backend import HEADER_BYTES, Namespace, weights_fingerprint  # noqa: E402
from kvpool.tiers.file import FileTier  # noqa: E402
from kvpool.tiers.host import HostTier  # noqa: E402
from kvpool.tiers.redis import RedisTier  # noqa: E402

KEY = TierKey("kvpool tests: a tier key of 16+ bytes")  # the fleet secret of these tests
BLOCK = 4
NEW = 6
SHARED = list(range(30, 70))  # 40 tokens: 10 full blocks shared by two prompts
PROMPTS = [
    SHARED + [1, 2, 3],
    [200 - i for i in range(51)],  # unrelated: (51 + 6 - 1) / 4 = 14 blocks, the whole device
    SHARED + [9, 8, 7, 6, 5],
    [150 + i % 40 for i in range(51)],
    SHARED[:33] + [4],  # a shorter prefix of the shared document
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny() -> tuple:
    model = load_model("tiny-llama", seed=2).model
    return model, [reference_greedy(model, p, NEW) for p in PROMPTS]


def engine_with(model, tiers_of, *, num_blocks: int = 14, write_through: bool = False,
                asynchronous: bool = True) -> LLMEngine:
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=BLOCK, keep_logits=True,
                       hasher=BlockHasher("sha256", shared=True))
    engine.enable_offload(tiers_of(engine.cache), write_through=write_through, asynchronous=asynchronous)
    return engine


def run_one_by_one(engine: LLMEngine, refs: list) -> None:
    """Each prompt alone (so the unrelated ones evict the shared prefix in between), checked against
    transformers' tokens and logits; the pools whole afterwards."""
    for prompt, (tokens, logits) in zip(PROMPTS, refs, strict=True):
        (req,) = engine.generate([prompt], SamplingParams(max_new_tokens=NEW))
        assert req.output_token_ids == tokens
        torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-4, rtol=0)
    engine.offload.synchronize()
    assert engine.pool.num_used_blocks == 0
    engine.offload.check_integrity()


def namespace(cache, model, tag: str) -> Namespace:
    return Namespace.for_cache(cache, model=f"tiny-llama:{weights_fingerprint(model.parameters())}:{tag}",
                               hash_scheme="sha256")


def test_the_device_alone_loses_the_shared_prefix(tiny) -> None:
    model, refs = tiny
    engine = LLMEngine(model, num_blocks=14, block_size=BLOCK, keep_logits=True)
    for prompt, (tokens, _) in zip(PROMPTS, refs, strict=True):
        assert engine.generate([prompt], SamplingParams(max_new_tokens=NEW))[0].output_token_ids == tokens
    assert engine.stats.prefix_hit_tokens == 0  # what the tiers below are for


@pytest.mark.parametrize("write_through", [False, True], ids=["evict", "write-through"])
def test_host_tier_hits_keep_the_tokens(tiny, write_through: bool) -> None:
    model, refs = tiny
    engine = engine_with(model, lambda c: [HostTier(64, namespace(c, model, "h"), like=c)],
                         write_through=write_through)
    run_one_by_one(engine, refs)
    hits = engine.offload.tier_hits()
    # prompt 3 finds the 10 shared blocks, prompt 5 its 8 (33 tokens): 18 blocks, all on the host
    assert hits == {"device": 0, "host": 18} and engine.stats.prefix_hit_tokens == 18 * BLOCK


@pytest.mark.parametrize("asynchronous", [False, True], ids=["inline", "worker"])
def test_host_disk_and_redis_all_serve_hits(tiny, tmp_path: Path, redis_single, asynchronous: bool) -> None:
    model, refs = tiny

    def tiers(cache):
        ns = namespace(cache, model, f"chain-{asynchronous}")
        bpb = cache.bytes_per_block
        return [HostTier(3, ns, like=cache),
                FileTier(tmp_path, ns, capacity_bytes=12 * (HEADER_BYTES + bpb), block_bytes=bpb,
                         auth_key=KEY),
                RedisTier(redis_single.url, ns, block_bytes=bpb, auth_key=KEY)]

    engine = engine_with(model, tiers, asynchronous=asynchronous)
    run_one_by_one(engine, refs)
    hits = engine.offload.tier_hits()
    assert sum(hits.values()) == 18  # nothing lost: the remote tier is unbounded
    if not asynchronous:  # where each block is found depends on the worker's timing otherwise
        assert hits["host"] and hits["disk"] and hits["remote"]
    engine.offload.close()


def test_redis_killed_mid_run_changes_no_token(tiny, tmp_path: Path) -> None:
    from redis_servers import redis_server

    model, refs = tiny
    with redis_server(tmp_path) as server:
        engine = engine_with(model, lambda c: [RedisTier(server.url, namespace(c, model, "killed"),
                                                         block_bytes=c.bytes_per_block, retry_s=0.05,
                                                         auth_key=KEY)],
                             write_through=True)
        for i, (prompt, (tokens, _)) in enumerate(zip(PROMPTS, refs, strict=True)):
            if i == 2:
                server.stop()  # the shared prefix was stored there; now every call fails
            assert engine.generate([prompt], SamplingParams(max_new_tokens=NEW))[0].output_token_ids == tokens
        engine.offload.synchronize()
        stats = engine.offload.stats()["remote"]
        assert stats["hits"] == 0 and stats["store_failures"] > 0 and stats["errors"] > 0
        assert engine.pool.num_used_blocks == 0


def test_byte_tiers_need_a_shared_hasher(tiny, tmp_path: Path) -> None:
    model, _ = tiny
    engine = LLMEngine(model, num_blocks=14, block_size=BLOCK)  # process-local hasher: a random root
    ns = namespace(engine.cache, model, "local")
    with pytest.raises(ConfigError, match="shared hasher"):
        engine.enable_offload([FileTier(tmp_path, ns, capacity_bytes=10**6,
                                        block_bytes=engine.cache.bytes_per_block, auth_key=KEY)])
    engine.enable_offload([HostTier(8, ns, like=engine.cache)])  # the host tier never leaves the process
    with pytest.raises(ConfigError, match="already"):
        engine.enable_offload([])


def test_kv_events_need_a_shared_hasher(tiny) -> None:
    """The events carry the hashes out of the process like a disk tier does (issue 30: the engine took a
    process-local hasher with events, and refused one only under a disk or Redis tier); without a hasher
    the engine takes a shared one."""
    from kvpool.events import QueueEventPublisher

    model, _ = tiny
    with pytest.raises(ConfigError, match="KV events carry block hashes"):
        LLMEngine(model, num_blocks=14, block_size=BLOCK, hasher=BlockHasher(),
                  kv_events=QueueEventPublisher())
    assert LLMEngine(model, num_blocks=14, block_size=BLOCK, kv_events=QueueEventPublisher()).hasher.shared

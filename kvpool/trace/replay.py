"""``run_replay``: a serving trace through the request path, and the all-full comparison of a hybrid model.

The simulation (timing modes, the step-time model, eviction) is :mod:`kvpool.trace.replayer`, on the same
scheduler and KV cache manager as the engine, for a model of any KV cache groups, with any policy, pins and
tiers; :func:`compare_all_full` sets a hybrid model's run beside the same trace with every layer full
attention. The names callers use from the replayer are re-exported here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.allocators.block_pool import BlockPool
from kvpool.errors import ConfigError
from kvpool.spec import KVCacheSpec
from kvpool.trace.loaders import TraceRequest, sub_blocks_per_hash_block
from kvpool.trace.replayer import (
    HIT_RATIO_BASIS,
    REPLAY_POLICIES,
    TIMINGS,
    ReplayConfig,
    Replayer,
    ReplayResult,
    admission_order,
    request_blocks,
    unbounded_num_blocks,
)

if TYPE_CHECKING:
    from kvpool.events.sink import KVEventSink
    from kvpool.tiers.backend import TierBackend

__all__ = ["HIT_RATIO_BASIS", "REPLAY_POLICIES", "TIMINGS", "ReplayConfig", "ReplayResult", "admission_order",
           "compare_all_full", "request_blocks", "run_replay", "unbounded_num_blocks"]


def run_replay(requests: Sequence[TraceRequest], config: ReplayConfig = ReplayConfig(), *,
                pool: BlockPool | None = None, progress: Callable[[int], object] | None = None,
                record_timeline: bool = False, event_sink: KVEventSink | None = None,
                observer: Callable[[float, BlockPool], object] | None = None,
                tiers: Sequence[TierBackend] = (), write_through: bool = False, tier_admission: int | str = 1
                ) -> ReplayResult:
    """Replay ``requests`` through ``pool`` (default: a fresh :class:`BlockPool` of ``config.num_blocks``
    with ``config.policy``, recording KV events into ``event_sink``) and return what it measured. The
    pool's event sink, if any, is flushed once per simulated step (the events carry the trace's hash ids
    and no token ids; a hybrid model's events name their group).

    ``pool`` must be all free, with ``config.policy`` (``belady``: a :class:`BeladyPolicy` over this
    replay's future, see :func:`admission_order`), the null block reserved exactly when a group of
    ``config.groups`` has a window and, when ``config.num_blocks`` is set, of that size.
    ``progress(n)`` is called as n more requests finish or are rejected; ``observer(t, pool)`` whenever the
    timeline would take a sample (every event in ``instant`` timing, about
    :data:`~kvpool.trace.replayer.TIMELINE_POINTS` times in ``trace`` timing). At the end every block is
    free and ``check_integrity()`` has passed. Raises :class:`ConfigError` for a block size that does not
    divide 512 on a trace with hash ids, or a pool that does not fit those rules.

    ``tiers``: hash-only tiers (``block_bytes=0``; a host tier first, then disk, remote) chained under the
    pool by an :class:`~kvpool.tiers.manager.OffloadManager` (inline, so the run is deterministic; evicted
    blocks go down, or every published block with ``write_through``), keyed by group and hash; a prefix
    found below is "loaded" into new device blocks for every group its hit needs. No KV moves, only hashes.
    The manager detaches at the end (the tiers stay open). ``tier_admission`` K > 1: a block goes down
    only once it has been offered K times (a :class:`~kvpool.allocators.policies.FrequencyAdmission` in
    the manager); ``"valued"``: only the blocks the pool's eviction policy values
    (:class:`~kvpool.allocators.policies.ValuedAdmission`); 1 stores every block.
    """
    if any(r.hash_ids is not None for r in requests):
        sub_blocks_per_hash_block(config.block_size)
    if pool is not None and (pool.num_used_blocks or config.num_blocks not in (None, pool.num_blocks)
                             or pool.policy.name != config.policy):
        raise ConfigError(f"replay needs an all-free pool of config.num_blocks blocks with policy "
                          f"{config.policy!r}, got {pool!r}")
    start = time.perf_counter()
    if pool is not None and event_sink is not None:
        raise ConfigError("give the event sink to your pool (BlockPool(..., event_sink=...)), not to both")
    replayer = Replayer(requests, config, pool=pool, progress=progress, record_timeline=record_timeline,
                        event_sink=event_sink, observer=observer)
    if tiers:
        replayer.chain(tiers, write_through, tier_admission)
    return replayer.run(start)


def compare_all_full(requests: Sequence[TraceRequest], config: ReplayConfig, spec: KVCacheSpec,
                     available_bytes: int, result: ReplayResult) -> dict[str, Any]:
    """``result`` (a replay of ``config``, per group) in bytes, and the same requests replayed on the same
    ``available_bytes`` with every layer full attention: one plain pool of ``available_bytes //
    (bytes_per_token x B)`` blocks. The all-full hit ratios share ``result``'s denominator (every request,
    a rejected one's prompt as misses). ``mean_memory_saving = 1 - mean bytes / all-full mean bytes`` over
    the same requests: when the two pools reject different requests, both are replayed again (without
    tiers) on the ``memory_compared_requests`` that both serve, so a request one pool rejects never lowers
    its memory."""
    full_block = spec.bytes_per_token * spec.block_size
    full_config = dataclasses.replace(config, groups=(), num_blocks=max(1, available_bytes // full_block))
    full = run_replay(requests, full_config)
    both = [r for r in requests if request_blocks(r, config) <= result.num_blocks
            and request_blocks(r, full_config) <= full.num_blocks]
    mine, theirs = result, full
    if len(both) < len(requests):
        mine = run_replay(both, dataclasses.replace(config, num_blocks=result.num_blocks))
        theirs = run_replay(both, full_config)
    mean, full_mean = mine.mean_blocks_used * spec.bytes_per_block, theirs.mean_blocks_used * full_block
    return {
        "kv_cache_groups": len(spec.groups), "bytes_per_block": spec.bytes_per_block,
        "peak_bytes_used": result.peak_blocks_used * spec.bytes_per_block,
        "mean_bytes_used": round(result.mean_blocks_used * spec.bytes_per_block),
        "mean_memory_saving": 1 - mean / full_mean if full_mean else 0.0,
        "memory_compared_requests": len(both),
        "all_full": {"num_blocks": full.num_blocks, "bytes_per_block": full_block,
                     "block_hit_ratio": full.block_hit_ratio, "token_hit_ratio": full.token_hit_ratio,
                     "requests_rejected": full.requests_rejected, "preemptions": full.preemptions,
                     "peak_blocks_used": full.peak_blocks_used, "mean_blocks_used": full.mean_blocks_used,
                     "peak_bytes_used": full.peak_blocks_used * full_block,
                     "mean_bytes_used": round(full.mean_blocks_used * full_block)},
    }

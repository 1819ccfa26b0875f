"""What a replay measured (:class:`ReplayResult`), and the parts of it read off the KV cache manager at the
end: the recurrent state's counters (:func:`state_report`) and the hits by place with the tiers' stats
(:func:`tier_report`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.trace.elastic_track import MemorySample

if TYPE_CHECKING:
    from kvpool.requests.kv_manager import KVCacheManager
    from kvpool.requests.no_state import StateSide

#: One timeline sample: (simulated seconds, blocks in use, cached free blocks, uncached free blocks).
Sample = tuple[float, int, int, int]
#: What a replay's hit ratios are over, printed beside them: pools of any size share the denominator.
HIT_RATIO_BASIS = "every request of the trace: a rejected request's prompt blocks count as misses"


@dataclass(frozen=True)
class ReplayResult:
    """What a replay measured. Blocks are ``block_size``-token blocks of one KV cache group; ratios are in
    [0, 1].

    ``prompt_blocks`` counts the full prompt blocks of every request of the trace, admitted or rejected,
    and ``hit_blocks`` those found cached at a request's first admission (at most the full blocks of its
    first ``input - 1`` tokens: the engine always computes the last prompt token); ``token_hit_ratio =
    (hit_blocks * block_size + partial_tokens) / prompt tokens`` (every request's). So the ratios of replays
    of one trace on pools of any size share one denominator: a rejected request's prompt counts as misses
    (:data:`HIT_RATIO_BASIS`), ``rejected_prompt_blocks`` of them (``requests_rejected`` requests).
    ``peak_blocks_used`` and ``mean_blocks_used`` (time-weighted over the simulated run) count blocks with
    a reference, over every group. ``block_ops`` counts block ids and hashes handled by pool calls (hashes
    a lookup examined, blocks touched, allocated, published and freed); ``block_ops_per_s = block_ops /
    wall_s``, ``wall_s`` the replay's own wall time. ``timeline`` (only when recorded) holds :data:`Sample`
    rows; ``policy`` is the eviction policy's name; ``pinned_blocks`` the blocks of ``config.pin_prefix``
    that were pinned (0 if it never was all cached).

    ``tier_hits`` splits ``hit_blocks`` by where they were found (``device``, then each tier's medium:
    ``host``, ``disk``, ``remote``); ``tiers`` holds the :meth:`OffloadManager.stats` of the run, and
    ``block_ops`` includes the block operations of the manager and of the host tier's pool. Without tiers
    ``tier_hits`` is ``{"device": hit_blocks}``.

    With ``config.state_save`` (a recurrent hybrid): ``state_slots_peak``, the most requests holding a state
    slot at once; ``checkpoints_saved`` (stored over the run), ``checkpoints_peak`` (held at once),
    ``checkpoint_hits`` (admissions restored from one; ``checkpoint_tier_hits`` of them from a tier),
    ``checkpoint_evictions``; ``kv_only_tokens``, at
    first admissions, the tokens whose KV every group had cached but that lay past the last checkpoint (not
    reused: ``hit_blocks`` excludes them). All 0 (``state_save`` None) otherwise.

    With ``config.elastic_block_bytes`` (a model of an elastic pool): ``peak_committed_bytes`` (the most its
    pages held, taken each step), ``final_committed_bytes`` (at the end: the cached blocks' pages),
    ``trimmed_committed_bytes`` (after evicting the cached blocks and giving their pages back),
    ``blocks_moved`` and ``compaction_s`` (the blocks its compactions moved and the wall seconds spent in
    them: ``config.elastic_compact``), and with a timeline ``memory_timeline``
    (:data:`~kvpool.trace.elastic_track.MemorySample` rows). All 0 otherwise.
    With ``config.match_unit``, the first admissions' partial hits (``partial_hits``), their hit
    tokens past the full blocks (``partial_tokens``) and the blocks and token slots copied.

    ``cache``: :meth:`ReplaySessions.end` (``usage``: the cached-token sums of the admitted requests by
    tier, ``sessions``: the session counters under ``config.sessions``).
    ``state_budget`` (with ``config.state_budget``, else None): :meth:`StateBudget.report`; the blocks it
    holds for state slots are not in ``peak_blocks_used`` / ``mean_blocks_used``.

    ``prefill_tokens_p50`` / ``_p90`` / ``_p95`` / ``_p99``: the tokens each admitted request computed at
    its first admission (its prompt less the tokens read from the cache, any tier), nearest-rank
    percentiles over the admitted requests (:func:`prefill_percentiles`; 0 when none was admitted). Prefill
    time grows with them, so their tail is the tail time-to-first-token a policy leaves (the metric
    Tail-Optimized LRU, ``tlru``, is designed for: arXiv 2510.15152 reports P90 and P95 TTFT).
    """

    requests_completed: int
    requests_rejected: int
    prompt_blocks: int
    hit_blocks: int
    block_hit_ratio: float
    token_hit_ratio: float
    peak_blocks_used: int
    mean_blocks_used: float
    preemptions: int
    block_ops: int
    block_ops_per_s: float
    wall_s: float
    evictions: int
    simulated_s: float
    num_blocks: int
    block_size: int
    timing: str
    policy: str = "lru"
    pinned_blocks: int = 0
    rejected_prompt_blocks: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, Any] = field(default_factory=dict)
    timeline: list[Sample] = field(default_factory=list, repr=False)
    state_save: str | None = None
    state_slots_peak: int = 0
    checkpoints_saved: int = 0
    checkpoints_peak: int = 0
    checkpoint_hits: int = 0
    checkpoint_evictions: int = 0
    checkpoint_tier_hits: int = 0
    kv_only_tokens: int = 0
    peak_committed_bytes: int = 0
    final_committed_bytes: int = 0
    trimmed_committed_bytes: int = 0
    blocks_moved: int = 0
    compaction_s: float = 0.0
    match_unit: int | None = None
    partial_hits: int = 0
    partial_tokens: int = 0
    partial_copied_blocks: int = 0
    partial_copied_tokens: int = 0
    cache: dict[str, Any] = field(default_factory=dict)
    memory_timeline: list[MemorySample] = field(default_factory=list, repr=False)
    state_budget: dict[str, Any] | None = None
    prefill_tokens_p50: int = 0
    prefill_tokens_p90: int = 0
    prefill_tokens_p95: int = 0
    prefill_tokens_p99: int = 0

    def to_dict(self) -> dict[str, object]:
        """Every field but the timelines, JSON-ready."""
        out = asdict(self)
        del out["timeline"], out["memory_timeline"]
        return out



def state_report(states: StateSide, state_save: str | None) -> dict[str, Any]:
    """The :class:`ReplayResult` fields of a recurrent hybrid's state slots and checkpoints (``{}`` for
    :data:`~kvpool.requests.no_state.NO_STATE`): ``states.replay_fields``."""
    return states.replay_fields(state_save)


def tier_report(kv: KVCacheManager) -> tuple[dict[str, int], dict[str, Any]]:
    """(hits by place at first admissions, the tier manager's stats); checks every tier."""
    places = kv.hits_by_place(first_admissions=True)
    if kv.tiers is None:
        return places, {}
    kv.tiers.synchronize()
    return places, kv.tiers.stats()


#: The percentiles of the tokens prefilled per request a replay reports (``prefill_tokens_p<q>``).
PREFILL_PERCENTILES = (50, 90, 95, 99)


def prefill_percentiles(computed: Sequence[int]) -> dict[str, int]:
    """``{"prefill_tokens_p<q>": value}`` for each q of :data:`PREFILL_PERCENTILES`: the nearest-rank
    percentile of ``computed`` (the smallest value that at least q% of the values do not exceed; all 0
    when ``computed`` is empty). O(n log n)."""
    ordered = sorted(computed)
    n = len(ordered)
    return {f"prefill_tokens_p{q}": ordered[max(0, math.ceil(q * n / 100) - 1)] if n else 0
            for q in PREFILL_PERCENTILES}


def ratio(num: float, den: float) -> float:
    """``num / den``, 0 for a zero denominator."""
    return num / den if den else 0.0

"""A sweep: the same trace replayed for each pool size and eviction policy, and its hit-ratio table.

``run_sweep`` runs :func:`kvpool.trace.replay.run_replay` once per (pool size, policy), each on a fresh
pool, optionally recording each run's timeline and a :class:`~kvpool.trace.report.PoolHeatmap`;
``hit_ratio_table`` arranges the block hit ratios by policy and size, ``rejected_table`` the requests
each run rejected (their prompts count as misses, so every run's ratio is over the same requests),
``result_table`` any other field of the runs' results.
``belady`` (the offline bound) is a policy like the others here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvpool.trace.loaders import TraceRequest
from kvpool.trace.replay import ReplayConfig, run_replay
from kvpool.trace.report import PoolHeatmap, SweepRun

if TYPE_CHECKING:
    from kvpool.events.sink import KVEventSink
    from kvpool.tiers.backend import TierBackend


def run_sweep(requests: Sequence[TraceRequest], config: ReplayConfig, sizes: Sequence[int | None],
              policies: Sequence[str], *, record: bool = False,
              progress: Callable[[int], object] | None = None, event_sink: KVEventSink | None = None,
              tiers: Callable[[], Sequence[TierBackend]] | None = None, write_through: bool = False,
              tier_admission: int | str = 1, on_run: Callable[[SweepRun, int, int], object] | None = None,
              sessions: Sequence[str | None] | None = None) -> list[SweepRun]:
    """Replay ``requests`` with ``config`` for every pool size in ``sizes`` (None: unbounded) and policy in
    ``policies``, sizes outermost, in the given orders. ``record`` keeps each run's timeline and heat map
    (for :func:`kvpool.trace.report.write_report`); ``event_sink`` records every run's KV events (give it
    to a single run). ``tiers``: a factory of fresh (hash-only) tiers for each run, chained under its pool
    (:func:`run_replay`'s ``tiers``, ``write_through`` and ``tier_admission``); they are emptied and
    closed after the run. ``on_run(run, i, n)`` is called as run ``i`` of ``n`` (from 1) finishes.
    ``sessions``: session policies (``session``, ``last=N``, None: no sessions), innermost, each policy run
    once per mode (a row ``lru+last=1``: :attr:`SweepRun.policy`) but the offline bound, run once without
    sessions; None (default): ``config.sessions`` for every run.
    Raises :class:`~kvpool.errors.ConfigError` as :class:`ReplayConfig` and :func:`run_replay` do, before
    the first run for a bad name or size."""
    modes = [config.sessions] if sessions is None else list(sessions)
    configs = [replace(config, num_blocks=size, policy=policy, sessions=mode) for size in sizes
               for policy in policies
               for mode in (modes if policy != "belady" or sessions is None else [None])]
    runs = []
    for cfg in configs:
        heatmap = PoolHeatmap() if record else None
        chain = tiers() if tiers is not None else ()
        try:
            result = run_replay(requests, cfg, progress=progress, record_timeline=record, observer=heatmap,
                                event_sink=event_sink, tiers=chain, write_through=write_through,
                                tier_admission=tier_admission)
        finally:
            for tier in chain:
                tier.clear()
                tier.close()
        runs.append(SweepRun(result, heatmap))
        if on_run is not None:
            on_run(runs[-1], len(runs), len(configs))
    return runs


def result_table(runs: Sequence[SweepRun], name: str) -> dict[str, dict[int, Any]]:
    """``{policy: {num_blocks: result.<name>}}`` in the runs' order, for a field of
    :class:`~kvpool.trace.replay_result.ReplayResult`."""
    table: dict[str, dict[int, Any]] = {}
    for run in runs:
        table.setdefault(run.policy, {})[run.num_blocks] = getattr(run.result, name)
    return table


def hit_ratio_table(runs: Sequence[SweepRun]) -> dict[str, dict[int, float]]:
    """``{policy: {num_blocks: block_hit_ratio}}`` in the runs' order."""
    return result_table(runs, "block_hit_ratio")


def rejected_table(runs: Sequence[SweepRun]) -> dict[str, dict[int, int]]:
    """``{policy: {num_blocks: requests_rejected}}`` in the runs' order: what stands beside each ratio of
    :func:`hit_ratio_table` (a rejected request's prompt counts there as misses)."""
    return result_table(runs, "requests_rejected")

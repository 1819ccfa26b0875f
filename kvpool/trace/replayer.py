"""The discrete-event replay of a serving trace on the request path: the replayer, run on a
:class:`~kvpool.trace.replay_config.ReplayConfig` into a :class:`~kvpool.trace.replay_result.ReplayResult`
(both importable from here too). :func:`kvpool.trace.replay.run_replay` runs it.

The replay is the engine with a clock for a model: each trace request becomes a
:class:`~kvpool.requests.request.Request` known by its counts and its prompt's block hashes, and the same
:class:`~kvpool.requests.scheduler.Scheduler` and :class:`~kvpool.requests.kv_manager.KVCacheManager`
that drive :class:`~kvpool.engine.engine.LLMEngine` drive it: prefix hits (at most the full blocks of the
first ``num_tokens - 1`` tokens, the last one always computed), chunked prefill, publishing each full
block after the step that wrote it, preemption by recompute, every KV cache group of a hybrid model, the
eviction policy, pins and the tier chain. Like the engine, the step that completes a prefill samples the
first output token; a request of ``output`` tokens decodes ``output - 1`` more steps and holds KV for
``input + output - 1`` tokens at its peak. A request that could never fit the pool alone is rejected
and counted (the engine's ``OutOfBlocksError``), its prompt as misses: the hit ratios of every pool size
are over the same requests (:data:`HIT_RATIO_BASIS`).

Timing modes:

* ``instant``: requests run one at a time in trace order (``max_num_seqs`` 1, no token budget): each
  prefills, then decodes to completion before the next starts. The clock still follows the step-time
  model; a request starts no earlier than its arrival.
* ``trace``: arrivals at trace timestamps; continuous batching under ``max_batched_tokens`` per step and
  ``max_running`` requests, exactly as the engine schedules.

Step-time model (seconds): ``step_s + prefill_token_s * prefill tokens + decode_token_s * decode tokens``
(prefill tokens: the step's prefill chunks, cached tokens excluded; the defaults are illustrative only).
Stretches of pure decode steps that change nothing in the pool (no block to allocate, free or publish, no
one finishing, nobody who could be admitted) run in one go, and so do all the decode steps but the last of
a request running alone with nothing to arrive, where its blocks come without an eviction
(:meth:`Scheduler.run_lone_decode`, :mod:`kvpool.trace.clock`): the clock adds their times as stepping.

Eviction: ``config.policy`` names the pool's eviction policy (:mod:`kvpool.allocators.policies`; the
``priority`` policy's retention clock is the simulated one), or ``belady``: the offline farthest-next-use
bound of :mod:`kvpool.trace.belady`, which the replay feeds with the trace's future.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.hashing import BlockHasher
from kvpool.allocators.policies import (
    EvictionPolicy,
    FrequencyAdmission,
    ValuedAdmission,
    make_policy,
)
from kvpool.errors import ConfigError, IntegrityError, InvalidArgumentError, OutOfBlocksError
from kvpool.numeric import as_int
from kvpool.requests.compaction import Compactor
from kvpool.requests.kv_manager import KVCacheManager
from kvpool.requests.request import Request
from kvpool.requests.scheduler import Scheduler, SchedulerOutput
from kvpool.requests.state_budget import StateBudget
from kvpool.requests.state_checkpoints import RequestStates
from kvpool.storage.elastic import PageModel
from kvpool.trace.belady import BeladyPolicy, TraceFuture
from kvpool.trace.clock import lone_decode_clock
from kvpool.trace.elastic_track import CommittedTrack
from kvpool.trace.loaders import MOONCAKE_BLOCK_SIZE, TraceRequest
from kvpool.trace.replay_config import REPLAY_POLICIES as REPLAY_POLICIES  # (name as name: re-exported)
from kvpool.trace.replay_config import TIMINGS as TIMINGS
from kvpool.trace.replay_config import UNLIMITED_TOKENS as UNLIMITED_TOKENS
from kvpool.trace.replay_config import ReplayConfig, admission_order, trace_request, unbounded_num_blocks
from kvpool.trace.replay_config import request_blocks as request_blocks
from kvpool.trace.replay_result import HIT_RATIO_BASIS as HIT_RATIO_BASIS
from kvpool.trace.replay_result import (
    ReplayResult,
    Sample,
    prefill_percentiles,
    ratio,
    state_report,
    tier_report,
)
from kvpool.trace.sessions import ReplaySessions

if TYPE_CHECKING:
    from kvpool.events.sink import KVEventSink
    from kvpool.tiers.backend import TierBackend

#: ``trace`` timing records about this many samples over the arrivals' span (instant: every event).
TIMELINE_POINTS = 5000
#: Runs stretches of pure decode steps in one go (tests turn it off to compare).
FAST_FORWARD = True


class Replayer:
    """One replay of ``requests`` (see the module docstring); :meth:`run` returns its result.

    ``pool``: an all-free :class:`BlockPool` to replay on (default: a fresh one of ``config.num_blocks``
    with ``config.policy``); ``event_sink`` records its KV events (flushed once per simulated step);
    ``observer(t, pool)`` and ``record_timeline`` sample the pool over time.

    ``requests`` are trace requests, or fresh :class:`~kvpool.requests.request.Request` objects with token
    ids (an engine's requests replayed): then ``hasher`` hashes their blocks as the engine's did and
    ``next_token(request)`` is the model, a clock that gives each request's next sampled token (for
    example the one the engine sampled), so the replay makes the engine's pool calls exactly (``belady``
    needs trace requests).
    """

    def __init__(self, requests: Sequence[TraceRequest] | Sequence[Request], config: ReplayConfig, *,
                 pool: BlockPool | None = None, progress: Callable[[int], object] | None = None,
                 record_timeline: bool = False, event_sink: KVEventSink | None = None,
                 observer: Callable[[float, BlockPool], object] | None = None,
                 hasher: BlockHasher | None = None, next_token: Callable[[Request], int] | None = None
                 ) -> None:
        self.cfg, self.progress, self.observer = config, progress, observer
        traced = all(isinstance(r, TraceRequest) for r in requests)
        self.given: list[Any] | None = None if traced else list(requests)
        self.requests: list[TraceRequest] = list(requests) if traced else \
            [_as_trace(r) for r in requests if isinstance(r, Request)]  # type: ignore[arg-type]
        if self.given is not None and (config.policy == "belady" or next_token is None or
                                       len(self.requests) != len(self.given)):
            raise ConfigError("replaying requests with token ids needs all of them so, a next_token clock, "
                              "and a policy other than belady")
        self.next_token = next_token
        self.bs = config.block_size
        self.now = 0.0
        self.budget: StateBudget | None = None
        num_blocks = config.num_blocks or (pool.num_blocks if pool is not None else
                                           unbounded_num_blocks(self.requests, config))
        try:
            memory = None if config.elastic_block_bytes is None else PageModel(
                num_blocks, config.elastic_block_bytes, page_size=config.elastic_page_size)
            self.kv = KVCacheManager(config.kv_cache_groups, num_blocks, event_sink=event_sink, hasher=hasher,
                                     policy=self._policy(num_blocks) if pool is None else "lru", pool=pool,
                                     states=self._states(), memory=memory, match_unit=config.match_unit)
        except (MemoryError, InvalidArgumentError) as exc:  # too large for memory
            raise ConfigError(f"a pool of {num_blocks:,} blocks cannot be built ({exc}): give a smaller "
                              "num_blocks (--num-blocks)") from None
        self.pool = self.kv.pool
        self.sessions = ReplaySessions(self.requests, config.sessions, self.kv)
        self._sink = self.pool.event_sink  # flushed once per simulated step (KVCacheManager.flush_events)
        self.sched = Scheduler(self.kv, max_num_batched_tokens=config.step_tokens,
                               max_num_seqs=config.max_num_seqs)
        if self.budget is not None:
            self.budget.attach(self.kv, self.sched)
        self.belady = self.pool.policy if isinstance(self.pool.policy, BeladyPolicy) else None
        if self.belady is not None:
            self.kv.on_admit = self._announce
        self._announced: set[int] = set()
        if config.pin_prefix:
            self.kv.pin_when_cached(self._pin_hashes(config.pin_prefix))
        self.timeline: list[Sample] | None = [] if record_timeline else None
        span = max((r.arrival_s for r in requests), default=0.0)
        self.sample_every = span / TIMELINE_POINTS if config.timing == "trace" else 0.0
        self.next_sample = 0.0
        self.completed = self.rejected = 0
        self.prompt_blocks = self.prompt_tokens = self.rejected_blocks = 0
        self.prefilled = array("q")  # per first admission: prompt tokens not read from the cache
        self.area = 0.0
        self.peak = 0
        self.track = None if memory is None else CommittedTrack(
            self.kv.memory, config.elastic_block_bytes, record_timeline,  # type: ignore[arg-type]
            Compactor(self.kv) if config.elastic_compact else None)

    def chain(self, tiers: Sequence[TierBackend], write_through: bool, tier_admission: int | str = 1) -> None:
        """Put ``tiers`` under the pool (an inline :class:`~kvpool.tiers.manager.OffloadManager`, with a
        :class:`FrequencyAdmission` of ``tier_admission`` offers when that is above 1, or the device policy's
        :class:`ValuedAdmission` for ``"valued"``)."""
        admission: FrequencyAdmission | None = ValuedAdmission() if tier_admission == "valued" else None
        if admission is None and as_int(tier_admission, "tier_admission", minimum=1) > 1:
            admission = FrequencyAdmission(as_int(tier_admission, "tier_admission"))
        self.kv.attach_tiers(tiers, write_through=write_through, asynchronous=False, admission=admission)

    def _states(self) -> RequestStates | None:
        """What the config's state kind holds (:attr:`ReplayConfig.state`): a recurrent hybrid's state slots
        (one per request that may run) and counted checkpoints, evicted by a policy of the pool's name
        (``lru`` under ``belady``, whose future is the KV blocks'), and its budget; None without a state."""
        cfg = self.cfg
        states, self.budget = cfg.state.request_states(cfg.block_size, cfg.max_num_seqs, lambda: make_policy(
            "lru" if cfg.policy == "belady" else cfg.policy, clock=lambda: self.now))
        return states

    def _policy(self, num_blocks: int) -> EvictionPolicy:
        cfg = self.cfg
        if cfg.policy == "belady":
            future = TraceFuture(admission_order(self.requests, cfg, num_blocks), self.bs)
            return BeladyPolicy(future, num_groups=len(cfg.kv_cache_groups))
        return make_policy(cfg.policy, clock=lambda: self.now)

    def _announce(self, req: Request) -> None:
        """Belady's future moves on at each request's first admission, before any eviction for it."""
        if req.request_id not in self._announced:
            self._announced.add(req.request_id)  # type: ignore[arg-type]
            self.belady.admitted(self.requests[req.request_id], req.block_hashes)  # type: ignore[union-attr]

    def _pin_hashes(self, prefix: tuple[int, ...]) -> list[int]:
        """The block hashes of ``config.pin_prefix`` (trace hash ids) at this block size."""
        return TraceRequest(0.0, MOONCAKE_BLOCK_SIZE * len(prefix), 0, prefix).block_hashes(self.bs)

    # ---- the run ------------------------------------------------------------------------------------

    def run(self, start: float) -> ReplayResult:
        """Simulate; ``wall_s`` runs from ``start`` (before the pool was built) to the end, before the
        final ``check_integrity()``."""
        order = range(len(self.requests))
        pending = deque(order if self.cfg.timing == "instant" else
                        sorted(order, key=lambda i: self.requests[i].arrival_s))
        while pending or self.sched.has_unfinished():
            self._arrive(pending)
            if self.sched.has_unfinished():
                self._step(pending)
            elif pending:  # idle until the next arrival
                self._sample(force=True)
                self.now = max(self.now, self.requests[pending[0]].arrival_s)
        self.kv.flush_events()
        wall = time.perf_counter() - start
        cache = self.sessions.end()
        if self.budget is not None:
            self.budget.release()
        pinned = self.kv.unpin_all()
        if self.pool.num_used_blocks:
            raise IntegrityError(f"replay ended with {self.pool.num_used_blocks} blocks still in use")
        tier_hits, tiers = tier_report(self.kv)
        self.kv.check_integrity()
        kv, bs = self.kv, self.bs
        hits, part = kv.first_stats.hit_blocks, kv.partial.report() if kv.partial is not None else {}
        hit_tokens = hits * bs + part.get("partial_tokens", 0)
        ops = kv.ops + (kv.tiers.ops if kv.tiers is not None else 0)
        if kv.tiers is not None:
            kv.detach_tiers()
        return ReplayResult(
            self.completed, self.rejected, self.prompt_blocks, hits,
            ratio(hits, self.prompt_blocks), ratio(hit_tokens, self.prompt_tokens),
            self.peak, ratio(self.area, self.now), self.sched.num_preemptions, ops, ratio(ops, wall), wall,
            self.pool.stats.evictions, self.now, self.pool.num_blocks, bs, self.cfg.timing, self.cfg.policy,
            pinned, self.rejected_blocks, tier_hits, tiers, timeline=self.timeline or [], cache=cache,
            **state_report(self.kv.state, self.cfg.state_save),
            **({} if self.track is None else self.track.report()), **part,
            state_budget=None if self.budget is None else self.budget.report(),
            **prefill_percentiles(self.prefilled))


    def _arrive(self, pending: deque[int]) -> None:
        """Queue the requests that arrived (``trace``), or the next one when none runs (``instant``); a
        request that could never fit the pool alone is rejected and counted, its prompt as misses."""
        instant = self.cfg.timing == "instant"
        while pending and (self.requests[pending[0]].arrival_s <= self.now if not instant else
                           not self.sched.has_unfinished()):
            i = pending.popleft()
            trace_req = self.requests[i]
            if instant:
                self.now = max(self.now, trace_req.arrival_s)
            given = self.given
            req = trace_request(trace_req, i, self.bs, self.cfg.match_unit) if given is None else given[i]
            self.sessions.arrive(req, trace_req)
            try:
                self.sched.add_request(req) if self.budget is None else self.budget.add_request(req)
            except OutOfBlocksError:
                self.rejected += 1
                self.rejected_blocks += req.num_prompt_tokens // self.bs
                self._count_prompt(req)
                if self.progress is not None:
                    self.progress(1)

    def _step(self, pending: deque[int]) -> None:
        """One engine step with the clock for a model, then the decode steps that change nothing."""
        sched, cfg = self.sched, self.cfg
        out = sched.schedule() if self.budget is None else self.budget.schedule()
        if not out.scheduled:
            raise IntegrityError("a step scheduled nothing")
        if out.admitted:
            self._count_admitted(out)
        prefill, decode = out.token_counts()
        self._tick(cfg.step_s + cfg.prefill_token_s * prefill + cfg.decode_token_s * decode)
        finished = sched.update(out, self._tokens(out))
        self.sessions.finished(finished)
        self.completed += len(finished)
        if self.track is not None:
            self.track.compact()  # between steps, as the engine compacts
        if finished:
            if self.progress is not None:
                self.progress(len(finished))
            if cfg.timing == "instant":
                self._sample(force=True)
        stalled = not sched.waiting or not (finished or out.admitted or out.preempted)
        if FAST_FORWARD and stalled:
            self._fast_forward(pending if not sched.waiting else None)

    def _tokens(self, out: SchedulerOutput) -> list[int | None]:
        """The step's sampled tokens: the clock's for requests with token ids, counted (None) otherwise."""
        if self.next_token is None:
            return [None] * out.num_sampled
        return [self.next_token(req) for (req, _), samples in zip(out.scheduled, out.sampled, strict=True)
                if samples]

    def _count_admitted(self, out: SchedulerOutput) -> None:
        for req in out.admitted:
            if req.num_preemptions == 0:  # a first admission
                self._count_prompt(req)
                usage = req.cache_usage
                self.prefilled.append(req.num_prompt_tokens - (usage.cache_read_tokens if usage else 0))

    def _count_prompt(self, req: Request) -> None:
        """Count ``req``'s prompt in the hit ratios' denominators (once per request)."""
        self.prompt_blocks += req.num_prompt_tokens // self.bs
        self.prompt_tokens += req.num_prompt_tokens

    def _fast_forward(self, pending: deque[int] | None) -> None:
        """Run, in one go, the pure decode steps before the next event: a request needing a block,
        freeing or publishing one, or finishing, or (``pending``, trace timing) an arrival that could be
        admitted. A lone request decoding with nothing to arrive runs every step but its last so, block
        allocations included (:meth:`_decode_alone`). Same result as stepping one at a time."""
        if (self.cfg.timing == "instant" or not pending) and self._decode_alone():
            return
        k = self.sched.num_idle_decode_steps()
        if k <= 0:
            return
        dt = self.cfg.step_s + self.cfg.decode_token_s * len(self.sched.running)
        if pending and self.cfg.timing == "trace":  # only the steps that start before the arrival
            k = min(k, math.ceil((self.requests[pending[0]].arrival_s - self.now) / dt) if dt > 0 else 0)
        if k > 0:
            self.sched.run_decode_steps(k)
            self._tick(k * dt)

    def _decode_alone(self) -> bool:
        """:meth:`Scheduler.run_lone_decode` (every decode step of the lone running request but its last,
        their blocks reserved in one call), and the clock of those steps as stepping would run it: pure
        decode steps up to the end of its blocks, then, per block, the step that allocates it and the
        ``block_size - 1`` pure decode steps that fill it, each with the blocks in use then. Only where no
        sample is taken meanwhile (no timeline, no observer). False (nothing changed) otherwise."""
        sched = self.sched
        if self.timeline is not None or self.observer is not None or len(sched.running) != 1:
            return False
        req = sched.running[0]
        room = self.kv.decode_room(req)
        used = self.pool.num_used_blocks
        steps = sched.run_lone_decode()
        if not steps:
            return False
        dt = self.cfg.step_s + self.cfg.decode_token_s  # one decode token: as _fast_forward's and _step's
        self.now, self.area, self.peak = lone_decode_clock(
            self.now, self.area, self.peak, used=used, room=room, steps=steps, block_size=self.bs,
            groups=len(self.kv.groups), dt=dt)
        self._count_committed()
        return True

    # ---- clock and usage ----------------------------------------------------------------------------

    def _tick(self, dt: float) -> None:
        """Run ``dt`` seconds with the blocks now in use; sample at the start; flush the step's events."""
        used = self.pool.num_used_blocks - (0 if self.budget is None else self.budget.tick(dt))
        self.peak = max(self.peak, used)
        self._count_committed()
        self._sample()
        self.area += used * dt
        self.now += dt
        if self._sink is not None:
            self._sink.flush()

    def _count_committed(self) -> None:
        if self.track is not None:
            self.track.count()

    def _sample(self, force: bool = False) -> None:
        """Record the pool state from now on (thinned in ``trace`` timing unless ``force``)."""
        recording = self.timeline is not None or self.observer is not None
        if recording and (force or self.now >= self.next_sample):
            self.next_sample = self.now + self.sample_every
            pool = self.pool
            if self.timeline is not None:
                cached = pool.num_evictable_blocks
                self.timeline.append((self.now, pool.num_used_blocks, cached, pool.num_free_blocks - cached))
                if self.track is not None:
                    self.track.sample(self.now, pool)
            if self.observer is not None:
                self.observer(self.now, pool)


def _as_trace(req: Request) -> TraceRequest:
    """The counts of a request with token ids, as a trace request (its arrival, prompt and output)."""
    return TraceRequest(req.arrival_s, req.num_prompt_tokens, req.max_tokens)

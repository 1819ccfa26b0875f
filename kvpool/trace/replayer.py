"""The discrete-event replay of a serving trace through the real :class:`BlockPool` (block ids only, no
tensors): :class:`ReplayConfig`, :class:`ReplayResult` and the replayer of one plain pool, which
:mod:`kvpool.trace.group_replay` extends to KV cache groups. :func:`kvpool.trace.replay.run_replay` picks one.

Per request: ``lookup`` the full prompt blocks' hashes (the longest cached prefix is the hit), ``touch`` the
hits, ``allocate`` blocks for the prompt as it is prefilled, ``cache_blocks`` each full prompt block once a
step has computed it, ``allocate`` one block each time decoding crosses a block boundary, and ``free`` every
block tail first at the end. A request of ``ceil((input + output) / block_size)`` blocks holds that many at
its last step; one larger than the whole pool is rejected and counted.

Timing modes:

* ``instant``: requests run one at a time in trace order; each prefills, then decodes to completion before
  the next starts (no concurrency). The simulated clock still follows the step-time model below.
* ``trace``: arrivals at trace timestamps; continuous batching with chunked prefill, as the reference
  engine schedules (vLLM v1 style) under a budget of ``max_batched_tokens`` per step: running requests,
  oldest first, each get their next tokens (one decode token, or the next chunk of a prefill that did not
  fit one step), then waiting requests are admitted first-come first-served with a first chunk of what is
  left of the budget (only the blocks of that chunk are allocated). When a running request needs blocks
  and too few are free, the newest running request is preempted by recompute: its blocks are freed tail
  first and it goes back to the front of the queue (on its return its prefix is usually still cached); a
  step that preempted admits no one.

Step-time model (seconds): ``step_s + prefill_token_s * uncached prefill tokens + decode_token_s * decode
tokens``. The defaults are illustrative only; set them for a model and device.

Eviction: ``config.policy`` names the pool's eviction policy (:mod:`kvpool.allocators.policies`; the
``priority`` policy's retention clock is the simulated one), or ``belady``: the offline farthest-next-use
bound of :mod:`kvpool.trace.belady`, which the replay feeds with the trace's future.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.allocators.block_pool import BlockPool
from kvpool.allocators.policies import POLICIES, EvictionPolicy, FrequencyAdmission, make_policy
from kvpool.errors import ConfigError, IntegrityError, InvalidArgumentError
from kvpool.numeric import as_int, as_optional_int, as_real
from kvpool.spec import KVCacheGroup
from kvpool.trace.belady import BeladyPolicy, TraceFuture
from kvpool.trace.loaders import MOONCAKE_BLOCK_SIZE, TraceRequest

if TYPE_CHECKING:
    from kvpool.events import KVEventSink
    from kvpool.tiers.backend import TierBackend

TIMINGS = ("instant", "trace")
#: Eviction policies a replay can use: the pool's own, and the offline bound.
REPLAY_POLICIES = (*POLICIES, "belady")
#: One timeline sample: (simulated seconds, blocks in use, cached free blocks, uncached free blocks).
Sample = tuple[float, int, int, int]
#: ``trace`` timing records about this many samples over the arrivals' span (instant: every event).
TIMELINE_POINTS = 5000
#: ``trace`` timing runs stretches of pure decode steps in one go (tests turn it off to compare).
FAST_FORWARD = True


@dataclass(frozen=True)
class ReplayConfig:
    """Replay settings.

    Args:
        block_size: tokens per block; must divide 512 for a trace with hash ids.
        num_blocks: pool size in blocks; None means unbounded: the sum over the trace of every request's
            ``ceil((input + output) / block_size)``, so that nothing is ever evicted or preempted.
        timing: ``"instant"`` or ``"trace"`` (see the module docstring).
        max_batched_tokens: token budget of one step (``trace`` timing).
        max_running: most requests in flight at once (``trace`` timing).
        step_s, prefill_token_s, decode_token_s: the step-time model, in seconds.
        groups: a hybrid model's KV cache groups (``KVCacheSpec.groups``): blocks are counted per group
            through a :class:`~kvpool.allocators.groups.KVCacheCoordinator` (windows free blocks, a hit is
            the prefix every group restores); empty (default) or one full group: one plain pool.
        policy: the pool's eviction policy, one of :data:`REPLAY_POLICIES` (``belady``: the offline bound).
        pin_prefix: trace hash ids (512-token blocks) of a prefix to pin, e.g. ``(0,)`` for the system
            prompt every Mooncake request starts with: its blocks are pinned as soon as all are cached and
            stay pinned to the end of the replay (``()``: pin nothing).

    Raises:
        ConfigError: a value out of range.
    """

    block_size: int = 16
    num_blocks: int | None = None
    timing: str = "instant"
    max_batched_tokens: int = 8192
    max_running: int = 256
    step_s: float = 0.005
    prefill_token_s: float = 2e-5
    decode_token_s: float = 1e-4
    groups: tuple[KVCacheGroup, ...] = ()
    policy: str = "lru"
    pin_prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(g.block_size != self.block_size for g in self.groups):
            raise ConfigError(f"the KV cache groups' block size must be block_size {self.block_size}")
        if self.timing not in TIMINGS:
            raise ConfigError(f"timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")
        if self.policy not in REPLAY_POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(REPLAY_POLICIES)}, got {self.policy!r}")
        if not isinstance(self.pin_prefix, (tuple, list)):
            raise ConfigError(f"pin_prefix must be a tuple of hash ids, got {self.pin_prefix!r}")
        object.__setattr__(self, "pin_prefix", tuple(as_int(h, "pin_prefix hash id", minimum=0,
                                                            error=ConfigError) for h in self.pin_prefix))
        for name in ("block_size", "num_blocks", "max_batched_tokens", "max_running"):
            check = as_optional_int if name == "num_blocks" else as_int
            object.__setattr__(self, name, check(getattr(self, name), name, minimum=1, error=ConfigError))
        for name in ("step_s", "prefill_token_s", "decode_token_s"):  # seconds
            object.__setattr__(self, name, as_real(getattr(self, name), name, minimum=0, finite=True,
                                                   error=ConfigError))


@dataclass(frozen=True)
class ReplayResult:
    """What a replay measured. Blocks are ``block_size``-token blocks; ratios are in [0, 1].

    ``prompt_blocks`` counts full prompt blocks of admitted requests and ``hit_blocks`` those found cached
    at a request's first admission (a hit counts even where an engine would recompute the last token);
    ``token_hit_ratio = hit_blocks * block_size / prompt tokens``. ``peak_blocks_used`` and
    ``mean_blocks_used`` (time-weighted over the simulated run) count blocks with a reference. ``block_ops``
    counts block ids and hashes handled by pool calls (hashes a lookup examined, blocks touched, allocated,
    published and freed); ``block_ops_per_s = block_ops / wall_s``, ``wall_s`` the replay's own wall time.
    ``timeline`` (only when recorded) holds :data:`Sample` rows; ``policy`` is the eviction policy's name;
    ``pinned_blocks`` the blocks of ``config.pin_prefix`` that were pinned (0 if it never was all cached).

    With tiers below the pool, ``hit_blocks`` counts hits in every tier and ``tier_hits`` splits them by
    where they were found (``device``, then each tier's medium: ``host``, ``disk``, ``remote``); ``tiers``
    holds the :meth:`OffloadManager.stats` of the run, and ``block_ops`` includes the block operations of
    the manager and of the host tier's pool. Without tiers ``tier_hits`` is ``{"device": hit_blocks}``.
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
    tier_hits: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, Any] = field(default_factory=dict)
    timeline: list[Sample] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, object]:
        """Every field but the timeline, JSON-ready."""
        out = asdict(self)
        del out["timeline"]
        return out


def request_blocks(req: TraceRequest, block_size: int) -> int:
    """Blocks a request holds at its end: ``ceil((input + output) / block_size)``."""
    return -(-(req.input_tokens + req.output_tokens) // block_size)


def unbounded_num_blocks(requests: Sequence[TraceRequest], block_size: int) -> int:
    """Blocks to hold every request of the trace at once: the sum of :func:`request_blocks`."""
    return max(1, sum(request_blocks(r, block_size) for r in requests))


def admission_order(requests: Sequence[TraceRequest], config: ReplayConfig, num_blocks: int
                    ) -> list[TraceRequest]:
    """The requests in the order the replay first admits them (the future :class:`TraceFuture` needs):
    trace order for ``instant`` timing, arrival order for ``trace`` timing (first come, first served),
    without the requests larger than the pool, which it rejects."""
    order = requests if config.timing == "instant" else sorted(requests, key=lambda r: r.arrival_s)
    return [r for r in order if request_blocks(r, config.block_size) <= num_blocks]


def _blocks_area(tokens_before: int, steps: int, block_size: int) -> int:
    """Sum over k = 1..steps of ceil((tokens_before + k) / block_size): block-steps of a decode run.

    Uses F(L) = sum_{l=1..L} ceil(l / B) = B q (q + 1) / 2 + r (q + 1), with q, r = divmod(L, B).
    """

    def prefix(length: int) -> int:
        q, r = divmod(length, block_size)
        return block_size * q * (q + 1) // 2 + r * (q + 1)

    return prefix(tokens_before + steps) - prefix(tokens_before)


class _Seq:
    """A request in flight: its hashes (computed once), the blocks it holds and how far it has got."""

    __slots__ = ("req", "hashes", "blocks", "generated", "computed", "published", "total_blocks", "admitted")

    def __init__(self, req: TraceRequest, block_size: int) -> None:
        self.req = req
        self.hashes = req.block_hashes(block_size)
        self.blocks: list[int] = []
        self.generated = 0  # output tokens produced so far (kept across a preemption)
        self.computed = 0  # tokens whose KV is written (hits included); < tokens while prefilling
        self.published = 0  # leading prompt blocks in the prefix index (hits included)
        self.total_blocks = request_blocks(req, block_size)
        self.admitted = False

    @property
    def tokens(self) -> int:
        """Tokens whose KV the request holds once (re)prefilled: prompt plus output so far."""
        return self.req.input_tokens + self.generated

    @property
    def prefilling(self) -> bool:
        """Whether some of :attr:`tokens` still need computing (a decode step follows only after)."""
        return self.computed < self.tokens


#: One request's share of a step: (request, tokens, whether they are a prefill chunk rather than a decode).
_Scheduled = tuple[_Seq, int, bool]


class _Replayer:
    def __init__(self, requests: Sequence[TraceRequest], config: ReplayConfig, pool: BlockPool | None,
                 progress: Callable[[int], object] | None, record_timeline: bool,
                 event_sink: KVEventSink | None = None,
                 observer: Callable[[float, BlockPool], object] | None = None) -> None:
        self.requests, self.cfg, self.progress, self.observer = requests, config, progress, observer
        self.bs = config.block_size
        self.now = 0.0
        if pool is None:
            num_blocks = config.num_blocks or unbounded_num_blocks(requests, self.bs)
            try:
                pool = self._new_pool(num_blocks, event_sink)
            except InvalidArgumentError as exc:  # too large for memory
                raise ConfigError(f"{exc}: give a smaller num_blocks (--num-blocks)") from None
        self.pool = pool
        self.belady = pool.policy if isinstance(pool.policy, BeladyPolicy) else None
        self.pin_hashes = self._pin_hashes(config.pin_prefix)
        self.pinned: list[int] = []
        self.timeline: list[Sample] | None = [] if record_timeline else None
        span = max((r.arrival_s for r in requests), default=0.0)
        self.sample_every = span / TIMELINE_POINTS if config.timing == "trace" else 0.0
        self.next_sample = 0.0
        self.completed = self.rejected = self.preemptions = self.ops = 0
        self.prompt_blocks = self.hit_blocks = self.prompt_tokens = 0
        self.area = 0.0
        self.peak = 0
        self.offload: Any = None
        self.tier_hits = [0]  # device, then each tier

    def chain(self, tiers: Sequence[TierBackend], write_through: bool, tier_admission: int = 1) -> None:
        """Put ``tiers`` under the pool (an inline :class:`~kvpool.tiers.manager.OffloadManager`, with a
        :class:`FrequencyAdmission` of ``tier_admission`` offers when that is above 1)."""
        from kvpool.tiers.manager import OffloadManager  # the tiers' extra, only when asked for

        admission = FrequencyAdmission(tier_admission) if as_int(tier_admission, "tier_admission",
                                                                 minimum=1) > 1 else None
        self.offload = OffloadManager(self.pool, tiers, write_through=write_through, asynchronous=False,
                                      admission=admission)
        self.tier_hits = [0] * (len(tiers) + 1)

    def _new_pool(self, num_blocks: int, event_sink: KVEventSink | None) -> BlockPool:
        cfg = self.cfg
        if cfg.policy == "belady":
            future = TraceFuture(admission_order(self.requests, cfg, num_blocks), self.bs)
            policy: EvictionPolicy = BeladyPolicy(future)
        else:
            policy = make_policy(cfg.policy, clock=lambda: self.now)
        return BlockPool(num_blocks, event_sink=event_sink, policy=policy)

    def _pin_hashes(self, prefix: tuple[int, ...]) -> list[int]:
        """The block hashes of ``config.pin_prefix`` (trace hash ids) at this block size."""
        if not prefix:
            return []
        hashes = TraceRequest(0.0, MOONCAKE_BLOCK_SIZE * len(prefix), 0, prefix).block_hashes(self.bs)
        if len(hashes) > self.pool.max_pinned_blocks:
            raise ConfigError(f"pin_prefix is {len(hashes)} blocks, over the pool's pin cap of "
                              f"{self.pool.max_pinned_blocks}")
        return hashes

    def run(self, start: float) -> ReplayResult:
        """Simulate; ``wall_s`` runs from ``start`` (before the pool was built) to the end, before the
        final ``check_integrity()``."""
        self._run_instant() if self.cfg.timing == "instant" else self._run_trace()
        self._flush_events()
        wall = time.perf_counter() - start
        pool, bs = self.pool, self.bs
        if self.pinned:
            pool.unpin(self.pinned)
        if pool.num_used_blocks:
            raise IntegrityError(f"replay ended with {pool.num_used_blocks} blocks still in use")
        pool.check_integrity()
        tier_hits, tiers = self._tier_report()
        ops = self.ops + (self.offload.ops if self.offload is not None else 0)
        return ReplayResult(
            self.completed, self.rejected, self.prompt_blocks, self.hit_blocks,
            _ratio(self.hit_blocks, self.prompt_blocks), _ratio(self.hit_blocks * bs, self.prompt_tokens),
            self.peak, _ratio(self.area, self.now), self.preemptions, ops, _ratio(ops, wall), wall,
            pool.stats.evictions, self.now, pool.num_blocks, bs, self.cfg.timing, self.cfg.policy,
            len(self.pinned), tier_hits, tiers, timeline=self.timeline or [])

    def _tier_report(self) -> tuple[dict[str, int], dict[str, Any]]:
        """(hits by place, the manager's stats); checks every tier and detaches the manager."""
        if self.offload is None:
            return {"device": self.hit_blocks}, {}
        self.offload.check_integrity()
        names = ["device"] + [t.medium for t in self.offload.tiers]
        stats = self.offload.stats()
        self.offload.detach()
        return dict(zip(names, self.tier_hits, strict=True)), stats

    # ---- pool calls (every block operation is counted here) -----------------------------------------

    def _admit(self, seq: _Seq, budget: int | None) -> int | None:
        """Look up ``seq``'s cached prefix, touch it and allocate blocks for its first chunk of uncached
        tokens: ``min(uncached, budget)`` (``trace`` timing), or all of them (``budget`` None: ``instant``
        timing, pool all free, nothing checked). Returns the chunk's tokens, or None (pool unchanged) when
        its blocks do not fit."""
        pool, hashes, bs = self.pool, seq.hashes, self.bs
        found = pool.lookup(hashes) if self.offload is None else self.offload.lookup(hashes)
        computed = len(found) * bs
        chunk = seq.tokens - computed if budget is None else min(seq.tokens - computed, budget)
        need = -(-(computed + chunk) // bs) - len(found)
        if budget is not None and not pool.can_allocate(hashes[:len(found)], len(found) + need):
            return None  # a hit on a cached free block consumes a free block too (and one found below)
        if self.belady is not None and not seq.admitted:
            self.belady.admitted(seq.req, hashes)  # the future moves on before any eviction for this request
        if self.offload is None:
            hits = found
            pool.touch(hits)
        else:  # blocks found below are loaded into new device blocks (shorter after a failed load)
            hits = self.offload.acquire(found)
            self._count_tier_hits(seq, found.where[:len(hits)])
        seq.blocks = hits + pool.allocate(need + len(found) - len(hits))
        seq.computed = seq.published = len(hits)
        seq.computed *= bs
        self.ops += min(len(hits) + 1, len(hashes)) + len(hits) + need  # hashes examined, touched, allocated
        if not seq.admitted:
            seq.admitted = True
            self.prompt_blocks += seq.req.input_tokens // bs
            self.prompt_tokens += seq.req.input_tokens
            self.hit_blocks += len(hits)
        return chunk

    def _count_tier_hits(self, seq: _Seq, where: list[int]) -> None:
        if not seq.admitted:
            for t in range(len(self.tier_hits)):
                self.tier_hits[t] += where.count(t)

    def _reserve(self, seq: _Seq, n: int) -> bool:
        """Blocks for ``n`` more tokens of ``seq``; False, nothing changed, when too few are free."""
        need = -(-(seq.computed + n) // self.bs) - len(seq.blocks)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            self._grow(seq, need)
        return True

    def _publish(self, seq: _Seq) -> None:
        """After a step: publish the full prompt blocks it computed (the engine publishes a block only
        after the forward that wrote its KV)."""
        full = min(seq.computed // self.bs, len(seq.hashes))
        if full > seq.published:
            ids, hashes = seq.blocks[seq.published:full], seq.hashes[seq.published:full]
            self.pool.cache_blocks(ids, hashes)
            if self.offload is not None:
                self.offload.on_published(ids, hashes)
            self.ops += full - seq.published
            seq.published = full
        if self.pin_hashes and not self.pinned and self.pool.can_pin_prefix(self.pin_hashes):
            self.pinned = self.pool.pin_prefix(self.pin_hashes)

    def _grow(self, seq: _Seq, n: int) -> None:
        seq.blocks += self.pool.allocate(n)
        self.ops += n

    def _release(self, seq: _Seq) -> None:
        """Free tail first: the prompt's head joins the LRU last, so it is evicted last."""
        self.pool.free(seq.blocks[::-1])
        self.ops += len(seq.blocks)
        seq.blocks = []

    def _finish(self, seq: _Seq) -> None:
        self._release(seq)
        self.completed += 1
        if self.progress is not None:
            self.progress(1)

    def _reject(self, req: TraceRequest) -> bool:
        """Count and drop a request that needs more blocks than the whole pool has."""
        if request_blocks(req, self.bs) <= self.pool.num_blocks:
            return False
        self.rejected += 1
        if self.progress is not None:
            self.progress(1)
        return True

    # ---- clock and usage ----------------------------------------------------------------------------

    def _tick(self, dt: float, block_seconds: float | None = None) -> None:
        """Run ``dt`` seconds with the blocks now in use (or the given block-seconds); sample at the start."""
        used = self.pool.num_used_blocks
        self.peak = max(self.peak, used)
        self._sample()
        self.area += used * dt if block_seconds is None else block_seconds
        self.now += dt
        self._flush_events()

    def _flush_events(self) -> None:
        """Publish what the pool recorded since the last step (one batch per simulated step)."""
        if self.pool.event_sink is not None:
            self.pool.event_sink.flush()

    def _sample(self, force: bool = False) -> None:
        """Record the pool state from now on (thinned in ``trace`` timing unless ``force``)."""
        recording = self.timeline is not None or self.observer is not None
        if recording and (force or self.now >= self.next_sample):
            self.next_sample = self.now + self.sample_every
            pool = self.pool
            if self.timeline is not None:
                cached = pool.num_evictable_blocks
                self.timeline.append((self.now, pool.num_used_blocks, cached, pool.num_free_blocks - cached))
            if self.observer is not None:
                self.observer(self.now, pool)

    # ---- instant timing -----------------------------------------------------------------------------

    def _run_instant(self) -> None:
        cfg, bs = self.cfg, self.bs
        decode_step = cfg.step_s + cfg.decode_token_s
        for req in self.requests:
            if self._reject(req):
                continue
            seq = _Seq(req, bs)
            self.now = max(self.now, req.arrival_s)
            new_tokens = self._admit(seq, None)
            self._tick(cfg.step_s + cfg.prefill_token_s * new_tokens)
            seq.computed = seq.tokens
            self._publish(seq)
            self._grow(seq, seq.total_blocks - len(seq.blocks))
            out = req.output_tokens
            self._tick(out * decode_step, _blocks_area(req.input_tokens, out, bs) * decode_step)
            self._finish(seq)
            self._sample(force=True)

    # ---- trace timing -------------------------------------------------------------------------------

    def _run_trace(self) -> None:
        pending = deque(sorted(self.requests, key=lambda r: r.arrival_s))
        waiting: deque[_Seq] = deque()
        running: list[_Seq] = []
        while pending or waiting or running:
            while pending and pending[0].arrival_s <= self.now:
                req = pending.popleft()
                if not self._reject(req):
                    waiting.append(_Seq(req, self.bs))
            if waiting or running:
                if self._step(waiting, running) and FAST_FORWARD:
                    self._fast_forward(running, pending[0].arrival_s if pending and not waiting else None)
            elif pending:  # idle until the next arrival
                self._sample(force=True)
                self.now = pending[0].arrival_s

    def _step(self, waiting: deque[_Seq], running: list[_Seq]) -> bool:
        """One engine step: the running requests' next tokens, then admissions, then the clock. Returns
        whether the queue is stalled: nothing waiting, or a head that no pure decode step can admit (it was
        refused, and no request finished, was preempted or was admitted, which would change the pool or the
        token budget)."""
        cfg, preemptions = self.cfg, self.preemptions
        scheduled, budget = self._schedule_running(waiting, running)
        admitted = self._schedule_waiting(waiting, running, budget) if self.preemptions == preemptions else []
        assert scheduled or admitted, "a step scheduled nothing"
        steps = scheduled + admitted
        prefill = sum(n for _, n, is_prefill in steps if is_prefill)
        decodes = sum(1 for *_, is_prefill in steps if not is_prefill)
        self._tick(cfg.step_s + cfg.prefill_token_s * prefill + cfg.decode_token_s * decodes)
        finished = False
        for seq, n, is_prefill in steps:
            if is_prefill:  # a chunk (an admission with every token cached computes 0 tokens)
                seq.computed += n
                self._publish(seq)
                done = not seq.prefilling and seq.generated == seq.req.output_tokens
            else:
                seq.computed += 1
                seq.generated += 1
                done = seq.generated == seq.req.output_tokens
            if done:
                running.remove(seq)
                self._finish(seq)
                finished = True
        return not waiting or not (finished or admitted or self.preemptions > preemptions)

    def _schedule_running(self, waiting: deque[_Seq], running: list[_Seq]) -> tuple[list[_Scheduled], int]:
        """Each running request, oldest first, gets its next tokens within the budget: one to decode, or
        the next prefill chunk. While too few blocks are free, the newest running request is preempted (it
        may be the one asking; then the loop ends). Returns what was scheduled and the budget left."""
        budget, scheduled, i = self.cfg.max_batched_tokens, [], 0
        while i < len(running) and budget > 0:
            seq = running[i]
            prefill = seq.prefilling
            n = min(seq.tokens - seq.computed, budget) if prefill else 1
            if self._reserve(seq, n):
                scheduled.append((seq, n, prefill))
                budget, i = budget - n, i + 1
            else:
                self._preempt(running.pop(), waiting)
        return scheduled, budget

    def _schedule_waiting(self, waiting: deque[_Seq], running: list[_Seq], budget: int) -> list[_Scheduled]:
        """Admit waiting requests in order, each with a first chunk of what is left of the budget, while
        their blocks fit and fewer than ``max_running`` run."""
        admitted: list[_Scheduled] = []
        while waiting and budget > 0 and len(running) < self.cfg.max_running:
            chunk = self._admit(waiting[0], budget)
            if chunk is None:
                break
            seq = waiting.popleft()
            running.append(seq)
            admitted.append((seq, chunk, True))
            budget -= chunk
        return admitted

    def _fast_forward(self, running: list[_Seq], next_arrival: float | None) -> None:
        """Run, in one go, the pure decode steps before the next event: a request needing a block or
        finishing, or an arrival that could be admitted. Same result as stepping one at a time; only when
        every running request decodes and all of them fit one step's budget."""
        if not running or len(running) > self.cfg.max_batched_tokens or any(s.prefilling for s in running):
            return
        bs = self.bs
        k = min(min(len(s.blocks) * bs - s.tokens, s.req.output_tokens - s.generated - 1) for s in running)
        dt = self.cfg.step_s + self.cfg.decode_token_s * len(running)
        if next_arrival is not None:  # steps that start before the arrival
            k = min(k, math.ceil((next_arrival - self.now) / dt) if dt > 0 else 0)
        if k > 0:
            for seq in running:
                seq.generated += k
                seq.computed += k
            self._tick(k * dt)

    def _preempt(self, seq: _Seq, waiting: deque[_Seq]) -> None:
        self._release(seq)
        seq.computed = seq.published = 0
        waiting.appendleft(seq)
        self.preemptions += 1


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0

"""Discrete-event replay of a serving trace through the real :class:`BlockPool` (block ids only, no tensors).

Per request: ``lookup`` the full prompt blocks' hashes (the longest cached prefix is the hit), ``touch`` the
hits, ``allocate`` the rest of the prompt, ``cache_blocks`` the full prompt blocks after the prefill step,
``allocate`` one block each time decoding crosses a block boundary, and ``free`` every block tail first at
the end. A request of ``ceil((input + output) / block_size)`` blocks holds that many at its last step; one
larger than the whole pool is rejected and counted.

Timing modes:

* ``instant``: requests run one at a time in trace order; each prefills, then decodes to completion before
  the next starts (no concurrency). The simulated clock still follows the step-time model below.
* ``trace``: arrivals at trace timestamps; continuous batching: every step decodes one token for each
  running request, then admits waiting requests first-come first-served while their uncached prompt tokens
  fit the token budget (a step with nothing else may take one larger prompt). When a decode needs a block
  and none is free, the newest running request is preempted by recompute: its blocks are freed tail first
  and it goes back to the front of the queue (on its return its prefix is usually still cached).

Step-time model (seconds): ``step_s + prefill_token_s * uncached prefill tokens + decode_token_s * decode
tokens``. The defaults are illustrative only; set them for a model and device.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from kvpool.allocators.block_pool import BlockPool
from kvpool.errors import ConfigError, IntegrityError, InvalidArgumentError
from kvpool.numeric import as_int, as_optional_int, as_real
from kvpool.trace.loaders import TraceRequest, sub_blocks_per_hash_block

if TYPE_CHECKING:
    from kvpool.events import KVEventSink

TIMINGS = ("instant", "trace")
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

    def __post_init__(self) -> None:
        if self.timing not in TIMINGS:
            raise ConfigError(f"timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")
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
    ``timeline`` (only when recorded) holds :data:`Sample` rows.
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


def run_replay(requests: Sequence[TraceRequest], config: ReplayConfig = ReplayConfig(), *,
                pool: BlockPool | None = None, progress: Callable[[int], object] | None = None,
                record_timeline: bool = False, event_sink: KVEventSink | None = None) -> ReplayResult:
    """Replay ``requests`` through ``pool`` (default: a fresh :class:`BlockPool` of ``config.num_blocks``
    recording KV events into ``event_sink``) and return what it measured. The pool's event sink, if any,
    is flushed once per simulated step (the events carry the trace's hash ids and no token ids).

    ``pool`` must be all free and, when ``config.num_blocks`` is set, of that size. ``progress(n)`` is
    called as n more requests finish or are rejected. At the end every block is free and
    ``check_integrity()`` has passed. Raises :class:`ConfigError` for a block size that does not divide 512
    on a trace with hash ids, or a pool that is not all free or not of ``config.num_blocks``.
    """
    if any(r.hash_ids is not None for r in requests):
        sub_blocks_per_hash_block(config.block_size)
    if pool is not None and (pool.num_used_blocks or config.num_blocks not in (None, pool.num_blocks)):
        raise ConfigError(f"replay needs an all-free pool of config.num_blocks blocks, got {pool!r}")
    start = time.perf_counter()
    if pool is not None and event_sink is not None:
        raise ConfigError("give the event sink to your pool (BlockPool(..., event_sink=...)), not to both")
    return _Replayer(requests, config, pool, progress, record_timeline, event_sink).run(start)


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

    __slots__ = ("req", "hashes", "blocks", "generated", "hits", "total_blocks", "admitted")

    def __init__(self, req: TraceRequest, block_size: int) -> None:
        self.req = req
        self.hashes = req.block_hashes(block_size)
        self.blocks: list[int] = []
        self.generated = 0  # output tokens produced so far (kept across a preemption)
        self.hits = 0  # cached prefix blocks found at the latest admission
        self.total_blocks = request_blocks(req, block_size)
        self.admitted = False

    @property
    def tokens(self) -> int:
        """Tokens whose KV the request holds once (re)prefilled: prompt plus output so far."""
        return self.req.input_tokens + self.generated


class _Replayer:
    def __init__(self, requests: Sequence[TraceRequest], config: ReplayConfig, pool: BlockPool | None,
                 progress: Callable[[int], object] | None, record_timeline: bool,
                 event_sink: KVEventSink | None = None) -> None:
        self.requests, self.cfg, self.progress = requests, config, progress
        self.bs = config.block_size
        if pool is None:
            num_blocks = config.num_blocks or unbounded_num_blocks(requests, self.bs)
            try:
                pool = BlockPool(num_blocks, event_sink=event_sink)
            except InvalidArgumentError as exc:  # too large for memory
                raise ConfigError(f"{exc}: give a smaller num_blocks (--num-blocks)") from None
        self.pool = pool
        self.timeline: list[Sample] | None = [] if record_timeline else None
        span = max((r.arrival_s for r in requests), default=0.0)
        self.sample_every = span / TIMELINE_POINTS if config.timing == "trace" else 0.0
        self.next_sample = 0.0
        self.completed = self.rejected = self.preemptions = self.ops = 0
        self.prompt_blocks = self.hit_blocks = self.prompt_tokens = 0
        self.now = self.area = 0.0
        self.peak = 0

    def run(self, start: float) -> ReplayResult:
        """Simulate; ``wall_s`` runs from ``start`` (before the pool was built) to the end, before the
        final ``check_integrity()``."""
        self._run_instant() if self.cfg.timing == "instant" else self._run_trace()
        self._flush_events()
        wall = time.perf_counter() - start
        pool, bs = self.pool, self.bs
        if pool.num_used_blocks:
            raise IntegrityError(f"replay ended with {pool.num_used_blocks} blocks still in use")
        pool.check_integrity()
        return ReplayResult(
            self.completed, self.rejected, self.prompt_blocks, self.hit_blocks,
            _ratio(self.hit_blocks, self.prompt_blocks), _ratio(self.hit_blocks * bs, self.prompt_tokens),
            self.peak, _ratio(self.area, self.now), self.preemptions, self.ops, _ratio(self.ops, wall), wall,
            pool.stats.evictions, self.now, pool.num_blocks, bs, self.cfg.timing, self.timeline or [])

    # ---- pool calls (every block operation is counted here) -----------------------------------------

    def _admit(self, seq: _Seq, budget: float | None) -> int | None:
        """Look up, touch the hits and allocate the rest of ``seq.tokens``; returns the uncached prefill
        tokens. With a ``budget`` (``trace`` timing) returns None, pool unchanged, when the blocks do not fit
        or the uncached tokens exceed it; ``None`` (``instant`` timing, pool all free) checks nothing."""
        pool, hashes = self.pool, seq.hashes
        need = -(-seq.tokens // self.bs)
        if budget is not None and not pool.can_allocate(hashes, need):
            return None
        hits = pool.lookup(hashes)
        new_tokens = seq.tokens - len(hits) * self.bs
        if budget is not None and new_tokens > budget:
            return None
        pool.touch(hits)
        seq.blocks = hits + pool.allocate(need - len(hits))
        seq.hits = len(hits)
        self.ops += min(len(hits) + 1, len(hashes)) + need  # examined hashes, touched + allocated blocks
        if not seq.admitted:
            seq.admitted = True
            self.prompt_blocks += seq.req.input_tokens // self.bs
            self.prompt_tokens += seq.req.input_tokens
            self.hit_blocks += len(hits)
        return new_tokens

    def _publish(self, seq: _Seq) -> None:
        """After the prefill step: publish the full prompt blocks that were not hits."""
        h, f = seq.hits, len(seq.hashes)
        if f > h:
            self.pool.cache_blocks(seq.blocks[h:f], seq.hashes[h:f])
            self.ops += f - h

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
        if self.timeline is not None and (force or self.now >= self.next_sample):
            self.next_sample = self.now + self.sample_every
            pool = self.pool
            cached = pool.num_evictable_blocks
            self.timeline.append((self.now, pool.num_used_blocks, cached, pool.num_free_blocks - cached))

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
        """One engine step: decode every running request, admit what fits, advance the clock. Returns
        whether the queue is stalled: nothing waiting, or a head that no pure decode step can admit (it was
        refused, and no request finished, was preempted or was admitted, which would change the pool or the
        token budget)."""
        cfg, preemptions = self.cfg, self.preemptions
        decodes = self._schedule_decodes(waiting, running)
        prefills, prefill_tokens = self._schedule_prefills(waiting, running, len(decodes))
        assert decodes or prefills, "a step scheduled nothing"
        self._tick(cfg.step_s + cfg.prefill_token_s * prefill_tokens + cfg.decode_token_s * len(decodes))
        finished = False
        for seq in decodes:
            seq.generated += 1
            if seq.generated == seq.req.output_tokens:
                running.remove(seq)
                self._finish(seq)
                finished = True
        for seq in prefills:
            self._publish(seq)
            if seq.generated == seq.req.output_tokens:
                self._finish(seq)
                finished = True
            else:
                running.append(seq)
        return not waiting or not (finished or prefills or self.preemptions > preemptions)

    def _fast_forward(self, running: list[_Seq], next_arrival: float | None) -> None:
        """Run, in one go, the pure decode steps before the next event: a request needing a block or
        finishing, or an arrival that could be admitted. Same result as stepping one at a time."""
        if not running:
            return
        bs = self.bs
        k = min(min(len(s.blocks) * bs - s.tokens, s.req.output_tokens - s.generated - 1) for s in running)
        dt = self.cfg.step_s + self.cfg.decode_token_s * len(running)
        if next_arrival is not None:  # steps that start before the arrival
            k = min(k, math.ceil((next_arrival - self.now) / dt) if dt > 0 else 0)
        if k > 0:
            for seq in running:
                seq.generated += k
            self._tick(k * dt)

    def _schedule_decodes(self, waiting: deque[_Seq], running: list[_Seq]) -> list[_Seq]:
        """Give each running request a block when its next token starts one, preempting the newest
        running requests (possibly itself) while no block is free."""
        scheduled = []
        for seq in list(running):
            if not seq.blocks:  # preempted earlier in this loop
                continue
            if seq.tokens + 1 > len(seq.blocks) * self.bs:
                while self.pool.num_free_blocks == 0 and seq.blocks:
                    self._preempt(running.pop(), waiting)
                if not seq.blocks:
                    continue
                self._grow(seq, 1)
            scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: _Seq, waiting: deque[_Seq]) -> None:
        self._release(seq)
        waiting.appendleft(seq)
        self.preemptions += 1

    def _schedule_prefills(self, waiting: deque[_Seq], running: list[_Seq], num_decodes: int
                           ) -> tuple[list[_Seq], int]:
        """Admit waiting requests in order while they fit the pool and the token budget."""
        scheduled: list[_Seq] = []
        budget = self.cfg.max_batched_tokens - num_decodes
        total = 0
        while waiting and len(running) + len(scheduled) < self.cfg.max_running:
            alone = not scheduled and not num_decodes  # an empty step may take one oversized prompt
            new_tokens = self._admit(waiting[0], math.inf if alone else budget - total)
            if new_tokens is None:
                break
            scheduled.append(waiting.popleft())
            total += new_tokens
        return scheduled, total


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0

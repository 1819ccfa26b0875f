"""Trace replay of a hybrid model: blocks counted per KV cache group through a :class:`KVCacheCoordinator`.

The same discrete-event replay as :mod:`kvpool.trace.replayer` (instant or trace timing, preemption by
recompute), with the pool calls of one plain pool replaced by the coordinator's: a request's admission takes
the longest prefix every group can restore (full groups: every block; sliding: the blocks covering the last
W - 1 tokens), its prompt is published in every group, and each time decoding starts a new block the
windowed groups first free the blocks that left the window (``remove_skipped_blocks``; so a block is freed
up to B - 1 tokens after it left, never before). Blocks are pool blocks of one group (``bytes_per_block``
of the spec); ``peak_blocks_used`` and ``mean_blocks_used`` count them over all groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpool.allocators.groups import KVCacheCoordinator
from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.spec import cdiv
from kvpool.trace.loaders import TraceRequest
from kvpool.trace.replayer import ReplayConfig, ReplayResult, _Replayer, _Seq

if TYPE_CHECKING:
    from kvpool.events import KVEventSink


def group_request_blocks(req: TraceRequest, config: ReplayConfig) -> int:
    """Most blocks ``req`` holds at once over every group (``KVCacheGroup.max_blocks`` of all its tokens,
    computed in chunks of the step budget in ``trace`` timing, the whole prompt at once in ``instant``)."""
    total = req.input_tokens + req.output_tokens
    chunk = req.input_tokens
    if config.timing == "trace":
        chunk = min(chunk, config.max_batched_tokens)
    return sum(g.max_blocks(total, max(1, chunk)) for g in config.groups)


class GroupReplayer(_Replayer):
    """:class:`_Replayer` over a coordinator of ``config.groups`` (of ``config.num_blocks`` blocks, the null
    block included; by default every request's :func:`group_request_blocks` at once, plus the null block).
    ``seq.blocks`` holds one placeholder per block of a group's table (the tables are the coordinator's)."""

    def __init__(self, requests: Sequence[TraceRequest], config: ReplayConfig,
                 progress: Callable[[int], object] | None, record_timeline: bool,
                 event_sink: KVEventSink | None = None) -> None:
        num_blocks = config.num_blocks or 1 + max(1, sum(group_request_blocks(r, config) for r in requests))
        try:
            self.kv = KVCacheCoordinator(config.groups, num_blocks, event_sink=event_sink)
        except (MemoryError, InvalidArgumentError) as exc:  # too large for memory
            raise ConfigError(f"a pool of {num_blocks:,} blocks cannot be built ({exc}): give a smaller "
                              "num_blocks (--num-blocks)") from None
        super().__init__(requests, config, self.kv.pool, progress, record_timeline)

    def run(self, start: float) -> ReplayResult:
        result = super().run(start)
        self.kv.check_integrity()
        return result

    def _admit(self, seq: _Seq, budget: int | None) -> int | None:
        kv, bs = self.kv, self.bs
        hit = kv.find_longest_cache_hit(seq.hashes)
        computed = hit.num_blocks * bs
        chunk = seq.tokens - computed if budget is None else min(seq.tokens - computed, budget)
        need = kv.num_blocks_to_allocate(seq, computed + chunk, hit)
        if budget is not None and need > self.pool.num_free_blocks:
            return None
        kv.allocate(seq, computed + chunk, hit)
        seq.blocks = [0] * cdiv(computed + chunk, bs)
        seq.computed, seq.published = computed, hit.num_blocks
        self.ops += min(hit.num_blocks + 1, len(seq.hashes)) + kv.num_blocks_held(seq)
        if not seq.admitted:
            seq.admitted = True
            self.prompt_blocks += seq.req.input_tokens // bs
            self.prompt_tokens += seq.req.input_tokens
            self.hit_blocks += hit.num_blocks
        return chunk

    def _reserve(self, seq: _Seq, n: int) -> bool:
        """Free what the windows left behind, then blocks for ``n`` more tokens in every group."""
        kv = self.kv
        self.ops += kv.remove_skipped_blocks(seq, seq.computed)
        need = kv.num_blocks_to_allocate(seq, seq.computed + n)
        if need > self.pool.num_free_blocks:
            return False
        if need:
            kv.allocate(seq, seq.computed + n)
            seq.blocks += [0] * (cdiv(seq.computed + n, self.bs) - len(seq.blocks))
            self.ops += need
        return True

    def _publish(self, seq: _Seq) -> None:
        full = min(seq.computed // self.bs, len(seq.hashes))
        if full > seq.published:
            self.kv.cache_blocks(seq, seq.hashes, full * self.bs)
            self.ops += (full - seq.published) * len(self.kv.groups)
            seq.published = full

    def _release(self, seq: _Seq) -> None:
        self.ops += self.kv.num_blocks_held(seq)
        self.kv.free(seq)
        seq.blocks = []

    def _reject(self, req: TraceRequest) -> bool:
        if group_request_blocks(req, self.cfg) <= self.pool.num_blocks - 1:
            return False
        self.rejected += 1
        if self.progress is not None:
            self.progress(1)
        return True

    def _run_instant(self) -> None:
        """One request at a time, decoding block by block: the blocks in use change only when a token
        starts a block (and the windows free theirs)."""
        cfg = self.cfg
        decode_step = cfg.step_s + cfg.decode_token_s
        for req in self.requests:
            if self._reject(req):
                continue
            seq = _Seq(req, self.bs)
            self.now = max(self.now, req.arrival_s)
            new_tokens = self._admit(seq, None)
            self._tick(cfg.step_s + cfg.prefill_token_s * (new_tokens or 0))
            seq.computed = seq.tokens
            self._publish(seq)
            while seq.generated < req.output_tokens:
                room = len(seq.blocks) * self.bs - seq.tokens
                if room == 0:
                    self._reserve(seq, 1)  # the pool holds every request alone: this never fails
                    continue
                steps = min(room, req.output_tokens - seq.generated)
                self._tick(steps * decode_step)
                seq.generated += steps
                seq.computed += steps
            self._finish(seq)
            self._sample(force=True)

"""``Scheduler``: continuous batching with chunked prefill, one for the engine and the trace replay alike.

vLLM v1's policy under a token budget of ``max_num_batched_tokens`` per step:

1. **Running requests first**, oldest first, each get their next tokens: one decode token, or the next
   chunk of a prefill that did not fit one step. When the pool has too few free blocks for one of them, the
   **newest** running request is preempted by recompute (its blocks freed tail first, its published blocks
   staying cached, so the recompute often hits them) and goes back to the front of the queue; the oldest
   request can always run, since every request fits alone (checked on arrival), so nothing deadlocks.
2. Then, unless this step preempted, **waiting requests join first come, first served** while fewer than
   ``max_num_seqs`` run and the budget lasts: the longest cached prefix is taken (on the device or in a
   tier), and blocks cover a first chunk of what is left of the budget.

After the model ran (the engine's forward, or the replay's clock), :meth:`Scheduler.update` marks the
tokens computed, publishes the full blocks whose KV is now written, records the sampled tokens, and frees
finished requests. The engine and the replay differ only in what produces the tokens, so the replay's pool
calls are the engine's by construction (``tests/test_request_path.py`` compares their call logs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.errors import InvalidArgumentError, OutOfBlocksError
from kvpool.numeric import as_int
from kvpool.requests.kv_manager import KVCacheManager
from kvpool.requests.request import Request, RequestStatus
from kvpool.units import plural


@dataclass
class SchedulerOutput:
    """One step's decisions. ``scheduled``: ``(request, new tokens)`` in batch order (running requests
    first, then the admitted ones); ``sampled[i]``: whether ``scheduled[i]`` samples a token after this
    step (its tokens are all computed then, and it generates); ``preempted`` and ``admitted`` requests."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def num_sampled(self) -> int:
        return sum(self.sampled)

    def token_counts(self) -> tuple[int, int]:
        """``(num_prefill_tokens, num_decode_tokens)`` in one pass over the batch."""
        prefill = decode = 0
        for req, n in self.scheduled:
            if _decoding(req, n):
                decode += 1
            else:
                prefill += n
        return prefill, decode


def _decoding(req: Request, n: int) -> bool:
    return n == 1 and req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1


class Scheduler:
    """Steps the requests of one :class:`KVCacheManager`.

    Args:
        kv: the KV cache manager (its pool, groups and tiers).
        max_num_batched_tokens: the token budget of one step (decode tokens + prefill chunks), >= 1.
        max_num_seqs: running requests at most, >= 1.

    Raises:
        InvalidArgumentError: a limit that is not an integer >= 1.
    """

    def __init__(self, kv: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = as_int(max_num_batched_tokens, "max_num_batched_tokens", minimum=1)
        self.max_num_seqs = as_int(max_num_seqs, "max_num_seqs", minimum=1)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- requests -----------------------------------------------------------------------------------

    def check_fits(self, req: Request) -> None:
        """Raise :class:`OutOfBlocksError` (with ``blocks_needed``: the ``num_blocks`` that would hold it)
        when ``req`` could never run, alone in the pool, prefilled in chunks of the step budget."""
        need = self.kv.blocks_needed(req, self.max_num_batched_tokens)
        if need > self.kv.pool.num_blocks:
            null = self.kv.pool.null_block is not None
            n = len(self.kv.groups)
            groups = f" over {plural(n, 'KV cache group')}" if n > 1 else ""
            raise OutOfBlocksError(
                f"the prompt ({plural(req.num_prompt_tokens, 'token')}) + "
                f"{plural(req.max_tokens, 'new token')} need {plural(need - null, 'block')} of "
                f"{self.kv.block_size} tokens{groups}, but the pool has "
                f"{plural(self.kv.pool.num_blocks - null, 'block')}", blocks_needed=need)

    def add_request(self, req: Request) -> None:
        """Queue ``req`` (hashing its full blocks); raises as :meth:`check_fits` (nothing queued)."""
        if req.status is not RequestStatus.WAITING or req.num_computed_tokens:
            raise InvalidArgumentError(f"request {req.request_id!r} is not a new request")
        self.check_fits(req)
        self.kv.sessions.check(req)
        self.kv.hash_blocks(req)
        self.waiting.append(req)
        self.kv.announce_waiting(req, True)

    def abort(self, req: Request) -> None:
        """Stop ``req`` and free its blocks (a no-op for a finished one)."""
        if req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
            self.kv.announce_waiting(req, False)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
        else:
            return
        req.status = RequestStatus.ABORTED

    def preempt_all(self) -> list[Request]:
        """Preempt every running request, newest first (each requeued at the front, so they run again in
        their order, before the waiting ones); returns them. Their tokens so far are kept; their KV is
        recomputed."""
        gone = []
        while self.running:
            req = self.running.pop()
            self._preempt(req)
            gone.append(req)
        return gone

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide one step (see the module docstring): every block operation of the step happens here.

        Raises:
            OutOfBlocksError: nothing runs and the first waiting request still cannot be admitted: it never
                will (the blocks it lacks are pinned, or held by the tiers' restores); it stays queued
                (``abort`` it, or unpin). Every request fits the pool alone, so without pins this never
                happens. (Not when the head was refused for memory, a limit that pools share: the step is
                then empty, and a later one admits it once memory is given back.)
        """
        out = SchedulerOutput()
        self.kv.sessions.tick()
        self.kv.memory_refused = False  # set again by any commit a memory limit refuses in this step
        budget = self._schedule_running(out)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if not out.scheduled and self.waiting and not self.kv.memory_refused:
            head = self.waiting[0]
            pinned = plural(self.kv.pool.num_pinned_blocks, "block")
            raise OutOfBlocksError(f"request {head.request_id!r} cannot be admitted although nothing runs: "
                                   f"{pinned} of the pool are pinned and {self.kv.num_free_blocks} free; "
                                   "unpin, or give the pool more blocks")
        out.sampled = [req.max_tokens > 0 and req.num_computed_tokens + n == req.num_tokens
                       for req, n in out.scheduled]
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        budget, running, i = self.max_num_batched_tokens, self.running, 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.kv.reserve(req, n):
                out.scheduled.append((req, n))
                budget, i = budget - n, i + 1
            else:  # the newest gives way; when that is req itself, the loop ends (i == len(running))
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        waiting, running = self.waiting, self.running
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting[0]
            n = self.kv.admit(req, budget)
            if n is None:
                break
            waiting.popleft()
            self.kv.announce_waiting(req, False)
            running.append(req)
            req.status = RequestStatus.RUNNING
            out.scheduled.append((req, n))
            out.admitted.append(req)
            budget -= n

    def _preempt(self, req: Request) -> None:
        self.kv.preempt(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.kv.announce_waiting(req, True)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput, tokens: Sequence[int | None], logits: Sequence[object] = ()
               ) -> list[Request]:
        """After the step ran: ``tokens[j]`` is the token sampled for the j-th request of ``out`` that
        samples (None: counted only, for a request without token ids); ``logits[j]`` its logits row, kept
        where the request keeps them. Publishes what the step wrote, extends the block hashes, frees and
        returns the requests that finished.

        Raises:
            InvalidArgumentError: ``tokens`` does not have one entry per sampling request.
        """
        if len(tokens) != out.num_sampled:
            raise InvalidArgumentError(f"{out.num_sampled} requests sample this step, got "
                                       f"{len(tokens)} tokens")
        finished, j, kv = [], 0, self.kv
        for (req, n), samples in zip(out.scheduled, out.sampled, strict=True):
            req.num_computed_tokens += n
            kv.publish(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # mid-prefill chunk: nothing to sample yet
            done = req.max_tokens == 0
            if samples:
                done = req.append_output(tokens[j], logits[j] if logits else None)
                j += 1
                kv.hash_blocks(req)
            if done:
                self.running.remove(req)
                kv.finish(req)
                req.status = RequestStatus.FINISHED
                finished.append(req)
        return finished

    # ---- a clock's shortcut -------------------------------------------------------------------------

    def num_idle_decode_steps(self) -> int:
        """Pure decode steps that would run from now on with no pool call and no change in who runs: every
        running request decodes (one token a step, all within one step's budget) and none needs a block,
        frees one, publishes one or finishes. A replay, whose model is a clock, runs them in one go
        (:meth:`run_decode_steps`) when nothing can arrive or be admitted meanwhile. 0 when not so."""
        running = self.running
        if not running or len(running) > self.max_num_batched_tokens:
            return 0
        steps = None
        for req in running:  # (requests with token ids sample real tokens: one step at a time)
            if req.prompt_token_ids is not None or req.num_output_tokens == 0 or \
                    req.num_computed_tokens != req.num_tokens - 1:
                return 0
            room = min(self.kv.decode_room(req), req.max_tokens - req.num_output_tokens - 1)
            steps = room if steps is None else min(steps, room)
            if steps <= 0:
                return 0
        return steps or 0

    def run_decode_steps(self, k: int) -> None:
        """Run ``k`` of the :meth:`num_idle_decode_steps` at once: each running request computes and
        generates ``k`` tokens (counted: requests without token ids only)."""
        for req in self.running:
            req.num_computed_tokens += k
            req.num_output_tokens += k
        self.kv.sessions.tick(k)

    def run_lone_decode(self) -> int:
        """When exactly one request runs, decoding (counts only, no token ids), and none waits: run at once
        every decode step it takes before its last (the one that finishes it, left to :meth:`schedule`),
        where :meth:`KVCacheManager.reserve_decode` can reserve their blocks in one call; returns how many
        steps ran (0: none, nothing changed). The pool ends as those steps one at a time would leave it;
        a replay's clock accounts for them (its own step pattern: a block per ``block_size`` tokens)."""
        if len(self.running) != 1 or self.waiting:
            return 0
        req = self.running[0]
        steps = req.max_tokens - req.num_output_tokens - 1
        if steps <= 0 or req.prompt_token_ids is not None or req.num_output_tokens == 0 or \
                req.num_computed_tokens != req.num_tokens - 1 or not self.kv.reserve_decode(req, steps):
            return 0
        req.num_computed_tokens += steps
        req.num_output_tokens += steps
        self.kv.sessions.tick(steps)
        return steps

"""``LLMEngine``: continuous batching of a Hugging Face causal LM whose KV lives in kvpool.

One :meth:`LLMEngine.step` = decide, execute, sample, publish, finish. The engine *decides* (schedules and
does every block operation) and writes the step's outcome into a :class:`~kvpool.engine.runner.StepBatch`;
its :class:`~kvpool.engine.runner.ModelRunner` *executes* the batch (one packed forward). Under tensor
parallelism the same engine decides on rank 0, and a runner that ships each batch to the other ranks first
takes the place of its own (:mod:`kvpool.engine.distributed`). Scheduling (nano-vllm / vLLM v1 style) under
a token budget of ``max_num_batched_tokens`` per step:

1. Running requests, oldest first, each get their next tokens (a decode token, or the next prefill chunk).
   When the pool has too few free blocks, the newest running request is preempted by recompute: its blocks
   are freed tail first (its published full blocks stay cached, so the recompute often hits them) and it
   goes back to the front of the queue. The oldest request can always run, since every request fits alone
   (checked on arrival), so the engine never deadlocks.
2. Then, unless a request was preempted in this step, waiting requests join in arrival order: the longest
   cached prefix of full blocks is looked up and touched (always leaving the last prompt token to compute,
   which yields the first logits), and fresh blocks cover the rest of the chunk.

A full block is published to the prefix cache only after the forward that wrote its KV.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvpool.allocators.groups import CacheHit, KVCacheCoordinator
from kvpool.allocators.hashing import BlockHasher, default_hasher
from kvpool.engine.models import kv_spec
from kvpool.engine.runner import ModelRunner, StepBatch
from kvpool.engine.sampling import SamplingParams, sample
from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError, KVPoolError, OutOfBlocksError
from kvpool.numeric import as_id_list, as_int, index_or_none
from kvpool.units import plural

if TYPE_CHECKING:  # the tiers and events need their extras: imported when they are enabled
    from kvpool.allocators.policies import FrequencyAdmission
    from kvpool.events import EventPublisher, KVEventSink
    from kvpool.tiers.backend import TierBackend
    from kvpool.tiers.manager import OffloadManager


class RequestStatus(enum.Enum):
    """WAITING (queued, holds no blocks) -> RUNNING (holds blocks) -> FINISHED or ABORTED; a preempted
    request goes back to WAITING."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """One generation request; its blocks (a table per KV cache group) are in ``LLMEngine.kv`` under its id.
    ``block_hashes`` are the chained hashes of its full blocks of ``token_ids``."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[Any] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_offloaded_blocks: int = 0  # full blocks handed to the offload manager's write-through
    status: RequestStatus = RequestStatus.WAITING
    logits: list[torch.Tensor] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class EngineStats:
    """Counters over the engine's life. ``peak_blocks_used``: most blocks in use after any step's scheduling;
    ``prefix_hit_tokens``: tokens found in the prefix cache on admission (a re-admission after preemption
    counts again); ``elapsed_s``: wall time inside :meth:`LLMEngine.generate`."""

    num_blocks: int
    peak_blocks_used: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    steps: int = 0
    elapsed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0


class LLMEngine:
    """Runs ``model`` (a transformers causal LM) with a :class:`PagedKVCache` of ``num_blocks`` blocks of
    ``block_size`` tokens, a block table per KV cache group managed by a :class:`KVCacheCoordinator`
    (one group for a full-attention model; sliding and chunked groups free blocks out of their window).

    Args:
        model: a Hugging Face causal LM in eval mode; each step switches its attention to
            :func:`paged_attention` if something else (a reference ``generate``) set another one.
        num_blocks: KV blocks in the pool (size it with :func:`kvpool.planner.plan_pool`).
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        max_num_seqs: running requests at most.
        eos_token_ids: tokens that end a request (unless its ``ignore_eos``).
        kv_dtype: KV storage dtype (default: the model's dtype).
        keep_logits: store each sampled row of logits ``[V]`` in ``Request.logits`` (for tests).
        hasher: the block hasher (default: the process-local ``kvpool.allocators.hashing.default_hasher()``,
            a random root per process unless ``$KVPOOL_HASH_SEED`` is set; with ``kv_events``, a shared
            ``BlockHasher(shared=True)``, since the hashes leave the process).
        tp_size: tensor-parallel ranks: ``model`` is this rank's shard and the KV cache holds
            ``spec.num_kv_heads_per_rank`` heads (see :mod:`kvpool.engine.distributed`).
        kv_events: a KV event publisher (:mod:`kvpool.events`): the pool records into a sink whose batch
            is published at the end of every step (medium ``GPU``, vLLM's name for the engine's own KV
            pool on any device; each event names its KV cache group). A host tier given to
            :meth:`enable_offload` then publishes into the same batches, medium ``CPU``.
    """

    def __init__(self, model: Any, *, num_blocks: int, block_size: int = 16,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 64, eos_token_ids: Sequence[int] = (),
                 enable_prefix_caching: bool = True, kv_dtype: torch.dtype | None = None,
                 keep_logits: bool = False, hasher: BlockHasher | None = None, tp_size: int = 1,
                 kv_events: EventPublisher | None = None) -> None:
        max_num_batched_tokens = as_int(max_num_batched_tokens, "max_num_batched_tokens", minimum=1)
        max_num_seqs = as_int(max_num_seqs, "max_num_seqs", minimum=1)
        self.model, self.block_size, self.device = model, block_size, model.device
        spec = kv_spec(model, block_size=block_size, dtype=kv_dtype, tp_size=tp_size)
        self.runner = ModelRunner(model, spec, num_blocks)
        self.cache = self.runner.cache
        sink = self._event_sink(kv_events)
        self.kv = KVCacheCoordinator(spec.groups, num_blocks, enable_caching=enable_prefix_caching,
                                     event_sink=sink)
        self.pool = self.kv.pool
        self.caching, self.keep_logits = enable_prefix_caching, keep_logits
        self.hasher = hasher or (default_hasher() if sink is None else BlockHasher(shared=True))
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats(num_blocks)
        self.max_model_len: int | None = getattr(model.config, "max_position_embeddings", None)
        self.vocab_size: int = model.get_input_embeddings().num_embeddings
        self.offload: OffloadManager | None = None

    def enable_offload(self, tiers: Sequence[TierBackend], *, write_through: bool = False,
                       asynchronous: bool = True, admission: FrequencyAdmission | None = None
                       ) -> OffloadManager:
        """Chain ``tiers`` (a :class:`~kvpool.tiers.host.HostTier` built ``like=self.cache`` first, then
        disk / remote tiers) under this engine's pool: evicted (or, with ``write_through``, published)
        blocks go down, and admission finds prefixes in every tier and loads them before the request runs.
        ``admission``: a frequency filter on what goes down (see the manager).
        Returns the :class:`~kvpool.tiers.manager.OffloadManager` (``stats()``, ``tier_hits()``; ``close()``
        it at the end to finish the stores in flight).

        Raises:
            ConfigError: prefix caching is off, an offload is attached already, the model has more than one
                KV cache group (sliding or chunked layers: not offloaded yet), or a tier keeps blocks
                outside this process (disk, remote) while the block hasher is process-local
                (``hasher=BlockHasher(shared=True)`` and ``$KVPOOL_HASH_SEED``), or (with KV events) a host
                tier that holds blocks already.
            InvalidArgumentError: as :class:`~kvpool.tiers.manager.OffloadManager`.
        """
        if not self.caching or self.offload is not None or len(self.kv.groups) > 1:
            raise ConfigError("offloading needs prefix caching, one KV cache group (a full-attention model) "
                              "and no offload attached already")
        if not self.hasher.shared and any(t.medium != "host" for t in tiers):
            raise ConfigError("disk and remote tiers keep block hashes beyond this process: give the engine "
                              "a shared hasher (BlockHasher(shared=True); $KVPOOL_HASH_SEED for a fleet)")
        from kvpool.tiers.host import HostTier
        from kvpool.tiers.manager import OffloadManager

        hosts = [t for t in tiers if isinstance(t, HostTier)] if self.pool.event_sink is not None else []
        if any(t.pool.num_cached_blocks or t.pool.event_sink is not None for t in hosts):
            raise ConfigError("with KV events, enable_offload needs a host tier that holds no block yet")
        self.offload = OffloadManager(self.pool, tiers, cache=self.cache, write_through=write_through,
                                      asynchronous=asynchronous, admission=admission)
        for host in hosts:  # its stores and evictions go out in this engine's batches, medium CPU
            host.pool.attach_event_sink(self.pool.event_sink.for_medium("CPU"))  # type: ignore[union-attr]
        return self.offload

    def _event_sink(self, publisher: EventPublisher | None) -> KVEventSink | None:
        if publisher is None or not publisher.enabled:
            return None
        from kvpool.events import MEDIUM_GPU, KVEventSink

        return KVEventSink(publisher, block_size=self.block_size, medium=MEDIUM_GPU, group_idx=0)

    # ---- requests
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id.

        Raises:
            InvalidArgumentError: an empty prompt, a token id that is not an integer in ``[0, vocab_size)``
                (never a bool), params that are not :class:`SamplingParams`, or prompt + max_new_tokens
                past max_position_embeddings.
            OutOfBlocksError: the request could never fit: ``ceil((prompt + max_new_tokens - 1) /
                block_size)`` blocks (the last sampled token is never written) exceed the pool; its
                ``blocks_needed`` is the ``num_blocks`` that would hold it.
        """
        return self._enqueue(*self._checked(prompt_token_ids, params))

    def _checked(self, prompt_token_ids: Sequence[int], params: SamplingParams | None
                 ) -> tuple[list[int], SamplingParams]:
        """The prompt as a list of ints, and the params, checked as :meth:`add_request` says; no change."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = as_id_list(prompt_token_ids, "token ids", error=InvalidArgumentError)
        if not prompt:
            raise InvalidArgumentError("empty prompt")
        if not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
            raise InvalidArgumentError(f"token ids must be in [0, {self.vocab_size}), got "
                                       f"{min(prompt)} .. {max(prompt)}")
        total = len(prompt) + params.max_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise InvalidArgumentError(f"prompt + max_new_tokens = {total} tokens exceed the model's "
                                       f"max_position_embeddings {self.max_model_len}")
        chunk = self.max_num_batched_tokens  # the last sampled token is never written: total - 1 tokens
        need = sum(g.max_blocks(total - 1, min(chunk, total - 1)) for g in self.kv.groups)
        null = self.pool.null_block is not None
        if need > self.pool.num_blocks - null:
            groups = f" over {len(self.kv.groups)} KV cache groups" if len(self.kv.groups) > 1 else ""
            raise OutOfBlocksError(
                f"the prompt ({plural(len(prompt), 'token')}) + {plural(params.max_new_tokens, 'new token')} "
                f"need {plural(need, 'block')} of {self.block_size} tokens{groups}, but the pool has "
                f"{plural(self.pool.num_blocks - null, 'block')}", blocks_needed=need + null)
        return prompt, params

    def _enqueue(self, prompt: list[int], params: SamplingParams) -> int:
        req = Request(len(self.requests), prompt, params, params.make_generator(),
                      logits=[] if self.keep_logits else None)
        self._extend_hashes(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return req.request_id

    def abort(self, request_id: int) -> None:
        """Stop a request and free every block it holds (no-op for a finished one). Raises InvalidIdError
        for an id that names no request (an integer by :mod:`kvpool.numeric`, never a bool)."""
        rid = index_or_none(request_id)
        req = None if rid is None else self.requests.get(rid)
        if req is None:
            raise InvalidIdError(f"no request {request_id!r}")
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req)
        else:
            return
        req.status = RequestStatus.ABORTED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Decide (schedule, block operations), execute one forward, sample; returns the requests that
        finished in this step."""
        if self.offload is not None:
            self.offload.poll()
        scheduled = self._schedule()
        if not scheduled:
            return []
        self.stats.steps += 1
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.pool.num_used_blocks)
        finished = self._postprocess(scheduled, self.runner.execute(self._prepare(scheduled)))
        if self.pool.event_sink is not None:
            self.pool.event_sink.flush()  # this step's KV events, as one batch
        return finished

    def _schedule(self) -> list[tuple[Request, int]]:
        budget, scheduled, i = self.max_num_batched_tokens, [], 0
        preempted = False
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._reserve(req, n):
                scheduled.append((req, n))
                budget, i = budget - n, i + 1
            else:  # the newest gives way; when that is req itself, the loop ends (i == len(running))
                self._preempt(self.running.pop())
                preempted = True
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = self._admit(req, budget)
            if not n:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            scheduled.append((req, n))
            budget -= n
        return scheduled

    def _reserve(self, req: Request, n: int) -> bool:
        """Free what ``req``'s windows left behind, give it the blocks for ``n`` more tokens; False (no
        block handed out) when the pool is short."""
        return self.kv.reserve(req.request_id, req.num_computed_tokens, req.num_computed_tokens + n)

    def _admit(self, req: Request, budget: int) -> int:
        """Touch ``req``'s cached prefix, allocate its first chunk; returns its tokens (0: no room).
        The hit covers full blocks of the first ``num_tokens - 1`` tokens (the last is always computed) that
        every KV cache group can restore."""
        limit = (req.num_tokens - 1) // self.block_size if self.caching else 0
        hit = self.kv.find_longest_cache_hit(req.block_hashes, limit) if self.offload is None else \
            self._take_from_tiers(req, budget, limit)
        if hit is None:
            return 0
        computed = hit.num_blocks * self.block_size
        n = min(req.num_tokens - computed, budget)
        if self.kv.num_blocks_to_allocate(req.request_id, computed + n, hit) > self.pool.num_free_blocks:
            return 0
        self.kv.allocate(req.request_id, computed + n, hit)
        req.num_computed_tokens = computed
        self.stats.prefix_hit_tokens += computed
        return n

    def _take_from_tiers(self, req: Request, budget: int, limit: int) -> CacheHit | None:
        """The longest prefix on the device or in a lower tier, as a cache hit for the coordinator (blocks
        found below loaded into new device blocks and published); None when it would not fit."""
        assert self.offload is not None
        found = self.offload.lookup(req.block_hashes[:limit])
        n = min(req.num_tokens - len(found) * self.block_size, budget)
        target = -(-(len(found) * self.block_size + n) // self.block_size)
        if self.offload.num_blocks_to_allocate(found, target) > self.pool.num_free_blocks:
            return None
        blocks = self.offload.acquire(found)  # shorter when a load below failed: those are computed
        self.pool.free(blocks[::-1])  # cached free again: the coordinator touches them back
        req.num_offloaded_blocks = len(blocks)
        return CacheHit(len(blocks), (blocks,), tuple(req.block_hashes[:len(blocks)]))

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _release(self, req: Request) -> None:
        self.kv.free(req.request_id)  # tail first: the prefix stays cached longest

    def _prepare(self, scheduled: list[tuple[Request, int]]) -> StepBatch:
        """The step's decisions as plain data: packed token ids, positions, rows to sample, block tables."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        for req, n in scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            ids += req.token_ids[start:end]
            positions += range(start, end)
            if end == req.num_tokens:
                rows.append(len(ids) - 1)
        spans = [(self.kv.block_tables(r.request_id), r.num_computed_tokens, r.num_computed_tokens + n)
                 for r, n in scheduled]
        return StepBatch(ids, positions, rows, spans)

    def _postprocess(self, scheduled: list[tuple[Request, int]], logits: torch.Tensor) -> list[Request]:
        finished, row = [], 0
        for req, n in scheduled:
            req.num_computed_tokens += n
            self._publish(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # mid-prefill chunk: nothing to sample yet
            if req.logits is not None:
                req.logits.append(logits[row].float().cpu())
            token = sample(logits[row], req.params, req.generator)
            row += 1
            req.output_token_ids.append(token)
            self.stats.generated_tokens += 1
            self._extend_hashes(req)
            if self._done(req, token):
                self.running.remove(req)
                self._release(req)
                req.status = RequestStatus.FINISHED
                finished.append(req)
        return finished

    def _done(self, req: Request, token: int) -> bool:
        eos = token in self.eos_token_ids and not req.params.ignore_eos
        return eos or len(req.output_token_ids) >= req.params.max_new_tokens

    def _extend_hashes(self, req: Request) -> None:
        """Hash the full blocks of ``req.token_ids`` not hashed yet (chained on the last one)."""
        done = len(req.block_hashes) * self.block_size
        if self.caching and req.num_tokens - done >= self.block_size:
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes += self.hasher.block_hashes(req.token_ids[done:], self.block_size, parent=parent)

    def _publish(self, req: Request) -> None:
        """Publish the full blocks whose KV is now written (the forward has run), in every group."""
        if self.caching:
            tokens = None if self.pool.event_sink is None else req.token_ids  # what BlockStored carries
            self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens, token_ids=tokens)
            if self.offload is not None and self.offload.write_through:
                self._offer(req)

    def _offer(self, req: Request) -> None:
        """Hand the blocks published since the last call to the offload manager (write-through)."""
        full, start = req.num_computed_tokens // self.block_size, req.num_offloaded_blocks
        if full > start:
            table = self.kv.block_tables(req.request_id)[0]
            assert self.offload is not None
            self.offload.on_published(table[start:full], req.block_hashes[start:full])
            req.num_offloaded_blocks = full

    def num_token_slots_used(self) -> int:
        """Token slots holding KV now: the tokens written in each block in use, a block that requests share
        counted once (for the ``kvpool_token_slots_used`` metric; a partly filled block counts its tokens).
        O(blocks in use); safe to call from another thread between steps."""
        filled: dict[int, int] = {}
        bs, null = self.block_size, self.kv.null_block
        for req in list(self.running):
            try:
                tables = self.kv.block_tables(req.request_id)
            except InvalidIdError:  # released since the list was copied
                continue
            for table in tables:
                for i, block in enumerate(table):
                    n = min(bs, req.num_computed_tokens - i * bs)
                    if block != null and n > filled.get(block, 0):
                        filled[block] = n
        return sum(filled.values())

    # ---- convenience
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 on_step: Callable[[int], None] | None = None) -> list[Request]:
        """Run ``prompts`` (token ids) to completion; returns their requests in order. ``on_step(n)`` is told
        the tokens generated by each step (a progress bar).

        Raises:
            InvalidArgumentError, OutOfBlocksError: as :meth:`add_request`, or a ``params`` sequence whose
                length differs from ``prompts``; checked for every prompt before any is queued.
        """
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidArgumentError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        checked = [_numbered(i, self._checked, p, sp)
                   for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True))]
        ids = [self._enqueue(*c) for c in checked]
        start = time.perf_counter()
        while self.has_unfinished():
            before = self.stats.generated_tokens
            self.step()
            if on_step is not None:
                on_step(self.stats.generated_tokens - before)
        self.stats.elapsed_s += time.perf_counter() - start
        return [self.requests[i] for i in ids]


def _numbered(i: int, check: Callable[..., Any], *args: Any) -> Any:
    """``check(*args)``; its error names prompt ``i`` ("the prompt" becomes "prompt 2") and carries it as
    ``prompt_index`` (the same exception object, re-raised)."""
    try:
        return check(*args)
    except KVPoolError as exc:
        text = str(exc)
        exc.args = (text.replace("the prompt", f"prompt {i}", 1) if "the prompt" in text else
                    f"prompt {i}: {text}",)
        exc.prompt_index = i  # type: ignore[attr-defined]
        raise

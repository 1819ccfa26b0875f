"""``LLMEngine``: continuous batching of a Hugging Face causal LM whose KV lives in kvpool.

One :meth:`LLMEngine.step` = decide, execute, sample, update. The engine owns the model and sampling; the
request path owns everything else: the :class:`~kvpool.requests.scheduler.Scheduler` decides the step
(running requests first, preempting the newest when blocks run out; then waiting requests first come,
first served, with chunked prefill) and the :class:`~kvpool.requests.kv_manager.KVCacheManager` does every
block operation (prefix hits on the device and in the tiers, every KV cache group, the eviction policy,
pins, KV events), exactly as for a trace replay. The step's outcome is a
:class:`~kvpool.engine.runner.StepBatch` that the :class:`~kvpool.engine.runner.ModelRunner` executes (one
packed forward). Under tensor parallelism the same engine decides on rank 0, and a runner that ships each
batch to the other ranks first takes the place of its own (:mod:`kvpool.engine.distributed`).

A full block is published to the prefix cache only after the forward that wrote its KV.

An attention / recurrent hybrid (:data:`kvpool.engine.models.TINY_HYBRID_MODELS`, or a local folder of such a
family) keeps its attention KV in the paged cache and each running request's recurrent state in a state slot
(:class:`~kvpool.requests.state_checkpoints.RequestStates`, over the runner's
:class:`~kvpool.storage.state.RecurrentStateCache`): taken at admission (zeroed, or filled from the state
checkpoint that ends its prefix hit), freed at its end or preemption (a preempted request is recomputed).
With prefix caching, states are saved at the block boundaries of ``state_save`` into ``state_checkpoints``
checkpoint slots as the forward passes them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvpool.allocators.groups import KVCacheCoordinator
from kvpool.allocators.hashing import BlockHasher, hasher_for
from kvpool.engine.recurrent import engine_kv_spec, model_memory
from kvpool.engine.runner import ModelRunner, StepBatch, StepRunner
from kvpool.engine.sampling import SamplingParams, sample
from kvpool.errors import (
    AsleepError,
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    KVPoolError,
    MemoryLimitError,
)
from kvpool.numeric import as_id_list, as_int, index_or_none
from kvpool.requests.compaction import Compactor
from kvpool.requests.kv_manager import KVCacheManager
from kvpool.requests.no_state import StateSide
from kvpool.requests.request import Request, RequestStatus
from kvpool.requests.scheduler import Scheduler, SchedulerOutput
from kvpool.requests.sessions import Retention, SessionCache
from kvpool.requests.state_checkpoints import SavePolicy
from kvpool.spec import KVCacheSpec
from kvpool.spec.memory import ModelMemory
from kvpool.storage.arena import ElasticConfig
from kvpool.storage.block_copy import copy_token_prefix

if TYPE_CHECKING:  # the tiers and events need their extras: imported when they are enabled
    from kvpool.allocators.policies import FrequencyAdmission
    from kvpool.events.publishers import EventPublisher
    from kvpool.events.sink import KVEventSink
    from kvpool.tiers.backend import TierBackend
    from kvpool.tiers.from_url import TierURL
    from kvpool.tiers.manager import OffloadManager

__all__ = ["EngineStats", "LLMEngine", "Request", "RequestStatus"]


@dataclass
class EngineStats:
    """Counters over the engine's life. ``peak_blocks_used``: most blocks in use after any step's scheduling;
    ``prefix_hit_tokens``: tokens found in the prefix cache (device or tiers) on admission (a re-admission
    after preemption counts again); ``elapsed_s``: wall time inside :meth:`LLMEngine.generate`;
    ``peak_committed_bytes``: most KV bytes committed after any step's scheduling (an elastic cache; a
    fixed one counts its whole buffer)."""

    num_blocks: int
    peak_blocks_used: int = 0
    peak_committed_bytes: int = 0
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
    ``block_size`` tokens, a block table per KV cache group (one group for a full-attention model; sliding
    and chunked groups free blocks out of their window), on the request path of :mod:`kvpool.requests`.

    Args:
        model: a Hugging Face causal LM in eval mode; each step switches its attention to
            :func:`paged_attention` if something else (a reference ``generate``) set another one.
        num_blocks: KV blocks in the pool (size it with :func:`kvpool.spec.planner.plan_pool`).
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        max_num_seqs: running requests at most.
        eos_token_ids: tokens that end a request (unless its ``ignore_eos``).
        kv_dtype: KV storage dtype (default: the model's dtype).
        keep_logits: store each sampled row of logits ``[V]`` in ``Request.logits`` (for tests).
        hasher: the block hasher (default: the process-local ``kvpool.allocators.hashing.default_hasher()``,
            a random root per process unless ``$KVPOOL_HASH_SEED`` is set; with ``kv_events``, a shared
            ``BlockHasher(shared=True)``, since the hashes leave the process; a process-local one given
            with ``kv_events`` is refused: :func:`~kvpool.allocators.hashing.hasher_for`).
        tp_size: tensor-parallel ranks: ``model`` is this rank's shard and the KV cache holds
            ``spec.num_kv_heads_per_rank`` heads (see :mod:`kvpool.engine.distributed`).
        kv_events: a KV event publisher (:mod:`kvpool.events`): the pool records into a sink whose batch
            is published at the end of every step (medium ``GPU``, vLLM's name for the engine's own KV
            pool on any device; each event names its KV cache group). A host tier given to
            :meth:`enable_offload` then publishes into the same batches, medium ``CPU``.
        policy: the eviction policy of cached free blocks, a name of
            :data:`~kvpool.allocators.policies.POLICIES` or a fresh
            :class:`~kvpool.allocators.policies.EvictionPolicy` (default ``"lru"``); the ``priority``
            policy keeps the blocks of requests added with a higher ``priority`` longer. A recurrent
            hybrid's state checkpoints are evicted by a fresh policy of the same name.
        pin_cap: the largest fraction of the pool that :meth:`pin_prefix` may pin.
        admission: a :class:`~kvpool.allocators.policies.FrequencyAdmission` the pool asks before it
            publishes a new block hash (None: publish every full block).
        state_save: a recurrent hybrid's state save policy (``tail``, ``dense``, ``interval=N``,
            ``tail+junction``: :mod:`kvpool.requests.state_checkpoints`); ignored for other models.
        state_checkpoints: a recurrent hybrid's checkpoint slots (default ``max_num_seqs``; 0 without
            prefix caching), beside one state slot per running request.
        attention: ``"gather"`` (default: gather each context, then SDPA) or ``"paged"`` (a CPU kernel that
            reads the pool in place by block table: :mod:`kvpool.engine.paged_attention`; ConfigError where
            it cannot run).
        elastic: False (default), True or an :class:`~kvpool.storage.arena.ElasticConfig` (a memory limit,
            a :class:`~kvpool.storage.arena.MemoryBudget` shared with other engines): the KV cache sits on a
            page arena whose committed memory follows the used and cached blocks (the request path commits
            a block's pages as it is handed out and releases them once it holds no KV:
            :mod:`kvpool.requests.block_memory`), and :meth:`sleep` / :meth:`wake` give every KV and state
            page back and take them again. With ``tp_size`` > 1 each rank's shard sits on its own arena,
            committed and released in step with rank 0's (:mod:`kvpool.engine.tp_memory`), and
            :meth:`sleep` / :meth:`wake` and the tiers' restores run on every rank.
        memory: the model's :class:`~kvpool.spec.memory.ModelMemory` at ``block_size``, ``kv_dtype`` and
            ``tp_size``, where the caller has made it (its config read once per command); default
            :func:`kvpool.engine.recurrent.model_memory`'s.
        match_unit: tokens per prefix-match unit (a divisor of ``block_size``): a prefix hit may end
            inside a block, its tokens copied from the cached block into the request's fresh one
            (:mod:`kvpool.requests.partial_hits`; with ``tp_size`` > 1 every rank copies its own shard:
            :mod:`kvpool.engine.tp_partial`); a recurrent hybrid's hit ends at a unit whose state was
            saved too (:mod:`kvpool.requests.unit_states`); None (default): whole blocks only.
            ConfigError for a bad unit or without prefix caching.

    Attributes: ``kv_manager`` (the :class:`~kvpool.requests.kv_manager.KVCacheManager`), ``scheduler``,
    ``kv`` (its :class:`KVCacheCoordinator`), ``pool`` (its :class:`BlockPool`), ``cache`` (the KV tensors),
    ``requests`` (every request by id), ``stats``.
    """

    def __init__(self, model: Any, *, num_blocks: int, block_size: int = 16,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 64, eos_token_ids: Sequence[int] = (),
                 enable_prefix_caching: bool = True, kv_dtype: torch.dtype | None = None,
                 keep_logits: bool = False, hasher: BlockHasher | None = None, tp_size: int = 1,
                 kv_events: EventPublisher | None = None, policy: Any = "lru", pin_cap: float = 0.5,
                 admission: FrequencyAdmission | None = None, state_save: str | SavePolicy = "tail",
                 state_checkpoints: int | None = None, attention: str = "gather",
                 elastic: bool | ElasticConfig = False, memory: ModelMemory | None = None,
                 match_unit: int | None = None) -> None:
        max_num_batched_tokens = as_int(max_num_batched_tokens, "max_num_batched_tokens", minimum=1)
        max_num_seqs = as_int(max_num_seqs, "max_num_seqs", minimum=1)
        self.model, self.block_size, self.device = model, block_size, model.device
        self.attention = attention
        self._elastic = elastic
        if memory is None:
            memory = model_memory(model, block_size=block_size, dtype=kv_dtype, tp_size=tp_size)
        spec = self._build_runner(model, memory, num_blocks, max_num_seqs, enable_prefix_caching, state_save,
                                  state_checkpoints, policy if isinstance(policy, str) else policy.name)
        self.cache = self.runner.cache
        sink = self._event_sink(kv_events)
        self.hasher = hasher_for(hasher, events=sink is not None)
        self.kv_manager = KVCacheManager(spec.groups, num_blocks, enable_caching=enable_prefix_caching,
                                         hasher=self.hasher, policy=policy, pin_cap=pin_cap,
                                         admission=admission, event_sink=sink, states=self.states,
                                         memory=self.cache if self.cache.elastic else None,
                                         match_unit=match_unit)
        #: Packs an elastic cache's live blocks after each step (:mod:`kvpool.requests.compaction`: their
        #: KV copied, every layer; under tensor parallelism on every rank: kvpool.engine.tp_compaction);
        #: None for a fixed cache.
        self.compactor = Compactor(self.kv_manager, self.cache.copy_blocks) if self.cache.elastic else None
        if self.kv_manager.partial is not None:  # partial hits copy their tokens in this KV cache
            self.kv_manager.partial.copy = functools.partial(copy_token_prefix, self.cache)
        self.tp_size = tp_size
        self.scheduler = Scheduler(self.kv_manager, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs)
        self.caching, self.keep_logits = enable_prefix_caching, keep_logits
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats(num_blocks)
        self.asleep = False
        self.max_model_len: int | None = getattr(model.config, "max_position_embeddings", None)
        self.vocab_size: int = model.get_input_embeddings().num_embeddings

    def _build_runner(self, model: Any, memory: ModelMemory, num_blocks: int, max_num_seqs: int,
                      caching: bool, state_save: str | SavePolicy, state_checkpoints: int | None,
                      eviction: str) -> KVCacheSpec:
        """The runner (and, for a recurrent hybrid, :attr:`states`, its checkpoints evicted by a fresh
        policy named ``eviction``); returns the KV spec."""
        self.hybrid = memory.hybrid
        spec = engine_kv_spec(memory, model)
        capacity = memory.state_kind.checkpoint_slots(state_checkpoints, max_num_seqs if caching else 0)
        self.runner = ModelRunner(model, spec, num_blocks, hybrid=self.hybrid, elastic=self._elastic,
                                  num_state_slots=max_num_seqs + capacity, attention=self.attention)
        self.states = self.runner.recurrent.request_states(state_save, self.block_size, max_num_seqs,
                                                           capacity, eviction)
        return spec

    @property
    def state(self) -> StateSide:
        """The state side of every request (:attr:`KVCacheManager.state
        <kvpool.requests.kv_manager.KVCacheManager.state>`): :attr:`states` for a recurrent hybrid, else
        :data:`~kvpool.requests.no_state.NO_STATE`."""
        return self.kv_manager.state

    # ---- the request path's parts, by their old names -----------------------------------------------

    @property
    def sessions(self) -> SessionCache:
        """Open and close sessions (:class:`~kvpool.requests.sessions.SessionCache`)."""
        return self.kv_manager.sessions

    @property
    def kv(self) -> KVCacheCoordinator:
        """The KV cache groups coordinator (block tables per group) under :attr:`kv_manager`."""
        return self.kv_manager.coordinator

    @property
    def pool(self) -> Any:
        """The :class:`BlockPool` (a tensor-parallel leader's recording wrapper once it took over)."""
        return self.kv_manager.pool

    @pool.setter
    def pool(self, pool: Any) -> None:
        self.kv_manager.coordinator.pool = pool

    def wrap_runner(self, wrap: Callable[[ModelRunner], StepRunner]) -> StepRunner:
        """Run every step through ``wrap(runner)`` (a :class:`~kvpool.engine.runner.StepRunner`: a
        tensor-parallel leader ships each batch to its followers before executing it); returns it. With
        :meth:`~kvpool.requests.kv_manager.KVCacheManager.wrap_pool`, the declared seam
        :mod:`kvpool.engine.distributed` takes an engine over through."""
        self.runner = wrapper = wrap(self.runner)
        return wrapper

    @property
    def offload(self) -> OffloadManager | None:
        """The tier chain of :meth:`enable_offload`, or None."""
        return self.kv_manager.tiers

    @property
    def waiting(self) -> Any:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    def enable_offload(self, tiers: Sequence[TierBackend | str | TierURL], *, write_through: bool = False,
                       asynchronous: bool = True, admission: FrequencyAdmission | None = None,
                       namespace: Any = None, auth_key: Any = None) -> OffloadManager:
        """Chain ``tiers`` (a :class:`~kvpool.tiers.host.HostTier` built ``like=self.cache`` first, then
        disk / remote tiers; or their URLs or checked :class:`~kvpool.tiers.from_url.TierURL` s,
        :mod:`kvpool.tiers.from_url`, built in ``namespace``, by default
        :meth:`tier_namespace`, with the fleet secret ``auth_key``, by default the environment's) under this
        engine's pool, for every KV cache group: evicted (or, with
        ``write_through``, published) blocks go down, and admission finds prefixes in every tier and loads
        the blocks each group's hit needs before the request runs. ``admission``: a frequency filter on what
        goes down (see the manager). Returns the :class:`~kvpool.tiers.manager.OffloadManager`
        (``stats()``; ``close()`` it at the end to finish the stores in flight); the prefix hits by place
        are ``kv_manager.hits_by_place()``. A recurrent hybrid's state checkpoints go down beside the KV
        (:mod:`kvpool.engine.state_tiers`: host tiers, and disk / Redis tiers given by URL).

        Raises:
            ConfigError: prefix caching is off, an offload is attached already, or a tier keeps blocks
                outside this process (disk, remote) while the block hasher is process-local
                (``hasher=BlockHasher(shared=True)`` and ``$KVPOOL_HASH_SEED``), or (with KV events) a host
                tier whose pool has an event sink already; a malformed tier URL. (A host tier that holds
                blocks already announces them on the event stream first.)
            InvalidArgumentError: as :class:`~kvpool.tiers.manager.OffloadManager`.
        """
        from kvpool.engine.state_tiers import checkpoint_tiers
        from kvpool.tiers.from_url import TierURL, tiers_from_urls

        urls = space = None
        if any(isinstance(t, str | TierURL) for t in tiers):
            urls = [t for t in tiers if isinstance(t, str | TierURL)]
            if len(urls) != len(tiers):
                raise ConfigError("give enable_offload tiers or tier URLs, not both")
            space = namespace if namespace is not None else self.tier_namespace()
            tiers = tiers_from_urls(urls, space, block_bytes=self.cache.bytes_per_block, like=self.cache,
                                    auth_key=auth_key)
        states = checkpoint_tiers(tiers, self.state, urls=urls, namespace=space, auth_key=auth_key)
        return self.kv_manager.attach_tiers(tiers, cache=self.cache, write_through=write_through,
                                            asynchronous=asynchronous, admission=admission,
                                            state_tiers=states or None)

    def tier_namespace(self, model_name: str = "model") -> Any:
        """The :class:`~kvpool.tiers.backend.Namespace` of this engine's blocks in a tier: the model named by
        ``model_name``, its weights (this rank's shard) and its config, the cache's dtype and layout, the
        tensor-parallel rank, the hash scheme; two processes share blocks exactly when they compute the same
        KV. Hashes the weights once (~50 GB/s)."""
        from kvpool.tiers.backend import Namespace, config_fingerprint, weights_fingerprint

        model = self.model
        model_id = (f"{model_name}:{weights_fingerprint(model.parameters())}:"
                    f"{config_fingerprint(model.config.to_dict())}")
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return Namespace.for_cache(self.cache, model=model_id, hash_scheme=self.hasher.algorithm,
                                   tp_rank=rank, tp_size=self.tp_size)

    def pin_prefix(self, token_ids: Sequence[int]) -> bool:
        """Pin the full blocks of ``token_ids`` (a system prompt) in every KV cache group as soon as they
        are cached (now, or after the step that publishes the last of them), so no eviction takes them;
        they stay pinned for the engine's life. Returns whether they are pinned now.

        Raises:
            InvalidArgumentError: token ids that are not integers in ``[0, vocab_size)``.
            ConfigError: prefix caching is off, or the prefix is over the pool's pin cap.
        """
        if not self.caching:
            raise ConfigError("pinning a prefix needs prefix caching")
        tokens = self._checked_tokens(token_ids)
        return self.kv_manager.pin_when_cached(self.hasher.block_hashes(tokens, self.block_size))

    def _event_sink(self, publisher: EventPublisher | None) -> KVEventSink | None:
        if publisher is None or not publisher.enabled:
            return None
        from kvpool.events.sink import KVEventSink
        from kvpool.events.wire import MEDIUM_GPU

        return KVEventSink(publisher, block_size=self.block_size, medium=MEDIUM_GPU, group_idx=0)

    # ---- requests
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, *,
                    priority: int = 0, session_id: Hashable | None = None, retain: Retention | None = None
                    ) -> int:
        """Queue a request; returns its id. ``priority``: its blocks' retention priority under the
        ``priority`` eviction policy (higher = kept longer; other policies ignore it). ``session_id``: an
        open session (:attr:`sessions`) whose turn it is; ``retain``: a token range kept for some steps
        after it ends (:mod:`kvpool.requests.sessions`). Once admitted, ``cache_usage`` on the request
        says its prompt tokens read from the cache by tier, created, and uncached.

        Raises:
            InvalidArgumentError: an empty prompt, a token id that is not an integer in ``[0, vocab_size)``
                (never a bool), params that are not :class:`SamplingParams`, prompt + max_new_tokens
                past max_position_embeddings, or a ``retain`` that is not a Retention.
            InvalidIdError: ``session_id`` names no open session.
            OutOfBlocksError: the request could never fit: its KV (prompt + max_new_tokens - 1 tokens: the
                last sampled token is never written) needs more blocks than the pool has over its KV cache
                groups; its ``blocks_needed`` is the ``num_blocks`` that would hold it.
        """
        return self._enqueue(self._checked(prompt_token_ids, params, priority, session_id, retain))

    def _checked_tokens(self, token_ids: Sequence[int]) -> list[int]:
        tokens = as_id_list(token_ids, "token ids", error=InvalidArgumentError)
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.vocab_size:
            raise InvalidArgumentError(f"token ids must be in [0, {self.vocab_size}), got "
                                       f"{min(tokens)} .. {max(tokens)}")
        return tokens

    def _checked(self, prompt_token_ids: Sequence[int], params: SamplingParams | None, priority: int = 0,
                 session_id: Hashable | None = None, retain: Retention | None = None) -> Request:
        """The request, checked as :meth:`add_request` says; nothing queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = self._checked_tokens(prompt_token_ids)
        if not prompt:
            raise InvalidArgumentError("empty prompt")
        total = len(prompt) + params.max_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise InvalidArgumentError(f"prompt + max_new_tokens = {total} tokens exceed the model's "
                                       f"max_position_embeddings {self.max_model_len}")
        stop = frozenset() if params.ignore_eos else self.eos_token_ids
        req = Request(len(self.requests), prompt, params.max_new_tokens, stop_token_ids=stop, params=params,
                      priority=priority, keep_logits=self.keep_logits, session_id=session_id, retain=retain)
        self.scheduler.check_fits(req)
        self.sessions.check(req)
        return req

    def _enqueue(self, req: Request) -> int:
        req.request_id = len(self.requests)
        req.generator = req.params.make_generator()
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req
        return req.request_id

    def abort(self, request_id: int) -> None:
        """Stop a request and free every block it holds (no-op for a finished one). Raises InvalidIdError
        for an id that names no request (an integer by :mod:`kvpool.numeric`, never a bool)."""
        rid = index_or_none(request_id)
        req = None if rid is None else self.requests.get(rid)
        if req is None:
            raise InvalidIdError(f"no request {request_id!r}")
        self.scheduler.abort(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- sleep and wake
    def sleep(self) -> int:
        """Give back every page of the KV cache and of a hybrid's state cache while the weights stay
        (vLLM's sleep level 1 for the KV cache, SGLang's memory saver). Running requests are preempted
        (their tokens so far kept, their KV recomputed after :meth:`wake`, tokens identical), pinned
        prefixes wait to be pinned again once cached, the prefix index is emptied (an
        ``AllBlocksCleared`` KV event, published now), the state checkpoints dropped; the tiers keep what
        they hold (swaps in flight finish first). Until :meth:`wake`, :meth:`step` and :meth:`generate`
        raise AsleepError; :meth:`add_request` queues. Returns the bytes given back (rank 0's, under tensor
        parallelism, where every rank gives its shard's pages back); 0 when asleep already.

        Raises:
            ConfigError: the engine was built without ``elastic``.
        """
        if not self.cache.elastic:
            raise ConfigError("sleep needs an elastic KV cache: build the engine with elastic=True")
        if self.asleep:
            return 0
        if self.offload is not None:
            self.offload.synchronize()
        before = self.cache.committed_bytes + self._state_bytes()
        self.stats.preemptions += len(self.scheduler.preempt_all())
        if not self.kv_manager.empty():
            raise IntegrityError("a block is still in use after every request was preempted")
        self.kv_manager.flush_events()
        self.runner.sleep()  # (through the runner: a tensor-parallel leader's sleeps every rank)
        self.asleep = True
        return before

    def wake(self) -> int:
        """Take memory again after :meth:`sleep`: the pages the KV cache kept for no block (the null block,
        the reserve) and every state slot, reading 0; the KV cache's blocks are committed again as they are
        handed out. Returns the bytes committed (rank 0's, under tensor parallelism); 0 when awake. Raises
        MemoryLimitError / InsufficientMemoryError (still asleep) when they cannot be committed (under
        tensor parallelism: on any rank; then every rank stays asleep)."""
        if not self.asleep:
            return 0
        taken = self.runner.wake()  # (a tensor-parallel leader's wakes every rank, or none)
        self.asleep = False
        return taken

    def trim(self) -> int:
        """Give back the pages of the cached free blocks (an idle engine under a budget shared with a busy
        one): those on pages with no used block are evicted from the prefix index (``BlockRemoved`` events;
        page-aware: :mod:`kvpool.requests.page_aware`), then every committed page with no block holding KV
        is released, the reserve too. Returns the bytes given back. ConfigError
        without ``elastic``."""
        if self.kv_manager.memory is None:
            raise ConfigError("trim needs an elastic KV cache: build the engine with elastic=True")
        memory = self.kv_manager.memory
        given = memory.shrink()
        self.kv_manager.flush_events()
        return given + memory.store.trim()  # (through the store: a tensor-parallel leader ships it)

    def _state_bytes(self) -> int:
        return sum(cache.committed_bytes or 0 for cache in self.runner.recurrent.caches)

    def _check_awake(self) -> None:
        if self.asleep:
            raise AsleepError("the engine is asleep (sleep() gave its KV memory back): call wake() first")

    # ---- one step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Decide (schedule, block operations), execute one forward, sample; returns the requests that
        finished in this step. Raises AsleepError between :meth:`sleep` and :meth:`wake`."""
        self._check_awake()
        if self.offload is not None:
            self.offload.poll()
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        if not out.scheduled:
            return []
        self.stats.steps += 1
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.pool.num_used_blocks)
        self.stats.peak_committed_bytes = max(self.stats.peak_committed_bytes, self._committed_bytes())
        self.stats.prefix_hit_tokens += sum(req.num_computed_tokens for req in out.admitted)
        logits = self.runner.execute(self._prepare(out))
        sampling = [req for (req, _), samples in zip(out.scheduled, out.sampled, strict=True) if samples]
        tokens = [sample(logits[j], req.params, req.generator) for j, req in enumerate(sampling)]
        rows = [logits[j].float().cpu() for j in range(len(sampling))] if self.keep_logits else ()
        finished = self.scheduler.update(out, tokens, rows)
        self.stats.generated_tokens += len(tokens)
        self.kv_manager.flush_events()  # this step's KV events, as one batch
        if self.compactor is not None:  # between steps: no kernel reads the tables now
            self.compactor.compact()
        return finished

    def _prepare(self, out: SchedulerOutput) -> StepBatch:
        """The step's decisions as plain data: packed token ids, positions, rows to sample, block tables."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        spans = []
        for (req, n), samples in zip(out.scheduled, out.sampled, strict=True):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            ids += req.token_ids[start:end]
            positions += range(start, end)
            if samples:
                rows.append(len(ids) - 1)
            spans.append((self.kv_manager.block_tables(req), start, end))
        slots, saves = self.state.batch_slots([req for req, _ in out.scheduled])
        return StepBatch(ids, positions, rows, spans, slots, saves)

    def _committed_bytes(self) -> int:
        committed = self.cache.committed_bytes
        return self.cache.nbytes if committed is None else committed

    def memory_stats(self) -> dict[str, Any]:
        """The KV cache's memory in bytes: ``reserved`` (the whole cache: its address space when elastic),
        ``committed`` (physical memory held now: the whole buffer for a fixed cache), ``used`` (blocks in
        use x bytes per block), ``cached`` (cached free blocks x bytes per block: the prefix cache), and
        ``elastic`` (whether committed memory follows the blocks). With an elastic cache, ``committed`` is
        ``used + cached`` rounded up to whole pages per run of blocks, plus the arena's reserve of pages.
        O(1); safe to call from another thread between steps."""
        per_block, pool = self.cache.bytes_per_block, self.pool
        return {"reserved": self.cache.nbytes, "committed": self._committed_bytes(),
                "used": pool.num_used_blocks * per_block, "cached": pool.num_evictable_blocks * per_block,
                "elastic": self.cache.elastic}

    def num_token_slots_used(self) -> int:
        """Token slots holding KV now: the tokens written in each block in use, a block that requests share
        counted once (for the ``kvpool_token_slots_used`` metric; a partly filled block counts its tokens).
        O(blocks in use); safe to call from another thread between steps."""
        return self.kv_manager.num_token_slots_used(self.running)

    # ---- convenience
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 on_step: Callable[[int], None] | None = None, session_id: Hashable | None = None
                 ) -> list[Request]:
        """Run ``prompts`` (token ids) to completion; returns their requests in order. ``on_step(n)`` is told
        the tokens generated by each step (a progress bar). ``session_id``: an open session every prompt is
        a turn of (as :meth:`add_request`'s).

        Raises:
            InvalidArgumentError, OutOfBlocksError: as :meth:`add_request`, or a ``params`` sequence whose
                length differs from ``prompts``; checked for every prompt before any is queued.
            AsleepError: the engine is asleep (nothing queued).
            MemoryLimitError: nothing runs and the memory limit leaves no room for the first waiting request
                (an elastic cache under a limit too small for it, or under a budget another engine holds).
        """
        self._check_awake()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidArgumentError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        checked = [_numbered(i, self._checked, p, sp, 0, session_id)
                   for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True))]
        ids = [self._enqueue(req) for req in checked]
        start = time.perf_counter()
        while self.has_unfinished():
            before, moved = self.stats.generated_tokens, (self.stats.steps, self.stats.preemptions)
            self.step()
            if moved == (self.stats.steps, self.stats.preemptions) and self.kv_manager.memory_refused:
                raise MemoryLimitError(f"request {self.waiting[0].request_id} cannot be admitted although "
                                       "nothing runs: the memory limit leaves no room for its blocks (with "
                                       "a budget shared with another engine, step both engines instead)")
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

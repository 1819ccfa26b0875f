"""The execute side of recurrent hybrids: each recurrent mixer reads and writes its state in the pool's slot.

transformers' recurrent mixers (Gated DeltaNet, KDA, Mamba-2, Mamba-1, LFM2's short convolutions) reach their
state through transformers' ``Cache`` and its linear-attention layers:
:class:`~kvpool.engine.state_cache.SlotStateCache` is such a ``Cache`` whose layers hold one request's slot of
a :class:`~kvpool.storage.state.RecurrentStateCache` as their states, so transformers' own update code writes
the pool in place and every method of the cache protocol is transformers' own. Their torch fallbacks ignore
``cu_seqlens``, so a packed batch would mix the requests' states: :class:`RecurrentStates` replaces each
mixer's ``forward`` (on the instance; the module tree and its weights stay as they are) with one that runs the
original once per request span of the step, with that request's slot, and concatenates the outputs. Outside a
step (a reference ``generate``) the original runs as before.

A span that starts at token 0 is a fresh request: the mixer sees no previous state (it starts from zero, as
transformers' prefill does) and writes the slot. A later span continues from the slot. Mamba-1 cannot
continue a multi-token span from a saved state in transformers (its full-sequence scan ignores the initial
state), so such a span runs token by token through the decode path, which does.

A span may carry **saves** (prefix caching of states, :mod:`kvpool.requests.state_checkpoints`): ``(b,
checkpoint slot)`` with ``start < b <= end``; each mixer then runs the span in pieces cut at every ``b``
and copies its layer's state into the checkpoint slot as it passes ``b``, so the checkpoint holds exactly the
state after the first ``b`` tokens (what a later request restores into its own slot).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvpool.allocators.state_pool import StatePool
from kvpool.engine.sharding_recurrent import RECURRENT_MODEL_TYPES
from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.requests.state_checkpoints import RequestStates, SavePolicy, StateCheckpoints
from kvpool.spec import AttentionKind, KVCacheSpec
from kvpool.spec.memory import ModelMemory
from kvpool.spec.state import HybridSpec, RecurrentStateSpec
from kvpool.storage.arena import ElasticConfig
from kvpool.storage.state import RecurrentStateCache

#: Keyword arguments of the decoder layer's call that a per-request mixer call must not receive: the
#: model's own cache (none in the paged engine), the packed batch's mask, and the paged-attention metadata.
_NOT_PASSED = frozenset({"cache", "cache_params", "past_key_values", "attention_mask", "kvpool_step",
                         "cache_position"})


class RecurrentStates:
    """The recurrent half of a runner: the state buffers and the per-span mixers of one model.

    Args:
        model: a Hugging Face causal LM of a family of :data:`kvpool.spec.state.FAMILIES`.
        spec: its :class:`RecurrentStateSpec` (on this rank).
        num_slots: state slots of the buffers.
        device: where the buffers live.

    Raises:
        ConfigError: a recurrent layer of ``spec`` whose mixer module is not found (or found twice): a
            module with that ``layer_idx`` and a ``conv1d`` / ``conv`` convolution.
    """

    def __init__(self, model: Any, spec: RecurrentStateSpec, num_slots: int,
                 device: torch.device | str = "cpu", *, elastic: bool | ElasticConfig = False) -> None:
        from kvpool.engine.state_cache import SlotStateCache  # imports transformers

        self.spec, self._slot_cache = spec, SlotStateCache
        #: model layer index -> KV cache layer of the attention layers (set by :meth:`for_runner`).
        self.kv_layers: dict[int, int] | None = None
        self.cache = RecurrentStateCache(spec, num_slots, device=device, elastic=elastic)
        if self.cache.elastic:  # every slot committed (reading 0): sleep gives them back, wake commits again
            self.cache.commit_blocks(range(num_slots))
        # (row start, row end, token start, slot, saves)
        self._spans: list[tuple[int, int, int, int, Sequence[tuple[int, int]]]] | None = None
        for layer, module in _mixers(model, spec).items():
            module.forward = self._per_span(module.forward, layer)

    @classmethod
    def for_runner(cls, model: Any, hybrid: HybridSpec, num_slots: int, device: torch.device | str, *,
                   elastic: bool | ElasticConfig = False) -> RecurrentStates:
        """A runner's recurrent half for ``hybrid``: its buffers of ``num_slots`` slots and
        :attr:`kv_layers` (each attention layer's model index -> its KV cache layer)."""
        states = cls(model, hybrid.state, num_slots, device, elastic=elastic)
        states.kv_layers = {m: i for i, m in enumerate(hybrid.attention_layers)}
        return states

    @staticmethod
    def kv_spec(memory: ModelMemory, model: Any) -> KVCacheSpec:
        """The engine's KV spec: the hybrid's attention layers as transformers calls them
        (:func:`execution_kv_spec`)."""
        return execution_kv_spec(memory.require_hybrid(), model)

    def request_states(self, state_save: str | SavePolicy, block_size: int, num_seqs: int, capacity: int,
                       eviction: str) -> RequestStates:
        """The request side of these buffers: a :class:`RequestStates` saving by ``state_save`` over a slot
        pool of ``num_seqs`` request slots and ``capacity`` checkpoint slots (evicted by a fresh policy named
        ``eviction``), moving data in :attr:`cache`. ConfigError for a bad policy."""
        policy = state_save if isinstance(state_save, SavePolicy) else SavePolicy.parse(state_save)
        pool = StatePool(num_seqs + capacity)
        checkpoints = StateCheckpoints(capacity, pool=pool, policy=eviction) if capacity else \
            StateCheckpoints(0)
        return RequestStates(policy, block_size, pool, checkpoints=checkpoints, mover=self.cache)

    @property
    def caches(self) -> tuple[RecurrentStateCache, ...]:
        """The state buffers a runner sleeps, wakes and counts beside its KV cache: ``(cache,)``."""
        return (self.cache,)

    def batch_step(self, batch: Any) -> contextlib.AbstractContextManager[None]:
        """:meth:`step` over a :class:`~kvpool.engine.runner.StepBatch`'s spans, state slots and saves;
        InvalidArgumentError for a batch that names no state slots."""
        if batch.state_slots is None:
            raise InvalidArgumentError("a hybrid model's batch must name each request's state slot")
        spans = [(start, end) for _, start, end in batch.spans]
        return self.step(spans, batch.state_slots, batch.state_saves)

    @contextlib.contextmanager
    def step(self, spans: Sequence[tuple[int, int]], slots: Sequence[int],
             saves: Sequence[Sequence[tuple[int, int]]] | None = None) -> Iterator[None]:
        """Run the forward inside this block as one engine step: request i computes tokens ``spans[i] =
        (start, end)`` (packed back to back, in order) with its state in ``slots[i]``, and saves its state
        after token ``b`` into slot ``c`` for each ``(b, c)`` of ``saves[i]`` (ascending, ``start < b <=
        end``).

        Raises InvalidArgumentError for spans, slots and saves of different lengths, a save outside its
        span or out of order, or a slot out of range."""
        saves = [()] * len(spans) if saves is None else saves
        if not len(spans) == len(slots) == len(saves):
            raise InvalidArgumentError(f"{len(spans)} spans but {len(slots)} state slots and {len(saves)} "
                                       f"lists of saves")
        rows, row = [], 0
        for (start, end), slot, cuts in zip(spans, slots, saves, strict=True):
            for _, c in cuts:
                self.cache.conv_view(self.spec.layers[0], c)  # checks the slot
            bounds = [b for b, _ in cuts]
            if bounds != sorted(set(bounds)) or any(not start < b <= end for b in bounds):
                raise InvalidArgumentError(f"saves at {bounds} are not ascending within ({start}, {end}]")
            self.cache.conv_view(self.spec.layers[0], slot)  # checks the slot
            rows.append((row, row + end - start, start, slot, list(cuts)))
            row += end - start
        self._spans = rows
        try:
            yield
        finally:
            self._spans = None

    def _per_span(self, original: Any, layer: int) -> Any:
        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            if self._spans is None:
                return original(*args, **kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            rest = {k: v for k, v in kwargs.items() if k not in _NOT_PASSED and k != "hidden_states"}
            outputs = [self._run_saving(original, layer, hidden[:, lo:hi], start, slot, saves, rest)
                       for lo, hi, start, slot, saves in self._spans]
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return forward

    def _run_saving(self, original: Any, layer: int, hidden: torch.Tensor, start: int, slot: int,
                    saves: Sequence[tuple[int, int]], rest: dict[str, Any]) -> torch.Tensor:
        """The span in pieces cut at its saves, this layer's state copied into each checkpoint slot."""
        if not saves:
            return self._run(original, layer, hidden, start, slot, rest)
        outputs, done = [], 0
        for b, checkpoint in saves:
            if b - start > done:
                outputs.append(self._run(original, layer, hidden[:, done:b - start], start + done, slot,
                                             rest))
                done = b - start
            self._save(layer, slot, checkpoint)
        if done < hidden.shape[1]:
            outputs.append(self._run(original, layer, hidden[:, done:], start + done, slot, rest))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _save(self, layer: int, slot: int, checkpoint: int) -> None:
        cache = self.cache
        cache.conv_view(layer, checkpoint).copy_(cache.conv_view(layer, slot))
        if cache.ssm is not None:
            cache.ssm_view(layer, checkpoint).copy_(cache.ssm_view(layer, slot))

    def _run(self, original: Any, layer: int, hidden: torch.Tensor, start: int, slot: int,
             rest: dict[str, Any]) -> torch.Tensor:
        if start > 0 and hidden.shape[1] > 1 and not self.spec.resumes_multi_token:
            return torch.cat([self._run(original, layer, hidden[:, t:t + 1], start + t, slot, rest)
                              for t in range(hidden.shape[1])], dim=1)
        cache = self._slot_cache(self.cache, slot, start > 0, layers=(layer,))
        return original(hidden, cache=cache, attention_mask=None, **rest)


class NoRecurrentStates:
    """The recurrent half of the runner of a model without recurrent layers: no state buffers, a step that
    runs the model as it is, every layer an attention layer of the KV cache (``kv_layers`` None)."""

    caches: tuple[RecurrentStateCache, ...] = ()
    kv_layers = None

    @staticmethod
    def for_runner(model: Any, hybrid: Any, num_slots: int, device: torch.device | str, *,
                   elastic: bool | ElasticConfig = False) -> NoRecurrentStates:
        """A runner's recurrent half: this null one (no buffer to allocate)."""
        return NoRecurrentStates()

    @staticmethod
    def kv_spec(memory: ModelMemory, model: Any) -> KVCacheSpec:
        """The engine's KV spec: ``memory.kv`` (ConfigError without attention layers)."""
        return memory.require_kv()

    def request_states(self, state_save: Any, block_size: int, num_seqs: int, capacity: int,
                       eviction: str) -> None:
        """None: no request keeps a state (the request path's side is
        :data:`~kvpool.requests.no_state.NO_STATE`)."""
        return None

    def batch_step(self, batch: Any) -> contextlib.AbstractContextManager[None]:
        """Nothing to route: the model runs unchanged."""
        return contextlib.nullcontext()


def engine_kind(hybrid: HybridSpec | None) -> type[RecurrentStates] | type[NoRecurrentStates]:
    """The engine's class for a model's state (``ModelMemory.hybrid``): :class:`RecurrentStates` for a
    hybrid, else :class:`NoRecurrentStates`. The one place the engine maps the spec's state to its own; the
    runner and the KV spec then ask the class (``for_runner``, ``kv_spec``)."""
    return NoRecurrentStates if hybrid is None else RecurrentStates


def runner_states(model: Any, hybrid: HybridSpec | None, num_slots: int, device: torch.device | str,
                  *, elastic: bool | ElasticConfig = False) -> RecurrentStates | NoRecurrentStates:
    """The recurrent half of a runner: for a hybrid's :class:`HybridSpec`, its :class:`RecurrentStates`
    (``num_slots`` slots, ``kv_layers`` mapping each attention layer's model index to its KV cache layer),
    else :class:`NoRecurrentStates`."""
    return engine_kind(hybrid).for_runner(model, hybrid, num_slots, device, elastic=elastic)


def _mixers(model: Any, spec: RecurrentStateSpec) -> dict[int, torch.nn.Module]:
    """The recurrent mixer module of each layer of ``spec``: the one module with that ``layer_idx`` that owns
    a ``conv1d`` or ``conv`` ``nn.Conv1d`` (every family's mixer does; no attention module does)."""
    found: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        conv = getattr(module, "conv1d", None) or getattr(module, "conv", None)
        if isinstance(conv, torch.nn.Conv1d) and isinstance(getattr(module, "layer_idx", None), int):
            found.setdefault(module.layer_idx, []).append(module)
    for layer in spec.layers:
        if len(found.get(layer, [])) != 1:
            raise ConfigError(f"recurrent layer {layer}: found {len(found.get(layer, []))} mixer modules "
                              f"(a module with layer_idx {layer} and a conv1d / conv), need exactly one")
    return {layer: found[layer][0] for layer in spec.layers}


def hybrid_spec(model: Any, *, block_size: int, dtype: torch.dtype | None = None) -> HybridSpec:
    """The model's :class:`HybridSpec`: :func:`model_memory`'s (ConfigError for a model without recurrent
    state)."""
    return model_memory(model, block_size=block_size, dtype=dtype).require_hybrid()


def model_memory(model: Any, *, block_size: int, dtype: torch.dtype | None = None, tp_size: int = 1
                 ) -> ModelMemory:
    """The model's :class:`~kvpool.spec.memory.ModelMemory`, its config read once: every dtype the model's
    own unless given, except the SSM state: float32, as transformers keeps it (its fallbacks compute the
    state in float32 whatever the model dtype), so the engine's tokens equal transformers' own. At
    ``tp_size`` > 1 ``model`` is this rank's shard (:func:`kvpool.engine.sharding.shard_model`) and the state
    spec this rank's heads; ConfigError for a hybrid whose mixers are not sharded there (a model type
    outside :data:`~kvpool.engine.sharding_recurrent.RECURRENT_MODEL_TYPES`)."""
    name = str(dtype or model.dtype).removeprefix("torch.")
    config = model.config.to_dict()
    return ModelMemory.from_config(config, block_size=block_size, tp_size=tp_size, kv_cache_dtype=name,
                                   conv_dtype=name, ssm_dtype="float32",
                                   shard_state=config.get("model_type") in RECURRENT_MODEL_TYPES)


def engine_kv_spec(memory: ModelMemory, model: Any) -> KVCacheSpec:
    """The KV spec the engine's paged cache holds: ``memory.kv``, or for a recurrent hybrid its attention
    layers' as transformers calls them (:func:`execution_kv_spec`)."""
    return engine_kind(memory.hybrid).kv_spec(memory, model)


def execution_kv_spec(spec: HybridSpec, model: Any) -> KVCacheSpec:
    """The KV spec of the attention layers as transformers' attention calls see them: ``spec.attention``, but
    MLA (Kimi Linear) as the decompressed per-head keys and values transformers passes to the attention
    function (``num_attention_heads`` KV heads of ``qk_nope_head_dim + qk_rope_head_dim``; its values must
    be as wide). Raises ConfigError for a model without attention layers or MLA values of another width."""
    attention = spec.attention
    if attention is None:
        raise ConfigError(f"{spec.model_type} has no attention layers")
    if attention.attention is not AttentionKind.MLA:
        return attention
    config = model.config
    width = config.qk_nope_head_dim + config.qk_rope_head_dim
    if config.v_head_dim != width:
        raise ConfigError(f"MLA values of {config.v_head_dim} and keys of {width} elements cannot share the "
                          f"paged KV cache's head_dim")
    heads = config.num_attention_heads
    return KVCacheSpec(attention.num_layers, heads, width, attention.dtype, attention.block_size,
                       num_attention_heads=heads)


def __getattr__(name: str) -> Any:
    """``SlotStateCache`` lives in :mod:`kvpool.engine.state_cache` (it imports transformers, which the engine
    package does not need to import); the old import path keeps working."""
    if name == "SlotStateCache":
        from kvpool.engine.state_cache import SlotStateCache

        return SlotStateCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

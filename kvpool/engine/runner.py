"""The execute half of an engine step: one step's decisions, as plain data, through the model.

The engine's scheduler *decides* (which requests run, how many tokens each, which blocks they hold) and
writes the outcome into a :class:`StepBatch`; a :class:`ModelRunner` *executes* it: packed tensors, the
attention metadata, one forward, the logits of the rows to sample. The batch is plain lists of ints, so
tensor parallelism ships it as is to the other ranks, whose runners execute the same batch on their shard of
the model and of the KV (:mod:`kvpool.engine.distributed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvpool.engine.attention import build_step_metadata, register_paged_attention
from kvpool.engine.paged_attention import ATTENTION_CHOICES, check_paged_cache, load_paged_kernel
from kvpool.engine.recurrent import NoRecurrentStates, RecurrentStates, runner_states
from kvpool.errors import ConfigError
from kvpool.spec import KVCacheSpec
from kvpool.spec.state import HybridSpec
from kvpool.storage.arena import ElasticConfig
from kvpool.storage.paged import PagedKVCache


@dataclass(frozen=True)
class StepBatch:
    """What one forward needs from the scheduler, for R requests packed back to back (T tokens in all).

    Attributes:
        token_ids: ``[T]`` the new tokens of every request, in order.
        positions: ``[T]`` their positions in their requests.
        sample_rows: ``[S]`` rows of the packed batch whose logits are sampled: the last new token of each
            request whose tokens are all computed after this step (a mid-prefill chunk samples nothing).
        spans: per request ``(tables, start, end)``: it computes tokens ``start .. end - 1`` and
            ``tables[g]`` (its block table in KV cache group g) covers its first ``end`` tokens (entries a
            window left behind hold the null block).
        state_slots: per request, its state slot (recurrent hybrids; see :mod:`kvpool.engine.recurrent`), or
            None for a model without recurrent layers.
        state_saves: per request, ``(b, checkpoint slot)`` pairs: save its state after token ``b`` (a
            recurrent hybrid's prefix caching); None: no saves.
    """

    token_ids: list[int]
    positions: list[int]
    sample_rows: list[int]
    spans: list[tuple[tuple[list[int], ...], int, int]]
    state_slots: list[int] | None = None
    state_saves: list[list[tuple[int, int]]] | None = None


class StepRunner(Protocol):
    """What the engine asks of the runner it executes its steps with: a :class:`ModelRunner`, or a wrapper
    put in front of one with :meth:`~kvpool.engine.engine.LLMEngine.wrap_runner` (a tensor-parallel leader's,
    which ships each batch to its followers first): the KV cache and spec it runs over, the recurrent states
    of a hybrid (:class:`~kvpool.engine.recurrent.NoRecurrentStates` for a model without recurrent layers;
    their ``caches`` are what ``sleep`` / ``wake`` and the memory stats read beside the KV cache), and
    ``execute``."""

    cache: Any
    spec: Any
    recurrent: RecurrentStates | NoRecurrentStates

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """As :meth:`ModelRunner.execute`: the logits ``[S, V]`` of ``batch.sample_rows``."""
        ...

    def sleep(self) -> int:
        """As :meth:`ModelRunner.sleep`."""
        ...

    def wake(self) -> int:
        """As :meth:`ModelRunner.wake`."""
        ...


class ModelRunner:
    """A causal LM (or one tensor-parallel rank's shard of it) with its KV in a :class:`PagedKVCache`.

    Args:
        model: a Hugging Face causal LM in eval mode; :meth:`execute` switches its attention to
            :func:`kvpool.engine.attention.paged_attention` when something else (a reference ``generate``)
            set another one.
        spec: the KV cache of this rank (``spec.num_kv_heads_per_rank`` heads per layer).
        num_blocks: blocks in the cache (the same on every rank).
        hybrid: for an attention / recurrent hybrid, its :class:`~kvpool.spec.state.HybridSpec`: ``spec``
            then covers the attention layers only (``hybrid.attention_layers``, in order) and the runner
            keeps ``num_state_slots`` state slots (:class:`~kvpool.engine.recurrent.RecurrentStates`) that
            each batch names in ``state_slots``.
        attention: ``"gather"`` (gather + SDPA, :mod:`kvpool.engine.attention`) or ``"paged"`` (the
            in-place kernel of :mod:`kvpool.engine.paged_attention`, built or loaded here).
        elastic: False, True or an :class:`~kvpool.storage.arena.ElasticConfig`: the KV cache (and the
            recurrent states) sit on a page arena (:mod:`kvpool.storage.arena`); nothing of the KV cache is
            committed until its blocks are (the request path does it), every state slot is committed here.

    Raises:
        ConfigError: an unknown ``attention``, or ``"paged"`` where its kernel cannot run (a CUDA or fp8
            cache, a KV dtype other than the model's, no C++ compiler).
    """

    def __init__(self, model: Any, spec: KVCacheSpec, num_blocks: int, *, hybrid: HybridSpec | None = None,
                 num_state_slots: int = 0, attention: str = "gather", elastic: bool | ElasticConfig = False
                 ) -> None:
        if attention not in ATTENTION_CHOICES:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {attention!r}")
        self.model, self.spec, self.device, self.attention = model, spec, model.device, attention
        self.cache = PagedKVCache(spec, num_blocks, device=self.device, dtype=spec.dtype, elastic=elastic)
        if attention == "paged":
            for layer in range(self.cache.num_layers):
                check_paged_cache(self.cache.k_cache(layer), self.cache.v_cache(layer), model.dtype)
            load_paged_kernel()
        self.attn_name = register_paged_attention()
        self.recurrent = runner_states(model, hybrid, num_state_slots, self.device, elastic=elastic)
        self.kv_layers = self.recurrent.kv_layers
        #: Every buffer that sleeps, wakes and commits: the KV cache, then the recurrent state buffers.
        self.stores: tuple[Any, ...] = (self.cache, *self.recurrent.caches)

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V into the cache and return the logits ``[S, V]`` of ``batch.sample_rows``."""
        if self.model.config._attn_implementation != self.attn_name:
            self.model.set_attn_implementation(self.attn_name)
        ids, positions, rows = (torch.tensor(v, dtype=torch.int64, device=self.device)
                                for v in ([batch.token_ids], [batch.positions], batch.sample_rows))
        meta = build_step_metadata(self.cache, self.spec.groups, batch.spans, self.device,
                                   kv_layers=self.kv_layers, attention=self.attention)
        with self.recurrent.batch_step(batch):
            return self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=rows,
                              kvpool_step=meta).logits[0]

    def sleep(self) -> int:
        """Give back every page of the elastic KV cache and of the recurrent states (the engine's
        ``sleep``, once no block is used); returns the bytes given back."""
        return sum(store.sleep() for store in self.stores)

    def wake(self) -> int:
        """Commit again what :meth:`sleep` gave back (reading 0); returns the bytes. Raises MemoryLimitError /
        InsufficientMemoryError, everything asleep still, when it cannot be committed."""
        taken = 0
        for i, store in enumerate(self.stores):
            try:
                taken += store.wake()
            except BaseException:
                for woken in self.stores[:i]:
                    woken.sleep()
                raise
        return taken

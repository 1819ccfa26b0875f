"""The execute half of an engine step: one step's decisions, as plain data, through the model.

The engine's scheduler *decides* (which requests run, how many tokens each, which blocks they hold) and
writes the outcome into a :class:`StepBatch`; a :class:`ModelRunner` *executes* it: packed tensors, the
attention metadata, one forward, the logits of the rows to sample. The batch is plain lists of ints, so
tensor parallelism ships it as is to the other ranks, whose runners execute the same batch on their shard of
the model and of the KV (:mod:`kvpool.engine.distributed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvpool.engine.attention import build_step_metadata, register_paged_attention
from kvpool.spec import KVCacheSpec
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
    """

    token_ids: list[int]
    positions: list[int]
    sample_rows: list[int]
    spans: list[tuple[tuple[list[int], ...], int, int]]


class ModelRunner:
    """A causal LM (or one tensor-parallel rank's shard of it) with its KV in a :class:`PagedKVCache`.

    Args:
        model: a Hugging Face causal LM in eval mode; :meth:`execute` switches its attention to
            :func:`kvpool.engine.attention.paged_attention` when something else (a reference ``generate``)
            set another one.
        spec: the KV cache of this rank (``spec.num_kv_heads_per_rank`` heads per layer).
        num_blocks: blocks in the cache (the same on every rank).
    """

    def __init__(self, model: Any, spec: KVCacheSpec, num_blocks: int) -> None:
        self.model, self.spec, self.device = model, spec, model.device
        self.cache = PagedKVCache(spec, num_blocks, device=self.device, dtype=spec.dtype)
        self.attn_name = register_paged_attention()

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V into the cache and return the logits ``[S, V]`` of ``batch.sample_rows``."""
        if self.model.config._attn_implementation != self.attn_name:
            self.model.set_attn_implementation(self.attn_name)
        ids, positions, rows = (torch.tensor(v, dtype=torch.int64, device=self.device)
                                for v in ([batch.token_ids], [batch.positions], batch.sample_rows))
        meta = build_step_metadata(self.cache, self.spec.groups, batch.spans, self.device)
        return self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=rows,
                          kvpool_step=meta).logits[0]

"""Tensor-parallel sharding of a Hugging Face Llama-family model, by hand, in place (Megatron style).

In every decoder layer of a model on ``tp_size`` ranks, rank ``r`` keeps:

* attention: the rows of ``q_proj`` for its query heads ``r * Hq/tp .. (r+1) * Hq/tp - 1`` and the rows of
  ``k_proj`` / ``v_proj`` for the KV heads those queries read (column-parallel), and the matching columns of
  ``o_proj`` (row-parallel). With ``tp <= Hkv`` that is KV heads ``r * Hkv/tp ..``; with ``tp > Hkv`` it is
  the one head ``r // (tp / Hkv)``, replicated on ``tp / Hkv`` ranks, as ``KVCacheSpec.num_kv_heads_per_rank``
  counts it. Query head ``j`` reads KV head ``j // (Hq / Hkv)`` (GQA), so a rank's queries never need
  another rank's KV.
* MLP: rows ``r * I/tp ..`` of ``gate_proj`` and ``up_proj`` (column-parallel) and those columns of
  ``down_proj`` (row-parallel).
* after each row-parallel layer (``o_proj``, ``down_proj``) an all-reduce (sum) of its partial output, then
  the layer's bias: 2 all-reduces per layer. Embeddings, norms and ``lm_head`` stay whole (replicated), so
  every rank computes the same logits.

transformers' own ``tp_plan`` (``base_model_tp_plan``: ``k_proj`` / ``v_proj`` "colwise") is not used: it
shards every weight evenly over the ranks (``Shard(0)``), so with ``tp_size > num_key_value_heads`` each rank
would get a fraction of a KV head instead of a whole replicated one.

Supported: models whose decoder layers have ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``
(Llama, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2 / 3, Llama 4 text with dense ``feed_forward`` MLPs, its
chunked-local layers included), and the recurrent hybrids of
:data:`~kvpool.engine.sharding_recurrent.RECURRENT_MODEL_TYPES` (Qwen3-Next, Qwen3.5 with dense MLPs), whose
layers hold either ``self_attn`` (its ``q_proj`` may carry a gate per head beside each query head: rows ``[q
head_dim, gate head_dim]`` per head, kept together) or a Gated DeltaNet ``linear_attn``, sharded by
:func:`~kvpool.engine.sharding_recurrent.shard_recurrent_mixer`. GPT-2 (a fused ``c_attn``),
mixture-of-experts MLPs and others raise ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.engine.sharding_recurrent import RECURRENT_MODEL_TYPES, shard_recurrent_mixer
from kvpool.errors import ConfigError
from kvpool.spec.memory import ModelMemory

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "llama4_text",
                         *RECURRENT_MODEL_TYPES)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ W_shard^T) + b``: a linear layer whose input features are split over ranks.

    Args:
        weight: ``[out_features, in_features / tp]``, this rank's columns.
        bias: ``[out_features]`` or None, added once, after the reduction.
        all_reduce: sums a tensor over the ranks, in place.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 all_reduce: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        self.all_reduce(y)
        return y if self.bias is None else y + self.bias


def check_shardable(config: Mapping[str, Any], tp_size: int, *, check_heads: bool = True) -> None:
    """Refuse a ``tp_size`` this module cannot shard ``config`` (a Hugging Face config dict) over.

    The KV heads and a hybrid's recurrent heads are checked by making the model's
    :class:`~kvpool.spec.memory.ModelMemory` at ``tp_size``, after every other check. ``check_heads`` False:
    the caller makes that ModelMemory itself next (``kvpool generate``'s one, kept for its ranks), so none
    is made here.

    Raises:
        ConfigError: ``tp_size`` < 1; a model type outside :data:`SUPPORTED_MODEL_TYPES` (for tp_size > 1);
            query heads or ``intermediate_size`` that ``tp_size`` does not divide (more ranks than query
            heads included); KV heads that ``tp_size`` neither divides nor is a multiple of; a hybrid's
            recurrent heads that it does not divide; layers with experts.
    """
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    kind = config.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"tensor parallelism shards {', '.join(SUPPORTED_MODEL_TYPES)} models, "
                          f"not {kind!r}")
    heads = config["num_attention_heads"]
    inner = config.get("intermediate_size_mlp") or config["intermediate_size"]  # Llama 4's dense MLPs
    if heads % tp_size:
        more = " (more ranks than query heads)" if tp_size > heads else ""
        raise ConfigError(f"tp_size {tp_size} does not divide the {heads} query heads{more}")
    if inner % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide intermediate_size {inner}")
    experts, dense = config.get("num_experts") or 0, set(config.get("mlp_only_layers") or ())
    if (experts and len(dense) < config["num_hidden_layers"]) or config.get("moe_layers"):  # Llama 4's too
        experts = experts or config.get("num_local_experts")
        raise ConfigError(f"tensor parallelism shards dense MLPs, not the {experts} experts of {kind!r}")
    if check_heads:  # KV heads: divisible, or replicated; a hybrid's recurrent heads divisible
        ModelMemory.from_config(dict(config), tp_size=tp_size)


def kv_heads_of_rank(num_kv_heads: int, rank: int, tp_size: int) -> range:
    """The KV heads rank ``rank`` holds: ``Hkv/tp`` of them, or the one replicated head when tp > Hkv."""
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def shard_model(model: Any, rank: int, tp_size: int, all_reduce: Callable[[torch.Tensor], None], *,
                check_heads: bool = True) -> Any:
    """Keep rank ``rank``'s shard of every decoder layer of ``model`` (see the module docstring); returns
    ``model``, changed in place. ``tp_size == 1`` changes nothing. ``check_heads``: as
    :func:`check_shardable` (False where the rank was given the model's ModelMemory at ``tp_size``).

    Raises:
        ConfigError: as :func:`check_shardable`, or decoder layers without the projections named above.
    """
    config = model.config.to_dict()
    check_shardable(config, tp_size, check_heads=check_heads)
    if tp_size == 1:
        return model
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    q_heads = range(rank * heads // tp_size, (rank + 1) * heads // tp_size)
    kv = kv_heads_of_rank(kv_heads, rank, tp_size)
    def row_parallel(linear: nn.Linear, columns: slice) -> RowParallelLinear:
        return _row_parallel(linear, columns, all_reduce)

    for layer in _decoder_layers(model):
        attn, mlp = getattr(layer, "self_attn", None), _mlp(layer)
        if attn is not None:
            _shard_attention(attn, q_heads, kv, row_parallel)
        else:
            shard_recurrent_mixer(layer.linear_attn, rank, tp_size, row_parallel, _keep_rows)
        inner = mlp.down_proj.in_features // tp_size
        mlp_rows = slice(rank * inner, (rank + 1) * inner)
        _keep_rows(mlp.gate_proj, mlp_rows)
        _keep_rows(mlp.up_proj, mlp_rows)
        mlp.down_proj = _row_parallel(mlp.down_proj, mlp_rows, all_reduce)
    return model


def _shard_attention(attn: nn.Module, q_heads: range, kv: range,
                     row_parallel: Callable[[nn.Linear, slice], nn.Module]) -> None:
    """Keep query heads ``q_heads`` and KV heads ``kv`` of ``attn``; a gated ``q_proj`` (Qwen3-Next, Qwen3.5:
    ``2 head_dim`` rows per head, the query then its gate) keeps both halves of each of its heads."""
    head_dim = attn.head_dim
    per_head = attn.q_proj.out_features // (attn.o_proj.in_features // head_dim)  # head_dim, or 2x if gated
    q_rows, kv_rows = _head_rows(q_heads, per_head), _head_rows(kv, head_dim)
    _keep_rows(attn.q_proj, q_rows)
    _keep_rows(attn.k_proj, kv_rows)
    _keep_rows(attn.v_proj, kv_rows)
    attn.o_proj = row_parallel(attn.o_proj, _head_rows(q_heads, head_dim))
    attn.num_key_value_groups = len(q_heads) // len(kv)  # what eager/sdpa attention would repeat


def _decoder_layers(model: Any) -> list[nn.Module]:
    """The decoder layers: each with ``mlp.{gate,up,down}_proj`` and either ``self_attn.{q,k,v,o}_proj`` or
    (a recurrent hybrid's) a ``linear_attn`` mixer."""
    def has(module: Any, names: tuple[str, ...]) -> bool:
        return module is not None and all(isinstance(getattr(module, n, None), nn.Linear) for n in names)

    layers = list(getattr(getattr(model, "model", None), "layers", None) or [])
    ok = layers and all(has(_mlp(layer), _MLP)
                        and (has(getattr(layer, "self_attn", None), _ATTENTION)
                             or getattr(layer, "linear_attn", None) is not None)
                        for layer in layers)
    if not ok:
        raise ConfigError(f"cannot shard {type(model).__name__}: its decoder layers lack "
                          f"self_attn.{{q,k,v,o}}_proj (or a linear_attn mixer) or mlp.{{gate,up,down}}_proj")
    return layers


def _mlp(layer: nn.Module) -> Any:
    """A decoder layer's MLP: ``mlp``, or Llama 4's ``feed_forward``."""
    return getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None)


def _head_rows(heads: range, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def _keep_rows(linear: nn.Linear, rows: slice | torch.Tensor) -> None:
    """Column parallelism: keep output features ``rows`` of ``linear`` (weight rows and bias)."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, columns: slice, all_reduce: Callable[[torch.Tensor], None]
                  ) -> RowParallelLinear:
    """Row parallelism: keep input features ``columns`` of ``linear``; its output is reduced over ranks."""
    with torch.no_grad():
        weight = linear.weight[:, columns].clone()
        bias = None if linear.bias is None else linear.bias.clone()
    return RowParallelLinear(weight, bias, all_reduce)

"""Tensor-parallel sharding of a Hugging Face model, by hand, in place (Megatron style).

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

This module is the dispatcher: it shards the attention and dense MLPs itself and hands each other part of a
decoder layer (:data:`_PARTS`) to its own module. Supported (:data:`SUPPORTED_MODEL_TYPES`):

* attention ``self_attn.{q,k,v}_proj`` with ``o_proj`` (or LFM2's ``out_proj``): each layer's own KV heads
  (MiMo-V2-Flash's sliding layers hold twice its full ones), V heads of their own size, attention ``sinks``
  (one logit per query head) sliced to this rank's heads; a gated ``q_proj`` (Qwen3-Next, Qwen3.5: rows ``[q
  head_dim, gate head_dim]`` per head) keeps both halves of each head; Gemma 4's full layers have no
  ``v_proj`` (V = K) and its KV-shared layers no ``k_proj`` (they read their source layer's KV, this rank's
  shard of it);
* dense MLPs (:data:`_DENSE_MLPS`: Llama's ``gate/up/down_proj``, LFM2's ``w1/w3/w2``, Nemotron-H's
  ``up/down_proj`` without a gate, GraniteMoeHybrid's fused ``input_linear``): Llama, SmolLM2, Mistral,
  Qwen2, Qwen3, Gemma 2 / 3 / 4 (Gemma 4's per-layer inputs stay whole), Llama 4 text with dense
  ``feed_forward`` MLPs (its chunked-local layers included);
* fused experts (:data:`EXPERT_MODEL_TYPES`: gpt-oss, MiMo-V2-Flash; Qwen3-Next's and Nemotron-H's expert
  layers): :func:`~kvpool.engine.sharding_experts.shard_experts`, a shared expert as a dense MLP;
* recurrent mixers (:data:`~kvpool.engine.sharding_recurrent.RECURRENT_MODEL_TYPES`): Gated DeltaNet
  (Qwen3-Next, Qwen3.5: :func:`~kvpool.engine.sharding_recurrent.shard_recurrent_mixer`), LFM2's short
  convolutions (:func:`~kvpool.engine.sharding_conv.shard_short_conv`), Mamba-2 (Nemotron-H,
  GraniteMoeHybrid, Bamba, Falcon-H1: :func:`~kvpool.engine.sharding_mamba.shard_mamba2_mixer`).

GPT-2 (``Conv1D`` projections, a fused ``c_attn``) is sharded by
:func:`~kvpool.engine.sharding_gpt2.shard_gpt2`.
Other model types (Jamba, Kimi Linear, OLMo hybrid, ...) and Llama 4's or GraniteMoeHybrid's experts
raise ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.engine.sharding_conv import shard_short_conv
from kvpool.engine.sharding_experts import expert_sizes, is_experts_block, shard_experts
from kvpool.engine.sharding_gpt2 import GPT2_MODEL_TYPES, gpt2_sizes, shard_gpt2
from kvpool.engine.sharding_mamba import shard_mamba2_mixer
from kvpool.engine.sharding_recurrent import RECURRENT_MODEL_TYPES, shard_recurrent_mixer
from kvpool.errors import ConfigError
from kvpool.spec.memory import ModelMemory

#: Model types whose layers hold fused experts (:mod:`kvpool.engine.sharding_experts`).
EXPERT_MODEL_TYPES = ("gpt_oss", "mimo_v2_flash")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma4_text",
                         "llama4_text", *EXPERT_MODEL_TYPES, *GPT2_MODEL_TYPES, *RECURRENT_MODEL_TYPES)


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
            recurrent heads or experts' intermediate sizes that it does not divide, Mamba-2 groups it neither
            divides nor is a multiple of; Llama 4's and GraniteMoeHybrid's experts.
    """
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    kind = config.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"tensor parallelism shards {', '.join(SUPPORTED_MODEL_TYPES)} models, "
                          f"not {kind!r}")
    if kind in GPT2_MODEL_TYPES:
        heads, inner = gpt2_sizes(dict(config))
    else:
        heads = config["num_attention_heads"]
        inner = config.get("intermediate_size_mlp") or config["intermediate_size"]  # Llama 4's dense MLPs
    if heads % tp_size:
        more = " (more ranks than query heads)" if tp_size > heads else ""
        raise ConfigError(f"tp_size {tp_size} does not divide the {heads} query heads{more}")
    if inner % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide intermediate_size {inner}")
    for name, size in expert_sizes(config).items():
        if size % tp_size:
            raise ConfigError(f"tp_size {tp_size} does not divide the experts' {name} {size}")
    # Llama 4's and GraniteMoeHybrid's experts: not of transformers' fused layout
    if config.get("moe_layers") or (kind == "granitemoehybrid" and config.get("num_local_experts")):
        raise ConfigError(f"tensor parallelism shards dense MLPs and fused experts, not the "
                          f"{config.get('num_local_experts')} experts of {kind!r}")
    if check_heads:  # KV heads: divisible, or replicated; a hybrid's recurrent heads and groups fit
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
        ConfigError: as :func:`check_shardable`, or decoder layers without the parts named above.
    """
    config = model.config.to_dict()
    check_shardable(config, tp_size, check_heads=check_heads)
    if tp_size == 1:
        return model
    def row_parallel(linear: nn.Linear, columns: slice) -> RowParallelLinear:
        return _row_parallel(linear, columns, all_reduce)

    if config.get("model_type") in GPT2_MODEL_TYPES:  # Conv1D projections, a fused c_attn
        shard_gpt2(model, rank, tp_size, row_parallel, _keep_rows)
        return model
    heads = config["num_attention_heads"]

    def shard_part(part: nn.Module) -> None:
        if _has(part, ("q_proj",)):
            _shard_attention(part, heads, rank, tp_size, row_parallel)
        elif is_experts_block(part):
            shard_experts(part.experts, rank, tp_size, all_reduce)
            for name in ("shared_expert", "shared_experts"):  # Qwen3-Next's (its gate whole), Nemotron-H's
                if isinstance(getattr(part, name, None), nn.Module):
                    shard_part(getattr(part, name))
        elif _dense_mlp(part) is not None:
            _shard_dense_mlp(part, rank, tp_size, all_reduce)
        elif hasattr(part, "A_log") and hasattr(part, "n_groups"):
            shard_mamba2_mixer(part, rank, tp_size, row_parallel, _keep_rows, all_reduce)
        elif hasattr(part, "A_log"):
            shard_recurrent_mixer(part, rank, tp_size, row_parallel, _keep_rows)
        elif hasattr(part, "in_proj") and hasattr(part, "conv"):
            shard_short_conv(part, rank, tp_size, row_parallel, _keep_rows)
        else:
            raise ConfigError(f"cannot shard {type(part).__name__}: not an attention, MLP, experts, Gated "
                              f"DeltaNet, Mamba-2 or short-convolution module of transformers' layout")

    for parts in _decoder_layers(model):
        for part in parts:
            shard_part(part)
    return model


def _has(module: Any, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


#: A dense MLP's (gate or None, up, down) linear layers, by family: Llama's, LFM2's, Nemotron-H's (no gate),
#: GraniteMoeHybrid's shared MLP (one ``input_linear`` of rows ``[gate I, up I]``: gate None, up it).
_DENSE_MLPS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), (None, "up_proj", "down_proj"),
               (None, "input_linear", "output_linear"))


def _dense_mlp(module: Any) -> tuple[str | None, str, str] | None:
    """The names of ``module``'s dense MLP linear layers (:data:`_DENSE_MLPS`), or None."""
    return next((names for names in _DENSE_MLPS if _has(module, tuple(n for n in names if n))), None)


def _shard_dense_mlp(mlp: nn.Module, rank: int, tp_size: int,
                     all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Rows ``r I/tp ..`` of the gate and up projections (GraniteMoeHybrid's fused ``input_linear``: those
    rows of each half), those columns of a row-parallel down projection."""
    gate, up, down = _dense_mlp(mlp) or ("", "", "")
    if getattr(mlp, down).in_features % tp_size:  # LFM2 sizes its MLPs apart from intermediate_size
        raise ConfigError(f"tp_size {tp_size} does not divide the {getattr(mlp, down).in_features} "
                          f"intermediate features of {type(mlp).__name__}")
    inner = getattr(mlp, down).in_features // tp_size
    rows = torch.arange(rank * inner, (rank + 1) * inner)
    if gate is not None:
        _keep_rows(getattr(mlp, gate), rows)
    fused = getattr(mlp, up).out_features == 2 * tp_size * inner  # [gate I, up I] in one layer
    _keep_rows(getattr(mlp, up), torch.cat([rows, tp_size * inner + rows]) if fused else rows)
    setattr(mlp, down, _row_parallel(getattr(mlp, down), slice(rank * inner, (rank + 1) * inner), all_reduce))


def _shard_attention(attn: nn.Module, heads: int, rank: int, tp_size: int,
                     row_parallel: Callable[[nn.Linear, slice], nn.Module]) -> None:
    """Keep rank ``rank``'s query heads of the ``heads`` and the KV heads they read, of this layer (its own
    KV head count: MiMo-V2-Flash's sliding layers have twice its full ones; its V heads may be narrower than
    its K heads). A gated ``q_proj`` (Qwen3-Next, Qwen3.5: ``2 head_dim`` rows per head, the query then its
    gate) keeps both halves of each of its heads; attention sinks (gpt-oss, MiMo-V2-Flash: ``sinks``, one
    logit per query head) keep this rank's heads. The output projection: ``o_proj``, or LFM2's
    ``out_proj``."""
    head_dim = attn.head_dim
    q_heads = range(rank * heads // tp_size, (rank + 1) * heads // tp_size)
    per_head = attn.q_proj.out_features // heads  # head_dim, or 2x if gated
    _keep_rows(attn.q_proj, _head_rows(q_heads, per_head))
    k_proj, v_proj = getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)
    v_dim = head_dim
    if isinstance(k_proj, nn.Linear):  # none in Gemma 4's KV-shared layers (their source's KV shard serves)
        kv_heads = k_proj.out_features // head_dim
        kv = kv_heads_of_rank(kv_heads, rank, tp_size)
        _keep_rows(k_proj, _head_rows(kv, head_dim))
        attn.num_key_value_groups = len(q_heads) // len(kv)  # what eager/sdpa attention would repeat
        if isinstance(v_proj, nn.Linear):  # none in Gemma 4's full layers: V = K
            v_dim = v_proj.out_features // kv_heads
            _keep_rows(v_proj, _head_rows(kv, v_dim))
    out = "o_proj" if isinstance(getattr(attn, "o_proj", None), nn.Linear) else "out_proj"
    setattr(attn, out, row_parallel(getattr(attn, out), _head_rows(q_heads, v_dim)))
    sinks = getattr(attn, "sinks", None)
    if isinstance(sinks, torch.Tensor):
        with torch.no_grad():
            attn.sinks = nn.Parameter(sinks[q_heads.start:q_heads.stop].clone(), requires_grad=False)


#: A decoder layer's parts, by attribute: its mixers (attention, Gated DeltaNet, LFM2's short convolution,
#: Mamba-2; Nemotron-H's one ``mixer`` is any of attention, Mamba-2 or an MLP) and its feed-forward modules.
_PARTS = ("self_attn", "linear_attn", "conv", "mamba", "mixer", "mlp", "feed_forward", "shared_mlp")


def _decoder_layers(model: Any) -> list[list[nn.Module]]:
    """Each decoder layer's parts (:data:`_PARTS`), at least one each."""
    layers = list(getattr(getattr(model, "model", None), "layers", None) or [])
    parts = [[p for name in _PARTS if isinstance(p := getattr(layer, name, None), nn.Module)]
             for layer in layers]
    if not layers or not all(parts):
        raise ConfigError(f"cannot shard {type(model).__name__}: its decoder layers hold none of "
                          f"{', '.join(_PARTS)}")
    return parts


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

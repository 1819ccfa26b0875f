"""Tensor-parallel sharding of a mixture-of-experts layer, by hand, in place: every expert's MLP sharded as a
dense MLP is.

An expert of intermediate size ``I`` on ``tp`` ranks: rank ``r`` keeps its gate and up units ``r I/tp ..
(r+1) I/tp - 1`` (column-parallel) and those input features of its down projection (row-parallel), for every
expert; the router stays whole (replicated), so every rank picks the same experts with the same weights. A
rank's expert output is then a partial sum of the whole expert's, and the experts module's output (summed over
the chosen experts, each scaled by its routing weight) one all-reduce (a forward hook on the experts module)
away from the whole layer's. A down-projection bias is kept on rank 0 only (zeros elsewhere), so the sum adds
it once, scaled by the routing weight as transformers adds it.

transformers 5.x keeps the experts of a layer as fused 3-D parameters (the classes decorated by
``transformers.integrations.moe.use_experts_implementation``, whose flags say the layout); layouts followed
(transformers 5.25.0, the release of :data:`~kvpool.engine.state_cache.TESTED_TRANSFORMERS` tested):

* ``is_transposed`` False (MiMo-V2-Flash, Qwen3-Next, the decorator's default): ``gate_up_proj`` ``[E, 2I,
  H]``, ``down_proj`` ``[E, H, I]``;
* ``is_transposed`` True (gpt-oss): ``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``;
* ``is_concatenated`` True: the ``2I`` features are ``[gate I, up I]``; False (gpt-oss): interleaved, unit
  ``j``'s gate at ``2j`` and its up at ``2j + 1``;
* ``has_gate`` False (Nemotron-H): ``up_proj`` ``[E, I, H]`` in place of ``gate_up_proj``;
* ``has_bias`` (gpt-oss): ``gate_up_proj_bias`` ``[E, 2I]`` (sliced as the ``2I`` features),
  ``down_proj_bias`` ``[E, H]`` (rank 0's only).

An experts module without these attributes, or with a post-expert norm (``has_post_expert_norm``: a norm of
each whole expert's output, which a partial sum cannot give), is refused with a ConfigError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvpool.errors import ConfigError

_LAYOUT = ("down_proj", "is_transposed", "is_concatenated", "has_bias", "has_gate")


def is_experts_block(mlp: Any) -> bool:
    """Whether ``mlp`` (a decoder layer's feed-forward module) holds fused experts: an ``experts`` module
    with a 3-D ``gate_up_proj``."""
    experts = getattr(mlp, "experts", None)
    weight = getattr(experts, "gate_up_proj", None)
    weight = getattr(experts, "up_proj", None) if weight is None else weight
    return isinstance(weight, torch.Tensor) and weight.dim() == 3


def expert_sizes(config: dict[str, Any]) -> dict[str, int]:
    """The intermediate sizes of a Hugging Face config dict's experts that tensor parallelism splits, by
    name: ``moe_intermediate_size`` (MiMo-V2-Flash, Qwen3-Next, Nemotron-H), the shared expert's
    (``shared_expert_intermediate_size``, ``moe_shared_expert_intermediate_size``), gpt-oss's
    ``intermediate_size`` (its only MLPs are experts); empty for a model without experts."""
    names = ["moe_intermediate_size", "shared_expert_intermediate_size",
             "moe_shared_expert_intermediate_size"]
    if config.get("model_type") == "gpt_oss":
        names.append("intermediate_size")
    return {name: config[name] for name in names if config.get(name)}


def shard_experts(experts: nn.Module, rank: int, tp_size: int,
                  all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Keep rank ``rank``'s units of every expert of ``experts`` (see the module docstring), in place, and
    sum its output over the ranks after each forward.

    Raises:
        ConfigError: an experts module of another layout (see the module docstring), or an intermediate
            size ``tp_size`` does not divide.
    """
    missing = [name for name in _LAYOUT if getattr(experts, name, None) is None]
    if missing or getattr(experts, "has_post_expert_norm", False):
        why = f"no {', '.join(missing)}" if missing else "a post-expert norm"
        raise ConfigError(f"cannot shard {type(experts).__name__}: not fused experts of transformers' layout "
                          f"({why})")
    transposed, up = experts.is_transposed, "gate_up_proj" if experts.has_gate else "up_proj"
    up_dim = 2 if transposed else 1
    inner = experts.down_proj.shape[1 if transposed else 2]
    if inner % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide the experts' intermediate size {inner}")
    per_rank = inner // tp_size
    units = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    if not experts.has_gate:
        features = units
    elif experts.is_concatenated:
        features = torch.cat([units, inner + units])
    else:
        features = torch.stack([2 * units, 2 * units + 1], dim=-1).flatten()
    with torch.no_grad():
        _keep(experts, up, up_dim, features)
        _keep(experts, "down_proj", 1 if transposed else 2, units)
        if experts.has_bias:
            _keep(experts, f"{up}_bias", 1, features)
            if rank:
                experts.down_proj_bias.zero_()
    for name in ("intermediate_dim", "intermediate_size"):  # what the eager forward may size with
        if isinstance(getattr(experts, name, None), int):
            setattr(experts, name, per_rank)
    experts.register_forward_hook(_summed_over_ranks(all_reduce))


def _keep(module: nn.Module, name: str, dim: int, index: torch.Tensor) -> None:
    """Replace parameter ``name`` of ``module`` by its slice ``index`` along ``dim``."""
    kept = getattr(module, name).index_select(dim, index).clone()
    setattr(module, name, nn.Parameter(kept, requires_grad=False))


def _summed_over_ranks(all_reduce: Callable[[torch.Tensor], None]) -> Callable[..., None]:
    """A forward hook that sums the module's output tensor over the ranks, in place."""
    def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        all_reduce(output)
    return hook

"""Tensor-parallel sharding of GPT-2, by hand, in place: its fused ``c_attn`` split by head.

GPT-2's projections are ``transformers.pytorch_utils.Conv1D`` (``y = x @ W + b``, ``W`` of ``[in, out]``: a
linear layer's weight transposed). Each is first turned into the ``nn.Linear`` computing the same (``W^T``),
then sharded as the Llama layout is (:mod:`kvpool.engine.sharding`): of ``c_attn``'s ``[q H, k H, v H]``
output features (``H = n_embd``, ``n_head`` heads of ``H / n_head``) rank ``r`` keeps its heads' rows of each
third (column-parallel); ``attn.c_proj`` is row-parallel over those heads' features; the MLP's ``c_fc`` keeps
rows ``r I/tp ..`` (``I = n_inner`` or ``4 H``) and its ``c_proj`` those input features (row-parallel). The
attention module's ``split_size`` (the width of each of q, k, v) and ``num_heads`` become this rank's.

Layout followed (transformers 5.25.0, the release of :data:`~kvpool.engine.state_cache.TESTED_TRANSFORMERS`
tested: the decoder blocks ``transformer.h``, each with ``attn.{c_attn,c_proj}`` and ``mlp.{c_fc,c_proj}``); a
model without it, or with cross-attention (``q_attn``), is refused with a ConfigError."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvpool.errors import ConfigError

#: Model types :func:`shard_gpt2` shards.
GPT2_MODEL_TYPES = ("gpt2",)


def gpt2_sizes(config: dict[str, Any]) -> tuple[int, int]:
    """(query heads, MLP intermediate size) of a GPT-2 config dict: ``n_head``, ``n_inner`` or ``4 n_embd``
    (transformers' ``GPT2Block`` default)."""
    return config["n_head"], config.get("n_inner") or 4 * config["n_embd"]


def shard_gpt2(model: Any, rank: int, tp_size: int, row_parallel: Callable[[nn.Linear, slice], nn.Module],
               keep_rows: Callable[[nn.Linear, slice | torch.Tensor], None]) -> None:
    """Keep rank ``rank``'s heads and MLP units of every block of the GPT-2 ``model`` (see the module
    docstring), in place.

    Args:
        row_parallel: makes a linear layer row-parallel over the given input features (the caller's
            all-reduce: :func:`kvpool.engine.sharding._row_parallel`).
        keep_rows: keeps the given output features of a linear layer (column parallelism).

    Raises:
        ConfigError: a model of another layout.
    """
    blocks = list(getattr(getattr(model, "transformer", None), "h", None) or [])
    names = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    if not blocks or any(_conv(block, name) is None for block in blocks for name in names) or any(
            getattr(block.attn, "q_attn", None) is not None for block in blocks):
        raise ConfigError(f"cannot shard {type(model).__name__}: not GPT-2's layout (transformer.h blocks of "
                          f"{', '.join(names)}, no cross-attention)")
    for block in blocks:
        attn, mlp = block.attn, block.mlp
        width = attn.embed_dim // tp_size  # this rank's heads' features in each of q, k, v
        mine = torch.arange(rank * width, (rank + 1) * width)
        attn.c_attn = _as_linear(attn.c_attn)
        keep_rows(attn.c_attn, torch.cat([mine, attn.embed_dim + mine, 2 * attn.embed_dim + mine]))
        attn.c_proj = row_parallel(_as_linear(attn.c_proj), slice(rank * width, (rank + 1) * width))
        attn.split_size, attn.num_heads = width, attn.num_heads // tp_size
        inner = mlp.c_fc.nf // tp_size
        mlp.c_fc = _as_linear(mlp.c_fc)
        keep_rows(mlp.c_fc, slice(rank * inner, (rank + 1) * inner))
        mlp.c_proj = row_parallel(_as_linear(mlp.c_proj), slice(rank * inner, (rank + 1) * inner))


def _conv(block: nn.Module, path: str) -> Any:
    """``block``'s module at ``path`` when it is a ``Conv1D`` (a 2-D ``weight``, a ``bias``, ``nf``)."""
    module: Any = block
    for name in path.split("."):
        module = getattr(module, name, None)
    weight = getattr(module, "weight", None)
    ok = isinstance(weight, torch.Tensor) and weight.dim() == 2
    return module if ok and isinstance(getattr(module, "nf", None), int) else None


def _as_linear(conv: Any) -> nn.Linear:
    """The ``nn.Linear`` computing what the ``Conv1D`` ``conv`` computes (weight transposed)."""
    nx, nf = conv.weight.shape
    linear = nn.Linear(nx, nf, bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    return linear.requires_grad_(False)

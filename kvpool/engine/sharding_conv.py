"""Tensor-parallel sharding of a short-convolution mixer (LFM2), by hand, in place: its channels split over
the ranks, its conv state with them.

LFM2's ``Lfm2ShortConv`` over ``H`` channels (``hidden_size``) computes ``y = out_proj(C * conv(B * x))``,
with ``[B, C, x] = in_proj(h)`` (rows ``[B H, C H, x H]``) and a depthwise causal ``conv`` (one filter per
channel): every channel is computed from its own ``B``, ``C`` and ``x`` row alone. On ``tp`` ranks rank ``r``
keeps channels ``r H/tp .. (r+1) H/tp - 1``: those rows of each third of ``in_proj`` (column-parallel), those
filters of the conv, so its conv state holds ``H / tp`` channels (the shape
:class:`~kvpool.spec.state.RecurrentStateSpec` gives per rank, in this rank's own state slots), and those
input features of ``out_proj`` (row-parallel: an all-reduce, as the attention's output projection).

Layout followed (transformers 5.25.0, the release of :data:`~kvpool.engine.state_cache.TESTED_TRANSFORMERS`
tested; a mixer without ``in_proj``, ``out_proj`` and a depthwise ``conv`` of ``H`` channels is refused with a
ConfigError)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvpool.errors import ConfigError

#: Model types whose short-convolution mixers :func:`shard_short_conv` shards.
SHORT_CONV_MODEL_TYPES = ("lfm2",)


def shard_short_conv(mixer: nn.Module, rank: int, tp_size: int,
                     row_parallel: Callable[[nn.Linear, slice], nn.Module],
                     keep_rows: Callable[[nn.Linear, slice | torch.Tensor], None]) -> None:
    """Keep rank ``rank``'s channels of the short-convolution ``mixer`` (see the module docstring), in place.

    Args:
        row_parallel: makes a linear layer row-parallel over the given input features (the caller's
            all-reduce: :func:`kvpool.engine.sharding._row_parallel`).
        keep_rows: keeps the given output features of a linear layer (column parallelism).

    Raises:
        ConfigError: a mixer of another layout, or channels ``tp_size`` does not divide.
    """
    conv, in_proj = getattr(mixer, "conv", None), getattr(mixer, "in_proj", None)
    ok = (isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels
          and isinstance(in_proj, nn.Linear) and in_proj.out_features == 3 * conv.in_channels
          and isinstance(getattr(mixer, "out_proj", None), nn.Linear))
    if not ok:
        raise ConfigError(f"cannot shard {type(mixer).__name__}: not a short convolution of transformers' "
                          f"layout (in_proj of [B, C, x], a depthwise conv, out_proj)")
    channels = conv.in_channels
    if channels % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide the {channels} short-convolution channels")
    per_rank = channels // tp_size
    mine = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    keep_rows(in_proj, torch.cat([mine, channels + mine, 2 * channels + mine]))
    keep_conv_channels(conv, mine)
    mixer.out_proj = row_parallel(mixer.out_proj, slice(rank * per_rank, (rank + 1) * per_rank))


def keep_conv_channels(conv: nn.Conv1d, channels: torch.Tensor) -> None:
    """Keep ``channels`` of a depthwise convolution (weight ``[C, 1, K]``, one group per channel)."""
    with torch.no_grad():
        conv.weight = nn.Parameter(conv.weight[channels].clone(), requires_grad=False)
        if conv.bias is not None:
            conv.bias = nn.Parameter(conv.bias[channels].clone(), requires_grad=False)
    conv.in_channels = conv.out_channels = conv.groups = len(channels)

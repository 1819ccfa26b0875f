"""Tensor-parallel sharding of a Mamba-2 mixer (Nemotron-H, GraniteMoeHybrid, Bamba, Falcon-H1), by hand, in
place: its heads and groups split over the ranks, its state with them.

A Mamba-2 mixer of ``nh`` heads of ``hd`` (``I = nh hd`` channels), ``g`` groups of ``N`` state (head ``j``
reads the ``B`` and ``C`` of group ``j // (nh / g)``) projects ``in_proj(h)`` to ``[z I, x I, B g N, C g N, dt
nh]`` and convolves ``[x, B, C]`` (``conv_dim`` channels, depthwise). On ``tp`` ranks rank ``r`` keeps heads
``r nh/tp ..`` and the groups they read, ``r g/tp ..``: those rows of ``z``, ``x``, ``B``, ``C`` and ``dt``
(column-parallel), those conv filters (so its conv state holds ``(I + 2 g N) / tp`` channels and its SSM state
``nh / tp`` heads: the shapes :class:`~kvpool.spec.state.RecurrentStateSpec` gives per rank, held in this
rank's own state slots), ``dt_bias``, ``A_log`` and ``D`` of its heads, the gated RMS norm's weight of its
channels, and those input features of ``out_proj`` (row-parallel: one all-reduce). The gated norm normalizes
each group's channels (``group_size = I / g``), so a rank holding whole groups normalizes as the whole model
does: ``tp`` must divide ``g`` (a model with fewer groups than ranks, such as one group, would need the norm's
sum of squares reduced across ranks; it is refused with a ConfigError).

Layout followed (transformers 5.25.0, the release of :data:`~kvpool.engine.state_cache.TESTED_TRANSFORMERS`
tested; a mixer without the attributes of :data:`_MAMBA2` is refused with a ConfigError). Falcon-H1's
``mup_vector`` (a multiplier per ``in_proj`` row) keeps the same rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvpool.engine.sharding_conv import keep_conv_channels
from kvpool.errors import ConfigError

#: Model types whose Mamba-2 mixers :func:`shard_mamba2_mixer` shards, and the config key of their groups.
MAMBA2_GROUPS = {"nemotron_h": "n_groups", "granitemoehybrid": "mamba_n_groups", "bamba": "mamba_n_groups",
                 "falcon_h1": "mamba_n_groups"}
MAMBA2_MODEL_TYPES = tuple(MAMBA2_GROUPS)
_MAMBA2 = ("in_proj", "conv1d", "out_proj", "dt_bias", "A_log", "D", "norm", "num_heads", "n_groups",
           "head_dim", "ssm_state_size", "intermediate_size", "conv_dim")


def check_mamba2_groups(config: dict[str, Any], tp_size: int) -> None:
    """ConfigError when ``tp_size`` does not divide a Mamba-2 model's groups (``config``: a Hugging Face
    config dict; other model types pass)."""
    key = MAMBA2_GROUPS.get(config.get("model_type", ""))
    groups = config.get(key or "", 1) or 1
    if key is not None and groups % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide the {groups} Mamba-2 groups of "
                          f"{config['model_type']!r} ({key}): each rank's gated norm needs whole groups")


def shard_mamba2_mixer(mixer: nn.Module, rank: int, tp_size: int,
                       row_parallel: Callable[[nn.Linear, slice], nn.Module],
                       keep_rows: Callable[[nn.Linear, slice | torch.Tensor], None]) -> None:
    """Keep rank ``rank``'s heads and groups of the Mamba-2 ``mixer`` (see the module docstring), in place.

    Args:
        row_parallel: makes a linear layer row-parallel over the given input features (the caller's
            all-reduce: :func:`kvpool.engine.sharding._row_parallel`).
        keep_rows: keeps the given output features of a linear layer (column parallelism).

    Raises:
        ConfigError: a mixer of another layout, or heads or groups ``tp_size`` does not divide.
    """
    if missing := [name for name in _MAMBA2 if getattr(mixer, name, None) is None]:
        raise ConfigError(f"cannot shard {type(mixer).__name__}: not a Mamba-2 mixer of transformers' layout "
                          f"(no {', '.join(missing)})")
    heads, groups, inner = mixer.num_heads, mixer.n_groups, mixer.intermediate_size
    if heads % tp_size or groups % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide the {heads} heads and {groups} groups of a "
                          f"Mamba-2 layer: each rank's gated norm needs whole groups")
    per_group = groups // tp_size * mixer.ssm_state_size
    x = _range(rank, inner // tp_size)
    bc = _range(rank, per_group)
    state = groups * mixer.ssm_state_size
    conv = torch.cat([x, inner + bc, inner + state + bc])  # this rank's [x, B, C] channels
    mine = _range(rank, heads // tp_size)
    rows = torch.cat([x, inner + conv, inner + mixer.conv_dim + mine])  # [z, xBC, dt]
    keep_rows(mixer.in_proj, rows)
    keep_conv_channels(mixer.conv1d, conv)
    with torch.no_grad():
        for name in ("dt_bias", "A_log", "D"):
            setattr(mixer, name, nn.Parameter(getattr(mixer, name)[mine].clone(), requires_grad=False))
        if isinstance(getattr(mixer.norm, "weight", None), torch.Tensor):
            mixer.norm.weight = nn.Parameter(mixer.norm.weight[x].clone(), requires_grad=False)
        if isinstance(getattr(mixer, "mup_vector", None), torch.Tensor):  # Falcon-H1
            mixer.mup_vector = mixer.mup_vector[..., rows].clone()
    mixer.out_proj = row_parallel(mixer.out_proj, slice(x[0].item(), x[-1].item() + 1))
    mixer.num_heads, mixer.n_groups = heads // tp_size, groups // tp_size
    mixer.intermediate_size, mixer.conv_dim = inner // tp_size, len(conv)
    if hasattr(mixer, "groups_time_state_size"):  # Falcon-H1
        mixer.groups_time_state_size = per_group


def _range(rank: int, per_rank: int) -> torch.Tensor:
    return torch.arange(rank * per_rank, (rank + 1) * per_rank)

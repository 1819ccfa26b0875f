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
does. With fewer groups than ranks (``tp`` a multiple of ``g``; Bamba, Granite 4.0-H and Falcon-H1 have one)
each group is replicated on ``tp / g`` ranks, as vLLM does (the per-rank state spec counts ``max(g, tp)``
groups): a rank keeps its group's whole ``B`` and ``C`` and its heads' part of the group's channels, and its
gated norm (:class:`SharedGroupGatedNorm`) adds the group's sum of squares over the ranks sharing it.

Layout followed (transformers 5.25.0, the release of :data:`~kvpool.engine.state_cache.TESTED_TRANSFORMERS`
tested; a mixer without the attributes of :data:`_MAMBA2` is refused with a ConfigError). Falcon-H1's
``mup_vector`` (a multiplier per ``in_proj`` row) keeps the same rows."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvpool.engine.sharding_conv import keep_conv_channels
from kvpool.errors import ConfigError

#: Model types whose Mamba-2 mixers :func:`shard_mamba2_mixer` shards.
MAMBA2_MODEL_TYPES = ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1")
_MAMBA2 = ("in_proj", "conv1d", "out_proj", "dt_bias", "A_log", "D", "norm", "num_heads", "n_groups",
           "head_dim", "ssm_state_size", "intermediate_size", "conv_dim")


def shard_mamba2_mixer(mixer: nn.Module, rank: int, tp_size: int,
                       row_parallel: Callable[[nn.Linear, slice], nn.Module],
                       keep_rows: Callable[[nn.Linear, slice | torch.Tensor], None],
                       all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Keep rank ``rank``'s heads and groups of the Mamba-2 ``mixer`` (see the module docstring), in place.

    Args:
        row_parallel: makes a linear layer row-parallel over the given input features (the caller's
            all-reduce: :func:`kvpool.engine.sharding._row_parallel`).
        keep_rows: keeps the given output features of a linear layer (column parallelism).
        all_reduce: sums a tensor over the ranks, in place (the gated norm of a group several ranks share).

    Raises:
        ConfigError: a mixer of another layout, heads ``tp_size`` does not divide, or groups it neither
            divides nor is a multiple of.
    """
    if missing := [name for name in _MAMBA2 if getattr(mixer, name, None) is None]:
        raise ConfigError(f"cannot shard {type(mixer).__name__}: not a Mamba-2 mixer of transformers' layout "
                          f"(no {', '.join(missing)})")
    heads, groups, inner = mixer.num_heads, mixer.n_groups, mixer.intermediate_size
    if heads % tp_size or (groups % tp_size and tp_size % groups):
        raise ConfigError(f"tp_size {tp_size} does not divide the {heads} heads, or neither divides nor is a "
                          f"multiple of the {groups} groups, of a Mamba-2 layer")
    shared = groups < tp_size  # each group spread over tp / g ranks: this rank keeps its one group whole
    group = rank // (tp_size // groups) if shared else rank
    per_group = (1 if shared else groups // tp_size) * mixer.ssm_state_size
    x = _range(rank, inner // tp_size)
    bc = _range(group, per_group)
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
    if shared and hasattr(mixer.norm, "group_size"):
        mixer.norm = SharedGroupGatedNorm(mixer.norm, group, groups, all_reduce)
    mixer.out_proj = row_parallel(mixer.out_proj, slice(x[0].item(), x[-1].item() + 1))
    mixer.num_heads, mixer.n_groups = heads // tp_size, max(1, groups // tp_size)
    mixer.intermediate_size, mixer.conv_dim = inner // tp_size, len(conv)
    if hasattr(mixer, "groups_time_state_size"):  # Falcon-H1
        mixer.groups_time_state_size = per_group


def _range(rank: int, per_rank: int) -> torch.Tensor:
    return torch.arange(rank * per_rank, (rank + 1) * per_rank)


class SharedGroupGatedNorm(nn.Module):
    """A Mamba-2 mixer's gated RMS norm on a rank holding part of one group (``g < tp``): ``y = w * h /
    sqrt(mean_group(h^2) + eps)`` with ``h = x * silu(gate)`` in float32, as transformers' ``*RMSNormGated``
    computes it, the group's sum of squares added over the ranks that share it (one all-reduce of ``[...,
    g]``: this rank's partial sum in its group's column, zeros in the others).

    Args:
        norm: the gated norm, its ``weight`` already this rank's channels; ``group_size`` (``I / g``) and
            ``variance_epsilon`` are read from it.
        group: the group this rank's channels belong to; groups: ``g``.
        all_reduce: sums a tensor over the ranks, in place.
    """

    def __init__(self, norm: nn.Module, group: int, groups: int,
                 all_reduce: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon, self.group_size = norm.variance_epsilon, norm.group_size
        self.group, self.groups, self.all_reduce = group, groups, all_reduce

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden = hidden_states.to(torch.float32)
        if gate is not None:
            hidden = hidden * nn.functional.silu(gate.to(torch.float32))
        sums = hidden.new_zeros(*hidden.shape[:-1], self.groups)
        sums[..., self.group] = hidden.pow(2).sum(-1)
        self.all_reduce(sums)
        variance = sums[..., self.group:self.group + 1] / self.group_size
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)

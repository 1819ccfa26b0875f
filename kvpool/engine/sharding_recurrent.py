"""Tensor-parallel sharding of a recurrent hybrid's linear-attention mixers, by hand, in place: the state
sharded by head like the KV.

A Gated DeltaNet mixer (Qwen3-Next, Qwen3.5) of ``Hk`` key heads of ``dk`` and ``Hv`` value heads of ``dv``
(value head ``j`` reads key head ``j // (Hv / Hk)``) on ``tp`` ranks: rank ``r`` keeps key heads ``r Hk/tp
.. (r+1) Hk/tp - 1`` and the value heads that read them, ``r Hv/tp ..`` (column-parallel), so its conv state
holds its channels of ``q``, ``k`` and ``v`` (``(2 Hk dk + Hv dv) / tp``, in that order) and its SSM state
its ``Hv / tp`` heads: the shapes :class:`~kvpool.spec.state.RecurrentStateSpec` gives per rank, held in
this rank's own state slots. The output projection is row-parallel (an all-reduce, as the attention's
``o_proj``). A rank's heads never read another rank's: the delta rule and the gated RMS norm work per head
(the norm's weight, of ``dv``, is shared by every head and stays whole).

Row layouts followed (transformers 5.24 / 5.25, :data:`~kvpool.engine.state_cache.TESTED_TRANSFORMERS`; the
mixers' attributes and projection layouts are not a documented contract, so each is checked and a mixer
without them is refused with a ConfigError):

* Qwen3-Next ``in_proj_qkvz``: one group per key head, ``[q dk, k dk, v (Hv/Hk) dv, z (Hv/Hk) dv]``;
  ``in_proj_ba``: one group per key head, ``[b Hv/Hk, a Hv/Hk]`` (``fix_query_key_value_ordering``).
* Qwen3.5 ``in_proj_qkv``: ``[q Hk dk, k Hk dk, v Hv dv]``; ``in_proj_z``: ``Hv dv``; ``in_proj_b`` and
  ``in_proj_a``: ``Hv``.
* Both: the depthwise ``conv1d`` over ``[q, k, v]`` channels; ``dt_bias`` and ``A_log`` per value head;
  ``out_proj`` over ``Hv dv`` input features.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvpool.engine.sharding_conv import SHORT_CONV_MODEL_TYPES, keep_conv_channels
from kvpool.engine.sharding_mamba import MAMBA2_MODEL_TYPES
from kvpool.errors import ConfigError

#: Model types whose Gated DeltaNet mixers :func:`shard_recurrent_mixer` shards.
GATED_DELTA_NET_MODEL_TYPES = ("qwen3_next", "qwen3_5_text")
#: Every recurrent hybrid whose state tensor parallelism shards per rank: the Gated DeltaNet ones, LFM2
#: (:mod:`kvpool.engine.sharding_conv`) and the Mamba-2 ones (:mod:`kvpool.engine.sharding_mamba`).
RECURRENT_MODEL_TYPES = (*GATED_DELTA_NET_MODEL_TYPES, *SHORT_CONV_MODEL_TYPES, *MAMBA2_MODEL_TYPES)
_GDN_SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv1d", "dt_bias", "A_log",
              "out_proj")


def shard_recurrent_mixer(mixer: nn.Module, rank: int, tp_size: int,
                          row_parallel: Callable[[nn.Linear, slice], nn.Module],
                          keep_rows: Callable[[nn.Linear, slice | torch.Tensor], None]) -> None:
    """Keep rank ``rank``'s heads of the Gated DeltaNet ``mixer`` (see the module docstring), in place.

    Args:
        row_parallel: makes a linear layer row-parallel over the given input features (the caller's
            all-reduce: :func:`kvpool.engine.sharding._row_parallel`).
        keep_rows: keeps the given output features of a linear layer (column parallelism).

    Raises:
        ConfigError: a mixer without the Gated DeltaNet attributes named above, or heads ``tp_size`` does not
            divide.
    """
    if any(getattr(mixer, name, None) is None for name in _GDN_SIZES):
        raise ConfigError(f"cannot shard {type(mixer).__name__}: not a Gated DeltaNet mixer of transformers' "
                          f"layout ({', '.join(_GDN_SIZES)})")
    hk, hv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    if hk % tp_size or hv % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide the {hk} key and {hv} value heads of a Gated "
                          f"DeltaNet layer")
    k_per, v_per = hk // tp_size, hv // tp_size
    q = torch.arange(rank * k_per * dk, (rank + 1) * k_per * dk)
    v = torch.arange(rank * v_per * dv, (rank + 1) * v_per * dv)
    channels = torch.cat([q, hk * dk + q, 2 * hk * dk + v])  # the conv's [q, k, v] of this rank
    if isinstance(getattr(mixer, "in_proj_qkvz", None), nn.Linear):  # Qwen3-Next: grouped by key head
        group, ba = 2 * dk + 2 * (hv // hk) * dv, 2 * (hv // hk)
        keep_rows(mixer.in_proj_qkvz, slice(rank * k_per * group, (rank + 1) * k_per * group))
        keep_rows(mixer.in_proj_ba, slice(rank * k_per * ba, (rank + 1) * k_per * ba))
    elif all(isinstance(getattr(mixer, n, None), nn.Linear) for n in ("in_proj_qkv", "in_proj_z",
                                                                       "in_proj_b", "in_proj_a")):
        keep_rows(mixer.in_proj_qkv, channels)
        keep_rows(mixer.in_proj_z, slice(v[0].item(), v[-1].item() + 1))
        keep_rows(mixer.in_proj_b, slice(rank * v_per, (rank + 1) * v_per))
        keep_rows(mixer.in_proj_a, slice(rank * v_per, (rank + 1) * v_per))
    else:
        raise ConfigError(f"cannot shard {type(mixer).__name__}: neither in_proj_qkvz / in_proj_ba "
                          f"(Qwen3-Next) nor in_proj_qkv / z / b / a (Qwen3.5)")
    keep_conv_channels(mixer.conv1d, channels)
    heads = slice(rank * v_per, (rank + 1) * v_per)
    with torch.no_grad():
        mixer.dt_bias = nn.Parameter(mixer.dt_bias[heads].clone(), requires_grad=False)
        mixer.A_log = nn.Parameter(mixer.A_log[heads].clone(), requires_grad=False)
    mixer.out_proj = row_parallel(mixer.out_proj, slice(v[0].item(), v[-1].item() + 1))
    mixer.num_k_heads, mixer.num_v_heads = k_per, v_per
    mixer.key_dim, mixer.value_dim = k_per * dk, v_per * dv
    mixer.conv_dim = len(channels)

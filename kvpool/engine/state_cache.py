"""transformers' own cache over the pool's state slots: what a recurrent mixer receives as ``cache``.

:class:`SlotStateCache` is a ``transformers.Cache`` whose :class:`SlotStateLayer` layers (transformers'
``LinearAttentionLayer``) hold one request's slot views of a
:class:`~kvpool.storage.state.RecurrentStateCache` as their conv and SSM states: transformers' own update code
writes the pool in place, and every method of the cache protocol, of this release or a later one, is
transformers' own. It imports transformers, so :mod:`kvpool.engine.recurrent` imports it when a hybrid's
:class:`~kvpool.engine.recurrent.RecurrentStates` is built (the rest of the engine package does not need
transformers to import).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

from kvpool.errors import ConfigError
from kvpool.storage.state import RecurrentStateCache

#: The transformers releases this module was tested with (tests/test_recurrent_engine.py fails on another):
#: :class:`SlotStateLayer` sets the layer's state attributes, which are not a documented contract; a release
#: that renames them is refused (ConfigError naming it) rather than left to keep its states outside the pool.
TESTED_TRANSFORMERS = ("5.24.0", "5.25.0")
#: The attributes of ``LinearAttentionLayer`` :class:`SlotStateLayer` fills: dicts keyed by state index.
_LAYER_STATE = ("conv_states", "recurrent_states", "is_conv_states_initialized",
                "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size")


class SlotStateLayer(LinearAttentionLayer):
    """transformers' linear-attention cache layer whose conv and SSM states are one request's slot views.

    Args:
        conv: the slot's conv state view ``[1, channels, K - 1]``
            (:meth:`~kvpool.storage.state.RecurrentStateCache.conv_view`).
        ssm: the slot's SSM state view ``[1, *ssm_shape]``, or None (a family without one: LFM2).
        has_previous: whether the views hold the state after the request's earlier tokens (the span does not
            start at token 0). Without one, ``get_*_state`` return None and the mixer starts from zero, as in
            transformers' own prefill.

    The states are already initialised (no lazy allocation): transformers' own ``update_conv_state`` /
    ``update_recurrent_state`` (and the decode kernels, on the views ``get_*_state`` return) write the pool's
    memory in place. The conv state keeps K - 1 inputs, as the pool does (transformers' own cache keeps K;
    both are what a causal convolution of width K needs). Every other method is transformers' own.

    Raises:
        ConfigError: this transformers' ``LinearAttentionLayer`` keeps its states under other names than
            :data:`_LAYER_STATE` (a release newer than :data:`TESTED_TRANSFORMERS` that changed them).
    """

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor | None, has_previous: bool) -> None:
        super().__init__(number_of_states=1)
        if missing := [name for name in _LAYER_STATE if not isinstance(getattr(self, name, None), dict)]:
            import transformers

            raise ConfigError(f"transformers {transformers.__version__}'s LinearAttentionLayer has no "
                              f"{', '.join(missing)}: kvpool's state slots follow the layer of transformers "
                              f"{' and '.join(TESTED_TRANSFORMERS)}")
        self.dtype, self.device = conv.dtype, conv.device
        self.conv_states[0], self.conv_kernel_size[0] = conv, conv.shape[-1]
        self.is_conv_states_initialized[0] = True
        if ssm is not None:
            self.recurrent_states[0], self.is_recurrent_states_initialized[0] = ssm, True
        self.has_previous_state[0] = has_previous


class SlotStateCache(Cache):
    """A transformers ``Cache`` over one request's state slot of a :class:`RecurrentStateCache`: what the
    recurrent mixers of a span receive as ``cache``.

    Args:
        states: the :class:`RecurrentStateCache`.
        slot: the request's state slot.
        has_previous: see :class:`SlotStateLayer`.
        layers: the recurrent layers to hold (default: every recurrent layer of ``states``); the other
            indices are transformers' ``DummyLayer``, so a mixer asking for them gets transformers' own error.

    Raises InvalidArgumentError (a layer that is not recurrent), InvalidIdError (a slot out of range).

    A subclass of ``transformers.Cache`` with :class:`SlotStateLayer` layers: a method a new transformers
    release adds to the cache protocol is inherited from transformers (``increase_count`` and
    ``get_recurrent_states_to_keep`` in 5.25 were); the layers never record past states
    (``is_recording_past`` is False). An attention layer's KV never goes through this cache (it is in the
    paged cache, :mod:`kvpool.engine.attention`): for Falcon-H1, whose layers hold attention and Mamba-2 side
    by side, only the mixer receives it.
    """

    def __init__(self, states: RecurrentStateCache, slot: int, has_previous: bool,
                 layers: Sequence[int] | None = None) -> None:
        held: list[Any] = [DummyLayer()] * (max(states.spec.layers) + 1)
        for layer in states.spec.layers if layers is None else layers:
            ssm = None if states.ssm is None else states.ssm_view(layer, slot)
            held[layer] = SlotStateLayer(states.conv_view(layer, slot), ssm, has_previous)
        super().__init__(layers=held)

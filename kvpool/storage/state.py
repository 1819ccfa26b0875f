"""``RecurrentStateCache``: the physical recurrent state of a hybrid, allocated once, with per-layer views.

Two buffers, one per state kind, layer-major like SGLang's ``MambaPool`` and vLLM's per-layer state tensors:

* conv: ``[L, N, channels, K - 1]`` in ``spec.conv_dtype``;
* SSM: ``[L, N, *spec.ssm_shape]`` in ``spec.ssm_dtype`` (absent for short convolutions),

L = the spec's recurrent layers (in model order; layer ``spec.layers[i]`` is row ``i``), N = state slots
(the :class:`~kvpool.allocators.state_pool.StatePool` ids). ``conv_state(layer)`` / ``ssm_state(layer)`` are
``[N, ...]`` views a kernel indexes by slot; ``conv_view(layer, slot)`` / ``ssm_view(layer, slot)`` are the
``[1, ...]`` views of one request, which a model updates in place (single-token decode does: transformers'
``causal_conv1d_update`` and Mamba's ``selective_state_update`` copy into the tensor they are given).
``zero_slots`` clears a fresh request's state in every layer; ``copy_slots`` copies whole slots (checkpoints,
copy-on-write).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError
from kvpool.numeric import as_int, index_or_none
from kvpool.spec.state import RecurrentStateSpec
from kvpool.storage.arena import ElasticConfig, elastic_config
from kvpool.storage.block_copy import check_block_ids, copy_pairs, copy_within
from kvpool.storage.elastic import ElasticMemory


class RecurrentStateCache(ElasticMemory):
    """The conv and SSM state of every recurrent layer for ``num_slots`` requests.

    Args:
        spec: the :class:`~kvpool.spec.state.RecurrentStateSpec` (shapes and dtypes per layer per request).
        num_slots: state slots N (what the state pool hands out, padding slot included).
        device: where the buffers live.
        elastic: True or an :class:`~kvpool.storage.arena.ElasticConfig`: both buffers sit on one page
            arena (:class:`~kvpool.storage.elastic.ElasticMemory`, whose "blocks" are the state slots
            here): a slot's pages are committed by ``commit_blocks([slot])`` and given back by
            ``release_blocks``. A slot touches at least one page per recurrent layer and buffer.

    The buffers start zeroed (``torch.zeros``; on CPU the pages are committed lazily; an elastic slot reads
    0 when its pages are committed).

    Raises:
        ConfigError: a bad slot count, or the buffers cannot be allocated on ``device``.
    """

    def __init__(self, spec: RecurrentStateSpec, num_slots: int, *,
                 device: torch.device | str = "cpu", elastic: bool | ElasticConfig = False) -> None:
        self.spec = spec
        self.num_slots = as_int(num_slots, "num_slots", minimum=1, error=ConfigError)
        self.layer_row = {layer: i for i, layer in enumerate(spec.layers)}
        n_layers = spec.num_layers
        config = elastic_config(elastic)
        buffers = [((n_layers, self.num_slots, *spec.conv_shape), spec.conv_dtype)]
        if spec.ssm_shape:
            buffers.append(((n_layers, self.num_slots, *spec.ssm_shape), spec.ssm_dtype))
        try:
            if config is not None:
                tensors = self.allocate_elastic(config, device, buffers, 1)
            else:
                tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in buffers]
            self.conv, self.ssm = tensors[0], (tensors[1] if len(tensors) > 1 else None)
        except (RuntimeError, AssertionError, TypeError) as exc:  # a bad device, out of memory
            raise ConfigError(f"cannot allocate the state buffers of {self.num_slots} slots on {device!r}: "
                              f"{str(exc).splitlines()[0]}") from None
        self.device = self.conv.device

    @property
    def nbytes(self) -> int:
        """Bytes of both buffers: ``num_slots x spec.bytes_per_request``."""
        ssm = 0 if self.ssm is None else self.ssm.numel() * self.ssm.element_size()
        return self.conv.numel() * self.conv.element_size() + ssm

    # ------------------------------------------------------------------------------------- views
    def conv_state(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s conv states of every slot: ``[N, channels, K - 1]`` (a view)."""
        return self.conv[self._row(layer)]

    def ssm_state(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s SSM states of every slot: ``[N, *ssm_shape]`` (a view). Raises
        InvalidArgumentError for a model without SSM states (short convolutions)."""
        if self.ssm is None:
            raise InvalidArgumentError(f"{self.spec.kind.value} layers keep no SSM state")
        return self.ssm[self._row(layer)]

    def conv_view(self, layer: int, slot: int) -> torch.Tensor:
        """One request's conv state in ``layer``: ``[1, channels, K - 1]``, a contiguous view to update in
        place. Raises InvalidArgumentError (not a recurrent layer), InvalidIdError (slot out of range)."""
        s = self._slot(slot)
        return self.conv[self._row(layer), s:s + 1]

    def ssm_view(self, layer: int, slot: int) -> torch.Tensor:
        """One request's SSM state in ``layer``: ``[1, *ssm_shape]``, a contiguous view to update in place."""
        s = self._slot(slot)
        return self.ssm_state(layer)[s:s + 1]

    # ---------------------------------------------------------------------------------- slot ops
    def zero_slots(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Zero the conv and SSM states of ``slots`` in every layer (a fresh request's initial state): one
        ``index_fill_`` per buffer. Raises InvalidIdError for a slot out of range (nothing is zeroed)."""
        ids = check_block_ids(slots, self.num_slots).to(self.device)
        if ids.numel() == 0:
            return
        for buffer in self._buffers():
            buffer.index_fill_(1, ids, 0)

    def copy_slots(self, pairs: Sequence[tuple[int, int]] | torch.Tensor) -> None:
        """Copy whole slots ``src -> dst`` in every layer (a state checkpoint, copy-on-write of a shared
        state). ``pairs``: ``(src, dst)`` pairs or an int ``[P, 2]`` tensor. Every source is read before any
        destination is written. Raises InvalidIdError for a slot out of range or a destination named twice;
        nothing is copied then."""
        ids = copy_pairs(pairs, self.num_slots, self.device)
        if ids is not None:
            for buffer in self._buffers():
                copy_within(buffer, 1, *ids)

    # ------------------------------------------------------------------------------------ tier rows
    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot's state in every layer (``spec.bytes_per_request``): one tier row."""
        return self.nbytes // self.num_slots

    def read_slots(self, slots: Sequence[int]) -> torch.Tensor:
        """The states of ``slots`` as CPU ``uint8 [n, bytes_per_slot]`` rows: each row every layer's conv
        state, then every layer's SSM state, of one slot (a checkpoint going down to a tier)."""
        ids = check_block_ids(slots, self.num_slots).to(self.device)
        parts = [b.index_select(1, ids).movedim(1, 0).reshape(len(ids), -1).view(torch.uint8)
                 for b in self._buffers()]
        return torch.cat(parts, dim=1).cpu()

    def write_slots(self, slots: Sequence[int], rows: torch.Tensor) -> None:
        """Write rows of :meth:`read_slots` (``uint8 [n, bytes_per_slot]``) into ``slots`` (distinct).
        Raises InvalidArgumentError for rows of another shape, InvalidIdError for a slot out of range."""
        ids = check_block_ids(slots, self.num_slots).to(self.device)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (len(ids), self.bytes_per_slot):
            raise InvalidArgumentError(f"state rows must be uint8 [{len(ids)}, {self.bytes_per_slot}], got "
                                       f"{rows.dtype} {list(rows.shape)}")
        start = 0
        for buffer in self._buffers():
            per_slot = buffer[:, 0].numel() * buffer.element_size()
            part = rows[:, start:start + per_slot].contiguous().to(self.device).view(buffer.dtype)
            shape = (len(ids), buffer.shape[0], *buffer.shape[2:])
            buffer.index_copy_(1, ids, part.view(shape).movedim(0, 1))
            start += per_slot

    # -------------------------------------------------------------------------------------- checks
    def _buffers(self) -> list[torch.Tensor]:
        return [self.conv] if self.ssm is None else [self.conv, self.ssm]

    def _row(self, layer: int) -> int:
        row = self.layer_row.get(index_or_none(layer))  # type: ignore[arg-type]
        if row is None:
            raise InvalidArgumentError(f"layer {layer!r} keeps no recurrent state (recurrent layers: "
                                       f"{list(self.spec.layers)})")
        return row

    def _slot(self, slot: int) -> int:
        s = index_or_none(slot)
        if s is None or not 0 <= s < self.num_slots:
            raise InvalidIdError(f"state slot {slot!r} is out of range [0, {self.num_slots})")
        return s

"""What memory one model needs, read once from its config: :class:`ModelMemory`.

A model keeps, per request and per tensor-parallel rank, the KV of its attention layers (a
:class:`~kvpool.spec.kv.KVCacheSpec`, its layers grouped by memory kind) and, for an attention / recurrent
hybrid, a recurrent state (:class:`~kvpool.spec.state.HybridSpec`). A command reads the config once, makes
one :class:`ModelMemory`, and its parts (the CLI, the engine, the planner) ask it: which kinds of memory
(:attr:`ModelMemory.kinds`), the KV spec, the state, and whether there is one, instead of reading and
classifying the config again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError
from kvpool.spec.hf_config import load_config
from kvpool.spec.kinds import MemoryKind
from kvpool.spec.kv import KVCacheSpec
from kvpool.spec.state import HybridSpec, RecurrentStateSpec, is_recurrent_config
from kvpool.spec.state_kind import NO_STATE_SPEC, NoRecurrentStateSpec, RecurrentStateKind

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelMemory:
    """The memory of one model on one rank.

    Attributes:
        config: the parsed ``config.json`` (read once, by :meth:`from_config`).
        kv: the KV of the attention layers (of all layers for a model without recurrent state), or None for
            a model with no attention layer (Mamba).
        hybrid: the :class:`HybridSpec` of an attention / recurrent hybrid, else None.
        state_kind: what the model keeps beside its KV, asked instead of "is it a hybrid?": a
            :class:`~kvpool.spec.state_kind.RecurrentStateKind` of ``hybrid``, or
            :data:`~kvpool.spec.state_kind.NO_STATE_SPEC` for a model without recurrent layers.
    """

    config: dict[str, Any]
    kv: KVCacheSpec | None
    hybrid: HybridSpec | None
    state_kind: RecurrentStateKind | NoRecurrentStateSpec

    @classmethod
    def from_config(cls, path_or_dict: str | Path | dict[str, Any], *, block_size: int = 16, tp_size: int = 1,
                    kv_cache_dtype: str = "auto", conv_dtype: str | torch.dtype = "auto",
                    ssm_dtype: str | torch.dtype = "auto", shard_state: bool = True) -> ModelMemory:
        """Read a ``config.json`` (a file, a folder holding one, a built-in name or the parsed dict) once.

        A recurrent family (:func:`kvpool.spec.state.is_recurrent_config`) gives its
        :meth:`HybridSpec.from_hf_config` (``conv_dtype`` / ``ssm_dtype`` apply to it only); any other model
        its :meth:`KVCacheSpec.from_hf_config`. Raises ConfigError as they do, and (``shard_state`` False,
        for a consumer that keeps the state on one rank) for a recurrent hybrid at ``tp_size`` > 1."""
        config = load_config(path_or_dict)
        if not is_recurrent_config(config):
            kv = KVCacheSpec.from_hf_config(config, tp_size=tp_size, kv_cache_dtype=kv_cache_dtype,
                                            block_size=block_size)
            return cls(config, kv, None, NO_STATE_SPEC)
        if not shard_state and tp_size != 1:
            raise ConfigError("a recurrent hybrid runs on one rank here (tp_size 1)")
        hybrid = HybridSpec.from_hf_config(config, tp_size=tp_size, kv_cache_dtype=kv_cache_dtype,
                                           conv_dtype=conv_dtype, ssm_dtype=ssm_dtype, block_size=block_size)
        return cls(config, hybrid.attention, hybrid, RecurrentStateKind(hybrid))

    @property
    def model_type(self) -> str | None:
        """The config's (text) model type."""
        text = self.config.get("text_config")
        lm = text if isinstance(text, dict) else self.config
        return lm.get("model_type") or self.config.get("model_type")

    @property
    def state(self) -> RecurrentStateSpec | None:
        """The recurrent state of a hybrid's recurrent layers, else None."""
        return self.state_kind.state

    @property
    def kinds(self) -> tuple[MemoryKind, ...]:
        """Each kind of memory a request holds, once, in group order: the KV cache groups' kinds, then
        :class:`~kvpool.spec.kinds.RecurrentState` for a hybrid."""
        kv = () if self.kv is None else tuple(dict.fromkeys(g.memory_kind for g in self.kv.groups))
        return kv + self.state_kind.kinds

    def require_hybrid(self) -> HybridSpec:
        """:attr:`hybrid`; ConfigError for a model without recurrent state."""
        return self.state_kind.require_hybrid(self.model_type)

    def require_kv_only(self) -> KVCacheSpec:
        """:attr:`kv` where it is the model's whole memory; ConfigError for a hybrid (a spec of its KV alone
        would leave its recurrent state out) and as :meth:`require_kv`."""
        self.state_kind.require_kv_only(self.model_type)
        return self.require_kv()

    def require_kv(self) -> KVCacheSpec:
        """:attr:`kv`; ConfigError for a model without attention layers (its memory is state only)."""
        if self.kv is None:
            raise ConfigError(f"{self.model_type} has no attention layers: no KV cache to plan")
        return self.kv

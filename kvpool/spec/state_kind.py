"""What a model keeps beside its KV, one class per kind: :class:`RecurrentStateKind` (an attention /
recurrent hybrid's state) and :class:`NoRecurrentStateSpec` (nothing: :data:`NO_STATE_SPEC`).

:attr:`ModelMemory.state_kind <kvpool.spec.memory.ModelMemory.state_kind>` is one of them, chosen once when
the config is read. The CLI, the planner and the engine ask it (its state spec, its memory kinds, the
state options it takes, what ``kvpool plan`` reports of it, how many checkpoint slots an engine keeps)
instead of asking whether the model is a hybrid. Each answers with the same members:

* ``state``: the :class:`~kvpool.spec.state.RecurrentStateSpec`, or None;
* ``kinds``: the memory kinds the state adds beside the KV cache groups' (``(RecurrentState(),)`` or ``()``);
* ``save_policy(state_save, state_checkpoints)``: the ``--state-save`` policy a replay runs (``tail`` by
  default), or None; ConfigError for a state option given to a model without state;
* ``plan_entries(kv_bytes, max_model_len)``: the ``recurrent_state`` part of ``kvpool plan --json`` (``{}``);
* ``checkpoint_slots(state_checkpoints, default)``: the state checkpoints an engine keeps (0 without state);
* ``require_hybrid(model_type)``: the :class:`~kvpool.spec.state.HybridSpec`, or ConfigError;
* ``require_kv_only(model_type)``: nothing where the KV spec is the model's whole memory, else ConfigError
  (a KV spec alone would leave a hybrid's state out);
* ``check_kv_budget(kv, budget_bytes)``: before the weights load, InsufficientMemoryError when
  ``budget_bytes`` of KV memory hold no block (``kv()`` gives the KV spec); a hybrid checks nothing then
  (the KV spec of its attention layers needs the loaded model:
  :func:`kvpool.engine.recurrent.engine_kv_spec`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvpool.errors import ConfigError
from kvpool.numeric import as_int
from kvpool.spec.kinds import MemoryKind, RecurrentState
from kvpool.spec.kv import KVCacheSpec
from kvpool.spec.state import HybridSpec, RecurrentStateSpec
from kvpool.spec.state_planner import state_report


@dataclass(frozen=True)
class RecurrentStateKind:
    """The state of an attention / recurrent hybrid (see the module docstring).

    Attributes:
        hybrid: the model's :class:`~kvpool.spec.state.HybridSpec`.
    """

    hybrid: HybridSpec

    @property
    def state(self) -> RecurrentStateSpec:
        """The recurrent layers' state spec."""
        return self.hybrid.state

    @property
    def kinds(self) -> tuple[MemoryKind, ...]:
        """``(RecurrentState(),)``."""
        return (RecurrentState(),)

    def save_policy(self, state_save: str | None, state_checkpoints: int | None) -> str:
        """``state_save``, else ``tail``."""
        return state_save or "tail"

    def plan_entries(self, kv_bytes: int, max_model_len: int | None) -> dict[str, Any]:
        """``{"recurrent_state": ...}``: :func:`~kvpool.spec.state_planner.state_report` for ``kv_bytes``."""
        return {"recurrent_state": state_report(self.hybrid, kv_bytes, max_model_len)}

    def checkpoint_slots(self, state_checkpoints: int | None, default: int) -> int:
        """``state_checkpoints``, else ``default``. ConfigError for a negative or non-integer count."""
        return as_int(default if state_checkpoints is None else state_checkpoints, "state_checkpoints",
                      minimum=0, error=ConfigError)

    def require_hybrid(self, model_type: str | None) -> HybridSpec:
        """:attr:`hybrid`."""
        return self.hybrid

    def require_kv_only(self, model_type: str | None) -> None:
        """ConfigError: a spec of the KV alone would leave the state out (the attention layers' KV is
        :attr:`HybridSpec.attention <kvpool.spec.state.HybridSpec.attention>`, beside the state)."""
        raise ConfigError(f"{model_type} keeps a recurrent state per request: its KV alone is not its memory "
                          f"(the attention layers' KV sits beside the state: ModelMemory.hybrid)")

    def check_kv_budget(self, kv: Callable[[], KVCacheSpec], budget_bytes: int) -> None:
        """Nothing before loading: the attention layers' KV spec needs the loaded model."""


@dataclass(frozen=True)
class NoRecurrentStateSpec:
    """The state part of a model without recurrent layers: no state spec, no memory kind beside the KV
    cache groups', no state option to take (see the module docstring). Every instance equals every other
    (a pickled :class:`~kvpool.spec.memory.ModelMemory` equals its original)."""

    state: ClassVar[None] = None
    kinds: ClassVar[tuple[MemoryKind, ...]] = ()

    def save_policy(self, state_save: str | None, state_checkpoints: int | None) -> None:
        """None: nothing to save. ConfigError for a ``--state-save`` or ``--state-checkpoints`` given."""
        for option, value in (("--state-save", state_save), ("--state-checkpoints", state_checkpoints)):
            if value is not None:
                raise ConfigError(f"{option} needs --model-config of a recurrent hybrid "
                                  f"(Qwen3-Next, Nemotron-H...)")

    def plan_entries(self, kv_bytes: int, max_model_len: int | None) -> dict[str, Any]:
        """``{}``: nothing of a state in ``kvpool plan``'s report."""
        return {}

    def checkpoint_slots(self, state_checkpoints: int | None, default: int) -> int:
        """0: no state to checkpoint (``state_checkpoints`` is not read)."""
        return 0

    def require_hybrid(self, model_type: str | None) -> HybridSpec:
        """ConfigError: the model keeps no recurrent state."""
        raise ConfigError(f"{model_type} keeps no recurrent state")

    def require_kv_only(self, model_type: str | None) -> None:
        """Nothing: the KV spec is the model's whole memory."""

    def check_kv_budget(self, kv: Callable[[], KVCacheSpec], budget_bytes: int) -> None:
        """:func:`~kvpool.spec.planner.plan_pool` of ``kv()`` in ``budget_bytes`` (all of it for KV):
        InsufficientMemoryError when it holds no block."""
        from kvpool.spec.planner import MemoryReadings, plan_pool

        plan_pool(kv(), MemoryReadings(total_bytes=budget_bytes, non_kv_bytes=0), gpu_memory_utilization=1.0)


#: The state part of every model without recurrent layers.
NO_STATE_SPEC = NoRecurrentStateSpec()

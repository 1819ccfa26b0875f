"""One byte budget for a recurrent hybrid's KV blocks and state slots: split statically, or rebalanced.

A hybrid's memory holds two kinds of entries of different sizes: KV blocks (``block_bytes`` each, the
attention layers' KV of one block of tokens) and state slots (``state_bytes`` each, every recurrent layer's
state of one request). State slots serve the running requests and the prefix cache's checkpoints alike
(SGLang's ``MambaPool`` holds both). How a budget of ``budget_bytes`` is split between the two sides:

* ``vllm-one-pool``: the split of :func:`kvpool.spec.state_planner.plan_single_pool`: one state slot per
  request the pool holds at ``context_len`` tokens each (``max_requests``), the rest KV. Static.
* ``sglang-ratio``: SGLang's ``mamba_full_memory_ratio`` r (0.9): ``budget x r / (1 + r)`` to state slots,
  the rest KV (:func:`kvpool.spec.state_planner.plan_two_pools`). Static.
* ``rebalanced``: starts at the ``sglang-ratio`` split and moves capacity at run time by a
  :class:`RebalanceRule` (the contract of TensorRT-LLM's KVCacheManagerV2 pool rebalancing, and the single
  byte budget of SGLang's ``--enable-unified-memory``): each step samples each side's use and reuse in
  bytes; the target gives each side what it held in use over the last ``window`` steps (the running
  requests' blocks and slots) and splits the rest of the budget (at least ``cache x budget``), the
  caches, in proportion to the prefix blocks each side served or lacked so far
  (:meth:`RebalanceRule.target`); capacity moves toward it by at most ``max_step x budget`` when it is
  more than ``threshold x budget`` away, at most once per ``cooldown`` steps.

**Use and reuse** of a side, per step: its bytes in use (KV blocks referenced by running requests; state
slots of running requests and pending saves; plus what the head of the queue lacked when a step refused it
on that side), and the prefix blocks it served or lacked at first admissions: a hit needs its KV blocks and
the checkpoint at its end, so each hit block counts for both sides, KV cached past the last checkpoint for
the state side (it lacked the checkpoint), and a checkpoint found past the cached KV for the KV side (it
lacked the blocks), the "ghost hits" of each side.

**Constraints that always fit.** Capacity moves only through free or cached entries: the KV side gives
blocks by allocating them from the pool (evicting cached blocks, never a referenced one) and holding them;
the state side gives slots by evicting checkpoints, never a running request's slot or a pending save. A move
away from the KV side also leaves free every block the running requests may still need to finish (the
running batch always fits), and when nothing runs, the head of the queue always gets room for its blocks
and a slot (a forced move, outside the threshold and cooldown); a move those constraints cut short is
counted (``moves_clamped``), a constraint that no move can meet too (``constraint_refusals``).

Plain numbers: slots and blocks are counts, the rule is arithmetic on bytes; nothing here holds KV or state.
:class:`BudgetConfig` and :class:`RebalanceRule` are here; :mod:`kvpool.requests.state_budget` runs them on a
KV cache manager.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import ConfigError
from kvpool.numeric import as_int, as_real

#: The splits of one budget between KV blocks and state slots.
SPLITS = ("vllm-one-pool", "sglang-ratio", "rebalanced")


@dataclass(frozen=True)
class RebalanceRule:
    """When to move capacity between the KV side and the state side (see the module docstring).

    Attributes:
        threshold: the imbalance that moves capacity, as a fraction of the budget, in (0, 1).
        cooldown: steps after a move during which none follows, >= 0.
        window: samples of demand averaged, >= 1.
        max_step: the most one move carries, as a fraction of the budget, in (0, 1] (moves step toward
            the target, so that a burst of demand does not evict a side's cache at once).
        cache: the least share of the budget, in [0, 1], split by reuse as the two sides' caches (cached
            KV blocks and checkpoints) even when the running requests would take more (they fill whatever
            KV is free, so their use alone would squeeze the checkpoints out).

    Raises:
        ConfigError: a value out of range.
    """

    threshold: float = 0.02
    cooldown: int = 16
    window: int = 64
    max_step: float = 0.02
    cache: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache", as_real(self.cache, "rebalance cache", minimum=0.0, maximum=1.0,
                                                  error=ConfigError))
        object.__setattr__(self, "max_step", as_real(self.max_step, "rebalance max_step", minimum=0.0,
                                                     maximum=1.0, open_min=True, error=ConfigError))
        object.__setattr__(self, "threshold", as_real(self.threshold, "rebalance threshold", minimum=0.0,
                                                      maximum=1.0, open_min=True, error=ConfigError))
        if self.threshold >= 1.0:
            raise ConfigError(f"rebalance threshold must be below 1, got {self.threshold!r}")
        object.__setattr__(self, "cooldown", as_int(self.cooldown, "rebalance cooldown", minimum=0,
                                                    error=ConfigError))
        object.__setattr__(self, "window", as_int(self.window, "rebalance window", minimum=1,
                                                  error=ConfigError))

    def target(self, kv_use: float, state_use: float, kv_reuse: float, state_reuse: float,
               budget_bytes: int) -> float:
        """The state side's target in bytes: what it holds in use, plus the budget's spare (``budget -
        kv_use - state_use``, at least ``cache x budget``) in proportion to each side's reuse (half each
        before either reused anything)."""
        spare = max(budget_bytes - kv_use - state_use, self.cache * budget_bytes, 0.0)
        reuse = kv_reuse + state_reuse
        share = state_reuse / reuse if reuse > 0 else 0.5
        return min(float(budget_bytes), state_use + spare * share)

    def move(self, target: float, state_bytes: int, budget_bytes: int, steps_since_move: int) -> float:
        """Bytes to move to the state side (negative: to the KV side; 0: none): ``target - state_bytes``
        (the state side now), at most ``max_step x budget`` either way, when it is over ``threshold x
        budget`` and ``steps_since_move >= cooldown``."""
        if steps_since_move < self.cooldown:
            return 0.0
        delta = target - state_bytes
        if abs(delta) <= self.threshold * budget_bytes:
            return 0.0
        step = self.max_step * budget_bytes
        return max(-step, min(step, delta))


class Rebalancer:
    """A :class:`RebalanceRule` over sampled demand: :meth:`sample` once per step, :meth:`propose` the
    move, :meth:`moved` after one was made (starts the cooldown). A side's use is the mean of what it held
    in use at the window's steps, its reuse the sum of what it reused or lacked since the start."""

    def __init__(self, rule: RebalanceRule) -> None:
        self.rule = rule
        self._samples: deque[tuple[float, float]] = deque(maxlen=rule.window)
        self.kv_reused = self.state_reused = 0.0
        self.steps_since_move = rule.cooldown  # the first move needs no wait

    def sample(self, kv_in_use: float, state_in_use: float, kv_reused: float = 0.0,
               state_reused: float = 0.0) -> None:
        """One step of each side: bytes held in use, and what it served or lacked at this step (any one
        unit for both sides: only their ratio counts)."""
        self._samples.append((kv_in_use, state_in_use))
        self.kv_reused += kv_reused
        self.state_reused += state_reused
        self.steps_since_move += 1

    def demand(self) -> tuple[float, float, float, float]:
        """The mean KV and state bytes in use over the window; the KV and state reuse so far."""
        n = len(self._samples) or 1
        return (sum(s[0] for s in self._samples) / n, sum(s[1] for s in self._samples) / n, self.kv_reused,
                self.state_reused)

    def propose(self, state_bytes: int, budget_bytes: int) -> float:
        """The rule's move for the window's demand (0 until the window is full)."""
        if len(self._samples) < self.rule.window:
            return 0.0
        target = self.rule.target(*self.demand(), budget_bytes)
        return self.rule.move(target, state_bytes, budget_bytes, self.steps_since_move)

    def moved(self) -> None:
        self.steps_since_move = 0


@dataclass(frozen=True)
class BudgetConfig:
    """One budget of ``budget_bytes`` for KV blocks of ``block_bytes`` and state slots of ``state_bytes``,
    ``split`` (:data:`SPLITS`) with ``state_slots`` to the state side at the start; ``rule`` moves them
    (``rebalanced`` only). Raises ConfigError for values out of range or a budget that cannot hold one
    slot and one block beside them."""

    split: str
    budget_bytes: int
    block_bytes: int
    state_bytes: int
    state_slots: int
    rule: RebalanceRule = field(default_factory=RebalanceRule)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"state split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        for name in ("budget_bytes", "block_bytes", "state_bytes", "state_slots"):
            object.__setattr__(self, name, as_int(getattr(self, name), name, minimum=1, error=ConfigError))
        if self.state_slots * self.state_bytes + 2 * self.block_bytes > self.budget_bytes:
            raise ConfigError(f"a budget of {self.budget_bytes:,} B cannot hold {self.state_slots:,} state "
                              f"slots of {self.state_bytes:,} B and two KV blocks of {self.block_bytes:,} B")

    @classmethod
    def plan(cls, split: str, hybrid: Any, budget_bytes: int, block_bytes: int, context_len: int,
             rule: RebalanceRule | None = None) -> BudgetConfig:
        """The budget of ``split`` for a :class:`~kvpool.spec.state.HybridSpec` ``hybrid``: its state
        slots at the start from :func:`~kvpool.spec.state_planner.plan_single_pool`'s requests of
        ``context_len`` tokens (``vllm-one-pool``) or :func:`~kvpool.spec.state_planner.plan_two_pools`
        (the others). Raises ConfigError (an unknown split, bad numbers) or InsufficientMemoryError."""
        from kvpool.spec.state_planner import plan_single_pool, plan_two_pools

        if split not in SPLITS:
            raise ConfigError(f"state split must be one of {', '.join(SPLITS)}, got {split!r}")
        if split != "vllm-one-pool":
            slots = plan_two_pools(hybrid, budget_bytes, context_len).state_slots
        else:
            slots = max(1, plan_single_pool(hybrid, budget_bytes).max_requests(context_len))
        return cls(split, budget_bytes, block_bytes, hybrid.state_bytes_per_request, slots,
                   rule or RebalanceRule())

    @property
    def max_slots(self) -> int:
        """State slots the whole budget less two KV blocks holds (the most the state side may reach)."""
        return (self.budget_bytes - 2 * self.block_bytes) // self.state_bytes

"""The budget of :mod:`kvpool.requests.budget` run on a KV cache manager: :class:`StateBudget` holds the
blocks the state side takes from the KV pool and moves capacity between the sides; :class:`BudgetStates`
lets request slots and checkpoints share the state side's slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.allocators.state_pool import StatePool
from kvpool.errors import ConfigError, IntegrityError, OutOfBlocksError
from kvpool.numeric import as_int
from kvpool.requests.budget import BudgetConfig, Rebalancer
from kvpool.requests.request import Request
from kvpool.requests.state_checkpoints import RequestStates, SavePolicy, StateCheckpoints
from kvpool.spec.kv import cdiv


class BudgetStates(RequestStates):
    """:class:`RequestStates` whose request slots and checkpoints share ``limit`` state slots: a request
    admitted takes a slot from the checkpoints (evicting the least valuable one) and gives it back when it
    ends; :meth:`set_limit` moves the limit (never below the running requests' slots and pending saves)."""

    def __init__(self, policy: SavePolicy | str, block_size: int, limit: int, max_slots: int, *,
                 eviction: Any = "lru") -> None:
        limit = as_int(limit, "state slots", minimum=1, maximum=max_slots, error=ConfigError)
        checkpoints = StateCheckpoints(limit, policy=eviction, max_capacity=max_slots)
        super().__init__(policy, block_size, StatePool(max_slots), checkpoints=checkpoints)
        self.limit = limit
        #: Over first admissions, in blocks: the joint hits, the KV cached past the last checkpoint (the
        #: state side lacked), and the checkpoints found past the cached KV (the KV side lacked).
        self.served = self.state_lacked = self.kv_lacked = 0

    @property
    def has_free_slot(self) -> bool:
        return self.limit - len(self._slots) - self.checkpoints.num_pending >= 1

    @property
    def num_fixed(self) -> int:
        """Slots that no move may take: running requests' and pending saves'."""
        return len(self._slots) + self.checkpoints.num_pending

    def admit(self, req: Request, hit_blocks: int, kv_blocks: int, *, first: bool) -> int:
        """As :meth:`RequestStates.admit`; at a first admission also counts the blocks each side served
        or lacked (:attr:`served`, :attr:`kv_lacked`, :attr:`state_lacked`)."""
        if not self.has_free_slot:
            raise OutOfBlocksError(f"request {req.request_id!r} needs a state slot, all {self.limit} are "
                                   "held")
        if first:
            limit = min(len(req.block_hashes), max(0, (req.num_tokens - 1) // self.block_size))
            self.served += hit_blocks
            self.state_lacked += kv_blocks - hit_blocks  # KV cached past the last checkpoint
            self.kv_lacked += max(0, self.checkpoints.longest(req.block_hashes, limit) - kv_blocks)
        slot = super().admit(req, hit_blocks, kv_blocks, first=first)  # restores before any eviction
        self._fit()
        return slot

    def free(self, req: Request) -> None:
        super().free(req)
        self._fit()

    def set_limit(self, limit: int) -> None:
        """Hold at most ``limit`` slots from now on (checkpoints evicted to fit). ConfigError below
        :attr:`num_fixed` or above the pool."""
        self.limit = as_int(limit, "state slots", minimum=max(1, self.num_fixed), maximum=self.pool.capacity,
                            error=ConfigError)
        self._fit()

    def _fit(self) -> None:
        self.checkpoints.resize(self.limit - len(self._slots))

    @property
    def num_request_capacity(self) -> int:
        return self.limit

    def check_integrity(self) -> None:
        super().check_integrity()
        if len(self._slots) + len(self.checkpoints) + self.checkpoints.num_pending > self.limit:
            raise IntegrityError(f"state slots over the budget's {self.limit}")


@dataclass
class BudgetStats:
    """What one budget did: moves made (and bytes), moves the constraints cut short, forced moves (the
    head of an empty batch), constraints no move could meet, admissions refused per side (steps whose
    head could not join for want of KV blocks or of a state slot), running requests (time-weighted mean
    over the steps, and peak), and the range of each side's capacity."""

    moves: int = 0
    bytes_moved: int = 0
    moves_clamped: int = 0
    forced_moves: int = 0
    constraint_refusals: int = 0
    refusals_kv: int = 0
    refusals_state: int = 0
    peak_running: int = 0
    running_area: float = 0.0
    busy_s: float = 0.0
    slots_min: int = 0
    slots_max: int = 0


class StateBudget:
    """The budget of :class:`BudgetConfig` run on a KV cache manager: the state side is
    :attr:`states` (a :class:`BudgetStates`, given to the manager), the KV side the manager's pool less the
    blocks this budget holds (allocated from the pool to make room for state slots).

    Call :meth:`attach` once the manager and its scheduler exist, :meth:`check_fits` as a request
    arrives, :meth:`before_step` before each step is scheduled, :meth:`after_step` after, :meth:`tick`
    with each step's simulated seconds, :meth:`release` at the end; :meth:`report` says what it did.
    """

    def __init__(self, config: BudgetConfig, save_policy: SavePolicy | str, block_size: int, *,
                 eviction: Any = "lru") -> None:
        self.cfg = config
        self.states = BudgetStates(save_policy, block_size, config.state_slots, config.max_slots,
                                   eviction=eviction)
        self.rebalancer = Rebalancer(config.rule) if config.split == "rebalanced" else None
        self.held: list[int] = []
        self.stats = BudgetStats(slots_min=config.state_slots, slots_max=config.state_slots)
        self._kv: Any = None
        self._sched: Any = None
        self._seen = (0, 0, 0)  # the states' served, kv_lacked, state_lacked at the last sample
        self._lacked = (0, 0)  # (KV blocks, state slots) the head lacked at the last step

    # ---- the sides ----------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self.states.limit

    @property
    def kv_blocks(self) -> int:
        """Blocks of the KV side: the pool's, less those this budget holds."""
        return self._kv.pool.num_blocks - len(self.held)

    def blocks_for(self, slots: int) -> int:
        """Pool blocks to hold so that ``slots`` state slots fit beside the KV side in the budget."""
        cfg = self.cfg
        spare = cfg.budget_bytes - self._kv.pool.num_blocks * cfg.block_bytes
        return max(0, cdiv(slots * cfg.state_bytes - spare, cfg.block_bytes))

    def attach(self, kv: Any, sched: Any) -> None:
        """Start on manager ``kv`` (built with :attr:`states`, its pool all free) and scheduler ``sched``:
        hold the blocks the starting state slots take. ConfigError when the pool is larger than the
        budget or too small for them."""
        if kv.states is not self.states:
            raise ConfigError("the KV cache manager must hold this budget's states")
        self._kv, self._sched = kv, sched
        pool = kv.pool
        if pool.num_blocks * self.cfg.block_bytes > self.cfg.budget_bytes:
            raise ConfigError(f"a pool of {pool.num_blocks:,} blocks is over the budget of "
                              f"{self.cfg.budget_bytes:,} B")
        need = self.blocks_for(self.slots)
        if need > pool.num_free_blocks - 1:
            raise ConfigError(f"the budget leaves no KV block beside {self.slots:,} state slots")
        self.held = pool.allocate(need) if need else []

    def max_kv_blocks(self) -> int:
        """The most blocks the KV side can ever have: all, for a static split's state slots as they are;
        for ``rebalanced``, all but what one state slot takes."""
        slots = self.slots if self.rebalancer is None else 1
        return self._kv.pool.num_blocks - self.blocks_for(slots)

    def check_fits(self, req: Request) -> None:
        """Raise OutOfBlocksError when ``req`` could never run alone on the KV side."""
        need = self._kv.blocks_needed(req, self._sched.max_num_batched_tokens)
        if need > self.max_kv_blocks():
            raise OutOfBlocksError(f"request {req.request_id!r} needs {need:,} blocks, the KV side of the "
                                   f"budget holds at most {self.max_kv_blocks():,}", blocks_needed=need)

    # ---- moves --------------------------------------------------------------------------------------

    def _running_need(self) -> int:
        """Free blocks the batch that must fit needs: what the running requests may still allocate before
        they finish, or, when none runs, what the head of the queue needs alone."""
        kv, sched = self._kv, self._sched
        chunk = sched.max_num_batched_tokens
        if not sched.running:
            return kv.blocks_needed(sched.waiting[0], chunk) if sched.waiting else 0
        return sum(max(0, kv.blocks_needed(r, chunk) - kv.coordinator.num_blocks_held(r.request_id))
                   for r in sched.running)

    def grow_state(self, slots: int, keep_free: int) -> int:
        """Move up to ``slots`` slots to the state side, leaving ``keep_free`` free blocks on the KV side;
        returns the slots moved."""
        pool, moved = self._kv.pool, 0
        room = pool.num_free_blocks - keep_free
        while moved < slots and self.slots + moved + 1 <= self.cfg.max_slots and \
                self.blocks_for(self.slots + moved + 1) - len(self.held) <= room:
            moved += 1
        take = self.blocks_for(self.slots + moved) - len(self.held)
        if take > 0:
            self.held += pool.allocate(take)
        if moved:
            self.states.set_limit(self.slots + moved)
        return moved

    def shrink_state(self, slots: int, keep: int = 0) -> int:
        """Move up to ``slots`` slots to the KV side, keeping the running requests' and pending saves'
        (and at least ``keep``); returns the slots moved."""
        moved = max(0, min(slots, self.slots - max(1, keep, self.states.num_fixed)))
        if moved:
            self.states.set_limit(self.slots - moved)
            give = len(self.held) - self.blocks_for(self.slots)
            if give > 0:
                back, self.held = self.held[-give:], self.held[:-give]
                self._kv.pool.free(back)
        return moved

    def _count_move(self, slots: int) -> None:
        s = self.stats
        s.moves += 1
        s.bytes_moved += abs(slots) * self.cfg.state_bytes
        s.slots_min, s.slots_max = min(s.slots_min, self.slots), max(s.slots_max, self.slots)

    # ---- the steps ----------------------------------------------------------------------------------

    def before_step(self) -> None:
        """Sample demand, meet the empty batch's constraint, and (``rebalanced``) apply the rule."""
        kv, sched = self._kv, self._sched
        if not sched.running and sched.waiting:
            self._fit_head(sched.waiting[0])
        if self.rebalancer is None:
            return
        cfg, st = self.cfg, self.states
        served, kv_lacked, state_lacked = st.served, st.kv_lacked, st.state_lacked
        new = served - self._seen[0]
        kv_reuse, state_reuse = new + kv_lacked - self._seen[1], new + state_lacked - self._seen[2]
        self._seen = (served, kv_lacked, state_lacked)
        used = kv.pool.num_used_blocks - len(self.held)
        self.rebalancer.sample((used + self._lacked[0]) * cfg.block_bytes,
                               (st.num_fixed + self._lacked[1]) * cfg.state_bytes, kv_reuse, state_reuse)
        delta = self.rebalancer.propose(self.slots * cfg.state_bytes, cfg.budget_bytes)
        if delta > 0:
            want = max(1, int(delta // cfg.state_bytes))  # a move carries one slot at least
            moved = self.grow_state(want, self._running_need())
        elif delta < 0:
            want = cdiv(int(-delta), cfg.state_bytes)
            moved = -self.shrink_state(want)
        else:
            return
        if abs(moved) < want:
            self.stats.moves_clamped += 1
        if moved:
            self.rebalancer.moved()
            self._count_move(moved)

    def _fit_head(self, head: Request) -> None:
        """Nothing runs: make room for ``head`` alone (its blocks and a slot), moving capacity whatever
        the rule says (``rebalanced``; a static split's arrival check already saw to it); counted in
        ``constraint_refusals`` when the budget cannot."""
        need = self._kv.blocks_needed(head, self._sched.max_num_batched_tokens)
        moved = 0
        if self.rebalancer is not None and self.kv_blocks < need:
            lack = need - self.kv_blocks
            slots = cdiv(lack * self.cfg.block_bytes, self.cfg.state_bytes)
            moved -= self.shrink_state(slots, keep=1)
        if self.rebalancer is not None and not self.states.has_free_slot:
            moved += self.grow_state(1, need)
        if moved:
            self.stats.forced_moves += 1
            self._count_move(moved)
        if self.kv_blocks < need or not self.states.has_free_slot:
            self.stats.constraint_refusals += 1

    def add_request(self, req: Request) -> None:
        """:meth:`check_fits`, then the scheduler's ``add_request``."""
        self.check_fits(req)
        self._sched.add_request(req)

    def schedule(self) -> Any:
        """One step of the scheduler between :meth:`before_step` and :meth:`after_step`; its output."""
        self.before_step()
        out = self._sched.schedule()
        self.after_step(out)
        return out

    def after_step(self, out: Any) -> None:
        """Count a refused head: the step had room for more requests and tokens, yet the head waits."""
        sched = self._sched
        tokens = sum(n for _, n in out.scheduled)
        if not sched.waiting or out.preempted or len(sched.running) >= sched.max_num_seqs or \
                tokens >= sched.max_num_batched_tokens:
            self._lacked = (0, 0)
            return
        if not self.states.has_free_slot:
            self.stats.refusals_state += 1
            self._lacked = (0, 1)
        else:
            self.stats.refusals_kv += 1
            head = sched.waiting[0]
            need = self._kv.blocks_needed(head, sched.max_num_batched_tokens)
            self._lacked = (max(0, need - self._kv.num_free_blocks), 0)

    def tick(self, dt: float) -> int:
        """``dt`` simulated seconds with the running requests of now; returns the blocks held (a replay
        leaves them out of the blocks in use)."""
        n = len(self._sched.running)
        s = self.stats
        s.peak_running = max(s.peak_running, n)
        s.running_area += n * dt
        s.busy_s += dt
        return len(self.held)

    def release(self) -> None:
        """Check the budget (:meth:`check_integrity`) and give the held blocks back to the pool (at the end
        of a replay)."""
        self.check_integrity()
        if self.held:
            self._kv.pool.free(self.held)
            self.held = []

    def check_integrity(self) -> None:
        """The budget is never exceeded; the state side holds its fixed slots. Raises IntegrityError."""
        cfg = self.cfg
        used = self.kv_blocks * cfg.block_bytes + self.slots * cfg.state_bytes
        if self._kv is not None and used > cfg.budget_bytes:
            raise IntegrityError(f"KV and state take {used:,} B, over the budget of {cfg.budget_bytes:,} B")
        self.states.check_integrity()

    def report(self) -> dict[str, Any]:
        """What the budget did, JSON-ready (the ``state_budget`` object of a replay's report)."""
        s, cfg = self.stats, self.cfg
        return {"split": cfg.split, "budget_bytes": cfg.budget_bytes, "block_bytes": cfg.block_bytes,
                "state_bytes": cfg.state_bytes, "state_slots_start": cfg.state_slots,
                "state_slots_min": s.slots_min, "state_slots_max": s.slots_max, "state_slots_end": self.slots,
                "moves": s.moves, "bytes_moved": s.bytes_moved, "moves_clamped": s.moves_clamped,
                "forced_moves": s.forced_moves, "constraint_refusals": s.constraint_refusals,
                "refusals_kv": s.refusals_kv, "refusals_state": s.refusals_state,
                "mean_running": s.running_area / s.busy_s if s.busy_s else 0.0,
                "peak_running": s.peak_running,
                **({"rule": {"threshold": cfg.rule.threshold, "cooldown": cfg.rule.cooldown,
                             "window": cfg.rule.window}} if self.rebalancer is not None else {})}

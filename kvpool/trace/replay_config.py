"""The settings of a replay (:class:`ReplayConfig`) and what they make of a trace's requests: each one as a
request of the request path (:func:`trace_request`), the blocks it needs alone (:func:`request_blocks`),
an unbounded pool's size (:func:`unbounded_num_blocks`) and the order of first admissions
(:func:`admission_order`). The timing modes and the step-time model are :mod:`kvpool.trace.replayer`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.allocators.partial_index import check_match_unit
from kvpool.allocators.policies import POLICIES
from kvpool.errors import ConfigError
from kvpool.numeric import as_int, as_optional_int, as_real
from kvpool.requests.budget import BudgetConfig
from kvpool.requests.kv_manager import blocks_needed
from kvpool.requests.request import Request
from kvpool.requests.sessions import SessionPolicy
from kvpool.spec import KVCacheGroup
from kvpool.spec.kv import needs_null_block
from kvpool.storage.arena import DEFAULT_PAGE_SIZE
from kvpool.trace.loaders import TraceRequest
from kvpool.trace.replay_state import NoReplayState, RecurrentReplayState, replay_state

TIMINGS = ("instant", "trace")
#: Eviction policies a replay can use: the pool's own, and the offline bound.
REPLAY_POLICIES = (*POLICIES, "belady")
#: ``instant`` timing's token budget per step: a whole prompt at once.
UNLIMITED_TOKENS = 2**62


@dataclass(frozen=True)
class ReplayConfig:
    """Replay settings.

    Args:
        block_size: tokens per block; must divide 512 for a trace with hash ids.
        num_blocks: pool size in blocks; None means unbounded: every request's :func:`request_blocks` at
            once, so that nothing is ever evicted or preempted.
        timing: ``"instant"`` or ``"trace"`` (see :mod:`kvpool.trace.replayer`).
        max_batched_tokens: token budget of one step (``trace`` timing).
        max_running: most requests in flight at once (``trace`` timing).
        step_s: the step-time model: seconds per step.
        prefill_token_s: the step-time model: seconds per uncached prompt token.
        decode_token_s: the step-time model: seconds per decode token.
        groups: a hybrid model's KV cache groups (``KVCacheSpec.groups``): blocks are counted per group
            (windows free blocks, a hit is the prefix every group restores); empty (default): one
            full-attention group.
        policy: the pool's eviction policy, one of :data:`REPLAY_POLICIES` (``belady``: the offline bound).
        pin_prefix: trace hash ids (512-token blocks) of a prefix to pin, e.g. ``(0,)`` for the system
            prompt every Mooncake request starts with: its blocks (in every group) are pinned as soon as
            all are cached and stay pinned to the end of the replay (``()``: pin nothing).
        state_save: for a recurrent hybrid, its state save policy (``tail``, ``dense``, ``interval=N``,
            ``tail+junction``: :mod:`kvpool.requests.state_checkpoints`): each running request holds a state
            slot and a prefix is a hit only up to a state checkpoint. None: no recurrent state.
        state_checkpoints: checkpoints held at most (least recently used evicted); None: unbounded.
        elastic_block_bytes: bytes of one pool block: the replay then runs on a model of an elastic pool
            (:class:`~kvpool.storage.elastic.PageModel`, no memory) whose committed pages follow the used
            and cached blocks as in the engine (:mod:`kvpool.requests.block_memory`), and reports them.
            None (default): no such model.
        elastic_page_size: that model's page size in bytes (2 MiB by default).
        elastic_compact: whether that model's pool is compacted after each step, as the engine's is
            (:mod:`kvpool.requests.compaction`: live blocks move off sparse pages so the committed pages
            stay within one page of the blocks packed). True by default.
        match_unit: tokens per prefix-match unit (a divisor of ``block_size``): hits may end inside a block,
            copied from a cached block (:mod:`kvpool.requests.partial_hits`); None: whole blocks only.
        sessions: ``"session"`` or ``"last=N"``: requests keep their trace's ``session_id`` and a session's
            turns are kept while it is open (:mod:`kvpool.trace.sessions`); None (default): no sessions.
        state_budget: one budget for a recurrent hybrid's KV blocks and state slots, and its split
            (:mod:`kvpool.requests.budget`; ``num_blocks``: the budget all as KV). None: KV only.

    Raises:
        ConfigError: a value out of range.
    """

    block_size: int = 16
    num_blocks: int | None = None
    timing: str = "instant"
    max_batched_tokens: int = 8192
    max_running: int = 256
    step_s: float = 0.005
    prefill_token_s: float = 2e-5
    decode_token_s: float = 1e-4
    groups: tuple[KVCacheGroup, ...] = ()
    policy: str = "lru"
    pin_prefix: tuple[int, ...] = ()
    state_save: str | None = None
    state_checkpoints: int | None = None
    elastic_block_bytes: int | None = None
    elastic_page_size: int = DEFAULT_PAGE_SIZE
    elastic_compact: bool = True
    match_unit: int | None = None
    sessions: str | None = None
    state_budget: BudgetConfig | None = None

    def __post_init__(self) -> None:
        if self.match_unit is not None:
            object.__setattr__(self, "match_unit", check_match_unit(self.match_unit, self.block_size))
        if any(g.block_size != self.block_size for g in self.groups):
            raise ConfigError(f"the KV cache groups' block size must be block_size {self.block_size}")
        if self.timing not in TIMINGS:
            raise ConfigError(f"timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")
        if self.policy not in REPLAY_POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(REPLAY_POLICIES)}, got {self.policy!r}")
        if not isinstance(self.pin_prefix, (tuple, list)):
            raise ConfigError(f"pin_prefix must be a tuple of hash ids, got {self.pin_prefix!r}")
        object.__setattr__(self, "pin_prefix", tuple(as_int(h, "pin_prefix hash id", minimum=0,
                                                            error=ConfigError) for h in self.pin_prefix))
        if self.sessions is not None:
            object.__setattr__(self, "sessions", str(SessionPolicy.parse(self.sessions)))
        state = replay_state(self.state_save, self.state_checkpoints, self.state_budget)
        object.__setattr__(self, "_state", state)  # not a field: asdict, eq and repr leave it out
        object.__setattr__(self, "state_save", state.save)
        object.__setattr__(self, "state_checkpoints", state.checkpoints)
        for name in ("block_size", "num_blocks", "max_batched_tokens", "max_running", "elastic_block_bytes",
                     "elastic_page_size"):
            check = as_optional_int if name in ("num_blocks", "elastic_block_bytes") else as_int
            object.__setattr__(self, name, check(getattr(self, name), name, minimum=1, error=ConfigError))
        for name in ("step_s", "prefill_token_s", "decode_token_s"):  # seconds
            object.__setattr__(self, name, as_real(getattr(self, name), name, minimum=0, finite=True,
                                                   error=ConfigError))

    @property
    def state(self) -> RecurrentReplayState | NoReplayState:
        """The replay's state kind, made from ``state_save``, ``state_checkpoints`` and ``state_budget``
        (:func:`~kvpool.trace.replay_state.replay_state`): a
        :class:`~kvpool.trace.replay_state.RecurrentReplayState`, or
        :data:`~kvpool.trace.replay_state.NO_REPLAY_STATE` without ``state_save``; the replay asks it
        instead of asking whether the model is a hybrid."""
        return self._state  # type: ignore[no-any-return, attr-defined]

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """:attr:`groups`, or one full-attention group when none are given."""
        return self.groups or (KVCacheGroup.full(self.block_size),)

    @property
    def step_tokens(self) -> int:
        """The scheduler's token budget per step (``instant``: unlimited, a whole prompt at once)."""
        return self.max_batched_tokens if self.timing == "trace" else UNLIMITED_TOKENS

    @property
    def max_num_seqs(self) -> int:
        return self.max_running if self.timing == "trace" else 1

def trace_request(req: TraceRequest, request_id: int, block_size: int, match_unit: int | None = None
                  ) -> Request:
    """``req`` as a request of the request path: counts and the prompt's block (and unit) hashes."""
    return Request(request_id, None, req.output_tokens, num_prompt_tokens=req.input_tokens,
                   block_hashes=req.block_hashes(block_size), arrival_s=req.arrival_s,
                   unit_hashes=req.block_hashes(match_unit) if match_unit else [])


def request_blocks(req: TraceRequest, config: ReplayConfig | int) -> int:
    """Pool blocks ``req`` needs at its peak alone (every group, the null block included): what the
    scheduler checks on arrival (a request needing more than the pool is rejected). ``config`` may be a
    block size (one full-attention group, instant timing)."""
    config = ReplayConfig(block_size=config) if isinstance(config, int) else config
    kv_tokens = req.input_tokens + max(req.output_tokens - 1, 0)
    return blocks_needed(config.kv_cache_groups, kv_tokens, config.step_tokens)


def unbounded_num_blocks(requests: Sequence[TraceRequest], config: ReplayConfig | int) -> int:
    """Blocks to hold every request of the trace at once: the sum of :func:`request_blocks` (the null
    block counted once). ``config`` may be a block size (one full-attention group)."""
    config = ReplayConfig(block_size=config) if isinstance(config, int) else config
    null = 1 if needs_null_block(config.kv_cache_groups) else 0
    return max(1 + null, sum(request_blocks(r, config) - null for r in requests) + null)


def admission_order(requests: Sequence[TraceRequest], config: ReplayConfig, num_blocks: int
                    ) -> list[TraceRequest]:
    """The requests in the order the replay first admits them (the future :class:`TraceFuture` needs):
    trace order for ``instant`` timing, arrival order for ``trace`` timing (first come, first served),
    without the requests larger than the pool, which it rejects."""
    order = requests if config.timing == "instant" else sorted(requests, key=lambda r: r.arrival_s)
    return [r for r in order if request_blocks(r, config) <= num_blocks]

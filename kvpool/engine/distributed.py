"""Tensor parallelism across processes (torch.distributed): ranks, collectives, and shipping each step's
decisions from rank 0 to the other ranks.

Who decides and who follows (docs/DESIGN.md argues the choice):

* **Rank 0 decides, once.** Its :class:`~kvpool.engine.engine.LLMEngine` is the only scheduler: admission,
  allocations, frees, prefix hits, evictions and the slot mapping of a step are made there. Its pool is a
  :class:`RecordingPool`, which logs every call that changes the ``BlockPool`` with its arguments and result.
* **One message per step.** Before its own forward, rank 0 ships ``("step", log, batch)`` to every rank: the
  pool calls logged since the last message and the step's :class:`~kvpool.engine.runner.StepBatch`.
* **Followers apply.** A follower replays the log on its own ``BlockPool`` and compares each result with rank
  0's (the same ids from ``allocate``, the same hits from ``lookup``), so the pools stay in lock-step or it
  raises :class:`IntegrityError` at the first divergence. It checks that the batch writes KV only into blocks
  its pool holds in use, then executes the batch on its shard of the model and of the KV: the same forward,
  with the same all-reduces, as rank 0's.
* **check_integrity is collective.** ``check_integrity()`` on rank 0's pool ships ``("check", log)``; every
  rank runs its own ``check_integrity()`` and hashes its pool state (ref counts, hashes, eviction order,
  counters); the digests are all-gathered, and any difference raises :class:`IntegrityError` on every rank.
* **One pool size.** :meth:`TPGroup.min_int` (``all_reduce`` MIN) makes every rank size its pool by the
  rank with the least room.
* **Tiers.** Each rank keeps its own KV shard in its own tiers (their namespace names the rank). Stores
  follow the pool: a device eviction (or, with write-through, a publish) fires the same listener on every
  rank as its pool replays rank 0's calls. A restore from the tiers is one message ``("restore", log,
  plan)``: every rank runs the same :meth:`~kvpool.tiers.manager.OffloadManager.restore` on its own pool
  and tiers, and the ranks keep only the blocks every rank loaded (``all_reduce`` MIN of the count), so a
  rank whose tier misses where rank 0 hit makes it a miss for all: no rank restores a prefix another lacks.
  An elastic cache's restore commits the blocks it loads into on every rank as rank 0 did (rank 0 ships
  its commit mid-restore, ``("commit", log, result)``: :mod:`kvpool.engine.tp_memory`).
  (On CUDA a host tier's copies complete at each rank's own pace, so the ranks' host tiers may hold
  different blocks for a while: the agreement keeps that a miss, never a divergence of the device pools.)
* **Partial hits.** A prefix hit that ends inside a block copies token slots of a cached block on rank 0;
  the copy is logged with the pool calls (:mod:`kvpool.engine.tp_partial`), so every rank makes it in its
  own KV shard, in the same order, before the step that reads it.
* **Compactions.** Rank 0's compaction of an elastic cache after a step (commits, whole-block copies,
  ``move_block`` calls, releases, the free stack's order) is logged the same way
  (:mod:`kvpool.engine.tp_compaction`): every rank moves the same blocks of its own shard.

* **Sleep and wake.** ``("sleep", log)``: every rank replays rank 0's preemptions and releases, then gives
  back every page of its shard; ``("wake", log)``: every rank commits again, and all stay awake only when
  all could (:func:`~kvpool.engine.tp_memory.wake_agreed`). ``("memory", log)`` gathers each rank's
  committed bytes (:func:`committed_by_rank`).

Messages are pickles broadcast on a gloo group over CPU tensors (the ranks of one job trust each other, as
``torch.distributed.broadcast_object_list`` does): one broadcast of a fixed :data:`FRAME_BYTES` frame that
holds the length and the message when it fits, one more for the rest when it does not. Model all-reduces run
on the default group: gloo on CPU, NCCL on CUDA (one GPU per rank, ``LOCAL_RANK``; the NCCL path is written
but has not run here: no GPU).

Only rank 0 samples: tokens reach the followers as the next step's ``token_ids``. Only rank 0 hashes blocks
(the hashes reach the followers inside ``cache_blocks`` calls) and only rank 0's pool may publish KV events.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvpool.engine.pool_log import (  # noqa: F401 (re-exported)
    RecordingPool,
    check_across_ranks,
    check_batch_blocks,
    pool_digest,
    replay,
)
from kvpool.engine.tp_compaction import has_moves, record_moves
from kvpool.engine.tp_group import DEFAULT_TIMEOUT_S, FRAME_BYTES, Channel, TPGroup  # noqa: F401 (re-exported)
from kvpool.engine.tp_memory import (
    FollowRestoreMemory,
    LeadRestoreMemory,
    RecordingMemory,
    committed_bytes,
    wake_agreed,
)
from kvpool.engine.tp_partial import record_copies
from kvpool.engine.tp_state import check_batch_slots, record_states
from kvpool.errors import CollectiveError, InsufficientMemoryError, IntegrityError

T = TypeVar("T")


@dataclass
class ShipStats:
    """Where shipping decisions costs time, over ``steps`` step messages: rank 0 pickling them
    (``encode_s``) and broadcasting them (``send_s``, which includes waiting for followers still busy with
    the step before), the slowest follower unpickling, replaying and checking them (``apply_s``, gathered
    when the followers stop); ``transport_us``: one message's round, both sides idle
    (:meth:`Leader.time_transport`), when measured."""

    steps: int = 0
    encode_s: float = 0.0
    send_s: float = 0.0
    apply_s: float = 0.0
    transport_us: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        per_step = 1e6 / max(self.steps, 1)
        return {"steps": self.steps, "encode_us_per_step": round(self.encode_s * per_step, 1),
                "send_us_per_step": round(self.send_s * per_step, 1),
                "apply_us_per_step": round(self.apply_s * per_step, 1),
                "transport_us": None if self.transport_us is None else round(self.transport_us, 1)}


class _ShippingRunner:
    """Rank 0's runner (a :class:`~kvpool.engine.runner.StepRunner` in front of its own): ships each batch
    (with the pool log) before executing it on rank 0's shard."""

    def __init__(self, leader: Leader, runner: Any) -> None:
        self.leader, self.runner = leader, runner
        self.cache, self.spec, self.recurrent = runner.cache, runner.spec, runner.recurrent

    def execute(self, batch: Any) -> torch.Tensor:
        self.leader.send("step", batch)
        self.leader.in_forward = True
        logits = self.runner.execute(batch)
        self.leader.in_forward = False
        return logits

    def sleep(self) -> int:
        self.leader.send("sleep")  # every follower replays the releases so far, then sleeps
        return self.runner.sleep()

    def wake(self) -> int:
        self.leader.send("wake")
        return wake_agreed(self.leader.tp, self.runner)


class Leader:
    """Rank 0: takes over ``engine`` through its declared seams: a :class:`RecordingPool` in front of its
    ``BlockPool`` (:meth:`~kvpool.requests.kv_manager.KVCacheManager.wrap_pool`) and a runner that ships each
    batch, then executes it (:meth:`~kvpool.engine.engine.LLMEngine.wrap_runner`)."""

    def __init__(self, tp: TPGroup, engine: Any) -> None:
        self.tp, self.engine, self.channel = tp, engine, Channel(tp)
        self.stats, self.in_forward, self.last_batch = ShipStats(), False, None
        self.pool = engine.kv_manager.wrap_pool(lambda pool: RecordingPool(pool, self.check))
        memory = engine.kv_manager.memory
        if memory is not None:  # an elastic cache: its commits and releases are shipped too
            memory.store = RecordingMemory(memory.store, self.pool)
        record_states(engine.state, self.pool)  # a hybrid's state slot calls and moves are shipped too
        partial = engine.kv_manager.partial
        if partial is not None and partial.copy is not None:  # partial hits: every rank copies its shard
            partial.copy = record_copies(partial.copy, self.pool)
        compactor = getattr(engine, "compactor", None)
        if compactor is not None and compactor.copy is not None:  # compactions: every rank moves its shard
            compactor.copy = record_moves(compactor.copy, self.pool)
        engine.wrap_runner(lambda runner: _ShippingRunner(self, runner))
        tiers = getattr(engine, "offload", None)
        if tiers is not None:  # every rank restores from its own tiers, in step with rank 0
            restore = tiers.restore

            def restore_everywhere(plan: Any, parent_hash: Any = None) -> Any:
                self.send("restore", plan)  # (only rank 0 publishes events: the parent stays here)
                return restore(plan, parent_hash)

            tiers.restore = restore_everywhere
            tiers.agree = tp.min_int
            if memory is not None:  # each rank commits what it loads into as rank 0 did
                tiers.memory = LeadRestoreMemory(memory, self.send)

    def send(self, kind: str, batch: Any = None) -> None:
        start = time.perf_counter()
        data = pickle.dumps((kind, self.pool.drain(), batch), protocol=pickle.HIGHEST_PROTOCOL)
        encoded = time.perf_counter()
        self.channel.send(data)
        if kind == "step":
            self.last_batch = batch
            self.stats.steps += 1
            self.stats.encode_s += encoded - start
            self.stats.send_s += time.perf_counter() - encoded

    def time_transport(self, batch: Any, rounds: int = 50) -> float:
        """Microseconds per message to ship ``batch`` (encode, broadcast, followers decode) while no rank
        computes: what shipping a step costs without the wait for the slowest rank."""
        start = time.perf_counter()
        for _ in range(rounds):
            self.send("ping", batch)
        self.send("sync")
        self.tp.min_int(0)  # the followers have decoded every message
        self.stats.transport_us = (time.perf_counter() - start) / rounds * 1e6
        return self.stats.transport_us

    def committed_by_rank(self) -> list[int]:
        """Collective: the bytes each rank's KV cache (and recurrent states) hold committed, in rank order
        (a fixed cache: all of it)."""
        self.send("memory")
        return _gather_committed(self.tp, self.engine.runner.runner)

    def check(self) -> None:
        self.send("check")
        check_across_ranks(self.tp, self.pool.pool, self.engine.cache, self.engine.state)

    def stop(self) -> None:
        """Tell the followers to stop (after replaying the last log) and gather their apply time."""
        self.send("stop")
        times = self.tp.all_gather_bytes((0).to_bytes(8, "little"))
        self.stats.apply_s = max(int.from_bytes(t, "little") for t in times) / 1e9

    def abandon(self, exc: BaseException) -> None:
        """After ``exc`` on rank 0: stop the followers when they wait for a message (not mid-forward, no
        broken collective); otherwise leave them to fail on the broken group (the launcher stops them)."""
        if not self.in_forward and not isinstance(exc, CollectiveError):
            with contextlib.suppress(CollectiveError):
                self.stop()


class Follower:
    """Ranks 1..N-1: apply rank 0's messages to ``engine``'s pool and runner until told to stop."""

    def __init__(self, tp: TPGroup, engine: Any) -> None:
        self.tp, self.engine, self.channel = tp, engine, Channel(tp)
        self.apply_s = 0.0

    @torch.inference_mode()
    def run(self) -> None:
        pool, runner, rank = self.engine.pool, self.engine.runner, self.tp.rank
        states = self.engine.states  # a hybrid's RequestStates (None otherwise): its slot pool follows too
        tiers = getattr(self.engine, "offload", None)
        if tiers is not None:
            tiers.agree = self.tp.min_int
            if tiers.memory is not None:  # rank 0's commits for its restores, mid-restore
                apply = functools.partial(replay, pool, rank=rank, cache=runner.cache, states=states)
                tiers.memory = FollowRestoreMemory(self.receive, apply, rank)
        while True:
            kind, log, batch = self.receive()
            start = time.perf_counter()
            if tiers is not None:  # copies complete at each rank's own pace (CUDA); restores agree anyway
                tiers.poll()
                if has_moves(log):  # rank 0 completed its tiers' jobs before it planned the moves
                    tiers.synchronize()
            replay(pool, log, rank, runner.cache, states)
            if kind == "restore" and tiers is not None:
                tiers.restore(batch)
            elif kind == "step":
                check_batch_blocks(pool, batch.spans, self.engine.block_size, rank)
                check_batch_slots(self.engine.state, batch, rank)
                self.apply_s += time.perf_counter() - start
                runner.execute(batch)
            elif kind == "check":
                check_across_ranks(self.tp, pool, runner.cache, self.engine.state)
            elif kind in ("sleep", "wake", "memory"):
                self._memory(kind, tiers)
            elif kind == "sync":  # the end of time_transport's pings
                self.tp.min_int(0)
            elif kind == "stop":
                self.tp.all_gather_bytes(int(self.apply_s * 1e9).to_bytes(8, "little"))
                return
            elif kind != "ping":
                raise IntegrityError(f"rank {rank}: rank 0 sent an unknown message {kind!r}")

    def receive(self) -> tuple[str, list, Any]:
        """Rank 0's next message: ``(kind, pool log, payload)``."""
        return pickle.loads(self.channel.recv())

    def _memory(self, kind: str, tiers: Any) -> None:
        """Rank 0's ``sleep`` (its stores in flight finished first, as rank 0's), ``wake`` (collective: a
        rank that cannot commit leaves every rank asleep, and rank 0 raises) or ``memory`` (collective: the
        committed bytes gathered)."""
        runner = self.engine.runner
        if kind == "sleep":
            if tiers is not None:
                tiers.synchronize()
            runner.sleep()
        elif kind == "wake":
            with contextlib.suppress(InsufficientMemoryError):
                wake_agreed(self.tp, runner)
        else:
            _gather_committed(self.tp, runner)


def _gather_committed(tp: TPGroup, runner: Any) -> list[int]:
    """Collective: :func:`~kvpool.engine.tp_memory.committed_bytes` of every rank's runner, in rank order."""
    mine = committed_bytes(runner).to_bytes(8, "little")
    return [int.from_bytes(b, "little") for b in tp.all_gather_bytes(mine)]


def committed_by_rank(engine: Any) -> list[int]:
    """Collective, on rank 0 while :func:`run_engine` runs ``lead``: the bytes each rank's KV cache (and
    recurrent states) hold committed now, in rank order (:meth:`Leader.committed_by_rank`)."""
    return engine.runner.leader.committed_by_rank()


def run_engine(tp: TPGroup, engine: Any, lead: Callable[[Any], T], *, transport_rounds: int = 0
               ) -> tuple[T, ShipStats] | None:
    """Run one tensor-parallel job on this rank, where ``engine`` is this rank's ``LLMEngine`` (its shard).

    Rank 0 returns ``(lead(engine), stats)``: ``lead`` drives the engine (``generate``, ``add_request`` +
    ``step``), its decisions shipped as the module docstring says; then a cross-rank ``check_integrity()``
    and the followers are stopped. The other ranks follow until stopped and return None. An exception on rank
    0 stops the followers cleanly where it can (:meth:`Leader.abandon`) and is re-raised. ``transport_rounds``
    > 0: then time that many rounds of shipping the last step's batch (``stats.transport_us``).
    """
    if tp.rank != 0:
        Follower(tp, engine).run()
        return None
    leader = Leader(tp, engine)
    try:
        result = lead(engine)
        engine.pool.check_integrity()
        if transport_rounds and leader.last_batch is not None:
            leader.time_transport(leader.last_batch, transport_rounds)
    except BaseException as exc:
        leader.abandon(exc)
        raise
    leader.stop()
    return result, leader.stats

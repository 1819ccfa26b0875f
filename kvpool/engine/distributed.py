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
  (On CUDA a host tier's copies complete at each rank's own pace, so the ranks' host tiers may hold
  different blocks for a while: the agreement keeps that a miss, never a divergence of the device pools.)

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
import hashlib
import os
import pickle
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kvpool.engine.tp_memory import REORDER, RecordingMemory, apply_memory_call, is_memory_call, memory_digest
from kvpool.errors import CollectiveError, IntegrityError, KVPoolError
from kvpool.spec import cdiv

FRAME_BYTES = 16384  # a step's message is ~0.2-3 KB for a few requests: one broadcast nearly always
DEFAULT_TIMEOUT_S = 300.0  # a collective waiting longer than this raises (a rank hung)
_RECORDED = ("allocate", "free", "touch", "cache_blocks", "lookup", "evict_blocks", "reset_prefix_cache",
             "pin", "pin_prefix", "unpin")
T = TypeVar("T")


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, its ``device``, the model's
    collective ``backend`` (``gloo`` or ``nccl``) and ``control``, the gloo group that carries messages."""

    rank: int
    size: int
    device: torch.device
    backend: str
    control: Any

    @classmethod
    def init(cls, rank: int, size: int, init_method: str = "env://", *, backend: str | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
        """Join the group (``torch.distributed.init_process_group``). ``backend`` None: NCCL when CUDA is
        available (device ``cuda:LOCAL_RANK``, or ``cuda:rank``), else gloo on the CPU."""
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        return cls(rank, size, device, backend, control)

    @classmethod
    def from_env(cls, **kwargs: Any) -> TPGroup:
        """Join the group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``)."""
        return cls.init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", **kwargs)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (the row-parallel layers' reduction)."""
        self._collective(dist.all_reduce, tensor)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` any rank passes (``all_reduce`` MIN)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        self._collective(dist.all_reduce, tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (the same length on every rank), in rank order."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self._collective(dist.all_gather, out, mine, group=self.control)
        return [t.numpy().tobytes() for t in out]

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` (CPU) into every rank's."""
        self._collective(dist.broadcast, tensor, src=0, group=self.control)

    def close(self) -> None:
        """Leave the group: a barrier first, so no rank tears its connections down while another still
        uses them, then ``destroy_process_group``."""
        if dist.is_initialized():
            self._collective(dist.barrier, group=self.control)
            dist.destroy_process_group()

    def _collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except RuntimeError as exc:  # DistBackendError: a peer closed its connections, or a timeout
            why = " ".join(str(exc).split())[:300]
            raise CollectiveError(f"rank {self.rank}: {fn.__name__} failed (another rank stopped?): "
                                  f"{why}") from exc


class Channel:
    """Rank 0 sends bytes, every other rank receives them (broadcast frames on the control group)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self._frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        self._view = self._frame.numpy()

    def send(self, data: bytes) -> None:
        head = len(data).to_bytes(8, "little") + data
        inline = min(len(head), FRAME_BYTES)
        self._view[:inline] = memoryview(head)[:inline]
        self.tp.broadcast(self._frame)
        if len(head) > FRAME_BYTES:
            self.tp.broadcast(torch.frombuffer(bytearray(head[FRAME_BYTES:]), dtype=torch.uint8))

    def recv(self) -> bytes:
        self.tp.broadcast(self._frame)
        size = int.from_bytes(self._view[:8].tobytes(), "little")
        data = self._view[8:8 + size].tobytes()
        if 8 + size > FRAME_BYTES:
            rest = torch.empty(8 + size - FRAME_BYTES, dtype=torch.uint8)
            self.tp.broadcast(rest)
            data += rest.numpy().tobytes()
        return data


class RecordingPool:
    """Rank 0's ``BlockPool`` with a log of every call that changes it, for the followers to replay.

    The calls of :data:`_RECORDED` go to the pool and, when they return, are logged as ``(name, args,
    kwargs, result)`` (one that raises changed nothing, so nothing is logged; iterables are logged as
    lists); everything else (reads, counters) passes straight through. :meth:`check_integrity` is the
    cross-rank check: it calls ``on_check``.
    """

    def __init__(self, pool: Any, on_check: Callable[[], None]) -> None:
        self.pool = pool
        self.log: list[tuple[str, tuple, dict[str, Any], Any]] = []
        self._on_check = on_check

    def __getattr__(self, name: str) -> Any:  # reads only: every recorded call is defined below
        if name == "pool":  # not set yet (unpickling, copying): no recursion
            raise AttributeError(name)
        return getattr(self.pool, name)

    def drain(self) -> list[tuple[str, tuple, dict[str, Any], Any]]:
        log, self.log = self.log, []
        return log

    def allocate(self, n: int) -> list[int]:
        return self._call("allocate", n)

    def free(self, block_ids: Iterable[int], *args: Any, **kwargs: Any) -> None:
        self._call("free", list(block_ids), *args, **kwargs)

    def touch(self, block_ids: Iterable[int]) -> None:
        self._call("touch", list(block_ids))

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[Hashable], **kwargs: Any) -> None:
        self._call("cache_blocks", list(block_ids), list(block_hashes), **kwargs)

    def lookup(self, block_hashes: Iterable[Hashable]) -> list[int]:
        return self._call("lookup", list(block_hashes))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._call("evict_blocks", list(block_ids))

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    def pin(self, block_ids: Iterable[int]) -> None:
        self._call("pin", list(block_ids))

    def pin_prefix(self, block_hashes: Sequence[Hashable]) -> list[int]:
        return self._call("pin_prefix", list(block_hashes))

    def unpin(self, block_ids: Iterable[int]) -> None:
        self._call("unpin", list(block_ids))

    def reorder_free(self, key: Callable[[int], Any]) -> None:  # an elastic pool's page order: tp_memory
        self.pool.reorder_free(key)
        self.log.append((REORDER, (), {}, None))

    def check_integrity(self) -> None:
        """Check every rank's pool and that all of them hold the same state (a collective)."""
        self._on_check()

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.pool, name)(*args, **kwargs)
        self.log.append((name, args, kwargs, result))
        return result


def replay(pool: Any, log: Sequence[tuple[str, tuple, dict[str, Any], Any]], rank: int,
           cache: Any = None) -> None:
    """Apply rank 0's logged pool calls to ``pool`` (and its memory calls to this rank's elastic ``cache``:
    :mod:`kvpool.engine.tp_memory`); IntegrityError at the first result that differs."""
    for name, args, kwargs, expected in log:
        if is_memory_call(name):
            apply_memory_call(pool, cache, name, args, expected, rank)
            continue
        if name not in _RECORDED:
            raise IntegrityError(f"rank {rank}: rank 0 shipped an unknown pool call {name!r}")
        try:
            result = getattr(pool, name)(*args, **kwargs)
        except KVPoolError as exc:
            raise IntegrityError(f"rank {rank}: rank 0's {name} raised here ({exc}): the pools diverged") \
                from exc
        if result != expected:
            raise IntegrityError(f"rank {rank}: {name} returned {result!r} where rank 0's returned "
                                 f"{expected!r}: the pools diverged")


def check_batch_blocks(pool: Any, spans: Iterable[tuple[Sequence[list[int]], int, int]], block_size: int,
                       rank: int) -> None:
    """Every block a step writes (tokens ``start .. end - 1`` of each span, in each group's table) is in use
    in ``pool``."""
    for tables, start, end in spans:
        for table in tables:
            for block in table[start // block_size:cdiv(end, block_size)]:
                if pool.ref_count(block) == 0:
                    raise IntegrityError(f"rank {rank}: the step writes KV into block {block}, which this "
                                         f"rank's pool holds free")


def pool_digest(pool: Any) -> bytes:
    """SHA-256 of a ``BlockPool``'s state as its public reads show it: every block's ref count and hash, the
    eviction order of the cached free blocks, the pins and the prefix-cache counters. O(num_blocks)."""
    n = pool.num_blocks
    state = ([pool.ref_count(b) for b in range(n)], [pool.block_hash(b) for b in range(n)],
             pool.evictable_blocks(), sorted(pool.pinned_blocks().items()), pool.num_free_blocks,
             repr(pool.stats))
    return hashlib.sha256(repr(state).encode()).digest()


def check_across_ranks(tp: TPGroup, pool: Any, cache: Any = None) -> None:
    """Collective: ``pool.check_integrity()`` on every rank, then the ranks' :func:`pool_digest` compared
    (with an elastic ``cache``, its pages too: :func:`~kvpool.engine.tp_memory.memory_digest`).

    Raises:
        IntegrityError: this rank's invariants are broken, or (on every rank) the digests differ.
    """
    broken: IntegrityError | None = None
    try:
        pool.check_integrity()
        digest = pool_digest(pool) + memory_digest(cache)
    except IntegrityError as exc:
        broken, digest = exc, bytes(64)  # still take part, so no rank waits for this one
    digests = tp.all_gather_bytes(digest)
    if broken is not None:
        raise broken
    if len(set(digests)) > 1:
        found = ", ".join(f"rank {r}: {d.hex()[:16]}/{d.hex()[64:80]}" for r, d in enumerate(digests))
        raise IntegrityError(f"the pool state differs across tensor-parallel ranks ({found})")


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
        engine.wrap_runner(lambda runner: _ShippingRunner(self, runner))
        tiers = getattr(engine, "offload", None)
        if tiers is not None:  # every rank restores from its own tiers, in step with rank 0
            restore = tiers.restore

            def restore_everywhere(plan: Any, parent_hash: Any = None) -> Any:
                self.send("restore", plan)  # (only rank 0 publishes events: the parent stays here)
                return restore(plan, parent_hash)

            tiers.restore = restore_everywhere
            tiers.agree = tp.min_int

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

    def check(self) -> None:
        self.send("check")
        check_across_ranks(self.tp, self.pool.pool, self.engine.cache)

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
        tiers = getattr(self.engine, "offload", None)
        if tiers is not None:
            tiers.agree = self.tp.min_int
        while True:
            data = self.channel.recv()
            start = time.perf_counter()
            kind, log, batch = pickle.loads(data)
            if tiers is not None:  # copies complete at each rank's own pace (CUDA); restores agree anyway
                tiers.poll()
            replay(pool, log, rank, runner.cache)
            if kind == "restore" and tiers is not None:
                tiers.restore(batch)
            elif kind == "step":
                check_batch_blocks(pool, batch.spans, self.engine.block_size, rank)
                self.apply_s += time.perf_counter() - start
                runner.execute(batch)
            elif kind == "check":
                check_across_ranks(self.tp, pool, runner.cache)
            elif kind == "sync":  # the end of time_transport's pings
                self.tp.min_int(0)
            elif kind == "stop":
                self.tp.all_gather_bytes(int(self.apply_s * 1e9).to_bytes(8, "little"))
                return
            elif kind != "ping":
                raise IntegrityError(f"rank {rank}: rank 0 sent an unknown message {kind!r}")


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

"""Copies between a host buffer's rows and a kvpool tier, on one worker thread.

An engine's scheduler submits a job (store rows to the tier, or load tier blocks into rows) and returns at
once; the worker runs the jobs in order and reports each one with how many of its leading blocks it moved
(:class:`JobDone`). A row is one block, ``block_bytes`` wide (vLLM's primary-tier chunk); consecutive rows
move in one tier call, straight from or into the buffer (no staging copy): a tier's ``set`` reads the rows
and its ``get`` fills them, checking every block's namespace and checksum, so a block that is missing,
truncated, flipped or unreadable ends the load there and the rows from it on are not reported loaded (their
content is unspecified: the engine must not read them). A fault of the medium (a dead Redis, a full disk)
is a short count, never an exception out of the worker.

A load may have a deadline (``load_timeout_s``): one not finished by then is reported failed at once, with
an event (:attr:`JobDone.released`) the worker sets when its I/O can no longer write the job's rows (the
job ended, or was skipped before it began). Until then the engine must not reuse those rows: a late write
would land in them.

:func:`open_tier` builds the tier an engine's configuration names (``disk`` or ``redis``), with
:func:`kvpool.tiers.from_url.build_tier`, where every tier is made.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvpool.errors import ConfigError
from kvpool.numeric import as_int, as_real
from kvpool.tiers.auth import TierKey
from kvpool.tiers.backend import Namespace, TierBackend
from kvpool.tiers.from_url import TierURL, build_tier, disk_url, resolve_auth_key

logger = logging.getLogger(__name__)

TIER_KINDS = ("disk", "redis")


def open_tier(kind: str, namespace: Namespace, block_bytes: int, *,
              directory: str | os.PathLike | None = None, capacity_bytes: int | None = None,
              url: str | None = None, prefix: str = "kvpool",
              timeout_s: float = 2.0, retry_s: float = 1.0, ttl_s: int | None = None,
              auth_key: TierKey | str | bytes | None = None) -> TierBackend:
    """A :class:`~kvpool.tiers.file.FileTier` (``kind="disk"``: ``directory`` and ``capacity_bytes``) or a
    :class:`~kvpool.tiers.redis.RedisTier` (``kind="redis"``: ``url``, and optionally ``prefix``,
    ``timeout_s``, ``retry_s``, ``ttl_s``) of ``block_bytes`` per block under ``namespace``.

    Its values are authenticated (:class:`~kvpool.tiers.auth.TierKey`): ``auth_key`` is a key or a secret
    (at least 16 bytes); None takes the fleet's secret from ``$KVPOOL_TIER_KEY`` (or ``$KVPOOL_HASH_SEED``),
    so an engine's JSON configuration never carries it; ``"public"`` opts out (a folder or a Redis no one
    else can write: values are still checked for faults).

    Raises:
        ConfigError: an unknown kind, a missing option, no secret given or in the environment; the tier's
            own errors (a directory another process holds, a malformed URL).
    """
    if kind == "disk":
        if directory is None or capacity_bytes is None:
            raise ConfigError("a disk tier needs 'directory' and 'capacity_bytes'")
        capacity = as_int(capacity_bytes, "capacity_bytes", minimum=0, error=ConfigError)
        tier = TierURL("disk", disk_url(str(directory), bytes=capacity), bytes=capacity, path=str(directory))
        return build_tier(tier, namespace, block_bytes=block_bytes, auth_key=resolve_auth_key(auth_key))
    if kind == "redis":
        if url is None:
            raise ConfigError("a redis tier needs 'url' (redis://HOST:PORT[/DB])")
        return build_tier(TierURL("remote", url), namespace, block_bytes=block_bytes,
                          auth_key=resolve_auth_key(auth_key), prefix=prefix, timeout_s=timeout_s,
                          retry_s=retry_s, ttl_s=ttl_s)
    raise ConfigError(f"tier must be one of {', '.join(TIER_KINDS)}, got {kind!r}")


@dataclass(frozen=True)
class JobDone:
    """One finished job: ``moved`` of its ``total`` blocks (a leading run for a load; for a store, how many
    are in the tier afterwards), in ``seconds`` on the worker, ``moved * block_bytes`` bytes.

    ``released`` is None when the job's I/O has ended; for a load given up at its deadline (moved 0) it is
    the event the worker sets once that I/O can no longer write the job's rows."""

    job_id: int
    is_load: bool
    moved: int
    total: int
    seconds: float
    nbytes: int
    released: threading.Event | None = None

    @property
    def ok(self) -> bool:
        return self.moved == self.total


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive rows: ``(position in slots, first row, length)``, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            pos, first, length = runs[-1]
            runs[-1] = (pos, first, length + 1)
        else:
            runs.append((i, slot, 1))
    return runs


class TierJobs:
    """Store and load jobs between ``rows`` (a contiguous CPU ``uint8 [num_rows, block_bytes]`` tensor, the
    engine's host buffer) and ``tier``, run in submission order by one daemon thread.

    Args:
        load_timeout_s: seconds from a load's submission after which :meth:`finished` reports it failed
            with a release event (None: a load is reported when its I/O ends). The deadline is checked in
            :meth:`finished`, on ``clock`` (``time.monotonic``).

    Raises:
        ConfigError: ``rows`` is not such a tensor, or its row width is not the tier's ``block_bytes``;
            ``load_timeout_s`` negative or not a number.
    """

    def __init__(self, tier: TierBackend, rows: torch.Tensor, name: str = "kvpool-tier-jobs", *,
                 load_timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(rows, torch.Tensor) and rows.dtype == torch.uint8 and rows.dim() == 2
                and rows.is_contiguous() and rows.device.type == "cpu" and rows.shape[1] == tier.block_bytes):
            raise ConfigError(f"rows must be a contiguous CPU uint8 tensor [n, {tier.block_bytes}]")
        self.tier, self.rows = tier, rows
        self.load_timeout_s = None if load_timeout_s is None else as_real(
            load_timeout_s, "load_timeout_s", minimum=0.0, error=ConfigError)
        self._clock = clock
        self._lock = threading.Lock()
        self._deadlines: dict[int, tuple[float, float, int]] = {}  # open loads: (submitted, deadline, total)
        self._given_up: dict[int, threading.Event] = {}  # loads reported failed whose I/O may still run
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.SimpleQueue[JobDone] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit_store(self, job_id: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Queue a copy of rows ``slots`` into the tier under ``keys`` (tier keys, one per slot)."""
        self._todo.put((job_id, False, list(keys), [int(s) for s in slots]))

    def submit_load(self, job_id: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Queue a copy of the tier's blocks ``keys`` into rows ``slots``."""
        if self.load_timeout_s is not None:
            now = self._clock()
            with self._lock:
                self._deadlines[job_id] = (now, now + self.load_timeout_s, len(keys))
        self._todo.put((job_id, True, list(keys), [int(s) for s in slots]))

    def finished(self) -> list[JobDone]:
        """The jobs finished since the last call, in the order they finished, then the loads given up at
        their deadline (each reported once: its later end is not reported again)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out + self._give_up_late_loads()

    def _give_up_late_loads(self) -> list[JobDone]:
        if not self._deadlines:
            return []
        now, out = self._clock(), []
        with self._lock:
            for job_id, (submitted, deadline, total) in list(self._deadlines.items()):
                if now >= deadline:
                    del self._deadlines[job_id]
                    released = self._given_up[job_id] = threading.Event()
                    out.append(JobDone(job_id, True, 0, total, now - submitted, 0, released))
        return out

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        return self._todo.unfinished_tasks

    def drain(self) -> None:
        """Block until every submitted job has finished (its result waits in :meth:`finished`)."""
        self._todo.join()

    def close(self) -> None:
        """Finish the queued jobs, stop the thread and close the tier."""
        self._todo.put(None)
        self._thread.join()
        self.tier.close()

    def _work(self) -> None:
        while True:
            job = self._todo.get()
            try:
                if job is None:
                    return
                self._run(*job)
            finally:
                self._todo.task_done()

    def _run(self, job_id: int, is_load: bool, keys: list[bytes], slots: list[int]) -> None:
        start = time.perf_counter()
        moved = 0
        try:
            if not is_load:
                moved = self._store(keys, slots)
            elif not self._was_given_up(job_id):
                moved = self._load(job_id, keys, slots)
        except Exception:  # a fault is a miss, never a crash of the worker
            logger.exception("kvpool tier job %d failed", job_id)
            moved = 0
        with self._lock:  # a load given up is reported already: its I/O has ended, so its rows are free
            released = self._given_up.pop(job_id, None) if is_load else None
            self._deadlines.pop(job_id, None)
            if released is None:
                self._done.put(JobDone(job_id, is_load, moved, len(keys), time.perf_counter() - start,
                                       moved * self.tier.block_bytes))
        if released is not None:
            released.set()

    def _was_given_up(self, job_id: int) -> bool:
        with self._lock:
            return job_id in self._given_up

    def _store(self, keys: list[bytes], slots: list[int]) -> int:
        return sum(self.tier.set(keys[pos:pos + n], self.rows[first:first + n])
                   for pos, first, n in slot_runs(slots))

    def _load(self, job_id: int, keys: list[bytes], slots: list[int]) -> int:
        moved = 0
        for pos, first, n in slot_runs(slots):
            if pos and self._was_given_up(job_id):
                break
            got = self.tier.get(keys[pos:pos + n], self.rows[first:first + n])
            moved += got
            if got < n:
                break
        return moved

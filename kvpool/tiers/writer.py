"""``Writer``: stores into the lower tiers (disk, remote) off the critical path.

A store is staged first: the caller copies the blocks into rows of a **staging ring** (a pre-allocated
``uint8 [staging_blocks, block_bytes]`` buffer; the copy is a memcpy, after which the source block may be
reused at once), then submits the rows with their keys and target tiers. A worker thread runs the
submitted jobs in order (``tier.set`` of each target) and then frees the rows. Until its job has run, a
staged block is **pending**: :meth:`Writer.exists` counts it as stored in its target tiers and
:meth:`Writer.get` serves it from its staging row, so a block is never missing between its eviction and
its write. Rows are freed in submission order (one worker, FIFO), so the ring allocates contiguous runs;
a stage that finds no room waits for the oldest jobs.

With ``asynchronous=False`` jobs run inline in :meth:`submit` (deterministic order; used by tests and by
a replay, which moves no data). A fault in a tier is counted by that tier (it never raises); an
unexpected exception in a job is counted in :attr:`Writer.job_errors` and the worker goes on.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvpool.errors import IntegrityError, InvalidArgumentError
from kvpool.numeric import as_int
from kvpool.tiers.backend import TierBackend


@dataclass
class _Job:
    tiers: tuple[int, ...]
    keys: list[Hashable]
    start: int  # first staging row
    rows: int  # rows held (0 for hash-only)


class Writer:
    """Write-behind stores into ``tiers`` (indices into this list name them in :meth:`submit`).

    Args:
        tiers: the lower tiers, all with the same ``block_bytes``.
        staging_blocks: rows of the staging ring (the most blocks in flight); >= 1.
        asynchronous: run jobs on a worker thread (True) or inline (False).
    """

    def __init__(self, tiers: Sequence[TierBackend], *, staging_blocks: int = 64, asynchronous: bool = True
                 ) -> None:
        sizes = {t.block_bytes for t in tiers}
        if len(sizes) > 1:
            raise InvalidArgumentError(f"lower tiers disagree on block_bytes: {sorted(sizes)}")
        staging_blocks = as_int(staging_blocks, "staging_blocks", minimum=1)
        self.tiers = list(tiers)
        self.block_bytes = sizes.pop() if sizes else 0
        self.capacity = staging_blocks
        rows = staging_blocks if self.block_bytes else 0
        self.ring = torch.empty(rows, self.block_bytes, dtype=torch.uint8)
        self._pending: list[dict[Hashable, int]] = [{} for _ in self.tiers]  # key -> staging row
        self._held: deque[_Job] = deque()  # jobs whose rows are in use, oldest first
        self._head = 0  # next free row
        self._cond = threading.Condition()
        self.job_errors = 0
        self._queue: queue.Queue[_Job | None] | None = None
        self._thread: threading.Thread | None = None
        if asynchronous and self.tiers:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._work, name="kvpool-tier-writer", daemon=True)
            self._thread.start()

    # ---- staging and submitting -------------------------------------------------------------------

    def stage(self, n: int) -> tuple[int, torch.Tensor | None]:
        """Reserve ``n`` contiguous staging rows (1 <= n <= capacity), waiting for old jobs when the ring is
        full; returns (first row, the rows ``uint8 [n, block_bytes]``, None for hash-only). Fill them, then
        :meth:`submit` them, before the next ``stage``."""
        if not self.block_bytes:
            return 0, None
        if not 1 <= n <= self.capacity:
            raise InvalidArgumentError(f"stage 1..{self.capacity} blocks at a time, got {n}")
        with self._cond:
            while (start := self._free_run(n)) is None:
                self._cond.wait()
            self._head = start + n
        return start, self.ring[start:start + n]

    def _free_run(self, n: int) -> int | None:
        """Where ``n`` contiguous free rows start (at the head, or wrapped to row 0), or None. The rows in
        use run from the oldest held job's start to the head, wrapping past the end of the ring."""
        if not self._held:
            return 0
        tail = self._held[0].start
        if self._head > tail:  # in use: [tail, head); free: [head, capacity) and [0, tail)
            if self._head + n <= self.capacity:
                return self._head
            return 0 if n <= tail else None
        return self._head if self._head + n <= tail else None  # wrapped: free [head, tail) only

    def submit(self, tiers: Sequence[int], keys: Sequence[Hashable], start: int) -> None:
        """Store the ``len(keys)`` rows staged at ``start`` under ``keys`` into each tier of ``tiers``
        (indices); from now until the job has run they are pending there."""
        job = _Job(tuple(tiers), list(keys), start, len(keys) if self.block_bytes else 0)
        with self._cond:
            for t in job.tiers:
                pending = self._pending[t]
                for i, key in enumerate(job.keys):
                    pending[key] = start + i
            self._held.append(job)
        if self._queue is None:
            self._run(job)
        else:
            self._queue.put(job)

    def _work(self) -> None:
        assert self._queue is not None
        while (job := self._queue.get()) is not None:
            self._run(job)
            self._queue.task_done()
        self._queue.task_done()

    def _run(self, job: _Job) -> None:
        rows = self.ring[job.start:job.start + job.rows] if self.block_bytes else None
        for t in job.tiers:
            try:
                self.tiers[t].set(job.keys, rows)
            except Exception:  # noqa: BLE001 (a bug in a tier must not kill the writer: count it)
                with self._cond:
                    self.job_errors += 1
        with self._cond:
            for t in job.tiers:
                pending = self._pending[t]
                for i, key in enumerate(job.keys):
                    if pending.get(key) == job.start + i:
                        del pending[key]
            done = self._held.popleft()
            assert done is job, "jobs finish in submission order"
            if not self._held:
                self._head = 0
            self._cond.notify_all()

    # ---- reading through the pending stores -------------------------------------------------------

    def exists(self, t: int, keys: Sequence[Hashable]) -> int:
        """Leading ``keys`` stored in tier ``t`` or pending for it."""
        n, pending, tier = 0, self._pending[t], self.tiers[t]
        while n < len(keys):
            with self._cond:
                while n < len(keys) and keys[n] in pending:
                    n += 1
            if n == len(keys):
                break
            run = tier.exists(keys[n:])
            if not run:
                break
            n += run
        return n

    def get(self, t: int, keys: Sequence[Hashable], out: torch.Tensor | None) -> int:
        """Load the leading blocks of ``keys`` held by tier ``t`` or pending for it into ``out`` rows;
        returns how many (a pending block comes from its staging row)."""
        n, pending, tier = 0, self._pending[t], self.tiers[t]
        while n < len(keys):
            with self._cond:  # the rows cannot be freed while this copies them
                while n < len(keys) and (row := pending.get(keys[n])) is not None:
                    if out is not None and self.block_bytes:
                        out[n].copy_(self.ring[row])
                    n += 1
                run = 0
                while n + run < len(keys) and keys[n + run] not in pending:
                    run += 1
            if not run:
                break
            got = tier.get(keys[n:n + run], out[n:] if out is not None else None)
            n += got
            if got < run:
                break
        return n

    def refresh(self, t: int, keys: Sequence[Hashable]) -> None:
        """Mark ``keys`` recently used in tier ``t`` (pending ones will be, once written)."""
        with self._cond:
            keys = [k for k in keys if k not in self._pending[t]]
        self.tiers[t].refresh(keys)

    # ---- lifetime -----------------------------------------------------------------------------------

    @property
    def num_pending(self) -> int:
        """Blocks staged and not yet written (counting each target tier once per block)."""
        with self._cond:
            return sum(len(job.keys) for job in self._held)

    def synchronize(self) -> None:
        """Wait until every submitted job has run."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Run what is queued, then stop the worker."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = self._thread = None

    def check_integrity(self) -> None:
        """Pending keys point at rows of jobs still held, and held jobs' rows lie in the ring."""
        with self._cond:
            rows = {job.start + i for job in self._held for i in range(job.rows)}
            ok = all(0 <= r < max(self.capacity, 1) for r in rows)
            if self.block_bytes:
                ok = ok and all(row in rows for p in self._pending for row in p.values())
            if not ok:
                raise IntegrityError("tier writer: a pending block points outside the staging rows in use")

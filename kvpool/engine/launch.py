"""Start, watch and stop the ranks of one tensor-parallel job on this machine.

:func:`launch` starts ``tp_size`` processes (multiprocessing ``spawn``: nothing inherited from the caller,
safe with CUDA); rank ``r`` joins the group (:meth:`kvpool.engine.distributed.TPGroup.init`) and runs
``target(tp, *args)``; :func:`launch` returns rank 0's result. The launching process takes part in no
collective, so no collective can block it: it only watches the ranks.

* A rank that raises sends the exception and its traceback over its own pipe and exits with status 1.
* When a rank fails (raises, is killed, exits non-zero or exits without reporting), the others have
  ``grace_s`` to report (a dead peer makes their next collective raise ``CollectiveError``); then every rank
  still alive is stopped (SIGTERM, then SIGKILL) and the *first own* failure is raised: a rank's own error
  or death comes before the collective errors it caused on the others. A bad-input ``KVPoolError``
  (``ConfigError``, ``OutOfBlocksError``, ...) is re-raised as itself, as the single-process engine raises
  it; anything else becomes :class:`~kvpool.errors.RankFailedError` (rank, one line, traceback).
* Ctrl-C: the launcher stops every rank and re-raises ``KeyboardInterrupt``; the ranks ignore SIGINT (a
  terminal sends it to the whole process group), so a rank never dies half-way on its own.
* If the launcher dies, the kernel kills the ranks (``PR_SET_PDEATHSIG`` = SIGKILL, Linux): no orphans.

The ranks meet through a file in a fresh temporary directory (``file://`` rendezvous): no port to choose and
none to collide; gloo then connects the ranks on ports the OS picks. ``torchrun`` users skip this module:
each process joins with :meth:`TPGroup.from_env` and torchrun watches them.

Why not ``torch.multiprocessing.spawn``: it raises for the first process to *exit* (often a rank that only
lost its peer), carries errors as text (no typed re-raise), and asks the kernel for SIGINT on the parent's
death, which a rank blocked inside a collective does not act on.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from kvpool.engine.distributed import TPGroup
from kvpool.errors import CollectiveError, ConfigError, IntegrityError, KVPoolError, RankFailedError

GRACE_S = 3.0  # after a failure, how long the other ranks may take to report theirs
STOP_S = 5.0  # after SIGTERM, how long before SIGKILL


@dataclass
class _Rank:
    rank: int
    process: Any
    conn: Connection
    pid: int = 0
    ready: bool = False
    reported: bool = False  # sent its result (or its error)
    result: Any = None
    error: tuple[BaseException | None, str, str] | None = None  # (exception, "Type: message", traceback)
    failed_at: float = field(default=float("inf"))


def launch(target: Callable[..., Any], tp_size: int, *args: Any, backend: str | None = None,
           on_ready: Callable[[list[int]], None] | None = None, grace_s: float = GRACE_S) -> Any:
    """Run ``target(tp, *args)`` on ``tp_size`` new processes; return rank 0's result.

    Args:
        target: a module-level function (it is pickled to the ranks), with picklable ``args``.
        backend: ``gloo``, ``nccl`` or None (NCCL when CUDA is available, else gloo).
        on_ready: told the ranks' pids once every rank has joined the group.

    Raises:
        ConfigError: ``tp_size`` < 1. A rank's bad-input ``KVPoolError``, as itself.
        RankFailedError: a rank raised anything else, was killed, or exited without a result.
        KeyboardInterrupt: after stopping every rank.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size must be an int >= 1, got {tp_size!r}")
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvpool-tp-") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        ranks: list[_Rank] = []
        try:
            for r in range(tp_size):
                recv, send = ctx.Pipe(duplex=False)
                rank_args = (r, tp_size, init_method, backend, os.getpid(), target, args, send)
                process = ctx.Process(target=_rank_main, name=f"kvpool-tp-rank-{r}", daemon=True,
                                      args=rank_args)
                process.start()
                send.close()
                ranks.append(_Rank(r, process, recv))
            _watch(ranks, on_ready, grace_s)
        finally:
            _stop(ranks)
    return _outcome(ranks)


def _rank_main(rank: int, size: int, init_method: str, backend: str | None, parent: int,
               target: Callable[..., Any], args: tuple, conn: Connection) -> None:
    """A rank's process: die with the launcher, join the group, run ``target``, report."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        tp = TPGroup.init(rank, size, init_method, backend=backend)
        _report(conn, "ready", os.getpid())
        result = target(tp, *args)
        tp.close()
        _report(conn, "result", result)
    except BaseException as exc:  # noqa: BLE001 (everything goes to the launcher)
        _report(conn, "error", _portable(exc), f"{type(exc).__name__}: {exc}", traceback.format_exc())
        conn.close()
        os._exit(1)  # no interpreter teardown: nothing may block on a broken group
    conn.close()
    # Reported and out of the group: skip the interpreter's teardown too, where the C++ destructors of torch's
    # gloo threads can abort ("terminate called without an active exception": CI saw a rank killed by
    # SIGABRT after its work was done, once in a run of the slow tests).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report(conn: Connection, *message: Any) -> None:
    """Plain pickle, not the pipe's own: that one shares tensors through memory this process takes with it
    when it exits; a plain pickle carries a copy."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def _portable(exc: BaseException) -> BaseException | None:
    """``exc`` if it survives pickling (to be re-raised as itself), else None."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return None


def _watch(ranks: list[_Rank], on_ready: Callable[[list[int]], None] | None, grace_s: float) -> None:
    """Read every rank's reports until all have exited, or ``grace_s`` after the first failure."""
    conns = {r.conn: r for r in ranks}
    sentinels = {r.process.sentinel: r for r in ranks}
    announced = False
    while conns or sentinels:
        first_failure = min(r.failed_at for r in ranks)
        timeout = None if first_failure == float("inf") else first_failure + grace_s - time.monotonic()
        if timeout is not None and timeout <= 0:
            return
        for ready in wait([*conns, *sentinels], timeout):
            if ready in conns:
                _read(conns, conns[ready])
            else:
                rank = sentinels.pop(ready)
                rank.process.join()
                while rank.conn in conns:  # what it sent before exiting comes first
                    _read(conns, rank)
                if rank.process.exitcode != 0 or not rank.reported:
                    rank.failed_at = min(rank.failed_at, time.monotonic())
        if not announced and on_ready is not None and all(r.ready for r in ranks):
            announced = True
            on_ready([r.pid for r in ranks])


def _read(conns: dict[Connection, _Rank], rank: _Rank) -> None:
    try:
        kind, *payload = pickle.loads(rank.conn.recv_bytes())
    except (EOFError, OSError):
        del conns[rank.conn]
        return
    if kind == "ready":
        rank.ready, rank.pid = True, payload[0]
    elif kind == "result":
        rank.reported, rank.result = True, payload[0]
    else:
        rank.reported, rank.error = True, tuple(payload)
        rank.failed_at = min(rank.failed_at, time.monotonic())


def _stop(ranks: list[_Rank]) -> None:
    """SIGTERM every rank still alive, SIGKILL those alive after :data:`STOP_S`, reap all."""
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.terminate()
    deadline = time.monotonic() + STOP_S
    for rank in ranks:
        rank.process.join(max(0.0, deadline - time.monotonic()))
        if rank.process.is_alive():
            rank.process.kill()
            rank.process.join()
        rank.conn.close()


def _outcome(ranks: list[_Rank]) -> Any:
    """Rank 0's result, or the first own failure raised (see the module docstring)."""
    failed = sorted((r for r in ranks if r.failed_at != float("inf")), key=lambda r: r.failed_at)
    own = [r for r in failed if not (r.error and isinstance(r.error[0], CollectiveError))]
    if not failed:
        return ranks[0].result
    rank = (own or failed)[0]
    if rank.error is None:
        code = rank.process.exitcode
        why = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with status {code} without reporting")
        raise RankFailedError(f"rank {rank.rank} {why}", rank.rank)
    exc, summary, trace = rank.error
    if isinstance(exc, KVPoolError) and not isinstance(exc, (IntegrityError, CollectiveError)):
        raise exc
    raise RankFailedError(f"rank {rank.rank} failed: {summary}", rank.rank, trace)

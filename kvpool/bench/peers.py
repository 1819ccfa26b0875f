"""vLLM's and SGLang's allocators timed in the same run as kvpool's: the peer rows of ``kvpool bench alloc``
(and so of ``kvpool bench targets``) and of ``benchmarks/peers/compare.py``.

Each side is a script of a source checkout's ``benchmarks/peers/`` folder run by its own interpreter: kvpool's
(``kvpool_ops.py``) by this one, vLLM's (``vllm_ops.py``) and SGLang's (``sglang_ops.py``) by the venvs
``benchmarks/peers/setup.sh`` builds under ``$PEER_VENVS`` (default ``~/.cache/kvpool-peers``). Every side
runs the same loops (``patterns.py``); only the calls differ. The runner starts each side once (the imports
paid once) and asks for rounds in turn, kvpool first, then each peer, ``rounds`` times over, so that
kvpool's timing and a peer's are minutes apart at most and see the same load; a row's ratio is the median of
the per-round ratios peer ns / kvpool ns. A peer whose venv is missing (or whose script fails) gets a row
that says so and no ratio: the figure DESIGN.md's peer table stored is shown beside it, labelled, never
divided into a live one.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

#: The folder of the side scripts in a source checkout.
SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
#: Where a stored figure comes from (shown beside a peer that is not installed, never divided).
STORED_FROM = "DESIGN.md's peer table: a 2-core CPU machine like the dev box, measured before 2026-11-29"


@dataclass(frozen=True)
class PeerRow:
    """One compared operation: the peer side, the operation (the same name on kvpool's side) and the figure
    DESIGN.md stored for it (ns per block, or per alloc + free pair)."""

    side: str
    op: str
    what: str
    stored_ns: float


ROWS = (
    PeerRow("vLLM", "block pool allocate(1)+free", "BlockPool", 1550.0),
    PeerRow("vLLM", "block pool allocate(256)+free", "BlockPool", 580.0),
    PeerRow("vLLM", "block pool evicting allocate(1)", "BlockPool", 1000.0),
    PeerRow("vLLM", "sha256 block hash (16 tokens)", "hash_block_tokens", 3300.0),
    PeerRow("SGLang", "token allocator alloc(1)+free(1)", "TokenToKVPoolAllocator", 21600.0),
    PeerRow("SGLang", "paged allocator alloc(16)+free(16)", "PagedTokenToKVPoolAllocator", 20000.0),
)
#: Peer side -> (its venv's folder under PEER_VENVS, its script).
PEERS = {"vLLM": ("vllm-venv", "vllm_ops.py"), "SGLang": ("sglang-venv", "sglang_ops.py")}


def peer_venvs() -> Path:
    """``$PEER_VENVS``, else ``$XDG_CACHE_HOME/kvpool-peers`` (``~/.cache/kvpool-peers``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpool-peers"
    return Path(os.environ.get("PEER_VENVS", default))


class Side:
    """One side's script, started once, timing a round per request (see the module docstring)."""

    def __init__(self, name: str, python: Path, script: str, repeat: int, env: dict[str, str] | None = None,
                 start: bool = True, argv: list[str] | None = None) -> None:
        """``argv``: the interpreter's arguments in place of ``script``'s path (whose folder, then, is not put
        on ``PYTHONPATH``; ``env`` may set it)."""
        self.name, self.error, self.version = name, "", ""
        self.rounds: list[dict[str, float]] = []
        self._proc: subprocess.Popen[str] | None = None
        if not python.exists():
            self.error = f"peer not installed (no {python}; benchmarks/peers/setup.sh builds it)"
            return
        if argv is None and not (SCRIPTS / script).exists():
            self.error = f"peer scripts not found ({SCRIPTS}: a source checkout's benchmarks/peers/)"
            return
        if not start:
            return
        path = os.environ.get("PYTHONPATH", "") if argv else os.pathsep.join(
            [str(SCRIPTS), os.environ.get("PYTHONPATH", "")])
        run_env = {**os.environ, "PEER_REPEAT": str(repeat), "PYTHONPATH": path, **(env or {})}
        command = [str(python), *(argv or [str(SCRIPTS / script)])]
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=run_env)

    @property
    def live(self) -> bool:
        return self._proc is not None and not self.error

    def round(self) -> None:
        """Time one round (appended to :attr:`rounds`); a failure is kept in :attr:`error`."""
        proc = self._proc
        if proc is None or self.error:
            return
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("round\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            result = json.loads(line)
        except (OSError, ValueError):
            self.error = f"peer failed: {_last_line(proc.stderr, proc)}"
            return
        self.version = result["version"]
        self.rounds.append(result["ns"])

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.communicate(input="", timeout=60)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
            self._proc = None


def _last_line(stream: IO[str] | None, proc: subprocess.Popen[str]) -> str:
    """The last line the side wrote on stderr before it ended (its error)."""
    try:
        proc.kill()
        rest = stream.read() if stream is not None else ""
    except (OSError, ValueError):
        rest = ""
    lines = [line for line in rest.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def alternate(sides: list[Side], rounds: int) -> None:
    """``rounds`` rounds, every live side once per round, in the order given (kvpool first)."""
    for _ in range(rounds):
        for side in sides:
            side.round()


def live_rows(rounds: int, repeat: int) -> list[dict[str, Any]]:
    """The peer rows of :data:`ROWS`, timed now: kvpool's side and each installed peer alternated
    ``rounds`` times (``repeat`` runs per operation and round, median), or, for a peer that is not there
    or fails, a row without a ratio."""
    venvs = peer_venvs()
    peers = {name: Side(name, venvs / venv / "bin" / "python", script, repeat, start=rounds > 0)
             for name, (venv, script) in PEERS.items()}
    kvpool = Side("kvpool", Path(sys.executable), "kvpool_ops.py", repeat,
                  start=any(p.live for p in peers.values()))
    sides = [kvpool, *peers.values()]
    try:
        alternate(sides, rounds)
    finally:
        for side in sides:
            side.close()
    return [_row(row, kvpool, peers[row.side], rounds) for row in ROWS]


def _row(row: PeerRow, kvpool: Side, peer: Side, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"peer": f"{row.side} {peer.version}".strip() + f" {row.what}", "op": row.op,
                           "peer_ns": None, "kvpool_ns": None, "peer_over_kvpool": None, "rounds": 0}
    problem = peer.error or kvpool.error or ("" if rounds else "not run (--peer-rounds 0)")
    paired = [(p[row.op], k[row.op]) for p, k in zip(peer.rounds, kvpool.rounds, strict=False)
              if row.op in p and row.op in k]
    if problem or not paired:
        out.update(status=problem or "peer gave no figure", stored_ns=row.stored_ns, stored_from=STORED_FROM)
        return out
    theirs, ours = [t for t, _ in paired], [o for _, o in paired]
    out.update(peer_ns=round(statistics.median(theirs), 1), kvpool_ns=round(statistics.median(ours), 1),
               peer_over_kvpool=round(statistics.median(t / o for t, o in paired), 2), rounds=len(paired),
               status="timed in this run")
    return out

"""kvpool's allocators beside vLLM's and SGLang's, the same operations timed in one run.

    benchmarks/peers/setup.sh          # once: the vLLM 0.33.0 and SGLang 0.5.23 venvs (minutes, ~4 GB)
    python3 benchmarks/peers/compare.py [--json] [--repeat R] [--rounds N]

Starts ``kvpool_ops.py`` with this interpreter (kvpool importable) twice, as installed (its hot path compiled
when the build runs) and with ``KVPOOL_PURE_PYTHON=1`` (interpreted), and ``vllm_ops.py`` / ``sglang_ops.py``
with the peers' venv interpreters, once each, then asks them for ``--rounds`` rounds in turn (each side
runs the loops of ``patterns.py`` once per round): the runner of ``kvpool bench alloc``'s peer rows
(``kvpool.bench.peers``), with the interpreted side added. It prints, per operation, each side's median over
the rounds and the median over the rounds of peer / kvpool (both kvpool sides). A missing venv is reported
and its rows left out. kvpool never imports vLLM or SGLang; nothing in kvpool's tests or CI runs this.

Environment: ``PEER_VENVS`` (default ``~/.cache/kvpool-peers``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from kvpool.bench.peers import PEERS, Side, alternate, peer_venvs


def comparison(sides: dict[str, Side]) -> list[dict]:
    """One row per (peer, operation) that the peer and both kvpool sides timed: medians over the rounds
    of each side's ns and of the per-round ratios peer / kvpool."""
    rows, ours, pure = [], sides["kvpool"], sides["kvpool interpreted"]
    for name in PEERS:
        peer = sides[name]
        for op in (peer.rounds[0] if peer.rounds else {}):
            rounds = zip(peer.rounds, ours.rounds, pure.rounds, strict=False)
            per = [(t[op], o[op], i[op]) for t, o, i in rounds if op in t and op in o and op in i]
            if not per:
                continue
            theirs, mine, interp = zip(*per, strict=True)
            rows.append({"peer": f"{name} {peer.version}", "operation": op, "rounds": len(per),
                         "peer_ns": statistics.median(theirs), "kvpool_ns": statistics.median(mine),
                         "kvpool_interpreted_ns": statistics.median(interp),
                         "peer_over_kvpool": statistics.median(t / o for t, o, _ in per),
                         "peer_over_kvpool_interpreted": statistics.median(t / i for t, _, i in per)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvpool's allocators beside vLLM's and SGLang's.")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs per operation and round (median; default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, every side once per round (default 3)")
    args = parser.parse_args(argv)
    venvs, here = peer_venvs(), Path(sys.executable)
    sides = {"kvpool": Side("kvpool", here, "kvpool_ops.py", args.repeat),
             "kvpool interpreted": Side("kvpool", here, "kvpool_ops.py", args.repeat,
                                        env={"KVPOOL_PURE_PYTHON": "1"}),
             **{name: Side(name, venvs / venv / "bin" / "python", script, args.repeat)
                for name, (venv, script) in PEERS.items()}}
    try:
        alternate(list(sides.values()), max(1, args.rounds))
    finally:
        for side in sides.values():
            side.close()
    for name, side in sides.items():
        if side.error:
            print(f"{name}: {side.error}: skipped", file=sys.stderr)
    if not sides["kvpool"].rounds or not sides["kvpool interpreted"].rounds:
        print("kvpool's own side failed: is kvpool importable by this python?", file=sys.stderr)
        return 2
    rows = comparison(sides)
    if args.json:
        timings = {name: s.rounds for name, s in sides.items()}
        print(json.dumps({"rounds": timings, "comparison": rows}, indent=2))
        return 0
    print(f"medians of {max(1, args.rounds)} round(s), the sides alternated")
    print(f"{'peer':<16}{'operation (same run, same pattern)':<42}{'peer ns':>10}{'kvpool ns':>11}"
          f"{'peer/kvpool':>13}{'interpreted ns':>16}{'peer/interp.':>14}")
    for r in rows:
        print(f"{r['peer']:<16}{r['operation']:<42}{r['peer_ns']:>10,.0f}{r['kvpool_ns']:>11,.0f}"
              f"{r['peer_over_kvpool']:>12.2f}x{r['kvpool_interpreted_ns']:>16,.0f}"
              f"{r['peer_over_kvpool_interpreted']:>13.2f}x")
    if not rows:
        print("no peer venv found: nothing to compare (benchmarks/peers/setup.sh builds them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""kvpool's allocators beside vLLM's and SGLang's, the same operations timed in one run.

    benchmarks/peers/setup.sh          # once: the vLLM 0.33.0 and SGLang 0.5.23 venvs (minutes, ~4 GB)
    python3 benchmarks/peers/compare.py [--json] [--repeat R] [--rounds N]

Runs ``kvpool_ops.py`` with this interpreter (kvpool importable) twice, as installed (its hot path compiled
when the build runs) and with ``KVPOOL_PURE_PYTHON=1`` (interpreted), and ``vllm_ops.py`` /
``sglang_ops.py`` with the peers' venv interpreters, one after the other, all on the patterns of
``patterns.py``; ``--rounds N`` repeats that sequence N times. It prints, per operation, each side's median
over the rounds and the median over the rounds of peer / kvpool (both kvpool sides), so each ratio comes
from timings taken minutes apart at most. A missing venv is reported and its rows left out. kvpool never
imports vLLM or SGLang; nothing in kvpool's tests or CI runs this.

Environment: ``PEER_VENVS`` (default ``~/.cache/kvpool-peers``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENVS = Path(os.environ.get("PEER_VENVS", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                            / "kvpool-peers"))
SIDES = {"kvpool": (Path(sys.executable), "kvpool_ops.py"),
         "kvpool interpreted": (Path(sys.executable), "kvpool_ops.py"),
         "vLLM": (VENVS / "vllm-venv" / "bin" / "python", "vllm_ops.py"),
         "SGLang": (VENVS / "sglang-venv" / "bin" / "python", "sglang_ops.py")}


def run_side(name: str, repeat: int) -> dict | None:
    """The side's JSON line, or None (with a note on stderr) when its venv is missing or it fails."""
    python, script = SIDES[name]
    if not python.exists():
        print(f"{name}: no {python} (run benchmarks/peers/setup.sh): skipped", file=sys.stderr)
        return None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "PEER_REPEAT": str(repeat)}
    if name == "kvpool interpreted":
        env["KVPOOL_PURE_PYTHON"] = "1"
    print(f"{name}: timing ({script}) ...", file=sys.stderr)
    done = subprocess.run([str(python), str(HERE / script)], capture_output=True, text=True, env=env,
                          timeout=1800)
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        print(f"{name}: failed ({tail[0]}): skipped", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def comparison(rounds: list[dict[str, dict]]) -> list[dict]:
    """One row per (peer, operation) that the peer and both kvpool sides timed: medians over the rounds
    of each side's ns and of the per-round ratios peer / kvpool."""
    rows = []
    first = rounds[0]
    for name, result in first.items():
        if name.startswith("kvpool"):
            continue
        for op in result["ns"]:
            per = [r for r in rounds if name in r and op in r["kvpool"]["ns"]
                   and op in r.get("kvpool interpreted", {}).get("ns", {})]
            if not per:
                continue
            theirs = [r[name]["ns"][op] for r in per]
            ours = [r["kvpool"]["ns"][op] for r in per]
            pure = [r["kvpool interpreted"]["ns"][op] for r in per]
            rows.append({"peer": f"{name} {result['version']}", "operation": op, "rounds": len(per),
                         "peer_ns": statistics.median(theirs), "kvpool_ns": statistics.median(ours),
                         "kvpool_interpreted_ns": statistics.median(pure),
                         "peer_over_kvpool": _median_ratio(theirs, ours),
                         "peer_over_kvpool_interpreted": _median_ratio(theirs, pure)})
    return rows


def _median_ratio(theirs: list[float], ours: list[float]) -> float:
    return statistics.median(t / o for t, o in zip(theirs, ours, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvpool's allocators beside vLLM's and SGLang's.")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=5, help="runs per operation (median; default 5)")
    parser.add_argument("--rounds", type=int, default=1, help="times every side runs, in turn (default 1)")
    args = parser.parse_args(argv)
    rounds = []
    for _ in range(max(1, args.rounds)):
        results = {name: r for name in SIDES if (r := run_side(name, args.repeat)) is not None}
        if "kvpool" not in results or "kvpool interpreted" not in results:
            print("kvpool's own side failed: is kvpool importable by this python?", file=sys.stderr)
            return 2
        rounds.append(results)
    rows = comparison(rounds)
    if args.json:
        print(json.dumps({"rounds": rounds, "comparison": rows}, indent=2))
        return 0
    print(f"kvpool: {rounds[0]['kvpool']['hot_path']}; medians of {len(rounds)} round(s)")
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

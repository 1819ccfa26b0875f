"""kvpool's allocators beside vLLM's and SGLang's, the same operations timed in one run.

    benchmarks/peers/setup.sh          # once: the vLLM 0.33.0 and SGLang 0.5.23 venvs (minutes, ~4 GB)
    python3 benchmarks/peers/compare.py [--json] [--repeat R]

Runs ``kvpool_ops.py`` with this interpreter (kvpool importable) and ``vllm_ops.py`` / ``sglang_ops.py``
with the peers' venv interpreters, one after the other in this one run, all on the patterns of
``patterns.py``, then prints peer / kvpool per operation. A missing venv is reported and its rows left
out. kvpool never imports vLLM or SGLang; nothing in kvpool's tests or CI runs this.

Environment: ``PEER_VENVS`` (default ``~/.cache/kvpool-peers``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENVS = Path(os.environ.get("PEER_VENVS", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                            / "kvpool-peers"))
SIDES = {"kvpool": (Path(sys.executable), "kvpool_ops.py"),
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
    print(f"{name}: timing ({script}) ...", file=sys.stderr)
    done = subprocess.run([str(python), str(HERE / script)], capture_output=True, text=True, env=env,
                          timeout=1800)
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        print(f"{name}: failed ({tail[0]}): skipped", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def comparison(results: dict[str, dict]) -> list[dict]:
    """One row per (peer, operation) that both the peer and kvpool timed."""
    ours = results["kvpool"]["ns"]
    rows = []
    for name, result in results.items():
        if name == "kvpool":
            continue
        for op, theirs in result["ns"].items():
            if op in ours:
                rows.append({"peer": f"{name} {result['version']}", "operation": op, "peer_ns": theirs,
                             "kvpool_ns": ours[op], "peer_over_kvpool": theirs / ours[op]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvpool's allocators beside vLLM's and SGLang's.")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=5, help="runs per operation (median; default 5)")
    args = parser.parse_args(argv)
    results = {name: r for name in SIDES if (r := run_side(name, args.repeat)) is not None}
    if "kvpool" not in results:
        print("kvpool's own side failed: is kvpool importable by this python?", file=sys.stderr)
        return 2
    rows = comparison(results)
    if args.json:
        print(json.dumps({"results": results, "comparison": rows}, indent=2))
        return 0
    print(f"{'peer':<16}{'operation (same run, same pattern)':<42}{'peer ns':>10}{'kvpool ns':>11}"
          f"{'peer/kvpool':>13}")
    for r in rows:
        print(f"{r['peer']:<16}{r['operation']:<42}{r['peer_ns']:>10,.0f}{r['kvpool_ns']:>11,.0f}"
              f"{r['peer_over_kvpool']:>12.2f}x")
    if not rows:
        print("no peer venv found: nothing to compare (benchmarks/peers/setup.sh builds them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

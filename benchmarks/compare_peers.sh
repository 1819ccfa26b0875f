#!/usr/bin/env bash
# kvpool's allocators beside vLLM's BlockPool and SGLang's TokenToKVPoolAllocator, timed in the same run.
#
# Runs ../shared/peer-bench/{vllm_block_pool,sglang_token_alloc}.py with the peer venvs when they exist
# (build them with ../shared/peer-bench/setup-peer-venvs.sh: minutes, ~4 GB), and `kvpool bench alloc --json`
# with the same op patterns (32,768 blocks; 2,048 x alloc(1) at 65,536 slots), then prints peer / kvpool.
# A missing peer venv is reported and skipped. Never needed by the tests or CI.
#
# Environment: PYTHON (default python3), PEER_BENCH (peer scripts folder), PEER_VENVS (venv cache folder).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEER_BENCH=${PEER_BENCH:-$ROOT/../shared/peer-bench}
PEER_VENVS=${PEER_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool-peers}
PYTHON=${PYTHON:-python3}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

peer() {  # peer NAME VENV SCRIPT: stdout of the peer script into $OUT/NAME, or a note
  local py=$PEER_VENVS/$2/bin/python
  if [[ -x $py && -f $PEER_BENCH/$3 ]]; then
    echo "running $1 ($3)..." >&2
    (cd "$PEER_BENCH" && "$py" "$3" 2>/dev/null | tail -1) > "$OUT/$1" || echo "$1 failed" >&2
  else
    echo "skipping $1: no $py or $PEER_BENCH/$3 (see $PEER_BENCH/README.md)" >&2
  fi
}

peer vllm vllm-venv vllm_block_pool.py
peer sglang sglang-venv sglang_token_alloc.py
echo "running kvpool bench alloc..." >&2
(cd "$ROOT" && "$PYTHON" -m kvpool bench alloc --json --sizes 32768 65536) > "$OUT/kvpool.json"

"$PYTHON" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {(r["op"], r["pool_blocks"]): r.get("kvpool_ns") for r in json.loads((out / "kvpool.json").read_text())["rows"]}
def read(name):
    path = out / name
    return [float(x) for x in path.read_text().split()] if path.exists() and path.read_text().strip() else None
pairs = []
if (v := read("vllm")):
    pairs += [("vLLM BlockPool allocate(1)+free, ns/block", v[0], rows[("allocate(1)+free", 32768)]),
              ("vLLM BlockPool allocate(256)+free, ns/block", v[1], rows[("allocate(256)+free", 32768)])]
if (s := read("sglang")):
    pairs += [("SGLang TokenToKVPoolAllocator alloc(1)+free(1), ns/pair", s[0],
               rows.get(("token alloc(1)+free(1)", 65536)))]
print(f"{'operation (same run)':<58}{'peer':>10}{'kvpool':>10}{'peer/kvpool':>13}")
for name, theirs, ours in pairs:
    ratio = f"{theirs / ours:.2f}x" if ours else "n/a"
    print(f"{name:<58}{theirs:>10,.0f}{(ours or float('nan')):>10,.0f}{ratio:>13}")
if not pairs:
    print("no peer venv found: nothing to compare (kvpool's own numbers: kvpool bench alloc)")
PY

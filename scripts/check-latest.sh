#!/usr/bin/env bash
# Today's releases, checked: a second venv, in a temporary folder, with the newest releases kvpool's extras
# admit (scripts/setup.sh without the lock; torch alone pinned, to the CPU wheel 2.13.0: any other torch
# request takes a multi-GB CUDA build), the versions it got beside the lock's, then the tests that build on
# other projects' interfaces: every test file that imports transformers, gguf, redis-py, msgspec, pyzmq or
# prometheus-client, or kvpool's layer over transformers (kvpool.engine), with their slow
# tests (the engine on real weights, token for token against transformers' own generation).
#
#   bash scripts/check-latest.sh            the above (~15 minutes on 2 idle cores)
#   bash scripts/check-latest.sh --peers    also the vLLM and SGLang plug-ins' conformance, each in its
#                                           release's venv (tests/integrations/run.sh vllm-latest sglang:
#                                           ~+30 minutes, several GB of venvs); KVPOOL_CHECK_PEERS=1 is the same
#
# Exit status 0 when every test passed, 1 when one failed, 2 for a bad argument. CI (.ci/run) runs it as a
# step that reports and does not gate.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PEERS=${KVPOOL_CHECK_PEERS:-0}
for arg in "$@"; do
    case $arg in
        --peers) PEERS=1 ;;
        *) echo "check-latest: unknown argument $arg (usage: scripts/check-latest.sh [--peers])" >&2; exit 2 ;;
    esac
done
say() { printf 'check-latest: %s\n' "$*"; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvpool-latest.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say "a venv with today's newest releases the extras admit ($WORK/venv)"
"${PYTHON:-python3}" -m venv "$WORK/venv"
# shellcheck disable=SC1091  # from here on `python3`, `kvpool` and the venv's ninja are the new venv's
. "$WORK/venv/bin/activate"
echo "torch==2.13.0" > "$WORK/constraints.txt"
# The interpreted hot path (nothing to compile, and a build of this tree by another venv is not used): the
# interfaces under test are other projects'.
export KVPOOL_PURE_PYTHON=1
KVPOOL_CONSTRAINTS=$WORK/constraints.txt KVPOOL_COMPILE=0 PYTHON=python3 bash scripts/setup.sh

say "the venv took $SECONDS s; the versions it got (* newer than requirements/lock.txt, < older, + not in the lock):"
python3 - requirements/lock.txt "$WORK/same-as-lock" <<'EOF'
import importlib.metadata as md
import re
import sys

from packaging.version import Version

locked = dict(m.groups() for m in re.finditer(r"^([A-Za-z0-9._-]+)==(\S+)", open(sys.argv[1]).read(), re.M))
locked = {re.sub(r"[-_.]+", "-", k).lower(): v for k, v in locked.items()}
changed = []
for dist in sorted(md.distributions(), key=lambda d: d.metadata["Name"].lower()):
    name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    if name in ("kvpool", "pip", "setuptools"):
        continue
    have, lock = dist.version, locked.get(name)
    mark = "+" if lock is None else "*" if Version(have) > Version(lock) else "<" if Version(have) < Version(lock) else " "
    if mark != " ":
        changed.append(f"{name} {have}" + (f" (lock {lock})" if lock else ""))
    print(f"  {mark} {name} {have}" + (f" (lock {lock})" if mark in "*<" else ""))
print("check-latest: differs from the lock: " + (", ".join(changed) or "nothing (the lock is today's newest)"))
if not changed:
    open(sys.argv[2], "w").write("same")
EOF

# The test files on other projects' interfaces, found by what they import (a new such file is included).
# The benchmarks' tests (test_bench.py) time kvpool, not an interface: left out (they were half of the time).
mapfile -t TESTS < <(grep -l -E "^\s*(import|from) (transformers|gguf|redis|msgspec|zmq|prometheus_client)\b|importorskip\(\"(transformers|gguf|redis|msgspec|zmq|prometheus_client)\"|kvpool\.engine\b" tests/test_*.py | grep -v -x tests/test_bench.py)
status=0 start=$SECONDS
if [[ -f $WORK/same-as-lock && ${KVPOOL_LOCK_TESTED:-0} == 1 ]]; then
    # CI sets KVPOOL_LOCK_TESTED=1 after its gating steps passed on the lock's versions: these are the same.
    say "not run again: the interface tests (today's releases are the lock's, which this run's tests passed on)"
else
    say "the interface tests: ${TESTS[*]}"
    python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" "${TESTS[@]}" || status=1
    say "the interface tests took $((SECONDS - start)) s"
fi

if ((PEERS)); then
    if grep -q "vllm-latest" tests/integrations/run.sh; then
        say "the plug-ins' conformance: tests/integrations/run.sh vllm-latest sglang"
        bash tests/integrations/run.sh vllm-latest sglang || status=1
    else
        say "NOT CHECKED: vLLM's newest release (tests/integrations/run.sh has no vllm-latest peer yet); the"
        say "plug-ins' conformance on the releases the extras pin: tests/integrations/run.sh vllm sglang"
        bash tests/integrations/run.sh vllm sglang || status=1
    fi
else
    say "not run: the vLLM / SGLang plug-ins' conformance (scripts/check-latest.sh --peers runs it)"
fi
if ((status == 0)); then say "passed on today's releases ($SECONDS s)"; else say "FAILED on today's releases (above; $SECONDS s)"; fi
exit "$status"

#!/usr/bin/env bash
# Conformance of kvpool's integrations against the real releases (vLLM 0.33.0, SGLang 0.5.23) on CPU, each in
# its own venv (benchmarks/peers/setup.sh builds them, with what these tests import): the vLLM tests in the
# vLLM venv, the SGLang tests and the HiCache throughput table in the SGLang venv, kvpool from this tree.
#   tests/integrations/run.sh [vllm|sglang ...]        (both by default; ~15 minutes on 2 cores)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENVS=${PEER_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool-peers}
export PYTHONPATH="$ROOT:$ROOT/tests:$ROOT/tests/integrations${PYTHONPATH:+:$PYTHONPATH}"
# The plug-ins' disk and Redis values are authenticated under the fleet's secret, read from the environment.
export KVPOOL_TIER_KEY=${KVPOOL_TIER_KEY:-conformance-tests-fleet-secret}
bash "$ROOT/benchmarks/peers/setup.sh" "$@"
for peer in "${@:-vllm sglang}"; do
  for p in $peer; do
    py=$VENVS/$p-venv/bin/python
    cd "$ROOT"
    case $p in
      vllm) "$py" -m pytest -q -s -p no:cacheprovider tests/integrations/test_vllm_policies.py \
              tests/integrations/test_vllm_tier.py ;;
      sglang) "$py" -m pytest -q -s -p no:cacheprovider tests/integrations/test_sglang_storage.py
              "$py" tests/integrations/hicache_throughput.py ;;
    esac
  done
done

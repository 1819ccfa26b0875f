#!/usr/bin/env bash
# Conformance of kvpool's integrations against the real releases on CPU, each in its own venv
# (benchmarks/peers/setup.sh builds them, with what these tests import), kvpool from this tree:
#   vllm         the vLLM tests in vLLM 0.33.0's venv
#   vllm-0.34    the same tests in vLLM 0.34.0's
#   vllm-latest  the same tests with the newest vLLM on the package index (scripts/check-latest.sh)
#   sglang       the SGLang tests and the HiCache throughput table in SGLang 0.5.23's venv
#   tests/integrations/run.sh [vllm|vllm-0.34|vllm-latest|sglang ...]   (vllm, vllm-0.34 and sglang by
#   default; ~8 minutes a vLLM release and ~7 for SGLang on 2 cores, plus ~5 a venv to build)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENVS=${PEER_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool-peers}
export PYTHONPATH="$ROOT:$ROOT/tests:$ROOT/tests/integrations${PYTHONPATH:+:$PYTHONPATH}"
# The plug-ins' disk and Redis values are authenticated under the fleet's secret, read from the environment.
export KVPOOL_TIER_KEY=${KVPOOL_TIER_KEY:-conformance-tests-fleet-secret}
peers=("${@:-vllm vllm-0.34 sglang}")
# shellcheck disable=SC2068
bash "$ROOT/benchmarks/peers/setup.sh" ${peers[@]}
# shellcheck disable=SC2068
for p in ${peers[@]}; do
  py=$VENVS/$p-venv/bin/python
  cd "$ROOT"
  case $p in
    vllm|vllm-*) echo "== $p: vLLM $("$py" -c 'import importlib.metadata as m; print(m.version("vllm"))')"
                 "$py" -m pytest -q -s -p no:cacheprovider tests/integrations/test_vllm_policies.py \
                   tests/integrations/test_vllm_tier.py ;;
    sglang) "$py" -m pytest -q -s -p no:cacheprovider tests/integrations/test_sglang_storage.py \
              tests/integrations/test_sglang_tlru.py
            "$py" tests/integrations/hicache_throughput.py ;;
    *) echo "unknown peer $p (vllm, vllm-0.34, vllm-latest or sglang)" >&2; exit 2 ;;
  esac
done

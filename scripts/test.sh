#!/usr/bin/env bash
# Install everything from scratch into .venv, lint, type-check, then run the whole test suite (slow tests included).
#   bash scripts/test.sh            # what CI runs
#   bash scripts/test.sh -m "not slow"   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0   # the CPU build first, so no dependency pulls a CUDA build
python -m pip install -q -e ".[test]"
ruff check src tests scripts benchmarks
mypy
python -m pytest "$@"

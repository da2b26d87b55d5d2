#!/usr/bin/env bash
# Install everything from scratch into .venv, lint, type-check, then run the whole test suite (slow tests included).
#   bash scripts/test.sh            # what CI runs
#   bash scripts/test.sh -m "not slow"   # extra arguments go to pytest (-n 0: one process)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0   # the CPU build first, so no dependency pulls a CUDA build
python -m pip install -q -e ".[test]"
# Made in the background on the second core while lint and the type check (about 50 s, one core) run:
# - Triton apart from the suite's environment (the CPU torch has none): tests/quantize/test_fp8_gemv.py runs the
#   fp8 kernel under Triton's interpreter in a process of its own with .triton/ on its path;
# - Optimum's own environment, a test peer (exporter.testing.optimum_peer; about 50 s to make, which the first
#   test that asked for it used to spend). Where it cannot be made, those tests skip and say why.
python -m pip install -q --no-deps --upgrade --target .triton triton==3.9.0 &
triton=$!
python -c 'from exporter.testing.optimum_peer import optimum_cli; print(optimum_cli()[1] or "Optimum: ready")' &
optimum=$!
ruff check src tests scripts benchmarks
mypy
wait "$triton"
wait "$optimum" || echo "Optimum's environment: not made (its tests will say why)"
# two workers, one test file each at a time (a file's fixtures are built once): the tests wait on child processes
# and compilers as much as they compute, so two share the 2-core CI machine well
python -m pytest -n 2 --dist loadfile --durations=25 "$@"

#!/usr/bin/env bash
# Sets up .venv, lints (ruff, and pyright where Node.js is present), then runs the whole
# test suite on 8 host devices and again on 1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/python -m ruff check jmirror tests benchmarks
.venv/bin/python -m ruff format --check jmirror tests benchmarks notebooks
if command -v node >/dev/null 2>&1; then  # pyright runs on Node.js; skipped where there is none
  .venv/bin/pyright jmirror
fi
JMIRROR_TEST_DEVICES=8 .venv/bin/python -m pytest -q "$@"
JMIRROR_TEST_DEVICES=1 .venv/bin/python -m pytest -q "$@"

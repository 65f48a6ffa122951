#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite on 8 host devices, then again on 1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
JMIRROR_TEST_DEVICES=8 .venv/bin/python -m pytest -q "$@"
JMIRROR_TEST_DEVICES=1 .venv/bin/python -m pytest -q "$@"

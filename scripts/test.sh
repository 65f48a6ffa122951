#!/usr/bin/env bash
# Sets up .venv, lints (ruff, and pyright where Node.js is present), then runs the whole
# test suite on 8 host devices and on 1. The two passes run side by side: the 8-device pass
# spends much of its time waiting on the processes its tests start (launcher, timeouts,
# preemption), which only it runs; the 1-device pass, at a lower priority (nice), compiles in
# those gaps, so the timing of the processes the 8-device pass starts is left alone. The
# 1-device pass's output follows the 8-device pass's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/python -m ruff check jmirror tests benchmarks
.venv/bin/python -m ruff format --check jmirror tests benchmarks notebooks
if command -v node >/dev/null 2>&1; then  # pyright runs on Node.js; skipped where there is none
  .venv/bin/pyright jmirror
fi
one_device_log="$(mktemp)"
JMIRROR_TEST_DEVICES=1 nice -n 10 .venv/bin/python -m pytest -q -p no:cacheprovider "$@" \
  >"$one_device_log" 2>&1 &
one_device=$!
trap 'kill "$one_device" 2>/dev/null || true; rm -f "$one_device_log"' EXIT
status=0
echo "--- the test suite on 8 host devices ---"
JMIRROR_TEST_DEVICES=8 .venv/bin/python -m pytest -q -p no:cacheprovider "$@" || status=$?
wait "$one_device" || status=$?
echo "--- the test suite on 1 host device ---"
cat "$one_device_log"
exit "$status"

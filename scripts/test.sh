#!/usr/bin/env bash
# Sets up .venv, lints (ruff, and pyright where Node.js is present), then runs the whole
# test suite on 8 host devices and on 1.
#
# The suite runs as three pytest sessions side by side, each in its own temporary directory:
# - the tests that start processes (the launcher, timeouts, preemption, several processes),
#   on 8 devices: they spend most of their time waiting on those processes, and run once;
# - every other test on 8 devices;
# - the whole suite on 1 device, at a lower priority (nice), so that it computes in the
#   others' gaps and leaves the timing of the processes alone (the process tests skip there).
# Each session's output is printed when all have finished. Arguments go to pytest; with
# arguments the two device passes run side by side over what they select.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/python -m ruff check jmirror tests benchmarks
.venv/bin/python -m ruff format --check jmirror tests benchmarks notebooks
if command -v node >/dev/null 2>&1; then  # pyright runs on Node.js; skipped where there is none
  .venv/bin/pyright jmirror
fi

# The suite's programs are small and run briefly: XLA compiles them without LLVM's optimization
# passes, which took about a fifth of the suite's CPU time (every process the tests start
# inherits the flag; jmirror's benchmarks and users' programs are compiled as usual).
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0"

PROCESS_TESTS=(
  tests/test_timeouts.py tests/test_preemption.py tests/test_launch.py
  tests/test_launch_restarts.py tests/test_distributed.py tests/test_multi_worker.py
  tests/test_checkpoint_processes.py tests/test_input_processes.py tests/test_resume.py
  tests/test_two_hosts.py tests/test_launch_elastic.py tests/test_input_local.py
  tests/test_launchers.py tests/test_launch_cache.py
)
# A session still running after this long is stopped (its log says where it was: pytest's
# faulthandler_timeout prints every thread's stack of a test that runs past 7 minutes).
SESSION_LIMIT_S="${SESSION_LIMIT_S:-3000}"
work="$(mktemp -d)"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"' EXIT

session() {  # session NAME DEVICES [nice] -- PYTEST ARGS...: runs in the background
  local name="$1" devices="$2"
  shift 2
  local prefix=()
  if [[ "$1" == nice ]]; then
    prefix=(nice -n 10)
    shift
  fi
  shift  # --
  local dir="$work/${#pids[@]}"
  mkdir -p "$dir"
  JMIRROR_TEST_DEVICES="$devices" "${prefix[@]}" timeout -k 30 "$SESSION_LIMIT_S" \
    .venv/bin/python -m pytest -q \
    -p no:cacheprovider --basetemp "$dir/tmp" "$@" >"$dir/log" 2>&1 &
  pids+=("$!")
  names+=("$name")
}

names=()
if (($#)); then
  session "8 host devices" 8 -- "$@"
  session "1 host device" 1 nice -- "$@"
else
  ignore=()
  for f in "${PROCESS_TESTS[@]}"; do ignore+=("--ignore=$f"); done
  session "8 host devices: tests that start processes" 8 -- "${PROCESS_TESTS[@]}"
  session "8 host devices: the other tests" 8 -- "${ignore[@]}"
  session "1 host device" 1 nice --
fi

status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || {
    status=$?
    if ((status == 124 || status == 137)); then
      echo "--- ${names[$i]}: stopped after ${SESSION_LIMIT_S} s ---" >>"$work/$i/log"
    fi
  }
done
pids=()  # all waited for: nothing for the exit trap to kill
for i in "${!names[@]}"; do
  echo "--- the test suite on ${names[$i]} ---"
  cat "$work/$i/log"
done
exit "$status"

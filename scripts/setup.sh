#!/usr/bin/env bash
# Creates .venv under the repository (once) and installs jmirror with the given extras.
# Quiet when there is nothing to do. Otherwise it prints one line, sends what venv and pip
# print to .venv/setup.log, and shows that log only when a command fails (with its exit code).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
stamp=".venv/.jmirror-installed-${extras//,/-}"
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
  exit 0
fi

if [ -x .venv/bin/python ]; then
  echo "updating .venv (jmirror[${extras}]; log in .venv/setup.log)..." >&2
else
  echo "setting up .venv (first run only, a few minutes; log in .venv/setup.log)..." >&2
fi
mkdir -p .venv
log=.venv/setup.log
: >"$log"

quietly() {
  local rc=0
  echo "\$ $*" >>"$log"
  "$@" >>"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    cat "$log" >&2
    echo "scripts/setup.sh: '$*' failed with exit code $rc (output above, kept in $log)" >&2
    exit "$rc"
  fi
}

if [ ! -x .venv/bin/python ]; then
  quietly python3 -m venv .venv
fi
quietly .venv/bin/python -m pip install --upgrade pip
quietly .venv/bin/python -m pip install -e ".[${extras}]"
touch "$stamp"

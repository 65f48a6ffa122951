#!/usr/bin/env bash
# Creates .venv under the repository (once) and installs jmirror with the given extras.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=".venv/.jmirror-installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[${extras}]"
  touch "$stamp"
fi

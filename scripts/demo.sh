#!/usr/bin/env bash
# Sets up .venv and runs the main demo: data-parallel training on 8 simulated devices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh examples
exec .venv/bin/python -m jmirror.demo --devices 8 "$@"

#!/usr/bin/env bash
# The whole test suite, set-up included: `bash scripts/test.sh [pytest args]`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d tests/e2e ]; then bash scripts/setup.sh --browser; else bash scripts/setup.sh; fi
exec .venv/bin/python -m pytest "$@"
